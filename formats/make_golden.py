"""Write the golden checkpoint of the current format version (formats/golden/v<N>/checkpoint).

    .venv/bin/python formats/make_golden.py            # refuses to replace an existing one
    .venv/bin/python formats/make_golden.py --force    # only while that version is unreleased

A golden checkpoint is written once per format version and then never regenerated: tests read
it back with the current code (tests/test_format.py) to prove old checkpoints stay readable.
Its values are simple formulas that the test restates independently; keep `golden_tree` and
the test's expectations in step when adding a new version.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def golden_tree(mesh: Mesh) -> dict:
    """Every kind of leaf format version 1 stores, small enough to check in (< 100 KB)."""

    def put(a: np.ndarray, *spec) -> jax.Array:
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))

    kernel = np.arange(16 * 96, dtype=np.float32).reshape(16, 96) * 0.5 - 100.0
    embed = ((np.arange(64 * 48) % 64) * 0.25).astype(ml_dtypes.bfloat16).reshape(64, 48)
    w_int4 = ((np.arange(64 * 80) % 16) - 8).astype(ml_dtypes.int4).reshape(64, 80)
    return {
        "params": {
            "dense": {
                "kernel": put(kernel, "data", "model"),  # zarr, 8 chunks of (8, 24)
                "bias": put(np.arange(96, dtype=np.float32) / 8, "model"),  # inline
            },
            "embed": put(embed, None, "model"),  # bfloat16 bits in uint16, 4 chunks of (64, 12)
        },
        "quant": {
            "w_int4": put(w_int4, "data"),  # int4 values in int8, 2 chunks of (32, 80)
            "scale_int8": np.arange(-4, 4, dtype=np.int8),  # numpy, inline
            "fp8": put(np.linspace(-2, 2, 16, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).reshape(4, 4)),
        },
        "data": {"valid": np.arange(4100) % 3 == 0},  # numpy bool, zarr, one chunk
        "mask": put((np.add.outer(np.arange(8), np.arange(8)) % 2 == 0)),  # bool, replicated, inline
        "opt": (jnp.int32(5), [np.float32(0.25), None]),  # tuple, list, None
        "rng": jax.random.key(42),
        "step": 7,
        "name": "golden-v1",
        "lr": 0.125,
        "flag": True,
        "big": 2**70,
        "z": 1 + 2j,
        "blob": b"\x00\x01ckpt",
    }


def golden_tree_v2(mesh: Mesh) -> dict:
    """Version 1's tree plus what version 2 adds: stacks of small arrays (SPEC section 7.1), here
    three layers whose kernels (sharded) and scales (bfloat16, replicated) form two stacks."""

    def put(a: np.ndarray, *spec) -> jax.Array:
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))

    tree = golden_tree(mesh)
    tree["name"] = "golden-v2"
    tree["layers"] = [
        {
            "kernel": put(np.arange(32 * 40, dtype=np.float32).reshape(32, 40) * 0.25 + i, "data", "model"),
            "scale": put(((np.arange(2560) % 128) * 0.5 - i).astype(ml_dtypes.bfloat16)),
        }
        for i in range(3)
    ]
    return tree


def golden_tree_v3(mesh: Mesh) -> dict:
    """Version 2's tree, saved by 4 processes x 2 devices in the packed layout (SPEC section 13),
    plus arrays whose shards several processes hold (pointers in the index objects): one
    replicated along the mesh's `data` axis (its shards on processes 0 and 2, 1 and 3) and one
    replicated on every device (written by one process, found through the others' pointers)."""

    def put(a: np.ndarray, *spec) -> jax.Array:
        sharding = NamedSharding(mesh, P(*spec))
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    def global_(x):  # every process passes the same value: one global array of it
        if not isinstance(x, jax.Array) or not x.is_fully_addressable:  # (device_put made it global)
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(np.asarray(jax.random.key_data(x))), impl=jax.random.key_impl(x))
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else ()
        return put(np.asarray(x), *spec)

    tree = jax.tree.map(global_, golden_tree_v2(mesh))
    tree["name"] = "golden-v3"
    tree["dp"] = put(np.arange(48 * 40, dtype=np.float32).reshape(48, 40) - 7.5, None, "model")
    tree["everywhere"] = put(np.arange(3 * 1000, dtype=np.int32).reshape(3, 1000) * 3, None, None)
    return tree


TREES = {1: golden_tree, 2: golden_tree_v2, 3: golden_tree_v3}
# Version 3 is the layout of multi-process saves: its golden checkpoint is written by real
# processes under jax.distributed on 127.0.0.1 (this file, run with --worker).
PROCESSES = {3: 4}


def _worker(dest: str, index: int, processes: int, port: int) -> None:
    import ckpt

    jax.config.update("jax_num_cpu_devices", 8 // processes)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=index, initialization_timeout=60)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    ckpt.save(dest, golden_tree_v3(mesh))
    jax.distributed.shutdown()


def _save_by_processes(dest: str, processes: int) -> None:
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(k), str(processes), str(port), dest], env=env)
             for k in range(processes)]
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        raise SystemExit(f"a save process failed: exit codes {codes}")


def main(argv=None) -> int:
    import ckpt
    from ckpt._format.records import FORMAT_VERSION

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="replace an existing golden checkpoint")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # index processes port dest
    args = parser.parse_args(argv)
    if args.worker:
        index, processes, port, dest = args.worker
        _worker(dest, int(index), int(processes), int(port))
        return 0
    dest = os.path.join(HERE, "golden", f"v{FORMAT_VERSION}", "checkpoint")
    if os.path.exists(dest):
        if not args.force:
            print(f"{dest} exists; golden checkpoints are never regenerated (use --force only for an "
                  "unreleased format version)", file=sys.stderr)
            return 1
        shutil.rmtree(dest)
    if FORMAT_VERSION in PROCESSES:
        _save_by_processes(dest, PROCESSES[FORMAT_VERSION])
    else:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
        ckpt.save(dest, TREES[FORMAT_VERSION](mesh))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dest) for f in fs)
    print(f"wrote {dest} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
