"""Orbax directories on the command line: `ckpt ls` rows of their steps, and the Orbax checkpoint
`ckpt convert` converts (`inspect`, `diff` and `plan` open them through ckpt.cli._foreign)."""

from __future__ import annotations

from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format import MANIFEST_NAME
from ckpt._host import Options
from ckpt._orbax import STEP_METADATA, kind_of, read_json, read_layout, scan_orbax_steps, step_of
from ckpt.storage import Storage, name_of, open_storage, usage


def _pick_step(storage: Storage, step: int | None) -> tuple[Storage, str | None]:
    """The step directory to use in an Orbax CheckpointManager directory (latest by default)."""
    steps = [s for s in scan_orbax_steps(storage) if s.finished]
    if step is None:
        latest = steps[-1]
        native = _latest_native_step(storage, after=latest.step)
        if native is None:
            return storage.child(latest.name), f"step {latest.step} (latest) of {storage.url}"
        # A directory a jax-ckpt manager took over: its newer steps need no conversion.
        return storage.child(latest.name), (f"step {latest.step} (the latest Orbax step; the latest step overall, "
                                            f"{native}, is a jax-ckpt checkpoint) of {storage.url}")
    for s in steps:
        if s.step == step:
            return storage.child(s.name), None
    raise CheckpointError(f"no step {step} in the Orbax CheckpointManager directory {storage.url} "
                          f"(steps: {[s.step for s in steps]})")


def _latest_native_step(storage: Storage, *, after: int) -> int | None:
    """The newest step of `storage` after `after` that is a jax-ckpt checkpoint (a step name
    with a manifest), or None."""
    _, dirs = storage.list_dir("")
    newer = sorted(((s, d) for d in dirs if (s := step_of(d)) is not None and s > after), reverse=True)
    return next((s for s, d in newer if storage.exists(f"{d}/{MANIFEST_NAME}")), None)


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

    held = usage(s)
    written = held.modified if held else None
    doc = read_json(s, STEP_METADATA, missing_ok=True) if finished else None
    stamp = doc.get("commit_timestamp_nsecs") if isinstance(doc, dict) else None
    if isinstance(stamp, int) and not isinstance(stamp, bool):
        written = stamp / 1e9
    return StepRow(step, s.url, "orbax" if finished else "uncommitted", held.bytes if held else None,
                   held.files if held else None, written, None, "storage" if held else None)


def orbax_rows(storage: Storage) -> list | None:
    """`ckpt ls` rows for an Orbax directory, or None when it is not one."""
    kind = kind_of(storage)
    if kind is None:
        return None
    if kind == "manager":
        return [orbax_row(s.step, storage.child(s.name), s.finished) for s in scan_orbax_steps(storage)]
    return [orbax_row(step_of(name_of(storage)) if kind == "step" else None, storage, True)]
