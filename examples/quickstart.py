"""Save a sharded pytree on a 4x2 mesh, look at it, and restore it onto other topologies.

    python examples/quickstart.py [DIR]

Runs on a laptop: JAX on CPU with 8 simulated devices.
"""

import os
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before the first use of a device

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt


def _host(x):
    """Values on the host; PRNG keys as their key data (how a numpy restore returns them)."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def main(root: str) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    shard = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    key = jax.random.key(0)
    state = {
        "params": {
            "embed": jax.device_put(jax.random.normal(key, (1024, 256)), shard("data", "model")),
            "mlp": {"w": jax.device_put(jnp.ones((256, 1024), jnp.bfloat16), shard(None, "model")),
                    "b": jax.device_put(jnp.zeros((1024,)), shard())},  # replicated
        },
        "step": 1000,
        "rng": key,
    }

    path = os.path.join(root, "checkpoint")
    ckpt.save(path, state)
    print(f"saved to {path}: " + ", ".join(sorted(os.listdir(path))))

    # What is in it, without reading any array data.
    for name, meta in [("params/embed", ckpt.metadata(path)["params"]["embed"]),
                       ("params/mlp/w", ckpt.metadata(path)["params"]["mlp"]["w"])]:
        print(f"  {name}: {meta.shape} {meta.dtype} mesh={meta.mesh} spec={meta.partition_spec} "
              f"chunks={meta.chunk_shape}")

    # 1. Same shardings (a target of shardings; ShapeDtypeStructs or arrays work too).
    same = ckpt.restore(path, jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else x, state))
    # 2. Another topology: a 2x4 mesh, keeping the saved PartitionSpecs by axis name.
    other = jax.make_mesh((2, 4), ("data", "model"))
    moved = ckpt.restore(path, mesh=other)
    # 3. One device, and 4. numpy on the host.
    one = ckpt.restore(path, jax.tree.map(lambda x: SingleDeviceSharding(jax.devices()[0]) if isinstance(x, jax.Array) else x, state))
    host = ckpt.restore(path)

    for name, tree in [("same sharding", same), ("mesh 2x4", moved), ("one device", one), ("numpy", host)]:
        ok = all(np.array_equal(_host(a), _host(b)) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(tree)))
        embed = tree["params"]["embed"]
        where = embed.sharding if isinstance(embed, jax.Array) else type(embed).__name__
        print(f"restored ({name}): values equal: {ok}; params/embed on {where}")
        if not ok:
            raise SystemExit(f"restore onto {name} does not match what was saved")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
