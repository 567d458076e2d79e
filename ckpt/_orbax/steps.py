"""Where an Orbax checkpoint is: a PyTree item, a CheckpointManager step, or a CheckpointManager
directory of steps (names ``<n>``, ``<prefix>_<n>`` or zero-padded; ``<name>.orbax-checkpoint-tmp-<k>``
while Orbax writes one). Used by restore's dispatch, the CLI and the manager."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ckpt._errors import CheckpointError
from ckpt._format import MANIFEST_NAME, METRICS_KEY
from ckpt.storage import Storage

PYTREE_METADATA = "_METADATA"  # a PyTree item
STEP_METADATA = "_CHECKPOINT_METADATA"  # a CheckpointManager step (also beside a bare item)
TMP_MARK = ".orbax-checkpoint-tmp"  # a step or item Orbax is still writing
METRICS_ITEM = "metrics"  # the item Orbax's CheckpointManager writes a step's metrics to
_STEP_NAME = re.compile(r"^(?:(.*)_)?(\d+)$")


def _exists(storage: Storage, key: str) -> bool:
    try:
        return storage.exists(key)
    except (OSError, CheckpointError):
        return False


def step_of(name: str) -> int | None:
    """The step of an Orbax step directory name ('100', 'checkpoint_100', '00000100')."""
    m = _STEP_NAME.match(name)
    return int(m.group(2)) if m else None


@dataclass(frozen=True)
class OrbaxStep:
    step: int
    name: str
    finished: bool  # not a temporary directory of a save in progress


def scan_orbax_steps(storage: Storage) -> list[OrbaxStep]:
    """The Orbax steps of a CheckpointManager directory, sorted by step (none if it is not one)."""
    _, dirs = storage.list_dir("")
    out = []
    for name in dirs:
        base, tmp, _ = name.partition(TMP_MARK)
        step = step_of(base)
        if step is None:
            continue
        if tmp or _exists(storage, f"{name}/{STEP_METADATA}"):
            out.append(OrbaxStep(step, name, not tmp))
    out.sort(key=lambda s: (s.step, s.name))
    return out


def kind_of(storage: Storage) -> str | None:
    """'item', 'step', 'manager' for an Orbax location, None for anything else (a jax-ckpt
    checkpoint included: its manifest is looked for first)."""
    if _exists(storage, MANIFEST_NAME):
        return None
    if _exists(storage, PYTREE_METADATA):
        return "item"
    if _exists(storage, STEP_METADATA):
        return "step"
    try:
        steps = scan_orbax_steps(storage)
    except (OSError, CheckpointError):
        return None
    return "manager" if any(s.finished for s in steps) else None


def _step_doc(storage: Storage) -> dict | None:
    """The step's ``_CHECKPOINT_METADATA`` (a small JSON file; untrusted input: size-limited),
    None when it is missing or not a JSON object."""
    try:
        doc = json.loads(storage.get(STEP_METADATA, max_bytes=1 << 20))
    except (OSError, CheckpointError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def step_custom_metadata(storage: Storage) -> dict:
    """The ``custom_metadata`` of the Orbax step at `storage` (what
    ``CheckpointManager.save(..., custom_metadata=)`` stored: MaxText writes
    ``{"scan_layers": true}``); {} when it has none. What a jax-ckpt step keeps as the metadata
    given to ``save(..., metadata=)``."""
    custom = (_step_doc(storage) or {}).get("custom_metadata")
    return dict(custom) if isinstance(custom, dict) and all(isinstance(k, str) for k in custom) else {}


def step_user_metadata(storage: Storage) -> dict | None:
    """The user metadata a jax-ckpt step holding what the Orbax step at `storage` holds would
    have: its custom metadata, and its metrics under METRICS_KEY; None when it has neither.
    (`convert` writes it; `ckpt inspect` shows it and `ckpt diff` compares it.)"""
    out = step_custom_metadata(storage)
    metrics = step_record(storage)[0]
    if metrics:
        out[METRICS_KEY] = metrics
    return out or None


def step_record(storage: Storage) -> tuple[dict | None, float | None]:
    """(metrics, commit time in seconds) of the Orbax step at `storage`, from its
    ``_CHECKPOINT_METADATA`` (a small JSON file) and its ``metrics`` item; None for what they
    do not say (untrusted input: size-limited, types checked)."""
    doc = _step_doc(storage)
    if doc is None:
        return None, None
    metrics = doc.get("metrics")
    if not (isinstance(metrics, dict) and metrics):
        # Orbax's CheckpointManager with best_fn writes them as the JSON item ``metrics``.
        try:
            metrics = json.loads(storage.get(f"{METRICS_ITEM}/{METRICS_ITEM}", max_bytes=1 << 20))
        except (OSError, CheckpointError, ValueError):
            metrics = None
    metrics = metrics if isinstance(metrics, dict) and metrics else None
    stamp = doc.get("commit_timestamp_nsecs") or doc.get("init_timestamp_nsecs")
    created = stamp / 1e9 if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) else None
    return metrics, created
