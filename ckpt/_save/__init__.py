"""save / save_async: flatten, describe, plan, stage to host, then write and commit in the
background. ``save`` is ``save_async(...).wait()``; there is one save path.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import math
import queue
import threading
from typing import Any

import crc32c
import msgpack
import numpy as np

from ckpt._memory import gc_paused
from ckpt._save.commit import Coordinator, commit_checkpoint, current_coordinator
from ckpt._save.plan import Leaf, array_shards, describe, finish_array_records, pack_records
from ckpt._errors import CheckpointError
from ckpt._geometry import chunk_grid, chunk_key
from ckpt._format import STACKS_VERSION, LeafRecord, Manifest, Stack, StackedStorage
from ckpt._options import Options, resolve, save_chunk_cap
from ckpt._save.plan import STACK_CHUNK_BYTES, SavePlan, plan_save
from ckpt._save.stage import SaveBudget, StagingAborted, stage
from ckpt._format import flatten, storage_paths
from ckpt._save.write import END, _write_chunks, array_specs
from ckpt._format import ArraySpec
from ckpt.storage import Staged, Storage, open_storage
from ckpt._format import GROUP_METADATA, array_metadata_bytes
from ckpt.storage import NotDurableError
from ckpt._save.stage import release_host_memory  # noqa: F401 (the door)

class SaveHandle:
    """A save in progress, as ``save_async`` returns it (not constructed directly).

    The host copies are already taken when it is returned: the saved arrays may be donated,
    deleted or overwritten. The rest of the save (writes, commit) runs on a background thread.

    Attributes:
        path: the checkpoint's location, as shown in messages.
    """

    def __init__(self, path: str, work) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(work,), name="ckpt-save")
        self._thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as e:  # handed to wait(), with its traceback
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the save has finished, committed or failed. Never blocks.

        Returns:
            True once the background work is over (``wait()`` then returns or raises at once).
        """
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed.

        Args:
            timeout: seconds to wait at most; None waits as long as the save takes.

        Raises:
            TimeoutError: the save is still running after `timeout` seconds (it goes on).
            CheckpointError: the save failed in the background (re-raised with its original
                traceback); nothing was committed. Also ``OSError`` from the storage and
                ``FileExistsError`` when another save committed at `path` first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"save to {self.path} still running after {timeout} s")
        if self._error is not None:
            raise self._error


def _fingerprint(final: str, overwrite: bool, tree: dict, leaves: list[Leaf], plan: SavePlan) -> bytes:
    view = [
        [l.record.path, l.record.kind, l.record.shape, l.record.dtype, l.record.sharding,
         type(l.record.storage).__name__, l.chunk_shape]
        for l in leaves
    ]
    # Which leaves are packed, and where, follows from shardings and device placement; every
    # process must have come to the same layout.
    packing = [plan.whole, [(st.members, st.process) for st in plan.stacks]]
    return hashlib.sha256(msgpack.packb([final, overwrite, tree, view, packing], use_bin_type=True)).digest()


def _check_fingerprints(views: list[dict]) -> None:
    """Raise unless every process planned the same save (`views` by process: plan or error)."""
    failed = [(p, v["error"]) for p, v in enumerate(views) if "error" in v]
    if failed:
        raise CheckpointError(
            f"process(es) {[p for p, _ in failed]} could not plan the save, nothing was written: "
            + "; ".join(f"process {p}: {e}" for p, e in failed)
        )
    groups: dict[bytes, list[int]] = {}
    for p, v in enumerate(views):
        groups.setdefault(v["plan"], []).append(p)
    if len(groups) > 1:
        majority = max(groups.values(), key=len)
        odd = sorted(p for g in groups.values() if g is not majority for p in g)
        raise CheckpointError(
            f"processes disagree on what to save: process(es) {odd} have a different tree, shapes, "
            f"dtypes, shardings, chunk shapes (host_budget_bytes, max_chunk_bytes) or path than process(es) {majority}; nothing was written"
        )


