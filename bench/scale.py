"""``python -m bench.scale``: what one save costs at N processes x 8 devices, simulated in one
Python process with the library's own planning, coordination and commit code.

Nothing is written to a disk: a counting in-memory store stands for the object store (one
request per PUT/GET/HEAD, a LIST page per 1,000 keys listed) and a counting key-value client
stands for the jax.distributed coordination service (``ckpt._distributed`` runs over it
unchanged, one thread per simulated process). Chunk bytes are never made: a write is its key
and length. What is real: the tree's shapes and shardings, the planner, the statuses the
processes exchange, the commit's checks and the manifest it builds.

Trees (``--tree``): ``per-layer`` (a 70B Llama: 80 layers x 9 matrices and norms, bf16 params
+ fp32 Adam mu/nu, 2,169 leaves, ~705 GB; matrices FSDP over hosts x tensor parallel 8 inside
a host, norms replicated), ``scanned`` (the same, layer-stacked: 36 leaves) and ``dp4`` (the
per-layer tree with 4-way data parallelism outside FSDP: every region held by 4 processes).

    python -m bench.scale --processes 8 128 1024 --tree per-layer
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


# --- counting object store --------------------------------------------------------------------

LIST_PAGE = 1000  # keys per LIST page (S3, GCS)


class CountingStore:
    """Keys and lengths only; requests counted by kind and process."""

    def __init__(self, processes: int) -> None:
        self.objects: dict[str, int] = {}
        self.requests = defaultdict(lambda: np.zeros(processes, dtype=np.int64))  # kind -> by process
        self.listed_keys = 0

    def put(self, process: int, key: str, nbytes: int) -> None:
        self.requests["PUT"][process] += 1
        self.objects[key] = nbytes

    def get(self, process: int, key: str) -> int:
        self.requests["GET"][process] += 1
        return self.objects[key]

    def list_prefix(self, process: int, prefix: str) -> dict[str, int]:
        found = {k: n for k, n in self.objects.items() if k.startswith(prefix)}
        self.requests["LIST"][process] += max(1, math.ceil(len(found) / LIST_PAGE))
        self.listed_keys += len(found)
        return found


# --- one simulated save -----------------------------------------------------------------------


@dataclasses.dataclass
class Figures:
    tree: str
    processes: int
    objects: int = 0
    primary_requests: dict = dataclasses.field(default_factory=dict)
    process_requests: dict = dataclasses.field(default_factory=dict)  # max over the others
    primary_listed_keys: int = 0
    commit_requests: int = 0
    coord_calls: int = 0
    coord_bytes: int = 0
    coord_bytes_primary: int = 0
    coord_bytes_straggler: int | None = None
    plan_cpu_s: float = 0.0
    plan_peak_mib: float = 0.0
    manifest_bytes: int = 0  # read by every restoring process
    index_bytes: int = 0  # index parts a restoring process reads (beyond the manifest)
    chunks: int = 0
    save_s: float = 0.0


def arrays_of(tree: str, processes: int):
    from ckpt._format import dtypes as _dtypes  # noqa: F401
    from ckpt._save.plan import ArrayShards, chunk_shape_for

    scanned, dp = TREES[tree]
    axes = mesh_axes(processes, dp)
    cache: dict = {}
    out = []
    leaves = llama70b(scanned)
    cap = 512 << 20
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
        itemsize = 2 if dtype == "bfloat16" else 4
        box = next(iter(holders))
        chunk = chunk_shape_for(tuple(b - a for a, b in box), itemsize, cap)
        out.append(ArrayShards(i, itemsize, holders, shape, dtype, chunk))
    return leaves, out


def plan_one_process(tree: str, processes: int, process: int):
    """What one process computes before writing: its own part of the plan (plan_save's
    `process`), from the holders of every unique region (as ``array_shards`` gets them)."""
    from ckpt._save.plan import plan_save

    leaves, arrays = arrays_of(tree, processes)
    plan = plan_save(arrays, process=process)
    return leaves, arrays, plan


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


def _index_bytes(plan) -> bytes:
    """A process's index object, as _SaveJob._put_index packs it (checksums made up)."""
    return msgpack.packb([[getattr(w, "array", getattr(w, "leaf", 0)), k, 0x9E3779B9]
                          for k, w in enumerate(plan.writes)], use_bin_type=True)


