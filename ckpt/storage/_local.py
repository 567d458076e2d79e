"""The local engine: a directory on a POSIX file system, the fast path.

Chunk files are written by the library's own I/O threads with O_DIRECT from its page-aligned
staging buffers (each file and its directory fsynced; ``_chunk_files``) and read back whole with
O_DIRECT into aligned buffers; small files, listing and deletion are plain system calls. The
directory renames a commit makes (``rename_noreplace``, ``exchange``: renameat2) are here too;
the commit that uses them is ``ckpt._commit.rename``.

Reads are confined to the checkpoint: every file is reached by an ``openat`` walk from the
checkpoint directory's own descriptor with ``O_NOFOLLOW`` on every component (a symbolic link
anywhere inside is an error, never followed), only regular files are opened (``O_NONBLOCK`` and a
type check first, so a FIFO or device is refused, never waited on), and a file's size is checked
with ``fstat`` before any buffer is allocated. ``pin()`` keeps that descriptor for a whole restore,
so an overwrite's rename-exchange cannot switch checkpoints under a reader. Ranged reads
(``read_range``, ``size``: safetensors files) differ in one way: a link is followed when its
target (``realpath``) stays under the directory, and the target is then opened by the same
``O_NOFOLLOW`` walk from the directory's descriptor (so a link swapped in meanwhile is refused,
not followed); a link out of the directory is an error.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import shutil
import stat
import threading
from typing import Any, Iterator

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import ArraySpec
from ckpt._geometry import Box, chunk_index_of, chunk_key
from ckpt._memory import aligned_empty
from ckpt.storage._base import (
    ChunkFiles,
    LocalDirectory,
    StoreCaps,
    Usage,
    check_range,
    range_buffer,
    range_short,
    size_mismatch,
)
from ckpt.storage._chunk_files import ChunkFileWriter, PackFile, fsync_path
from ckpt.storage._confine import check_key, file_kind, link_target_within
from ckpt.storage._tensorstore import TensorStoreStorage, shared_context

_PAGE = 4096
_direct_reads: bool | None = None  # unknown until the first open
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def write_file_synced(path: str, data: bytes, *, exclusive: bool = False) -> None:
    with open(path, "xb" if exclusive else "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_libc = None


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """renameat2(2) where the platform has it; False when it does not."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2  # noqa: B018  (probe)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    AT_FDCWD = -100
    rc = _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # kernel or file system without the flag
        return False
    raise OSError(err, os.strerror(err), dst)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename a directory into place; FileExistsError if `dst` exists, never replacing it."""
    if not _renameat2(src, dst, _RENAME_NOREPLACE):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "checkpoint already exists", dst)
        os.rename(src, dst)


def exchange(src: str, dst: str) -> bool:
    """Atomically swap two directories; False where the platform cannot."""
    return _renameat2(src, dst, _RENAME_EXCHANGE)


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---- confined reads ----------------------------------------------------------------------------


def _open_direct(name: str, dir_fd: int) -> int:
    """An fd for reading the regular file `name` below `dir_fd`, with O_DIRECT unless the file
    system refuses it."""
    global _direct_reads
    if _direct_reads is not False and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(name, _FILE_FLAGS | os.O_DIRECT, dir_fd=dir_fd)
            _direct_reads = True
            return fd
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _direct_reads = False
    return os.open(name, _FILE_FLAGS, dir_fd=dir_fd)


class _LinkRefused(CheckpointError):
    """A symbolic link met by a confined read (ranged reads then look where it leads)."""


def _refusal(where: str, st: os.stat_result | None, wanted: str) -> CheckpointError:
    if st is not None and stat.S_ISLNK(st.st_mode):
        return _LinkRefused(f"{where} is a symbolic link: a checkpoint is read only through its own directories "
                            "and regular files, never through links")
    kind = file_kind(st.st_mode) if st is not None else "unreadable"
    return CheckpointError(f"{where} is not {wanted} ({kind})")


class LocalStorage(LocalDirectory, TensorStoreStorage):
    """A directory on the local file system (`root`: an absolute path). `pinned_fd`: an open
    descriptor of the directory that every read goes through (see ``pin``)."""

    caps = StoreCaps("local", renames=True, conditional_writes=True, versioned_writes=True, reads_into_buffers=True,
                     writes_in_place=True)

    def __init__(self, root: str, concurrency: int, pinned_fd: int | None = None):
        self.root = os.path.abspath(root)
        self._concurrency = concurrency
        self._pinned_fd = pinned_fd
        self._chunk_writer: ChunkFileWriter | None = None
        # A pinned storage keeps the files its ranged reads opened until the pin ends (opened
        # confined, once: a safetensors restore reads one file in thousands of ranges, and a
        # confined open per range cost 14 us against 3 us for the read itself).
        self._range_fds: dict[str, int] | None = {} if pinned_fd is not None else None
        self._range_lock = threading.Lock()
        super().__init__({"driver": "file", "path": self.root.rstrip("/") + "/"}, self.root,
                         shared_context("local", concurrency))

    # ---- location ----------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def where(self, key: str) -> str:
        return self._path(key)

    def child(self, key: str) -> "LocalStorage":
        return LocalStorage(self._path(key.strip("/")), self._concurrency)

    def parent(self) -> "LocalStorage":
        return LocalStorage(os.path.dirname(self.root), self._concurrency)

    @property
    def resolved_name(self) -> str:
        return os.path.basename(os.path.realpath(self.root))

    @contextlib.contextmanager
    def pin(self) -> Iterator["LocalStorage"]:
        fd = self._pinned_fd if self._pinned_fd is not None else os.open(self.root, os.O_RDONLY | os.O_DIRECTORY
                                                                          | os.O_CLOEXEC)
        pinned = LocalStorage(self.root, self._concurrency, pinned_fd=fd)
        try:
            yield pinned
        finally:
            with pinned._range_lock:
                fds, pinned._range_fds = list(pinned._range_fds.values()), None
            for f in fds:
                os.close(f)
            if fd != self._pinned_fd:
                os.close(fd)

    # ---- confined reads ----------------------------------------------------------------

    @contextlib.contextmanager
    def _parent_fd(self, key: str) -> Iterator[tuple[int, str]]:
        """(descriptor of the directory holding `key`, the key's last component), reached from
        the checkpoint directory without following any link."""
        parts = check_key(key).split("/")
        owned: list[int] = []
        if self._pinned_fd is not None:
            fd = self._pinned_fd
        else:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            owned.append(fd)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    raise FileNotFoundError(errno.ENOENT, "no such object", self._path(key)) from None
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise OSError(e.errno, e.strerror, self._path("/".join(parts[: i + 1]))) from None
                    try:
                        st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        st = None
                    raise _refusal(self._path("/".join(parts[: i + 1])), st, "a directory") from None
                owned.append(fd)
            yield fd, parts[-1]
        finally:
            for f in owned:
                os.close(f)

    def _open_file(self, key: str, *, direct: bool = False) -> tuple[int, os.stat_result]:
        """An open descriptor of the regular file `key` and its fstat."""
        where = self._path(key)
        with self._parent_fd(key) as (dir_fd, name):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such object", where) from None
            if not stat.S_ISREG(st.st_mode):
                raise _refusal(where, st, "a regular file")
            try:
                fd = _open_direct(name, dir_fd) if direct else os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
            except OSError as e:
                raise OSError(e.errno, e.strerror, where) from None
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                raise _refusal(where, opened, "the regular file it was a moment ago")
        except BaseException:
            os.close(fd)
            raise
        return fd, opened

    def _open_ranged(self, key: str) -> tuple[int, os.stat_result]:
        """``_open_file``, except that a symbolic link on the way is followed when its target
        stays under this directory: the target is then opened by the same walk (no link
        followed), as the key it is below this directory."""
        try:
            return self._open_file(key)
        except _LinkRefused:
            pass
        target = link_target_within(self.root, self._path(check_key(key)))
        inside = os.path.relpath(target, os.path.realpath(self.root)).replace(os.sep, "/")
        return self._open_file(inside)

    def _ranged_fd(self, key: str) -> tuple[int, bool]:
        """(a descriptor of `key` for ranged reads, whether the caller closes it): kept open
        while pinned, else opened for this call."""
        fds = self._range_fds
        if fds is None:
            return self._open_ranged(key)[0], True
        fd = fds.get(key)
        if fd is None:
            with self._range_lock:
                fd = fds.get(key)
                if fd is None:
                    fd = fds[key] = self._open_ranged(key)[0]
        return fd, False

    def size(self, key: str) -> int:
        fd, owned = self._ranged_fd(key)
        try:
            return os.fstat(fd).st_size
        finally:
            if owned:
                os.close(fd)

    def read_range(self, key: str, start: int, length: int, into: np.ndarray | None = None) -> np.ndarray:
        """`length` bytes from `start`, with ``preadv`` into the buffer (see Storage.read_range)."""
        check_range(start, length)
        buf = range_buffer(into, length, self._path(key) if into is None else key)  # (names it if allocation fails)
        fd, owned = self._ranged_fd(key)
        filled = 0
        try:
            while filled < length:
                n = os.preadv(fd, [memoryview(buf)[filled:]], start + filled)
                if n == 0:
                    break
                filled += n
        except OSError as e:
            raise OSError(e.errno, e.strerror, self._path(key)) from None
        finally:
            if owned:
                os.close(fd)
        if filled != length:
            raise range_short(self._path(key), start, length)
        return buf

    def get(self, key: str, *, max_bytes: int) -> bytes:
        path = self._path(key)
        fd, st = self._open_file(key)
        try:
            if st.st_size > max_bytes:
                raise size_mismatch(path, st.st_size, max_bytes)
            limit, parts, total = st.st_size + 1, [], 0
            while total < limit:
                part = os.read(fd, limit - total)
                if not part:
                    break
                parts.append(part)
                total += len(part)
        finally:
            os.close(fd)
        data = b"".join(parts)
        if len(data) > max_bytes:
            raise size_mismatch(path, len(data), max_bytes)
        return data

    def read_exact(self, key: str, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        """One whole file, read straight into a page-aligned buffer.

        With the ``bytes`` codec a chunk file is exactly the chunk's little-endian bytes, so this
        is one read, with O_DIRECT where the file system allows it (no page-cache copy). The
        alignment also lets JAX adopt the buffer as a CPU device buffer without a copy. The
        buffer is allocated only once fstat says the file holds exactly `nbytes`.
        """
        file = self._path(key)
        fd, st = self._open_file(key, direct=True)
        try:
            if st.st_size != nbytes:
                raise size_mismatch(file, st.st_size, nbytes)
            padded = -(-nbytes // _PAGE) * _PAGE  # direct reads want whole pages
            if into is not None and len(into) == padded + _PAGE and into.ctypes.data % _PAGE == 0:
                buf = into
            else:
                try:
                    buf = aligned_empty(padded + _PAGE, _PAGE)  # one page more, to see a file that grew
                except MemoryError:
                    raise CheckpointError(f"{file}: no memory for its {nbytes} bytes") from None
            filled = 0
            while filled < len(buf):
                n = os.readv(fd, [memoryview(buf)[filled:]])
                if n == 0:
                    break
                filled += n
        finally:
            os.close(fd)
        if filled != nbytes:
            raise size_mismatch(file, filled, nbytes)
        return buf[:nbytes]

    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        return {k: (path, spec.chunk_shape) for k, (path, spec) in arrays.items()}

    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        # The chunk file is the chunk's bytes (the ``bytes`` codec), written from `data` itself.
        # An edge chunk's file still holds the whole chunk shape, the part outside the array
        # zeros (the fill value): appended when only the first dimension is cut, else laid out.
        path, chunk_shape = handle
        chunk_shape = tuple(chunk_shape)
        size = None
        if data.shape != chunk_shape:
            if data.shape[1:] == chunk_shape[1:]:
                size = math.prod(chunk_shape) * data.dtype.itemsize
            else:
                padded = np.zeros(chunk_shape, data.dtype)
                padded[tuple(slice(0, n) for n in data.shape)] = data
                data = padded
        if self._chunk_writer is None:
            self._chunk_writer = ChunkFileWriter(self.root, self._concurrency)
        return self._chunk_writer.write(f"{path}/{chunk_key(chunk_index_of(box, chunk_shape))}", data, size)

    # Chunk files are read by the engine's own direct I/O (read_exact: into an aligned buffer,
    # sized by fstat first) on the reader's pool, not by TensorStore's asynchronous reads.
    read_chunk_async = ChunkFiles.read_chunk_async

    def open_pack(self, key: str) -> PackFile:
        return PackFile(self._path(key), self._concurrency)

    def exists(self, key: str) -> bool:
        """Whether `key` is a regular file reached without following links ('': whether the
        directory itself exists)."""
        if not key:
            return os.path.lexists(self.root)
        try:
            with self._parent_fd(key) as (dir_fd, name):
                return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except (OSError, CheckpointError):
            return False

    def stat_many(self, keys) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for key in keys:
            try:
                st = os.lstat(self._path(key))
                out[key] = st.st_size if stat.S_ISREG(st.st_mode) else None
            except OSError:
                out[key] = None
        return out

    # ---- writes ------------------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file_synced(path, data, exclusive=True)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        files, dirs = [], []
        try:
            with os.scandir(self._path(prefix.strip("/"))) as it:
                for entry in it:
                    (dirs if entry.is_dir(follow_symlinks=False) else files).append(entry.name)
        except (FileNotFoundError, NotADirectoryError):
            pass
        return sorted(files), sorted(dirs)

    def du(self) -> Usage:
        """Regular files under the directory (symlinks not followed), their bytes and the newest
        modification time (the directory's own when it holds no file)."""
        total = count = 0
        try:
            newest = os.lstat(self.root).st_mtime
        except FileNotFoundError:
            return Usage(0, 0, 0.0)
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:  # removed while we walk (a manager deleting an old step)
                    continue
                total, count, newest = total + st.st_size, count + 1, max(newest, st.st_mtime)
        return Usage(total, count, newest)

    def delete(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def delete_tree(self, prefix: str = "") -> None:
        path = self._path(prefix.strip("/"))
        if os.path.isdir(path) and not os.path.islink(path):
            remove_tree(path)
        else:
            self.delete(prefix)

    def sync(self, key: str = "") -> None:
        fsync_path(self._path(key))

    def make_dirs(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.root)
        os.makedirs(self.root, exist_ok=True)
