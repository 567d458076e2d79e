"""Checkpoint locations and the few file-system operations the commit protocol needs."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from urllib.parse import urlparse

from ckpt._errors import CheckpointError


def local_path(path) -> str:
    """Absolute local path for a path or a file:// URL."""
    text = os.fspath(path)
    if "://" in text:
        url = urlparse(text)
        if url.scheme != "file":
            raise CheckpointError(f"unsupported checkpoint URL scheme {url.scheme!r} in {text!r}")
        text = url.path
    return os.path.abspath(text)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


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
