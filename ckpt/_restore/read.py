"""Restore's reader: the chunks each region needs, read within a host memory budget, verified,
assembled and placed on its devices one region (or piece of a region) at a time.

Work is cut into *units*: a region some local devices need, or, for an array whose chunks and
copies do not fit the budget, the part of a region in a *tile* (a chunk-aligned box; each chunk
lies in one tile, so it is read once for every region that needs it). Units are read in batches
whose host bytes fit ``host_budget_bytes``: all reads of a batch are issued at once, from this
thread where the engine has asynchronous I/O (``Storage.read_chunk_async``), and each chunk is
checked against its CRC-32C when first used. Each unit is placed on its devices as it is
assembled (ckpt._place); a leaf is made with ``make_array_from_single_device_arrays`` once all
its units are placed; a batch's buffers are dropped when it is done. Every host buffer the
reader allocates is counted in a ``HostBudget`` where it is allocated, so the high-water mark is
measured, not predicted. Not counted: a numpy result the caller asked for (it is the result) and
device memory (on CPU, device memory is host memory: a device buffer may even adopt a host
buffer handed to ``device_put``; such buffers are never written after).

Size: the reader's batches, reads in flight, checks and assembly are one pipeline whose memory
accounting must be read whole.
"""
from __future__ import annotations

import gc
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ckpt._errors import CheckpointError, ChecksumError
from ckpt._format import PRNG_KEY, LeafRecord, chunk_checksum, display_path
from ckpt._format import VALUES, dtype_from_name, from_storage, storage_of, to_storage
from ckpt._geometry import (
    Box,
    box_shape,
    box_size,
    chunk_box,
    chunk_grid,
    chunk_key,
    chunks_overlapping,
    flat_chunk_index,
    full_box,
    index_to_box,
    intersect,
    relative,
)
from ckpt._host import PAGE, HostBudget, Options, ReadBuffers, aligned_empty
from ckpt._restore.place import BATCH_PUT_MAX_BYTES, _Build, _Lease, _Piece, _split, _Unit
from ckpt._restore.plan import PLAN_BYTES_PER_CHUNK, LeafReadPlan, plan_budget, _key_data_sharding, _Want, cast_values, held_note, plan_leaf_read
from ckpt._layout import ChunkRuns
from ckpt.storage import Done, Storage, StoreCaps


@dataclass
class RestoreStats:
    bytes_read: int = 0
    bytes_needed: int = 0
    chunks_read: int = 0
    per_leaf: dict = field(default_factory=dict)
    host_budget: int = 0
    host_high_water: int = 0  # most bytes of chunks and regions the reader held at once


# An engine that holds each ranged response whole until it is taken (StoreCaps.response_part_bytes:
# TensorStore on object stores) gets batches of two parts per request in flight, at least 128 MiB:
# with a whole 0.5 GiB restore in flight at once, that memory and the read buffers were fresh pages
# for every byte. It restored the benchmark tree from SeaweedFS in 0.69 s instead of 0.95 s
# (medians of 8, interleaved: docs/benchmarks.md). The next batch's reads go out while one is placed.
MIN_READ_WINDOW = 128 << 20


def read_window(caps: StoreCaps, io_concurrency: int) -> int | None:
    """The most chunk bytes a restore reads in one batch from a store with `caps`, with
    `io_concurrency` requests in flight (None: as many as the host budget allows)."""
    if caps.response_part_bytes is None:
        return None
    return max(MIN_READ_WINDOW, 2 * io_concurrency * caps.response_part_bytes)


def _bounding_box(boxes: list[Box]) -> Box:
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def rec_itemsize(rec: LeafRecord) -> int:
    return dtype_from_name(rec.dtype).itemsize


