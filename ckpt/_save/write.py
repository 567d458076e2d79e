"""The writer of a save: hands this process's staged chunks to storage, checksums them, and
gives their host memory back to the save's budget once each is durable."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections import deque

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import ArraySpec, Stack, chunk_checksum
from ckpt._format import dtypes as _dtypes
from ckpt._geometry import chunk_grid, chunk_index_of, flat_chunk_index
from ckpt._save.commit import group_paths
from ckpt._save.plan import Leaf, PackedWrite
from ckpt._save.stage import SaveBudget
from ckpt.storage import Storage

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


def array_specs(leaves: list[Leaf], stacks: list[Stack]) -> dict[int, tuple[str, ArraySpec]]:
    """(storage path, spec) of every Zarr array of the save, by array id: a leaf's index, or
    ``-1 - s`` for stack s (the ids of the plan's writes)."""
    specs = {}
    for i, leaf in enumerate(leaves):
        st = leaf.record.zarr
        if st is not None:
            attrs = {"jax_ckpt": {"path": leaf.record.path, "dtype": leaf.record.dtype, "encoding": st.encoding}}
            specs[i] = (st.path, ArraySpec(tuple(leaf.record.shape), tuple(leaf.chunk_shape),
                                           np.dtype(st.data_type), attrs))
    members: dict[int, list[str]] = {}
    for leaf in leaves:
        if leaf.record.stacked is not None:
            members.setdefault(leaf.record.stacked.stack, []).append(leaf.record.path)
    for s, stack in enumerate(stacks):
        # The member leaves' paths in stack order, so that a Zarr user can find a leaf's slice.
        attrs = {"jax_ckpt": {"dtype": stack.dtype, "encoding": stack.zarr.encoding, "members": members[s]}}
        specs[-1 - s] = (stack.zarr.path, ArraySpec(stack.shape, stack.zarr.chunk_shape,
                                                     np.dtype(stack.zarr.data_type), attrs))
    return specs


def metadata_share(specs: dict[int, tuple[str, ArraySpec]], process: int, processes: int) -> list[tuple[str, ArraySpec]]:
    """The arrays whose zarr.json `process` writes: every `processes`-th in the specs' order
    (the same on every process), so that no process writes thousands of small files (a 70B
    model's 2,169 leaves made process 0 write 2,897 of them at any scale: issue 23)."""
    return [item for k, item in enumerate(specs.values()) if k % processes == process]


class _InFlight:
    __slots__ = ("future", "nbytes", "array", "flat", "data", "lease")

    def __init__(self, future, nbytes, array, flat, data, lease):
        self.future, self.nbytes, self.array, self.flat, self.data, self.lease = (
            future, nbytes, array, flat, data, lease)


def _write_chunks(storage: Storage, leaves: list[Leaf], chunks: queue.Queue, primary: bool,
                  copied: threading.Event, budget: SaveBudget, max_inflight_bytes: int, prefix: str = "",
                  stacks: list[Stack] = (), pressed: bool = False, max_inflight_writes: int | None = None,
                  share: tuple[int, int] = (0, 1)) -> dict:
    """Write this process's chunks as their host copies arrive; return their CRC-32Cs, by array
    id (see array_specs) and flat chunk index.

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

    `share`: (this process, processes): the arrays' zarr.json files are spread over the
    processes (``metadata_share``); the primary also writes the groups'.
    """
    specs = array_specs(leaves, stacks)
    handles = storage.open_arrays(specs)
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
            done = getattr(e.future, "done", None)
            if done is not None and done():
                e.future.result()  # raises if it failed

    def look_for_failures() -> None:
        """Raise the error of a write in flight that has failed (the first found), if any."""
        for e in inflight:
            done = getattr(e.future, "done", None)
            if done is not None and done():
                e.future.result()  # raises if it failed

    def wait_oldest(future) -> None:
        """Wait for `future` (the oldest write), looking for failures of the others meanwhile."""
        done = getattr(future, "done", None)
        if done is None:
            return
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
        array = w.array if isinstance(w, PackedWrite) else w.leaf
        data = _dtypes.to_storage(host)
        del host
        spec = specs[array][1]
        flat = flat_chunk_index(chunk_index_of(w.box, spec.chunk_shape), grids[array])
        e = _InFlight(None, w.nbytes, array, flat, data, lease)
        e.future = storage.write_chunk(handles[array], w.box, data)
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
        created = [storage.create_array(path, spec) for path, spec in metadata_share(specs, *share)]
        if primary:
            # zarr.json of the root and every intermediate group, so stock zarr can browse the
            # tree: the groups the commit checks for (commit.group_paths).
            created += [storage.put_group(g) for g in sorted(group_paths((path for path, _ in specs.values()), prefix))]
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
            cancel = getattr(fut, "cancel", None)
            if cancel is not None:
                cancel()
        for fut in pending:
            try:
                fut.result()
            except (Exception, asyncio.CancelledError, concurrent.futures.CancelledError):
                pass
        raise
    return sums