def save_async(path, tree: Any, *, overwrite: bool = False, options: Options | None = None,
               host_budget_bytes: int | str | None = None, max_chunk_bytes: int | None = None) -> SaveHandle:
    """Start saving `tree` to `path`; return once every byte this process writes is either in
    host memory the library owns or already written. The arrays may be donated or deleted from
    then on.

    Every unique shard is written once, by one process, as chunks of a Zarr v3 array (a shard
    larger than the chunk cap is split evenly into several chunks); the manifest is written
    last, so the checkpoint appears whole or not at all. Under ``jax.distributed`` every process
    calls it with the same arguments.

    Host memory stays within the host budget: when this process's bytes fit it, the call
    returns as soon as the host copies exist (the writes run in the background); when they do
    not, the call copies chunk by chunk, each copy waiting for earlier chunks to be written, and
    returns once the last chunk is copied (docs/memory.md).

    Args:
        path (str | os.PathLike): a local path (``str``, ``pathlib.Path``,
            ``etils.epath.Path``) or a URL: ``file://``, ``memory://``, ``s3://``, ``gs://`` or
            any fsspec URL (docs/storage.md).
        tree: a pytree whose leaves are ``jax.Array``, ``numpy.ndarray``, numpy scalars, typed
            PRNG key arrays, or small Python values (``int``, ``float``, ``bool``, ``complex``,
            ``str``, ``bytes``, ``None``).
        overwrite: replace a checkpoint already at `path` (in one step, once the new one is
            complete).
        options: engine, concurrency and memory settings (``ckpt.Options``).
        host_budget_bytes: the most host memory this save uses for staging, pooled buffers and
            writes in flight, in bytes, or ``"unlimited"``; overrides
            ``Options.host_budget_bytes`` (default: ``CKPT_HOST_BUDGET_BYTES``, else a quarter
            of the host's RAM). It also caps chunks at a quarter of the budget.
        max_chunk_bytes: the largest chunk written (a shard is split evenly into chunks of at
            most this size); overrides ``Options.max_chunk_bytes`` (default
            ``CKPT_MAX_CHUNK_BYTES``, else 64 MiB).

    Returns:
        A ``SaveHandle``: ``wait()`` blocks until the checkpoint is committed, ``done()`` polls.

    Raises:
        FileExistsError: `path` holds a checkpoint and `overwrite` is False (on local disk:
            anything exists at `path`).
        CheckpointError: a leaf cannot be saved (naming it), or the processes of a job disagree
            on the tree; nothing is written.
        ValueError: an option is invalid.
        TypeError: `options` is not a ``ckpt.Options``.
        OSError: the storage refused to stage the save.
    """
    return start_save(path, tree, overwrite=overwrite, options=options, host_budget_bytes=host_budget_bytes,
                      max_chunk_bytes=max_chunk_bytes)


def _save_options(options: Options | None, host_budget_bytes, max_chunk_bytes) -> Options:
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options must be a ckpt.Options, got {type(options).__name__}")
    opts = options or Options()
    if host_budget_bytes is not None:
        opts = dataclasses.replace(opts, host_budget_bytes=host_budget_bytes)
    if max_chunk_bytes is not None:
        opts = dataclasses.replace(opts, max_chunk_bytes=max_chunk_bytes)
    return resolve(opts)


