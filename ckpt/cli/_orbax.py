"""Orbax directories on the command line: `ckpt ls` lists their steps, `ckpt inspect` shows what
they hold, `ckpt convert` converts them; the commands that work on jax-ckpt data (verify, diff,
plan, du, export) say what the directory is and how to convert it."""

from __future__ import annotations

from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format import ARRAY_KINDS, LeafRecord, Manifest, ZarrStorage
from ckpt._options import Options
from ckpt._orbax import STEP_METADATA, kind_of, read_json, read_layout, scan_orbax_steps, step_of
from ckpt.storage import Storage, open_storage


def _pick_step(storage: Storage, step: int | None) -> tuple[Storage, str | None]:
    """The step directory to use in an Orbax CheckpointManager directory (latest by default)."""
    steps = [s for s in scan_orbax_steps(storage) if s.finished]
    if step is None:
        return storage.child(steps[-1].name), f"step {steps[-1].step} (latest) of {storage.url}"
    for s in steps:
        if s.step == step:
            return storage.child(s.name), None
    raise CheckpointError(f"no step {step} in the Orbax CheckpointManager directory {storage.url} "
                          f"(steps: {[s.step for s in steps]})")


def orbax_source(location: Any, step: int | None, options: Options) -> tuple[Storage, str, str | None]:
    """(the Orbax checkpoint to read, what it is, a note when a step was picked) for `location`.
    CheckpointError when it is not an Orbax checkpoint."""
    storage = open_storage(location, options)
    kind = kind_of(storage)
    if kind is None:
        raise CheckpointError(f"{storage.url} is not an Orbax checkpoint, step or CheckpointManager directory")
    note = None
    if kind == "manager":
        storage, note = _pick_step(storage, step)
    elif step is not None:
        raise CheckpointError(f"{storage.url} is one Orbax checkpoint, not a CheckpointManager directory: drop --step")
    return storage, read_layout(storage).describe(), note


def refuse_orbax(storage: Storage) -> None:
    """For commands that read jax-ckpt data: an Orbax location gets an error saying what it is."""
    if kind_of(storage) is None:
        return
    what = "an Orbax CheckpointManager directory" if kind_of(storage) == "manager" else "an Orbax checkpoint"
    raise CheckpointError(f"{storage.url} is {what}, not a jax-ckpt checkpoint: 'ckpt inspect' shows it, "
                          f"ckpt.restore reads it, and 'ckpt convert {storage.url} DEST' makes a jax-ckpt "
                          "checkpoint of it")


def orbax_rows(storage: Storage) -> list | None:
    """`ckpt ls` rows for an Orbax directory (state 'orbax'; 'uncommitted' for a step being
    written), or None when it is not one."""
    from ckpt.cli._opened import StepRow

    kind = kind_of(storage)
    if kind is None:
        return None

    def row(step: int | None, s: Storage, finished: bool) -> StepRow:
        usage = s.du()
        written = usage.modified if usage else None
        doc = read_json(s, STEP_METADATA, missing_ok=True) if finished else None
        stamp = doc.get("commit_timestamp_nsecs") if isinstance(doc, dict) else None
        if isinstance(stamp, int) and not isinstance(stamp, bool):
            written = stamp / 1e9
        return StepRow(step, s.url, "orbax" if finished else "uncommitted", usage.bytes if usage else None,
                       usage.files if usage else None, written, None, "storage" if usage else None)

    if kind == "manager":
        return [row(s.step, storage.child(s.name), s.finished) for s in scan_orbax_steps(storage)]
    return [row(step_of(storage.name) if kind == "step" else None, storage, True)]


def inspect_orbax(location: Any, step: int | None, options: Options, as_json: bool) -> int | None:
    """`ckpt inspect` of an Orbax location (printed here), or None when it is not one."""
    import json
    import sys

    from ckpt._restore import OrbaxArrays
    from ckpt.cli._opened import Opened
    from ckpt.cli._render import inspect_document, json_safe, render_inspect

    storage = open_storage(location, options)
    if kind_of(storage) is None:
        return None
    storage, what, note = orbax_source(storage, step, options)
    if note:
        print(f"using {note}", file=sys.stderr)
    layout = read_layout(storage)
    OrbaxArrays(layout, options).open(range(len(layout.leaves)))
    records = []
    for leaf in layout.leaves:
        rec = leaf.record
        if rec.kind in ARRAY_KINDS:
            import numpy as np

            data_type = np.dtype(np.uint32 if rec.prng_impl else np.dtype(rec.dtype)).name
            rec = LeafRecord(rec.path, rec.kind, rec.shape, rec.dtype, rec.sharding,
                             ZarrStorage(leaf.param, leaf.chunk_shape, data_type, "orbax", "none"), None, rec.prng_impl)
        records.append(rec)
    manifest = Manifest(layout.tree, records)
    doc = inspect_document(Opened(storage, manifest))
    created = (layout.step_metadata or {}).get("commit_timestamp_nsecs")
    doc.update(format="orbax-checkpoint", format_version=None, library_version=None,
               created=created / 1e9 if isinstance(created, int) else None,
               user_metadata=None, orbax={"what": what, "items": [
                   {"name": i.name, "kind": i.kind, "layout": i.layout} for i in layout.items]})
    if as_json:
        print(json.dumps(json_safe(doc), indent=2))
        return 0
    text = render_inspect({**doc, "created": 0.0, "library_version": ""}, manifest).split("\n")
    body = text[text.index(""):]  # the table and totals, after render_inspect's own header
    print("\n".join([f"checkpoint {storage.url}", f"{what}: read by ckpt.restore through TensorStore; "
                     f"'ckpt convert' makes a jax-ckpt checkpoint of it"] + body))
    return 0
