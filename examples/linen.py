"""Flax Linen with jax-ckpt (docs/frameworks/linen.md): a TrainState (parameters sharded over a
4x2 mesh, an optax AdamW state, a typed PRNG key for dropout) is saved, then restored three ways:
into an abstract TrainState with shardings on a 2x4 mesh (a target), with ``mesh=``, and with no
target, the last two loaded with ``flax.serialization.from_state_dict``. Every value is checked.

    python examples/linen.py [--dir DIR]
"""

import argparse
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices for the demo

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import serialization  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import ckpt  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(4)(x)


class TrainState(train_state.TrainState):
    rng: jax.Array  # a typed key (jax.random.key), saved and restored as one


def create(seed: int) -> TrainState:
    model = MLP()
    params = model.init(jax.random.key(seed), jnp.ones((1, 16)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2), rng=jax.random.key(seed + 1))


def shardings(state, mesh) -> TrainState:
    """Kernels split over 'model' by their output dimension; everything else replicated."""
    def one(path, x):
        name = jax.tree_util.keystr(path)
        spec = P(None, "model") if name.endswith("['kernel']") and x.shape[-1] % mesh.shape["model"] == 0 else P()
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, state)


def values(state) -> list[np.ndarray]:
    def host(x):
        return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key)
                          else x)
    return [host(x) for x in jax.tree.leaves(serialization.to_state_dict(state))]


def mesh_of(shape) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def main(directory: str) -> None:
    mesh = mesh_of((4, 2))
    state = create(0)
    state = jax.device_put(state, shardings(state, mesh))
    x = jnp.ones((8, 16))

    def loss(params, rng):
        return jnp.mean(state.apply_fn({"params": params}, x, train=True, rngs={"dropout": rng}) ** 2)

    state = state.apply_gradients(grads=jax.grad(loss)(state.params, state.rng))  # one step
    path = os.path.join(directory, "linen")
    ckpt.save(path, state, overwrite=True)

    # 1. A target: the abstract TrainState (jax.eval_shape) with the shardings wanted on a new mesh.
    mesh2 = mesh_of((2, 4))
    abstract = jax.eval_shape(lambda: create(1))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings(abstract, mesh2))
    state1 = ckpt.restore(path, target)
    assert isinstance(state1, TrainState) and state1.params["Dense_0"]["kernel"].sharding.spec == P(None, "model")

    # 2. mesh=: the saved PartitionSpecs on the new mesh, as plain dicts; flax loads them with
    #    from_state_dict once to_state_dict has turned the optax tuples into {'0': ...} dicts.
    on_mesh = ckpt.restore(path, mesh=mesh2)
    state2 = serialization.from_state_dict(abstract, serialization.to_state_dict(on_mesh))

    # 3. No target: numpy arrays (the key as a typed key), loaded the same way.
    state3 = serialization.from_state_dict(abstract, serialization.to_state_dict(ckpt.restore(path)))

    want = values(state)
    for restored in (state1, state2, state3):
        got = values(restored)
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
        assert int(restored.step) == 1 and jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
        assert np.allclose(restored.apply_fn({"params": restored.params}, x), state.apply_fn({"params": state.params}, x))
    print(f"linen: saved and restored {len(want)} arrays three ways from {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    if args.dir:
        main(args.dir)
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
