"""From a command-line location to a checkpoint, through the storage interface.

A location (local path, ``file://``, ``memory://``, ``s3://``, any fsspec URL) is a checkpoint
itself or a manager directory, optionally with a step in it: step entries under any naming a
``CheckpointManager`` gives (``step_<n>``, formats/SPEC.md; ``<n>`` with ``step_prefix=None``;
``<prefix>_<n>``) and Orbax steps beside them (a run migrated from Orbax), all seen together. Everything here goes through ``ckpt.storage``, so every command works on every backend the
library saves to, and sees generation-prefixed checkpoints exactly as restore does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format import MANIFEST_NAME, TEMP_MARK, Manifest, is_temp_name, read_manifest
from ckpt._format import dtype_from_name
from ckpt._geometry import chunk_grid
from ckpt._host import Options
from ckpt._orbax import STEP_METADATA, TMP_MARK, step_of
from ckpt.cli._opened import Opened, StepRow, _is_file, _not_a_directory, open_location
from ckpt.storage import Storage, name_of, usage


_STRICT = re.compile(r"^(?:step_)?\d+$")  # the manager's default naming and step_prefix=None


@dataclass(frozen=True)
class StepEntry:
    """One entry of a manager directory that names a step: a jax-ckpt checkpoint (any naming a
    manager gives: ``step_00000100``, ``100`` with ``step_prefix=None``, ``<prefix>_<n>``), an
    Orbax step, or a save of either not committed (yet)."""

    step: int
    name: str
    kind: str  # 'jax-ckpt' or 'orbax'
    committed: bool

    @property
    def rank(self) -> int:
        """Which entry a step number means where several claim it: the manager's default
        naming first, then Orbax's, then other namings (as ``CheckpointManager`` reads them)."""
        return 0 if self.name.startswith("step_") and self.kind == "jax-ckpt" else 1 if self.kind == "orbax" else 2


def scan_all_steps(storage: Storage) -> list[StepEntry]:
    """Every step entry of a manager directory, jax-ckpt's and Orbax's, whatever the step
    naming, sorted by step. Uncommitted entries: temporary directories of either library, and
    step directories named as a manager names them that hold no manifest (a save to an object
    store that has not committed). A directory named ``<prefix>_<n>`` counts only when it holds
    a checkpoint (so ``logs_2`` is not a step)."""
    files, dirs = storage.list_dir("")
    out = []
    for name in dirs + files:
        if TMP_MARK in name:  # Orbax writing a step
            step = step_of(name.partition(TMP_MARK)[0])
            if step is not None:
                out.append(StepEntry(step, name, "orbax", False))
            continue
        if is_temp_name(name):
            step = step_of(name.split(TEMP_MARK, 1)[0])
            if step is not None:
                out.append(StepEntry(step, name, "jax-ckpt", False))
            continue
        step = step_of(name)
        if step is None or name not in dirs:
            continue
        if storage.exists(f"{name}/{MANIFEST_NAME}"):
            out.append(StepEntry(step, name, "jax-ckpt", True))
        elif storage.exists(f"{name}/{STEP_METADATA}"):
            out.append(StepEntry(step, name, "orbax", True))
        elif _STRICT.match(name):
            out.append(StepEntry(step, name, "jax-ckpt", False))
    out.sort(key=lambda e: (e.step, e.rank, e.name))
    return out


def _committed(entries: list[StepEntry]) -> dict[int, StepEntry]:
    """step -> the committed entry that step number means."""
    out: dict[int, StepEntry] = {}
    for e in entries:
        if e.committed and (e.step not in out or e.rank < out[e.step].rank):
            out[e.step] = e
    return out


def open_checkpoint(location: Any, step: int | None = None, options: Options | None = None) -> Opened:
    """The committed checkpoint at `location`, or the given (default: latest committed) step of
    the manager directory at `location` (jax-ckpt's and Orbax's steps alike), with its manifest
    read and checked. Orbax checkpoints and safetensors come back as ``Opened`` of their format
    (``ckpt.cli._foreign``): a manifest of their tree, no chunks of ours."""
    from ckpt.cli._foreign import open_foreign

    storage = open_location(location, options)
    note = None
    if storage.exists(MANIFEST_NAME):
        if step is not None:
            raise CheckpointError(f"{storage.url} is a single checkpoint, not a manager directory: drop --step")
        return Opened(storage, read_manifest(storage))
    entries = [] if is_temp_name(name_of(storage)) else scan_all_steps(storage)
    if entries:
        committed = _committed(entries)
        if step is not None:
            if step not in committed:
                steps = f"committed steps: {sorted(committed) or 'none'}"
                if any(e.step == step for e in entries):
                    raise CheckpointError(f"step {step} in {storage.url} is not committed (a save in progress, or "
                                          f"one that never finished: 'ckpt ls' shows it; {steps})")
                raise CheckpointError(f"no step {step} in {storage.url} ({steps})")
            entry = committed[step]
        elif not committed:
            raise CheckpointError(f"{storage.url} is a manager directory without a committed step")
        else:
            entry = committed[max(committed)]
            note = (f"step {entry.step} (latest) of {storage.url}: an Orbax step" if entry.kind == "orbax"
                    else f"step {entry.step} (latest committed) of {storage.url}")
        storage = storage.child(entry.name)
        if entry.kind == "jax-ckpt":
            return Opened(storage, read_manifest(storage), note)
    elif step is not None:
        raise CheckpointError(f"{storage.url} is not a manager directory (no step entries): drop --step")
    foreign = open_foreign(storage, note, options)
    if foreign is not None:
        return foreign
    return Opened(storage, read_manifest(storage), note)


