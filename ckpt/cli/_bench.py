"""`ckpt bench`: ckpt save/restore against the raw disk, measured in the same run (docs/cli.md).

The disk benchmark of the developer benchmarks (bench/bench.py in the repository, `python -m
bench --gib 2`), kept here so that an installed copy can measure its own disk; the other modes
(Orbax, object stores, many small leaves, host memory, --train) stay in bench/.

A transformer-like tree (about --gib GiB, float32, some leaves replicated) on a 4x2 mesh of 8
CPU devices. Each run: the same unique shards written as plain files (one per shard, fsynced,
by a thread pool as wide as ckpt's I/O: the baseline), a bare device-to-host copy of them, a
ckpt save; a raw read of the files, ckpt restores onto the same sharding (with and without
checksum verification), onto mesh (2,4) and onto one device, with the page cache emptied before
each read. Figures are medians over the runs. Every shard of every restore is compared with
what was saved; a difference is an error (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ckpt._errors import CheckpointError
from ckpt._host import Options
from ckpt._restore import restore
from ckpt._save import save_async


def add_bench_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--gib", type=_positive(float), default=2.0, help="approximate size of the tree (default 2)")
    c.add_argument("--runs", type=_positive(int), default=3, help="runs to take the median of (default 3)")
    c.add_argument("--dir", default="/tmp/ckpt-bench", help="directory on the disk to measure (default "
                   "/tmp/ckpt-bench); the benchmark works in a fresh subdirectory and removes it")
    c.add_argument("--json", action="store_true", help="print the result as one JSON document")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"bad value {text!r} (a number > 0)")
        return value
    return parse


def _cpu_devices(n: int = 8) -> None:
    """n simulated CPU devices, so that the 4x2 mesh exists and the figures are the disk's on any
    machine. When JAX is already running (``ckpt bench`` called in-process), its devices are used."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends initialised: too late to choose
        return
    jax.config.update("jax_platforms", "cpu")


def _meshes():
    """The mesh to save from and the swapped one to restore onto: (4,2) and (2,4) on 8 devices;
    (n,1) and (1,n) on fewer (n a power of two, so that every dimension of the tree divides)."""
    n = 1 << (min(len(jax.devices()), 8).bit_length() - 1)
    shape = (4, 2) if n == 8 else (n, 1)
    return jax.make_mesh(shape, ("x", "y")), jax.make_mesh(shape[::-1], ("x", "y"))


def _make_tree(gib: float, mesh):
    """bench/bench.py's tree (model width 2048 from --gib 0.33 up); below that the width halves
    until one layer fits, so that small runs (the tests') stay small."""
    budget = gib * 2**30 / 4  # float32 elements
    d = 2048
    while d > 64 and 21 * d * d > budget:  # embeddings (vocab 8d, seq d) plus one layer
        d //= 2
    vocab, seq, per_layer = 8 * d, d, 12 * d * d
    layers = max(1, round((budget - (vocab + seq) * d) / per_layer))

    def put(shape, spec, seed):
        x = jax.random.normal(jax.random.key(seed), shape, np.float32)
        return jax.device_put(x, NamedSharding(mesh, spec))

    tree = {"embed": put((vocab, d), P("x", "y"), 0), "pos_embed": put((seq, d), P(), 1),  # replicated
            "layers": [], "final_norm": put((d,), P(), 2)}
    for i in range(layers):
        s = 10 + 10 * i
        tree["layers"].append({
            "attn": {n: put((d, d), P("x", "y"), s + k) for k, n in enumerate(["wq", "wk", "wv", "wo"])},
            "mlp": {"w1": put((d, 4 * d), P(None, "y"), s + 5), "w2": put((4 * d, d), P("y", None), s + 6)},
            "norm": put((d,), P(), s + 7),
        })
    return jax.block_until_ready(tree)


def _unique_shards(tree) -> list:
    """The per-device array of every unique shard (replica_id 0): what the baseline writes."""
    return [s.data for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.replica_id == 0]


