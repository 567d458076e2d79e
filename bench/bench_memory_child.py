"""The children of the memory benchmark (bench/bench_memory.py): one measurement per fresh process.

Each child gets a JSON spec (``python -m bench.bench_memory --child SPEC``) and prints one JSON
line. ``measure`` is the timed region: peak host RSS from VmHWM, reset right before it.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import inspect
import json
import os
import shutil
import signal
import time

MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _quiesce(prefault_bytes: int) -> None:
    from bench.common import prefault

    gc.collect()
    if prefault_bytes:
        prefault(prefault_bytes)
    try:  # free heap pages go back to the kernel: a region reusing them would not raise VmHWM
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(fn, prefault_bytes: int = 0):
    """Run fn() as a timed region: (its result, seconds, memory in MiB: resident before, peak
    (VmHWM, reset right before), resident after, peak over resident, retained after)."""
    _quiesce(prefault_bytes)
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    mem = {"before_mib": before / 1024, "peak_mib": peak / 1024, "after_mib": after / 1024,
           "over_resident_mib": (peak - before) / 1024, "retained_mib": (after - before) / 1024}
    return out, dt, mem


def _budget_kwargs(fn, budget: int | None) -> tuple[dict, str]:
    """The host budget as `fn` takes it: its ``host_budget_bytes=`` keyword where it has one
    (issue 10), else ``options=Options(host_budget_bytes=...)``."""
    import ckpt

    if budget is None:
        return {}, "default"
    if "host_budget_bytes" in inspect.signature(fn).parameters:
        return {"host_budget_bytes": budget}, "keyword"
    return {"options": ckpt.Options(host_budget_bytes=budget)}, "options"


def _device_bytes(tree) -> int:
    """Bytes of the distinct device buffers of `tree` (replicas sharing a buffer count once)."""
    import jax

    seen: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            seen[s.data.unsafe_buffer_pointer()] = s.data.nbytes
    return sum(seen.values())


def _check_tree(restored, expected) -> int:
    """Compare every addressable shard of `restored` with `expected`; the number of shards."""
    import jax
    import numpy as np

    n = 0
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        whole = np.asarray(want)
        for s in got.addressable_shards:
            if not np.array_equal(np.asarray(s.data), whole[s.index]):
                raise AssertionError(f"restored shard {s.index} of a {whole.shape} leaf differs")
            n += 1
    return n


# ---- the measurements --------------------------------------------------------------


def _tiny_tree(mesh):
    """The benchmark tree's kinds of leaves at test size (about 21 MiB): the tests' harness run."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def put(shape, spec, seed):
        return jax.device_put(jax.random.normal(jax.random.key(seed), shape, jnp.float32), NamedSharding(mesh, spec))

    d = 512
    tree = {"embed": put((4096, d), P("x", "y"), 0), "pos_embed": put((512, d), P(), 1),
            "layers": [{"attn": {"wq": put((d, d), P("x", "y"), 10)},
                        "mlp": {"w1": put((d, 4 * d), P(None, "y"), 15), "w2": put((4 * d, d), P("y", None), 16)},
                        "norm": put((d,), P(), 17)}]}
    return jax.block_until_ready(tree)


def _tree(spec: dict):
    """The benchmark tree (bench.common.make_tree, 4x2 mesh), or the tiny one when spec["tiny"]."""
    import jax

    from bench.common import make_tree, unique_shards

    mesh = jax.make_mesh((4, 2), ("x", "y"))
    tree = _tiny_tree(mesh) if spec.get("tiny") else make_tree(spec["gib"], mesh)
    shards = unique_shards(tree)
    return tree, shards, sum(x.nbytes for _, x in shards)