def manifest_size(manifest: Manifest, manifest_bytes: int) -> tuple[int, int]:
    """(bytes, files) of a committed checkpoint as its manifest describes it: every chunk file
    plus the manifest (the small zarr.json files are not counted). For storage that cannot report
    sizes without reading every object."""
    total, files = manifest_bytes, 1
    for rec in manifest.leaves:
        st = rec.zarr
        if st is None:
            continue
        chunks = math.prod(chunk_grid(rec.shape, st.chunk_shape))
        itemsize = dtype_from_name(st.data_type).itemsize
        total += chunks * math.prod(st.chunk_shape) * itemsize
        files += chunks
    for stack in manifest.stacks:
        st = stack.zarr
        chunks = math.prod(chunk_grid(stack.shape, st.chunk_shape))
        total += chunks * math.prod(st.chunk_shape) * dtype_from_name(st.data_type).itemsize
        files += chunks
    return total, files


def _row(step: int | None, storage: Storage, note: str | None = None) -> StepRow:
    held = usage(storage)
    size, files, written = (held.bytes, held.files, held.modified) if held else (None, None, None)
    sized_by = "storage" if held else None
    state, problem = "uncommitted", note  # note: whose staged data it is (ckpt.cli._clean.notes)
    from ckpt.cli._clean import is_retired

    if is_retired(name_of(storage)):
        # A step deleted (renamed away first) whose files are not all removed yet, e.g. when the
        # process was killed during retention: not a save that failed to commit.
        state = "deleted"
    elif not is_temp_name(name_of(storage)) and storage.exists(MANIFEST_NAME):
        try:
            manifest = read_manifest(storage)
        except CheckpointError as e:
            state, problem = "corrupt", str(e).splitlines()[0]
        else:
            state, written = "committed", manifest.created
            if held is None:
                # Only the size can be wrong here (a manifest of at most 1 GiB was just read).
                manifest_bytes = len(storage.get(MANIFEST_NAME, max_bytes=1 << 30))
                (size, files), sized_by = manifest_size(manifest, manifest_bytes), "manifest"
    return StepRow(step, storage.url, state, size, files, written, problem, sized_by)


def list_steps(location: Any, options: Options | None = None) -> list[StepRow]:
    """Every step of a manager directory (jax-ckpt's and Orbax's), or the one checkpoint at
    `location`."""
    storage = open_location(location, options)
    has_manifest = storage.exists(MANIFEST_NAME)
    entries = [] if has_manifest or is_temp_name(name_of(storage)) else scan_all_steps(storage)
    from ckpt.cli._clean import notes

    staged = {} if has_manifest else notes(storage)  # uncommitted entries: a save in progress, or dead
    if entries or staged:
        # Every step, and temporary directories of other saves (save_async) beside them.
        from ckpt.cli._orbax import orbax_row

        named = {e.name for e in entries}
        rows = [orbax_row(e.step, storage.child(e.name), e.committed) if e.kind == "orbax"
                else _row(e.step, storage.child(e.name), staged.get(e.name)) for e in entries]
        return rows + [_row(None, storage.child(n), why) for n, why in sorted(staged.items()) if n not in named]
    if has_manifest or is_temp_name(name_of(storage)):
        return [_row(step_of(name_of(storage).split(TEMP_MARK)[0]), storage)]
    from ckpt._format import GENERATION_MARK

    if any(d.startswith(GENERATION_MARK) for d in storage.list_dir("")[1]):
        # A save to this location (object stores: a generation prefix) that never committed.
        return [_row(step_of(name_of(storage)), storage)]
    if _is_file(storage):
        raise _not_a_directory(storage)
    from ckpt.cli._orbax import orbax_rows

    if (orbax := orbax_rows(storage)) is not None:  # an Orbax item or step
        return orbax
    raise CheckpointError(
        f"{storage.url} is neither a checkpoint (no {MANIFEST_NAME}) nor a manager directory (no step entries: "
        "step_<n>, <n>, <prefix>_<n>)"
    )
