"""Save and restore plans: which process writes or reads which region. Pure functions of
shapes, shardings and process indices; no I/O, no devices needed, deterministic, so every
process of a job computes the same plan on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ckpt._layout import Box, box_size, chunk_box, chunks_overlapping

HOST = -1  # device id of data that lives on the host (numpy leaves)


@dataclass(frozen=True)
class ArrayShards:
    """The unique regions of one array and every (process, device id) holding a copy."""

    leaf: int
    itemsize: int
    holders: Mapping[Box, Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class ShardWrite:
    """One unique region (one chunk) of one leaf, copied from `device` and written by `process`."""

    leaf: int
    box: Box
    process: int
    device: int
    nbytes: int


@dataclass(frozen=True)
class SavePlan:
    writes: tuple[ShardWrite, ...]

    def for_process(self, process: int) -> tuple[ShardWrite, ...]:
        return tuple(w for w in self.writes if w.process == process)

    def bytes_by_process(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for w in self.writes:
            out[w.process] = out.get(w.process, 0) + w.nbytes
        return out


def plan_save(arrays: Iterable[ArrayShards]) -> SavePlan:
    """Assign every unique region to exactly one holder, balancing bytes.

    Regions held by one process go to it. Replicated regions are then placed largest first on
    the holding process with the fewest bytes so far (longest-processing-time scheduling), so
    replicated arrays are spread over processes instead of all landing on replica 0. Within a
    process, the least loaded holding device copies it. Ties break on the lowest index, so the
    result depends only on the inputs.
    """
    items = []
    for a in arrays:
        for box, holders in a.holders.items():
            items.append((a.leaf, box, box_size(box) * a.itemsize, tuple(sorted(set(holders)))))
    items.sort(key=lambda it: (len({p for p, _ in it[3]}) > 1, -it[2], it[0], it[1]))
    proc_load: dict[int, int] = {}
    dev_load: dict[tuple[int, int], int] = {}
    writes = []
    for leaf, box, nbytes, holders in items:
        procs = sorted({p for p, _ in holders})
        proc = min(procs, key=lambda p: (proc_load.get(p, 0), p))
        devs = [d for p, d in holders if p == proc]
        dev = min(devs, key=lambda d: (dev_load.get((proc, d), 0), d))
        proc_load[proc] = proc_load.get(proc, 0) + nbytes
        dev_load[(proc, dev)] = dev_load.get((proc, dev), 0) + nbytes
        writes.append(ShardWrite(leaf, box, proc, dev, nbytes))
    writes.sort(key=lambda w: (w.leaf, w.box))
    return SavePlan(tuple(writes))


@dataclass(frozen=True)
class ChunkRead:
    index: tuple[int, ...]
    box: Box
    nbytes: int


@dataclass(frozen=True)
class RegionRead:
    """A region some local devices need, and the chunks (by index) that cover it."""

    box: Box
    chunks: tuple[tuple[int, ...], ...]
    nbytes: int


@dataclass(frozen=True)
class LeafReadPlan:
    leaf: int
    regions: tuple[RegionRead, ...]
    chunks: tuple[ChunkRead, ...]  # unique: each chunk is read once for all regions

    @property
    def bytes_read(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def bytes_needed(self) -> int:
        return sum(r.nbytes for r in self.regions)


def plan_leaf_read(
    leaf: int,
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    itemsize: int,
    boxes: Iterable[Box],
) -> LeafReadPlan:
    """Unique regions out of `boxes` and the unique chunks to read for them."""
    regions, chunks = [], {}
    for box in sorted(set(boxes)):
        idx = tuple(chunks_overlapping(box, chunk_shape))
        regions.append(RegionRead(box, idx, box_size(box) * itemsize))
        for i in idx:
            if i not in chunks:
                cbox = chunk_box(i, chunk_shape, shape)
                chunks[i] = ChunkRead(i, cbox, box_size(cbox) * itemsize)
    return LeafReadPlan(leaf, tuple(regions), tuple(chunks[i] for i in sorted(chunks)))


def batch_by_budget(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Split positions 0..n-1 into consecutive batches whose sizes sum to at most `budget`
    (a single item over budget forms a batch of its own)."""
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > budget:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        batches.append(current)
    return batches
