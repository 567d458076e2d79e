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
    for dev in range(n):
        box = tuple((int(k) * step, (int(k) + 1) * step) for k, (_, step) in zip(keys[dev], parts_per_dim))
        holders.setdefault(box, []).append((dev // 8, dev))
    return holders


# --- counting key-value client (the jax.distributed client's methods ckpt uses) ---------------


class CountingKV:
    """An in-memory coordination service counting calls and bytes by process."""

    def __init__(self, processes: int) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
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
            self.kv.cond.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        deadline = time.monotonic() + timeout_ms / 1000
        with self.kv.cond:
            while key not in self.kv.data:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._count(len(key))
                    raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
                self.kv.cond.wait(left)
            value = self.kv.data[key]
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
    for i, (path, shape, dtype, spec) in enumerate(leaves):
        key = (shape, spec)
        if key not in cache:
            cache[key] = holders_of(shape, spec, axes)
        holders = cache[key]
        itemsize = 2 if dtype == "bfloat16" else 4
        box = next(iter(holders))
        chunk = chunk_shape_for(tuple(b - a for a, b in box), itemsize, cap)
        out.append(ArrayShards(i, itemsize, holders, shape, dtype, chunk))
    return leaves, out


def plan_one_process(tree: str, processes: int, process: int):
    """What one process computes before writing (today: the whole job's plan)."""
    from ckpt._save.plan import plan_save

    leaves, arrays = arrays_of(tree, processes)
    plan = plan_save(arrays)
    return leaves, plan, plan.for_process(process)


def measure_planning(tree: str, processes: int) -> tuple[float, float, tuple]:
    t0 = time.process_time()
    result = plan_one_process(tree, processes, 0)
    cpu = time.process_time() - t0
    del result
    tracemalloc.start()
    result = plan_one_process(tree, processes, 0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return cpu, peak / 2**20, result


def _status_of(plan, process: int) -> bytes:
    """What a process reports after writing (today: every chunk's checksum)."""
    from ckpt._geometry import chunk_grid, chunk_index_of, flat_chunk_index

    sums = []
    for w in plan.for_process(process):
        array = getattr(w, "array", None)
        array = w.leaf if array is None else array
        sums.append([array, hash((array, w.box)) & 0xFFFF, 0x12345678])
    return msgpack.packb({"error": None, "sums": sums}, use_bin_type=True)


def coordinate(processes: int, statuses: list[bytes], straggler_s: float = 0.0) -> CountingKV:
    """Run the coordination of one save over a counting KV client, one thread per process."""
    from ckpt._distributed import DistributedCoordinator

    kv = CountingKV(processes)
    errors: list = []
    threading.stack_size(256 << 10)

    def run(p: int) -> None:
        try:
            coord = DistributedCoordinator(kv.client(p), p, processes)
            save_id = coord.new_save_id()
            fp = hashlib.sha256(b"plan").digest()
            coord.all_gather(f"{save_id}/plan", msgpack.packb({"plan": fp}))
            coord.broadcast(f"{save_id}/prepare", lambda: msgpack.packb({"staged": {"prefix": "gen-0123456789ab/"}}))
            if straggler_s and p == processes - 1:
                time.sleep(straggler_s)
            coord.all_gather(f"{save_id}/written", statuses[p])
            coord.broadcast(f"{save_id}/commit", lambda: msgpack.packb({"error": None}))
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


def simulate(tree: str, processes: int, *, straggler_s: float = 0.0, coordination: bool = True) -> Figures:
    from ckpt._format import GROUP_METADATA, ArraySpec, LeafRecord, Manifest, ZarrStorage, array_metadata_bytes
    from ckpt._geometry import chunk_grid, chunk_key
    from ckpt._save.commit import group_paths

    fig = Figures(tree, processes)
    fig.plan_cpu_s, fig.plan_peak_mib, (leaves, plan, _) = measure_planning(tree, processes)
    store = CountingStore(processes)
    prefix = "gen-0123456789ab/"
    # Every process writes its chunks; the primary its zarr.json files.
    arrays = {}
    for w in plan.writes:
        array = getattr(w, "array", None)
        array = w.leaf if array is None else array
        store.put(w.process, f"{prefix}{array}/c/{hash(w.box)}", w.nbytes)
        arrays.setdefault(array, 0)
    for array in arrays:
        store.put(0, f"{prefix}{array}/zarr.json", 400)
    paths = [leaves[a][0] if a >= 0 else f"~stacks/{-1 - a}" for a in arrays]
    for g in group_paths(paths, prefix):
        store.put(0, f"{prefix}{g}/zarr.json", len(GROUP_METADATA))
    before = {k: int(v[0]) for k, v in store.requests.items()}
    # The commit: today the primary lists the whole generation (_check_written -> stat_many).
    store.list_prefix(0, prefix)
    # The manifest: one record per leaf with every chunk's checksum.
    checksums = defaultdict(list)
    for w in plan.writes:
        array = getattr(w, "array", None)
        checksums[w.leaf if array is None else array].append(0x12345678)
    records = []
    for i, (path, shape, dtype, spec) in enumerate(leaves):
        st = ZarrStorage(path, shape, dtype, "raw", chunk_checksums=tuple(checksums.get(i, ())))
        records.append(LeafRecord(path, "jax.Array", shape, dtype, {"spec": [list(s) if isinstance(s, tuple) else s for s in spec]}, st))
    manifest = Manifest({}, records).encode()
    store.put(0, "manifest.msgpack", len(manifest))
    fig.manifest_bytes = len(manifest)
    fig.objects = len(store.objects)
    fig.primary_requests = {k: int(v[0]) for k, v in store.requests.items()}
    fig.commit_requests = sum(fig.primary_requests.values()) - sum(before.values())
    fig.primary_listed_keys = store.listed_keys
    if processes > 1:
        fig.process_requests = {k: int(v[1:].max()) for k, v in store.requests.items()}
    if coordination:
        statuses = [_status_of(plan, p) for p in range(processes)]
        t0 = time.monotonic()
        kv = coordinate(processes, statuses)
        fig.save_s = time.monotonic() - t0
        fig.coord_calls, fig.coord_bytes = int(kv.calls.sum()), int(kv.bytes.sum())
        fig.coord_bytes_primary = int(kv.bytes[0])
        if straggler_s:
            fig.coord_bytes_straggler = int(coordinate(processes, statuses, straggler_s).bytes.sum())
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
