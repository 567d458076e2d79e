"""Orbax directories on the command line: `ckpt ls` rows of their steps, and the Orbax checkpoint
`ckpt convert` converts (`inspect`, `diff` and `plan` open them through ckpt.cli._foreign)."""

from __future__ import annotations

from typing import Any

from ckpt._errors import CheckpointError
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


def orbax_row(step: int | None, s: Storage, finished: bool):
    """The `ckpt ls` row of one Orbax step (state 'orbax'; 'uncommitted' while Orbax writes it)."""
    from ckpt.cli._opened import StepRow

    usage = s.du()
    written = usage.modified if usage else None
    doc = read_json(s, STEP_METADATA, missing_ok=True) if finished else None
    stamp = doc.get("commit_timestamp_nsecs") if isinstance(doc, dict) else None
    if isinstance(stamp, int) and not isinstance(stamp, bool):
        written = stamp / 1e9
    return StepRow(step, s.url, "orbax" if finished else "uncommitted", usage.bytes if usage else None,
                   usage.files if usage else None, written, None, "storage" if usage else None)


def orbax_rows(storage: Storage) -> list | None:
    """`ckpt ls` rows for an Orbax directory, or None when it is not one."""
    kind = kind_of(storage)
    if kind is None:
        return None
    if kind == "manager":
        return [orbax_row(s.step, storage.child(s.name), s.finished) for s in scan_orbax_steps(storage)]
    return [orbax_row(step_of(storage.name) if kind == "step" else None, storage, True)]
