"""Every kind of sharding JAX produces saves; restored arrays are safe to donate. On local disk
and on memory:// (the `location` fixture)."""

import jax
import numpy as np
import pytest
from jax._src.sharding_impls import GSPMDSharding
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt


def _value(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _check(arr, expected, sharding=None):
    if sharding is not None:
        assert arr.sharding == sharding
    for s in arr.addressable_shards:
        assert np.array_equal(np.asarray(s.data), expected[s.index]), (s.device, s.index)


def test_mesh_over_a_subset_of_devices(location):
    devs = jax.devices()
    sub = Mesh(np.array([devs[2], devs[5], devs[7], devs[1]]).reshape(2, 2), ("a", "b"))
    value = _value((32, 64))
    ckpt.save(location("c"), {"w": jax.device_put(value, NamedSharding(sub, P("a", "b")))})
    assert ckpt.metadata(location("c"))["w"].mesh == {"a": 2, "b": 2}
    _check(ckpt.restore(location("c"), {"w": NamedSharding(sub, P("a", "b"))})["w"], value)
    full = Mesh(np.array(devs).reshape(4, 2), ("a", "b"))
    _check(ckpt.restore(location("c"), mesh=full)["w"], value, NamedSharding(full, P("a", "b")))
    assert np.array_equal(ckpt.restore(location("c"))["w"], value)


def test_pmap_output(location):
    value = _value((8, 512))
    out = jax.pmap(lambda v: v * 2)(value)
    ckpt.save(location("c"), {"p": out})
    assert np.array_equal(ckpt.restore(location("c"))["p"], value * 2)
    target = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
    _check(ckpt.restore(location("c"), {"p": target})["p"], value * 2, target)


def test_gspmd_sharding_saves_and_restores_with_a_target(location):
    named = NamedSharding(jax.make_mesh((4, 2), ("a", "b")), P("a", "b"))
    gspmd = GSPMDSharding(named._device_assignment, named._to_xla_hlo_sharding(2))
    value = _value((16, 128))
    arr = jax.device_put(value, gspmd)
    assert type(arr.sharding) is GSPMDSharding
    ckpt.save(location("c"), {"g": arr}, options=ckpt.Options(pack_limit_bytes=0))  # chunk = shard
    meta = ckpt.metadata(location("c"))["g"]
    assert meta.partition_spec is None and meta.chunk_shape == (4, 64)
    _check(ckpt.restore(location("c"), {"g": named})["g"], value, named)
    # mesh= needs a PartitionSpec, which this sharding never had: a clear error, not a guess.
    with pytest.raises(ckpt.CheckpointError, match="leaf 'g' was saved with a sharding that has no PartitionSpec"):
        ckpt.restore(location("c"), mesh=named.mesh)


def test_single_device_sharding(location):
    value = _value((64, 32))
    ckpt.save(location("c"), {"s": jax.device_put(value, jax.devices()[4])})
    meta = ckpt.metadata(location("c"))["s"]
    assert meta.partition_spec == P() and meta.chunk_shape == (64, 32)
    one = SingleDeviceSharding(jax.devices()[1])
    _check(ckpt.restore(location("c"), {"s": one})["s"], value, one)


def test_restored_arrays_can_be_donated(location):
    """Restore places host buffers on devices without copying them where it can (replicas may
    share one); training on the result with donated state must stay exact."""
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    specs = {"replicated": P(), "sharded": P("x", "y"), "half": P("x")}
    values = {k: _value((64, 128), i) for i, k in enumerate(specs)}
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    ckpt.save(location("c"), {k: jax.device_put(values[k], shardings[k]) for k in specs})
    state = ckpt.restore(location("c"), shardings)
    step = jax.jit(lambda t: jax.tree.map(lambda a: a * 2 + 1, t), donate_argnums=0, out_shardings=shardings)
    expected = dict(values)
    for _ in range(3):
        state = step(state)
        expected = {k: v * 2 + 1 for k, v in expected.items()}
        for k in specs:
            _check(state[k], expected[k], shardings[k])
    # The checkpoint itself is untouched by all of this.
    again = ckpt.restore(location("c"), shardings)
    for k in specs:
        _check(again[k], values[k], shardings[k])
