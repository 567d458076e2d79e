"""The local engine: a directory on a POSIX file system, the fast path.

Chunk files are written by the library's own I/O threads with O_DIRECT from its page-aligned
staging buffers (each file and its directory fsynced; ``ChunkFileWriter``) and read back whole with
O_DIRECT into aligned buffers; small files, listing and deletion are plain system calls (the
directory renames of a commit are the commit's own: ``ckpt._commit.rename``).

Chunk files: with the ``bytes`` codec a chunk file is exactly the chunk's little-endian bytes,
so writing it needs no encoder. Going through TensorStore's zarr3 driver instead cost host memory
the save's budget could not see (its own buffers per write in flight, which the allocator then
kept: peak RSS 70 MiB over a 256 MiB budget) and throughput (field notes: ~1.2 GiB/s for its
direct mode; these threads write 1.6 GiB/s on the same disk, docs/benchmarks.md). Durability:
each file is fsynced, then its directory (and every directory created for it, then that one's
parent), before its future resolves; a chunk reported written survives a crash.

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

Size: one backend, one module (zarr-python's storage/: a module per backend): a save or restore on
local disk runs through this module and the location's alone (docs/design.md walks them).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import secrets
import shutil
import stat
import threading
from concurrent.futures import Future
from typing import Any, Iterator

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import GROUP_METADATA, ArraySpec, array_metadata_bytes, check_key
from ckpt._geometry import Box, chunk_index_of, chunk_key
from ckpt._host import aligned_empty, shared_pool
from ckpt.storage._base import (
    ChunkFiles,
    LocalDirectory,
    Storage,
    StoreCaps,
    Usage,
    check_range,
    range_buffer,
    range_short,
    size_mismatch,
)
from ckpt.storage._confine import file_kind, link_target_within

_PAGE = 4096  # O_DIRECT wants the buffer, the length and the file offset aligned (to 512 or 4096)
_direct_reads: bool | None = None  # unknown until the first open
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def write_file_synced(path: str, data: bytes, *, exclusive: bool = False) -> None:
    with open(path, "xb" if exclusive else "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ---- chunk files -------------------------------------------------------------------------------

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


class LocalStorage(LocalDirectory, ChunkFiles, Storage):
    """A directory on the local file system (`root`: an absolute path). `pinned_fd`: an open
    descriptor of the directory that every read goes through (see ``pin``).

    Every member is its own (plain system calls on the library's threads; no other engine
    underneath), so a save or restore on local disk runs through this module and the location's
    alone. No versioned writes: a manager directory here has its ``flock`` (``ckpt._commit``),
    never a lease."""

    caps = StoreCaps("local", renames=True, conditional_writes=True, reads_into_buffers=True, writes_in_place=True)

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

    @property
    def url(self) -> str:
        return self.root

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
        return self._writer().write(f"{path}/{chunk_key(chunk_index_of(box, chunk_shape))}", data, size)

    def _writer(self) -> ChunkFileWriter:
        if self._chunk_writer is None:
            self._chunk_writer = ChunkFileWriter(self.root, self._concurrency)
        return self._chunk_writer

    def create_array(self, path: str, spec: ArraySpec) -> Future:
        # The zarr.json files of a save go out on the writer of its chunk files, which fsyncs
        # each with the directories it made.
        return self._writer().write(f"{path}/zarr.json", np.frombuffer(array_metadata_bytes(spec), np.uint8))

    def put_group(self, path: str) -> Future:
        return self._writer().write(f"{path}/zarr.json" if path else "zarr.json", np.frombuffer(GROUP_METADATA, np.uint8))

    # Chunk files are read by ChunkFiles' read_chunk(_async): the engine's own direct I/O
    # (read_exact: into an aligned buffer, sized by fstat first) on the reader's pool.

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

    def put(self, key: str, data: bytes) -> Future:
        """Write the file `key` whole: a temporary file beside it, fsynced, renamed over it, and
        the directory fsynced; a reader sees the old bytes or the new, never a part."""
        return shared_pool("ckpt-put", self._concurrency).submit(self._put, check_key(key), bytes(data))

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}.__put-{secrets.token_hex(6)}"
        try:
            write_file_synced(temp, data)
            os.rename(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temp)
            raise
        fsync_path(os.path.dirname(path))

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
            shutil.rmtree(path, ignore_errors=True)
        else:
            self.delete(prefix)

    def sync(self, key: str = "") -> None:
        fsync_path(self._path(key))

    def make_dirs(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.root)
        os.makedirs(self.root, exist_ok=True)
