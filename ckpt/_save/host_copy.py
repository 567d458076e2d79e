"""The host copy within a byte budget: the device-to-host copies of the chunks this process
writes, into host memory the library owns, never more than the save's host budget at once
("staging" names this step's buffers only; the staged place of a commit is ``ckpt._commit``'s).

A ``SaveBudget`` counts every host byte of one save: staging buffers being filled, chunks
handed to storage and not yet durable, and the free buffers the process-wide ``StagingPool``
keeps. ``copy_to_host`` takes budget before it starts a chunk's copy and blocks while the budget is
spent; the writer gives the budget back when the chunk's write is durable and checksummed. Once
``copy_to_host`` has yielded every chunk, the caller may donate, delete or overwrite the arrays.

Size: the device-to-host step and the budget that bounds it (the staging pool, leases, buffers still
referenced) are one piece of accounting, read together.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from ckpt._format import VALUES, storage_of
from ckpt._geometry import full_box, index_to_box, relative
from ckpt._host import HostBudget
from ckpt._host import return_to_os as _return_to_os
from ckpt._host import unreferenced as _unreferenced
from ckpt._save.plan import HOST, BundledWrite, ShardWrite

PAGE = 4096  # staging buffers are page aligned and sized, for direct (O_DIRECT) writes
# A buffer a storage engine still references when its write is durable (TensorStore lets go of
# the chunk a moment after its future resolves) stays counted until it is unreferenced, for at
# most this long; after that it is taken to be the engine's own (memory:// keeps the very
# buffers it is given as the stored chunks) and no longer counted. Once KEEPER_AFTER buffers of
# a save were, the engine is taken to keep them all: later ones are not waited for.
RELEASE_GRACE_S = 0.1
KEEPER_AFTER = 2

# One condition for the pool and every budget: a budget's bound counts the pool's free bytes.
_COND = threading.Condition()


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _allocate(nbytes: int) -> np.ndarray:
    from ckpt._host import aligned_empty
    return aligned_empty(nbytes, PAGE)


class StagingPool:
    """Free staging buffers, kept for the next chunk of this save and for later saves.

    A training loop saves the same shapes over and over, and a save larger than its budget
    recycles a budget's worth of buffers chunk after chunk. Copying into a buffer the process
    already touched skips the page faults of fresh memory, which here cost 2-3x the copy itself
    (and ~15x when the host has reclaimed the pages). The pool never holds more than the budget
    of the save using it (its free bytes count against that budget), keeps a buffer only once
    nothing else references it, and is emptied by ``ckpt.release_host_memory()``. Buffers come
    from numpy (page aligned), which advises transparent huge pages for large allocations.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}  # by size (whole pages)
        self.free_bytes = 0

    # Every method below runs with _COND held.

    def _pop(self, nbytes: int, most: float = 2) -> np.ndarray | None:
        """The smallest free buffer of at least `nbytes` (and at most `most` times that), or None."""
        fits = [n for n, bufs in self._free.items() if bufs and nbytes <= n <= most * nbytes]
        if not fits:
            return None
        n = min(fits)
        self.free_bytes -= n
        return self._free[n].pop()

    def _push(self, buf: np.ndarray) -> None:
        self._free.setdefault(buf.nbytes, []).append(buf)
        self.free_bytes += buf.nbytes

    def _shrink(self, limit: int) -> int:
        """Drop free buffers (largest first) until at most `limit` bytes are free; the bytes
        dropped (the caller then calls _return_to_os, outside the lock)."""
        before = self.free_bytes
        for n in sorted(self._free, reverse=True):
            bufs = self._free[n]
            while bufs and self.free_bytes > limit:
                bufs.pop()
                self.free_bytes -= n
        self._free = {n: b for n, b in self._free.items() if b}
        return before - self.free_bytes

    def release(self) -> int:
        """Drop every free buffer; return the bytes dropped."""
        with _COND:
            freed = self._shrink(0)
        if freed:
            _return_to_os()
        return freed


POOL = StagingPool()


