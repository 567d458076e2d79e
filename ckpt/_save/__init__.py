"""save / save_async: flatten, describe, plan, stage to host, then write and commit in the
background. ``save`` is ``save_async(...).wait()``; there is one save path.
"""

from __future__ import annotations

import atexit

# Imported here so that its exit hook (which stops the shared I/O pools) is registered before
# ours: threading runs these hooks last registered first, so pending saves finish first.
import concurrent.futures.thread  # noqa: F401
import concurrent.futures
import dataclasses
import errno
import hashlib
import logging
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from typing import Any

import crc32c
import msgpack
import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import ALIGN, LeafRecord, Stack, StackedStorage, flatten, storage_paths
from ckpt._geometry import chunk_grid
from ckpt._memory import gc_paused
from ckpt._options import Options, resolve, save_chunk_cap

# The door: convert commits as a save does, writing the same groups.
from ckpt._save.commit import (  # noqa: F401
    INDEX_DIR,
    PackedSave,
    commit_packed,
    commit_written,
    group_paths,
)
from ckpt._save.plan import (
    STACK_CHUNK_BYTES,
    Leaf,
    SavePlan,
    array_shards,
    describe,
    finish_array_records,
    pack_records,
    plan_save,
)
from ckpt._save.stage import (
    SaveBudget,
    StagingAborted,
    release_host_memory,  # noqa: F401 (the door)
    stage,
)
from ckpt._save.write import END, _write_chunks, array_specs, metadata_share
from ckpt._commit import Coordinator, Staged, after_failed_commit, commit_for, current_coordinator
from ckpt._errors import NotDurableError, OutcomeUnknownError
from ckpt.storage import PackWriter, Storage, open_storage

_log = logging.getLogger("ckpt")

# Seconds the interpreter's exit waits for pending saves before it says so on stderr.
EXIT_NOTICE_S = 2.0