def _child_save(spec: dict) -> dict:
    import ckpt
    from bench.common import evict, raw_write

    tree, shards, nbytes = _tree(spec)
    width = ckpt.Options().resolved().io_concurrency
    raw_dir, ck_dir = os.path.join(spec["root"], "raw"), os.path.join(spec["root"], "ckpt")
    for d in (raw_dir, ck_dir):
        shutil.rmtree(d, ignore_errors=True)
    kwargs, via = _budget_kwargs(ckpt.save_async, spec["budget"])
    out: dict = {"unique_bytes": nbytes, "budget_via": via}

    def save():
        s = time.perf_counter()
        h = ckpt.save_async(ck_dir, tree, **kwargs)
        blocking = time.perf_counter() - s
        h.wait()
        return blocking

    order = ["raw", "save"] if spec["order"] % 2 == 0 else ["save", "raw"]
    for name in order:
        if name == "raw":
            _, out["raw_write_s"], out["raw_mem"] = measure(lambda: raw_write(shards, raw_dir, width),
                                                            int(1.25 * nbytes))
            evict(raw_dir)  # untimed, as in bench/bench.py: leave no dirty pages for the save to meet
        else:
            out["save_blocking_s"], out["save_s"], out["save_mem"] = measure(save, int(1.25 * nbytes))
    evict(ck_dir)
    release = getattr(ckpt, "release_host_memory", None)
    if release is not None:
        before = _status_kib("VmRSS")
        release()
        gc.collect()
        out["released_mib"] = (before - _status_kib("VmRSS")) / 1024
    with open(os.path.join(spec["root"], "raw-shapes.json"), "w") as f:
        json.dump([[list(x.shape), str(x.dtype)] for _, x in shards], f)
    return out


def _child_raw_read(spec: dict) -> dict:
    import jax
    import numpy as np

    import ckpt
    from bench.common import evict, raw_read

    with open(os.path.join(spec["root"], "raw-shapes.json")) as f:
        shards = [(str(i), jax.ShapeDtypeStruct(tuple(s), np.dtype(d))) for i, (s, d) in enumerate(json.load(f))]
    nbytes = sum(x.size * x.dtype.itemsize for _, x in shards)
    raw_dir = os.path.join(spec["root"], "raw")
    evict(raw_dir)
    width = ckpt.Options().resolved().io_concurrency
    _, dt, mem = measure(lambda: raw_read(shards, raw_dir, width), int(1.25 * nbytes))
    return {"unique_bytes": nbytes, "raw_read_s": dt, "raw_mem": mem}


def _child_restore(spec: dict) -> dict:
    import jax
    from jax.sharding import SingleDeviceSharding

    import ckpt
    from bench.common import evict

    ck_dir = os.path.join(spec["root"], spec.get("name", "ckpt"))
    kwargs, via = _budget_kwargs(ckpt.restore, spec["budget"])
    if "big_mib" in spec:  # the big array, onto the sharding it was saved with
        args = {"target": {"w": _big_sharding()}}
    elif spec["target"] == "one":
        one = SingleDeviceSharding(jax.devices()[0])
        args = {"target": jax.tree.map(lambda m: one, ckpt.metadata(ck_dir),
                                       is_leaf=lambda m: isinstance(m, ckpt.ArrayMetadata))}
    else:  # "same" or "mesh24": every array on this mesh with its saved PartitionSpec
        args = {"mesh": jax.make_mesh((4, 2) if spec["target"] == "same" else (2, 4), ("x", "y"))}
    nbytes = sum(m.nbytes for m in jax.tree.leaves(
        ckpt.metadata(ck_dir), is_leaf=lambda m: isinstance(m, ckpt.ArrayMetadata)))
    evict(ck_dir)
    restored, dt, mem = measure(lambda: jax.block_until_ready(ckpt.restore(ck_dir, **args, **kwargs)),
                                int(1.25 * nbytes))
    placed = _device_bytes(restored)
    mem["over_restored_mib"] = mem["peak_mib"] - mem["before_mib"] - placed / MIB
    mem["transient_mib"] = mem["peak_mib"] - mem["after_mib"]  # what the restore let go of again
    expected = {"w": _big_array(spec["big_mib"])} if "big_mib" in spec else _tree(spec)[0]
    shards = _check_tree(restored, expected)
    return {"restore_s": dt, "restore_mem": mem, "restored_bytes": placed, "shards_checked": shards,
            "budget_via": via}


