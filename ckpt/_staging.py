"""Host staging: device-to-host copies of the shards this process writes, owned by the library.

All copies start together (``copy_to_host_async`` on every shard) before any is waited on, so
transfers from different devices overlap. Once ``take`` has returned, the caller may donate,
delete or overwrite the arrays.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from ckpt._layout import full_box, relative
from ckpt._plan import HOST, PackedWrite, ShardWrite
from ckpt.storage import aligned_empty


class HostBufferPool:
    """Staging buffers kept from one save for the next.

    A training loop saves the same shapes over and over. Copying into the previous save's
    buffers skips the page faults of fresh memory, which here cost 2-3x the copy itself (and
    ~15x when the host has reclaimed the pages). The pool holds at most the buffers of the last
    save that returned them, and only buffers nothing else references any more. Used for the
    CPU backend, where the copy is a memcpy; on accelerators the library keeps the buffer that
    ``copy_to_host_async`` filled. ``Options(staging_pool=False)`` (``CKPT_STAGING_POOL=0``) turns
    it off.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                return bucket.pop()
        # Page-aligned, so that direct (O_DIRECT) writes can use the buffer without a copy.
        return aligned_empty(nbytes, 4096)

    def give_back(self, buffers: list[np.ndarray]) -> None:
        """Keep `buffers` (the last save's) for the next save; drop what the pool held before."""
        free: dict[int, list[np.ndarray]] = {}
        for buf in buffers:
            # Views of a buffer (the host arrays handed to storage) reference the array that
            # owns the memory, not `buf`, so that is the one to count. Expected: buf.base,
            # `owner`, and getrefcount's argument. More means a view is still alive somewhere
            # (the caller, or a storage engine): never reuse it.
            owner = buf.base
            if owner is not None and sys.getrefcount(owner) <= 3:
                free.setdefault(buf.nbytes, []).append(buf)
            del owner
        with self._lock:
            self._free = free


POOL = HostBufferPool()


def start_copies(sources: dict[int, Any], writes: Sequence[ShardWrite | PackedWrite]) -> list[tuple[Any, Any]]:
    """Start every device-to-host copy; return (write, per-device array or host array), or for
    a packed write (write, [per-device or host array of each piece, in plan order])."""
    by_device: dict[int, dict[int, Any]] = {}
    on_cpu: dict[int, bool] = {}

    def piece(leaf: int, device: int) -> Any:
        src = sources[leaf]
        if device == HOST:
            return src
        if leaf not in by_device:
            shards = src.addressable_shards
            by_device[leaf] = {s.device.id: s.data for s in shards}
            on_cpu[leaf] = shards[0].device.platform == "cpu"
        data = by_device[leaf][device]
        if not on_cpu[leaf]:  # (on the CPU backend the host copy is a memcpy made in take())
            data.copy_to_host_async()
        return data

    pending: list[tuple[Any, Any]] = []
    for w in writes:
        if isinstance(w, PackedWrite):
            pending.append((w, [piece(leaf, dev) for leaf, pieces in w.members for _, dev in pieces]))
        else:
            pending.append((w, piece(w.leaf, w.device)))
    return pending


def owned_copy(x: Any, buffers: list[np.ndarray] | None = None) -> np.ndarray:
    """A host array the library owns, whatever happens to `x` afterwards.

    When `buffers` is given (the pool is on), the copy goes into a pooled buffer, which is
    appended to `buffers` so the save can give it back when its writes are done.
    """
    if isinstance(x, jax.Array) and x.devices().pop().platform != "cpu":
        # On accelerators np.asarray is the fresh host buffer copy_to_host_async filled.
        return np.asarray(x)
    # On the CPU backend np.asarray is a view of the device buffer, which donation overwrites.
    src = np.asarray(x)
    if buffers is None or src.nbytes == 0:
        return np.array(src, copy=True)
    buf = POOL.take(src.nbytes)
    buffers.append(buf)
    out = buf.view(src.dtype).reshape(src.shape)
    np.copyto(out, src)
    return out


def packed_copy(w: PackedWrite, parts: list[Any], buffers: list[np.ndarray] | None = None) -> np.ndarray:
    """The chunk of a packed write, assembled from its pieces into one buffer the library owns:
    shape (members, *shape) for a stack's chunk, the member's shape for a single-chunk array."""
    first = np.asarray(parts[0])
    stacked = w.array < 0
    shape = tuple(b - a for a, b in (w.box[1:] if stacked else w.box))
    out_shape = (len(w.members), *shape) if stacked else shape
    if buffers is None or w.nbytes == 0:
        out = np.empty(out_shape, first.dtype)
    else:
        buf = POOL.take(w.nbytes)
        buffers.append(buf)
        out = buf.view(first.dtype).reshape(out_shape)
    whole = full_box(shape)
    where: dict = {whole: ...}  # box -> its slices in a member (members of a stack share boxes)
    k = 0
    for slot, (_, pieces) in enumerate(w.members):
        dst = out[slot] if stacked else out
        for box, _ in pieces:
            index = where.get(box)
            if index is None:
                index = where[box] = relative(box, whole)
            # (a copy of the device buffer, as owned_copy makes: donation may overwrite it)
            dst[index] = first if k == 0 else np.asarray(parts[k])
            k += 1
    return out


def take(pending: list[tuple[Any, Any]], buffers: list[np.ndarray] | None = None
         ) -> Iterator[tuple[Any, np.ndarray]]:
    """Owned host copies in plan order, each yielded as soon as it exists, so that storage can
    start on a chunk while the next is copied."""
    for w, x in pending:
        yield w, (packed_copy(w, x, buffers) if isinstance(w, PackedWrite) else owned_copy(x, buffers))
