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

from ckpt._errors import CheckpointError
from ckpt._format import MANIFEST_NAME, Manifest, find_manifest, is_temp_name, read_manifest
from ckpt._host import Options
from ckpt._layout import packed_reads
from ckpt._orbax import PYTREE_METADATA, STEP_METADATA, TMP_MARK, step_of
from ckpt._restore import orbax_source, safetensors_source
from ckpt.storage import Storage, open_storage, pinned


class Source(Protocol):
    """A format other than jax-ckpt's own, read behind the same restore and metadata calls."""

    def detect(self, path: Any, options: Options | None) -> bool: ...
    def restore(self, path: Any, target: Any, *, mesh: Any, partial: bool, options: Options | None,
                allow_lossy_cast: bool = False, axis_names: dict[str, str] | None = None,
                rename: Any = None) -> Any: ...
    def metadata(self, path: Any, options: Options | None) -> Any: ...


# Sniffed in this order, and only where the location holds no jax-ckpt manifest.
FOREIGN: tuple[Source, ...] = (safetensors_source.SOURCE, orbax_source.SOURCE)


def chunk_source(storage: Storage, manifest: Manifest | None) -> Storage:
    """What the chunks of the checkpoint at `storage` are read through: the store itself (the
    files layout: an object per chunk), or, for a packed checkpoint, the layout's reader
    (``ckpt._layout.PackedChunks``: through the index objects)."""
    if manifest is None or manifest.layout is None:
        return storage
    return packed_reads(storage, manifest)


@contextlib.contextmanager
def open_native(path: Any, options: Options) -> Iterator[tuple[Storage, Manifest | None]]:
    """(the location pinned, its manifest), or (the location, None) where it holds no manifest.
    Pinned: the manifest and every chunk come from the checkpoint that was at `path` when it was
    opened, even if an overwrite replaces it meanwhile (``ckpt.storage.pinned``): never a mix of two."""
    storage = open_storage(path, options)
    with contextlib.ExitStack() as stack:
        try:
            reading = stack.enter_context(pinned(storage))
        except (FileNotFoundError, NotADirectoryError):  # no directory there: no manifest either
            reading = None
        if reading is None:
            yield storage, None
        else:
            manifest = find_manifest(reading)
            yield chunk_source(reading, manifest), manifest


def foreign_source(path: Any, options: Options | None, resolved: Options) -> Source | None:
    """The source of another format at `path`. Where there is none, the error that says why
    `path` is not a checkpoint (``require_manifest``'s: a manager directory lists its steps);
    None if a manifest was committed there since ``open_native`` looked (read it natively)."""
    if safetensors_source.SOURCE.detect(path, options):
        return safetensors_source.SOURCE
    storage = open_storage(path, resolved)
    refuse_manager_directory(storage)  # Orbax's steps and ours alike, before Orbax's own sniffing
    for source in FOREIGN:
        if source is not safetensors_source.SOURCE and source.detect(path, options):
            return source
    read_manifest(storage)
    return None


def require_manifest(storage: Storage) -> Manifest:
    """The manifest at `storage`, or the error that says why there is none: a manager directory
    lists its steps (``refuse_manager_directory``); otherwise ``read_manifest``'s."""
    manifest = find_manifest(storage)
    if manifest is None:
        refuse_manager_directory(storage)
        manifest = read_manifest(storage)
    return manifest


# A manager directory's steps named in an error: the first and the last few, an ellipsis between.
_SHOWN_STEPS = 3


def manager_steps(storage: Storage) -> list[tuple[int, str, bool]]:
    """(step, entry name, is Orbax's) for each committed step directly under `storage`: a
    directory named as a step (``step_00000100``, ``100``, ``checkpoint_100``...) holding a
    jax-ckpt manifest or Orbax's ``_CHECKPOINT_METADATA``; [] for anything else (a checkpoint, an
    Orbax step, a file, nothing). One LIST, then ``stat_many`` of the step-named directories'
    markers; only ever on the way to an error (no checkpoint at `storage`)."""
    try:
        files, dirs = storage.list_dir("")
    except (OSError, ValueError, CheckpointError):  # nothing there, a file, a location that cannot list
        return []
    if not dirs or {MANIFEST_NAME, STEP_METADATA, PYTREE_METADATA} & set(files):
        return []  # a checkpoint (or an Orbax item or step) itself: its subdirectories are its data
    named = [(step, name) for name in sorted(dirs) if not (is_temp_name(name) or TMP_MARK in name)
             for step in [step_of(name)] if step is not None]
    keys = [f"{name}/{marker}" for _, name in named for marker in (MANIFEST_NAME, STEP_METADATA)]
    try:
        present = storage.stat_many(keys)
    except (OSError, CheckpointError):
        return []
    found: dict[int, tuple[int, str, bool]] = {}
    for step, name in named:
        if step in found:
            continue
        if present.get(f"{name}/{MANIFEST_NAME}") is not None:
            found[step] = (step, name, False)
        elif present.get(f"{name}/{STEP_METADATA}") is not None:
            found[step] = (step, name, True)
    return [found[s] for s in sorted(found)]


def refuse_manager_directory(storage: Storage) -> None:
    """Raise CheckpointError naming the steps (a few, the latest) where `storage` is a
    CheckpointManager directory (jax-ckpt's, Orbax's or both) rather than one checkpoint."""
    steps = manager_steps(storage)
    if not steps:
        return
    numbers = [str(s) for s, _, _ in steps]
    if len(numbers) > 2 * _SHOWN_STEPS:
        numbers = numbers[:_SHOWN_STEPS] + ["..."] + numbers[-_SHOWN_STEPS:]
    latest, name, _ = steps[-1]
    orbax = sum(1 for _, _, o in steps if o)
    kinds = "" if not orbax else " (all Orbax's)" if orbax == len(steps) else f" ({orbax} of them Orbax's)"
    raise CheckpointError(
        f"{storage.url} is a CheckpointManager directory, not one checkpoint: it holds {len(steps)} "
        f"step{'s' if len(steps) > 1 else ''}{kinds}: {', '.join(numbers)} (latest {latest}); restore one "
        f"step, e.g. {storage.where(name)}, or open the directory with "
        f"ckpt.CheckpointManager({storage.url!r}, read_only=True) and call .restore(step)")
