"""Save and restore plans: which process writes or reads which region. Pure functions of
shapes, shardings and process indices; no I/O, no devices needed, deterministic, so every
process of a job computes the same plan on its own.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from ckpt._layout import Box, box_size, chunk_box, chunks_overlapping, full_box

HOST = -1  # device id of data that lives on the host (numpy leaves)

# Packing small arrays (measured: docs/benchmarks.md, "Many small leaves"). An array of at most
# PACK_LIMIT bytes whose whole value one process holds is written by that process as one chunk:
# as a single-chunk Zarr array, or, when other such arrays have its shape and dtype, as one slice
# of a *stack* (a Zarr array of them all, chunked along its first dimension into chunks of about
# STACK_CHUNK_BYTES). Per-file costs (a create, a write, an fsync, a read) dwarf the bytes of
# small arrays: a 64x64 float32 array on 8 devices was 8 files of 2 KiB; 2,000 of them now fill
# eight 4 MiB chunk files.
PACK_LIMIT = 1 << 20
STACK_CHUNK_BYTES = 4 << 20
# Members per stack: a stack's zarr.json lists its members' leaf paths, which stays well below
# the 1 MiB readers accept for metadata files.
MAX_STACK_MEMBERS = 4096


@dataclass(frozen=True)
class ArrayShards:
    """The unique regions of one array and every (process, device id) holding a copy.

    `shape` and `dtype` (the logical dtype's name) make the array a candidate for packing; without
    them it is always written shard by shard. `chunk_shape`, when given, divides every region's
    shape: each region is then written as its chunks (one write each), else as one chunk."""

    leaf: int
    itemsize: int
    holders: Mapping[Box, Sequence[tuple[int, int]]]
    shape: tuple[int, ...] | None = None
    dtype: str = ""
    chunk_shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ShardWrite:
    """One chunk of one leaf (`box`, inside one unique region), copied from the shard `device`
    holds and written by `process`."""

    leaf: int
    box: Box
    process: int
    device: int
    nbytes: int


@dataclass(frozen=True)
class PackedWrite:
    """One chunk assembled on the host from the whole values of small arrays `process` holds.

    `array`: the leaf index of a single-chunk array, or ``-1 - s`` for stack s. `box`: the
    chunk's region of that array. `members`: (leaf, pieces) in order along the chunk's first
    dimension (one member, the whole chunk, for a single-chunk array); pieces are the leaf's
    unique regions, each with the device of `process` to copy it from."""

    array: int
    box: Box
    process: int
    members: tuple[tuple[int, tuple[tuple[Box, int], ...]], ...]
    nbytes: int


@dataclass(frozen=True)
class Stack:
    """Small arrays of one shape and dtype written by one process as one Zarr array: member k
    is index k of its first dimension; chunks hold `chunk_members` members each."""

    members: tuple[int, ...]  # leaf indices
    shape: tuple[int, ...]  # the members' shape
    dtype: str
    chunk_members: int
    process: int


@dataclass(frozen=True)
class SavePlan:
    writes: tuple[ShardWrite | PackedWrite, ...]
    stacks: tuple[Stack, ...] = ()
    whole: tuple[int, ...] = ()  # leaves packed as single-chunk arrays

    def for_process(self, process: int) -> tuple[ShardWrite | PackedWrite, ...]:
        return tuple(w for w in self.writes if w.process == process)

    def bytes_by_process(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for w in self.writes:
            out[w.process] = out.get(w.process, 0) + w.nbytes
        return out


def _chunks_of(box: Box, chunk_shape: tuple[int, ...] | None) -> list[Box]:
    """The chunks of `chunk_shape` that tile `box` (which the chunk shape divides), row-major."""
    if chunk_shape is None or all(b - a == c for (a, b), c in zip(box, chunk_shape)):
        return [box]
    for (a, b), c in zip(box, chunk_shape):
        if c <= 0 or (b - a) % c:
            raise ValueError(f"chunk shape {chunk_shape} does not divide the region {box}")
    ranges = [[(s, s + c) for s in range(a, b, c)] for (a, b), c in zip(box, chunk_shape)]
    return [tuple(p) for p in itertools.product(*ranges)]


def _least(candidates, load: dict, key=lambda c: c):
    return min(candidates, key=lambda c: (load.get(key(c), 0), c))


def plan_save(arrays: Iterable[ArrayShards], *, pack_limit: int = PACK_LIMIT,
              stack_chunk_bytes: int = STACK_CHUNK_BYTES) -> SavePlan:
    """Assign every unique region to exactly one holder, balancing bytes; pack small arrays.

    A region larger than its array's `chunk_shape` is split into its chunks first, each placed
    on its own, so the chunks of a big replicated region spread over its holders too.

    Regions held by one process go to it. Replicated regions are then placed largest first on
    the holding process with the fewest bytes so far (longest-processing-time scheduling), so
    replicated arrays are spread over processes instead of all landing on replica 0. Within a
    process, the least loaded holding device copies it. Ties break on the lowest index, so the
    result depends only on the inputs.

    An array of at most `pack_limit` bytes (shape and dtype given) of which some one process
    holds every region is packed: written whole by the least loaded such process, in a stack
    with the other packed arrays of that writer, shape and dtype, or alone as a single chunk.
    Arrays no one process holds whole are written shard by shard as above.
    """
    items, packable = [], []
    # Arrays of one shape and sharding share one holders map (array_shards): what depends only
    # on it is worked out once per map, not once per leaf.
    layouts: dict[int, tuple] = {}
    for a in arrays:
        if a.shape is not None and 0 < math.prod(a.shape) * a.itemsize <= pack_limit:
            layout = layouts.get(id(a.holders))
            if layout is None:
                boxes = sorted(a.holders.items())
                whole = tuple(sorted(set.intersection(*({p for p, _ in h} for _, h in boxes))))
                devices = {p: [(box, box_size(box), sorted({d for q, d in h if q == p})) for box, h in boxes]
                           for p in whole}
                layout = layouts[id(a.holders)] = (whole, devices)
            if layout[0]:
                packable.append((a, layout))
                continue
        for box, holders in a.holders.items():
            holders = tuple(sorted(set(holders)))
            for part in _chunks_of(box, a.chunk_shape):
                items.append((a.leaf, part, box_size(part) * a.itemsize, holders))
    items.sort(key=lambda it: (len({p for p, _ in it[3]}) > 1, -it[2], it[0], it[1]))
    proc_load: dict[int, int] = {}
    dev_load: dict[tuple[int, int], int] = {}
    writes: list = []
    for leaf, box, nbytes, holders in items:
        procs = sorted({p for p, _ in holders})
        proc = _least(procs, proc_load)
        dev = _least([d for p, d in holders if p == proc], dev_load, key=lambda d: (proc, d))
        proc_load[proc] = proc_load.get(proc, 0) + nbytes
        dev_load[(proc, dev)] = dev_load.get((proc, dev), 0) + nbytes
        writes.append(ShardWrite(leaf, box, proc, dev, nbytes))
    writes.sort(key=lambda w: (w.leaf, w.box))

    # Packed arrays: writers by the same rule (arrays only one process holds first), then each
    # region from the least loaded device of the writer that holds it.
    packable.sort(key=lambda x: (len(x[1][0]) > 1, -math.prod(x[0].shape) * x[0].itemsize, x[0].leaf))
    groups: dict[tuple, list] = {}
    for a, (procs, devices) in packable:
        proc = procs[0] if len(procs) == 1 else _least(procs, proc_load)
        proc_load[proc] = proc_load.get(proc, 0) + math.prod(a.shape) * a.itemsize
        pieces = []
        for box, size, devs in devices[proc]:
            dev = devs[0] if len(devs) == 1 else _least(devs, dev_load, key=lambda d: (proc, d))
            dev_load[(proc, dev)] = dev_load.get((proc, dev), 0) + size * a.itemsize
            pieces.append((box, dev))
        groups.setdefault((proc, a.dtype, tuple(a.shape), a.itemsize), []).append((a.leaf, tuple(pieces)))
    stacks, whole, packed = [], [], []
    for (proc, dtype, shape, itemsize), group in sorted(groups.items(), key=lambda g: min(m[0] for m in g[1])):
        group.sort()
        member_bytes = math.prod(shape) * itemsize
        if len(group) == 1:
            whole.append(group[0][0])
            packed.append(PackedWrite(group[0][0], full_box(shape), proc, (group[0],), member_bytes))
            continue
        for first in range(0, len(group), MAX_STACK_MEMBERS):
            members = group[first:first + MAX_STACK_MEMBERS]
            per_chunk = max(1, min(len(members), stack_chunk_bytes // member_bytes))
            s = len(stacks)
            stacks.append(Stack(tuple(m[0] for m in members), shape, dtype, per_chunk, proc))
            for start in range(0, len(members), per_chunk):
                part = tuple(members[start:start + per_chunk])
                box = ((start, start + len(part)),) + full_box(shape)
                packed.append(PackedWrite(-1 - s, box, proc, part, member_bytes * len(part)))
    return SavePlan(tuple(writes) + tuple(packed), tuple(stacks), tuple(sorted(whole)))


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

    @functools.cached_property
    def bytes_read(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @functools.cached_property
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
