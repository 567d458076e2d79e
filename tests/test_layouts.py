"""Device layouts on restore (issue 25, item 12): a target that asks for a layout
(``jax.experimental.layout.Format(layout, sharding)`` as a leaf, a ``ShapeDtypeStruct`` whose
sharding is a ``Format``, an array in a custom layout) comes back in that layout, as jax's own
serializer restores it (``test_load_with_layout``); what cannot be restored into is refused naming
the leaf. Every placement path is covered: small leaves placed in one batch, a small leaf read
whole, large shards put one by one, shards streamed in pieces (on the host for CPU devices, and
on the device), and arrays with no elements. Every shard's values and layout are compared."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt
from ckpt._restore import place, restore_with_stats

COL = Layout(major_to_minor=(1, 0))  # column-major: not a CPU device's default for 2-D arrays


def _mesh():
    return jax.make_mesh((4, 2), ("x", "y"))


def _check(arr, value: np.ndarray, fmt: Format) -> None:
    """`arr` holds `value` in every shard, with `fmt`'s sharding and its layout, as jax itself
    places `value` for that Format."""
    assert isinstance(arr, jax.Array), type(arr)
    assert arr.sharding == fmt.sharding
    assert arr.format.layout.major_to_minor == fmt.layout.major_to_minor
    assert arr.format == jax.device_put(value, fmt).format
    assert len(arr.addressable_shards) == len(fmt.sharding.addressable_devices)
    for s in arr.addressable_shards:
        assert s.data.format.layout.major_to_minor == fmt.layout.major_to_minor, s.device
        assert np.array_equal(np.asarray(s.data), value[s.index]), s.device


def _value(shape=(64, 32), dtype=np.float32):
    return np.arange(np.prod(shape), dtype=dtype).reshape(shape)


@pytest.fixture
def saved(tmp_path):
    value = _value()
    path = str(tmp_path / "c")
    ckpt.save(path, {"w": jax.device_put(value, NamedSharding(_mesh(), P("x", "y"))), "host": value * 2})
    return path, value


def test_a_format_leaf_comes_back_on_devices_in_its_layout(saved):
    path, value = saved
    fmt = Format(COL, NamedSharding(_mesh(), P(None, "y")))
    out = ckpt.restore(path, {"w": fmt, "host": Format(COL, SingleDeviceSharding(jax.devices()[2]))})
    _check(out["w"], value, fmt)  # (before: a numpy array)
    _check(out["host"], value * 2, Format(COL, SingleDeviceSharding(jax.devices()[2])))
    # A tiling given as the device reports it: the Format comes back equal.
    exact = Format(Layout((1, 0), tiling=()), NamedSharding(_mesh(), P("x")))
    out = ckpt.restore(path, {"w": exact, "host": exact})
    assert out["w"].format == exact and out["host"].format == exact
    _check(out["w"], value, exact)
    # A Format with the default layout (or none) is a bare sharding.
    plain = Format(None, NamedSharding(_mesh(), P("x")))
    out = ckpt.restore(path, {"w": plain, "host": Format(Layout((0, 1)), NamedSharding(_mesh(), P("x")))})
    assert out["w"].format == jax.device_put(value, plain.sharding).format
    assert out["host"].format == jax.device_put(value, plain.sharding).format


def test_a_shape_dtype_struct_with_a_format_keeps_its_layout(saved):
    path, value = saved
    fmt = Format(COL, NamedSharding(_mesh(), P("x", "y")))
    target = {"w": jax.ShapeDtypeStruct(value.shape, np.float32, sharding=fmt),
              "host": jax.ShapeDtypeStruct(value.shape, jax.numpy.bfloat16, sharding=fmt)}
    out = ckpt.restore(path, target)  # (before: the default layout)
    _check(out["w"], value, fmt)
    _check(out["host"], (value * 2).astype(jax.numpy.bfloat16), fmt)
    # An array in that layout as the target: its layout; ShapeDtypeStruct.like of it too.
    like = jax.device_put(np.zeros_like(value), fmt)
    out = ckpt.restore(path, {"w": like, "host": jax.ShapeDtypeStruct.like(like)})
    _check(out["w"], value, fmt)
    _check(out["host"], value * 2, fmt)
    # ... and of an array in the default layout: the default layout.
    default = jax.device_put(np.zeros_like(value), fmt.sharding)
    out = ckpt.restore(path, {"w": jax.ShapeDtypeStruct.like(default), "host": default})
    assert out["w"].format == default.format and out["host"].format == default.format


def test_what_cannot_be_restored_into_is_refused_naming_the_leaf(saved):
    path, _ = saved
    sharding = NamedSharding(_mesh(), P("x"))
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w'.*no sharding"):  # (before: numpy, silently)
        ckpt.restore(path, {"w": Format(), "host": sharding})
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w'.*AUTO"):
        ckpt.restore(path, {"w": Format(Layout.AUTO, sharding), "host": sharding})
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'host'.*major_to_minor=\(0, 1, 2\)"):
        ckpt.restore(path, {"w": sharding, "host": Format(Layout((0, 1, 2)), sharding)})


@pytest.mark.parametrize("in_place", [True, False])
def test_every_placement_path_keeps_the_layout(tmp_path, monkeypatch, in_place):
    """Small leaves (one batched transfer), large shards (one device_put each), shards larger
    than the host budget streamed in pieces (filled on the host for CPU devices, or updated on
    the device: FILL_CPU_SHARDS_IN_PLACE off), and an array with no elements."""
    monkeypatch.setattr(place, "FILL_CPU_SHARDS_IN_PLACE", in_place)
    mesh = _mesh()
    small, large, empty = _value((16, 8)), _value((1024, 512)), np.zeros((0, 8), np.float32)
    path = str(tmp_path / "c")
    tree = {"small": jax.device_put(small, NamedSharding(mesh, P("x", "y"))),
            "large": jax.device_put(large, NamedSharding(mesh, P("x"))), "empty": empty}
    ckpt.save(path, tree, options=ckpt.Options(max_chunk_bytes=64 << 10))
    fmts = {"small": Format(COL, NamedSharding(mesh, P(None, "y"))),
            "large": Format(COL, NamedSharding(mesh, P(None, "y"))),  # shards of 1 MiB each
            "empty": Format(COL, NamedSharding(mesh, P(None, "y")))}
    for budget in (None, 256 << 10):  # 256 KiB: each large shard arrives in pieces
        out, _ = restore_with_stats(path, fmts, host_budget_bytes=budget)
        _check(out["small"], small, fmts["small"])
        _check(out["large"], large, fmts["large"])
        assert out["empty"].shape == (0, 8) and out["empty"].format.layout.major_to_minor == (1, 0)
    # One device, a cast, and streamed pieces: the ShapeDtypeStruct's dtype and layout.
    one = Format(COL, SingleDeviceSharding(jax.devices()[5]))
    target = {"large": jax.ShapeDtypeStruct(large.shape, jax.numpy.bfloat16, sharding=one)}
    out, _ = restore_with_stats(path, target, partial=True, host_budget_bytes=256 << 10)
    _check(out["large"], large.astype(jax.numpy.bfloat16), one)


def test_prng_keys_restore_in_the_default_layout_only(tmp_path):
    mesh = _mesh()
    keys = jax.random.split(jax.random.key(0), (8, 2))
    path = str(tmp_path / "c")
    ckpt.save(path, {"k": jax.device_put(keys, NamedSharding(mesh, P("x")))})
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'k'.*PRNG key.*default layout"):
        ckpt.restore(path, {"k": Format(COL, NamedSharding(mesh, P("x")))})
    # A Format with no layout, or a key array's own (default) one: as a bare sharding.
    for t in (Format(None, NamedSharding(mesh, P("x"))), jax.device_put(keys, NamedSharding(mesh, P(None, "y")))):
        out = ckpt.restore(path, {"k": t})
        assert out["k"].sharding.is_equivalent_to(t.sharding, 2)
        data = jax.random.key_data(out["k"])
        for s in data.addressable_shards:
            assert np.array_equal(np.asarray(s.data), np.asarray(jax.random.key_data(keys))[s.index]), s.device


def test_orbax_and_safetensors_sources_restore_into_the_layout(tmp_path):
    import orbax.checkpoint as ocp
    import safetensors.numpy

    value = _value()
    fmt = Format(COL, NamedSharding(_mesh(), P("x", "y")))
    file = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": value}, file)
    _check(ckpt.restore(file, {"w": fmt})["w"], value, fmt)
    where = tmp_path / "orbax"
    saver = ocp.StandardCheckpointer()
    saver.save(where, {"w": jax.device_put(value, NamedSharding(_mesh(), P("x")))})
    saver.wait_until_finished()
    _check(ckpt.restore(str(where), {"w": fmt})["w"], value, fmt)
    sds = jax.ShapeDtypeStruct(value.shape, np.float32, sharding=fmt)
    _check(ckpt.restore(str(where), {"w": sds})["w"], value, fmt)