@gc_paused()
def start_save(path, tree: Any, *, overwrite: bool = False, user_metadata: dict | None = None,
               options: Options | None = None, host_budget_bytes: int | str | None = None,
               max_chunk_bytes: int | None = None) -> SaveHandle:
    """save_async with the library-internal options (user_metadata: a small msgpack-able dict
    stored in the manifest, used by CheckpointManager)."""
    opts = _save_options(options, host_budget_bytes, max_chunk_bytes)
    cap = save_chunk_cap(opts)
    storage = open_storage(path, opts)
    final = storage.url
    coord = current_coordinator()
    # First, before anything can fail, so that every process's count of saves stays the same.
    save_id = coord.new_save_id()
    try:
        try:
            encoding, flat = flatten(tree)
            leaves = [describe(l, coord.process_count, cap) for l in flat]
            finish_array_records(leaves, storage_paths([l.components for l in flat]))
            # (packed chunks stay within the cap too)
            plan = plan_save(array_shards(leaves), pack_limit=min(opts.pack_limit_bytes, cap),
                             stack_chunk_bytes=min(STACK_CHUNK_BYTES, cap))
            stacks = pack_records(leaves, plan)
            my_writes = plan.for_process(coord.process_index)
            view, own_error = {"plan": _fingerprint(final, overwrite, encoding, leaves, plan)}, None
        except Exception as e:  # the others learn of it now instead of waiting for this process
            view, own_error = {"error": f"{type(e).__name__}: {e}"}, e
        views = [msgpack.unpackb(v) for v in coord.all_gather(f"{save_id}/plan", msgpack.packb(view))]
        if own_error is not None:
            raise own_error
        _check_fingerprints(views)

        mine: list[Staged] = []  # the primary's own Staged: it holds the staged place's lock

        def prepare() -> bytes:
            try:
                mine.append(storage.stage(overwrite=overwrite))
                return msgpack.packb({"staged": mine[0].info})
            except OSError as e:
                return msgpack.packb({"errno": e.errno, "error": f"{e.strerror}: {e.filename}"})

        decision = msgpack.unpackb(coord.broadcast(f"{save_id}/prepare", prepare))
        if "staged" not in decision:
            raise OSError(decision["errno"], decision["error"].split(": ")[0], final)
        staged = mine[0] if mine else storage.staged_from(decision["staged"])
    except BaseException:
        coord.end_save(save_id)
        raise

    chunks: queue.Queue = queue.Queue()
    copied = threading.Event()  # set once every host copy exists
    budget = SaveBudget(opts.host_budget_bytes, keep=opts.staging_pool)
    # More bytes than the budget: the caller waits for the disk anyway, so writes need not wait
    # for the copies to end.
    pressed = sum(w.nbytes for w in my_writes) > budget.limit
    job = _SaveJob(coord, save_id, storage, staged, overwrite, encoding, leaves, user_metadata, opts, stacks)
    handle = SaveHandle(final, lambda: job.run(chunks, copied, budget, pressed))
    handle._budget = budget  # (read by tests: its high-water mark)
    try:
        for item in stage({i: l.source for i, l in enumerate(leaves)}, my_writes, budget):
            chunks.put(item)
            del item
    except BaseException as e:
        copied.set()
        chunks.put(e)
        failure = None
        try:
            handle.wait()  # the writer aborts and removes the temporary directory
        except BaseException as err:
            failure = err
        if isinstance(e, StagingAborted) and failure is not None:
            raise failure  # the writer's error, which stopped the copies
        raise
    copied.set()
    chunks.put(END)
    return handle


def save(path, tree: Any, *, overwrite: bool = False, options: Options | None = None,
         host_budget_bytes: int | str | None = None, max_chunk_bytes: int | None = None) -> None:
    """Save `tree` to `path` and return once the checkpoint is committed.

    ``save_async(path, tree, ...).wait()``: see ``save_async`` for what is written and when.

    Args:
        path (str | os.PathLike): a local path or URL, as for ``save_async``.
        tree: the pytree to save.
        overwrite: replace a checkpoint already at `path`.
        options: engine, concurrency and memory settings (``ckpt.Options``).
        host_budget_bytes: the most host memory the save uses (bytes or ``"unlimited"``), as
            for ``save_async``.
        max_chunk_bytes: the largest chunk written, as for ``save_async``.

    Raises:
        FileExistsError: `path` holds a checkpoint and `overwrite` is False.
        CheckpointError: a leaf cannot be saved, the processes disagree, or a write failed
            (nothing committed; the previous checkpoint at `path`, if any, is untouched).
        OSError: the storage failed, naming the object.
    """
    save_async(path, tree, overwrite=overwrite, options=options, host_budget_bytes=host_budget_bytes,
               max_chunk_bytes=max_chunk_bytes).wait()