def _status(index: dict | None) -> bytes:
    """A status as _SaveJob._exchange_and_commit packs it."""
    return msgpack.packb({"error": None, "index": index, "stats": [0.1234, 1.2345, 12.345, 688_000_000, 3]},
                         use_bin_type=True)


def coordinate(processes: int, straggler_s: float = 0.0) -> CountingKV:
    """Run the coordination of one save over a counting KV client, one thread per process:
    the exchanges of ``ckpt._save`` (plan views gathered to the primary, the staged place
    broadcast, statuses gathered, the outcome broadcast), through ckpt._distributed."""
    from ckpt._distributed import DistributedCoordinator

    kv = CountingKV(processes)
    errors: list = []
    threading.stack_size(256 << 10)
    fp = hashlib.sha256(b"plan").digest()
    index = {"key": "~index/1023", "size": 281_000, "crc": 0x12345678}
    outcome = msgpack.packb({"error": None, "stats": {"slowest": 17, "slowest_s": 12.3456, "bytes": 705 * 10**9,
                                                      "requests": 3 * processes, "wait_s": 1.2345,
                                                      "process_count": processes}})

    def run(p: int) -> None:
        try:
            coord = DistributedCoordinator(kv.client(p), p, processes)
            save_id = coord.new_save_id()
            coord.gather(f"{save_id}/plan", msgpack.packb({"plan": fp}))
            coord.broadcast(f"{save_id}/prepare", lambda: msgpack.packb({"staged": {"prefix": "gen-0123456789ab/"}}))
            if straggler_s and p == processes - 1:
                time.sleep(straggler_s)
            coord.gather(f"{save_id}/written", _status(None if p == 0 else index))
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


def _unique_chunks(arrays, plan) -> int:
    """Objects of chunk data in the job: every chunk of every array written region by region,
    and the packed writes (the same on every process: packing is planned by all alike)."""
    from ckpt._geometry import chunk_grid

    packed = {id(a) for a in arrays if any(a.leaf in st.members for st in plan.stacks) or a.leaf in plan.whole}
    stacked = sum(math.ceil(len(st.members) / st.chunk_members) for st in plan.stacks)
    return sum(math.prod(chunk_grid(a.shape, a.chunk_shape)) for a in arrays if id(a) not in packed) \
        + stacked + len(plan.whole)


MANIFEST_MEASURED_UP_TO = 1024  # beyond: the manifest's size extrapolated from its bytes per chunk