def release_host_memory() -> int:
    """Free the staging buffers ckpt keeps between saves.

    Saves keep their host staging buffers (at most the save's ``host_budget_bytes``) so that the
    next save copies into memory the process has already touched, which is several times faster
    than faulting in fresh pages. Call this when that memory is needed elsewhere (e.g. after the
    last save of a phase); a later save allocates again. Buffers still in use by a running save
    are not affected (they are freed when that save is done with them unless pooled again).

    Returns:
        The number of bytes the pool released.

    Raises:
        Nothing: it only drops the library's references to free buffers.
    """
    return POOL.release()


class StagingAborted(Exception):
    """The save's writer failed: no budget will come back (the writer's error is the cause)."""


class Lease:
    """Budget held for one chunk: `nbytes` counted, and the pooled buffer when there is one."""

    __slots__ = ("nbytes", "buffer")

    def __init__(self, nbytes: int, buffer: np.ndarray | None):
        self.nbytes, self.buffer = nbytes, buffer


class SaveBudget(HostBudget):
    """The host bytes of one save: at most `limit` (a chunk larger than the limit is staged
    alone, only when nothing else is held), `held` by its leases. ``acquire`` waits for room and
    takes a pooled buffer where one fits; ``release`` gives it back. `high_water` is the most
    ever counted: this save's leases plus the pool's free buffers; tests assert it stays within
    `limit`."""

    def __init__(self, limit: int, *, pool: StagingPool = POOL, keep: bool = True) -> None:
        super().__init__(limit)
        self.pool, self.keep = pool, keep
        self.waited = False  # whether a chunk ever had to wait for budget
        self.written_off = 0  # buffers still referenced after RELEASE_GRACE_S (no longer counted)
        self._lingering: deque = deque()  # (buffer, deadline): released, still referenced
        self._error: BaseException | None = None
        with _COND:
            dropped = pool._shrink(limit)
            self._note()
        if dropped:
            _return_to_os()

    def _note(self) -> None:
        self.high_water = max(self.high_water, self.held + self.pool.free_bytes)

    def take(self, n: int) -> None:
        """Count `n` bytes without waiting for room (the meter's take, under the save's lock)."""
        with _COND:
            self.held += n
            self._note()

    def give(self, n: int) -> None:
        with _COND:
            self.held -= n
            _COND.notify_all()

    def acquire(self, nbytes: int, *, buffer: bool, block: bool = True) -> Lease | None:
        """Count `nbytes` (with a page-aligned buffer of that size when `buffer`); None if that
        would exceed the budget and not `block`. Raises StagingAborted once the writer failed."""
        need = _pages(nbytes) if buffer else nbytes
        dropped, pooled, counted = 0, None, False
        try:
            with _COND:
                while True:
                    if self._error is not None:
                        raise StagingAborted("the save's writes failed") from self._error
                    self._settle()
                    if buffer and self.keep:
                        pooled = self.pool._pop(need)
                        if pooled is not None:
                            self.held += pooled.nbytes
                            self._note()
                            return Lease(pooled.nbytes, pooled)
                    free = self.pool.free_bytes
                    if self.held + free + need > self.limit and buffer and self.keep:
                        # No room for a new buffer: a larger free one serves (its pages are
                        # already the process's; trading it for a new one would fault new pages).
                        pooled = self.pool._pop(need, most=float("inf"))
                        if pooled is not None:
                            self.held += pooled.nbytes
                            self._note()
                            return Lease(pooled.nbytes, pooled)
                    if self.held + free + need > self.limit and free:
                        # Free buffers of other sizes make room for this one.
                        dropped += self.pool._shrink(max(0, self.limit - self.held - need))
                        free = self.pool.free_bytes
                    if self.held + free + need <= self.limit or self.held == 0:
                        self.held += need
                        self._note()
                        counted = True
                        break
                    if not block:
                        return None
                    self.waited = True
                    # (a lingering buffer frees no one to notify: look again shortly)
                    _COND.wait(0.002 if self._lingering else None)
        finally:
            if dropped:
                _return_to_os()  # (before allocating: the new buffer may reuse those pages)
        if not buffer:
            return Lease(need, None)
        try:
            return Lease(need, _allocate(need))
        except BaseException:
            if counted:
                self.release(Lease(need, None))
            raise

    def release(self, lease: Lease) -> None:
        """Give back a lease whose chunk is durable and no longer read; its buffer is pooled
        when nothing else references it and the budget has room for it."""
        buf, lease.buffer = lease.buffer, None
        dropped = False
        with _COND:
            self._settle()
            if buf is not None and not _unreferenced(buf):
                # Still read somewhere: its memory is not free yet, so it stays counted.
                self._lingering.append((buf, time.monotonic() + RELEASE_GRACE_S))
            else:
                dropped = not self._free(buf, lease.nbytes) and buf is not None
            _COND.notify_all()  # (a waiter then looks again, and polls lingering buffers)
        if dropped:
            del buf
            _return_to_os()

    def _free(self, buf: np.ndarray | None, nbytes: int) -> bool:
        """Uncount `nbytes`; pool `buf` if there is room. Whether it was pooled."""
        self.held -= nbytes
        if buf is not None and self.keep and self._error is None:
            if self.held + self.pool.free_bytes + buf.nbytes <= self.limit:
                self.pool._push(buf)
                return True
        return False

    def _settle(self) -> None:
        """Uncount lingering buffers that are now unreferenced (pooling them) or past their
        grace (left to whoever holds them)."""
        if not self._lingering:
            return
        now, still = time.monotonic(), deque()
        keeper = self.written_off >= KEEPER_AFTER
        for buf, deadline in self._lingering:
            if _unreferenced(buf):
                self._free(buf, buf.nbytes)
            elif keeper or now >= deadline:
                self.written_off += 1
                self._free(None, buf.nbytes)
            else:
                still.append((buf, deadline))
        self._lingering = still

    def finish(self, timeout: float = 0.01) -> None:
        """At the end of the save's writes: wait briefly (`timeout`) for lingering buffers, so
        that they are pooled for the next save, then stop counting the rest."""
        deadline = time.monotonic() + timeout
        with _COND:
            while True:
                self._settle()
                if not self._lingering or time.monotonic() >= deadline:
                    break
                _COND.wait(0.002)
            for buf, _ in self._lingering:
                self._free(None, buf.nbytes)
            self._lingering.clear()
            _COND.notify_all()

    def abort(self, error: BaseException) -> None:
        """Make every waiting and later acquire raise StagingAborted (the writer failed)."""
        with _COND:
            self._error = error
            _COND.notify_all()