class _Cancel:
    """Whether a save was cancelled, and whether it is past the point where it still can be (its
    commit): one lock, so that a cancel and the commit never both happen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requested = False
        self.committing = False

    def request(self) -> bool:
        with self._lock:
            if not self.committing:
                self.requested = True
            return self.requested

    def may_commit(self) -> bool:
        """Pass the point of no return, unless cancelled first."""
        with self._lock:
            if not self.requested:
                self.committing = True
            return not self.requested


class SaveHandle:
    """A save in progress, as ``save_async`` returns it (not constructed directly).

    The host copies are already taken when it is returned: the saved arrays may be donated,
    deleted or overwritten. The rest of the save (writes, commit) runs on a background thread.

    A save nobody waits for still completes: when the interpreter exits, it waits for pending
    saves first (saying so on stderr after 2 s); a save that fails then is reported on stderr
    with its traceback and the exit status is 1. A handle whose save failed and that is dropped
    without ``wait()`` logs a warning (logger ``ckpt``) naming the path.

    Attributes:
        path: the checkpoint's location, as shown in messages.
    """

    def __init__(self, path: str, work, cancel: _Cancel | None = None) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._observed = False  # wait() raised the error: the caller knows
        self._cancel = cancel or _Cancel()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(work,), name="ckpt-save")
        with _handles_lock:
            _handles.add(self)
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

    def cancel(self) -> bool:
        """Stop the save unless it is already committing. Never blocks.

        A cancelled save issues no more writes, lets those in flight end, removes its staged
        data and commits nothing; ``wait()`` then raises ``CheckpointError`` ("cancelled"). In a
        multi-process job the whole save is cancelled (every process's ``wait()`` raises).
        Ctrl-C (KeyboardInterrupt) during ``wait()`` cancels the same way.

        Returns:
            True if the save commits nothing (cancelled now or before, or it failed before its
            commit); False if it had already begun its commit (``wait()`` says how that ended).
        """
        return self._cancel.request()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed.

        Ctrl-C (KeyboardInterrupt) while waiting cancels the save (see ``cancel``): once its
        writes in flight have ended and its staged data is removed, the KeyboardInterrupt is
        re-raised and nothing is committed (unless the commit had already begun: it then ends
        first, committed or failed).

        Args:
            timeout: seconds to wait at most; None waits as long as the save takes.

        Raises:
            TimeoutError: the save is still running after `timeout` seconds (it goes on).
            CheckpointError: the save failed in the background (re-raised with its original
                traceback; a failure of the storage is its ``__cause__``), or it was cancelled;
                nothing was committed. Also ``OSError`` from the storage and
                ``FileExistsError`` when another save committed at `path` first.
        """
        try:
            finished = self._done.wait(timeout)
        except KeyboardInterrupt:
            # The caller gives up on this save: it must not commit later behind its back (say
            # while the interpreter exits). A second Ctrl-C stops this wait; the cleanup goes on.
            self.cancel()
            self._done.wait()
            raise
        if not finished:
            raise TimeoutError(f"save to {self.path} still running after {timeout} s")
        if self._error is not None:
            self._observed = True
            raise self._error

    @property
    def stats(self) -> dict | None:
        """Figures of the save once it committed (None before, or when it failed).

        ``{"process": {...}, "job": {...}}``: this process's seconds planning (``plan_s``),
        copying to host (``copy_s``), writing (``write_s``), waiting for the others
        (``wait_s``) and, on the primary, committing (``commit_s``), its ``bytes``, ``writes``
        and storage ``requests``; the job's ``bytes``, ``requests``, ``slowest`` process and its
        ``slowest_s`` (host copy + writes), and on the primary (process 0) ``processes``, every
        process's figures. Logged at INFO (logger ``ckpt``) when the save commits.
        """
        job = getattr(self, "_job", None)
        if job is None or not self._done.is_set() or self._error is not None or job.job_stats is None:
            return None
        return {"process": dict(job.stats, process=job.coord.process_index), "job": job.job_stats}

    def _unreported_failure(self) -> BaseException | None:
        """The error of a save that failed, was not cancelled, and whose error nobody saw."""
        if self._done.is_set() and self._error is not None and not self._observed and not self._cancel.requested:
            return self._error
        return None

    def __del__(self) -> None:
        try:
            error = self._unreported_failure()
            if error is None:
                return
            self._observed = True
            _log.warning("jax-ckpt: the save to %s failed and was never waited on (its SaveHandle was dropped "
                         "without wait()): %s", self.path, _describe(error))
        except Exception:  # (a handle whose __init__ failed; or the interpreter is tearing down)
            pass


def _describe(e: BaseException) -> str:
    """``Type: text``, or ``Type`` alone for an exception without text."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# Every SaveHandle alive (a running save's thread holds its handle), for the exit hook.
_handles: "weakref.WeakSet[SaveHandle]" = weakref.WeakSet()
_handles_lock = threading.Lock()
_exit_failed = False  # a save failed (or was interrupted) at exit: the exit status becomes 1


def _saves(n: int) -> str:
    return f"{n} save" if n == 1 else f"{n} saves"


def _finish_at_exit() -> None:
    """Run when the main thread has ended, before concurrent.futures stops the I/O pools and
    before the interpreter joins its threads: every pending save (not cancelled) finishes now,
    announced on stderr after EXIT_NOTICE_S; Ctrl-C meanwhile cancels them. Then every failure
    nobody saw is printed on stderr with its traceback, and the exit status becomes 1
    (``_exit_status``). Never raises: an exception here would skip the other exit hooks."""
    global _exit_failed
    try:
        with _handles_lock:
            handles = list(_handles)
        pending = [h for h in handles if not h.done() and not h._cancel.requested]
        try:
            deadline = time.monotonic() + EXIT_NOTICE_S
            for h in pending:
                h._done.wait(max(0.0, deadline - time.monotonic()))
            left = [h for h in pending if not h.done()]
            if left:
                print(f"jax-ckpt: waiting for {_saves(len(left))} in progress to "
                      f"{', '.join(h.path for h in left)} before exiting (Ctrl-C cancels)",
                      file=sys.stderr, flush=True)
                for h in left:
                    h._done.wait()
        except KeyboardInterrupt:
            left = [h for h in pending if not h.done() and h.cancel()]
            if left:
                _exit_failed = True
                print(f"jax-ckpt: interrupted while exiting: cancelled {_saves(len(left))} in progress to "
                      f"{', '.join(h.path for h in left)}; nothing of {'it' if len(left) == 1 else 'them'} "
                      "is committed", file=sys.stderr, flush=True)
            try:
                for h in left:
                    h._done.wait()  # (their staged data is being removed)
            except KeyboardInterrupt:
                pass
        for h in handles:
            error = h._unreported_failure()
            if error is None:
                continue
            h._observed = True
            _exit_failed = True
            when = "while the interpreter was exiting" if h in pending else "and was never waited on"
            print(f"jax-ckpt: the save to {h.path} failed {when} (the program did not wait() for it):\n"
                  + "".join(traceback.format_exception(error)).rstrip(), file=sys.stderr, flush=True)
    except BaseException as e:  # noqa: BLE001 (see the docstring)
        try:
            print(f"jax-ckpt: finishing pending saves at exit failed: {_describe(e)}", file=sys.stderr, flush=True)
        except BaseException:  # noqa: BLE001
            pass


def _exit_status() -> None:
    """The exit status of a program whose save failed at exit: 1. Registered with atexit when this
    module is imported, so it runs after the exit handlers registered later; os._exit (there is
    no other way to change the status once the program's code has ended) skips those registered
    before jax-ckpt was imported, so logging and the standard streams are flushed here first."""
    if not _exit_failed:
        return
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    finally:
        os._exit(1)


try:
    # The hook concurrent.futures registers too (imported above, so ours runs before it).
    threading._register_atexit(_finish_at_exit)
    atexit.register(_exit_status)
except (AttributeError, RuntimeError):  # another Python; or imported while the interpreter exits
    pass


def _fingerprint(final: str, overwrite: bool, tree: dict, leaves: list[Leaf], plan: SavePlan,
                 layout: str = "files") -> bytes:
    """A hash of what every process must agree on: the inputs of the plan (tree, shapes, dtypes,
    shardings, chunk shapes, path), and the packing of small arrays every process computes alike
    (O(leaves)). Never the writes: each process plans only its own (plan_save's `process`)."""
    view = [
        [l.record.path, l.record.kind, l.record.shape, l.record.dtype, l.record.sharding,
         type(l.record.storage).__name__, l.chunk_shape]
        for l in leaves
    ]
    # Which leaves are packed, and where, follows from shardings and device placement; every
    # process must have come to the same layout.
    packing = [plan.whole, [(st.members, st.process) for st in plan.stacks]]
    return hashlib.sha256(msgpack.packb([final, overwrite, tree, view, packing, layout], use_bin_type=True)).digest()


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
            f"dtypes, shardings, chunk shapes (host_budget_bytes, max_chunk_bytes), layout (Options.layout, CKPT_LAYOUT) "
            f"or path than process(es) {majority}; nothing was written"
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


# Object stores: a data object is one PUT, two of a process in flight. Its bytes in about six
# objects of at least 64 MiB keep its uploads parallel: one process saving 1 GiB to SeaweedFS
# (python -m bench --gib 1 --url s3://... --seaweedfs, CKPT_LAYOUT=packed), save / raw PUT was
# 1.04 with 64 MiB objects, 0.78 with 256 MiB and 0.50 with 1 GiB. Six data objects and the
# index object stay within the 8 objects a process of issue 23's bound.
PUT_OBJECTS, MIN_PUT_OBJECT_BYTES = 6, 64 << 20


def _packing(plan: SavePlan, shards, opts: Options, budget: SaveBudget, staged: Storage, writes) -> PackedSave:
    """The packed layout's part of a save. Data objects of `pack_object_bytes`; where the engine
    writes whole objects (object stores), also at most a quarter of the budget and about a sixth
    of this process's bytes (at least 64 MiB), with two assembly buffers of that size (or of this
    process's bytes, when fewer) from the budget, taken now, before any chunk is staged: the
    writer never waits for budget the copies hold."""
    target = opts.pack_object_bytes
    # (each chunk at most ALIGN bytes of padding before it)
    mine = sum(w.nbytes for w in writes) + ALIGN * len(writes)
    if not staged.streams_packs:
        target = min(target, max(budget.limit // 4, 1 << 20), max(MIN_PUT_OBJECT_BYTES, -(-mine // PUT_OBJECTS)))
    packing = PackedSave(plan, shards, target)
    if not staged.streams_packs and writes:
        packing.buffer_bytes = min(target, mine)
        packing.leases = [budget.acquire(packing.buffer_bytes, buffer=True) for _ in range(1 if mine <= target else 2)]
    return packing


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
    started = time.perf_counter()
    # First, before anything can fail, so that every process's count of saves stays the same.
    save_id = coord.new_save_id()
    try:
        try:
            encoding, flat = flatten(tree)
            leaves = [describe(l, coord.process_count, cap) for l in flat]
            finish_array_records(leaves, storage_paths([l.components for l in flat]))
            # (packed chunks stay within the cap too)
            # This process's writes only: the job's plan is never built (issue 23).
            shards = array_shards(leaves)
            plan = plan_save(shards, pack_limit=min(opts.pack_limit_bytes, cap),
                             stack_chunk_bytes=min(STACK_CHUNK_BYTES, cap), process=coord.process_index)
            stacks = pack_records(leaves, plan)
            my_writes = plan.writes
            layout = "packed" if opts.layout == "packed" or (opts.layout == "auto" and coord.process_count > 1) \
                else "files"
            view, own_error = {"plan": _fingerprint(final, overwrite, encoding, leaves, plan, layout)}, None
        except Exception as e:  # the others learn of it now instead of waiting for this process
            view, own_error = {"error": f"{type(e).__name__}: {e}"}, e
        plan_s = time.perf_counter() - started
        # The views go to the primary alone, which checks them before staging the save.
        views = coord.gather(f"{save_id}/plan", msgpack.packb(view))
        if own_error is not None and views is None:
            raise own_error

        mine: list[Staged] = []  # the primary's own Staged: it holds the staged place's lock

        def prepare() -> bytes:
            _check_fingerprints([msgpack.unpackb(v) for v in views])
            try:
                mine.append(commit_for(storage).stage(overwrite=overwrite))
                return msgpack.packb({"staged": mine[0].info})
            except OSError as e:
                return msgpack.packb({"errno": e.errno, "error": str(e.strerror)})

        try:
            decision = msgpack.unpackb(coord.broadcast(f"{save_id}/prepare", prepare))
        except CheckpointError:
            if own_error is not None:  # the primary's own planning error (the others got its text)
                raise own_error from None
            raise
        if "staged" not in decision:
            raise OSError(decision["errno"], decision["error"], final)
        staged = mine[0] if mine else commit_for(storage).staged_from(decision["staged"])
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
    if layout == "packed":
        job.packing = _packing(plan, shards, opts, budget, staged.storage, my_writes)
    job.stats.update(plan_s=plan_s, bytes=sum(w.nbytes for w in my_writes), writes=len(my_writes))
    handle = SaveHandle(final, lambda: job.run(chunks, copied, budget, pressed), job.cancel)
    handle._job = job  # (SaveHandle.stats)
    handle._budget = budget  # (read by tests: its high-water mark)
    copy_start = time.perf_counter()
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
    job.stats["copy_s"] = time.perf_counter() - copy_start
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


def _cancelled(final: str) -> CheckpointError:
    return CheckpointError(f"save to {final} was cancelled (SaveHandle.cancel(), or Ctrl-C during wait()): "
                           "nothing was committed and its staged data is removed")


class _StopOnCancel:
    """The staged storage as the writer sees it: once the save is cancelled, every further write
    raises the cancellation, so the writer stops issuing writes, lets those in flight end and
    fails (its failure path), and the primary then removes the staged data."""

    def __init__(self, storage: Storage, cancel: _Cancel, final: str) -> None:
        self._storage, self._cancel, self._final = storage, cancel, final

    def __getattr__(self, name: str):
        return getattr(self._storage, name)

    def _check(self) -> None:
        if self._cancel.requested:
            raise _cancelled(self._final)

    def write_chunk(self, *args):
        self._check()
        return self._storage.write_chunk(*args)

    def create_array(self, *args):
        self._check()
        return self._storage.create_array(*args)

    def put_group(self, *args):
        self._check()
        return self._storage.put_group(*args)


# The durations each process reports, in this order, then its bytes and requests.
_TIMES = ("plan_s", "copy_s", "write_s")


def _job_stats(statuses: list[dict], own: dict) -> dict:
    """The primary's view of a save: every process's figures and the slowest one."""
    per = []
    for p, s in enumerate(statuses):
        figures = s.get("stats") or [0.0] * (len(_TIMES) + 2)
        row = dict(zip(_TIMES, figures[:len(_TIMES)]))
        row.update(process=p, bytes=figures[len(_TIMES)], requests=figures[len(_TIMES) + 1])
        per.append(row)
    slowest = max(per, key=lambda r: (r["copy_s"] + r["write_s"], -r["process"]))
    return {"processes": per, "slowest": slowest["process"],
            "slowest_s": round(slowest["copy_s"] + slowest["write_s"], 4),
            "bytes": sum(r["bytes"] for r in per), "requests": sum(r["requests"] for r in per),
            "wait_s": round(own.get("wait_s", 0.0), 4)}


def _summary(job: dict) -> dict:
    """What the other processes learn of the job's figures: O(1), not the table."""
    return {k: v for k, v in job.items() if k != "processes"} | {"process_count": len(job["processes"])}


def _log_stats(final: str, job: dict | None) -> None:
    if job is None or not _log.isEnabledFor(logging.INFO):
        return
    _log.info("jax-ckpt: saved %s: %d bytes, %d requests over %d process(es); slowest process %d "
              "(host copy + writes %.3f s)", final, job["bytes"], job["requests"],
              job.get("process_count", len(job.get("processes", ()))), job["slowest"], job["slowest_s"])


class _SaveJob:
    """The background part of one save: write this process's chunks, exchange reports, commit."""

    def __init__(self, coord: Coordinator, save_id: str, storage: Storage, staged: Staged, overwrite: bool,
                 encoding: dict, leaves: list[Leaf], user_metadata: dict | None, options: Options,
                 stacks: list[Stack] = ()):
        self.coord, self.save_id, self.storage, self.staged = coord, save_id, storage, staged
        self.overwrite, self.encoding, self.leaves = overwrite, encoding, leaves
        self.user_metadata, self.options, self.stacks = user_metadata, options, list(stacks)
        self.cancel = _Cancel()  # SaveHandle.cancel()
        # This process's figures (seconds: plan_s, copy_s, write_s, wait_s, commit_s; bytes,
        # writes, requests), and the job's once committed (SaveHandle.stats).
        self.stats: dict = {}
        self.job_stats: dict | None = None
        self._own_sums: dict = {}
        self.packing: PackedSave | None = None  # the packed layout (format version 3), else files

    def run(self, chunks: queue.Queue, copied: threading.Event, budget: SaveBudget, pressed: bool) -> None:
        try:
            self._exchange_and_commit(chunks, copied, budget, pressed)
        finally:
            self.staged.release()  # (commit and abort release it; this covers any other exit)
            self.coord.end_save(self.save_id)

    def _abort(self) -> None:
        try:
            commit_for(self.storage).abort(self.staged)
        except OSError:
            pass  # left for cleanup: never a checkpoint, since no manifest points to it

    def _exchange_and_commit(self, chunks: queue.Queue, copied: threading.Event, budget: SaveBudget,
                             pressed: bool) -> None:
        coord, final = self.coord, self.storage.url
        primary = coord.process_index == 0
        error: BaseException | None = None
        sums: dict = {}
        write_start = time.perf_counter()
        packing = self.packing
        target: Any = self.staged.storage
        if packing is not None:
            packing.writer = target = PackWriter(target, coord.process_index, packing.target_bytes,
                                                 [lease.buffer[:packing.buffer_bytes] for lease in packing.leases])
        try:
            sums = _write_chunks(_StopOnCancel(target, self.cancel, final), self.leaves, chunks,
                                 primary, copied, budget, self.options.max_inflight_bytes, self.staged.prefix,
                                 self.stacks, pressed,
                                 # Object stores: at most two requests per I/O slot in flight
                                 # (the engine runs io_concurrency at once; one more each keeps
                                 # them busy), so a failing chunk stops the save within one round.
                                 max_inflight_writes=None if self.storage.renames or packing else 2 * self.options.io_concurrency,
                                 share=(coord.process_index, coord.process_count))
            if packing is not None:
                packing.writer.close()  # every data object durable (or the first failure)
        except BaseException as e:
            error = e
            if packing is not None:
                packing.writer.abandon()  # (every write started has ended: the abort may remove them)
        finally:
            if packing is not None:
                for lease in packing.leases:
                    budget.release(lease)
                packing.leases = []
        self.stats["write_s"] = time.perf_counter() - write_start
        specs = array_specs(self.leaves, self.stacks)  # (and its share of the zarr.json files)
        if packing is not None:
            self.stats["requests"] = packing.writer.requests
        else:
            self.stats["requests"] = self.stats.get("writes", 0) + len(
                metadata_share(specs, coord.process_index, coord.process_count))
            if primary:
                self.stats["requests"] += len(group_paths((path for path, _ in specs.values()), self.staged.prefix))
        # The point of no return: past it, cancel() refuses; before it, a cancel (here, or on
        # any process: its error reaches the primary) makes the primary abort the save.
        if error is None and not self.cancel.may_commit():
            error = _cancelled(final)
        index = None
        if error is None and (packing is not None or not primary):
            try:
                index = self._put_packed_index(sums, specs) if packing is not None else self._put_index(sums)
            except BaseException as e:
                error = e
        self._own_sums = sums
        st = self.stats
        # O(1) bytes whatever the number of chunks: the checksums are in the index object.
        status = msgpack.packb(
            {"error": None if error is None else _describe(error), "index": index,
             "stats": [round(st.get(k, 0.0), 4) for k in _TIMES] + [st.get("bytes", 0), st.get("requests", 0)]},
            use_bin_type=True,
        )
        wait_start = time.perf_counter()
        gathered, gather_error = None, None
        try:
            gathered = coord.gather(f"{self.save_id}/written", status)
        except CheckpointError as e:
            if not primary:  # (this process could not post: the service is gone)
                raise CheckpointError(f"save to {final} failed: {e}") from None
            gather_error = e  # the primary never commits without every process's report
        # The storage's own exception when this process's commit failed: the cause of the error
        # raised here (the other processes only learn its text).
        commit_error: list[BaseException] = []

        def commit() -> bytes:
            st["wait_s"] = time.perf_counter() - wait_start
            commit_start = time.perf_counter()
            try:
                return self._decide(gathered, gather_error, commit_error)
            finally:
                st["commit_s"] = time.perf_counter() - commit_start

        try:
            outcome = msgpack.unpackb(coord.broadcast(f"{self.save_id}/commit", commit))
        except CheckpointError as e:
            raise CheckpointError(
                f"save to {final}: every process wrote its part, but the outcome of the commit is unknown "
                f"here (check for {final} before relying on it): {e}"
            ) from None
        if not primary:
            st["wait_s"] = time.perf_counter() - wait_start
            self.job_stats = outcome.get("stats")
        if error is not None:
            raise error
        cause = commit_error[0] if commit_error else None
        if outcome.get("exists"):
            raise FileExistsError(
                errno.EEXIST, "another save committed a checkpoint here first; this one committed nothing "
                "(pass overwrite=True to replace it)", final) from cause
        if outcome.get("unknown"):
            # The manifest write may have landed: nothing the save wrote was deleted.
            raise OutcomeUnknownError(
                f"save to {final}: the outcome of its commit is unknown (committed or not): {outcome['error']}; "
                f"nothing it wrote was deleted: check for {final} (ckpt ls, ckpt verify) before relying on it"
            ) from cause
        if outcome["error"]:
            raise CheckpointError(f"save to {final} failed, nothing committed: {outcome['error']}") from cause
        _log_stats(final, self.job_stats)
        if outcome.get("not_durable"):
            raise NotDurableError(outcome["not_durable"])

    def _put_index(self, sums: dict) -> dict:
        """Write this process's chunk checksums into the staged place (its index object, which
        the primary reads once at the commit); return what the status says of it."""
        data = msgpack.packb([[array, flat, crc] for array, m in sums.items() for flat, crc in m.items()],
                             use_bin_type=True)
        key = f"{INDEX_DIR}/{self.coord.process_index}"
        self.staged.storage.put(key, data).result()
        self.stats["requests"] = self.stats.get("requests", 0) + 1
        return {"key": key, "size": len(data), "crc": crc32c.crc32c(data)}

    def _put_packed_index(self, sums: dict, specs: dict) -> dict:
        """Packed layout: write this process's index object (its chunks' places and CRC-32Cs,
        and pointers to the writers of the chunks it holds and others wrote); return what the
        status says of it (O(1) bytes: the primary never reads it)."""
        packing, process = self.packing, self.coord.process_index
        data = packing.index_object(process, self.staged.prefix, sums, specs)
        key = f"{INDEX_DIR}/{process}"
        self.staged.storage.put(key, data).result()
        self.stats["requests"] = self.stats.get("requests", 0) + 1
        return {"key": key, "size": len(data), "crc": crc32c.crc32c(data), "chunks": packing.written,
                "places": packing.places}

    def _decide(self, gathered: list[bytes] | None, gather_error: BaseException | None,
                commit_error: list[BaseException]) -> bytes:
        """The primary's commit step: the outcome every process gets (msgpack)."""
        if gather_error is not None:
            self._abort()
            return msgpack.packb({"error": str(gather_error)})
        statuses = [msgpack.unpackb(s, strict_map_key=False) for s in gathered]
        self.job_stats = _job_stats(statuses, self.stats)
        failed = {p: s["error"] for p, s in enumerate(statuses) if s["error"]}
        if failed:
            self._abort()
            return msgpack.packb({"error": "; ".join(f"process {p}: {e}" for p, e in failed.items())})
        try:
            self._commit(statuses)
            return msgpack.packb({"error": None, "stats": _summary(self.job_stats)})
        except NotDurableError as e:  # committed: nothing to abort, the save succeeded
            return msgpack.packb({"error": None, "not_durable": str(e), "stats": _summary(self.job_stats)})
        except BaseException as e:
            commit_error.append(e)
            # A lost race (another save committed here first) stays a FileExistsError.
            after_failed_commit(self.storage, self.staged, e)
            return msgpack.packb({"error": f"commit failed: {_describe(e)}",
                                  "exists": isinstance(e, FileExistsError),
                                  "unknown": isinstance(e, OutcomeUnknownError) or not isinstance(e, Exception)})

    def _collect_sums(self, statuses: list[dict]) -> dict[int, dict[int, int]]:
        """Every chunk's checksum: the primary's own, and each other process's index object,
        read once each (io_concurrency at a time) and checked against its status."""
        collected: dict[int, dict[int, int]] = {}
        for array, m in self._own_sums.items():
            collected.setdefault(array, {}).update(m)
        wanted = [(p, s["index"]) for p, s in enumerate(statuses) if p != self.coord.process_index]
        storage = self.staged.storage

        def fetch(item):
            p, index = item
            if not index:
                raise CheckpointError(f"process {p} reported no index object")
            data = storage.get(index["key"], max_bytes=index["size"])
            if len(data) != index["size"] or crc32c.crc32c(data) != index["crc"]:
                raise CheckpointError(
                    f"{storage.where(index['key'])}: the index object of process {p} holds {len(data)} bytes "
                    f"with CRC-32C {crc32c.crc32c(data):#010x}, not the {index['size']} bytes with "
                    f"{index['crc']:#010x} it reported (removed or changed before the commit?)")
            return msgpack.unpackb(data)

        if wanted:
            with concurrent.futures.ThreadPoolExecutor(min(len(wanted), self.options.io_concurrency)) as pool:
                for entries in pool.map(fetch, wanted):
                    for array, flat, crc in entries:
                        collected.setdefault(array, {})[flat] = crc
        return collected

    def _commit(self, statuses: list[dict]) -> None:
        """Gather every process's chunk checksums into the records, then commit_written."""
        if self.packing is not None:
            records, stacks, section = self.packing.manifest_parts(self.leaves, self.stacks, statuses,
                                                                   self.staged.prefix, array_specs(self.leaves, self.stacks))
            commit_packed(self.storage, self.staged, self.encoding, records, stacks, section,
                          overwrite=self.overwrite, user_metadata=self.user_metadata,
                          objects=self.packing.own_objects(statuses, self.coord.process_index)
                          if self.coord.process_count == 1 else None)
            return
        collected = self._collect_sums(statuses)
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
        # One process: every file it wrote is checked (one listing per directory). Several: the
        # primary checks what the processes reported (their index objects, read above, and every
        # chunk of every array accounted for) and lists nothing: a listing of the generation
        # grows with its objects (13,816 LIST pages at 1,024 hosts, issue 23).
        commit_written(self.storage, self.staged, self.encoding, records, array_specs(self.leaves, self.stacks),
                       overwrite=self.overwrite, stacks=stacks, user_metadata=self.user_metadata,
                       check_files=self.coord.process_count == 1)

