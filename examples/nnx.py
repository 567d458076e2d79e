"""Flax NNX with jax-ckpt (docs/frameworks/nnx.md): a model with sharded parameters, dropout
RNG streams (typed PRNG keys) and an nnx.Optimizer is saved on a 4x2 mesh, then restored three
ways: into an abstract model on a 2x4 mesh (a target), with ``mesh=`` into ``nnx.update``, and with
no target at all into ``nnx.replace_by_pure_dict``. Every restored value is checked.

    python examples/nnx.py [--dir DIR]
"""

import argparse
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices for the demo

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import ckpt  # noqa: E402

lecun = nnx.initializers.lecun_normal()


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(lecun, (None, "model")), rngs=rngs)
        self.fc2 = nnx.Linear(64, 4, kernel_init=nnx.with_partitioning(lecun, ("model", None)), rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.dropout(jax.nn.relu(self.fc1(x))))


def build(seed: int):
    model = MLP(nnx.Rngs(seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def leaves(tree):
    """Every array as numpy (PRNG keys as their key data), to compare."""
    def host(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return [host(x) for x in jax.tree.leaves(nnx.state(tree))]


def mesh_of(shape) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def main(directory: str) -> None:
    mesh = mesh_of((4, 2))
    with jax.set_mesh(mesh):
        model, optimizer = build(0)
        x = jnp.ones((8, 16))
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)  # one step: optimizer state is not zeros
        optimizer.update(model, grads)
    path = os.path.join(directory, "nnx")
    ckpt.save(path, nnx.state((model, optimizer)), overwrite=True)

    # 1. A target: an abstract model and optimizer on another mesh. Nothing is allocated twice;
    #    every array comes back with the abstract state's sharding.
    mesh2 = mesh_of((2, 4))
    with jax.set_mesh(mesh2):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: build(1)))
        model1, optimizer1 = nnx.merge(graphdef, ckpt.restore(path, abstract_state))
    assert model1.fc1.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert model1.fc1.kernel[...].sharding.mesh == mesh2

    # 2. mesh=: the saved PartitionSpecs on a new mesh, as plain dicts that nnx.update takes.
    with jax.set_mesh(mesh2):
        model2, optimizer2 = build(2)
    nnx.update((model2, optimizer2), ckpt.restore(path, mesh=mesh2))

    # 3. No target: numpy arrays in pure dicts (no `value` levels), PRNG keys as typed keys,
    #    exactly what nnx.to_pure_dict gives, so nnx.replace_by_pure_dict takes it.
    pure = ckpt.restore(path)
    assert jax.dtypes.issubdtype(pure[0]["dropout"]["rngs"]["key"].dtype, jax.dtypes.prng_key)
    with jax.set_mesh(mesh2):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: build(3)))
    nnx.replace_by_pure_dict(state, pure)
    model3, optimizer3 = nnx.merge(graphdef, state)

    want = leaves((model, optimizer))
    for restored in [(model1, optimizer1), (model2, optimizer2), (model3, optimizer3)]:
        got = leaves(restored)
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    model.eval()
    for m in (model1, model2, model3):
        m.eval()
        assert np.allclose(m(x), model(x))
    assert np.array_equal(jax.random.key_data(model3.dropout.rngs.key[...]),
                          jax.random.key_data(model.dropout.rngs.key[...]))
    print(f"nnx: saved and restored {len(want)} arrays three ways from {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    if args.dir:
        main(args.dir)
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
