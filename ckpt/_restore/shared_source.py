"""Replicated regions as a source: read once across the processes that hold them, the rest
received from those peers over the devices' interconnect (docs/multihost.md, "Replicated state").

Where a restore target places the same region on devices of several processes (data
parallelism across hosts, FSDP inside a host and replicas across hosts), each process would
otherwise read every byte of its replica from storage. Here each leaf's shard is a *slot* (the
devices' coordinates along the mesh axes its PartitionSpec uses; the devices along the other
axes are its replicas), and a slot's bytes are read once in total:

1. Plan (pure, the same on every process): leaves are grouped by (mesh, sharded axes); their
   shards are cut into pieces along chunk boundaries and packed into *slabs* of ``L`` bytes;
   within each slab the sources to read (chunks, a stack chunk as one) are split byte-balanced
   among the processes holding the slots that need them (slots held by the same processes
   together, so that a source is read once; the order rotating slab by slab). The mesh must
   span every process of the job (all of them enter its collective).
2. Agree before any I/O: the exchange is compiled first, then every process posts a digest of
   its plan through the jax.distributed store and waits for all the others (``CKPT_TIMEOUT_S``
   of silence names the missing processes); a different plan is refused on all.
3. Per slab: each process fills its part of its slots (zeros elsewhere; one contributing device
   per slot and process), every process posts "ready" (or the error its reads met), and only
   then all enter one jitted ``psum`` over the replica axes (``shard_map``), on the bytes as
   unsigned words, so that adding zeros changes no bit. The next slab is read meanwhile.
   While the collective runs, peers are watched: one silent for ``CKPT_TIMEOUT_S`` is named.
4. Each leaf's shards are placed once its last slab is exchanged.

Leaves that cannot share (numpy targets, custom device layouts, PRNG keys, data stored inline in
the manifest, shardings other than ``NamedSharding``, fewer replicas across processes than asked)
are read by the ordinary reader, as they are without this module.

Size: its plan, agreement, exchange and placement are one protocol every process must run
identically, and the restore pipeline holds no sixth step module.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ckpt._distributed import distributed_coordinator
from ckpt._errors import CheckpointError
from ckpt._format import PRNG_KEY, LeafRecord, display_path
from ckpt._format import dtype_from_name, from_storage
from ckpt._geometry import Box, box_shape, box_size, full_box, index_to_box, intersect, relative
from ckpt._host import aligned_empty, return_to_os
from ckpt._host import SHARE_MIN_REPLICAS, Options
from ckpt._restore.place import _zeros_on
from ckpt._restore.plan import _Want, cast_values, held_note, plan_leaf_read
from ckpt._restore.read import Reader, RestoreStats

_WORD = np.dtype(np.uint32)  # the exchange adds unsigned words: x + 0 == x, bit for bit
_ALIGN = 64
# What one slab of L bytes per slot holds at once in a process with S local slots of the group
# and D local devices of its mesh (on CPU devices all of it is host memory; on accelerators the
# exchange's part is device memory, counted the same way so that one rule holds on both):
# - reads: the slab being exchanged (S x L, the contributors' inputs, adopted without a copy),
#   the next slab being filled (S x L) and the chunks read for it (at most S x L): 3 S L;
# - exchange: zeros for the D - S devices that contribute nothing, the psum's output (D x L),
#   and the collective's own buffers, which gloo keeps from the first exchange on (D x L):
#   (D - S) + 2 D.
# Measured on 2 processes x 2 CPU devices with L = 16 MiB (loopback gloo; /proc/self/statm every
# 2 ms, MALLOC_MMAP_THRESHOLD_ fixed so that freed slabs go back): an exchange's peak is 4.25 L
# over its inputs (output 2 L, the rest gloo's), 6.3 L on the first, which keeps 2 L afterwards.
# So L = budget / (2 S + 3 D) (docs/benchmarks.md, "Replicated state"), within these bounds: the
# floor keeps the number of slabs (one agreement round each) sane under a tiny budget; a chunk
# larger than a slab still makes one, as a chunk larger than the budget does for the reader.
_MIN_SLAB, _MAX_SLAB = 64 << 10, 64 << 20


def slab_memory(slab_bytes: int, slots: int, devices: int) -> int:
    """The bytes a process holds at once for slabs of `slab_bytes` per slot (reads in flight and
    the exchange), with `slots` local slots and `devices` local devices of the mesh."""
    return (2 * slots + 3 * devices) * slab_bytes


@dataclass(frozen=True)
class _Piece:
    k: int  # position in the shared wants
    rel: Box  # the part of the leaf's shard, relative to the shard's origin (the same in every slot)
    offset: int  # where its bytes start in the slab
    nbytes: int


@dataclass
class _Group:
    """Leaves on one mesh whose PartitionSpecs use the same axes: exchanged together."""

    mesh: Any
    sharded: tuple[str, ...]
    replicated: tuple[str, ...]
    slot_of: dict  # device -> slot (its coordinates along `sharded`)
    device_of: dict  # slot -> one of its devices
    holders: dict  # slot -> sorted process indices holding it
    leaves: list[int] = field(default_factory=list)  # positions in the shared wants
    slabs: list[list[_Piece]] = field(default_factory=list)
    slab_bytes: int = 0
    wants: list = field(default_factory=list)  # the shared wants (of every group), by position

    def local_slots(self, me: int) -> list:
        return sorted(s for s, ps in self.holders.items() if me in ps)


def share_mode(options: Options) -> int | None:
    """The fewest replicas across processes from which a leaf is shared, or None (off)."""
    mode = options.share_replicas
    return None if mode == "off" else 2 if mode == "on" else SHARE_MIN_REPLICAS


def _axes(spec: PartitionSpec) -> set[str]:
    out = set()
    for e in spec:
        if e is None:
            continue
        out.update(e if isinstance(e, tuple) else (e,))
    return out


def _group_key(want: _Want, rec: LeafRecord, least: int) -> tuple | None:
    """(mesh, sharded axes) of a leaf that can be shared, else None."""
    s = want.sharding
    if (not isinstance(s, NamedSharding) or want.layout is not None or rec.kind == PRNG_KEY
            or (rec.zarr is None and rec.stacked is None) or math.prod(rec.shape) == 0 or isinstance(s.mesh, jax.sharding.AbstractMesh)):
        return None
    if _processes_of(s.mesh) != jax.process_count():
        return None  # a mesh of some of the processes: the others could not join its collective
    used = _axes(s.spec)
    sharded = tuple(a for a in s.mesh.axis_names if a in used)
    replicated = tuple(a for a in s.mesh.axis_names if a not in used)
    if not replicated or math.prod(s.mesh.shape[a] for a in replicated) < least:
        return None
    return s.mesh, sharded


@functools.lru_cache(maxsize=64)
def _processes_of(mesh) -> int:
    return len({d.process_index for d in mesh.devices.flat})


def _make_group(mesh, sharded: tuple[str, ...]) -> _Group:
    slot_of, device_of, holders = _slots(mesh, sharded)
    return _Group(mesh, sharded, tuple(a for a in mesh.axis_names if a not in sharded), slot_of, device_of,
                  dict(holders))


@functools.lru_cache(maxsize=64)
def _slots(mesh, sharded: tuple[str, ...]) -> tuple[dict, dict, dict]:
    """(device -> slot, slot -> one of its devices, slot -> the processes holding it): computed
    once per mesh and sharded axes (every leaf of a model asks)."""
    names = list(mesh.axis_names)
    pos = [names.index(a) for a in sharded]
    slot_of, holders = {}, {}
    for idx in np.ndindex(*mesh.devices.shape):
        d = mesh.devices[idx]
        slot = tuple(idx[p] for p in pos)
        slot_of[d] = slot
        holders.setdefault(slot, set()).add(d.process_index)
    device_of = {}
    for d, slot in slot_of.items():
        device_of.setdefault(slot, d)
    return slot_of, device_of, {s: sorted(ps) for s, ps in holders.items()}


def _split(box: Box, chunk: tuple[int, ...], itemsize: int, limit: int) -> list[Box]:
    """`box` (relative to a shard) cut into boxes of at most `limit` bytes, along multiples of
    the chunk shape where it spans several chunks (so that a chunk is one piece's)."""
    if box_size(box) * itemsize <= limit:
        return [box]
    for d, (lo, hi) in enumerate(box):
        step = chunk[d] if hi - lo > chunk[d] else 1 if hi - lo > 1 else 0
        if not step:
            continue
        row = box_size(box) // (hi - lo) * itemsize
        n = max(1, limit // (row * step)) * step
        out = []
        for a in range(lo, hi, n):
            out += _split(box[:d] + ((a, min(hi, a + n)),) + box[d + 1:], chunk, itemsize, limit)
        return out
    return [box]


def plan_shared(wants: list[_Want], leaves: list[LeafRecord], least: int | None, budget: int,
                ) -> tuple[list[_Group], list[_Want]]:
    """(groups of shared leaves with their slabs, the wants left to the ordinary reader)."""
    if least is None or jax.process_count() == 1:
        return [], wants
    groups: dict[tuple, _Group] = {}
    rest = []
    shared: list[_Want] = []
    for w in wants:
        rec = leaves[w.index]
        key = _group_key(w, rec, least)
        if key is not None:
            g = groups.get(key) or _make_group(*key)
            if min(len(ps) for ps in g.holders.values()) >= least:
                groups[key] = g
                g.leaves.append(len(shared))
                shared.append(w)
                continue
        rest.append(w)
    me = jax.process_index()
    for g in groups.values():
        g.wants = shared
        devices = sum(d.process_index == me for d in g.mesh.devices.flat)
        _pack(g, leaves, budget, max(1, len(g.local_slots(me))), max(1, devices))
    return list(groups.values()), rest


def _pack(g: _Group, leaves: list[LeafRecord], budget: int, slots: int, devices: int) -> None:
    """Cut the group's shards into pieces and pack them into slabs (``slots``: the slots this
    process holds, ``devices``: its devices of the mesh; what a slab holds of the budget is
    `slab_memory`)."""
    itemsizes = [np.dtype(g.wants[k].dtype).itemsize for k in g.leaves]
    largest_chunk = max(math.prod(leaves[g.wants[k].index].chunk_shape) * i for k, i in zip(g.leaves, itemsizes))
    share = slab_memory(1, slots, devices)
    limit = min(_MAX_SLAB, max(_MIN_SLAB, largest_chunk, budget // share // _ALIGN * _ALIGN))
    pieces = []
    for k, itemsize in zip(g.leaves, itemsizes):
        w, rec = g.wants[k], leaves[g.wants[k].index]
        shard = tuple(w.sharding.shard_shape(rec.shape))
        pieces += [(k, b, box_size(b) * itemsize) for b in _split(full_box(shard), rec.chunk_shape, itemsize, limit)]
    stream = sum(-(-n // _ALIGN) * _ALIGN for _, _, n in pieces)
    g.slab_bytes = -(-min(limit, max(stream, _ALIGN)) // _ALIGN) * _ALIGN
    slab, used = [], 0
    for k, b, n in pieces:
        if slab and used + n > g.slab_bytes:
            g.slabs.append(slab)
            slab, used = [], 0
        slab.append(_Piece(k, b, used, n))
        used += -(-n // _ALIGN) * _ALIGN
        g.slab_bytes = max(g.slab_bytes, -(-used // _ALIGN) * _ALIGN)  # a piece over the limit alone
    g.slabs.append(slab)


def _box_in(want: _Want, rec: LeafRecord, group: _Group, slot) -> Box:
    """The region of the leaf that `slot`'s devices hold."""
    return _boxes(want.sharding, tuple(rec.shape))[group.device_of[slot]]


@functools.lru_cache(maxsize=256)
def _boxes(sharding, shape: tuple[int, ...]) -> dict:
    """Every device's region of `shape` under `sharding` (leaves of a model share a few)."""
    return {d: index_to_box(i, shape) for d, i in sharding.devices_indices_map(shape).items()}


def _my_reads(group: _Group, j: int, leaves: list[LeafRecord], me: int, planner: Reader
              ) -> list[tuple[Any, _Piece, Box, Box]]:
    """(slot, piece, its box in the leaf, the part of it this process reads) for slab `j`: the
    sources under the slab's pieces (chunks; a stack's chunk with all its members there) split
    byte-balanced among the processes holding those slots, the first share going to a
    different process slab by slab. Slots held by the same processes are split together, so
    that a source several of them need (a stack chunk) is one process's, read once.
    `planner` names the sources as the reader does."""
    classes: dict[tuple, list] = {}
    for slot, holders in sorted(group.holders.items()):
        if me in holders:
            classes.setdefault(tuple(holders), []).append(slot)
    mine = []
    for holders, slots in classes.items():
        sources: dict[tuple, list] = {}
        for slot in slots:
            for p in group.slabs[j]:
                w = group.wants[p.k]
                rec = leaves[w.index]
                shard = _box_in(w, rec, group, slot)
                box = tuple((o + a, o + b) for (o, _), (a, b) in zip(shard, p.rel))
                itemsize = np.dtype(w.dtype).itemsize
                for src in planner.sources_of(p.k, rec, box):
                    part = intersect(src.box, box)
                    if part is not None:
                        sources.setdefault(src.key, []).append((slot, p, box, part, box_size(part) * itemsize))
        total = sum(x[4] for items in sources.values() for x in items) or 1
        done = 0
        for items in sources.values():
            n = sum(x[4] for x in items)
            share = min(len(holders) - 1, (2 * done + n) * len(holders) // (2 * total))
            if holders[(share + j) % len(holders)] == me:
                mine += [x[:4] for x in items]
            done += n
    return mine


def _exchange_fn(group: _Group):
    return _compiled_exchange(group.mesh, group.sharded, group.replicated, group.slab_bytes)


@functools.lru_cache(maxsize=32)
def _compiled_exchange(mesh, sharded: tuple[str, ...], replicated: tuple[str, ...], slab_bytes: int):
    """(the compiled psum of one slab over the replica axes, its input sharding, its length in
    words): compiled once per mesh and slab size, so a job's later restores compile nothing."""
    spec = PartitionSpec(sharded) if sharded else PartitionSpec()
    body = jax.shard_map(lambda x: jax.lax.psum(x, replicated), mesh=mesh, in_specs=spec, out_specs=spec)
    n = math.prod(mesh.shape[a] for a in sharded) * slab_bytes // _WORD.itemsize
    sharding = NamedSharding(mesh, spec)
    compiled = jax.jit(body, donate_argnums=0).lower(jax.ShapeDtypeStruct((n,), _WORD, sharding=sharding)).compile()
    return compiled, sharding, n


class SharedRestore:
    """The shared leaves of one restore, read and exchanged slab by slab (the module docstring)."""

    def __init__(self, groups: list[_Group], storage, leaves: list[LeafRecord], verify: bool,
                 stats: RestoreStats, options: Options):
        self.groups, self.storage, self.leaves = groups, storage, leaves
        self.verify, self.stats, self.options = verify, stats, options
        self.me = jax.process_index()
        self.planner = Reader(None, leaves, False, RestoreStats(), options)  # names sources only
        self.high_water = 0
        self._held = 0
        self._read: dict = {}  # leaf path -> bytes this process read of it
        self._lock = threading.Lock()

    def _take(self, n: int) -> None:
        with self._lock:
            self._held += n
            self.high_water = max(self.high_water, self._held)

    def run(self) -> dict[int, Any]:
        coord = distributed_coordinator()
        # Compiled before any I/O and before the agreement: no process compiles while others wait.
        fns = [_exchange_fn(g) for g in self.groups]
        rid = coord.new_save_id()
        try:
            digest = hashlib.sha256(repr([(g.sharded, g.replicated, g.slab_bytes, sorted(map(str, g.holders.items())),
                                           [[(p.k, p.rel, p.offset) for p in s] for s in g.slabs],
                                           [(self.leaves[g.wants[k].index].path, str(g.wants[k].sharding.spec),
                                             np.dtype(g.wants[k].dtype).str) for k in g.leaves])
                                          for g in self.groups]).encode()).hexdigest().encode()
            got = coord.all_gather(f"{rid}/restore: plan", digest)
            differ = [p for p, d in enumerate(got) if d != got[0]]
            if differ:
                raise CheckpointError(f"restore of replicated leaves: process(es) {differ} planned a different "
                                      "restore than process 0 (different targets or options on different processes)")
            out: dict[int, Any] = {}
            for i, (g, fn) in enumerate(zip(self.groups, fns)):
                out.update(self._group(coord, rid, i, g, fn))
                for k in g.leaves:  # (read, needed by this process's devices), as the reader reports
                    w, rec = g.wants[k], self.leaves[g.wants[k].index]
                    boxes = {index_to_box(x, rec.shape) for x in w.sharding.addressable_devices_indices_map(
                        tuple(rec.shape)).values()}
                    needed = sum(box_size(b) for b in boxes) * dtype_from_name(rec.dtype).itemsize
                    self.stats.bytes_needed += needed
                    self.stats.per_leaf[rec.path] = (self._read.get(rec.path, 0), needed)
            return out
        finally:
            coord.end_save(rid)

    def _group(self, coord, rid: str, i: int, g: _Group, fn) -> dict[int, Any]:
        compiled, sharding, n = fn
        slots = g.local_slots(self.me)
        local = [d for d in sharding.addressable_devices_indices_map((n,))]
        contributor = {}
        for d in sorted(local, key=lambda d: d.id):
            contributor.setdefault(g.slot_of[d], d)
        shards: dict[tuple[int, Any], np.ndarray] = {}  # (leaf position, slot) -> host buffer of the shard
        last_slab = {}
        for j, slab in enumerate(g.slabs):
            for p in slab:
                last_slab[p.k] = j
        done: dict[int, Any] = {}
        pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-share-read")  # the next slab, read meanwhile
        try:
            ahead = pool.submit(self._fill, g, 0, slots)
            for j in range(len(g.slabs)):
                error = None
                try:
                    bufs = ahead.result()
                except Exception as e:  # noqa: BLE001 (told to the others before it is raised here)
                    error, bufs = e, None
                ahead = pool.submit(self._fill, g, j + 1, slots) if j + 1 < len(g.slabs) and error is None else None
                status = b"\x00" if error is None else b"\x01" + f"{type(error).__name__}: {error}".encode()
                got = coord.all_gather(f"{rid}/restore: reads of slab {j} (group {i})", status)
                if error is not None:
                    raise error
                failed = [(p, v[1:].decode(errors="replace")) for p, v in enumerate(got) if v[:1] != b"\x00"]
                if failed:
                    raise CheckpointError(f"process {failed[0][0]} failed reading its part of the replicated leaves: "
                                          f"{failed[0][1]}")
                # The exchange's part of slab_memory, counted while it is in flight (its zeros,
                # the psum's output, the collective's buffers; its inputs are the slab's, counted).
                exchange = (3 * len(local) - len(slots)) * g.slab_bytes
                self._take(exchange)
                arrays = []
                for d in local:
                    s = g.slot_of[d]
                    if contributor[s] is d:
                        arrays.append(jax.device_put(bufs[s].view(_WORD), d))
                    else:
                        arrays.append(_zeros_on((g.slab_bytes // _WORD.itemsize,), _WORD, SingleDeviceSharding(d))())
                x = jax.make_array_from_single_device_arrays((n,), sharding, arrays)
                del arrays
                y = compiled(x)
                coord.watch(y.is_ready, f"{rid}/restore: exchange of slab {j} (group {i})")
                for shard in y.addressable_shards:
                    s = g.slot_of[shard.device]
                    if contributor[s] is not shard.device:
                        continue
                    data = np.asarray(shard.data).view(np.uint8)
                    for p in g.slabs[j]:
                        w = g.wants[p.k]
                        rec = self.leaves[w.index]
                        dtype = np.dtype(w.dtype)
                        buf = shards.get((p.k, s))
                        if buf is None:
                            shape = tuple(w.sharding.shard_shape(rec.shape))
                            buf = shards[(p.k, s)] = aligned_empty(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)
                        buf[relative(p.rel, full_box(buf.shape)) + (...,)] = (
                            data[p.offset:p.offset + p.nbytes].view(dtype).reshape(box_shape(p.rel)))
                del y, x
                with self._lock:
                    self._held -= sum(b.nbytes for b in bufs.values()) + exchange
                del bufs
                for k in [k for k, last in last_slab.items() if last == j]:
                    done[g.wants[k].index] = self._place(g, k, shards, local)
                # The slab's buffers, its zeros and the psum's output are free now; slabs are
                # below glibc's dynamic mmap threshold, so without this the holes stayed
                # resident beside the next slab's (64 MiB tree, 32 MiB budget, 2 and 4 processes
                # on disk: peak RSS growth 145-149 MiB; 116-117 with MALLOC_MMAP_THRESHOLD_
                # fixed; 124-129 with these trims).
                return_to_os()
        finally:  # (after a failure, the read in flight is waited for: it holds no lock anyone needs)
            pool.shutdown(cancel_futures=True)
        return done

    def _place(self, g: _Group, k: int, shards: dict, local: list) -> jax.Array:
        w = g.wants[k]
        rec = self.leaves[w.index]
        idx = w.sharding.addressable_devices_indices_map(tuple(rec.shape))
        arrays = [jax.device_put(shards[(k, g.slot_of[d])], d) for d in idx]
        arr = jax.make_array_from_single_device_arrays(tuple(rec.shape), w.sharding, arrays)
        jax.block_until_ready(arr)
        for s in {g.slot_of[d] for d in idx}:
            del shards[(k, s)]
        return arr

    def _fill(self, g: _Group, j: int, slots: list) -> dict:
        """Slab `j` of this process's slots: its reads in place, zeros elsewhere (one read of
        each source for all the slots that need it)."""
        bufs = {}
        for s in slots:
            bufs[s] = aligned_empty(g.slab_bytes)
            bufs[s][:] = 0
            self._take(g.slab_bytes)
        by_leaf: dict[int, list] = {}
        for slot, p, box, part in _my_reads(g, j, self.leaves, self.me, self.planner):
            by_leaf.setdefault(p.k, []).append((slot, p, box, part))
        plans = []
        for k, items in by_leaf.items():
            w, rec = g.wants[k], self.leaves[g.wants[k].index]
            plans.append(plan_leaf_read(w.index, rec.shape, rec.chunk_shape, dtype_from_name(rec.dtype).itemsize,
                                        [part for *_, part in items]))
        if not plans:
            return bufs
        # Counted apart and added up (a reader's per-leaf figures are of one read), then
        # reported per leaf once every slab is in (run()).
        mine = RestoreStats()
        regions = Reader(self.storage, self.leaves, self.verify, mine, self.options).read(plans)
        with self._lock:
            self.stats.bytes_read += mine.bytes_read
            self.stats.chunks_read += mine.chunks_read
            for path, (got, _) in mine.per_leaf.items():
                self._read[path] = self._read.get(path, 0) + got
        held = sum(a.nbytes for r in regions.values() for a in r.values())
        self._take(held)
        for k, items in by_leaf.items():
            w, rec = g.wants[k], self.leaves[g.wants[k].index]
            saved = dtype_from_name(rec.dtype)
            dtype = np.dtype(w.dtype)
            for slot, p, box, part in items:
                a = from_storage(regions[w.index][part], saved)
                if a.dtype != dtype:
                    a = cast_values(a, dtype, display_path(rec.path), w.lossy_ok, held_note(w, saved))
                view = bufs[slot][p.offset:p.offset + p.nbytes].view(dtype).reshape(box_shape(box))
                view[relative(part, box) + (...,)] = a
        regions = a = view = None  # (dropped before the trim below)
        with self._lock:
            self._held -= held
        return_to_os()  # the chunks read, copied into the slab: their holes go back (as above)
        return bufs
