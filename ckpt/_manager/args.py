"""Argument checks of the CheckpointManager, each with an error naming what is wrong."""

from __future__ import annotations

import datetime
import math
import operator
from typing import Any

import msgpack

from ckpt._errors import CheckpointError
from ckpt._format import unpack_map_keys
from ckpt._manager.retention import BEST_MODES, METRICS_KEY

# Metadata travels inside the manifest, which every restore reads whole.
METADATA_LIMIT_BYTES = 1 << 20


def check_count(name: str, value: int | None, *, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}, got {value!r}")
    return value


def as_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError(f"step must be an integer, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def check_restore_step(step: Any) -> None:
    """``restore(step)``'s `step`: None or an integer. The usual slip, a target passed by
    position (``manager.restore(abstract_state)``, Orbax's ``restore(step, args=...)`` habit
    reversed), gets the call that was meant."""
    if step is None or (not isinstance(step, bool) and isinstance(step, int)):
        return
    try:
        operator.index(step)  # a numpy integer, a 0-d integer array
        return
    except TypeError:
        pass
    raise TypeError(f"step must be an integer or None, got {type(step).__name__}; to restore into a target, "
                    "pass it by keyword: manager.restore(target=abstract_state) (latest step) or "
                    "manager.restore(step, target=abstract_state)")


def check_interval(value: Any) -> float | None:
    """keep_time_interval as seconds (a timedelta or a number of seconds > 0)."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"keep_time_interval must be a datetime.timedelta or seconds, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"keep_time_interval must be positive, got {value!r}")
    return seconds


def check_best(best_fn: Any, best_mode: Any) -> None:
    if best_fn is not None and not callable(best_fn):
        raise TypeError(f"best_fn must be a callable (metrics dict -> number), got {type(best_fn).__name__}")
    if best_mode not in BEST_MODES:
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")


def snapshot_metadata(step: int, metadata: dict | None, metrics: dict | None) -> dict | None:
    """A private copy of what a step's manifest stores as user metadata (`metadata`, with
    `metrics` under METRICS_KEY), or a clear error naming the key."""
    if metadata is None and metrics is None:
        return None
    if metadata is not None and not isinstance(metadata, dict):
        raise TypeError(f"metadata for step {step} must be a dict, got {type(metadata).__name__}")
    for key, value in (metadata or {}).items():
        if not isinstance(key, str):
            raise CheckpointError(f"metadata for step {step}: key {key!r} is not a string")
        if key == METRICS_KEY:
            raise CheckpointError(f"metadata for step {step}: key {key!r} is reserved; pass metrics with metrics=")
        try:
            msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise CheckpointError(
                f"metadata for step {step}: value of {key!r} ({type(value).__name__}) cannot be stored: {e}; "
                "use None, bool, int, float, str, bytes, lists and dicts (convert numpy/jax scalars with float() or int())"
            ) from None
    stored = dict(metadata or {})
    if metrics is not None:
        stored[METRICS_KEY] = metrics
    packed = msgpack.packb(stored, use_bin_type=True)
    if len(packed) > METADATA_LIMIT_BYTES:
        raise CheckpointError(
            f"metadata for step {step} is {len(packed)} bytes; the limit is {METADATA_LIMIT_BYTES}: "
            "save large values as leaves of the tree instead"
        )
    return unpack_map_keys(packed)  # as a reader gets it back: tuple dict keys stay tuples
