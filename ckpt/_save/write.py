"""The writer of a save: hands this process's staged chunks to the layout's ``ChunkWriter``,
checksums them, and gives their host memory back to the save's budget once each is durable."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections import deque

from ckpt._errors import CheckpointError
from ckpt._format import ArraySpec, chunk_checksum
from ckpt._format import dtypes as _dtypes
from ckpt._geometry import chunk_grid, chunk_index_of, flat_chunk_index
from ckpt._layout import ChunkWriter
from ckpt._save.host_copy import SaveBudget

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
        data = _dtypes.to_storage(host)
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