class _SaveJob:
    """The background part of one save: write this process's chunks, exchange reports, commit."""

    def __init__(self, coord: Coordinator, save_id: str, storage: Storage, staged: Staged, overwrite: bool,
                 encoding: dict, leaves: list[Leaf], user_metadata: dict | None, options: Options,
                 stacks: list[Stack] = ()):
        self.coord, self.save_id, self.storage, self.staged = coord, save_id, storage, staged
        self.overwrite, self.encoding, self.leaves = overwrite, encoding, leaves
        self.user_metadata, self.options, self.stacks = user_metadata, options, list(stacks)

    def run(self, chunks: queue.Queue, copied: threading.Event, budget: SaveBudget, pressed: bool) -> None:
        try:
            self._exchange_and_commit(chunks, copied, budget, pressed)
        finally:
            self.staged.release()  # (commit and abort release it; this covers any other exit)
            self.coord.end_save(self.save_id)

    def _abort(self) -> None:
        try:
            self.storage.abort(self.staged)
        except OSError:
            pass  # left for cleanup: never a checkpoint, since no manifest points to it

    def _exchange_and_commit(self, chunks: queue.Queue, copied: threading.Event, budget: SaveBudget,
                             pressed: bool) -> None:
        coord, final = self.coord, self.storage.url
        primary = coord.process_index == 0
        error: BaseException | None = None
        sums: dict = {}
        try:
            sums = _write_chunks(self.staged.storage, self.leaves, chunks, primary, copied, budget,
                                 self.options.max_inflight_bytes, self.staged.prefix, self.stacks, pressed)
        except BaseException as e:
            error = e
        status = msgpack.packb(
            {"error": None if error is None else f"{type(error).__name__}: {error}",
             "sums": [[leaf, flat, crc] for leaf, m in sums.items() for flat, crc in m.items()]},
            use_bin_type=True,
        )
        try:
            gathered = coord.all_gather(f"{self.save_id}/written", status)
        except CheckpointError as e:
            if primary:  # the primary never commits without every process's report
                self._abort()
                raise CheckpointError(f"save to {final} failed, nothing committed: {e}") from None
            raise CheckpointError(f"save to {final} failed: {e}") from None
        statuses = [msgpack.unpackb(s, strict_map_key=False) for s in gathered]

        def commit() -> bytes:
            failed = {p: s["error"] for p, s in enumerate(statuses) if s["error"]}
            if failed:
                self._abort()
                return msgpack.packb({"error": "; ".join(f"process {p}: {e}" for p, e in failed.items())})
            try:
                self._commit(statuses)
                return msgpack.packb({"error": None})
            except NotDurableError as e:  # committed: nothing to abort, the save succeeded
                return msgpack.packb({"error": None, "not_durable": str(e)})
            except BaseException as e:
                # A lost race (another save committed here first) stays a FileExistsError. Where
                # the manifest write may have landed (a put whose answer was lost), deleting the
                # staged data could break a committed checkpoint; data that no manifest points to
                # is only a leftover, so it stays.
                if self.storage.renames or isinstance(e, FileExistsError):
                    self._abort()
                return msgpack.packb({"error": f"commit failed: {type(e).__name__}: {e}",
                                      "exists": isinstance(e, FileExistsError)})

        try:
            outcome = msgpack.unpackb(coord.broadcast(f"{self.save_id}/commit", commit))
        except CheckpointError as e:
            raise CheckpointError(
                f"save to {final}: every process wrote its part, but the outcome of the commit is unknown "
                f"here (check for {final} before relying on it): {e}"
            ) from None
        if error is not None:
            raise error
        if outcome.get("exists"):
            raise FileExistsError(
                errno.EEXIST, "another save committed a checkpoint here first; this one committed nothing "
                "(pass overwrite=True to replace it)", final)
        if outcome["error"]:
            raise CheckpointError(f"save to {final} failed, nothing committed: {outcome['error']}")
        if outcome.get("not_durable"):
            raise NotDurableError(outcome["not_durable"])

    def _commit(self, statuses: list[dict]) -> None:
        from ckpt._version import __version__

        collected: dict[int, dict[int, int]] = {}
        for s in statuses:
            for array, flat, crc in s["sums"]:
                collected.setdefault(array, {})[flat] = crc
        stacks = []
        for s, stack in enumerate(self.stacks):
            n = int(np.prod(chunk_grid(stack.shape, stack.zarr.chunk_shape)))
            got = collected.get(-1 - s, {})
            if len(got) != n:
                raise CheckpointError(f"stack {s} ({stack.zarr.path}): {len(got)} of {n} chunks were written")
            stacks.append(dataclasses.replace(stack, zarr=dataclasses.replace(
                stack.zarr, path=self.staged.prefix + stack.zarr.path, chunk_checksums=tuple(got[k] for k in range(n)))))
        records = []
        for i, leaf in enumerate(self.leaves):
            rec = leaf.record
            st = rec.zarr
            if rec.stacked is not None:
                member = StackedStorage(rec.stacked.stack, rec.stacked.index, stacks[rec.stacked.stack])
                rec = LeafRecord(rec.path, rec.kind, rec.shape, rec.dtype, rec.sharding, member, rec.value, rec.prng_impl)
            elif st is not None:
                n = int(np.prod(chunk_grid(rec.shape, leaf.chunk_shape)))
                got = collected.get(i, {})
                if len(got) != n:
                    raise CheckpointError(f"leaf {rec.path!r}: {len(got)} of {n} chunks were written")
                st = dataclasses.replace(st, path=self.staged.prefix + st.path,
                                         chunk_checksums=tuple(got[k] for k in range(n)))
                rec = LeafRecord(rec.path, rec.kind, rec.shape, rec.dtype, rec.sharding, st, rec.value, rec.prng_impl)
            records.append(rec)
        zarr_json = _check_written(self.staged, array_specs(self.leaves, self.stacks), self.storage.url)
        manifest = Manifest(self.encoding, records, user_metadata=self.user_metadata, library_version=__version__,
                            stacks=stacks, format_version=STACKS_VERSION if stacks else 1, zarr_json=zarr_json)
        commit_checkpoint(self.storage, self.staged, manifest, overwrite=self.overwrite)