def simulate(tree: str, processes: int, *, straggler_s: float = 0.0, coordination: bool = True) -> Figures:
    from ckpt._format import LeafRecord, Manifest, ZarrStorage
    from ckpt._geometry import chunk_grid
    from ckpt._save.commit import group_paths

    fig = Figures(tree, processes)
    fig.plan_cpu_s, fig.plan_peak_mib, (leaves, arrays, plan) = measure_planning(tree, processes)
    store = CountingStore(processes)
    prefix = "gen-0123456789ab/"
    chunks = _unique_chunks(arrays, plan)
    # Writes: each process its chunks (as process 0 plans them: the trees are symmetric) and,
    # but the primary, its index object; the primary the zarr.json files.
    mine = len(plan.writes)
    index = _index_bytes(plan)
    store.requests["PUT"][:] += mine
    store.requests["PUT"][1:] += 1
    for p in range(1, processes):
        store.objects[f"{prefix}~index/{p}"] = len(index)
    stacked = {m for st in plan.stacks for m in st.members}
    paths = [leaves[a.leaf][0] for a in arrays if a.leaf not in stacked]
    paths += [f"~stacks/{s}" for s in range(len(plan.stacks))]
    groups = len(group_paths(paths, prefix))
    metadata = len(paths) + groups
    # Every processes-th array's zarr.json per process (write.metadata_share); the groups' by
    # the primary.
    store.requests["PUT"][:] += np.array([len(range(p, len(paths), processes)) for p in range(processes)])
    store.requests["PUT"][0] += groups
    before = {k: int(v[0]) for k, v in store.requests.items()}
    # The commit: the primary reads each index object once (no listing), then the manifest.
    for p in range(1, processes):
        store.get(0, f"{prefix}~index/{p}")
    n_chunks = 0
    if processes <= MANIFEST_MEASURED_UP_TO:
        records = []
        for i, (path, shape, dtype, spec) in enumerate(leaves):
            a = arrays[i]
            n = math.prod(chunk_grid(a.shape, a.chunk_shape))
            n_chunks += n
            st = ZarrStorage(path, a.chunk_shape, dtype, "raw", chunk_checksums=(0x9E3779B9,) * n)
            records.append(LeafRecord(path, "jax.Array", shape, dtype,
                                      {"spec": [list(x) if isinstance(x, tuple) else x for x in spec]}, st))
        manifest = len(Manifest({}, records).encode())
        del records
    else:
        small = simulate(tree, MANIFEST_MEASURED_UP_TO, coordination=False) if tree else None
        per_chunk = (small.manifest_bytes - 200 * len(leaves)) / max(1, small.chunks)
        manifest = int(200 * len(leaves) + per_chunk * chunks)
    store.put(0, "manifest.msgpack", manifest)
    fig.manifest_bytes = manifest
    fig.chunks = chunks
    fig.objects = chunks + metadata + (processes - 1) + 1
    fig.primary_requests = {k: int(v[0]) for k, v in store.requests.items()}
    fig.commit_requests = sum(fig.primary_requests.values()) - sum(before.values())
    fig.primary_listed_keys = store.listed_keys
    if processes > 1:
        fig.process_requests = {k: int(v[1:].max()) for k, v in store.requests.items()}
    if coordination:
        t0 = time.monotonic()
        kv = coordinate(processes)
        fig.save_s = time.monotonic() - t0
        fig.coord_calls, fig.coord_bytes = int(kv.calls.sum()), int(kv.bytes.sum())
        fig.coord_bytes_primary = int(kv.bytes[0])
        if straggler_s:
            fig.coord_bytes_straggler = int(coordinate(processes, straggler_s).bytes.sum())
    return fig


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} KB"


def table(figs: list[Figures]) -> str:
    rows = ["| tree | N | objects | primary requests | per-process requests (max) | keys listed | commit requests "
            "| coordinator calls / bytes | plan CPU s / peak MiB per process | manifest + index read per restoring process |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for f in figs:
        reqs = ", ".join(f"{k} {v:,}" for k, v in sorted(f.primary_requests.items()))
        other = ", ".join(f"{k} {v:,}" for k, v in sorted(f.process_requests.items())) or "-"
        coord = f"{f.coord_calls:,} / {_mb(f.coord_bytes)}"
        if f.coord_bytes_straggler is not None:
            coord += f" ({_mb(f.coord_bytes_straggler)} with a straggler)"
        rows.append(f"| {f.tree} | {f.processes:,} | {f.objects:,} | {reqs} | {other} | {f.primary_listed_keys:,} | "
                    f"{f.commit_requests:,} | {coord} | {f.plan_cpu_s:.2f} / {f.plan_peak_mib:,.0f} | "
                    f"{_mb(f.manifest_bytes + f.index_bytes)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--tree", choices=sorted(TREES), nargs="+", default=["per-layer"])
    ap.add_argument("--straggler-s", type=float, default=0.0, help="also run with the last process this late")
    ap.add_argument("--no-coordination", action="store_true", help="skip the threaded KV exchange")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    figs = []
    for tree in args.tree:
        for n in args.processes:
            f = simulate(tree, n, straggler_s=args.straggler_s, coordination=not args.no_coordination)
            print(json.dumps(dataclasses.asdict(f)), file=sys.stderr, flush=True)
            figs.append(f)
    print(table(figs))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dataclasses.asdict(f) for f in figs], fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
