"""Placement of restored leaves (ckpt/_restore/place.py): small leaves are placed with one batched
transfer per leaf (``make_array_from_callback``), not one ``device_put`` per device shard
(docs/benchmarks.md, "Many small leaves": 32,000 calls for 4,000 leaves on 8 devices was 6x
slower); large shards keep their own ``device_put`` (zero-copy adoption, the host budget).
Every addressable shard of every leaf is compared with the saved values."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt._restore import place


@pytest.fixture
def counted(monkeypatch):
    """Counts of the placement calls ckpt/_restore/place.py makes (the real functions still run;
    calls JAX makes inside them are not counted)."""
    calls = {"device_put": 0, "make_array_from_callback": 0, "batched_device_put": 0}

    def counting(name, real):
        def call(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") == place.__name__:
                calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(place.jax, "device_put", counting("device_put", jax.device_put))
    monkeypatch.setattr(place.jax, "make_array_from_callback",
                        counting("make_array_from_callback", jax.make_array_from_callback))
    if place._batched_device_put is not None:
        monkeypatch.setattr(place, "_batched_device_put", counting("batched_device_put", place._batched_device_put))
    return calls


def _batched(calls) -> int:
    """Leaves placed in one batched transfer: JAX's own batched put (place._put_together), or
    make_array_from_callback where that is the way."""
    return calls["batched_device_put"] + calls["make_array_from_callback"]


def _mesh():
    return jax.make_mesh((4, 2), ("x", "y"))


def _small_tree(mesh, n=24):
    rng = np.random.default_rng(3)
    specs = [P("x", "y"), P(), P("x"), P(None, "y"), P(("x", "y"))]
    values, tree = {}, {}
    for i in range(n):
        spec = specs[i % len(specs)]
        shape = (16, 8) if spec != P(("x", "y")) else (32,)
        values[f"l{i}"] = rng.standard_normal(shape).astype(np.float32)
        tree[f"l{i}"] = jax.device_put(values[f"l{i}"], NamedSharding(mesh, spec))
    return tree, values


def _check_every_shard(out, values, dtype=np.float32):
    for name, want in values.items():
        got = out[name]
        assert got.dtype == dtype, name
        assert len(got.addressable_shards) == 8, name
        for s in got.addressable_shards:
            assert np.array_equal(np.asarray(s.data), want[s.index].astype(dtype)), (name, s.device)


@pytest.mark.parametrize("kind", ["shape_dtype_struct", "sharding"])
def test_small_leaves_are_placed_in_one_batched_transfer_each(tmp_path, counted, kind):
    mesh = _mesh()
    tree, values = _small_tree(mesh)
    path = str(tmp_path / "c")
    ckpt.save(path, tree)
    if kind == "sharding":
        target = {k: v.sharding for k, v in tree.items()}
    else:
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    out = ckpt.restore(path, target)
    _check_every_shard(out, values)
    assert _batched(counted) == len(values) and counted["device_put"] == 0, counted


def test_a_cast_and_a_new_mesh_are_still_placed_in_batches(tmp_path, counted):
    mesh = _mesh()
    tree, values = _small_tree(mesh, n=10)
    path = str(tmp_path / "c")
    ckpt.save(path, tree)
    other = jax.make_mesh((2, 4), ("x", "y"))
    target = {k: jax.ShapeDtypeStruct(v.shape, np.float64 if jax.config.jax_enable_x64 else np.float16,
                                      sharding=NamedSharding(other, v.sharding.spec)) for k, v in tree.items()}
    dtype = np.float64 if jax.config.jax_enable_x64 else np.float16
    out = ckpt.restore(path, target)
    _check_every_shard(out, values, dtype)
    assert _batched(counted) == len(values) and counted["device_put"] == 0, counted


def test_large_shards_keep_their_own_device_put(tmp_path, counted):
    """A leaf whose shards are over BATCH_PUT_MAX_BYTES is placed shard by shard as it is read
    (so aligned buffers are adopted and the host budget gets them back at once)."""
    mesh = _mesh()
    rows = 4 * place.BATCH_PUT_MAX_BYTES // (256 * 4) * 4  # shards of 2x BATCH_PUT_MAX_BYTES
    value = np.arange(rows * 256, dtype=np.float32).reshape(rows, 256)
    path = str(tmp_path / "c")
    ckpt.save(path, {"big": jax.device_put(value, NamedSharding(mesh, P("x")))})
    out = ckpt.restore(path, {"big": NamedSharding(mesh, P("x"))})
    _check_every_shard(out, {"big": value})
    assert counted["device_put"] == 8 and _batched(counted) == 0, counted


def test_a_leaf_large_against_the_budget_is_not_held_whole(tmp_path):
    """With a budget that a leaf's shards together would strain, they are not held for a
    batched transfer: the reader stays within its budget and every shard is right."""
    from ckpt._restore import restore_with_stats

    mesh = _mesh()
    value = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)  # 512 KiB in 16 KiB chunks
    path = str(tmp_path / "c")
    ckpt.save(path, {"w": jax.device_put(value, NamedSharding(mesh, P("x", "y")))}, max_chunk_bytes=16 * 1024)
    out, stats = restore_with_stats(path, {"w": NamedSharding(mesh, P("x", "y"))}, host_budget_bytes=128 * 1024)
    _check_every_shard(out, {"w": value})
    assert 0 < stats.host_high_water <= 128 * 1024, stats


@pytest.mark.parametrize("spec", [P("x", "y"), P(), P("x"), P(None, "y"), P(("x", "y"))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool", "uint32"])
def test_the_batched_put_makes_what_make_array_from_callback_makes(spec, dtype):
    """place._put_together (JAX's batched transfer, bookkeeping shared by leaves of one kind)
    against jax.make_array_from_callback itself: the same values on the same devices, the same
    sharding, committed; and it takes the fast way for every ordinary dtype."""
    import ml_dtypes

    mesh = _mesh()
    sharding = NamedSharding(mesh, spec)
    shape = (16, 8) if spec != P(("x", "y")) else (32,)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    host = (np.arange(np.prod(shape)) % 7).reshape(shape).astype(np_dtype)
    from ckpt._geometry import index_to_box
    fast_calls = []
    real = place._batched_device_put
    assert real is not None  # the JAX of both test environments has it
    try:
        place._batched_device_put = lambda *a: fast_calls.append(1) or real(*a)
        got = place._put_together(shape, sharding, None, host.dtype, lambda index, box: host[index])
    finally:
        place._batched_device_put = real
    want = jax.make_array_from_callback(shape, sharding, lambda index: host[index])
    assert fast_calls == [1]
    assert got.sharding == want.sharding and got.committed and got.dtype == want.dtype and got.shape == want.shape
    assert [s.device for s in got.addressable_shards] == [s.device for s in want.addressable_shards]
    for a, b in zip(got.addressable_shards, want.addressable_shards):
        assert a.index == b.index and np.array_equal(np.asarray(a.data), np.asarray(b.data))
    assert np.array_equal(np.asarray(got), host)
    # The index and the box it passes name the same region of the leaf.
    seen = []
    place._put_together(shape, sharding, None, host.dtype, lambda index, box: seen.append(
        index_to_box(index, shape) == box) or host[index])
    assert seen and all(seen)


def test_the_batched_put_leaves_what_it_does_not_cover_to_make_array_from_callback():
    """A shard of another shape or dtype than the sharding asks for (never made by the reader,
    but the guard is what keeps a mistake from reaching JAX's unchecked path) goes through
    make_array_from_callback, which refuses it in its own words."""
    mesh = _mesh()
    sharding = NamedSharding(mesh, P("x", "y"))
    host = np.zeros((16, 8), np.float32)
    with pytest.raises(ValueError):
        place._put_together((16, 8), sharding, None, host.dtype, lambda index, box: host)  # whole, not the shard
