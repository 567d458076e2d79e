"""CheckpointManager: one checkpoint per training step in a directory, saved in the background,
with retention, resume and crash safety.

Every step is a plain checkpoint at ``<directory>/step_<8+ digits>`` (``StepNaming``: other
names on request, e.g. Orbax's bare ``<step>``) that ``ckpt.restore`` and ``ckpt.metadata`` open
directly; the directory may be any location (docs/storage.md). A step is committed once its
manifest exists (formats/SPEC.md sections 9-10), so ``all_steps()`` lists the directory and
checks for manifests; ``.tmp-`` directories (local disk) and step prefixes without a manifest
(elsewhere) are saves in progress, saves that never committed, or steps half-deleted. Finished
Orbax steps (``<step>/_CHECKPOINT_METADATA``) in the directory are steps too, restored through
``ckpt.restore``'s Orbax reader.

Opening a manager, listing, restoring and reading metadata never change the directory: another
process may be saving there. Only a manager that saves (process 0, not ``read_only``) deletes
anything: it claims the directory (``ckpt._commit``'s ``lock``: a second saving manager gets a
CheckpointError naming the first), and after each commit removes old steps under its retention
policy (``ckpt._retention``) and the leftovers of saves that provably died
(``ckpt._commit``'s ``leftovers``), never a save in progress.

Multi-process jobs: every process creates a manager on the same shared directory and calls the
same methods in the same order. Decisions every process must agree on (``should_save``, whether
``save`` starts a save, when a background failure is raised) depend only on that call sequence,
on JAX's preemption sync point (the same on every process) and on the directory as it was when
the manager opened (or was last ``reload``-ed), never on timing. Retention depends only on
step numbers, metrics and save times stored in the manifests; only process 0 deletes.

Size: CheckpointManager is one public class; its members (save, restore, retention, preemption,
items) delegate to the modules beside it.
"""

from __future__ import annotations

import dataclasses
import errno
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import jax

from ckpt._errors import CheckpointError
from ckpt._format import read_manifest
from ckpt._manager import preemption as _preemption
from ckpt._manager.args import (
    METADATA_LIMIT_BYTES,
    as_step,
    check_best,
    check_count,
    check_interval,
    check_restore_step,
    snapshot_metadata,
)
from ckpt._manager.items import restore_item
from ckpt._manager.naming import StepNaming, parse_step, scan_steps, step_dir_name  # noqa: F401 (the door)
from ckpt._manager.retention import METRICS_KEY, best_step, check_metrics, score, steps_to_delete
from ckpt._manager.steps import StepDirectory
from ckpt._exit import EXIT_NOTICE_S, on_exit
from ckpt._host import Options, resolve
from ckpt._orbax import step_custom_metadata, step_record
from ckpt._restore import restore as _restore
from ckpt._save import SaveHandle, start_save
from ckpt._commit import SaveLock, commit_for
from ckpt._errors import NotDurableError
from ckpt.storage import Storage, make_dirs, open_storage

__all__ = ["CheckpointManager", "METADATA_LIMIT_BYTES", "steps_to_delete"]
_as_step = as_step


# Managers that saved and are not closed. At interpreter exit their saves in flight are finished
# (committed or reported on stderr), their deletions done and their locks released before the
# interpreter stops accepting background work (``_finish_at_exit``).
_unclosed: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


def _finish_at_exit() -> None:
    for manager in list(_unclosed):
        manager._finish_at_exit()


