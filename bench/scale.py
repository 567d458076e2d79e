"""``python -m bench.scale``: what one save and one restore cost at N processes x 8 devices, in
the packed layout (format version 3, the default of multi-process saves), simulated in one Python
process with the library's own code.

What runs for real: the planner (``plan_save`` per process), the packed writer (``PackWriter``:
which chunks go into which data objects, at which offsets; chunk bytes are never made, only
shapes), the index objects (``PackedSave.index_object``, real bytes), the staging and commit of
the storage (``commit_for(store).stage``, ``commit_packed``: the manifest built from the statuses by
``PackedSave.manifest_parts`` and written if absent), the coordination (``ckpt._distributed``
over a counting key-value client, one thread per process, with the real statuses), and the
restore's lookups (``read_manifest`` and ``PackedChunks.locate`` for every chunk a restoring
process reads). The store is ``CountingStorage``, an in-memory object store counting requests
by kind and process (a LIST page per 1,000 keys).

Up to ``--full-up-to`` processes (128) every process is simulated. Beyond, the trees being
symmetric, only the processes the figures read are: process 0 (the primary), processes 0 and 1
(the restoring processes) and the processes their index objects point to. Every other process
gets a status and data objects from a run of the packed writer over process 0's region chunks
(the same sizes by symmetry) followed by its own packed small arrays (their places go into the
manifest); its chunk count is what makes the job's total (the commit checks the total).

Trees (``--tree``): ``per-layer`` (a 70B Llama: 80 layers x 9 matrices and norms, bf16 params
+ fp32 Adam mu/nu, 2,169 leaves, ~705 GB; matrices FSDP over hosts x tensor parallel 8 inside
a host, norms replicated), ``scanned`` (the same, layer-stacked: 36 leaves) and ``dp4`` (the
per-layer tree with 4-way data parallelism outside FSDP: every region held by 4 processes).

    python -m bench.scale --processes 8 128 1024 4096 --tree per-layer scanned dp4 --straggler-s 10

The files layout (one object per chunk, before issue 23) is no longer simulated: its figures
are in docs/multihost.md ("before" rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import threading
import time
import tracemalloc
from collections import defaultdict

import msgpack
import numpy as np

# --- the trees --------------------------------------------------------------------------------

D, FFN, KV, VOCAB, LAYERS = 8192, 28672, 1024, 32768, 80  # Llama-2-70B (vocab rounded to 2^15)
MATRIX = ("fsdp", "tp")


def llama70b(scanned: bool) -> list[tuple[str, tuple[int, ...], str, tuple]]:
    """(path, shape, dtype, partition spec) of every leaf: params bf16, Adam mu and nu fp32."""
    layer = [("wq", (D, D)), ("wk", (D, KV)), ("wv", (D, KV)), ("wo", (D, D)),
             ("w1", (D, FFN)), ("w2", (FFN, D)), ("w3", (D, FFN))]
    norms = ["attn_norm", "ffn_norm"]
    params: list[tuple[str, tuple, tuple]] = [("embed", (VOCAB, D), MATRIX)]
    if scanned:
        params += [(f"layers/{n}", (LAYERS, *s), (None, *MATRIX)) for n, s in layer]
        params += [(f"layers/{n}", (LAYERS, D), (None, None)) for n in norms]
    else:
        for i in range(LAYERS):
            params += [(f"layers/{i}/{n}", s, MATRIX) for n, s in layer]
            params += [(f"layers/{i}/{n}", (D,), (None,)) for n in norms]
    params += [("final_norm", (D,), (None,)), ("output", (D, VOCAB), MATRIX)]
    out = [(f"params/{p}", s, "bfloat16", spec) for p, s, spec in params]
    for moment in ("mu", "nu"):
        out += [(f"opt/{moment}/{p}", s, "float32", spec) for p, s, spec in params]
    return out


TREES = {"per-layer": (False, 1), "scanned": (True, 1), "dp4": (False, 4)}


def mesh_axes(processes: int, dp: int) -> dict[str, int]:
    """Mesh axes, outermost first; devices are numbered row-major, 8 per process."""
    return {"dp": dp, "fsdp": processes // dp, "tp": 8}


def holders_of(shape: tuple, spec: tuple, axes: dict[str, int]) -> dict[tuple, list[tuple[int, int]]]:
    """Every unique region of an array with this shape and partition spec over the mesh, and the
    (process, device id) holding it (8 devices per process), as ``devices_indices_map`` gives."""
    sizes = list(axes.values())
    n = math.prod(sizes)
    coords = np.stack(np.unravel_index(np.arange(n), sizes), axis=1)  # device -> mesh coordinate
    names = list(axes)
    parts_per_dim = []
    for dim, entry in zip(shape, spec + (None,) * (len(shape) - len(spec))):
        group = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        count = math.prod(axes[a] for a in group) if group else 1
        index = np.zeros(n, dtype=np.int64)
        for a in group:
            index = index * axes[a] + coords[:, names.index(a)]
        step = dim // count
        parts_per_dim.append((index, step))
    holders: dict[tuple, list] = {}
    keys = np.stack([idx for idx, _ in parts_per_dim], axis=1) if parts_per_dim else np.zeros((n, 0), np.int64)
    rows, inverse = np.unique(keys, axis=0, return_inverse=True)
    steps = np.array([step for _, step in parts_per_dim], dtype=np.int64)
    starts = rows * steps
    boxes = [tuple(zip(a, b)) for a, b in zip(starts.tolist(), (starts + steps).tolist())]
    for dev, b in enumerate(inverse.reshape(-1).tolist()):
        holders.setdefault(boxes[b], []).append((dev // 8, dev))
    return holders


def _shard_shape(shape: tuple, spec: tuple, axes: dict[str, int]) -> tuple[int, ...]:
    out = []
    for dim, entry in zip(shape, spec + (None,) * (len(shape) - len(spec))):
        group = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        out.append(dim // math.prod(axes[a] for a in group) if group else dim)
    return tuple(out)


# --- counting key-value client (the jax.distributed client's methods ckpt uses) ---------------


class CountingKV:
    """An in-memory coordination service counting calls and bytes by process."""

    def __init__(self, processes: int) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        # One event per key waited on: a write wakes only its own waiters (a shared condition
        # would wake all 4,096 threads at every write).
        self.events: dict[str, threading.Event] = {}
        self.calls = np.zeros(processes, dtype=np.int64)
        self.bytes = np.zeros(processes, dtype=np.int64)

    def client(self, process: int) -> "_Client":
        return _Client(self, process)


class _Client:
    def __init__(self, kv: CountingKV, process: int) -> None:
        self.kv, self.p = kv, process

    def _count(self, nbytes: int) -> None:
        self.kv.calls[self.p] += 1
        self.kv.bytes[self.p] += nbytes

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self.key_value_set_bytes(key, value.encode(), allow_overwrite)

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        self._count(len(key) + len(value))
        with self.kv.cond:
            if key in self.kv.data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.kv.data[key] = bytes(value)
            event = self.kv.events.get(key)
        if event is not None:
            event.set()

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        with self.kv.cond:
            value = self.kv.data.get(key)
            if value is None:
                event = self.kv.events.setdefault(key, threading.Event())
        if value is None:
            event.wait(timeout_ms / 1000)
            with self.kv.cond:
                value = self.kv.data.get(key)
            if value is None:
                self._count(len(key))
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        self._count(len(key) + len(value))
        return value

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        return self.blocking_key_value_get_bytes(key, timeout_ms).decode()

    def key_value_try_get_bytes(self, key: str) -> bytes:
        with self.kv.cond:
            value = self.kv.data.get(key)
        self._count(len(key) + (len(value) if value is not None else 0))
        if value is None:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return value

    def key_value_try_get(self, key: str) -> str:
        return self.key_value_try_get_bytes(key).decode()

    def key_value_dir_get_bytes(self, directory: str) -> list[tuple[str, bytes]]:
        with self.kv.cond:
            out = [(k, v) for k, v in self.kv.data.items() if k.startswith(directory)]
        self._count(len(directory) + sum(len(k) + len(v) for k, v in out))
        return out

    def key_value_dir_get(self, directory: str) -> list[tuple[str, str]]:
        return [(k, v.decode()) for k, v in self.key_value_dir_get_bytes(directory)]

    def key_value_increment(self, key: str, n: int) -> int:
        self._count(len(key) + 8)
        with self.kv.cond:
            value = int(self.kv.data.get(key, b"0")) + n
            self.kv.data[key] = str(value).encode()
            return value

    def key_value_delete(self, key: str) -> None:
        self._count(len(key))
        with self.kv.cond:
            for k in [k for k in self.kv.data if k == key or k.startswith(key + "/")]:
                del self.kv.data[k]


# --- counting object store (a ckpt.storage.Storage) ---------------------------------------------

LIST_PAGE = 1000  # keys per LIST page (S3, GCS)
KEEP_BYTES = 64 << 20  # objects up to this size keep their bytes (index objects, manifest)


class _Finished:
    """A finished write's future."""

    def result(self, timeout: float | None = None) -> None:
        return None

    def done(self) -> bool:
        return True