def _child_first(spec: dict) -> dict:
    import numpy as np

    import ckpt
    from bench.common import bare_copy, files_and_bytes, raw_write

    tree, shards, nbytes = _tree(spec)
    system, path = spec["system"], os.path.join(spec["root"], f"first-{spec['system']}")
    shutil.rmtree(path, ignore_errors=True)
    width = ckpt.Options().resolved().io_concurrency
    if system == "raw":
        def fn():
            raw_write(shards, path, width)
    elif system == "bare":
        def fn():
            bare_copy(shards)
    elif system == "ckpt":
        def fn():
            s = time.perf_counter()
            h = ckpt.save_async(path, tree)
            blocking = time.perf_counter() - s
            h.wait()
            return blocking
    elif system == "orbax":
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()

        def fn():
            s = time.perf_counter()
            checkpointer.save(path, tree)
            blocking = time.perf_counter() - s
            checkpointer.wait_until_finished()
            return blocking
    elif system == "jax":
        import jax
        from jax.experimental.array_serialization import serialization

        arrays = jax.tree.leaves(tree)
        paths = [os.path.join(path, str(i)) for i in range(len(arrays))]
        manager = serialization.GlobalAsyncCheckpointManager()

        def fn():
            s = time.perf_counter()
            manager.serialize_with_paths(arrays, paths)
            blocking = time.perf_counter() - s
            manager.wait_until_finished()
            return blocking
    else:
        raise ValueError(f"unknown system {system!r}")
    blocking, dt, mem = measure(fn, int(1.25 * nbytes))
    files, size = files_and_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    out = {"system": system, "unique_bytes": nbytes, "seconds": dt, "mem": mem, "files": files,
           "disk_bytes": size, "versions": {"numpy": np.__version__}}
    if blocking is not None:
        out["blocking_s"] = blocking
    if system == "ckpt":
        value = ckpt.Options().resolved().host_budget_bytes  # an int, or None / a word for unlimited
        out["default_budget_bytes"] = value if isinstance(value, (int, type(None))) else str(value)
    return out


def _big_sharding():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(jax.make_mesh((2,), ("x",), devices=jax.devices()[:2]), P("x"))


def _big_array(mib: int):
    import jax
    import jax.numpy as jnp

    rows = max(2, mib * MIB // (4096 * 4) // 2 * 2)  # float32 rows of 4096, an even number
    make = jax.jit(lambda: jax.random.normal(jax.random.key(7), (rows, 4096), jnp.float32),
                   out_shardings=_big_sharding())
    return jax.block_until_ready(make())


def _child_big_save(spec: dict) -> dict:
    import jax

    import ckpt

    x = _big_array(spec["big_mib"])
    path = os.path.join(spec["root"], "big")
    shutil.rmtree(path, ignore_errors=True)
    kwargs, via = _budget_kwargs(ckpt.save, spec["budget"])
    _, dt, mem = measure(lambda: ckpt.save(path, {"w": x}, **kwargs), x.nbytes)
    return {"array_bytes": x.nbytes, "shard_shape": list(x.addressable_shards[0].data.shape),
            "devices": len(x.sharding.device_set), "save_s": dt, "save_mem": mem, "budget_via": via,
            "chunks": [m.chunk_shape for m in jax.tree.leaves(
                ckpt.metadata(path), is_leaf=lambda m: isinstance(m, ckpt.ArrayMetadata))]}


CHILDREN = {"save": _child_save, "raw_read": _child_raw_read, "restore": _child_restore,
            "first": _child_first, "big_save": _child_big_save}


def child_main(spec: dict) -> int:
    """Run the measurement `spec` names and print its result as one JSON line."""
    from bench.common import setup_devices

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's view into a hung child
    setup_devices(8)
    out = CHILDREN[spec["kind"]](spec)
    print(json.dumps(out))
    return 0
