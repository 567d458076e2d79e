"""The local engine: a directory on a POSIX file system, the fast path.

Chunks are written through TensorStore's zarr3 driver with direct I/O from the library's
page-aligned buffers (each file fsynced) and read back whole with O_DIRECT into aligned buffers;
small files, listing and deletion are plain system calls. A save is staged in a sibling
``<path>.tmp-<hex>`` directory and committed by one rename (renameat2 NOREPLACE, or EXCHANGE when
overwriting), so the checkpoint's own layout has no generation prefix.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from typing import Callable, Iterable

import numpy as np

from ckpt._errors import CheckpointError
from ckpt.storage._base import MANIFEST_NAME, TEMP_MARK, Staged, Usage, aligned_empty, size_mismatch
from ckpt.storage._tensorstore import TensorStoreStorage, shared_context

_PAGE = 4096
_direct_reads: bool | None = None  # unknown until the first open


def _open_for_read(file: str) -> int:
    """An fd for reading `file`, with O_DIRECT unless the file system refuses it."""
    global _direct_reads
    if _direct_reads is not False and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
            _direct_reads = True
            return fd
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _direct_reads = False
    return os.open(file, os.O_RDONLY)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class LocalStorage(TensorStoreStorage):
    """A directory on the local file system (`root`: an absolute path)."""

    engine = "local"
    renames = True
    conditional_writes = True

    def __init__(self, root: str, concurrency: int):
        self.root = os.path.abspath(root)
        self._concurrency = concurrency
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
    def name(self) -> str:
        return os.path.basename(self.root)

    # ---- bytes -------------------------------------------------------------------------

    def get(self, key: str, *, max_bytes: int) -> bytes:
        path = self._path(key)
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise size_mismatch(path, os.stat(path).st_size, max_bytes)
        return data

    def read_exact(self, key: str, nbytes: int) -> np.ndarray:
        """One whole file, read straight into a page-aligned buffer.

        With the ``bytes`` codec a chunk file is exactly the chunk's little-endian bytes, so this
        is one read, with O_DIRECT where the file system allows it (no page-cache copy). The
        alignment also lets JAX adopt the buffer as a CPU device buffer without a copy.
        """
        file = self._path(key)
        padded = -(-nbytes // _PAGE) * _PAGE  # direct reads want whole pages
        buf = aligned_empty(padded + _PAGE, _PAGE)  # one page more, to see a too-long file
        fd = _open_for_read(file)
        try:
            filled = 0
            while filled < len(buf):
                n = os.readv(fd, [memoryview(buf)[filled:]])
                if n == 0:
                    break
                filled += n
        finally:
            os.close(fd)
        if filled != nbytes:
            raise size_mismatch(file, filled if filled < nbytes else os.stat(file).st_size, nbytes)
        return buf[:nbytes]

    def put_if_absent(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file_synced(path, data, exclusive=True)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def exists_any(self) -> bool:
        return os.path.lexists(self.root)

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

    # ---- commit: a staged sibling directory, renamed into place --------------------------

    def stage(self, *, overwrite: bool) -> Staged:
        if os.path.lexists(self.root) and not overwrite:
            raise FileExistsError(errno.EEXIST, "checkpoint already exists (pass overwrite=True to replace it)", self.root)
        os.makedirs(os.path.dirname(self.root), exist_ok=True)
        tmp = f"{self.root}{TEMP_MARK}{secrets.token_hex(6)}"
        os.mkdir(tmp)
        return Staged(LocalStorage(tmp, self._concurrency), "", {"tmp": os.path.basename(tmp)})

    def staged_from(self, info: dict) -> Staged:
        tmp = os.path.join(os.path.dirname(self.root), info["tmp"])
        return Staged(LocalStorage(tmp, self._concurrency), "", info)

    def commit(self, staged: Staged, manifest: bytes, *, overwrite: bool,
               old_data: Callable[[], Iterable[str]] | None = None) -> None:
        tmp, final = staged.storage.where(""), self.root
        write_file_synced(os.path.join(tmp, MANIFEST_NAME), manifest)
        fsync_path(tmp)
        if overwrite and os.path.lexists(final):
            if exchange(tmp, final):
                remove_tree(tmp)  # holds the previous checkpoint now
            else:
                # No atomic exchange here: the old checkpoint is moved aside, never modified.
                old = f"{final}{TEMP_MARK}old-{secrets.token_hex(6)}"
                os.rename(final, old)
                os.rename(tmp, final)
                remove_tree(old)
        else:
            rename_noreplace(tmp, final)
        fsync_path(os.path.dirname(final))

    def abort(self, staged: Staged) -> None:
        remove_tree(staged.storage.where(""))

    def retire(self) -> None:
        # A rename to a temporary name first (after which it is no longer a checkpoint), made
        # durable, then the removal of the files.
        retired = f"{self.root}{TEMP_MARK}deleted-{secrets.token_hex(6)}"
        os.rename(self.root, retired)
        fsync_path(os.path.dirname(self.root))
        remove_tree(retired)

    def make_dirs(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", self.root)
        os.makedirs(self.root, exist_ok=True)