def evict(root: str) -> None:
    """Empty the page cache of every file under root, so that each read meets the disk."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def prefault(nbytes: int) -> None:
    """Touch and free memory (untimed) so that each timed region finds the host's pages ready."""
    np.ones(nbytes // 8, dtype=np.float64)


def raw_write(shards, root: str, width: int) -> float:
    os.makedirs(root)

    def write(i_x):
        i, x = i_x
        fd = os.open(os.path.join(root, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, memoryview(np.asarray(x)).cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(width) as ex:
        list(ex.map(write, enumerate(shards)))
    return time.perf_counter() - t


def raw_read(shards, root: str, width: int) -> float:
    def read(i_x):
        i, x = i_x
        out = np.empty(x.shape, x.dtype)
        with open(os.path.join(root, str(i)), "rb", buffering=0) as f:
            f.readinto(memoryview(out).cast("B"))

    evict(root)
    t = time.perf_counter()
    with ThreadPoolExecutor(width) as ex:
        list(ex.map(read, enumerate(shards)))
    return time.perf_counter() - t


def bare_copy(shards) -> float:
    t = time.perf_counter()
    for x in shards:
        x.copy_to_host_async()
    copies = [np.array(x, copy=True) for x in shards]
    dt = time.perf_counter() - t
    del copies
    return dt


def check_values(restored, refs: list) -> int:
    """Compare every addressable shard of every restored leaf with the host copy of what was
    saved; the number of shards compared. CheckpointError at the first difference."""
    leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
    if len(leaves) != len(refs):
        raise CheckpointError(f"restore returned {len(leaves)} leaves, {len(refs)} were saved")
    n = 0
    for (path, got), want in zip(leaves, refs):
        for s in got.addressable_shards:
            if not np.array_equal(np.asarray(s.data), want[s.index]):
                raise CheckpointError(f"restored values differ from those saved: leaf "
                                      f"{jax.tree_util.keystr(path)}, shard {s.index}")
            n += 1
    return n


def run(gib: float, runs: int, root: str) -> dict:
    """Measure `runs` rounds interleaved (each system meets the machine in every state alike);
    medians, throughputs and ratios against the raw baseline of the same run."""
    _cpu_devices()
    width = Options().resolved().io_concurrency
    mesh, swapped_mesh = _meshes()
    tree = _make_tree(gib, mesh)
    shards = _unique_shards(tree)
    refs = [np.asarray(x) for x in jax.tree.leaves(tree)]
    nbytes = sum(x.nbytes for x in shards)
    targets = {"restore_same": jax.tree.map(lambda a: a.sharding, tree),
               "restore_mesh24": jax.tree.map(lambda a: NamedSharding(swapped_mesh, a.sharding.spec), tree),
               "restore_one_device": jax.tree.map(lambda a: SingleDeviceSharding(jax.devices()[0]), tree)}
    t: dict[str, list[float]] = {}
    checked = {"restores": 0, "shards": 0}
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=root)  # never a directory of the user's
    raw_dir, ck_dir = os.path.join(work, "raw"), os.path.join(work, "ckpt")

    def timed(name, fn):
        prefault(int(1.25 * nbytes))
        t.setdefault(name, []).append(fn())

    def save():
        s = time.perf_counter()
        handle = save_async(ck_dir, tree)
        t.setdefault("save_blocking_s", []).append(time.perf_counter() - s)
        handle.wait()
        return time.perf_counter() - s

    def restore_onto(target, verify=True):
        def go():
            evict(ck_dir)
            s = time.perf_counter()
            out = jax.block_until_ready(restore(ck_dir, target, verify=verify))
            dt = time.perf_counter() - s
            checked["shards"] += check_values(out, refs)  # untimed
            checked["restores"] += 1
            return dt
        return go

    try:
        for r in range(runs):
            for d in (raw_dir, ck_dir):
                shutil.rmtree(d, ignore_errors=True)
            timed("raw_write", lambda: raw_write(shards, raw_dir, width))
            evict(raw_dir)  # untimed: leave the next region no dirty pages of the baseline
            timed("bare_d2h_copy", lambda: bare_copy(shards))  # right before the save: same state
            timed("save", save)
            timed("raw_read", lambda: raw_read(shards, raw_dir, width))
            pair = [("restore_same", restore_onto(targets["restore_same"])),
                    ("restore_same_noverify", restore_onto(targets["restore_same"], verify=False))]
            for name, fn in pair if r % 2 == 0 else pair[::-1]:  # neither always goes second
                timed(name, fn)
            timed("restore_mesh24", restore_onto(targets["restore_mesh24"]))
            timed("restore_one_device", restore_onto(targets["restore_one_device"]))
            print(f"run {r + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in t.items()), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in t.items()}
    gib_unique = nbytes / 2**30
    return {
        "unique_gib": gib_unique, "runs": runs, "io_concurrency": width, "devices": mesh.size,
        "mesh": list(mesh.devices.shape), "seconds": med,
        "gib_per_s": {k: gib_unique / v for k, v in med.items() if k != "save_blocking_s"},
        "ratios": {
            "save / raw_write": med["raw_write"] / med["save"],
            "restore_same / raw_read": med["raw_read"] / med["restore_same"],
            "restore_same_noverify / raw_read": med["raw_read"] / med["restore_same_noverify"],
            "restore_mesh24 / raw_read": med["raw_read"] / med["restore_mesh24"],
            "restore_one_device / raw_read": med["raw_read"] / med["restore_one_device"],
            "verify cost (1 - noverify_s / verify_s)": 1 - med["restore_same_noverify"] / med["restore_same"],
            "save_blocking_s / bare_d2h_copy": med["save_blocking_s"] / med["bare_d2h_copy"],
        },
        # Reached only when every shard of every restore equalled what was saved (else an error).
        "values_match": True, "leaves": len(refs), "restores_checked": checked["restores"],
        "shards_checked": checked["shards"],
    }


def print_table(res: dict) -> None:
    print(f"\njax-ckpt benchmark: {res['unique_gib']:.2f} GiB unique, median of {res['runs']} runs, "
          f"I/O width {res['io_concurrency']}, mesh {'x'.join(map(str, res['mesh']))}")
    print(f"{'measure':<28}{'seconds':>10}{'GiB/s':>10}")
    for k, v in res["seconds"].items():
        rate = res["gib_per_s"].get(k)
        print(f"{k:<28}{v:>10.3f}{(f'{rate:.2f}' if rate else ''):>10}")
    print("\nratios (throughput vs raw baseline measured in the same run; higher is better)")
    for k, v in res["ratios"].items():
        print(f"  {k:<44}{v:>8.2f}")
    print(f"\nvalues: every restored shard equal to what was saved ({res['shards_checked']} shards "
          f"in {res['restores_checked']} restores)")
