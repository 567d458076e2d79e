"""Host memory the library freed, handed back to the kernel at once.

Host buffers below glibc's mmap threshold (dynamic, up to 32 MiB) live in the heap, and glibc
keeps a freed block resident for later reuse. When the library trades buffers of one size for
another (the save's staging pool, a restore's read batches), the holes stayed resident beside the
new buffers: a save with a 256 MiB budget peaked at 327 MiB of RSS over its input, 259 MiB with
``return_to_os`` after each free (docs/memory.md). The library does not change the process's
allocator settings; it only returns memory it has just freed.
"""

from __future__ import annotations

import ctypes


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
