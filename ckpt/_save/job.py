"""The background part of one save, in named steps (PyTorch DCP's ``save``: plan, agree, write,
finish): write this process's chunks through the layout's writer (``write``), report to the
primary (``report``), and on the primary decide and commit (``decide``); every process then
learns the outcome (``outcome``). The layout (``ckpt._layout``) is a value chosen once: nothing
here asks which one it is.

The write step hands this process's staged chunks to the layout's ``ChunkWriter``, checksums
them, and gives their host memory back to the save's budget once each is durable.

Size: the background part of a save reads top to bottom in one file: its steps and the write step
they run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgpack

from ckpt._commit import Coordinator, after_failed_commit, commit_for
from ckpt._errors import CheckpointError, NotDurableError, OutcomeUnknownError
from ckpt._format import ArraySpec, chunk_checksum, to_storage
from ckpt._geometry import Box, chunk_grid, chunk_index_of, flat_chunk_index
from ckpt._layout import ChunkWriter, SaveFacts, SaveLayout
from ckpt._host import Options
from ckpt._save.host_copy import SaveBudget

_log = logging.getLogger("ckpt")

# The durations each process reports, in this order, then its bytes and requests.
_TIMES = ("plan_s", "copy_s", "write_s")


class Cancel:
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


def describe_error(e: BaseException) -> str:
    """``Type: text``, or ``Type`` alone for an exception without text."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def cancelled(final: str) -> CheckpointError:
    return CheckpointError(f"save to {final} was cancelled (SaveHandle.cancel(), or Ctrl-C during wait()): "
                           "nothing was committed and its staged data is removed")


class _StopOnCancel(ChunkWriter):
    """The layout's writer as the save's writer sees it: once the save is cancelled, every
    further write raises the cancellation, so the writer stops issuing writes, lets those in
    flight end and fails (its failure path), and the primary then removes the staged data."""

    def __init__(self, writer: ChunkWriter, cancel: Cancel, final: str) -> None:
        self._writer, self._cancel, self._final = writer, cancel, final

    def _check(self) -> None:
        if self._cancel.requested:
            raise cancelled(self._final)

    def write_chunk(self, array: int, box: Box, data: Any) -> Any:
        self._check()
        return self._writer.write_chunk(array, box, data)

    def write_metadata(self) -> list:
        self._check()
        return self._writer.write_metadata()


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


class SaveJob:
    """The background part of one save: write this process's chunks, exchange reports, commit."""

    def __init__(self, coord: Coordinator, save_id: str, facts: SaveFacts, layout: SaveLayout, options: Options):
        self.coord, self.save_id, self.facts, self.layout, self.options = coord, save_id, facts, layout, options
        self.cancel = Cancel()  # SaveHandle.cancel()
        # This process's figures (seconds: plan_s, copy_s, write_s, wait_s, commit_s; bytes,
        # writes, requests), and the job's once committed (SaveHandle.stats).
        self.stats: dict = {}
        self.job_stats: dict | None = None

    def run(self, chunks: queue.Queue, copied: threading.Event, budget: SaveBudget, pressed: bool) -> None:
        try:
            error = self._write(chunks, copied, budget, pressed)
            status = self._report(error)
            outcome = self._agree(status)
            self._outcome(outcome, error)
        finally:
            self.facts.staged.release()  # (commit and abort release it; this covers any other exit)
            self.coord.end_save(self.save_id)

    def _write(self, chunks: queue.Queue, copied: threading.Event, budget: SaveBudget,
               pressed: bool) -> BaseException | None:
        """Step 1: this process's chunks through the layout's writer, every one durable (or the
        first failure, returned); then the point of no return."""
        f, layout, final = self.facts, self.layout, self.facts.storage.url
        error: BaseException | None = None
        sums: dict = {}
        write_start = time.perf_counter()
        writer = layout.open(f)
        try:
            sums = write_chunks(_StopOnCancel(writer, self.cancel, final), f.specs, chunks, copied, budget,
                                self.options.max_inflight_bytes, pressed,
                                layout.max_inflight_writes(f.storage.caps, self.options.io_concurrency))
            layout.close()
        except BaseException as e:
            error = e
            layout.abandon()
        finally:
            layout.release(budget)
        self.stats["write_s"] = time.perf_counter() - write_start
        self.stats["requests"] = writer.requests
        self._sums = sums
        # The point of no return: past it, cancel() refuses; before it, a cancel (here, or on
        # any process: its error reaches the primary) makes the primary abort the save.
        if error is None and not self.cancel.may_commit():
            error = cancelled(final)
        return error

    def _report(self, error: BaseException | None) -> bytes:
        """Step 2: what this process tells the primary: its error, or what the layout wrote of
        its chunks (an index object), and its figures; O(1) bytes whatever the chunks."""
        index = None
        if error is None:
            try:
                index = self.layout.report(self.facts, self._sums)
                if index is not None:
                    self.stats["requests"] = self.stats.get("requests", 0) + 1
            except BaseException as e:
                error = e
        self._error = error
        st = self.stats
        return msgpack.packb(
            {"error": None if error is None else describe_error(error), "index": index,
             "stats": [round(st.get(k, 0.0), 4) for k in _TIMES] + [st.get("bytes", 0), st.get("requests", 0)]},
            use_bin_type=True,
        )

    def _agree(self, status: bytes) -> dict:
        """Step 3: every status to the primary, which decides (and commits); its outcome back."""
        coord, final, st = self.coord, self.facts.storage.url, self.stats
        primary = coord.process_index == 0
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
        self._commit_error: list[BaseException] = []

        def commit() -> bytes:
            st["wait_s"] = time.perf_counter() - wait_start
            commit_start = time.perf_counter()
            try:
                return self._decide(gathered, gather_error)
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
        return outcome

    def _outcome(self, outcome: dict, error: BaseException | None) -> None:
        """Step 4: return, or raise what happened (this process's own error first)."""
        final = self.facts.storage.url
        error = self._error or error
        if error is not None:
            raise error
        cause = self._commit_error[0] if self._commit_error else None
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

    def _abort(self) -> None:
        try:
            commit_for(self.facts.storage).abort(self.facts.staged)
        except OSError:
            pass  # left for cleanup: never a checkpoint, since no manifest points to it

    def _decide(self, gathered: list[bytes] | None, gather_error: BaseException | None) -> bytes:
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
            self.layout.commit(self.facts, statuses)
            return msgpack.packb({"error": None, "stats": _summary(self.job_stats)})
        except NotDurableError as e:  # committed: nothing to abort, the save succeeded
            return msgpack.packb({"error": None, "not_durable": str(e), "stats": _summary(self.job_stats)})
        except BaseException as e:
            self._commit_error.append(e)
            # A lost race (another save committed here first) stays a FileExistsError.
            after_failed_commit(self.facts.storage, self.facts.staged, e)
            return msgpack.packb({"error": f"commit failed: {describe_error(e)}",
                                  "exists": isinstance(e, FileExistsError),
                                  "unknown": isinstance(e, OutcomeUnknownError) or not isinstance(e, Exception)})


