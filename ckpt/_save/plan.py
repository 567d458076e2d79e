"""Describing leaves for a save: what kind each is, how it is stored (inline in the manifest or
as a Zarr array with which chunk shape), and where its unique shards live. No I/O.

Size: a pure planner (describe every leaf, then plan which process and device writes each unique
shard): one function of its inputs, tested alone.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import (
    ALGORITHM,
    INLINE_LIMIT,
    JAX_ARRAY,
    NUMPY,
    NUMPY_SCALAR,
    PRNG_KEY,
    PY_BOOL,
    PY_BYTES,
    PY_COMPLEX,
    PY_FLOAT,
    PY_INT,
    PY_STR,
    FlatLeaf,
    InlineStorage,
    LeafRecord,
    Stack,
    StackedStorage,
    ZarrStorage,
    display_path,
)
from ckpt._format import dtype_from_name, storage_of, to_storage
from ckpt._geometry import Box, box_size, describe_sharding, full_box, index_to_box
from ckpt._host import PACK_LIMIT


@dataclass
class Leaf:
    record: LeafRecord
    source: Any = None  # jax.Array / np.ndarray to write chunks from (None when inline)
    chunk_shape: tuple[int, ...] | None = None
    logical_dtype: np.dtype | None = None


# Where stacks of bundled small arrays live, below the data root ('~' never begins a leaf's
# escaped storage path, except the '~<leaf index>' of a clash, which is never '~stacks').
STACKS_DIR = "~stacks"


# Per dtype, not per leaf (numpy computes dtype names in Python; thousands of leaves share a few).
@functools.lru_cache(maxsize=256)
def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=64)
def _sharding_record(sharding, ndim: int) -> dict:
    # Trees share a handful of shardings among thousands of leaves. The record is shared by
    # every leaf with this sharding and rank and never modified. The rank is part of the key:
    # JAX accepts trailing None entries beyond it (P(None) on a 0-d array), which readers refuse
    # in a manifest, so the spec is cut to the rank here (describe_sharding's ndim).
    return describe_sharding(sharding, ndim).to_record()


def _inline_record(rec: LeafRecord, host: np.ndarray) -> None:
    rec.storage = InlineStorage(to_storage(host).tobytes())


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@functools.lru_cache(maxsize=1024)
def chunk_shape_for(shard_shape: tuple[int, ...], itemsize: int, cap: int) -> tuple[int, ...]:
    """The chunk shape of an array whose shards have `shard_shape`: the shard itself when it
    holds at most `cap` bytes, else an even division of it into chunks of at most `cap` bytes.

    Every chunk dimension divides the shard's, so each chunk lies inside one shard (one writer)
    and all chunks of the array have one shape (a regular Zarr grid). Leading dimensions are split
    first: a chunk is ``(1, ..., 1, c, shard[d+1], ..., shard[-1])`` with ``c`` a divisor of
    ``shard[d]``, the largest such chunk of at most `cap` bytes (rows of the shard stay whole,
    so a chunk is one contiguous run of the shard's memory when it is C-ordered). When
    divisibility leaves only chunks far smaller than the cap (below cap/16, e.g. a 1-d shard of
    prime length), the smallest even division larger than the cap (possibly the whole shard) is
    taken instead: a chunk may then exceed `cap` (and such a chunk is staged alone when it
    exceeds the host budget).
    """
    shape = tuple(int(n) for n in shard_shape)
    total = math.prod(shape) * itemsize
    if total <= cap or total == 0:
        return shape
    best_under: tuple[int, tuple] | None = None
    best_over: tuple[int, tuple] | None = None
    for d in range(len(shape)):
        rest = math.prod(shape[d + 1:]) * itemsize  # bytes of one index along d, later dims whole
        for c in _divisors(shape[d]):
            nbytes = c * rest
            candidate = (*(1,) * d, c, *shape[d + 1:])
            if nbytes <= cap:
                if best_under is None or nbytes > best_under[0]:
                    best_under = (nbytes, candidate)
            elif best_over is None or nbytes < best_over[0]:
                best_over = (nbytes, candidate)
    if best_under is not None and (best_under[0] * 16 >= cap or best_over is None):
        return best_under[1]
    return best_over[1] if best_over is not None else shape  # (a 0-d array)


def describe(leaf: FlatLeaf, process_count: int, max_chunk_bytes: int | None = None) -> Leaf:
    """What `leaf` is and how it is stored; array leaves get their chunk shape
    (``chunk_shape_for`` the shard shape and `max_chunk_bytes`; None: the shard shape)."""
    v, path = leaf.value, leaf.path
    rec = LeafRecord(path=path, kind="")
    if isinstance(v, jax.core.Tracer):
        raise CheckpointError(f"leaf {display_path(path)!r} is a tracer: save outside jit/vmap")
    if isinstance(v, jax.Array):
        if v.is_deleted():
            raise CheckpointError(f"leaf {display_path(path)!r}: the array was deleted (donated?) before the save")
        data = v
        rec.kind = JAX_ARRAY
        if _is_key(v.dtype):
            rec.kind, rec.prng_impl = PRNG_KEY, str(jax.random.key_impl(v))
            data = jax.random.key_data(v)
        rec.shape, rec.dtype = tuple(data.shape), _dtype_name(data.dtype)
        try:
            # The key array's rank, not its key data's: the spec lays out the keys.
            rec.sharding = _sharding_record(v.sharding, v.ndim)
        except ValueError as e:
            raise CheckpointError(f"leaf {display_path(path)!r}: cannot record its sharding: {e}") from None
        nbytes = data.size * data.dtype.itemsize
        if data.size == 0:
            # No data, so nothing to write or gather: every process records the same (empty)
            # inline value. A Zarr array of it would have a zero chunk dimension (the shard
            # shape of (0, 8) over 'x' is (0, 1)), which no chunk grid can hold.
            _inline_record(rec, np.empty(data.shape, data.dtype))
            return Leaf(rec)
        if nbytes <= INLINE_LIMIT and (process_count == 1 or (data.sharding.is_fully_replicated and any(
                d.process_index == 0 for d in data.sharding.device_set))):
            full = data.addressable_shards[0].data if process_count > 1 else data
            _inline_record(rec, np.asarray(full))
            return Leaf(rec)
        chunk = tuple(data.sharding.shard_shape(data.shape))
        if max_chunk_bytes is not None:
            chunk = chunk_shape_for(chunk, data.dtype.itemsize, max_chunk_bytes)
        return Leaf(rec, data, chunk, np.dtype(data.dtype))
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        rec.kind = NUMPY if isinstance(v, np.ndarray) else NUMPY_SCALAR
        if a.dtype.kind in "OUSMm" or a.dtype.names is not None or a.dtype.subdtype is not None:
            raise CheckpointError(f"leaf {display_path(path)!r}: cannot save numpy dtype {a.dtype}")
        try:
            storage_of(a.dtype)
        except TypeError:
            raise CheckpointError(f"leaf {display_path(path)!r}: cannot save numpy dtype {a.dtype}") from None
        rec.shape, rec.dtype = a.shape, a.dtype.name
        if a.nbytes <= INLINE_LIMIT:
            _inline_record(rec, a)
            return Leaf(rec)
        chunk = tuple(a.shape)
        if max_chunk_bytes is not None:
            chunk = chunk_shape_for(chunk, a.dtype.itemsize, max_chunk_bytes)
        return Leaf(rec, a, chunk, a.dtype)
    if isinstance(v, bool):
        rec.kind, rec.value = PY_BOOL, v
    elif isinstance(v, int):
        rec.kind, rec.value = PY_INT, v if -(2**63) <= v < 2**64 else str(v)
    elif isinstance(v, float):
        rec.kind, rec.value = PY_FLOAT, v
    elif isinstance(v, complex):
        rec.kind, rec.value = PY_COMPLEX, [v.real, v.imag]
    elif isinstance(v, str):
        rec.kind, rec.value = PY_STR, v
    elif isinstance(v, bytes):
        rec.kind, rec.value = PY_BYTES, v
    else:
        raise CheckpointError(
            f"leaf {display_path(path)!r}: cannot save a value of type {type(v).__module__}.{type(v).__qualname__}"
            + _not_data_hint(v)
        )
    return Leaf(rec)


def _not_data_hint(v: Any) -> str:
    import sys

    if not callable(v):
        return ""
    if "equinox" in sys.modules:  # a whole equinox Module holds its functions (activations...) as leaves
        return ("; a function is not data: save only the arrays of an equinox Module, "
                "eqx.filter(model, eqx.is_array) or the first half of eqx.partition(model, eqx.is_array), and "
                "eqx.combine the restored arrays with the rest (docs/frameworks/equinox.md)")
    return "; a function is not data: save only the arrays (and numbers, strings) of the tree"


def finish_array_records(leaves: list[Leaf], paths: list[str]) -> None:
    for leaf, spath in zip(leaves, paths):
        if leaf.source is None:
            continue
        storage_dtype, encoding = storage_of(leaf.logical_dtype)
        # chunk_checksums are filled in at commit.
        leaf.record.storage = ZarrStorage(spath, tuple(leaf.chunk_shape), storage_dtype.name, encoding, ALGORITHM)


def bundle_records(leaves: list[Leaf], plan: SavePlan) -> list[Stack]:
    """Give the leaves the plan packs their storage: one whole-array chunk, or a member of a
    stack (at STACKS_DIR/<stack>). Returns the stacks (their checksums are filled in at commit)."""
    for i in plan.whole:
        leaf = leaves[i]
        leaf.chunk_shape = tuple(leaf.record.shape)
        leaf.record.storage = dataclasses.replace(leaf.record.storage, chunk_shape=leaf.chunk_shape)
    stacks = []
    for s, planned in enumerate(plan.stacks):
        storage_dtype, encoding = storage_of(dtype_from_name(planned.dtype))
        zarr = ZarrStorage(f"{STACKS_DIR}/{s}", (planned.chunk_members, *planned.shape), storage_dtype.name,
                           encoding, ALGORITHM)
        stack = Stack((len(planned.members), *planned.shape), planned.dtype, zarr)
        stacks.append(stack)
        for k, i in enumerate(planned.members):
            leaves[i].record.storage = StackedStorage(s, k, stack)
            leaves[i].chunk_shape = None
    return stacks


def array_shards(leaves: list[Leaf]) -> list[ArrayShards]:
    """The unique regions of every array leaf written as Zarr, with their holders, shapes and
    dtypes (for packing)."""
    out, cache, grids = [], {}, {}
    for i, leaf in enumerate(leaves):
        src = leaf.source
        if src is None:
            continue
        if isinstance(src, np.ndarray):
            holders = {full_box(src.shape): [(0, HOST)]}
        else:
            key = (src.sharding, src.shape)
            if key not in cache:
                shard = tuple(src.sharding.shard_shape(src.shape))
                if src.ndim and all(n > 0 and k > 0 and n % k == 0 for n, k in zip(src.shape, shard)):
                    # Evenly divided: every device's cell in the grid of shards, once per
                    # sharding and grid (the layers of a model share one), then scaled to this
                    # shape. Working out every device's region costs O(devices) in Python:
                    # 32,768 devices at 4,096 x 8, once per grid instead of once per shape.
                    parts = tuple(n // k for n, k in zip(src.shape, shard))
                    grid = grids.get((src.sharding, parts))
                    if grid is None:
                        grid = grids[(src.sharding, parts)] = _holders(src.sharding, parts)
                    cache[key] = {tuple((a * k, b * k) for (a, b), k in zip(box, shard)): h
                                  for box, h in grid.items()}
                else:
                    cache[key] = _holders(src.sharding, src.shape)
            holders = cache[key]
        out.append(ArrayShards(i, src.dtype.itemsize, holders, tuple(leaf.record.shape), leaf.record.dtype,
                               tuple(leaf.chunk_shape)))
    return out


HOST = -1  # device id of data that lives on the host (numpy leaves)


def _holders(sharding, shape: tuple[int, ...]) -> dict[Box, list[tuple[int, int]]]:
    """Every unique region of an array of `shape` under `sharding`, with its (process, device)
    holders."""
    holders: dict[Box, list[tuple[int, int]]] = {}
    for d, idx in sharding.devices_indices_map(shape).items():
        holders.setdefault(index_to_box(idx, shape), []).append((d.process_index, d.id))
    return holders


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

    @property
    def array_id(self) -> int:
        """The id of the array the chunk belongs to (``array_specs``)."""
        return self.leaf


@dataclass(frozen=True)
class BundledWrite:
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

    @property
    def array_id(self) -> int:
        return self.array


@dataclass(frozen=True)
class PlannedStack:
    """Small arrays of one shape and dtype written by one process as one Zarr array: member k
    is index k of its first dimension; chunks hold `chunk_members` members each."""

    members: tuple[int, ...]  # leaf indices
    shape: tuple[int, ...]  # the members' shape
    dtype: str
    chunk_members: int
    process: int


@dataclass(frozen=True)
class SavePlan:
    writes: tuple[ShardWrite | BundledWrite, ...]
    stacks: tuple[PlannedStack, ...] = ()
    whole: tuple[int, ...] = ()  # leaves bundled as single-chunk arrays
    # With `process` (plan_save): (leaf, chunk box, writer) of every chunk this process holds
    # and another writes: the pointers of its index object (the packed layout, SPEC section 13).
    pointers: tuple[tuple[int, Box, int], ...] = ()
    whole_writers: tuple[tuple[int, int], ...] = ()  # (leaf, process) of each leaf in `whole`

    def for_process(self, process: int) -> tuple[ShardWrite | BundledWrite, ...]:
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


class _Loads:
    """Bytes assigned so far per process, kept per holder set: the writer of a region held by
    the processes `S` is chosen by the bytes given to each member of `S` by regions of `S` (and
    by bundled arrays), never by regions of other sets. So every member of `S` (which holds all
    of them) reaches the same choices from what it holds alone: a process plans only its own
    part (issue 23: the whole job's plan is 13.8 M writes at 1,024 hosts)."""

    def __init__(self, base: dict[int, int]) -> None:
        self._base = base  # bundled arrays' bytes, known to every process
        self._sets: dict[tuple[int, ...], dict[int, int]] = {}

    def assign(self, procs: tuple[int, ...], nbytes: int) -> int:
        heap = self._sets.get(procs)
        if heap is None:  # a heap: a set may hold every process of the job (a replicated array)
            heap = self._sets[procs] = [(self._base.get(p, 0), p) for p in procs]
            heapq.heapify(heap)
        load, proc = heap[0]
        heapq.heapreplace(heap, (load + nbytes, proc))
        return proc


def plan_save(arrays: Iterable[ArrayShards], *, pack_limit: int = PACK_LIMIT,
              stack_chunk_bytes: int = STACK_CHUNK_BYTES, process: int | None = None) -> SavePlan:
    """Assign every unique region to exactly one holder, balancing bytes; bundle small arrays.

    `process` given: plan only the writes of that process (``writes`` holds its own; stacks and
    whole arrays are the job's, the same on every process). The union over processes of their
    plans is the plan without `process`: each process computes its own part in time and memory
    that grow with the regions it holds, not with the job's.

    An array of at most `pack_limit` bytes (shape and dtype given) of which some one process
    holds every region is bundled: written whole by the least loaded such process (loads of
    bundled arrays only, so every process computes the same bundling), in a stack with the other
    bundled arrays of that writer, shape and dtype, or alone as a single chunk.

    The other arrays are written region by region, a region larger than its array's
    `chunk_shape` split into its chunks first, each placed on its own. Regions held by one
    process go to it. Replicated regions are placed largest first on the holding process with
    the fewest bytes so far among the same holders (longest-processing-time scheduling within
    each set of holders, seeded with the bundled bytes), so replicated arrays are spread over
    processes instead of all landing on replica 0. Within a process, the least loaded holding
    device copies it. Ties break on the lowest index, so the result depends only on the inputs.
    """
    bundleable, big = _bundleable(list(arrays), pack_limit)
    bundled_load: dict[int, int] = {}
    dev_load: dict[tuple[int, int], int] = {}
    groups = _place_bundled(bundleable, bundled_load, dev_load)
    writes, pointers = _place_regions(big, process, bundled_load, dev_load)
    stacks, whole, bundled, whole_writers = _bundle(groups, stack_chunk_bytes, process)
    return SavePlan(tuple(writes) + tuple(bundled), tuple(stacks), tuple(sorted(whole)), tuple(sorted(pointers)),
                    tuple(sorted(whole_writers)))


def _bundleable(arrays: list[ArrayShards], pack_limit: int) -> tuple[list, list]:
    """(bundleable, big): the arrays of at most `pack_limit` bytes some one process holds whole,
    each with (the processes holding it whole, each box's devices by process); the others."""
    bundleable = []
    # Arrays of one shape and sharding share one holders map (array_shards): what depends only
    # on it is worked out once per map, not once per leaf.
    placements: dict[int, tuple] = {}
    big = []
    for a in arrays:
        if a.shape is not None and 0 < math.prod(a.shape) * a.itemsize <= pack_limit:
            placement = placements.get(id(a.holders))
            if placement is None:
                boxes = sorted(a.holders.items())
                whole = tuple(sorted(set.intersection(*({p for p, _ in h} for _, h in boxes))))
                # Each box's devices by process, once per holders map (a replicated array's one
                # box has every device of the job: 32,768 at 4,096 x 8).
                by_proc = []
                for box, h in boxes:
                    devs: dict[int, list[int]] = {}
                    for q, d in h:
                        devs.setdefault(q, []).append(d)
                    by_proc.append((box, devs))
                placement = placements[id(a.holders)] = (whole, by_proc)
            if placement[0]:
                bundleable.append((a, placement))
                continue
        big.append(a)
    return bundleable, big


def _place_bundled(bundleable: list, bundled_load: dict[int, int], dev_load: dict[tuple[int, int], int]) -> dict:
    """The bundled arrays' writers and devices, grouped by (writer, dtype, shape, itemsize): lists
    of (leaf, pieces). Adds their bytes to `bundled_load` (by process) and `dev_load`."""
    # Bundled arrays first, by every process alike: writers among those holding the array whole
    # (arrays only one process holds first), then each region from the least loaded device of
    # the writer that holds it.
    bundleable.sort(key=lambda x: (len(x[1][0]) > 1, -math.prod(x[0].shape) * x[0].itemsize, x[0].leaf))
    sets = _Loads(bundled_load)
    groups: dict[tuple, list] = {}
    for a, (procs, boxes) in bundleable:
        nbytes = math.prod(a.shape) * a.itemsize
        proc = procs[0] if len(procs) == 1 else sets.assign(procs, nbytes)
        bundled_load[proc] = bundled_load.get(proc, 0) + nbytes
        pieces = []
        for box, devices in boxes:
            devs = sorted(set(devices[proc]))
            dev = devs[0] if len(devs) == 1 else _least(devs, dev_load, key=lambda d: (proc, d))
            dev_load[(proc, dev)] = dev_load.get((proc, dev), 0) + box_size(box) * a.itemsize
            pieces.append((box, dev))
        groups.setdefault((proc, a.dtype, tuple(a.shape), a.itemsize), []).append((a.leaf, tuple(pieces)))
    return groups


def _place_regions(big: list[ArrayShards], process: int | None, bundled_load: dict[int, int],
                   dev_load: dict[tuple[int, int], int]) -> tuple[list, list]:
    """(writes, pointers): the region writes of `process` (of every process without it), and
    the (leaf, chunk box, writer) of the chunks it holds and another writes."""
    # Regions: only those `process` holds (all of them without it), each holder set balanced
    # on its own (seeded with the bundled bytes, which every process knows alike).
    sets = _Loads(bundled_load)
    items = []
    by_proc: dict[int, list] = {}
    seen: dict[int, tuple] = {}
    for a in big:
        if process is None:
            mine = a.holders.items()
        else:
            held = by_proc.get(id(a.holders))
            if held is None:
                held = by_proc[id(a.holders)] = [
                    (box, h) for box, h in a.holders.items()
                    if (h[0][0] == process if len(h) == 1 else any(p == process for p, _ in h))]
            mine = held
        for box, holders in mine:
            # (holders, their processes, this process's devices among them), once per list
            # of holders: a replicated region's list has every device of the job.
            known = seen.get(id(holders))
            if known is None:
                unique = tuple(sorted(set(holders)))
                procs = tuple(sorted({p for p, _ in unique}))
                devices: dict[int, list[int]] = {}
                for p, d in unique:
                    devices.setdefault(p, []).append(d)
                known = seen[id(holders)] = (holders, procs, devices)
            for part in _chunks_of(box, a.chunk_shape):
                items.append((a.leaf, part, box_size(part) * a.itemsize, known))
    items.sort(key=lambda it: (len(it[3][1]) > 1, -it[2], it[0], it[1]))
    writes: list = []
    pointers: list = []
    for leaf, box, nbytes, (_, procs, devices) in items:
        proc = procs[0] if len(procs) == 1 else sets.assign(procs, nbytes)
        if process is not None and proc != process:
            pointers.append((leaf, box, proc))
            continue
        dev = _least(devices[proc], dev_load, key=lambda d: (proc, d))
        dev_load[(proc, dev)] = dev_load.get((proc, dev), 0) + nbytes
        writes.append(ShardWrite(leaf, box, proc, dev, nbytes))
    writes.sort(key=lambda w: (w.leaf, w.box))
    return writes, pointers


def _bundle(groups: dict, stack_chunk_bytes: int, process: int | None) -> tuple[list, list, list, list]:
    """(stacks, whole, bundled writes, whole_writers) of the bundled arrays' `groups`: a group of
    one is a single-chunk array, the others stacks of at most MAX_STACK_MEMBERS members."""
    stacks, whole, bundled, whole_writers = [], [], [], []
    for (proc, dtype, shape, itemsize), group in sorted(groups.items(), key=lambda g: min(m[0] for m in g[1])):
        group.sort()
        member_bytes = math.prod(shape) * itemsize
        if len(group) == 1:
            whole.append(group[0][0])
            whole_writers.append((group[0][0], proc))
            if process is None or proc == process:
                bundled.append(BundledWrite(group[0][0], full_box(shape), proc, (group[0],), member_bytes))
            continue
        for first in range(0, len(group), MAX_STACK_MEMBERS):
            members = group[first:first + MAX_STACK_MEMBERS]
            per_chunk = max(1, min(len(members), stack_chunk_bytes // member_bytes))
            s = len(stacks)
            stacks.append(PlannedStack(tuple(m[0] for m in members), shape, dtype, per_chunk, proc))
            if process is not None and proc != process:
                continue
            for start in range(0, len(members), per_chunk):
                part = tuple(members[start:start + per_chunk])
                box = ((start, start + len(part)),) + full_box(shape)
                bundled.append(BundledWrite(-1 - s, box, proc, part, member_bytes * len(part)))
    return stacks, whole, bundled, whole_writers
