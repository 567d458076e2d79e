"""Chunk files written by the local engine itself: one file per chunk, straight from the
library's page-aligned host buffers with O_DIRECT, by a process-wide pool of I/O threads.

With the ``bytes`` codec a chunk file is exactly the chunk's little-endian bytes, so writing it
needs no encoder. Going through TensorStore's zarr3 driver instead cost host memory the save's
budget could not see (its own buffers per write in flight, which the allocator then kept: peak
RSS 70 MiB over a 256 MiB budget) and throughput (field notes: ~1.2 GiB/s for its direct mode;
these threads write 1.6 GiB/s on the same disk, docs/benchmarks.md).

Durability: each file is fsynced, then its directory (and every directory created for it, then
that one's parent), before its future resolves; a chunk reported written survives a crash.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from concurrent.futures import Future

import numpy as np

from ckpt.storage._base import shared_pool

_PAGE = 4096  # O_DIRECT wants the buffer, the length and the file offset aligned (to 512 or 4096)
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
_direct_writes: bool | None = None  # unknown until the first open (tmpfs, for one, refuses it)

def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_for_write(path: str, direct: bool) -> tuple[int, bool]:
    """(fd, whether it is O_DIRECT)."""
    global _direct_writes
    if direct and _direct_writes is not False and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, _WRITE_FLAGS | os.O_DIRECT, 0o644)
            _direct_writes = True
            return fd, True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _direct_writes = False
    return os.open(path, _WRITE_FLAGS, 0o644), False


def write_file(path: str, data: np.ndarray, size: int | None = None) -> None:
    """Write `data`'s bytes (C-contiguous) as the file `path`, then zeros up to `size` bytes
    when given, fsynced. The page-aligned part goes out with O_DIRECT when the buffer is page
    aligned; a tail, or any buffer that is not, through the page cache."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    mv = memoryview(flat)
    n = len(mv)
    direct = n >= _PAGE and flat.ctypes.data % _PAGE == 0
    fd, direct = _open_for_write(path, direct)
    try:
        done = 0
        while done < n:
            if direct and (n - done < _PAGE or done % _PAGE):
                # The unaligned tail (or an odd short write): O_DIRECT off for the rest.
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                direct = False
            end = done + (n - done) // _PAGE * _PAGE if direct else n
            written = os.write(fd, mv[done:end])
            if written <= 0:
                raise OSError(errno.EIO, "short write", path)
            done += written
        if size is not None and size > n:
            os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, path) from None
        raise
    finally:
        os.close(fd)


class ChunkFileWriter:
    """Writes the chunk files of one staged checkpoint directory, `root`."""

    def __init__(self, root: str, concurrency: int):
        self.root = root
        self._pool = shared_pool("ckpt-write", concurrency)
        self._dirs: set[str] = set()  # directories known to exist
        self._unsynced: set[str] = set()  # created here, their entry in the parent not yet fsynced
        self._dirs_lock = threading.Lock()

    def _ensure_dir(self, path: str) -> None:
        # Only the mkdirs run under the lock. Their fsyncs come after the chunk's write, outside
        # it (_sync_dirs): fsyncing each new directory's parent here, one after another under
        # the lock, held every I/O thread up while a save made its directories (the benchmark
        # tree's few hundred: 0.12-0.14 s of a 1.2 s write, docs/benchmarks.md).
        if path in self._dirs:
            return
        with self._dirs_lock:
            missing, d = [], path
            while d not in self._dirs and not os.path.isdir(d):
                missing.append(d)
                d = os.path.dirname(d)
            for d in reversed(missing):
                try:
                    os.mkdir(d)
                except FileExistsError:
                    pass
                self._unsynced.add(d)
            self._dirs.add(path)

    def _sync_dirs(self, parent: str) -> None:
        """Make the entry of a file in `parent` durable, and those of the directories above it
        that this writer created and nobody has fsynced yet. Every level up to the root is
        looked at: another thread may be between two levels of its own walk (each directory
        leaves the set only after its fsync), so one synced level says nothing of the next."""
        fsync_path(parent)
        d = parent
        while len(d) > len(self.root):
            if d in self._unsynced:
                fsync_path(os.path.dirname(d))
                self._unsynced.discard(d)
            d = os.path.dirname(d)

    def _write(self, key: str, data: np.ndarray, size: int | None) -> None:
        path = os.path.join(self.root, key)
        parent = os.path.dirname(path)
        self._ensure_dir(parent)
        write_file(path, data, size)
        self._sync_dirs(parent)

    def write(self, key: str, data: np.ndarray, size: int | None = None) -> Future:
        """Start writing the file `key` (relative to root): `data`'s bytes, then zeros up to
        `size` bytes when given; durable once the returned future resolves. The caller does
        not change `data` until then."""
        return self._pool.submit(self._write, key, data, size)


class PackFile:
    """A data object of the packed layout (formats/SPEC.md section 13) on local disk, written in
    place: each chunk at its offset as it arrives (the whole pages of a page-aligned buffer at a
    page-aligned offset with O_DIRECT, the rest through the page cache), then, at ``close``,
    its size set and the file and its directory fsynced."""

    def __init__(self, path: str, concurrency: int):
        self.path = path
        self._pool = shared_pool("ckpt-write", concurrency)
        # close() waits for the writes, so it runs apart from the pool they are queued on.
        self._closer = shared_pool("ckpt-pack-close", 2)
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fd = os.open(path, _WRITE_FLAGS, 0o644)
        self._direct_fd: int | None = None
        if _direct_writes is not False and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError:
                self._direct_fd = None

    def write_at(self, offset: int, data: np.ndarray) -> Future:
        future = self._pool.submit(self._write, offset, data)
        with self._lock:
            self._pending.append(future)
        return future

    def _write(self, offset: int, data: np.ndarray) -> None:
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        mv = memoryview(flat)
        n, done = len(mv), 0
        if self._direct_fd is not None and offset % _PAGE == 0 and flat.ctypes.data % _PAGE == 0 and n >= _PAGE:
            whole = n // _PAGE * _PAGE
            while done < whole:
                written = os.pwrite(self._direct_fd, mv[done:whole], offset + done)
                if written <= 0:
                    raise OSError(errno.EIO, "short write", self.path)
                done += written
        while done < n:
            written = os.pwrite(self._fd, mv[done:], offset + done)
            if written <= 0:
                raise OSError(errno.EIO, "short write", self.path)
            done += written

    def close(self, size: int) -> Future:
        return self._closer.submit(self._close, size)

    def _close(self, size: int) -> None:
        try:
            with self._lock:
                pending, self._pending = self._pending, []
            for f in pending:
                f.result()
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            if self._direct_fd is not None:
                os.close(self._direct_fd)
        fsync_path(os.path.dirname(self.path))
