"""Trees, checks and storage hooks (through ckpt.Options) shared by the multi-process tests
(test_multihost.py) and the processes they launch. Every process computes the same global values
on its own."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from multiproc import Worker

# Array leaves: path -> (shape, dtype, PartitionSpec over ('data', 'model')).
X_ARRAYS = {
    "params/w": ((32, 64), np.float32, P("data", "model")),
    "params/b": ((64,), jnp.bfloat16, P("model")),  # replicated over 'data', i.e. across processes
    "params/emb": ((16, 48), np.int32, P(None, ("data", "model"))),
    "opt/mu": ((32, 64), np.float32, P()),  # fully replicated
    "opt/count": ((), np.int32, P()),  # small and replicated: inline in the manifest
}
Y_ARRAYS = {
    "layers/0/w": ((64, 32), np.float32, P("model", "data")),
    "layers/1/w": ((48, 16), jnp.bfloat16, P("data", None)),
    "head": ((40,), np.float32, P()),
}
Z_KIB = [64, 56, 48, 40, 36, 32, 28, 24, 20, 16, 12, 8]  # fully replicated float32 leaves
# Saved on the (4, 2) mesh in chunks of at most R_CHUNK_BYTES (shards of 16 and 8 KiB cut into
# 4 KiB chunks), restored onto (2, 4) by 2 and 4 processes: a reshard whose reads the plan
# (`ckpt plan`) must predict exactly.
R_ARRAYS = {
    "r/w": ((256, 128), np.float32, P("data", "model")),
    "r/v": ((128, 256), jnp.bfloat16, P("model", "data")),
    "r/u": ((8192,), np.float32, P("data")),
}
R_CHUNK_BYTES = 4096  # the smallest cap a save accepts


def values(path: str, shape, dtype, seed: int = 0) -> np.ndarray:
    """The global value of a leaf: distinct per leaf and seed, exact in bfloat16."""
    base = sum(map(ord, path)) + 17 * seed
    n = int(np.prod(shape, dtype=np.int64))
    return ((np.arange(n, dtype=np.int64) * 7 + base) % 251 - 125).reshape(shape).astype(dtype)


def mesh_of(shape) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))


def build(arrays: dict, mesh: Mesh, seed: int = 0) -> dict:
    out = {}
    for path, (shape, dtype, spec) in arrays.items():
        full = values(path, shape, dtype, seed)
        node = out
        *parents, name = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda idx, f=full: f[idx])
    return out


def x_tree(mesh: Mesh, seed: int = 0) -> dict:
    tree = build(X_ARRAYS, mesh, seed)
    tree["table"] = values("table", (64, 40), np.float64, seed)  # numpy: written by process 0
    tree["step"], tree["name"] = 7 + seed, "run-x"
    return tree


def leaf(tree, path: str):
    for part in path.split("/"):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def bad_shards(restored, arrays: dict, shardings: dict | None = None, seed: int = 0) -> tuple[list[str], int]:
    """(leaves with a wrong shard, sharding or type; number of shards compared)."""
    bad, count = [], 0
    for path, (shape, dtype, _) in arrays.items():
        full, got = values(path, shape, dtype, seed), leaf(restored, path)
        if shardings is None:
            count += 1
            # (a 0-d array comes back as a numpy scalar)
            if not (isinstance(got, (np.ndarray, np.generic)) and got.dtype == full.dtype
                    and np.array_equal(got, full)):
                bad.append(path)
            continue
        if not isinstance(got, jax.Array) or not got.sharding.is_equivalent_to(shardings[path], len(shape)):
            bad.append(path)
            continue
        for shard in got.addressable_shards:
            count += 1
            if not np.array_equal(np.asarray(shard.data), full[shard.index]):
                bad.append(f"{path}{shard.index}")
    return bad, count


def shardings_for(arrays: dict, mesh: Mesh, swap: bool = False) -> dict:
    flip = {"data": "model", "model": "data"}
    out = {}
    for path, (_, _, spec) in arrays.items():
        if swap:
            spec = P(*[tuple(flip[a] for a in e) if isinstance(e, tuple) else flip.get(e, e) for e in spec])
        out[path] = NamedSharding(mesh, spec)
    return out


def as_target(arrays: dict, shardings: dict) -> dict:
    out = {}
    for path, (shape, dtype, _) in arrays.items():
        node = out
        *parents, name = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[path])
    return out


def restore_checks(w: Worker, tag: str, path: str, arrays: dict, mesh: Mesh) -> None:
    """Restore `path` with the saved specs on `mesh`, with swapped specs, and as numpy."""
    from ckpt._restore import restore_with_stats

    same = shardings_for(arrays, mesh)
    tree, stats = restore_with_stats(path, mesh=mesh)
    bad, n = bad_shards(tree, arrays, same)
    w.report(check=f"{tag}-mesh", bad=bad, shards=n, bytes_read=stats.bytes_read,
             per_leaf={k: list(v) for k, v in stats.per_leaf.items()})
    swapped = shardings_for(arrays, mesh, swap=True)
    tree = ckpt.restore(path, as_target(arrays, swapped), partial=True)
    bad, n = bad_shards(tree, arrays, swapped)
    w.report(check=f"{tag}-swapped", bad=bad, shards=n)


def reshard_check(w: Worker, tag: str, path: str) -> None:
    """Restore R_ARRAYS onto a (2, 4) mesh; report what this process read."""
    from ckpt._restore import restore_with_stats

    mesh = mesh_of((2, 4))
    tree, stats = restore_with_stats(path, mesh=mesh)
    bad, n = bad_shards(tree, R_ARRAYS, shardings_for(R_ARRAYS, mesh))
    w.report(check=tag, bad=bad, shards=n, bytes_read=stats.bytes_read, bytes_needed=stats.bytes_needed,
             chunks_read=stats.chunks_read)


def hooked_writes(before: Callable[[np.ndarray], None]) -> ckpt.Options:
    """Options for one save whose storage calls `before(data)` ahead of every chunk write this
    process makes (a fault-injecting engine wrapped around the default one: support.py)."""
    from support import write_hook_options

    return write_hook_options(before)


def disk_full(data) -> None:
    raise OSError(28, "No space left on device (simulated)")


def no_op(data) -> None:
    pass


def stall_once(seconds: float):
    stalled = []

    def stall(data) -> None:
        if not stalled:
            stalled.append(True)
            time.sleep(seconds)

    return stall


def die(data) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def tmp_entries(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n)