# The library's one exit hook (ckpt._exit) runs the managers' part first, then the saves'.
on_exit(_finish_at_exit, rank=0)


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
    as a context manager, or call ``close()``; one never closed still finishes its save in
    flight and its deletions when the interpreter exits (a failure is printed on stderr).
    docs/migrating-from-orbax.md maps Orbax's CheckpointManager options and calls to these.

    Args:
        directory (str | os.PathLike): any location ``ckpt.save`` accepts (a local path,
            ``s3://``, ``gs://``...); created by the first save if missing. Orbax steps already
            there are listed and restored like the others.
        max_to_keep: after each commit, keep only this many steps (the newest; with `best_fn`,
            the best), plus those `keep_every_n_steps` and `keep_time_interval` keep; None
            keeps all. The newest committed step is never deleted; deletion runs in the
            background.
        keep_every_n_steps: also keep every step divisible by this.
        keep_time_interval (datetime.timedelta | float): also keep one step per this much save
            time (seconds), judged by the save times stored in the manifests: oldest first, a
            step saved at least this long after the last step kept this way is kept.
        best_fn: ``metrics dict -> number``; with it `max_to_keep` keeps the best steps by the
            metrics given to ``save(..., metrics=)``, and ``best_step()`` names the best. Metrics
            may be nested: ``best_fn=lambda m: m["eval"]["acc"]``.
        best_mode: ``"min"`` (smaller `best_fn` is better, e.g. a loss) or ``"max"``.
        keep_checkpoints_without_metrics: with `best_fn`, also keep steps saved without
            metrics (otherwise they are deleted first).
        save_interval_steps: ``should_save(step)`` is True for multiples of it (and for the
            first step saved in an empty directory, and at a preemption).
        async_save: ``save`` returns once the state is copied to host memory (the arrays may then
            be donated); with False it returns once the step is committed.
        read_only: never save nor delete, take no lock (``save`` and ``delete`` raise).
        step_prefix: step directories are ``<step_prefix>_<step>``; None: the bare step
            (Orbax's default).
        step_format_fixed_length: zero-pad the step to this many digits; None: no padding.
        save_on_preemption: at a preemption notice (JAX's preemption sync point under
            ``jax.distributed``; otherwise SIGTERM, watched from the first save on, from the
            main thread), ``save`` saves that step whatever the interval and returns once it is
            committed and the manager's deletions are done; ``reached_preemption(step)`` is then
            True and a loop that asks it decides to stop. A loop that never asks is ended by the
            SIGTERM as it would have been, once that step is committed; one that calls the
            manager only at the steps it saves, at once (docs/training.md, "First step and
            preemption"; ``ckpt/_manager/preemption.py``).
        host_budget_bytes: ``Options.host_budget_bytes`` of every save and restore.
        max_chunk_bytes: ``Options.max_chunk_bytes`` of every save.
        options: engine, concurrency and memory settings for every save and restore
            (``ckpt.Options``), read once, now.

    Raises:
        ValueError: a count is not a positive integer, `best_mode` is not min/max, a naming
            argument or an option is invalid.
        TypeError: `options` is not a ``ckpt.Options``, `best_fn` is not callable, or
            `keep_time_interval` is neither a timedelta nor a number.
        OSError: the storage failed.
    """

    def __init__(self, directory, *, max_to_keep: int | None = None, keep_every_n_steps: int | None = None,
                 keep_time_interval: Any = None, best_fn: Callable[[dict], Any] | None = None,
                 best_mode: str = "min", keep_checkpoints_without_metrics: bool = True,
                 save_interval_steps: int = 1, async_save: bool = True, read_only: bool = False,
                 step_prefix: str | None = "step", step_format_fixed_length: int | None = 8,
                 save_on_preemption: bool = True, host_budget_bytes: int | None = None,
                 max_chunk_bytes: int | None = None, options: Options | None = None) -> None:
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"options must be a ckpt.Options, got {type(options).__name__}")
        budgets = {k: v for k, v in (("host_budget_bytes", host_budget_bytes), ("max_chunk_bytes", max_chunk_bytes))
                   if v is not None}
        if budgets:
            options = dataclasses.replace(options or Options(), **budgets)
        self.options = resolve(options)
        self.naming = StepNaming(step_prefix, step_format_fixed_length)
        self.max_to_keep = check_count("max_to_keep", max_to_keep, optional=True)
        self.keep_every_n_steps = check_count("keep_every_n_steps", keep_every_n_steps, optional=True)
        self.keep_time_interval = check_interval(keep_time_interval)
        check_best(best_fn, best_mode)
        self.best_fn, self.best_mode = best_fn, best_mode
        self.keep_checkpoints_without_metrics = bool(keep_checkpoints_without_metrics)
        self.save_interval_steps = check_count("save_interval_steps", save_interval_steps, optional=False)
        self.async_save = bool(async_save)
        self.read_only = bool(read_only)
        self.storage: Storage = open_storage(directory, self.options)
        self.directory = self.storage.url
        self._deletes = jax.process_index() == 0 and not self.read_only
        self._saver_lock: SaveLock | None = None  # taken by the first save (process 0)
        self._closed = False
        self._pending: _Pending | None = None
        self._threads: list[threading.Thread] = []
        self._background_lock = threading.Lock()  # one deleter at a time
        self._steps = StepDirectory(self.storage, self.naming)
        self._preemption: tuple[int, bool] | None = None  # (step, answer) of the last sync point
        # SIGTERM is watched from the first save on (a manager that only reads never defers it),
        # and never where JAX's preemption service owns it (preemption.py).
        self._watch_sigterm = (bool(save_on_preemption) and not self.read_only and jax.process_count() == 1
                               and not _preemption.jax_service())
        self._watching = False
        # Who will act on a SIGTERM (preemption.py): whether the loop asked reached_preemption
        # itself, and the last two steps it called the manager with.
        self._loop_asks = False
        self._steps_called: tuple[int | None, int | None] = (None, None)
        self.reload()

    # ---- queries -------------------------------------------------------------------------

    def reload(self) -> None:
        """Read the directory's steps again (steps another process saved or deleted since this
        manager opened); ``should_save`` and ``save`` decide from what it finds. In a
        multi-process job call it on every process at the same point.

        Raises:
            OSError: the storage failed.
        """
        # Steps saved, or being saved, as far as this manager knows. Deliberately not re-listed
        # except here: every process of a job must make the same decisions.
        self._known_steps = set(self._steps.scan())
        pending = self._pending
        if pending is not None and not pending.finished.is_set():
            self._known_steps.add(pending.step)
        self._last_step = max(self._known_steps, default=None)

    def all_steps(self) -> list[int]:
        """The committed steps, listed from storage now.

        Returns:
            The step numbers whose manifest exists (or Orbax steps that finished), sorted.
        """
        return sorted(self._steps.scan())

    def latest_step(self) -> int | None:
        """The newest committed step whose manifest is whole.

        A step whose manifest is damaged is skipped with a RuntimeWarning naming it (once per
        manager); manifests are read from the newest step down until one is whole.

        Returns:
            The largest such step number, or None when there is none.
        """
        steps = self._steps.scan()
        for step in sorted(steps, reverse=True):
            if self._steps.manifest_ok(steps[step]):
                return step
        return None

    def best_step(self) -> int | None:
        """The committed step whose metrics score best under `best_fn` (the newest among
        equals); without `best_fn`, the latest step.

        Returns:
            The step number, or None when no committed step has metrics `best_fn` can score.
        """
        if self.best_fn is None:
            return self.latest_step()
        steps = self._steps.scan()
        return best_step(list(steps), {s: self._steps.facts_of(m) for s, m in steps.items()}, self.best_fn, self.best_mode)

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save.

        Call it (or ``save``) at every step on every process: it asks JAX's preemption sync
        point, which needs that.

        Args:
            step: the training step, an integer >= 0.

        Returns:
            True when `step` is newer than every step already saved (or being saved) here and
            is the first step of an empty directory, or a preemption was signalled
            (``reached_preemption``), or a multiple of save_interval_steps. Always False for a
            ``read_only`` manager.

        Raises:
            TypeError: `step` is not an integer.
            ValueError: `step` is negative.
        """
        step = self._called_at(step)
        if self.read_only:
            return False  # its save raises: it never saves
        if self._last_step is not None and step <= self._last_step:
            return False
        preempted = self._reached(step)
        return self._last_step is None or preempted or step % self.save_interval_steps == 0

    def reached_preemption(self, step: int) -> bool:
        """Whether the job was asked to stop and every process has reached `step`.

        Call it at every step, on every process (JAX's preemption sync point requires it); the
        answer for a step is asked once and remembered. ``save`` asks it too and saves when it
        is True; stop training after that save.

        Args:
            step: the training step, an integer >= 0.

        Returns:
            True when JAX's preemption sync point says every process reached `step` after a
            preemption notice, or (``save_on_preemption``) this single-process job received
            SIGTERM that no save has answered yet (the step whose save answered it keeps its
            True answer, so ``if manager.reached_preemption(step): break`` after
            ``save(step, ...)`` stops the loop); False otherwise.

        Raises:
            TypeError: `step` is not an integer.
            ValueError: `step` is negative.
        """
        step = self._called_at(step)
        self._loop_asks = True
        return self._reached(step)

    def _reached(self, step: int) -> bool:
        """reached_preemption(step), asked by the manager itself (the loop has not asked)."""
        if self._preemption is not None and self._preemption[0] == step:
            return self._preemption[1]
        from jax.experimental import multihost_utils

        try:
            answer = bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:  # no preemption sync manager in this job
            answer = False
        answer = answer or (self._watching and _preemption.received())
        self._preemption = (step, answer)
        return answer

    def _called_at(self, step: Any) -> int:
        """`step` checked, and noted as a step the loop called the manager with."""
        step = _as_step(step)
        if step != self._steps_called[1]:
            self._steps_called = (self._steps_called[1], step)
        return step

    def _listens_for_preemption(self) -> bool:
        """(preemption.py, from the SIGTERM handler) Whether the loop will see a notice soon:
        it asked reached_preemption itself, or it calls the manager at every step (the last two
        steps it called with are consecutive)."""
        before, last = self._steps_called
        return self._loop_asks or (before is not None and last == before + 1)

    def _save_in_flight(self) -> threading.Event | None:
        """(preemption.py) The finishing event of the save in flight, if any."""
        pending = self._pending
        return None if pending is None or pending.finished.is_set() else pending.finished

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
        return self.storage.where(self._steps.name_of(_as_step(step)))

    def is_saving_in_progress(self) -> bool:
        """Whether a save this manager started has not finished yet (never blocks).

        Returns:
            True while the step last saved is still being written or committed.
        """
        pending = self._pending
        return pending is not None and not pending.finished.is_set()

    # ---- save ----------------------------------------------------------------------------

    def save(self, step: int, tree: Any, *, force: bool = False, metadata: dict | None = None,
             metrics: dict | None = None) -> bool:
        """Save `tree` as `step` if ``should_save(step)`` or `force`.

        A step already saved (or being saved) here is never saved again. Waits for the previous
        save to commit first. With ``async_save`` (the default) it returns once the host copies
        are taken; the write, the commit and retention run in the background. At a preemption
        (``reached_preemption(step)``) it saves whatever the interval and returns once the step
        is committed and old steps deleted; stop training then (see ``save_on_preemption``).

        Args:
            step: the training step, an integer >= 0.
            tree: the pytree to save, as for ``ckpt.save``. A dict's top-level keys are the
                step's items (``restore(step, item=...)`` restores one alone).
            force: save even when ``should_save(step)`` is False.
            metadata: a small msgpack-able dict (data-loader position...; at most 1 MiB packed)
                stored with the step; ``metadata(step)`` returns it, its keys in their order
                (tuples come back as lists, except dict keys that are tuples: those stay tuples).
            metrics: a dict whose values are any JSON tree: numbers, strings, bools, None, lists
                and dicts with string keys, nested (``{"eval": {"acc": 0.5}}``; 0-d numpy / jax
                values are converted, tuples become lists; at most 32 levels deep), stored with
                the step; ``metrics(step)`` returns it; `best_fn` ranks steps by it.

        Returns:
            Whether a save started.

        Raises:
            CheckpointError: the previous save failed in the background (raised once, with the
                original error as ``__cause__``), a leaf cannot be saved, `metadata` or
                `metrics` cannot be stored (naming the key), the manager is closed or
                read-only, or another manager is saving to the directory (naming it).
            NotADirectoryError: `directory` is a file.
            FileExistsError: something uncommitted is at the step's name and nothing proves its
                save ended (a save in progress, files without an owner record): it is left
                alone. A leftover of a save of that step that provably died is replaced.
            TypeError: `step` is not an integer or `metadata` / `metrics` is not a dict.
            ValueError: `step` is negative, or `best_fn` fails on `metrics`.
        """
        self._check_open()
        if self.read_only:
            raise CheckpointError(f"checkpoint manager for {self.directory} is read-only: it does not save")
        step = self._called_at(step)
        if step in self._known_steps or not (self.should_save(step) or force):
            return False
        metrics = check_metrics(step, metrics)
        if metrics is not None and self.best_fn is not None:
            score(self.best_fn, metrics, step)  # fails here, naming the step, not in retention later
        stored = snapshot_metadata(step, metadata, metrics)
        self._finish_pending()
        if self._deletes and self._saver_lock is None:
            make_dirs(self.storage)
            self._saver_lock = commit_for(self.storage).lock()
        lost = getattr(self._saver_lock, "lost", None)
        if lost:
            # This manager stalled past its lease's expiry and another one took the directory
            # over (a lease on object stores): saving now would race it.
            raise CheckpointError(f"checkpoint manager for {self.directory} no longer holds its saver lease: {lost}")
        _unclosed.add(self)
        if self._watch_sigterm and not self._watching:
            self._watching = _preemption.watch(self)
        name = self.naming.name(step)
        blocked = self._clear_dead(step) if self._deletes else None
        try:
            handle = start_save(self.storage.child(name), tree, user_metadata=stored, options=self.options)
        except FileExistsError as e:
            if blocked is None:
                raise
            # Something uncommitted under the step's name that nothing proves abandoned (every
            # process got this error from the save's shared decision; process 0 knows why).
            raise FileExistsError(
                errno.EEXIST, f"step {step} is not committed, but something is at its name and it is not "
                f"provably abandoned ({blocked}): it is not replaced; remove it if no save is writing it",
                self.storage.where(name)) from e
        pending = _Pending(step, self.storage.where(name), handle)
        self._pending = pending
        self._known_steps.add(step)
        self._last_step = step if self._last_step is None else max(self._last_step, step)
        self._start_background(self._finish_save, pending, name=f"ckpt-manager-step-{step}")
        preempted = self._reached(step)
        if not self.async_save or preempted:
            self._finish_pending()
        if preempted:
            # The job is about to stop: the deletions after this commit finish now too, so
            # nothing is cut off half-way when the loop ends the process.
            self.wait()
            if self._watching:
                self._watching = False
                if self._loop_asks:
                    # The loop's own code, which sees reached_preemption(step), ends the
                    # process (its exit status, its cleanup): never kill it here. A Python
                    # handler installed before ours gets the notice.
                    _preemption.consume()
                else:
                    # Nobody asks: the signal does what it would have done (by default the
                    # process ends), now that the preemption step is committed.
                    _preemption.hand_on()
        return True

    def delete(self, step: int) -> None:
        """Delete a committed step now: its manifest (or Orbax's ``_CHECKPOINT_METADATA``)
        first, then its data, so no moment shows a half-deleted step as committed. Waits for
        the save of that step if it is in flight. In a multi-process job every process calls
        it; process 0 deletes.

        Args:
            step: the step number, an integer >= 0.

        Raises:
            FileNotFoundError: `step` is not a committed step.
            CheckpointError: the manager is closed or read-only, or the step is being restored.
            OSError: the storage failed (the step may be left in place, still committed).
        """
        self._check_open()
        if self.read_only:
            raise CheckpointError(f"checkpoint manager for {self.directory} is read-only: it does not delete")
        step = _as_step(step)
        if self._pending is not None and self._pending.step == step:
            self._finish_pending()
        with self._background_lock:  # retention is not deleting meanwhile
            entry = self._steps.scan().get(step)
            if entry is None:
                raise FileNotFoundError(errno.ENOENT, f"step {step} is not a committed checkpoint here "
                                        f"(committed steps: {self.all_steps()})", self.step_path(step))
            if self._deletes and not self._steps.retire(entry):
                raise CheckpointError(f"step {step} is being restored; delete it afterwards")
        self._known_steps.discard(step)
        self._last_step = max(self._known_steps, default=None)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight has committed and background deletions are done.

        On processes other than 0, deletions process 0 makes may still be under way.

        Args:
            timeout: seconds to wait at most; None waits as long as it takes.

        Raises:
            CheckpointError: the save in flight failed (nothing committed for that step).
            TimeoutError: still running after `timeout` seconds (it goes on; call again).
        """
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        pending = self._pending
        if pending is not None and not pending.finished.wait(left()):
            raise TimeoutError(f"saving step {pending.step} to {pending.path} still running after {timeout} s")
        self._finish_pending()
        while self._threads:
            thread = self._threads[0]
            thread.join(left())
            if thread.is_alive():
                raise TimeoutError(f"background work of the checkpoint manager for {self.directory} "
                                   f"still running after {timeout} s")
            self._threads.pop(0)

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
            self._release()

    def _release(self, *, at_exit: bool = False) -> None:
        self._closed = True
        _unclosed.discard(self)
        if self._saver_lock is not None:
            self._saver_lock.release()
        if self._watching:
            self._watching = False
            told = self._loop_asks and self._preemption is not None and self._preemption[1]
            if not at_exit and told and _preemption.received():
                # The loop was told (reached_preemption said True) and closes: its decision,
                # as after a save that answered the notice; never a kill inside close().
                _preemption.consume()
            else:
                _preemption.unwatch(self, hand_on_notice=not at_exit)

    def _finish_at_exit(self) -> None:
        """close() for a manager the program never closed, as the interpreter exits: its save
        in flight commits (announced on stderr when it takes long) or its failure is printed on
        stderr; deletions finish; the directory lock is released. Nothing is raised (there is
        no caller left to catch it)."""
        if self._closed:
            return
        try:
            pending = self._pending
            if pending is not None and not pending.finished.wait(EXIT_NOTICE_S):
                print(f"jax-ckpt: the CheckpointManager for {self.directory} was not closed; finishing the save of "
                      f"step {pending.step} to {pending.path} before the interpreter exits", file=sys.stderr,
                      flush=True)
            self.wait()
        except BaseException as e:  # (KeyboardInterrupt included: the exit goes on)
            print(f"jax-ckpt: the CheckpointManager for {self.directory} was not closed, and at exit: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            self._release(at_exit=True)

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
                partial: bool = False, verify: bool = True, options: Options | None = None,
                item: str | int | None = None, allow_lossy_cast: bool = False,
                axis_names: dict[str, str] | None = None, rename: Any = None) -> Any:
        """``ckpt.restore`` of a step (or of one item of it); retention leaves the step alone
        while it is read.

        Args:
            step: the step to restore; None: ``latest_step()`` (the newest with a whole
                manifest). A target passed here by position is refused with a TypeError that
                says ``restore(target=...)`` (or ``restore(step, target)``).
            target: as for ``ckpt.restore`` (with `item`: a target for that item).
            mesh: as for ``ckpt.restore``.
            partial: as for ``ckpt.restore``.
            verify: as for ``ckpt.restore``.
            options: settings of this restore; None: the manager's.
            item: restore only this top-level key of the saved tree (an Orbax step's
                ``<step>/<item>/``), reading only the chunks its arrays need: a string, or an
                integer where the saved keys are (``nnx.state((model, optimizer))``: 0 and 1).
            allow_lossy_cast: as for ``ckpt.restore``: cast to a target dtype even where values
                change beyond rounding.
            axis_names: as for ``ckpt.restore``: with `mesh`, ``{saved axis name: mesh axis
                name}`` (e.g. ``{"data": "batch"}``) for a mesh whose axes are named otherwise.
            rename: as for ``ckpt.restore``: a target in other names, or made of parts of saved
                leaves (``ckpt.surgery``), over the whole step (saved names begin with the
                item's key); not with `item`.

        Returns:
            The restored tree (or item), as ``ckpt.restore`` returns it (with
            ``partial="matching"``: ``(tree, missing)``).

        Raises:
            TypeError: `step` is not an integer (a pytree there: pass it as ``target=``), or
                `item` is neither a string nor an integer.
            ValueError: both `rename` and `item`.
            FileNotFoundError: no committed checkpoint in the directory, or `step` is not a
                committed step (the message lists the committed ones).
            KeyError: the step has no item `item` (the message lists its items).
            CheckpointError: as for ``ckpt.restore``.
            TreeMismatchError: as for ``ckpt.restore``.
        """
        check_restore_step(step)
        if rename is not None and item is not None:
            raise ValueError("rename= applies to a whole step (the saved names begin with the item's key, "
                             f"e.g. '{item}.layers.0.kernel'); pass item=None")
        opts = self.options if options is None else options
        with self._pinned_step(step) as (location, entry):
            if options is not None:  # opened again with these options (their engine included)
                location = open_storage(location.url, resolve(options))
            if item is not None:
                return restore_item(location, item, target, orbax=entry.orbax, mesh=mesh, partial=partial,
                                    verify=verify, options=opts, allow_lossy_cast=allow_lossy_cast,
                                    axis_names=axis_names)
            return _restore(location, target, mesh=mesh, partial=partial, verify=verify, options=opts,
                            allow_lossy_cast=allow_lossy_cast, axis_names=axis_names, rename=rename)

    def metadata(self, step: int | None = None) -> dict:
        """The metadata dict saved with a step.

        Args:
            step: the step; None: the latest committed step.

        Returns:
            The dict given to ``save(..., metadata=)``; {} when none was given. For an Orbax
            step, its ``custom_metadata`` (Orbax's ``save(..., custom_metadata=)``).

        Raises:
            FileNotFoundError: no committed checkpoint in the directory, or `step` is not a
                committed step.
            CheckpointError: the step's manifest is damaged.
        """
        with self._pinned_step(step) as (location, entry):
            if entry.orbax:
                return step_custom_metadata(location)
            stored = read_manifest(location).user_metadata
        return {k: v for k, v in (stored or {}).items() if k != METRICS_KEY}

    def metrics(self, step: int | None = None) -> dict | None:
        """The metrics saved with a step (``save(..., metrics=)``; for an Orbax step, the
        metrics Orbax stored).

        Args:
            step: the step; None: the latest committed step.

        Returns:
            The metrics dict, or None when the step was saved without metrics.

        Raises:
            FileNotFoundError: no committed checkpoint in the directory, or `step` is not a
                committed step.
            CheckpointError: the step's manifest is damaged.
        """
        with self._pinned_step(step) as (location, entry):
            if entry.orbax:
                return step_record(location)[0]
            stored = read_manifest(location).user_metadata or {}
        metrics = stored.get(METRICS_KEY)
        return dict(metrics) if isinstance(metrics, dict) else None

    # ---- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"checkpoint manager for {self.directory} is closed")

    @property
    def last_save_stats(self) -> dict | None:
        """Figures of the last save this manager committed (None before the first): its
        ``step``, and ``process`` and ``job`` as ``SaveHandle.stats`` gives them (durations per
        process, bytes, requests, the slowest process; docs/multihost.md)."""
        return getattr(self, "_last_save_stats", None)

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
            self._last_save_stats = {"step": pending.step, **(pending.handle.stats or {})}
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
        try:
            steps = self._steps.scan()
            facts = ({s: self._steps.facts_of(e) for s, e in steps.items()}
                     if self.best_fn is not None or self.keep_time_interval is not None else {})
        except (OSError, CheckpointError) as e:
            warnings.warn(f"checkpoint manager could not list the steps of {self.directory}: {e}",
                          RuntimeWarning, stacklevel=1)
            return
        doomed = steps_to_delete(list(steps), self.max_to_keep, self.keep_every_n_steps, facts=facts,
                                 best_fn=self.best_fn, best_mode=self.best_mode,
                                 keep_checkpoints_without_metrics=self.keep_checkpoints_without_metrics,
                                 keep_time_interval=self.keep_time_interval)
        for step in doomed:
            try:
                self._steps.retire(steps[step])  # a step being read is left; a later commit deletes it
            except OSError as e:
                # Left in place (still committed and whole); the next commit retries.
                warnings.warn(f"checkpoint manager could not delete step {step} in {self.directory}: {e}",
                              RuntimeWarning, stacklevel=1)

    def _clear_dead(self, step: int) -> str | None:
        """StepDirectory.clear_dead; a failure to judge or remove becomes the reason the save
        names if what is there blocks it."""
        try:
            return self._steps.clear_dead(step)
        except (OSError, CheckpointError) as e:
            return f"judging or removing it failed: {type(e).__name__}: {e}"

    def _remove_leftovers(self) -> None:
        try:
            self._steps.remove_leftovers()
        except (OSError, CheckpointError) as e:
            warnings.warn(f"checkpoint manager could not remove leftovers in {self.directory}: {e}",
                          RuntimeWarning, stacklevel=1)

    def _pinned_step(self, step: int | None):
        """The storage of a committed step, which retention leaves alone until the block ends."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(errno.ENOENT, "no committed checkpoint in this directory", self.directory)
        return self._steps.pinned(_as_step(step))

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep}, "
                f"keep_every_n_steps={self.keep_every_n_steps}, save_interval_steps={self.save_interval_steps}, "
                f"async_save={self.async_save}, read_only={self.read_only})")
