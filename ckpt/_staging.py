"""Host staging: device-to-host copies of the shards this process writes, owned by the library.

All copies start together (``copy_to_host_async`` on every shard) before any is waited on, so
transfers from different devices overlap. Once ``take`` has returned, the caller may donate,
delete or overwrite the arrays.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import jax
import numpy as np

from ckpt._plan import HOST, ShardWrite


def start_copies(sources: dict[int, Any], writes: Sequence[ShardWrite]) -> list[tuple[ShardWrite, Any]]:
    """Start every device-to-host copy; return (write, per-device array or host array)."""
    by_device: dict[int, dict[int, Any]] = {}
    pending = []
    for w in writes:
        src = sources[w.leaf]
        if w.device == HOST:
            pending.append((w, src))
            continue
        if w.leaf not in by_device:
            by_device[w.leaf] = {s.device.id: s for s in src.addressable_shards}
        data = by_device[w.leaf][w.device].data
        data.copy_to_host_async()
        pending.append((w, data))
    return pending


def owned_copy(x: Any) -> np.ndarray:
    """A host array the library owns, whatever happens to `x` afterwards."""
    if isinstance(x, jax.Array):
        # On the CPU backend np.asarray is a view of the device buffer, which donation
        # overwrites; elsewhere it is the fresh host buffer copy_to_host_async filled.
        if x.devices().pop().platform == "cpu":
            return np.array(x, copy=True)
        return np.asarray(x)
    return np.array(x, copy=True)


def take(pending: list[tuple[ShardWrite, Any]]) -> Iterator[tuple[ShardWrite, np.ndarray]]:
    """Owned host copies in plan order; each yielded as soon as it exists."""
    for w, x in pending:
        yield w, owned_copy(x)