# ---- the write step ---------------------------------------------------------------------

# Bytes handed to storage and not yet durable, per process, while the caller is still making its
# host copies of a save that fits its budget: enough to keep the disk busy, little enough not to
# slow the copies the caller waits for (measured on 2 cores: 64 MiB kept save throughput within
# noise of unthrottled writes and cut the worst blocking time 2.5x). A save larger than its
# budget waits for the disk anyway, so its writes go out up to max_inflight_bytes at once.
COPYING_INFLIGHT_BYTES = 64 << 20

END = object()  # the last item the caller puts on the chunk queue

# While the writer waits for its oldest chunk write, it looks this often for a failure of the
# others: the first failure stops the save (no new write goes out, queued ones are cancelled).
FAILURE_POLL_S = 0.25


class _InFlight:
    __slots__ = ("future", "nbytes", "array", "flat", "data", "lease")

    def __init__(self, future, nbytes, array, flat, data, lease):
        self.future, self.nbytes, self.array, self.flat, self.data, self.lease = (
            future, nbytes, array, flat, data, lease)


class _Writes:
    """The chunk writes of one save handed to storage and not yet finished, with their checksums
    (``write_chunks``'s bookkeeping)."""

    def __init__(self, writer: ChunkWriter, specs: dict[int, tuple[str, ArraySpec]], budget: SaveBudget) -> None:
        self.writer, self.specs, self.budget = writer, specs, budget
        self.grids = {a: chunk_grid(spec.shape, spec.chunk_shape) for a, (_, spec) in specs.items()}
        self.sums: dict[int, dict[int, int]] = {}
        self.inflight: deque[_InFlight] = deque()
        self.unsummed: deque[_InFlight] = deque()
        self.bytes = 0  # of the writes in flight
        # Once a chunk write has failed the save is lost: no new write goes out (a store answering
        # SlowDown to every PUT would otherwise see every chunk retried in turn). Failures are
        # looked for while the writer waits for its oldest write (all writes in flight, every
        # FAILURE_POLL_S), and before each new write (two of them: the newest, and one in turn),
        # which costs two done() calls per chunk and no request.
        self.cursor = 0

    def spot_check(self) -> None:
        inflight = self.inflight
        if not inflight:
            return
        self.cursor = (self.cursor + 1) % len(inflight)
        for e in (inflight[-1], inflight[self.cursor]):
            if e.future.done():
                e.future.result()  # raises if it failed

    def look_for_failures(self) -> None:
        """Raise the error of a write in flight that has failed (the first found), if any."""
        for e in self.inflight:
            if e.future.done():
                e.future.result()  # raises if it failed

    def wait_oldest(self, future) -> None:
        """Wait for `future` (the oldest write), looking for failures of the others meanwhile."""
        done = future.done
        while not done():
            try:
                future.result(FAILURE_POLL_S)
                return
            except TimeoutError:
                if done():
                    return  # (its own failure, or its own time bound: raised by the caller)
                self.look_for_failures()
            except BaseException:  # noqa: BLE001 (its own failure: raised by the caller)
                return

    def checksum(self, e: _InFlight) -> None:
        if e.data is not None:
            self.sums.setdefault(e.array, {})[e.flat] = chunk_checksum(e.data)
            e.data = None

    def checksum_all(self) -> None:
        """Checksum every write handed to storage and not yet checksummed."""
        while self.unsummed:
            self.checksum(self.unsummed.popleft())

    def finish_oldest(self) -> None:
        self.wait_oldest(self.inflight[0].future)
        e = self.inflight.popleft()
        e.future.result()
        self.checksum(e)  # (drops the last reference to the chunk's data before the lease goes back)
        self.bytes -= e.nbytes
        self.budget.release(e.lease)

    def submit(self, item) -> None:
        w, host, lease = item
        array = w.array_id
        data = to_storage(host)
        del host
        spec = self.specs[array][1]
        flat = flat_chunk_index(chunk_index_of(w.box, spec.chunk_shape), self.grids[array])
        e = _InFlight(None, w.nbytes, array, flat, data, lease)
        e.future = self.writer.write_chunk(array, w.box, data)
        self.inflight.append(e)
        self.unsummed.append(e)
        self.bytes += w.nbytes

    def may_submit(self, nbytes: int, limit: int, max_writes: int | None) -> bool:
        """Whether a write of `nbytes` may go out now: none in flight, or within both bounds."""
        return not self.inflight or (self.bytes + nbytes <= limit
                                     and (max_writes is None or len(self.inflight) < max_writes))

    def abort(self, error: BaseException, created: list) -> None:
        # Wake the caller if it waits for budget that will not come back; drop the writes not
        # yet started where the engine can (a pool's queued calls; TensorStore's requests on
        # object stores), then let every started write finish (or fail, each within its time
        # bound) before the caller removes the temporary directory: a write still running would
        # create files in it again.
        self.budget.abort(error)
        pending = [e.future for e in self.inflight] + created
        for fut in pending:
            fut.cancel()
        for fut in pending:
            try:
                fut.result()
            except (Exception, asyncio.CancelledError, concurrent.futures.CancelledError):
                pass


