"""What the benchmarks share: 8 CPU devices, the benchmark tree and its unique shards, the raw-disk
baselines (the same bytes written and read as plain files) and page-cache eviction.

Used by bench/bench.py and by the memory benchmark's children (bench/bench_memory_child.py);
kept apart so that neither imports the other (the children are started by bench_memory, which
bench.py's --memory dispatches to).
"""

from __future__ import annotations

import os


def setup_devices(n: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_platforms", "cpu")


def evict(root: str) -> None:
    from ckpt.cli import _bench  # (the installed `ckpt bench`'s: one definition)

    _bench.evict(root)


def prefault(nbytes: int) -> None:
    from ckpt.cli import _bench

    _bench.prefault(nbytes)


def make_tree(gib: float, mesh):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    d, vocab, seq = 2048, 16384, 2048
    per_layer = 4 * d * d + 2 * d * 4 * d
    fixed = vocab * d + seq * d
    layers = max(1, round((gib * 2**30 / 4 - fixed) / per_layer))

    def put(shape, spec, seed):
        x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
        return jax.device_put(x, NamedSharding(mesh, spec))

    tree = {
        "embed": put((vocab, d), P("x", "y"), 0),
        "pos_embed": put((seq, d), P(), 1),  # replicated over all 8 devices
        "layers": [],
        "final_norm": put((d,), P(), 2),
    }
    for i in range(layers):
        s = 10 + 10 * i
        tree["layers"].append({
            "attn": {n: put((d, d), P("x", "y"), s + k) for k, n in enumerate(["wq", "wk", "wv", "wo"])},
            "mlp": {"w1": put((d, 4 * d), P(None, "y"), s + 5), "w2": put((4 * d, d), P("y", None), s + 6)},
            "norm": put((d,), P(), s + 7),
        })
    jax.block_until_ready(tree)
    return tree


def unique_shards(tree):
    """(name, per-device array) of every unique shard, with replica_id == 0."""
    import jax

    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        for s in leaf.addressable_shards:
            if s.replica_id == 0:
                out.append((f"{jax.tree_util.keystr(path)}{s.index}", s.data))
    return out


# The raw baselines are the installed `ckpt bench`'s own (one implementation of what "raw" means);
# the developer benchmarks pass (name, array) pairs.
def raw_write(shards, root: str, width: int) -> float:
    from ckpt.cli import _bench

    return _bench.raw_write([x for _, x in shards], root, width)


def raw_read(shards, root: str, width: int) -> float:
    from ckpt.cli import _bench

    return _bench.raw_read([x for _, x in shards], root, width)


def bare_copy(shards) -> float:
    from ckpt.cli import _bench

    return _bench.bare_copy([x for _, x in shards])


def files_and_bytes(root: str) -> tuple[int, int]:
    files = size = 0
    for d, _, names in os.walk(root):
        for f in names:
            files += 1
            size += os.path.getsize(os.path.join(d, f))
    return files, size