class ObjectStore:
    """The objects of one simulated bucket (key -> bytes, or size for data objects) and the
    requests made, by kind and process."""

    def __init__(self, processes: int) -> None:
        self.objects: dict[str, bytes | int] = {}
        self.requests = defaultdict(lambda: np.zeros(processes, dtype=np.int64))
        self.listed_keys = np.zeros(processes, dtype=np.int64)

    def count(self, kind: str, process: int, n: int = 1) -> None:
        self.requests[kind][process] += n

    def by_process(self, process: int) -> dict[str, int]:
        return {k: int(v[process]) for k, v in self.requests.items() if v[process]}


class _PackObject:
    def __init__(self, storage, key: str) -> None:
        self.storage, self.key = storage, key

    def write_at(self, offset: int, data) -> _Finished:
        return _Finished()

    def close(self, size: int) -> _Finished:
        return self.storage.put_parts(self.key, [], size)


def _storage_class():
    from ckpt.storage import Storage, StoreCaps

    class CountingStorage(Storage):
        """An object store in memory (write-if-absent, no rename), as seen by one process."""

        # PackWriter writes data objects chunk by chunk at their offsets (open_pack), so that no
        # chunk bytes are ever made; which chunk lands in which object at which offset is the
        # same as when an object store's objects are assembled in buffers of target_bytes.
        caps = StoreCaps("counting", conditional_writes=True, writes_in_place=True)

        def __init__(self, store: ObjectStore, process: int, root: str = "ckpt") -> None:
            self.store, self.process, self.root = store, process, root.strip("/")

        @property
        def url(self) -> str:
            return f"sim://{self.root}"

        def child(self, key: str):
            return CountingStorage(self.store, self.process, f"{self.root}/{key}")

        def parent(self):
            return CountingStorage(self.store, self.process, self.root.rpartition("/")[0])

        def _key(self, key: str) -> str:
            return f"{self.root}/{key}" if key else self.root

        def _count(self, kind: str, n: int = 1) -> None:
            self.store.count(kind, self.process, n)

        def get(self, key: str, *, max_bytes: int) -> bytes:
            from ckpt._errors import CheckpointError

            self._count("GET")
            value = self.store.objects.get(self._key(key))
            if value is None:
                raise FileNotFoundError(2, "no such object", self.where(key))
            if isinstance(value, int):
                raise CheckpointError(f"{self.where(key)}: a simulated data object has no bytes")
            if len(value) > max_bytes:
                raise CheckpointError(f"{self.where(key)}: more than {max_bytes} bytes")
            return value

        def read_exact(self, key: str, nbytes: int, into=None):
            return np.frombuffer(self.get(key, max_bytes=nbytes), np.uint8)

        def put(self, key: str, data) -> _Finished:
            self._count("PUT")
            n = memoryview(data).nbytes
            self.store.objects[self._key(key)] = bytes(data) if n <= KEEP_BYTES else n
            return _Finished()

        def put_parts(self, key: str, parts: list, size: int) -> _Finished:
            self._count("PUT")
            self.store.objects[self._key(key)] = int(size)
            return _Finished()

        def open_pack(self, key: str) -> _PackObject:
            """A data object being filled (PackWriter): chunks at offsets, no bytes kept; one PUT
            when it is closed (an object store sends an assembled object as one PUT)."""
            return _PackObject(self, key)

        def put_if_absent(self, key: str, data) -> None:
            self._count("PUT")
            if self._key(key) in self.store.objects:
                raise FileExistsError(17, "exists", self.where(key))
            self.store.objects[self._key(key)] = bytes(data)

        def exists(self, key: str) -> bool:
            if not key:
                self._count("LIST")
                return bool(self._below(""))
            self._count("HEAD")
            return self._key(key) in self.store.objects

        def _below(self, prefix: str) -> list[str]:
            start = self._key(prefix).rstrip("/") + "/"
            return [k for k in self.store.objects if k.startswith(start)]

        def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
            start = self._key(prefix).rstrip("/") + "/"
            files, dirs = set(), set()
            for k in self._below(prefix):
                head, sep, _ = k[len(start):].partition("/")
                (dirs if sep else files).add(head)
            n = len(files) + len(dirs)  # (a delimiter listing: one key per entry)
            self._count("LIST", max(1, math.ceil(n / LIST_PAGE)))
            self.store.listed_keys[self.process] += n
            return sorted(files), sorted(dirs)

        def delete(self, key: str) -> None:
            self._count("DELETE")
            self.store.objects.pop(self._key(key), None)

        def delete_tree(self, prefix: str = "") -> None:
            keys = self._below(prefix)
            self._count("LIST", max(1, math.ceil(len(keys) / LIST_PAGE)))
            self.store.listed_keys[self.process] += len(keys)
            for k in keys:
                self._count("DELETE")
                del self.store.objects[k]

        def open_arrays(self, arrays):
            raise NotImplementedError("the packed layout writes through PackWriter")

        def write_chunk(self, handle, box, data):
            raise NotImplementedError("the packed layout writes through PackWriter")

    return CountingStorage


