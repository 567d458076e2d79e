"""Flax NNX, Flax Linen, Equinox and Optax states with the real libraries: the examples the docs
include (examples/nnx.py, linen.py, equinox_mlp.py; each checks every value it restores with a
target, with mesh= and without a target) run here, plus what they do not show."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["nnx", "linen", "equinox_mlp"])
def test_example_runs(name, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(tmp_path))
    assert "three ways" in capsys.readouterr().out or name == "equinox_mlp"


def test_restore_without_target_gives_typed_keys_and_unboxed_nnx_variables(tmp_path):
    from flax import nnx

    rngs = nnx.Rngs(0, dropout=1)
    model = nnx.Dropout(0.5, rngs=rngs)
    ckpt.save(tmp_path / "c", nnx.state(model))
    out = ckpt.restore(tmp_path / "c")
    key = out["rngs"]["key"]  # not {"value": ...}: a Variable is a box around one value
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and jax.random.key_impl(key) == "threefry2x32"
    assert np.array_equal(jax.random.key_data(key), jax.random.key_data(model.rngs.key[...]))
    assert set(out) == {"rngs"} and set(out["rngs"]) == {"count", "key"}
    assert set(nnx.to_pure_dict(nnx.state(model))["rngs"]) == {"count", "key"}
    assert ckpt.metadata(tmp_path / "c")["rngs"]["key"].dtype == key.dtype


@dataclasses.dataclass
class Box:
    value: jax.Array


jax.tree_util.register_dataclass(Box, data_fields=["value"], meta_fields=[])


@dataclasses.dataclass
class Pair:
    value: jax.Array
    other: jax.Array


jax.tree_util.register_dataclass(Pair, data_fields=["value", "other"], meta_fields=[])


def test_only_a_single_value_field_is_unboxed(tmp_path):
    ckpt.save(tmp_path / "c", {"box": Box(jnp.arange(3)), "pair": Pair(jnp.ones(2), jnp.zeros(2))})
    out = ckpt.restore(tmp_path / "c")
    assert np.array_equal(out["box"], np.arange(3)) and set(out["pair"]) == {"value", "other"}
    back = ckpt.restore(tmp_path / "c", {"box": Box(jax.ShapeDtypeStruct((3,), jnp.int32)),
                                         "pair": Pair(jax.ShapeDtypeStruct((2,), jnp.float32),
                                                      jax.ShapeDtypeStruct((2,), jnp.float32))})
    assert isinstance(back["box"], Box) and isinstance(back["pair"], Pair)


def test_whole_equinox_module_is_refused_with_how_to_partition(tmp_path):
    import equinox as eqx

    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    with pytest.raises(ckpt.CheckpointError, match=r"activation.*eqx\.filter\(model, eqx\.is_array\).*eqx\.partition"):
        ckpt.save(tmp_path / "c", model)
    assert not (tmp_path / "c").exists()


def test_optax_states_with_a_target_with_mesh_and_without(tmp_path):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params = {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model"))),
              "b": jnp.arange(8.0)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3), optax.ema(0.9))
    state = tx.init(params)
    state = jax.tree.map(lambda x: x + 1, state)
    ckpt.save(tmp_path / "c", state)
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh2, P())),
                          jax.eval_shape(tx.init, params))
    with_target = ckpt.restore(tmp_path / "c", target)
    assert jax.tree.structure(with_target) == jax.tree.structure(state)
    on_mesh = ckpt.restore(tmp_path / "c", mesh=mesh2)
    host = ckpt.restore(tmp_path / "c")
    assert on_mesh[1][0]["mu"]["w"].sharding.spec == P("data", "model")
    for got_tree in (with_target, on_mesh, host):
        got = jax.tree.leaves(got_tree)
        want = jax.tree.leaves(state)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if isinstance(g, jax.Array):
                for shard in g.addressable_shards:
                    assert np.array_equal(np.asarray(shard.data), np.asarray(w)[shard.index])
            assert np.array_equal(np.asarray(g), np.asarray(w))
