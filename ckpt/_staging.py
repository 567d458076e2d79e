"""Host staging: device-to-host copies of the shards this process writes, owned by the library.

All copies start together (``copy_to_host_async`` on every shard) before any is waited on, so
transfers from different devices overlap. Once ``take`` has returned, the caller may donate,
delete or overwrite the arrays.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Sequence

import jax
import numpy as np

from ckpt._plan import HOST, ShardWrite


class HostBufferPool:
    """Staging buffers kept from one save for the next.

    A training loop saves the same shapes over and over. Copying into the previous save's
    buffers skips the page faults of fresh memory, which here cost 2-3x the copy itself (and
    ~15x when the host has reclaimed the pages). The pool holds at most the buffers of the last
    save that returned them, and only buffers nothing else references any more. Used for the
    CPU backend, where the copy is a memcpy; on accelerators the library keeps the buffer that
    ``copy_to_host_async`` filled. ``CKPT_STAGING_POOL=0`` turns it off.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.enabled = os.environ.get("CKPT_STAGING_POOL", "1") != "0"

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                return bucket.pop()
        return np.empty(nbytes, np.uint8)

    def give_back(self, buffers: list[np.ndarray]) -> None:
        """Keep `buffers` (the last save's) for the next save; drop what the pool held before."""
        free: dict[int, list[np.ndarray]] = {}
        for i in range(len(buffers)):
            buf = buffers[i]
            # References: buffers[i], `buf`, and getrefcount's argument. More means a view of
            # it is still alive somewhere (the caller, or a storage engine): never reuse it.
            if sys.getrefcount(buf) <= 3:
                free.setdefault(buf.nbytes, []).append(buf)
            del buf
        with self._lock:
            self._free = free

    def clear(self) -> None:
        with self._lock:
            self._free = {}


POOL = HostBufferPool()


def start_copies(sources: dict[int, Any], writes: Sequence[ShardWrite]) -> list[tuple[ShardWrite, Any]]:
    """Start every device-to-host copy; return (write, per-device array or host array)."""
    by_device: dict[int, dict[int, Any]] = {}
    pending = []
    for w in writes:
        src = sources[w.leaf]
        if w.device == HOST:
            pending.append((w, src))
            continue
        if w.leaf not in by_device:
            by_device[w.leaf] = {s.device.id: s for s in src.addressable_shards}
        data = by_device[w.leaf][w.device].data
        data.copy_to_host_async()
        pending.append((w, data))
    return pending


def owned_copy(x: Any, buffers: list[np.ndarray] | None = None) -> np.ndarray:
    """A host array the library owns, whatever happens to `x` afterwards.

    When `buffers` is given and the pool is on, the copy goes into a pooled buffer, which is
    appended to `buffers` so the save can give it back when its writes are done.
    """
    if isinstance(x, jax.Array) and x.devices().pop().platform != "cpu":
        # On accelerators np.asarray is the fresh host buffer copy_to_host_async filled.
        return np.asarray(x)
    # On the CPU backend np.asarray is a view of the device buffer, which donation overwrites.
    src = np.asarray(x)
    if buffers is None or not POOL.enabled or src.nbytes == 0:
        return np.array(src, copy=True)
    buf = POOL.take(src.nbytes)
    buffers.append(buf)
    out = buf.view(src.dtype).reshape(src.shape)
    np.copyto(out, src)
    return out


COPY_THREADS = int(os.environ.get("CKPT_COPY_THREADS", 2))


def take(pending: list[tuple[ShardWrite, Any]], buffers: list[np.ndarray] | None = None
         ) -> list[tuple[ShardWrite, np.ndarray]]:
    """Owned host copies of every pending shard, in plan order.

    All copies finish before any chunk is handed to storage: on a host where the copy is a
    memcpy, overlapping it with writes makes both slower (they share memory bandwidth), and the
    caller waits for the copies either way. The copies run on a few threads (np.copyto releases
    the GIL).
    """
    if buffers is not None:
        # Pooled buffers are taken up front, in plan order, so that threads do not race for them.
        pass
    if COPY_THREADS <= 1 or len(pending) < 2:
        return [(w, owned_copy(x, buffers)) for w, x in pending]
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()
    per_item: list[list[np.ndarray]] = [[] for _ in pending]

    def copy(i: int) -> np.ndarray:
        return owned_copy(pending[i][1], per_item[i] if buffers is not None else None)

    with ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="ckpt-copy") as ex:
        copies = list(ex.map(copy, range(len(pending))))
    if buffers is not None:
        with lock:
            for bufs in per_item:
                buffers.extend(bufs)
    return [(w, c) for (w, _), c in zip(pending, copies)]
