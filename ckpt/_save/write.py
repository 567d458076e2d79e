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
from ckpt._save.stage import SaveBudget

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


def write_chunks(writer: ChunkWriter, specs: dict[int, tuple[str, ArraySpec]], chunks: queue.Queue,
                 copied: threading.Event, budget: SaveBudget, max_inflight_bytes: int, pressed: bool = False,
                 max_inflight_writes: int | None = None) -> dict:
    """Write this process's chunks through `writer` as their host copies arrive, then its
    metadata objects; return the chunks' CRC-32Cs, by array id (``array_specs``: `specs`) and
    flat chunk index.

    Each chunk's lease goes back to `budget` once its write is durable and its checksum taken,
    so the caller, waiting for budget, can stage the next chunk. The oldest write is retired
    whenever no new chunk is waiting. While the caller is still copying a save that fits its
    budget (`copied` not set, not `pressed`), few writes go out (COPYING_INFLIGHT_BYTES) and
    checksums wait until a write is retired: the disk starts working without slowing the copies
    the caller waits for. Otherwise writes go out up to `max_inflight_bytes` and checksums are
    computed while they are in flight (direct I/O leaves the CPU idle meanwhile).

    `max_inflight_writes` bounds the writes handed to storage and not yet retired (object
    stores: so that once one chunk has given up after its retries, at most that many others
    were started, whatever the chunk sizes: issue 28, a SlowDown on every PUT).
    """
    grids = {a: chunk_grid(spec.shape, spec.chunk_shape) for a, (_, spec) in specs.items()}
    sums: dict[int, dict[int, int]] = {}
    inflight: deque[_InFlight] = deque()
    unsummed: deque[_InFlight] = deque()
    queued: deque = deque()  # (write, host copy, lease) received, not yet handed to storage
    created: list = []
    inflight_bytes = 0
    ended = False
    # Once a chunk write has failed the save is lost: no new write goes out (a store answering
    # SlowDown to every PUT would otherwise see every chunk retried in turn). Failures are
    # looked for while the writer waits for its oldest write (all writes in flight, every
    # FAILURE_POLL_S), and before each new write (two of them: the newest, and one in turn),
    # which costs two done() calls per chunk and no request.
    cursor = 0

    def spot_check() -> None:
        nonlocal cursor
        if not inflight:
            return
        cursor = (cursor + 1) % len(inflight)
        for e in (inflight[-1], inflight[cursor]):
            if e.future.done():
                e.future.result()  # raises if it failed

    def look_for_failures() -> None:
        """Raise the error of a write in flight that has failed (the first found), if any."""
        for e in inflight:
            if e.future.done():
                e.future.result()  # raises if it failed

    def wait_oldest(future) -> None:
        """Wait for `future` (the oldest write), looking for failures of the others meanwhile."""
        done = future.done
        while not done():
            try:
                future.result(FAILURE_POLL_S)
                return
            except TimeoutError:
                if done():
                    return  # (its own failure, or its own time bound: raised by the caller)
                look_for_failures()
            except BaseException:  # noqa: BLE001 (its own failure: raised by the caller)
                return

    def checksum(e: _InFlight) -> None:
        if e.data is not None:
            sums.setdefault(e.array, {})[e.flat] = chunk_checksum(e.data)
            e.data = None

    def retire() -> None:
        nonlocal inflight_bytes
        wait_oldest(inflight[0].future)
        e = inflight.popleft()
        e.future.result()
        checksum(e)  # (drops the last reference to the chunk's data before the lease goes back)
        inflight_bytes -= e.nbytes
        budget.release(e.lease)

    def submit(item) -> None:
        nonlocal inflight_bytes
        w, host, lease = item
        array = w.array_id
        data = _dtypes.to_storage(host)
        del host
        spec = specs[array][1]
        flat = flat_chunk_index(chunk_index_of(w.box, spec.chunk_shape), grids[array])
        e = _InFlight(None, w.nbytes, array, flat, data, lease)
        e.future = writer.write_chunk(array, w.box, data)
        inflight.append(e)
        unsummed.append(e)
        inflight_bytes += w.nbytes

    try:
        while not ended or queued:
            if not ended and (not chunks.empty() or not (queued or inflight)):
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
            if queued and (not inflight or (inflight_bytes + queued[0][0].nbytes <= limit
                                            and (max_inflight_writes is None or len(inflight) < max_inflight_writes))):
                spot_check()
                submit(queued.popleft())
                continue
            if fast:
                while unsummed:
                    checksum(unsummed.popleft())
            if inflight:
                retire()
        while unsummed:
            checksum(unsummed.popleft())
        # Metadata last: the small fsynced files then overlap the chunk writes in flight.
        created = writer.write_metadata()
        while inflight:
            retire()
        budget.finish()
        for fut in created:
            fut.result()
    except BaseException as error:
        # Wake the caller if it waits for budget that will not come back; drop the writes not
        # yet started where the engine can (a pool's queued calls; TensorStore's requests on
        # object stores), then let every started write finish (or fail, each within its time
        # bound) before the caller removes the temporary directory: a write still running would
        # create files in it again.
        budget.abort(error)
        pending = [e.future for e in inflight] + created
        for fut in pending:
            fut.cancel()
        for fut in pending:
            try:
                fut.result()
            except (Exception, asyncio.CancelledError, concurrent.futures.CancelledError):
                pass
        raise
    return sums