def _copies_on_conversion(dtype: np.dtype) -> bool:
    """Whether the storage form of `dtype` is a converted copy (counted twice in the budget)."""
    return storage_of(dtype)[1] == VALUES or dtype.byteorder == ">"


class _Sources:
    """The device data of every leaf, by device id, and whether it lives on the CPU backend."""

    def __init__(self, sources: dict[int, Any]):
        self.sources = sources
        self._shards: dict[int, dict[int, tuple[Any, tuple]]] = {}
        self._on_cpu: dict[int, bool] = {}

    def shard(self, leaf: int, device: int) -> tuple[Any, tuple, bool]:
        """(data, the box it holds, whether host memory) of `leaf` on `device`."""
        src = self.sources[leaf]
        if device == HOST:
            return src, full_box(np.shape(src)), True
        if leaf not in self._shards:
            shards = src.addressable_shards
            self._shards[leaf] = {s.device.id: (s.data, index_to_box(s.index, src.shape)) for s in shards}
            self._on_cpu[leaf] = shards[0].device.platform == "cpu"
        data, box = self._shards[leaf][device]
        return data, box, self._on_cpu[leaf]


def _begin(srcs: _Sources, w: ShardWrite | BundledWrite) -> Any:
    """Start what the copy of `w` needs: on accelerators, ``copy_to_host_async`` of the chunk (a
    device-side slice when the chunk is part of a shard); on the host, the source views."""
    if isinstance(w, BundledWrite):
        parts = []
        for leaf, pieces in w.members:
            for _, dev in pieces:
                data, _, host = srcs.shard(leaf, dev)
                if not host:
                    data.copy_to_host_async()
                parts.append(data)
        return parts
    data, box, host = srcs.shard(w.leaf, w.device)
    if host:
        # On the CPU backend a view of the device buffer (slicing the jax.Array instead would
        # compile and run a slice op: a second copy); copied into a staging buffer by _finish.
        data = np.asarray(data)
    if box != w.box:
        data = data[relative(w.box, box)]  # (device-side on accelerators; a view on the host)
    if not host:
        data.copy_to_host_async()
    return data


