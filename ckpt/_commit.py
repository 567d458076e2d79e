"""The commit protocol: how a save becomes a checkpoint, atomically, in one or many processes.

1. Every process computes the save plan and a fingerprint of it; the fingerprints are compared.
2. The primary process (index 0) checks the destination and creates a temporary sibling
   directory ``<path>.tmp-<token>``; its name is broadcast.
3. Every process writes its chunks (each fsynced by the storage engine) and reports its status
   and chunk checksums to the primary.
4. When all succeeded, the primary writes and fsyncs ``manifest.msgpack`` inside the temporary
   directory, fsyncs it, and renames it to ``<path>`` in one step (RENAME_NOREPLACE, or
   RENAME_EXCHANGE when overwriting). Otherwise it removes the temporary directory.
5. The outcome is broadcast; every process returns or raises.

A crash at any point leaves either no directory at ``<path>`` (or the previous checkpoint, which
is never modified) and at most a ``.tmp-`` directory, which readers refuse and the
CheckpointManager deletes. Processes talk through a Coordinator: a local one here, the
jax.distributed key-value store in ckpt._distributed.
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Callable, Protocol

from ckpt._errors import CheckpointError
from ckpt._fs import exchange, fsync_path, remove_tree, rename_noreplace, write_file_synced
from ckpt._manifest import MANIFEST_NAME, Manifest
from ckpt._manifest_check import check_manifest

TEMP_MARK = ".tmp-"


class Coordinator(Protocol):
    """What the save and commit steps need from the processes of a job."""

    process_index: int
    process_count: int

    def new_save_id(self) -> str:
        """An id for the next save; every process gets the same one for the same save.
        Each call is matched by one ``end_save`` once this process is done with the save."""

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        """Every process's `value`, by process index. Raises naming processes that never sent.
        `key` is ``<save id>/<step>``, used once per save."""

    def broadcast(self, key: str, make: Callable[[], bytes]) -> bytes:
        """The primary's `make()`, on every process (if it raises there, the others raise too)."""

    def end_save(self, save_id: str) -> None:
        """This process made its last exchange of `save_id` (or gave up on the save)."""


class LocalCoordinator:
    """The coordinator of a single-process job."""

    process_index = 0
    process_count = 1

    def __init__(self) -> None:
        self._count = 0

    def new_save_id(self) -> str:
        self._count += 1
        return str(self._count)

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        return [value]

    def broadcast(self, key: str, make: Callable[[], bytes]) -> bytes:
        return make()

    def end_save(self, save_id: str) -> None:
        pass


_local = LocalCoordinator()


def current_coordinator() -> Coordinator:
    import jax

    if jax.process_count() == 1:
        return _local
    from ckpt._distributed import distributed_coordinator

    return distributed_coordinator()


def is_temp_name(name: str) -> bool:
    return TEMP_MARK in name


def prepare_temp_dir(final: str, *, overwrite: bool) -> str:
    """Check the destination and create the temporary directory beside it."""
    if os.path.lexists(final) and not overwrite:
        raise FileExistsError(errno.EEXIST, "checkpoint already exists (pass overwrite=True to replace it)", final)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{final}{TEMP_MARK}{secrets.token_hex(6)}"
    os.mkdir(tmp)
    return tmp


def commit_checkpoint(tmp: str, final: str, manifest: Manifest, *, overwrite: bool) -> None:
    """Write the manifest last and move the temporary directory into place atomically."""
    write_file_synced(os.path.join(tmp, MANIFEST_NAME), manifest.encode())
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


def read_manifest(root: str) -> Manifest:
    """The manifest of the committed checkpoint at `root`, with the errors readers expect."""
    if not os.path.lexists(root):
        raise FileNotFoundError(errno.ENOENT, "no checkpoint at this path", root)
    if not os.path.isdir(root):
        raise CheckpointError(f"{root} is not a checkpoint directory")
    path = os.path.join(root, MANIFEST_NAME)
    if not os.path.exists(path):
        why = (
            "it is the temporary directory of a save that never committed"
            if is_temp_name(os.path.basename(root))
            else f"it has no {MANIFEST_NAME}; a save may not have committed"
        )
        raise CheckpointError(f"{root} is not a committed checkpoint: {why}")
    with open(path, "rb") as f:
        return check_manifest(Manifest.decode(f.read(), root), root)
