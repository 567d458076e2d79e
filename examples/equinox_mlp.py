"""Equinox with jax-ckpt (docs/frameworks/equinox.md): a Module holds functions (its activation)
as well as arrays, and functions are not data, so the arrays are saved: ``eqx.filter(model,
eqx.is_array)`` (the first half of ``eqx.partition``). The arrays, sharded over a 4x2 mesh, are
saved with the optax state, then restored into the abstract Module (a target) on a 2x4 mesh and
put back together with ``eqx.combine``; ``mesh=`` and no target give the same arrays as dicts
keyed by field name. Every value is checked.

    python examples/equinox_mlp.py [--dir DIR]

(Not examples/equinox.py: a script of that name would shadow the equinox package.)
"""

import argparse
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices for the demo

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import ckpt  # noqa: E402


def make(seed: int) -> eqx.nn.MLP:
    return eqx.nn.MLP(in_size=16, out_size=4, width_size=64, depth=2, key=jax.random.key(seed))


def shardings(params, mesh):
    """Weights (out, in) split over 'model' by their output dimension; the rest replicated."""
    def one(x):
        spec = P("model", None) if x.ndim == 2 and x.shape[0] % mesh.shape["model"] == 0 else P()
        return NamedSharding(mesh, spec)
    return jax.tree.map(one, params)


def main(directory: str) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model = make(0)
    params, static = eqx.partition(model, eqx.is_array)
    params = jax.device_put(params, shardings(params, mesh))
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    path = os.path.join(directory, "equinox")

    try:
        ckpt.save(path, {"model": model})  # the whole Module: its activation is a function
    except ckpt.CheckpointError as e:
        assert "eqx.filter(model, eqx.is_array)" in str(e)
    ckpt.save(path, {"model": params, "opt_state": opt_state, "step": 100}, overwrite=True)

    # 1. A target: the abstract Module's arrays (no memory used) with shardings on a new mesh.
    mesh2 = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    abstract = eqx.filter(eqx.filter_eval_shape(make, 1), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings(abstract, mesh2))
    target = {"model": abstract, "opt_state": jax.eval_shape(tx.init, abstract), "step": 0}
    restored = ckpt.restore(path, target)
    model1 = eqx.combine(restored["model"], static)
    assert type(restored["opt_state"][0]) is optax.ScaleByAdamState and restored["step"] == 100
    assert model1.layers[0].weight.sharding.spec == P("model", None)

    # 2. mesh= and 3. no target: the same arrays in plain dicts keyed by field name (an equinox
    #    Module is rebuilt from its abstract skeleton, as in 1).
    on_mesh, host = ckpt.restore(path, mesh=mesh2), ckpt.restore(path)
    for i, layer in enumerate(model.layers):
        for tree in (on_mesh, host):
            assert np.array_equal(tree["model"]["layers"][i]["weight"], layer.weight)
            assert np.array_equal(tree["model"]["layers"][i]["bias"], layer.bias)
        assert on_mesh["model"]["layers"][i]["weight"].sharding.mesh == mesh2

    x = jnp.ones((16,))
    assert np.allclose(model1(x), model(x))
    for a, b in zip(jax.tree.leaves(restored["opt_state"]), jax.tree.leaves(opt_state)):
        assert np.array_equal(a, b)
    print(f"equinox: saved and restored {len(jax.tree.leaves(params))} arrays from {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    if args.dir:
        main(args.dir)
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
