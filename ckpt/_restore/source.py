"""The first step of a restore: what the location holds.

A jax-ckpt checkpoint is looked for first: its manifest, one GET (no LIST, no stat of other
files), read from the pinned location the rest of the restore reads from. Only where there is
no manifest are other formats sniffed, each a *source* with the same three calls
(``detect``, ``restore``, ``metadata``): safetensors (files, index files, directories of shards)
and Orbax checkpoints, whose data goes through the same reader as native chunks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol

from ckpt._format import Manifest, find_manifest, read_manifest
from ckpt._options import Options
from ckpt._restore import orbax_source, safetensors_source
from ckpt.storage import Storage, open_storage


class Source(Protocol):
    """A format other than jax-ckpt's own, read behind the same restore and metadata calls."""

    def detect(self, path: Any, options: Options | None) -> bool: ...
    def restore(self, path: Any, target: Any, *, mesh: Any, partial: bool, options: Options | None,
                allow_lossy_cast: bool = False) -> Any: ...
    def metadata(self, path: Any, options: Options | None) -> Any: ...


# Sniffed in this order, and only where the location holds no jax-ckpt manifest.
FOREIGN: tuple[Source, ...] = (safetensors_source.SOURCE, orbax_source.SOURCE)


@contextlib.contextmanager
def open_native(path: Any, options: Options) -> Iterator[tuple[Storage, Manifest | None]]:
    """(the location pinned, its manifest), or (the location, None) where it holds no manifest.
    Pinned: the manifest and every chunk come from the checkpoint that was at `path` when it was
    opened, even if an overwrite replaces it meanwhile (``Storage.pin``): never a mix of two."""
    storage = open_storage(path, options)
    with contextlib.ExitStack() as stack:
        try:
            pinned = stack.enter_context(storage.pin())
        except (FileNotFoundError, NotADirectoryError):  # no directory there: no manifest either
            pinned = None
        if pinned is None:
            yield storage, None
        else:
            yield pinned, find_manifest(pinned)


def foreign_source(path: Any, options: Options | None, resolved: Options) -> Source | None:
    """The source of another format at `path`. Where there is none, the error that says why
    `path` is not a checkpoint (``read_manifest``'s); None if a manifest was committed there
    since ``open_native`` looked (read it natively)."""
    for source in FOREIGN:
        if source.detect(path, options):
            return source
    read_manifest(open_storage(path, resolved))
    return None
