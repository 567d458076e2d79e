"""Host memory the library freed, handed back to the kernel at once.

Host buffers below glibc's mmap threshold (dynamic, up to 32 MiB) live in the heap, and glibc
keeps a freed block resident for later reuse. When the library trades buffers of one size for
another (the save's staging pool, a restore's read batches), the holes stayed resident beside the
new buffers: a save with a 256 MiB budget peaked at 327 MiB of RSS over its input, 259 MiB with
``return_to_os`` after each free (docs/memory.md). The library does not change the process's
allocator settings; it only returns memory it has just freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import threading
from collections import Counter

import numpy as np

PAGE = 4096
POOLED_MIN_BYTES = 1 << 20  # smaller read buffers are left to the allocator


def _libc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _libc_trim()


def return_to_os() -> None:
    """Return the free pages of the C heap to the kernel (glibc ``malloc_trim``; elsewhere
    nothing). Call it right after freeing a large buffer; it costs well under a millisecond."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def unreferenced(buf: np.ndarray) -> bool:
    """Whether nothing but `buf` itself refers to its memory (an aligned view from
    ``aligned_empty``): no view of it handed out is alive any more.

    Views reference the array that owns the memory (`buf.base`), not `buf`: expected are
    buf.base, `owner` here, and getrefcount's argument. More means a view is alive somewhere
    (a storage engine that kept the chunk, a device that adopted it): never reuse it."""
    owner = buf.base
    return owner is not None and sys.getrefcount(owner) <= 3


class ReadBuffers:
    """The page-aligned read buffers of one restore, reused batch after batch.

    A restore larger than its budget reads batch after batch; buffers the batch is done with
    (those no device adopted and no result kept) are read into again by the next batch, so its
    reads land in pages the process already holds instead of freshly faulted ones. Free buffers
    are counted in the restore's budget meter (`budget`: take/give); before a batch, free buffers
    of sizes the batch does not read are dropped, so free and used together stay within what
    the batch was planned for."""

    def __init__(self, budget) -> None:
        self.budget = budget
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def prepare(self, sizes: list[int]) -> None:
        """Before a batch reading buffers of `sizes`: keep as many free buffers of each size as
        it reads, drop the rest."""
        wanted = Counter(sizes)
        dropped = 0
        with self._lock:
            for n, bufs in self._free.items():
                while len(bufs) > wanted.get(n, 0):
                    bufs.pop()
                    dropped += n
            self._free = {n: b for n, b in self._free.items() if b}
        if dropped:
            self.budget.give(dropped)
            return_to_os()

    def get(self, nbytes: int) -> np.ndarray | None:
        """A buffer of `nbytes` (whole pages) plus one page, as the local engine reads into:
        a free one (uncounted here: the caller counts what it holds) or a new one; None for a
        buffer below POOLED_MIN_BYTES (the engine allocates it: small blocks are reused by the
        allocator itself)."""
        if nbytes < POOLED_MIN_BYTES:
            return None
        with self._lock:
            bufs = self._free.get(nbytes)
            buf = bufs.pop() if bufs else None
        if buf is not None:
            self.budget.give(nbytes)
            return buf
        from ckpt._memory import aligned_empty

        return aligned_empty(nbytes + PAGE, PAGE)

    def put_back(self, buffers: list[np.ndarray]) -> None:
        """After a batch (its other bytes given back): keep the buffers of `buffers` nothing
        refers to any more, as far as the budget has room for them (counted)."""
        kept = 0
        with self._lock:
            for buf in buffers:
                n = len(buf) - PAGE
                if unreferenced(buf) and self.budget.held + kept + n <= self.budget.limit:
                    self._free.setdefault(n, []).append(buf)
                    kept += n
        self.budget.take(kept)

    def close(self) -> None:
        """Drop every free buffer (the restore is done)."""
        self.prepare([])


# Cyclic garbage collection paused while a save or restore builds its per-leaf objects.
# A tree of thousands of leaves makes tens of thousands of short-lived containers (records, plans,
# boxes, futures), which trigger the collector's full collections; each walks every object of the
# process, about 0.1 s in a process that has imported JAX, and a 4,000-leaf save or restore paid
# one or two of them (docs/benchmarks.md, "Many small leaves"). Reference counting frees these
# objects anyway; the collector runs again, as usual, once the call returns.
@contextlib.contextmanager
def gc_paused():
    """Disable the cyclic collector for the block (or decorated call), if it was enabled."""
    if not gc.isenabled():  # the caller turned it off: leave that alone
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def aligned_empty(nbytes: int, alignment: int = 64) -> np.ndarray:
    """An uninitialised uint8 buffer whose data starts on an `alignment`-byte boundary
    (XLA's CPU client adopts such host buffers without copying them)."""
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset : offset + nbytes]