class Reader:
    """Reads the chunks of planned regions through a Storage, verified, within a budget."""

    def __init__(self, storage: Storage, leaves: list[LeafRecord], verify: bool, stats: RestoreStats,
                 options: Options):
        self.storage, self.leaves, self.verify, self.stats = storage, leaves, verify, stats
        self.options = options
        self.budget = HostBudget(options.host_budget_bytes)
        self._limit = self.budget.limit  # what tiles and batches are cut to fit (run())
        stats.host_budget = options.host_budget_bytes
        # Read buffers reused batch after batch, where the engine reads into given buffers.
        self.caps = storage.caps if storage is not None else StoreCaps()  # (None: a planner only)
        self.buffers = ReadBuffers(self.budget) if self.caps.reads_into_buffers else None
        self._runs = isinstance(storage, ChunkRuns)  # (reads a batch's chunks together)
        self._plans: dict[tuple, LeafReadPlan] = {}
        self._planned = 0  # chunks in self._plans, bounded by the budget (plan.check_plan_size)
        self._bounds: dict[int, Box] = {}  # id(a template's regions) -> their bounding box (_groups)
        self.wants: list[_Want] = []
        self._sources: dict = {}

    def plan(self, want: _Want) -> LeafReadPlan:
        rec = self.leaves[want.index]
        sharding = want.sharding
        if sharding is not None and rec.kind == PRNG_KEY:
            sharding = _key_data_sharding(sharding, rec)
        itemsize = dtype_from_name(rec.dtype).itemsize
        # Many leaves share a shape, sharding and chunking (layer stacks, optimizer states):
        # their plans differ only in the leaf index.
        key = (sharding, rec.shape, rec.chunk_shape, itemsize)
        template = self._plans.get(key)
        if template is None:
            if sharding is None:
                boxes = [full_box(rec.shape)]
            else:
                boxes = [index_to_box(idx, rec.shape)
                         for idx in sharding.addressable_devices_indices_map(rec.shape).values()]
            # (the plans a restore keeps, all together, are bounded by the budget: what each
            # leaf's plan is left of it)
            template = plan_leaf_read(want.index, rec.shape, rec.chunk_shape, itemsize, boxes,
                                      budget=plan_budget(self.options.host_budget_bytes) - self._planned * PLAN_BYTES_PER_CHUNK)
            self._plans[key] = template
            self._planned += len(template.chunks)
        if template.leaf == want.index:
            return template
        plan = LeafReadPlan(want.index, template.regions, template.chunks)
        # Its sums are the template's (functools.cached_property keeps them in __dict__).
        plan.__dict__.update(bytes_needed=template.bytes_needed, bytes_read=template.bytes_read)
        return plan

    # ---- units and their sources -------------------------------------------------------

    def _source_bytes(self, key: tuple) -> int:
        """Host bytes a source holds once read (a trimmed copy of an edge chunk included)."""
        if key[0] == "i":
            rec = self.leaves[key[1]]
            return 2 * math.prod(rec.shape) * dtype_from_name(rec.dtype).itemsize
        st = self._array_of(key)
        itemsize = np.dtype(st.data_type).itemsize
        padded = math.prod(st.chunk_shape) * itemsize
        trimmed = box_size(chunk_box(key[2], st.chunk_shape, self._shape_of(key))) * itemsize
        return padded + (trimmed if trimmed != padded else 0)

    def _buffer_bytes(self, key: tuple) -> int:
        """The read buffer a chunk source needs: its whole chunk shape, in whole pages."""
        st = self._array_of(key)
        return -(-math.prod(st.chunk_shape) * np.dtype(st.data_type).itemsize // PAGE) * PAGE

    def _array_of(self, key: tuple):
        return self._sources[key][0].zarr if key[0] == "z" else self._sources[key][0].stacked.array.zarr

    def _shape_of(self, key: tuple):
        rec = self._sources[key][0]
        return rec.shape if key[0] == "z" else rec.stacked.array.shape

    def sources_of(self, k: int, rec: LeafRecord, box: Box) -> tuple[_Piece, ...]:
        """The sources (chunks, stack chunks, inline data) covering `box` of leaf `rec`, the
        wanted leaf number `k`: what a planner that reads nothing itself (the shared restore)
        splits among the processes."""
        return self._pieces(k, rec, box)

    def _pieces(self, k: int, rec: LeafRecord, box: Box) -> tuple[_Piece, ...]:
        if rec.zarr is not None:
            out = []
            for c in chunks_overlapping(box, rec.zarr.chunk_shape):
                key = ("z", rec.zarr.path, c)
                self._sources.setdefault(key, (rec, k))
                out.append(_Piece(key, chunk_box(c, rec.zarr.chunk_shape, rec.shape)))
            return tuple(out)
        if rec.stacked is not None:
            st = rec.stacked.array.zarr
            c = (rec.stacked.index // st.chunk_shape[0],) + (0,) * (len(st.chunk_shape) - 1)
            key = ("s", st.path, c)
            self._sources.setdefault(key, (rec, k))
            return (_Piece(key, full_box(rec.shape), rec.stacked.index - c[0] * st.chunk_shape[0]),)
        key = ("i", self.wants[k].index)
        self._sources.setdefault(key, (rec, k))
        return (_Piece(key, full_box(rec.shape)),)

    def _unit_cost(self, rec: LeafRecord, want: _Want, box: Box, pieces) -> int:
        n = box_size(box)
        logical = dtype_from_name(rec.dtype)
        storage_size = storage_of(logical)[0].itemsize
        direct = len(pieces) == 1 and pieces[0].box == box
        cost = 0 if direct else n * storage_size  # an assembled copy
        if storage_of(logical)[1] == VALUES:
            cost += n * logical.itemsize
        if np.dtype(want.dtype) != logical:
            cost += n * np.dtype(want.dtype).itemsize
        return cost

    def _small(self, nbytes: int) -> bool:
        """Whether a leaf of `nbytes` (as read or as wanted, whichever is larger) is placed in one
        batched transfer: its shards are then held until the last is read, so it must be small
        against the budget too (a quarter of the limit batches are cut to)."""
        return nbytes < min(BATCH_PUT_MAX_BYTES, self._limit // 4)

    def _unit(self, k: int, rec: LeafRecord, want: _Want, box: Box, region: Box) -> _Unit:
        pieces = self._pieces(k, rec, box)
        return _Unit(k, box, region, pieces, self._unit_cost(rec, want, box, pieces))

    def _groups(self, k: int, want: _Want, plan: LeafReadPlan, split: bool) -> list[list[_Unit]]:
        """The units of a leaf in groups that share their chunks: the whole leaf when it fits
        the budget (one unit per region); else *tiles*, chunk-aligned boxes cut from the
        regions' bounding box until each tile's chunks and largest piece fit, each piece the
        part of a region in a tile (so a chunk two regions share is read once, for both)."""
        rec = self.leaves[want.index]
        regions = [r.box for r in plan.regions]

        def units_of(tile: Box) -> list[_Unit]:
            return [self._unit(k, rec, want, inter, r) for r in regions
                    if (inter := r if tile is None else intersect(r, tile)) is not None]

        if split and want.sharding is not None and len(regions) > 1:
            # A small leaf is one unit, its regions' bounding box: read and assembled once, cut
            # per device as it is placed (one make_array_from_callback; place._Build.whole), not
            # one unit per device.
            bound = self._bounds.get(id(plan.regions))
            if bound is None:  # (leaves of one plan template share it: Reader.plan)
                bound = self._bounds[id(plan.regions)] = _bounding_box(regions)
            if self._small(box_size(bound) * max(rec_itemsize(rec), np.dtype(want.dtype).itemsize)):
                return [[self._unit(k, rec, want, bound, bound)]]
        if not split or rec.zarr is None or not regions:
            return [units_of(None)]
        needed = {c.index for c in plan.chunks}

        def fits(tile: Box) -> bool:
            units = units_of(tile)
            sources = sum(self._source_bytes(("z", rec.zarr.path, c))
                          for c in chunks_overlapping(tile, rec.zarr.chunk_shape) if c in needed)
            return sources + max((u.cost for u in units), default=0) <= self._limit

        return [g for g in (units_of(t) for t in _split(_bounding_box(regions), rec.zarr.chunk_shape, fits)) if g]

    # ---- reading -----------------------------------------------------------------------

    def run(self, wants: list[_Want]) -> dict[int, Any]:
        """The value of every wanted leaf (by leaf index), host memory within the budget."""
        self.wants, self._sources = wants, {}
        # What tiles and batches are cut to fit: the budget, or twice the engine's read window
        # where that is less (batches of one window each).
        window = read_window(self.caps, self.options.io_concurrency)
        self._limit = self.budget.limit if window is None else min(self.budget.limit, 2 * window)
        groups: list[list[_Unit]] = []
        builds = []
        for k, w in enumerate(wants):
            plan = self.plan(w)
            self._count_plan(w, plan)
            mine = self._groups(k, w, plan, split=True)
            groups += mine
            rec = self.leaves[w.index]
            # One group is read and placed in one batch: its shards may wait for each other.
            together = len(mine) == 1 and self._small(
                plan.bytes_needed * max(1, np.dtype(w.dtype).itemsize // rec_itemsize(rec)))
            builds.append(_Build(rec, w, sum(len(g) for g in mine), together))
        out: dict[int, Any] = {}
        for k, b in enumerate(builds):
            if b.left == 0:
                out[wants[k].index] = b.value()
        # Batches of at most half that limit, so that the next batch's reads are in flight
        # while this one is assembled and placed (two batches held at once: the limit).
        batches = self._batches(groups, self._limit // 2)
        ahead = None  # the next batch's sources, its reads issued
        try:
            for i, (batch, cost) in enumerate(batches):
                get, ahead = ahead or self._batch_sources(batch).__enter__(), None
                try:
                    if i + 1 < len(batches) and cost + batches[i + 1][1] <= self._limit:
                        ahead = self._batch_sources(batches[i + 1][0]).__enter__()
                    self._place_batch(batch, get, builds, out)
                finally:
                    get.__exit__(None, None, None)
                    del get
                if any(u.box != u.region for u in batch):
                    # A piece put on a CPU device and then copied into the device's shard is
                    # freed only by the cyclic collector (one piece lingered per device; restore
                    # pauses the collector): a young-generation pass frees it before the next batch.
                    gc.collect(0)
        finally:
            if ahead is not None:
                ahead.__exit__(None, None, None)
        if self.buffers is not None:
            self.buffers.close()
        return out

    def _place_batch(self, batch: list[_Unit], get: "_Sources", builds: list[_Build], out: dict) -> None:
        wants = self.wants
        pending = []
        for u in batch:
            lease = _Lease(self.budget)
            data, whole_chunk = self._assemble(u, get, lease)
            w = wants[u.k]
            data, converted = self._convert(self.leaves[w.index], w, data, lease)
            build = builds[u.k]
            made = build.put(u, data, whole_chunk or converted, lease)
            del data
            # Host buffers handed to device_put stay alive until the copies finish. A unit's
            # own copies are given back once placed (a batch holds its sources and one unit's
            # copies at a time); a unit placed straight from its sources is waited for at the
            # end of the batch, so that the copies to the devices overlap the reads still
            # arriving. A small shard waits for the rest of its leaf (made is None), its lease
            # kept until the leaf is placed.
            if made is not None and lease.taken:
                jax.block_until_ready(made)
                lease.close()
            elif made is not None:
                pending += made
            if build.left == 0:
                out[w.index] = value = build.value()
                if build.leases:
                    jax.block_until_ready(value)
                    for held in build.leases:
                        held.close()
                    build.leases = []
                elif isinstance(value, jax.Array):
                    pending.append(value)
        jax.block_until_ready(pending)

    def read(self, plans: list[LeafReadPlan]) -> dict[int, dict[Box, np.ndarray]]:
        """The regions of each plan (storage dtype), every chunk read once, verified; one batch
        (the caller asked for these regions: no budget applies)."""
        self.wants = [_Want(p.leaf, None, dtype_from_name(self.leaves[p.leaf].dtype)) for p in plans]
        self._sources = {}
        units = []
        for k, p in enumerate(plans):
            self._count_plan(self.wants[k], p)
            units += self._groups(k, self.wants[k], p, split=False)[0]
        out: dict[int, dict[Box, np.ndarray]] = {p.leaf: {} for p in plans}
        with self._batch_sources(units) as get:
            for u in units:
                out[plans[u.k].leaf][u.box] = self._assemble(u, get, get.lease)[0]
        if self.buffers is not None:
            self.buffers.close()
        return out

    def _count_plan(self, want: _Want, plan: LeafReadPlan) -> None:
        rec = self.leaves[want.index]
        self.stats.bytes_needed += plan.bytes_needed
        # A stacked leaf's own bytes of the stack chunk (read once for all its members).
        own = rec.stacked.array.member_bytes if rec.stacked is not None else 0
        self.stats.per_leaf[rec.path] = (own, plan.bytes_needed)

    def _batches(self, groups: list[list[_Unit]], limit: int) -> list[tuple[list[_Unit], int]]:
        """(batch, its bytes): consecutive groups whose sources (each counted once) and largest
        unit copies fit `limit`; a group over it alone is a batch of its own (a chunk is read
        once for all the units that need it)."""
        batches, current, keys, sources, most = [], [], set(), 0, 0
        for g in groups:
            new = {p.key for u in g for p in u.pieces} - keys
            add = sum(self._source_bytes(key) for key in new)
            cost = max(u.cost for u in g)
            if current and sources + add + max(most, cost) > limit:
                batches.append((current, sources + most))
                current, keys, sources, most = [], set(), 0, 0
                new = {p.key for u in g for p in u.pieces}
                add = sum(self._source_bytes(key) for key in new)
            current += g
            keys |= new
            sources += add
            most = max(most, cost)
        if current:
            batches.append((current, sources + most))
        return batches

    def _batch_sources(self, batch: list[_Unit]):
        return _Sources(self, batch)

    def _assemble(self, u: _Unit, get, lease: _Lease) -> tuple[np.ndarray, bool]:
        """(unit.box of the leaf in storage dtype, whether it is a whole chunk); copies made
        are counted in `lease`."""
        arrays = [(p, get(p)) for p in u.pieces]
        if len(arrays) == 1 and arrays[0][0].box == u.box:
            return arrays[0][1], arrays[0][0].key[0] == "z"
        if len(arrays) == 1 and intersect(arrays[0][0].box, u.box) == u.box:
            view = arrays[0][1][relative(u.box, arrays[0][0].box) + (...,)]
            if self.wants[u.k].sharding is None or view.flags.c_contiguous:
                return view, False
            lease.take(view.nbytes)  # device_put would copy it anyway, uncounted
            return np.ascontiguousarray(view), False
        rec = self.leaves[self.wants[u.k].index]
        dtype = storage_of(dtype_from_name(rec.dtype))[0].newbyteorder("<")
        shape = box_shape(u.box)
        out = aligned_empty(math.prod(shape) * dtype.itemsize)
        lease.take(out.nbytes)
        out = out.view(dtype).reshape(shape)
        for p, a in arrays:
            inter = intersect(p.box, u.box)
            if inter is not None:
                out[relative(inter, u.box) + (...,)] = a[relative(inter, p.box) + (...,)]
        return out, False

    def _convert(self, rec: LeafRecord, want: _Want, a: np.ndarray, lease) -> tuple[np.ndarray, bool]:
        saved = dtype_from_name(rec.dtype)
        b = from_storage(a, saved)
        copied = not np.may_share_memory(a, b)
        if copied:
            lease.take(b.nbytes)
        if b.dtype != want.dtype:
            # Refused where values would change beyond rounding (plan.py, "casts"): checked on
            # every unit, so a shard streamed in pieces is checked in every piece.
            b = cast_values(b, want.dtype, display_path(rec.path), want.lossy_ok, held_note(want, saved))
            lease.take(b.nbytes)
            copied = True
        return b, copied

    def issue(self, key: tuple, lease: _Lease, executor: ThreadPoolExecutor, into: np.ndarray | None = None) -> Any:
        """Start reading a source: a future of its raw bytes (inline data: its array, at hand).
        The source's ``read_chunk_async`` issues it: from this thread where the engine has
        asynchronous I/O of its own, else on `executor`. `into`: a buffer from ``self.buffers``."""
        rec, _ = self._sources[key]
        if key[0] == "i":
            a = to_storage(rec.inline_array())
            lease.take(2 * a.nbytes)  # the logical value and its storage form
            return Done(a)
        st = self._array_of(key)
        # A chunk file always holds the whole chunk shape (an edge chunk's part outside the
        # array is padding, which the checksum does not cover).
        padded = math.prod(st.chunk_shape) * np.dtype(st.data_type).itemsize
        lease.take(padded)
        try:
            extra = () if into is None else (into,)
            return self.storage.read_chunk_async(st.path, key[2], padded, executor, *extra)
        except (OSError, CheckpointError) as e:  # reported where the chunk is used, naming it
            return Done(error=e)

    def issue_merged(self, keys: list[tuple], lease: _Lease, executor: ThreadPoolExecutor) -> dict[tuple, Any]:
        """Where the storage reads many chunks at once (``read_chunks``: a packed checkpoint,
        whose chunks that follow each other in a data object are read as one range): start
        every chunk read of a batch so, {key: future}; {} elsewhere (``issue`` one by one)."""
        if not self._runs:
            return {}
        requests = []
        for key in keys:
            if key[0] == "i":
                continue
            st = self._array_of(key)
            padded = math.prod(st.chunk_shape) * np.dtype(st.data_type).itemsize
            lease.take(padded)
            requests.append((key, st.path, key[2], padded))
        return self.storage.read_chunks(requests, executor)

    def finish(self, key: tuple, future: Any, lease: _Lease) -> np.ndarray:
        """A source's array (storage dtype) once read: a chunk checked against its CRC-32C, a
        stack chunk, or inline data."""
        if key[0] == "i":
            return future.result()
        rec, _ = self._sources[key]
        st = self._array_of(key)
        index = key[2]
        packed = not st.chunk_checksums  # format version 3: places and checksums in index objects
        try:
            if packed:
                want, file = self.storage.chunk_check(st.path, index)
            else:
                file = self.storage.where(f"{st.path}/{chunk_key(index)}")
                want = st.chunk_checksums[flat_chunk_index(index, chunk_grid(rec.shape, st.chunk_shape))
                                          if key[0] == "z" else index[0]]
        except CheckpointError:
            future.result()  # (the read's own error names the chunk and the index object)
            raise
        if key[0] == "z":
            where = f"leaf {display_path(rec.path)!r}, chunk {list(index)} ({file})"
        else:
            where = (f"leaf {display_path(rec.path)!r} (member {rec.stacked.index} of stack {rec.stacked.stack}), "
                     f"chunk {list(index)} ({file})")
        shape = box_shape(chunk_box(index, st.chunk_shape, self._shape_of(key)))
        dtype = np.dtype(st.data_type).newbyteorder("<")
        chunk_shape = st.chunk_shape
        try:
            raw = future.result()
            a = raw.view(dtype).reshape(chunk_shape)
            if shape != chunk_shape:
                a = np.ascontiguousarray(a[tuple(slice(0, n) for n in shape)])
                lease.take(a.nbytes)
                lease.give(raw.nbytes)
                del raw
        except FileNotFoundError:
            raise CheckpointError(f"{where}: chunk file is missing") from None
        except (OSError, CheckpointError) as e:
            raise CheckpointError(f"{where}: cannot read: {e}") from None
        if self.verify:
            got = chunk_checksum(a)
            if got != want:
                raise ChecksumError(display_path(rec.path), index, file,
                                    f"{st.checksum} is {got:#010x}, expected {want:#010x}")
        return a


class _Sources:
    """The sources of a batch, all reads issued at once (each source once) and each checked
    when first used, counted in the stats; a context that gives their bytes back to the budget
    when the batch is done."""

    def __init__(self, reader: Reader, batch: list[_Unit]):
        self.reader, self.batch = reader, batch
        self.lease = _Lease(reader.budget)
        self.done: dict[tuple, np.ndarray] = {}

    def __enter__(self):
        r = self.reader
        keys = list(dict.fromkeys(p.key for u in self.batch for p in u.pieces))
        self.pool = ThreadPoolExecutor(r.options.io_concurrency, thread_name_prefix="ckpt-read")
        self.buffers: list[np.ndarray] = []
        self.futures = r.issue_merged(keys, self.lease, self.pool)
        sizes = ({key: r._buffer_bytes(key) for key in keys if key[0] != "i" and key not in self.futures}
                 if r.buffers is not None else {})
        if sizes:
            r.buffers.prepare(list(sizes.values()))
        for key in keys:
            if key in self.futures:
                continue
            into = None
            if key in sizes:
                into = r.buffers.get(sizes[key])
                if into is not None:
                    self.buffers.append(into)
            self.futures[key] = r.issue(key, self.lease, self.pool, into)
        for key in keys:
            if key[0] == "i":
                continue
            rec = r._sources[key][0]
            st = r._array_of(key)
            nbytes = box_size(chunk_box(key[2], st.chunk_shape, r._shape_of(key))) * np.dtype(st.data_type).itemsize
            r.stats.bytes_read += nbytes
            r.stats.chunks_read += 1
            if key[0] == "z":
                got, needed = r.stats.per_leaf.get(rec.path, (0, 0))
                r.stats.per_leaf[rec.path] = (got + nbytes, needed)
        return self

    def __call__(self, piece: _Piece) -> np.ndarray:
        a = self.done.get(piece.key)
        if a is None:
            a = self.done[piece.key] = self.reader.finish(piece.key, self.futures.pop(piece.key), self.lease)
        return a if piece.row is None else a[piece.row]

    def __exit__(self, *exc):
        self.pool.shutdown(cancel_futures=True)  # after a failure, skip the reads not yet started
        self.futures, self.done = {}, {}
        self.lease.close()
        if self.buffers:
            self.reader.buffers.put_back(self.buffers)
            self.buffers = []
        return False