# --- the save's inputs, as a save builds them ---------------------------------------------------


@dataclasses.dataclass
class Figures:
    tree: str
    processes: int
    simulated: int = 0  # processes whose writer ran for real (the others: see the module doc)
    objects: int = 0  # data + index objects + manifest
    data_objects: int = 0
    data_object_mib: tuple = (0.0, 0.0)  # (smallest, largest) data object, MiB
    target_bytes: int = 0  # the data objects' target size (PackWriter)
    primary_requests: dict = dataclasses.field(default_factory=dict)
    process_requests: dict = dataclasses.field(default_factory=dict)  # max over the others
    primary_listed_keys: int = 0
    commit_requests: int = 0
    commit_request_kinds: dict = dataclasses.field(default_factory=dict)
    commit_cpu_s: float = 0.0  # the primary's, from the statuses to the manifest written
    coord_calls: int = 0
    coord_bytes: int = 0
    coord_bytes_primary: int = 0
    coord_bytes_straggler: int | None = None
    status_bytes_max: int = 0
    plan_cpu_s: float = 0.0
    plan_peak_mib: float = 0.0
    manifest_bytes: int = 0  # read by every restoring process
    index_object_bytes: int = 0  # the largest index object
    restore_chunks: int = 0  # chunks process 0 reads restoring onto the same topology: one ranged GET each
    restore_runs: int = 0  # ranged GETs of chunk data (read_chunks: chunks that follow each other, one)
    indexes_read: int = 0  # index objects it reads
    index_bytes: int = 0  # their bytes
    restore_gets: int = 0  # its GETs before any chunk (manifest + index objects)
    manifest_cpu_s: float = 0.0  # reading and validating the manifest
    reshard_chunks: int = 0  # the same onto N/2 processes (process 0)
    reshard_indexes_read: int = 0
    reshard_index_bytes: int = 0
    chunks: int = 0
    sim_s: float = 0.0


