"""Confined reads: local paths checked for links and
regular files before a library that follows links opens them (Storage module docstring;
keys themselves are checked by ``ckpt._format.check_key``).

Checkpoint files are never reached through a symbolic link. Ranged reads (``Storage.read_range``,
``Storage.size``: files jax-ckpt did not write, such as safetensors) follow a link only when its
target, resolved with ``realpath``, stays under the location (``link_target_within``): a Hugging
Face cache's snapshot links into its ``blobs/`` directory are followed, a link out of it is an
error naming the link."""

from __future__ import annotations

import errno
import os
import stat

from ckpt._errors import CheckpointError
from ckpt._format import check_key


def link_target_within(root: str, path: str) -> str:
    """The real path (``realpath``) of the symbolic link `path` found below the directory `root`,
    if it lies strictly under ``realpath(root)`` (compared as paths, component by component);
    CheckpointError naming the link otherwise."""
    real_root = os.path.realpath(root)
    target = os.path.realpath(path)
    if target == real_root or os.path.commonpath([real_root, target]) != real_root:
        raise CheckpointError(
            f"{path} is a symbolic link to {target}, which is outside {root}: a link is followed only when "
            f"its target stays under the location it is read from")
    return target


def check_local_key(root: str, key: str, *, links_within_root: bool = False) -> str:
    """For engines reading local files through a library that follows links (TensorStore's
    file driver, fsspec's local file system): the path of `key` below the directory `root` after
    checking that no component is a symbolic link and the object is a regular file (a FIFO or
    device would block or never end). With `links_within_root` (ranged reads), a link whose
    target stays under `root` is allowed (``link_target_within``)."""
    path = root.rstrip("/")
    parts = check_key(key).split("/")
    for i, part in enumerate(parts):
        path = f"{path}/{part}"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such object", path) from None
        except NotADirectoryError:
            raise CheckpointError(f"{path}: a component of the path is not a directory") from None
        if stat.S_ISLNK(st.st_mode) and links_within_root:
            path = link_target_within(root, path)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such object (a dangling link)", path) from None
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointError(f"{path} is a symbolic link; checkpoints are read only through their own "
                                  "directories and regular files")
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{path} is not a directory")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is not a regular file ({file_kind(st.st_mode)})")
    return path


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"
