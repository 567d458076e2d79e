"""Retention decisions of the CheckpointManager, as pure functions of what the manifests say.

Which committed steps to delete depends only on the step numbers, the metrics and the save
times stored in the steps' manifests (never on the clock or on timing), so every process would
decide the same; only process 0 deletes anyway. The policy follows Orbax's CheckpointManager:

- ``max_to_keep`` None keeps everything.
- Without ``best_fn``: the newest ``max_to_keep`` steps are kept.
- With ``best_fn``: the ``max_to_keep`` steps whose metrics score best are kept; steps saved
  without metrics (or whose score cannot be computed) are kept as well when
  ``keep_checkpoints_without_metrics`` (the default), else they go first.
- Whatever the above says, a step is also kept when it is a multiple of ``keep_every_n_steps``,
  when ``keep_time_interval`` preserves it (walking the steps oldest first, one whose save time is
  at least the interval after the last step preserved this way; the oldest step is preserved),
  and the newest step is never deleted.

Metrics are stored in the step's manifest, inside its user metadata under ``METRICS_KEY``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ckpt._errors import CheckpointError
from ckpt._format import METRICS_KEY  # noqa: F401 (reserved key of a manager step's user metadata)
BEST_MODES = ("min", "max")


@dataclass(frozen=True)
class StepFacts:
    """What retention knows of a committed step, from its manifest."""

    metrics: dict | None = None  # None: saved without metrics (or unreadable)
    created: float | None = None  # save time (seconds since the epoch); None: unknown


# Metrics are a JSON tree; nesting deeper than this is refused at save (no eval report needs it,
# and the manifest's reader stays far from msgpack's own stack limit).
METRICS_MAX_DEPTH = 32


def check_metrics(step: int, metrics: Any) -> dict | None:
    """A plain copy of `metrics`: any JSON tree under a dict (str keys; dicts, lists, str, int,
    float, bool, None; tuples become lists; 0-d numpy / jax numbers are converted with
    ``.item()``), or a clear error naming the key path at fault."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics for step {step} must be a dict, got {type(metrics).__name__}")
    return _json_copy(step, metrics, "", 0)


def _json_copy(step: int, value: Any, where: str, depth: int) -> Any:
    at = f"value of {where!r}" if where else "metrics"
    if depth > METRICS_MAX_DEPTH:
        raise CheckpointError(f"metrics for step {step}: {at} is nested deeper than {METRICS_MAX_DEPTH} levels")
    if isinstance(value, Mapping):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"metrics for step {step}: key {key!r}{f' in {where!r}' if where else ''} "
                                      "is not a string (metrics are a JSON tree)")
            out[key] = _json_copy(step, v, f"{where}/{key}" if where else key, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_json_copy(step, v, f"{where}/{i}", depth + 1) for i, v in enumerate(value)]
    if value is not None and not isinstance(value, (bool, int, float, str)) and getattr(value, "shape", None) == () \
            and hasattr(value, "item"):
        value = value.item()  # a numpy scalar or a 0-d (jax) array: a Python number now
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise CheckpointError(
            f"metrics for step {step}: {at} ({type(value).__name__}) is not a number, a string, None, a list or "
            "a dict; metrics are a JSON tree of scalars (use float(x)); store anything else with metadata= or in "
            "the tree"
        )
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        raise CheckpointError(f"metrics for step {step}: {at} does not fit 64 bits")
    return value


def score(best_fn: Callable[[dict], Any], metrics: dict, step: int) -> float:
    """``best_fn(metrics)`` as a float (NaN allowed), or a clear error naming the step."""
    try:
        value = best_fn(metrics)
        value = float(value.item() if hasattr(value, "item") else value)
    except Exception as e:
        raise ValueError(f"best_fn failed on the metrics of step {step} ({metrics!r}): {type(e).__name__}: {e}") from e
    return value


def _goodness(value: float, best_mode: str) -> float:
    """Larger is better; NaN (a diverged run's loss) ranks worst in either mode."""
    if math.isnan(value):
        return -math.inf
    return -value if best_mode == "min" else value


def time_preserved(steps: list[int], facts: Mapping[int, StepFacts], interval: float) -> set[int]:
    """The steps ``keep_time_interval`` preserves: oldest first, each step saved at least
    `interval` seconds after the last one preserved (the oldest is preserved). Steps without a
    known save time are not preserved by time."""
    kept: set[int] = set()
    last: float | None = None
    for step in sorted(steps):
        created = facts[step].created if step in facts else None
        if created is None:
            continue
        if last is None or created >= last + interval:
            kept.add(step)
            last = created
    return kept


def steps_to_delete(committed: list[int], max_to_keep: int | None, keep_every_n_steps: int | None = None, *,
                    facts: Mapping[int, StepFacts] | None = None, best_fn: Callable[[dict], Any] | None = None,
                    best_mode: str = "min", keep_checkpoints_without_metrics: bool = True,
                    keep_time_interval: float | None = None) -> list[int]:
    """The committed steps retention removes (module docstring), sorted.

    Args:
        committed: the committed step numbers.
        max_to_keep: how many to keep (the newest, or the best with `best_fn`); None keeps all.
        keep_every_n_steps: also keep the multiples of this.
        facts: metrics and save time of each step (missing: no metrics, unknown time).
        best_fn: metrics dict -> a number; steps are ranked by it.
        best_mode: ``"min"``: smaller is better; ``"max"``: larger is better.
        keep_checkpoints_without_metrics: with `best_fn`, keep the steps that have no metrics.
        keep_time_interval: seconds; also keep one step per interval of save time.
    """
    if max_to_keep is None or not committed:
        return []
    facts = facts or {}
    ordered = sorted(set(committed))
    n = max(max_to_keep, 1)
    if best_fn is None:
        candidates = ordered[:-n]
    else:
        scored, without = [], []
        for step in ordered:
            metrics = facts[step].metrics if step in facts else None
            if metrics is None:
                without.append(step)
                continue
            try:
                scored.append((score(best_fn, metrics, step), step))
            except ValueError:
                without.append(step)  # cannot be ranked: judged as a step without metrics
        # Worst first; among equal scores the older step goes first.
        scored.sort(key=lambda p: (_goodness(p[0], best_mode), p[1]))
        ranked = [s for _, s in scored]
        candidates = ranked[:-n] if len(ranked) > n else []
        if not keep_checkpoints_without_metrics:
            pool = without + ranked
            candidates = pool[:-n] if len(pool) > n else []
    keep = {ordered[-1]}
    if keep_every_n_steps:
        keep.update(s for s in ordered if s % keep_every_n_steps == 0)
    if keep_time_interval is not None:
        keep |= time_preserved(ordered, facts, keep_time_interval)
    return sorted(s for s in candidates if s not in keep)


def best_step(committed: list[int], facts: Mapping[int, StepFacts], best_fn: Callable[[dict], Any],
              best_mode: str) -> int | None:
    """The committed step whose metrics score best (the newest among equals); None when no step
    has metrics that `best_fn` can score."""
    best: tuple[float, int] | None = None
    for step in sorted(committed):
        metrics = facts[step].metrics if step in facts else None
        if metrics is None:
            continue
        try:
            value = score(best_fn, metrics, step)
        except ValueError:
            continue
        key = (_goodness(value, best_mode), step)
        if best is None or key >= best:
            best = key
    return None if best is None else best[1]