def _cap() -> int:
    """The chunk cap of a save with the default options and a 16 GiB host budget (a 64 GiB
    host): save_chunk_cap, i.e. max_chunk_bytes (64 MiB)."""
    from ckpt._host import MAX_CHUNK_BYTES

    return min(MAX_CHUNK_BYTES, HOST_BUDGET // 4)


HOST_BUDGET = 16 << 30  # a quarter of a 64 GiB host (the default budget)


def _tree_leaves(tree: str) -> tuple[dict, list]:
    """(tree encoding, leaves (path, shape, dtype, spec) in the order flatten gives them)."""
    from ckpt._format import flatten

    scanned, _ = TREES[tree]
    described = llama70b(scanned)
    nested: dict = {}
    for k, (path, *_rest) in enumerate(described):
        *parents, last = path.split("/")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = k  # (a placeholder: flatten only walks the tree)
    encoding, flat = flatten(nested)
    return encoding, [described[leaf.value] for leaf in flat]


def arrays_of(tree: str, processes: int):
    """(leaves (path, shape, dtype, spec), ArrayShards of each) as array_shards gives them:
    every unique region of each array with its (process, device) holders."""
    from ckpt._format import dtype_from_name
    from ckpt._save.plan import ArrayShards, chunk_shape_for

    _, dp = TREES[tree]
    axes = mesh_axes(processes, dp)
    cache: dict = {}
    out = []
    _, leaves = _tree_leaves(tree)
    cap = _cap()
    grids: dict = {}
    for i, (path, shape, dtype, spec) in enumerate(leaves):
        key = (shape, spec)
        if key not in cache:
            # As array_shards does: every device's cell in the grid of shards once per grid,
            # then scaled to each shape.
            parts = tuple(n // k for n, k in zip(shape, _shard_shape(shape, spec, axes)))
            if (parts, spec) not in grids:
                grids[(parts, spec)] = holders_of(parts, spec, axes)
            shard = tuple(n // p for n, p in zip(shape, parts))
            cache[key] = {tuple((a * k, b * k) for (a, b), k in zip(box, shard)): h
                          for box, h in grids[(parts, spec)].items()}
        holders = cache[key]
        itemsize = dtype_from_name(dtype).itemsize
        box = next(iter(holders))
        chunk = chunk_shape_for(tuple(b - a for a, b in box), itemsize, cap)
        out.append(ArrayShards(i, itemsize, holders, shape, dtype, chunk))
    return leaves, out


def _plan(arrays, process: int):
    from ckpt._host import PACK_LIMIT
    from ckpt._save.plan import STACK_CHUNK_BYTES, plan_save

    cap = _cap()
    return plan_save(arrays, pack_limit=min(PACK_LIMIT, cap), stack_chunk_bytes=min(STACK_CHUNK_BYTES, cap),
                     process=process)


def plan_one_process(tree: str, processes: int, process: int):
    """What one process computes before writing: its own part of the plan (plan_save's
    `process`), from the holders of every unique region (as ``array_shards`` gets them)."""
    leaves, arrays = arrays_of(tree, processes)
    return leaves, arrays, _plan(arrays, process)


def measure_planning(tree: str, processes: int, process: int = 0) -> tuple[float, float, tuple]:
    import ckpt._save.plan  # noqa: F401 (the import is not planning)

    t0 = time.process_time()
    result = plan_one_process(tree, processes, process)
    cpu = time.process_time() - t0
    del result
    tracemalloc.start()
    result = plan_one_process(tree, processes, process)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return cpu, peak / 2**20, result


class _Device:
    __slots__ = ("process_index",)

    def __init__(self, process: int) -> None:
        self.process_index = process


class _Mesh:
    """What the commit reads of a saved array's mesh: its devices' processes."""

    def __init__(self, axes: dict[str, int]) -> None:
        procs = [_Device(p) for p in range(math.prod(axes.values()) // 8)]
        self.devices = np.empty(tuple(axes.values()), dtype=object)
        self.devices.reshape(-1)[:] = [procs[d // 8] for d in range(self.devices.size)]


class _Source:
    """A jax.Array as the commit sees it (``leaf.source.sharding.mesh``)."""

    def __init__(self, mesh: _Mesh) -> None:
        self.sharding = self
        self.mesh = mesh


def save_leaves(tree: str, processes: int, arrays, plan):
    """(tree encoding, Leaf of every leaf with its record, stacks, array specs) as the save's
    describe / finish_array_records / bundle_records / array_specs make them."""
    from ckpt._format import JAX_ARRAY, LeafRecord, storage_paths
    from ckpt._format import dtype_from_name
    from ckpt._geometry import ShardingInfo, fit_spec, normalize_spec
    from ckpt._save.plan import Leaf, finish_array_records, bundle_records
    from ckpt._layout import array_specs

    encoding, described = _tree_leaves(tree)
    axes = mesh_axes(processes, TREES[tree][1])
    source = _Source(_Mesh(axes))
    leaves = []
    for (path, shape, dtype, spec), a in zip(described, arrays):
        info = ShardingInfo("named", tuple(axes), tuple(axes.values()), fit_spec(normalize_spec(spec), len(shape)))
        rec = LeafRecord(path, JAX_ARRAY, tuple(shape), dtype, info.to_record())
        leaves.append(Leaf(rec, source, tuple(a.chunk_shape), dtype_from_name(dtype)))
    finish_array_records(leaves, storage_paths([tuple(path.split("/")) for path, *_ in described]))
    stacks = bundle_records(leaves, plan)
    return encoding, leaves, stacks, array_specs(leaves, stacks)


# --- one process's writes: the packed writer, as the save's writer drives it --------------------


def run_writer(writer, writes, specs: dict) -> None:
    """Hand `writes` to `writer` in plan order (the stager's order), chunk data without memory."""
    zeros = {}
    for w in writes:
        array = w.array_id
        dtype = specs[array][1].dtype
        if dtype not in zeros:
            zeros[dtype] = np.zeros((), dtype)
        writer.write_chunk(array, w.box, np.broadcast_to(zeros[dtype], tuple(b - a for a, b in w.box)))
    writer.close()


def _crc(array: int, flat: int) -> int:
    return (array * 0x9E3779B1 + flat * 0x85EBCA77) & 0xFFFFFFFF  # made up: no bytes exist


def write_process(staged, process: int, plan, arrays, specs: dict, target: int, put_index: bool = True) -> tuple[dict, object]:
    """One process's save after planning: its chunks through a PackWriter into its data objects,
    then its index object; returns (its status's "index", the PackedSave)."""
    import crc32c

    from ckpt._format import INDEX_DIR
    from ckpt._layout import PackedSave, PackWriter

    packing = PackedSave(plan, arrays, target)
    writer = packing.writer = PackWriter(staged.storage, process, target, specs)
    run_writer(writer, plan.writes, specs)
    sums: dict = {}
    for array, flat in writer.locations:
        sums.setdefault(array, {})[flat] = _crc(array, flat)
    data = packing.index_object(process, staged.prefix, sums, specs)
    key = f"{INDEX_DIR}/{process}"
    if put_index:
        staged.storage.put(key, data).result()
    index = {"key": key, "size": len(data), "crc": crc32c.crc32c(data), "chunks": packing.written,
             "places": packing.places}
    return index, packing


def status_bytes(index: dict) -> bytes:
    """A status as ckpt._save.job.SaveJob._report packs it (durations, bytes, requests)."""
    return msgpack.packb({"error": None, "index": index,
                          "stats": [0.1234, 1.2345, 12.345, 688_000_000, 3]}, use_bin_type=True)


def coordinate(processes: int, statuses: list[bytes], straggler_s: float = 0.0) -> CountingKV:
    """Run the coordination of one save over a counting KV client, one thread per process:
    the exchanges of ``ckpt._save`` (plan views gathered to the primary, the staged place
    broadcast, statuses gathered, the outcome broadcast), through ckpt._distributed."""
    from ckpt._distributed import DistributedCoordinator

    kv = CountingKV(processes)
    errors: list = []
    threading.stack_size(256 << 10)
    fp = hashlib.sha256(b"plan").digest()
    outcome = msgpack.packb({"error": None, "stats": {"slowest": 17, "slowest_s": 12.3456, "bytes": 705 * 10**9,
                                                      "requests": 3 * processes, "wait_s": 1.2345,
                                                      "process_count": processes}})

    def run(p: int) -> None:
        try:
            coord = DistributedCoordinator(kv.client(p), p, processes)
            save_id = coord.new_save_id()
            coord.gather(f"{save_id}/plan", msgpack.packb({"plan": fp}))
            coord.broadcast(f"{save_id}/prepare", lambda: msgpack.packb({"staged": {"generation": "gen-0123456789ab"}}))
            if straggler_s and p == processes - 1:
                time.sleep(straggler_s)
            coord.gather(f"{save_id}/written", statuses[p])
            coord.broadcast(f"{save_id}/commit", lambda: outcome)
            coord.end_save(save_id)
        except BaseException as e:  # noqa: BLE001
            errors.append((p, e))

    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in range(processes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"coordination failed: {errors[:3]}")
    return kv


# --- the restore's lookups -----------------------------------------------------------------------


def _held_boxes(arrays, axes: dict[str, int] | None, process: int, leaves) -> list[tuple[int, list]]:
    """(array index, boxes `process` holds) of every array: on the saving topology (`axes`
    None: the saved holders) or on the mesh `axes`."""
    out, cache = [], {}
    for a in arrays:
        if axes is None:
            key = id(a.holders)
            if key not in cache:
                cache[key] = [box for box, h in a.holders.items() if any(p == process for p, _ in h)]
        else:
            spec = leaves[a.leaf][3]
            key = (a.shape, spec)
            if key not in cache:
                cache[key] = [box for box, h in holders_of(a.shape, spec, axes).items()
                              if any(p == process for p, _ in h)]
        out.append((a.leaf, cache[key]))
    return out


def restore_lookups(root, manifest, held, process: int) -> tuple[int, object, int]:
    """Locate every chunk of every box in `held` as a restoring `process` does, through the
    library's own batched read (``PackedChunks.read_chunks``: the chunks of one data object that
    follow each other read as one range, up to its cap), with an executor that counts the ranged
    GETs instead of making them; returns (chunks located, the PackedChunks, ranged GETs). One
    batch, as a restore whose host budget holds the process's part (16 GiB here)."""
    import itertools

    from ckpt._layout import PackedChunks

    class Counting:
        def submit(self, fn, *args):
            return None  # (the range is never read: only counted, by read_chunks)

    chunks = PackedChunks(root, manifest, process=process)
    requests, seen = [], set()
    for leaf, boxes in held:
        rec = manifest.leaves[leaf]
        if rec.stacked is not None:
            st = manifest.stacks[rec.stacked.stack]
            index = (rec.stacked.index // st.zarr.chunk_shape[0],) + (0,) * (len(st.shape) - 1)
            key = (st.zarr.path, index)
            if boxes and key not in seen:
                seen.add(key)
                requests.append((key, st.zarr.path, index, _chunk_bytes(st.zarr)))
            continue
        shape = rec.zarr.chunk_shape
        for box in boxes:
            ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, shape)]
            for index in itertools.product(*ranges):
                requests.append(((rec.zarr.path, index), rec.zarr.path, index, _chunk_bytes(rec.zarr)))
    futures = chunks.read_chunks(requests, Counting())
    for f in futures.values():  # (a lookup that failed is an error here, as in a restore)
        if hasattr(f, "_error") and f._error is not None:
            raise f._error
    return len(requests), chunks, chunks.ranges_read


def _chunk_bytes(st) -> int:
    return math.prod(st.chunk_shape) * np.dtype(st.data_type).itemsize


# --- one simulated save and restore --------------------------------------------------------------

FULL_UP_TO = 128  # every process simulated up to this many


def simulate(tree: str, processes: int, *, straggler_s: float = 0.0, coordination: bool = True,
             full_up_to: int = FULL_UP_TO, target_bytes: int | None = None, reshard: bool = True) -> Figures:
    from ckpt._commit import commit_for
    from ckpt._format import MANIFEST_NAME, read_manifest
    from ckpt._host import PACK_OBJECT_BYTES
    from ckpt._layout import ManifestParts, PackedSave, commit_packed
    from ckpt._save.plan import ShardWrite

    started = time.monotonic()
    CountingStorage = _storage_class()
    fig = Figures(tree, processes)
    fig.plan_cpu_s, fig.plan_peak_mib, (described, arrays, plan0) = measure_planning(tree, processes)
    # As the save sizes them: Options.pack_object_bytes, at most a quarter of the host budget.
    target = fig.target_bytes = target_bytes or min(PACK_OBJECT_BYTES, max(HOST_BUDGET // 4, 1 << 20))
    encoding, leaves, stacks, specs = save_leaves(tree, processes, arrays, plan0)
    fig.chunks = sum(math.prod(-(-n // c) for n, c in zip(s.shape, s.chunk_shape)) for _, s in specs.values())

    store = ObjectStore(processes)
    primary = CountingStorage(store, 0)
    staged0 = commit_for(primary).stage(overwrite=False)  # (the primary's LIST and owner record)

    def staged_of(p: int):
        return staged0 if p == 0 else commit_for(CountingStorage(store, p)).staged_from(staged0.info)

    # Which processes run for real: all, or those whose index objects readers read.
    full = processes <= full_up_to
    plans = {0: plan0}
    readers = [0, 1] if processes > 1 else [0]
    for r in readers:
        plans.setdefault(r, _plan(arrays, r))
    real = set(range(processes)) if full else set(readers) | {w for r in readers for _, _, w in plans[r].pointers}
    indexes: dict[int, dict] = {}
    for p in sorted(real):
        plan = plans.get(p) or _plan(arrays, p)
        indexes[p], _ = write_process(staged_of(p), p, plan, arrays, specs, target)
    fig.simulated = len(real)
    if not full:
        # The others: process 0's region chunks (the same sizes on every process: the trees are
        # symmetric), then each one's own packed small arrays, through a real PackWriter.
        packable = {m for st in plan0.stacks for m in st.members} | set(plan0.whole)
        small_arrays = [a for a in arrays if a.leaf in packable]
        regions = tuple(w for w in plan0.writes if isinstance(w, ShardWrite))
        small_writers = {w for _, w in plan0.whole_writers} | {st.process for st in plan0.stacks}
        base = None
        for p in range(processes):
            if p in real:
                continue
            if p in small_writers or base is None:
                own = _plan(small_arrays, p).writes if p in small_writers else ()
                region_plan = dataclasses.replace(plan0, writes=regions + tuple(own), pointers=())
                view = commit_for(CountingStorage(ObjectStore(processes), p)).staged_from(staged0.info)
                index, packing = write_process(view, p, region_plan, arrays, specs, target, False)
                index = dict(index, crc=0x80000000 | p)  # (never read; 4 bytes, as a real CRC packs)
                objects = packing.writer.objects
                if p not in small_writers:
                    base = (index, objects)
            else:
                index, objects = base
            indexes[p] = dict(index, key=f"~index/{p}", places=index["places"] if p in small_writers else [])
            staged = staged_of(p)
            for k, (_, size) in enumerate(objects):
                staged.storage.put_parts(f"~data/{p}.{k}", [], size)
            staged.storage.put_parts(f"~index/{p}", [], index["size"])
        # The chunk counts of the processes simulated from process 0's: what makes the total.
        derived = [p for p in range(processes) if p not in real]
        short = fig.chunks - sum(i["chunks"] for i in indexes.values())
        for k, p in enumerate(derived):
            indexes[p]["chunks"] += short // len(derived) + (k < short % len(derived))
    statuses = [{"error": None, "index": indexes[p], "stats": [0.1, 1.2, 12.3, 688_000_000, 3]}
                for p in range(processes)]

    # The primary's commit: from the statuses alone (no listing, no index object read).
    before = store.by_process(0)
    t0 = time.process_time()
    packing = PackedSave(plan0, arrays, target)
    records, new_stacks, section = packing.manifest_parts(leaves, stacks, statuses, staged0.prefix, specs)
    commit_packed(primary, staged0, ManifestParts(encoding, records, new_stacks), section, overwrite=False)
    fig.commit_cpu_s = time.process_time() - t0
    after = store.by_process(0)
    fig.commit_request_kinds = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    fig.commit_requests = sum(fig.commit_request_kinds.values())
    fig.primary_requests = after
    fig.primary_listed_keys = int(store.listed_keys[0])
    if processes > 1:
        fig.process_requests = {k: int(v[1:].max()) for k, v in store.requests.items()}
    keys = [k for k in store.objects if not k.endswith("/" + MANIFEST_NAME)]
    data = [store.objects[k] for k in keys if "/~data/" in k]
    fig.objects = len(store.objects)
    fig.data_objects = len(data)
    fig.data_object_mib = (min(data) / 2**20, max(data) / 2**20) if data else (0.0, 0.0)
    fig.index_object_bytes = max(i["size"] for i in indexes.values())
    fig.manifest_bytes = len(store.objects[f"ckpt/{MANIFEST_NAME}"])
    fig.status_bytes_max = max(len(status_bytes(i)) for i in indexes.values())

    # Restore onto the same topology: process 0 reads the manifest, then locates every chunk its
    # devices hold.
    reader = CountingStorage(store, 0)
    before = sum(store.by_process(0).values())
    t0 = time.process_time()
    manifest = read_manifest(reader)
    fig.manifest_cpu_s = time.process_time() - t0
    fig.restore_chunks, located, fig.restore_runs = restore_lookups(reader, manifest, _held_boxes(arrays, None, 0, described), 0)
    fig.indexes_read, fig.index_bytes = located.indexes_read, located.index_bytes_read
    fig.restore_gets = sum(store.by_process(0).values()) - before
    if reshard and processes >= 4:
        # Onto N/2 processes x 8 devices: process 0 holds what processes 0 and 1 held.
        axes = mesh_axes(processes // 2, TREES[tree][1])
        fig.reshard_chunks, located, _ = restore_lookups(reader, manifest, _held_boxes(arrays, axes, 0, described), 0)
        fig.reshard_indexes_read, fig.reshard_index_bytes = located.indexes_read, located.index_bytes_read

    if coordination:
        blobs = [status_bytes(indexes[p]) for p in range(processes)]
        kv = coordinate(processes, blobs)
        fig.coord_calls, fig.coord_bytes = int(kv.calls.sum()), int(kv.bytes.sum())
        fig.coord_bytes_primary = int(kv.bytes[0])
        if straggler_s:
            fig.coord_bytes_straggler = int(coordinate(processes, blobs, straggler_s).bytes.sum())
    fig.sim_s = time.monotonic() - started
    return fig


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} KB"


def _reqs(d: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(d.items()) if v) or "-"


def table(figs: list[Figures]) -> str:
    rows = [("| tree | N | objects (data + index + manifest) | primary's requests | per process, max | keys listed "
             "| commit requests | coordinator calls / bytes (straggler) | plan CPU s / MiB | manifest | "
             "restore: index objects / bytes read (N -> N/2) | restore: chunks / ranged GETs |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in figs:
        coord = f"{f.coord_calls:,} / {_mb(f.coord_bytes)}"
        if f.coord_bytes_straggler is not None:
            coord += f" ({_mb(f.coord_bytes_straggler)})"
        restore = f"{f.indexes_read} / {_mb(f.index_bytes)}"
        if f.reshard_chunks:
            restore += f" ({f.reshard_indexes_read} / {_mb(f.reshard_index_bytes)})"
        rows.append(f"| {f.tree} | {f.processes:,} | {f.objects:,} ({f.data_objects:,} + {f.processes:,} + 1) | "
                    f"{_reqs(f.primary_requests)} | {_reqs(f.process_requests)} | {f.primary_listed_keys:,} | "
                    f"{f.commit_requests} ({_reqs(f.commit_request_kinds)}) | {coord} | "
                    f"{f.plan_cpu_s:.2f} / {f.plan_peak_mib:,.0f} | {_mb(f.manifest_bytes)} | {restore} | "
                    f"{f.restore_chunks:,} / {f.restore_runs:,} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--tree", choices=sorted(TREES), nargs="+", default=["per-layer"])
    ap.add_argument("--straggler-s", type=float, default=0.0, help="also run with the last process this late")
    ap.add_argument("--no-coordination", action="store_true", help="skip the threaded KV exchange")
    ap.add_argument("--full-up-to", type=int, default=FULL_UP_TO,
                    help="simulate every process up to this many (beyond: see the module doc)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    figs = []
    for tree in args.tree:
        for n in args.processes:
            f = simulate(tree, n, straggler_s=args.straggler_s, coordination=not args.no_coordination,
                         full_up_to=args.full_up_to)
            print(json.dumps(dataclasses.asdict(f)), file=sys.stderr, flush=True)
            figs.append(f)
    print(table(figs))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(f) for f in figs], fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