def _into(lease: Lease, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return lease.buffer[:nbytes].view(dtype).reshape(shape)


def _finish(w: ShardWrite | BundledWrite, src: Any, lease: Lease) -> np.ndarray:
    """The host copy of `w`, owned by the library."""
    if isinstance(w, BundledWrite):
        return _bundled(w, src, lease)
    if isinstance(src, jax.Array):
        # On accelerators np.asarray is the fresh host buffer copy_to_host_async filled.
        return np.asarray(src)
    # On the host (CPU backend, numpy leaves) `src` is a view of memory the library does not
    # own (donation overwrites a device buffer): copy it into the staging buffer.
    view = src
    if lease.buffer is None:
        return np.array(view, copy=True)
    out = _into(lease, view.dtype, view.shape)
    np.copyto(out, view)
    return out


def _bundled(w: BundledWrite, parts: list[Any], lease: Lease) -> np.ndarray:
    """The chunk of a bundled write (small arrays, format version 2's stacks), assembled from its pieces into one buffer the library owns:
    shape (members, *shape) for a stack's chunk, the member's shape for a single-chunk array."""
    first = np.asarray(parts[0])
    stacked = w.array < 0
    shape = tuple(b - a for a, b in (w.box[1:] if stacked else w.box))
    out_shape = (len(w.members), *shape) if stacked else shape
    out = np.empty(out_shape, first.dtype) if lease.buffer is None else _into(lease, first.dtype, out_shape)
    whole = full_box(shape)
    where: dict = {whole: ...}  # box -> its slices in a member (members of a stack share boxes)
    k = 0
    for slot, (_, pieces) in enumerate(w.members):
        dst = out[slot] if stacked else out
        for box, _ in pieces:
            index = where.get(box)
            if index is None:
                index = where[box] = relative(box, whole)
            # (a copy of the device buffer, as _finish makes: donation may overwrite it)
            dst[index] = first if k == 0 else np.asarray(parts[k])
            k += 1
    return out


def _cost(srcs: _Sources, w: ShardWrite | BundledWrite) -> tuple[int, bool]:
    """(bytes to count, whether the library allocates a staging buffer) for `w`."""
    if isinstance(w, BundledWrite):
        leaf, pieces = w.members[0]
        _, _, host = srcs.shard(leaf, pieces[0][1])
        dtype = np.dtype(srcs.sources[leaf].dtype)
        # On accelerators the pieces' host copies exist beside the assembled chunk.
        n = w.nbytes if host else 2 * w.nbytes
    else:
        _, _, host = srcs.shard(w.leaf, w.device)
        dtype = np.dtype(srcs.sources[w.leaf].dtype)
        n = w.nbytes
    if _copies_on_conversion(dtype):
        n += w.nbytes
    # On accelerators the host buffer is the one copy_to_host_async fills (jax's, not pooled).
    return max(n, 1), host or isinstance(w, BundledWrite)


def copy_to_host(sources: dict[int, Any], writes: Sequence[ShardWrite | BundledWrite], budget: SaveBudget
          ) -> Iterator[tuple[ShardWrite | BundledWrite, np.ndarray, Lease]]:
    """Owned host copies of `writes` in plan order, each yielded with its lease as soon as it
    exists, so that storage can start on a chunk while the next is copied.

    Copies are started as far ahead as the budget allows (so transfers from several devices
    overlap), and at least one at a time: when the budget is spent, the next copy waits until
    the writer gives a lease back. The consumer releases each yielded lease through `budget`.
    """
    srcs = _Sources(sources)
    started: deque = deque()  # (write, lease, what _begin returned)
    nxt = 0
    try:
        while nxt < len(writes) or started:
            while nxt < len(writes):
                w = writes[nxt]
                nbytes, buffer = _cost(srcs, w)
                lease = budget.acquire(nbytes, buffer=buffer, block=not started)
                if lease is None:
                    break
                started.append((w, lease, None))
                started[-1] = (w, lease, _begin(srcs, w))
                nxt += 1
            w, lease, src = started.popleft()
            try:
                host = _finish(w, src, lease)
            except BaseException:
                budget.release(lease)
                raise
            del src
            yield w, host, lease
            del host
    finally:
        for _, lease, _ in started:
            budget.release(lease)
