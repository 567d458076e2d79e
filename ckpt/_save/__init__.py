"""save / save_async: flatten, describe, plan, stage to host, then write and commit in the
background. ``save`` is ``save_async(...).wait()``; there is one save path.

Size: the public save and its handle, and the named steps it runs in order (plan, agree, copy,
write, finish).
"""

from __future__ import annotations

import atexit

import dataclasses
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

import msgpack

from ckpt._errors import CheckpointError
from ckpt._format import flatten, storage_paths
from ckpt._exit import EXIT_NOTICE_S, on_exit
from ckpt._host import gc_paused
from ckpt._host import Options, resolve, save_chunk_cap

from ckpt._save.plan import (
    STACK_CHUNK_BYTES,
    Leaf,
    SavePlan,
    array_shards,
    describe,
    finish_array_records,
    bundle_records,
    plan_save,
)
from ckpt._save.host_copy import (
    SaveBudget,
    StagingAborted,
    release_host_memory,  # noqa: F401 (the door)
    copy_to_host,
)
from ckpt._save.job import Cancel, SaveJob, describe_error
from ckpt._save.job import END
from ckpt._commit import Staged, commit_for, current_coordinator
from ckpt._layout import SaveFacts, array_specs, layout_name, save_layout
from ckpt.storage import open_storage

_log = logging.getLogger("ckpt")



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

    def __init__(self, path: str, work, cancel: Cancel | None = None) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._observed = False  # wait() raised the error: the caller knows
        self._cancel = cancel or Cancel()
        self._job: SaveJob | None = None  # (set by start_save: its figures, SaveHandle.stats)
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
        job = self._job
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
                         "without wait()): %s", self.path, describe_error(error))
        except Exception:  # (a handle whose __init__ failed; or the interpreter is tearing down)
            pass


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
            print(f"jax-ckpt: finishing pending saves at exit failed: {describe_error(e)}", file=sys.stderr, flush=True)
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


# The library's one exit hook (ckpt._exit): the saves' part runs after the managers'.
on_exit(_finish_at_exit, rank=1)
try:
    atexit.register(_exit_status)
except RuntimeError:  # imported while the interpreter exits
    pass


@dataclasses.dataclass
class _Planned:
    """What this process planned of a save (``_plan``)."""

    encoding: dict  # the encoded tree
    leaves: list[Leaf]
    shards: list
    plan: SavePlan  # this process's writes only: the job's plan is never built (issue 23)
    stacks: list
    layout: str


def _fingerprint(final: str, overwrite: bool, planned: _Planned) -> bytes:
    """A hash of what every process must agree on: the inputs of the plan (tree, shapes, dtypes,
    shardings, chunk shapes, path), and the bundling of small arrays every process computes alike
    (O(leaves)). Never the writes: each process plans only its own (plan_save's `process`)."""
    leaves, plan = planned.leaves, planned.plan
    view = [
        [l.record.path, l.record.kind, l.record.shape, l.record.dtype, l.record.sharding,
         type(l.record.storage).__name__, l.chunk_shape]
        for l in leaves
    ]
    # Which leaves are bundled, and where, follows from shardings and device placement; every
    # process must have come to the same layout.
    bundling = [plan.whole, [(st.members, st.process) for st in plan.stacks]]
    return hashlib.sha256(msgpack.packb([final, overwrite, planned.encoding, view, bundling, planned.layout],
                                        use_bin_type=True)).digest()


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
            planned = _plan(tree, opts, cap, coord)
            view, own_error = {"plan": _fingerprint(final, overwrite, planned)}, None
        except Exception as e:  # the others learn of it now instead of waiting for this process
            view, own_error = {"error": f"{type(e).__name__}: {e}"}, e
        plan_s = time.perf_counter() - started
        staged = _prepare(coord, save_id, storage, overwrite, view, own_error)
    except BaseException:
        coord.end_save(save_id)
        raise

    p = planned
    my_writes = p.plan.writes
    chunks: queue.Queue = queue.Queue()
    copied = threading.Event()  # set once every host copy exists
    budget = SaveBudget(opts.host_budget_bytes, keep=opts.staging_pool)
    # More bytes than the budget: the caller waits for the disk anyway, so writes need not wait
    # for the copies to end.
    pressed = sum(w.nbytes for w in my_writes) > budget.limit
    facts = SaveFacts(storage, staged, p.encoding, p.leaves, p.stacks, array_specs(p.leaves, p.stacks), overwrite,
                      user_metadata, coord.process_index, coord.process_count, opts.io_concurrency)
    job = SaveJob(coord, save_id, facts, save_layout(p.layout, p.plan, p.shards, opts.pack_object_bytes, budget,
                                                     staged.storage.caps, my_writes), opts)
    job.stats.update(plan_s=plan_s, bytes=sum(w.nbytes for w in my_writes), writes=len(my_writes))
    handle = SaveHandle(final, lambda: job.run(chunks, copied, budget, pressed), job.cancel)
    handle._job = job  # (SaveHandle.stats)
    handle._budget = budget  # (read by tests: its high-water mark)
    copy_start = time.perf_counter()
    try:
        for item in copy_to_host({i: l.source for i, l in enumerate(p.leaves)}, my_writes, budget):
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


def _plan(tree: Any, opts: Options, cap: int, coord) -> _Planned:
    """Describe the leaves of `tree` (chunks of at most `cap` bytes), plan this process's
    writes and choose the layout."""
    encoding, flat = flatten(tree)
    leaves = [describe(l, coord.process_count, cap) for l in flat]
    finish_array_records(leaves, storage_paths([l.components for l in flat]))
    # (bundled chunks stay within the cap too)
    # This process's writes only: the job's plan is never built (issue 23).
    shards = array_shards(leaves)
    plan = plan_save(shards, pack_limit=min(opts.pack_limit_bytes, cap),
                     stack_chunk_bytes=min(STACK_CHUNK_BYTES, cap), process=coord.process_index)
    stacks = bundle_records(leaves, plan)
    return _Planned(encoding, leaves, shards, plan, stacks, layout_name(opts.layout, coord.process_count))


def _prepare(coord, save_id: str, storage, overwrite: bool, view: dict, own_error: Exception | None) -> Staged:
    """Every process's plan (`view`: its fingerprint or its error) to the primary, which checks
    that they agree and stages the save; the staged place back, on every process."""
    final = storage.url
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
    return mine[0] if mine else commit_for(storage).staged_from(decision["staged"])


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