def write_chunks(writer: ChunkWriter, specs: dict[int, tuple[str, ArraySpec]], chunks: queue.Queue,
                 copied: threading.Event, budget: SaveBudget, max_inflight_bytes: int, pressed: bool = False,
                 max_inflight_writes: int | None = None) -> dict:
    """Write this process's chunks through `writer` as their host copies arrive, then its
    metadata objects; return the chunks' CRC-32Cs, by array id (``array_specs``: `specs`) and
    flat chunk index.

    Each chunk's lease goes back to `budget` once its write is durable and its checksum taken,
    so the caller, waiting for budget, can stage the next chunk. The oldest write is finished
    whenever no new chunk is waiting. While the caller is still copying a save that fits its
    budget (`copied` not set, not `pressed`), few writes go out (COPYING_INFLIGHT_BYTES) and
    checksums wait until a write is finished: the disk starts working without slowing the copies
    the caller waits for. Otherwise writes go out up to `max_inflight_bytes` and checksums are
    computed while they are in flight (direct I/O leaves the CPU idle meanwhile).

    `max_inflight_writes` bounds the writes handed to storage and not yet finished (object
    stores: so that once one chunk has given up after its retries, at most that many others
    were started, whatever the chunk sizes: issue 28, a SlowDown on every PUT).
    """
    writes = _Writes(writer, specs, budget)
    queued: deque = deque()  # (write, host copy, lease) received, not yet handed to storage
    created: list = []
    ended = False
    try:
        while not ended or queued:
            if not ended and (not chunks.empty() or not (queued or writes.inflight)):
                item = chunks.get()
                if item is END:
                    ended = True
                elif isinstance(item, BaseException):
                    raise CheckpointError("copying shards to host failed") from item
                else:
                    queued.append(item)
                    del item
                continue
            fast = pressed or ended or copied.is_set()
            limit = max_inflight_bytes if fast else min(COPYING_INFLIGHT_BYTES, max_inflight_bytes)
            if queued and writes.may_submit(queued[0][0].nbytes, limit, max_inflight_writes):
                writes.spot_check()
                writes.submit(queued.popleft())
                continue
            if fast:
                writes.checksum_all()
            if writes.inflight:
                writes.finish_oldest()
        writes.checksum_all()
        # Metadata last: the small fsynced files then overlap the chunk writes in flight.
        created = writer.write_metadata()
        while writes.inflight:
            writes.finish_oldest()
        budget.finish()
        for fut in created:
            fut.result()
    except BaseException as error:
        writes.abort(error, created)
        raise
    return writes.sums
