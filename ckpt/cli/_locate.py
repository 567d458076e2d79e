"""From a command-line location to a checkpoint, through the storage interface.

A location (local path, ``file://``, ``memory://``, ``s3://``, any fsspec URL) is a checkpoint
itself or a manager directory (``step_<n>`` entries, formats/SPEC.md), optionally with a step in
it. Everything here goes through ``ckpt.storage``, so every command works on every backend the
library saves to, and sees generation-prefixed checkpoints exactly as restore does.
"""

from __future__ import annotations

import math
from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format import MANIFEST_NAME, TEMP_MARK, Manifest, is_temp_name, read_manifest
from ckpt._format import dtypes as _dtypes
from ckpt._geometry import chunk_grid
from ckpt._manager import parse_step, scan_steps, step_dir_name
from ckpt._options import Options
from ckpt.cli._opened import Opened, StepRow, _is_file, _not_a_directory, open_location
from ckpt.storage import Storage


def _committed_steps(storage: Storage) -> list[int]:
    return [e.step for e in scan_steps(storage) if e.committed]


def open_checkpoint(location: Any, step: int | None = None, options: Options | None = None) -> Opened:
    """The committed checkpoint at `location`, or the given (default: latest committed) step of
    the manager directory at `location`, with its manifest read and checked."""
    if step is not None:
        name = step_dir_name(step)  # ValueError for a negative step, before any I/O
    storage = open_location(location, options)
    note = None
    if step is not None:
        if storage.exists(MANIFEST_NAME) and not scan_steps(storage):
            raise CheckpointError(f"{storage.url} is a single checkpoint, not a manager directory: drop --step")
        child = storage.child(name)
        if not child.exists_any():
            steps = _committed_steps(storage)
            raise CheckpointError(f"no step {step} in {storage.url} (committed steps: {steps or 'none'})")
        storage = child
    elif not storage.exists(MANIFEST_NAME) and not is_temp_name(storage.name):
        entries = scan_steps(storage)
        if entries:
            committed = [e for e in entries if e.committed]
            if not committed:
                raise CheckpointError(f"{storage.url} is a manager directory without a committed step")
            note = f"step {committed[-1].step} (latest committed) of {storage.url}"
            storage = storage.child(committed[-1].name)
    if not storage.exists(MANIFEST_NAME):
        from ckpt.cli._orbax import refuse_orbax

        refuse_orbax(storage)  # an Orbax directory: say what it is and what reads it
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
        itemsize = _dtypes.dtype_from_name(st.data_type).itemsize
        total += chunks * math.prod(st.chunk_shape) * itemsize
        files += chunks
    for stack in manifest.stacks:
        st = stack.zarr
        chunks = math.prod(chunk_grid(stack.shape, st.chunk_shape))
        total += chunks * math.prod(st.chunk_shape) * _dtypes.dtype_from_name(st.data_type).itemsize
        files += chunks
    return total, files


def _row(step: int | None, storage: Storage, note: str | None = None) -> StepRow:
    usage = storage.du()
    size, files, written = (usage.bytes, usage.files, usage.modified) if usage else (None, None, None)
    sized_by = "storage" if usage else None
    state, problem = "uncommitted", note  # note: whose staged data it is (ckpt.cli._clean.notes)
    from ckpt.cli._clean import is_retired

    if is_retired(storage.name):
        # A step deleted (renamed away first) whose files are not all removed yet, e.g. when the
        # process was killed during retention: not a save that failed to commit.
        state = "deleted"
    elif not is_temp_name(storage.name) and storage.exists(MANIFEST_NAME):
        try:
            manifest = read_manifest(storage)
        except CheckpointError as e:
            state, problem = "corrupt", str(e).splitlines()[0]
        else:
            state, written = "committed", manifest.created
            if usage is None:
                # Only the size can be wrong here (a manifest of at most 1 GiB was just read).
                manifest_bytes = len(storage.get(MANIFEST_NAME, max_bytes=1 << 30))
                (size, files), sized_by = manifest_size(manifest, manifest_bytes), "manifest"
    return StepRow(step, storage.url, state, size, files, written, problem, sized_by)


def list_steps(location: Any, options: Options | None = None) -> list[StepRow]:
    """Every step of a manager directory, or the one checkpoint at `location`."""
    storage = open_location(location, options)
    has_manifest = storage.exists(MANIFEST_NAME)
    entries = [] if has_manifest else scan_steps(storage)
    from ckpt.cli._clean import notes

    staged = {} if has_manifest else notes(storage)  # uncommitted entries: a save in progress, or dead
    if entries or staged:
        # Every step, and temporary directories of other saves (save_async) beside them.
        named = {e.name for e in entries}
        rows = [_row(e.step, storage.child(e.name), staged.get(e.name)) for e in entries]
        return rows + [_row(None, storage.child(n), why) for n, why in sorted(staged.items()) if n not in named]
    if has_manifest or is_temp_name(storage.name):
        return [_row(parse_step(storage.name.split(TEMP_MARK)[0]), storage)]
    from ckpt._format import GENERATION_MARK

    if any(d.startswith(GENERATION_MARK) for d in storage.list_dir("")[1]):
        # A save to this location (object stores: a generation prefix) that never committed.
        return [_row(parse_step(storage.name), storage)]
    if _is_file(storage):
        raise _not_a_directory(storage)
    from ckpt.cli._orbax import orbax_rows

    if (orbax := orbax_rows(storage)) is not None:  # an Orbax directory: its steps (state 'orbax')
        return orbax
    raise CheckpointError(
        f"{storage.url} is neither a checkpoint (no {MANIFEST_NAME}) nor a manager directory (no step_* entries)"
    )