def _check_written(staged: Staged, specs: dict[int, tuple[str, ArraySpec]], final: str) -> dict[str, int]:
    """Check that every file the save wrote is still in the staged place, whole (a save never
    commits what someone removed or truncated meanwhile); return the CRC-32C of every zarr.json,
    keyed as the manifest records them."""
    expected: dict[str, int] = {}
    zarr_json: dict[str, int] = {}
    groups = {""} if specs or not staged.prefix else set()  # as _write_chunks writes them
    for path, spec in specs.values():
        meta = array_metadata_bytes(spec)
        expected[f"{path}/zarr.json"] = len(meta)
        zarr_json[f"{staged.prefix}{path}/zarr.json"] = crc32c.crc32c(meta)
        chunk_bytes = math.prod(spec.chunk_shape) * spec.dtype.itemsize
        for index in np.ndindex(*chunk_grid(spec.shape, spec.chunk_shape)):
            expected[f"{path}/{chunk_key(index)}"] = chunk_bytes
        parts = path.split("/")
        groups.update("/".join(parts[:k]) for k in range(1, len(parts)))
    for group in groups:
        key = f"{group}/zarr.json" if group else "zarr.json"
        expected[key] = len(GROUP_METADATA)
        zarr_json[staged.prefix + key] = crc32c.crc32c(GROUP_METADATA)
    found = staged.storage.stat_many(expected)
    bad = [f"{staged.storage.where(k)} ({'missing' if found[k] is None else f'{found[k]} of {n} bytes'})"
           for k, n in expected.items() if found[k] is None or (found[k] >= 0 and found[k] != n)]
    if bad:
        raise CheckpointError(
            f"save to {final}: {len(bad)} file(s) it wrote are gone or changed before the commit, e.g. {bad[0]} "
            "(did another process remove the save's temporary data?); nothing was committed")
    return zarr_json
