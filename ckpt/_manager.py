"""CheckpointManager: one checkpoint per training step in a directory, saved in the background,
with retention, resume and crash safety.

Every step is a plain checkpoint at ``<directory>/step_<8+ digits>`` that ``ckpt.restore`` and
``ckpt.metadata`` open directly; the directory may be any location (docs/storage.md). A step is
committed once its manifest exists (formats/SPEC.md sections 9-10), so ``all_steps()`` lists the
directory and checks for manifests; ``.tmp-`` directories (local disk) and step prefixes without
a manifest (elsewhere) are saves in progress, saves that never committed, or steps half-deleted.

Opening a manager, listing, restoring and reading metadata never change the directory: another
process may be saving there. Only a manager that saves (process 0) deletes anything: it claims
the directory (``Storage.lock_saves``: a second saving manager gets a CheckpointError naming the
first), and after each commit removes old steps under its retention policy and the leftovers of
saves that provably died (``Storage.leftovers``), never a save in progress.

Multi-process jobs: every process creates a manager on the same shared directory and calls the
same methods in the same order. Decisions every process must agree on (``should_save``, whether
``save`` starts a save, when a background failure is raised) depend only on that call sequence
and on the directory as it was when the manager opened, never on timing. Only process 0
deletes: old steps after each commit and leftovers of dead saves.
"""

from __future__ import annotations

import contextlib
import errno
import operator
import threading
import warnings
from typing import Any, Iterator

import jax
import msgpack

from ckpt._commit import read_manifest
from ckpt._errors import CheckpointError
from ckpt._options import Options, resolve
from ckpt._restore import restore as _restore
from ckpt._save import SaveHandle, start_save
from ckpt._steps import scan_steps, step_dir_name
from ckpt.storage import MANIFEST_NAME, Storage, is_temp_name, open_storage
from ckpt.storage._base import NotDurableError, SaveLock

# Metadata travels inside the manifest, which every restore reads whole.
METADATA_LIMIT_BYTES = 1 << 20


def steps_to_delete(committed: list[int], max_to_keep: int | None, keep_every_n_steps: int | None) -> list[int]:
    """The committed steps retention removes: all but the newest `max_to_keep` and the
    multiples of `keep_every_n_steps`. The newest step is always kept."""
    if max_to_keep is None or not committed:
        return []
    ordered = sorted(set(committed))
    keep = set(ordered[-max(max_to_keep, 1):])
    if keep_every_n_steps:
        keep.update(s for s in ordered if s % keep_every_n_steps == 0)
    return [s for s in ordered if s not in keep]


def _check_count(name: str, value: int | None, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}")
    return value


