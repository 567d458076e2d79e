"""What the commands work on: a location opened through ``ckpt.storage`` (``open_location``), a
committed checkpoint with its manifest (``Opened``), and one row of a listing (``StepRow``)."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format import Manifest
from ckpt._options import Options, resolve
from ckpt.storage import Storage, open_storage


@dataclass(frozen=True)
class Opened:
    """A committed checkpoint, its manifest read and checked."""

    storage: Storage
    manifest: Manifest
    note: str | None = None  # set when a step was picked out of a manager directory

    @property
    def root(self) -> str:
        """The checkpoint's location, as shown to the user."""
        return self.storage.url


def _is_file(storage: Storage) -> bool:
    """Whether the location itself is a file (object), not a directory (prefix). Lists the
    parent, so it is asked only to explain an error."""
    try:
        return bool(storage.name) and storage.name in storage.parent().list_dir("")[0]
    except (OSError, CheckpointError):
        return False


def _not_a_directory(storage: Storage) -> CheckpointError:
    return CheckpointError(f"{storage.url} is not a directory (it is a file)")


def open_location(location: Any, options: Options | None) -> Storage:
    """The storage of `location`, which must hold something."""
    storage = open_storage(location, resolve(options))
    if not storage.exists_any():
        if _is_file(storage):
            raise _not_a_directory(storage)
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", storage.url)
    return storage


@dataclass(frozen=True)
class StepRow:
    """One line of `ckpt ls`. Sizes are None where the storage cannot tell them."""

    step: int | None
    path: str
    state: str  # 'committed', 'uncommitted' or 'corrupt'
    size: int | None
    files: int | None
    written: float | None  # seconds since the epoch: the manifest's 'created', else the newest file's time
    problem: str | None = None
    sized_by: str | None = None  # 'storage' (everything there), 'manifest' (chunks + manifest), None