def _as_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError(f"step must be an integer, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def _snapshot_metadata(step: int, metadata: dict | None) -> dict | None:
    """A private copy of `metadata` as it will be stored, or a clear error naming the key."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata for step {step} must be a dict, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise CheckpointError(f"metadata for step {step}: key {key!r} is not a string")
        try:
            msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise CheckpointError(
                f"metadata for step {step}: value of {key!r} ({type(value).__name__}) cannot be stored: {e}; "
                "use None, bool, int, float, str, bytes, lists and dicts (convert numpy/jax scalars with float() or int())"
            ) from None
    packed = msgpack.packb(metadata, use_bin_type=True)
    if len(packed) > METADATA_LIMIT_BYTES:
        raise CheckpointError(
            f"metadata for step {step} is {len(packed)} bytes; the limit is {METADATA_LIMIT_BYTES}: "
            "save large values as leaves of the tree instead"
        )
    return msgpack.unpackb(packed, raw=False, strict_map_key=False)


class _Pending:
    """A save this manager started; a finisher thread records its outcome."""

    def __init__(self, step: int, path: str, handle: SaveHandle) -> None:
        self.step, self.path, self.handle = step, path, handle
        self.finished = threading.Event()
        self.error: BaseException | None = None


class CheckpointManager:
    """Saves a training run's steps under `directory`, each a checkpoint of its own
    (``step_<8+ digits>``), in the background, and deletes old ones.

    Opening a manager reads the directory and changes nothing in it (another process may be
    saving there). Its first save claims the directory: a second manager saving to it gets a
    CheckpointError naming the first. After each commit, process 0 removes old steps
    (retention) and the leftovers of saves that provably died, never a save in progress. One
    manager per directory per job; its methods are meant to be called from one thread. Use it
    as a context manager, or call ``close()``.

    Args:
        directory (str | os.PathLike): any location ``ckpt.save`` accepts (a local path,
            ``s3://``, ``gs://``...); created by the first save if missing.
        max_to_keep: after each commit, keep only the newest this many steps, plus every step
            divisible by `keep_every_n_steps`; None keeps all. The newest committed step is
            never deleted, and deletion runs in the background.
        keep_every_n_steps: also keep every step divisible by this.
        save_interval_steps: ``should_save(step)`` is True for multiples of it.
        async_save: ``save`` returns once the state is copied to host memory (the arrays may then
            be donated); with False it returns once the step is committed.
        options: engine, concurrency and memory settings for every save and restore
            (``ckpt.Options``), read once, now.

    Raises:
        ValueError: a count is not a positive integer, or an option is invalid.
        TypeError: `options` is not a ``ckpt.Options``.
        OSError: the storage failed.
    """

    def __init__(self, directory, *, max_to_keep: int | None = None, keep_every_n_steps: int | None = None,
                 save_interval_steps: int = 1, async_save: bool = True, options: Options | None = None) -> None:
        self.options = resolve(options)
        self.storage: Storage = open_storage(directory, self.options)
        self.directory = self.storage.url
        self.max_to_keep = _check_count("max_to_keep", max_to_keep, optional=True)
        self.keep_every_n_steps = _check_count("keep_every_n_steps", keep_every_n_steps, optional=True)
        self.save_interval_steps = _check_count("save_interval_steps", save_interval_steps, optional=False)
        self.async_save = bool(async_save)
        self._deletes = jax.process_index() == 0
        self._saver_lock: SaveLock | None = None  # taken by the first save (process 0)
        self._closed = False
        self._pending: _Pending | None = None
        self._threads: list[threading.Thread] = []
        self._background_lock = threading.Lock()  # one deleter at a time
        self._pin_lock = threading.Lock()
        self._pinned: dict[int, int] = {}  # step -> restores/metadata reads in progress
        self._deleting: set[int] = set()  # steps retention is deleting now
        entries = scan_steps(self.storage)
        # Steps saved, or being saved, as far as this manager knows. Deliberately not re-listed
        # later: every process of a job must make the same decisions.
        self._known_steps = {e.step for e in entries if e.committed}
        self._last_step = max(self._known_steps, default=None)

    # ---- queries -------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The committed steps, listed from storage now.

        Returns:
            The step numbers whose manifest exists, sorted.
        """
        return [e.step for e in scan_steps(self.storage) if e.committed]

    def latest_step(self) -> int | None:
        """The newest committed step.

        Returns:
            The largest committed step number, or None when there is none.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save.

        Args:
            step: the training step, an integer >= 0.

        Returns:
            True when `step` is a multiple of save_interval_steps and newer than every step
            already saved (or being saved) here.

        Raises:
            TypeError: `step` is not an integer.
            ValueError: `step` is negative.
        """
        step = _as_step(step)
        if self._last_step is not None and step <= self._last_step:
            return False
        return step % self.save_interval_steps == 0

    def reached_preemption(self, step: int) -> bool:
        """Whether the job was asked to stop and every process has reached `step`.

        Call it at every step, on every process (JAX's preemption sync point requires it). When
        it returns True, save with ``save(step, tree, force=True)`` and stop.

        Args:
            step: the training step, an integer >= 0.

        Returns:
            True when JAX's preemption sync point says every process reached `step` after a
            preemption notice; False otherwise, and when the preemption service is not running
            (e.g. without jax.distributed).

        Raises:
            TypeError: `step` is not an integer.
            ValueError: `step` is negative.
        """
        from jax.experimental import multihost_utils

        try:
            return bool(multihost_utils.reached_preemption_sync_point(_as_step(step)))
        except RuntimeError:  # no preemption sync manager in this job
            return False

    def step_path(self, step: int) -> str:
        """Where `step` is (or would be) stored.

        Args:
            step: the step number, an integer >= 0.

        Returns:
            The step's location (committed or not), as ``ckpt.restore``, ``ckpt.metadata`` and
            the ``ckpt`` command accept it.

        Raises:
            TypeError: `step` is not an integer.
            ValueError: `step` is negative.
        """
        return self.storage.where(step_dir_name(_as_step(step)))

    # ---- save ----------------------------------------------------------------------------

    def save(self, step: int, tree: Any, *, force: bool = False, metadata: dict | None = None) -> bool:
        """Save `tree` as `step` if ``should_save(step)`` or `force`.

        A step already saved (or being saved) here is never saved again. Waits for the previous
        save to commit first. With ``async_save`` (the default) it returns once the host copies
        are taken; the write, the commit and retention run in the background.

        Args:
            step: the training step, an integer >= 0.
            tree: the pytree to save, as for ``ckpt.save``.
            force: save even when ``should_save(step)`` is False (e.g. at preemption).
            metadata: a small msgpack-able dict (metrics, data-loader position; at most 1 MiB
                packed) stored with the step; ``metadata(step)`` returns it (tuples come back as
                lists).

        Returns:
            Whether a save started.

        Raises:
            CheckpointError: the previous save failed in the background (raised once, with the
                original error as ``__cause__``), a leaf cannot be saved, `metadata` cannot be
                stored (naming the key), the manager is closed, or another manager is saving to
                the directory (naming it).
            NotADirectoryError: `directory` is a file.
            TypeError: `step` is not an integer or `metadata` is not a dict.
            ValueError: `step` is negative.
        """
        self._check_open()
        step = _as_step(step)
        if not (force or self.should_save(step)) or step in self._known_steps:
            return False
        stored = _snapshot_metadata(step, metadata)
        self._finish_pending()
        if self._deletes and self._saver_lock is None:
            self.storage.make_dirs()
            self._saver_lock = self.storage.lock_saves()
        path = self.step_path(step)
        handle = start_save(self.storage.child(step_dir_name(step)), tree, user_metadata=stored, options=self.options)
        pending = _Pending(step, path, handle)
        self._pending = pending
        self._known_steps.add(step)
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        self._start_background(self._finish_save, pending, name=f"ckpt-manager-step-{step}")
        if not self.async_save:
            self._finish_pending()
        return True

    def wait(self) -> None:
        """Block until the save in flight has committed and background deletions are done.

        On processes other than 0, deletions process 0 makes may still be under way.

        Raises:
            CheckpointError: the save in flight failed (nothing committed for that step).
        """
        self._finish_pending()
        while self._threads:
            self._threads.pop(0).join()

    def close(self) -> None:
        """Wait for everything in the background, then refuse further saves.

        Raises:
            CheckpointError: the save in flight failed (the manager is closed all the same).
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._saver_lock is not None:
                self._saver_lock.release()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as close_error:  # the exception already in flight matters more
            exc.add_note(f"also, closing the checkpoint manager failed: {close_error!r}")

    # ---- restore -------------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, *, mesh: jax.sharding.Mesh | None = None,
                partial: bool = False) -> Any:
        """``ckpt.restore`` of a step; retention leaves the step alone while it is read.

        Args:
            step: the step to restore; None: the latest committed step.
            target: as for ``ckpt.restore``.
            mesh: as for ``ckpt.restore``.
            partial: as for ``ckpt.restore``.

        Returns:
            The restored tree, as ``ckpt.restore`` returns it.

        Raises:
            FileNotFoundError: no committed checkpoint in the directory, or `step` is not a
                committed step (the message lists the committed ones).
            CheckpointError: as for ``ckpt.restore``.
            TreeMismatchError: as for ``ckpt.restore``.
        """
        with self._pinned_step(step) as location:
            return _restore(location, target, mesh=mesh, partial=partial, options=self.options)

    def metadata(self, step: int | None = None) -> dict:
        """The metadata dict saved with a step.

        Args:
            step: the step; None: the latest committed step.

        Returns:
            The dict given to ``save(..., metadata=)``; {} when none was given.

        Raises:
            FileNotFoundError: no committed checkpoint in the directory, or `step` is not a
                committed step.
            CheckpointError: the step's manifest is damaged.
        """
        with self._pinned_step(step) as location:
            stored = read_manifest(location).user_metadata
        return {} if stored is None else stored

    # ---- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.directory} is closed")

    def _start_background(self, target, *args, name: str) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        # Not a daemon: an interpreter that exits without close() still commits and cleans up.
        thread = threading.Thread(target=target, args=args, name=name)
        thread.start()
        self._threads.append(thread)

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.finished.wait()
        if isinstance(pending.error, NotDurableError):  # committed: the step is saved
            warnings.warn(f"step {pending.step}: {pending.error}", RuntimeWarning, stacklevel=3)
        elif pending.error is not None:
            self._known_steps.discard(pending.step)
            self._last_step = max(self._known_steps, default=None)
            raise CheckpointError(
                f"saving step {pending.step} to {pending.path} failed in the background; "
                f"the step was not committed: {type(pending.error).__name__}: {pending.error}"
            ) from pending.error

    def _finish_save(self, pending: _Pending) -> None:
        try:
            pending.handle.wait()
        except BaseException as e:  # raised to the caller by _finish_pending
            pending.error = e
        finally:
            pending.finished.set()
        committed = pending.error is None or isinstance(pending.error, NotDurableError)
        if committed and self._deletes:
            with self._background_lock:
                if self.max_to_keep is not None:
                    self._apply_retention()
                self._remove_leftovers()

    def _apply_retention(self) -> None:
        committed = self.all_steps()
        for step in steps_to_delete(committed, self.max_to_keep, self.keep_every_n_steps):
            try:
                with self._pin_lock:
                    if self._pinned.get(step):
                        continue  # being read; a later commit deletes it
                    self._deleting.add(step)
                try:
                    # The manifest goes first (or the directory is renamed away), so a crash never
                    # leaves a half-deleted step that looks committed.
                    self.storage.child(step_dir_name(step)).retire()
                finally:
                    with self._pin_lock:
                        self._deleting.discard(step)
            except OSError as e:
                # Left in place (still committed and whole); the next commit retries.
                warnings.warn(f"checkpoint manager could not delete step {step} in {self.directory}: {e}",
                              RuntimeWarning, stacklevel=1)

    def _remove_leftovers(self) -> None:
        """Remove what saves that provably died left here. On local disk every commit already
        removes dead temporary directories beside it (``Storage.commit``); elsewhere an
        uncommitted step prefix holds generations, each judged by its owner record."""
        if self.storage.renames:
            return
        try:
            for entry in scan_steps(self.storage):
                if entry.committed or is_temp_name(entry.name):
                    continue
                step = self.storage.child(entry.name)
                for leftover in step.leftovers():
                    if leftover.dead:
                        step.remove_leftover(leftover)
        except (OSError, CheckpointError) as e:
            warnings.warn(f"checkpoint manager could not remove leftovers in {self.directory}: {e}",
                          RuntimeWarning, stacklevel=1)

    @contextlib.contextmanager
    def _pinned_step(self, step: int | None) -> Iterator[Storage]:
        """The storage of a committed step, which retention leaves alone until the block ends."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(errno.ENOENT, "no committed checkpoint in this directory", self.directory)
        step = _as_step(step)
        with self._pin_lock:
            self._pinned[step] = self._pinned.get(step, 0) + 1
            deleting = step in self._deleting
        try:
            location = self.storage.child(step_dir_name(step))
            if deleting or not location.exists(MANIFEST_NAME):
                raise FileNotFoundError(
                    errno.ENOENT, f"step {step} is not a committed checkpoint here (committed steps: {self.all_steps()})",
                    location.url,
                )
            yield location
        finally:
            with self._pin_lock:
                self._pinned[step] -= 1
                if not self._pinned[step]:
                    del self._pinned[step]

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep}, "
                f"keep_every_n_steps={self.keep_every_n_steps}, save_interval_steps={self.save_interval_steps}, "
                f"async_save={self.async_save})")
