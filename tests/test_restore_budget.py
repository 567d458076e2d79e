"""Restore keeps the library's host memory within host_budget_bytes (issue 10).

The reader counts every host buffer it allocates (chunks read, trimmed edge chunks, assembled
regions, dtype conversions) where it allocates it, in a HostBudget whose high-water mark
restore_with_stats reports. Not counted, by design (docs/memory.md): a numpy result the caller
asked for, and device memory (on these CPU devices, device memory is host memory).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import ckpt
from ckpt._restore import restore_with_stats

BUDGET = 48 << 10
CHUNK = 8 << 10  # chunks well below the budget, shards above it


def _save(location, tree, **options):
    ckpt.save(location("c"), tree, options=ckpt.Options(max_chunk_bytes=CHUNK, **options))
    return location("c")


def _big(shape=(512, 256)):
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape)


def _check_shards(arr, value):
    assert arr.shape == value.shape
    for s in arr.addressable_shards:
        assert np.array_equal(np.asarray(s.data), value[s.index]), s.device


def _within(stats, budget=BUDGET):
    assert stats.host_budget == budget
    assert 0 < stats.host_high_water <= budget, stats.host_high_water


@pytest.fixture(params=["in place", "on device"])
def fill(request, monkeypatch):
    """Both ways a shard larger than the budget is filled: in a host buffer the CPU device then
    adopts, and the accelerators' way (each piece updated into a device buffer)."""
    from ckpt._restore import place as _place

    monkeypatch.setattr(_place, "FILL_CPU_SHARDS_IN_PLACE", request.param == "in place")
    return request.param


def test_an_array_many_times_the_budget_restores_shard_by_shard(location, fill):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    s = NamedSharding(mesh, P("x", "y"))
    value = _big()  # 512 KiB: 10x the budget; each device's shard (64 KiB) is over it too
    path = _save(location, {"w": jax.device_put(value, s)})
    out, stats = restore_with_stats(path, {"w": s}, host_budget_bytes=BUDGET)
    _check_shards(out["w"], value)
    _within(stats)
    assert stats.bytes_read == value.nbytes  # streamed in chunk-aligned pieces: no chunk read twice


@pytest.mark.parametrize("target", ["same", "one device"])
def test_a_budget_of_about_one_chunk_streams_chunk_by_chunk(location, target, fill):
    """Each piece placed is one whole chunk, put on the device as read (no host copy)."""
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    s = NamedSharding(mesh, P("x", "y"))
    value = _big()
    path = _save(location, {"w": jax.device_put(value, s)})
    t = s if target == "same" else SingleDeviceSharding(jax.devices()[5])
    budget = CHUNK + CHUNK // 2
    out, stats = restore_with_stats(path, {"w": t}, host_budget_bytes=budget)
    _check_shards(out["w"], value)
    _within(stats, budget)
    assert stats.bytes_read == value.nbytes


def test_reshard_4x2_to_2x4_within_the_budget(location):
    value = _big()
    saved = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))
    path = _save(location, {"w": jax.device_put(value, saved)})
    target = NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("x", "y"))
    out, stats = restore_with_stats(path, {"w": target}, host_budget_bytes=BUDGET)
    _check_shards(out["w"], value)
    _within(stats)
    assert stats.bytes_read <= 1.1 * value.nbytes


def test_reshard_with_a_dtype_cast_counts_the_converted_copy(location):
    value = _big()
    saved = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))
    path = _save(location, {"w": jax.device_put(value, saved)})
    target = NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P(None, "y"))
    want = jax.ShapeDtypeStruct(value.shape, jnp.bfloat16, sharding=target)
    out, stats = restore_with_stats(path, {"w": want}, host_budget_bytes=BUDGET)
    assert out["w"].dtype == jnp.bfloat16
    _check_shards(out["w"], value.astype(ml_dtypes.bfloat16))
    _within(stats)


def test_onto_one_device_within_the_budget(location):
    value = _big()
    saved = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))
    path = _save(location, {"w": jax.device_put(value, saved)})
    one = SingleDeviceSharding(jax.devices()[3])
    out, stats = restore_with_stats(path, {"w": one}, host_budget_bytes=BUDGET)
    assert out["w"].sharding == one
    _check_shards(out["w"], value)
    _within(stats)


@pytest.mark.parametrize("as_", ["numpy target", "no target"])
def test_as_numpy_the_result_is_not_transient_memory(location, as_):
    value = _big()
    saved = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))
    path = _save(location, {"w": jax.device_put(value, saved)})
    target = {"w": np.zeros_like(value)} if as_ == "numpy target" else None
    out, stats = restore_with_stats(path, target, host_budget_bytes=BUDGET)
    assert isinstance(out["w"], np.ndarray) and np.array_equal(out["w"], value)
    _within(stats)


def test_stacked_small_leaves_within_the_budget(location):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    s = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(0)
    values = {f"l{i}": rng.standard_normal((16, 16)).astype(np.float32) for i in range(40)}  # 1 KiB each
    values["big"] = _big((256, 128))
    path = _save(location, {k: jax.device_put(v, s) for k, v in values.items()})
    target = {k: NamedSharding(mesh, P(None, "y")) for k in values}
    out, stats = restore_with_stats(path, target, host_budget_bytes=BUDGET)
    for k, v in values.items():
        _check_shards(out[k], v)
    _within(stats)


def test_the_keyword_of_restore_overrides_options(location):
    value = _big((128, 128))
    s = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))
    path = _save(location, {"w": jax.device_put(value, s)})
    opts = ckpt.Options(host_budget_bytes=1 << 30)
    out = ckpt.restore(path, {"w": s}, options=opts, host_budget_bytes=BUDGET)
    _check_shards(out["w"], value)
    _, stats = restore_with_stats(path, {"w": s}, options=opts, host_budget_bytes=BUDGET)
    _within(stats)
    _, stats = restore_with_stats(path, {"w": s}, options=opts)
    assert stats.host_budget == 1 << 30
    out, stats = restore_with_stats(path, {"w": s}, host_budget_bytes="unlimited")
    _check_shards(out["w"], value)
    assert stats.host_budget > 1 << 60


def test_a_chunk_larger_than_the_budget_is_read_once(location):
    """The smallest piece a restore reads is one chunk: with a budget below it the restore
    still succeeds, reading each chunk once for all the regions that need it."""
    value = _big((256, 256))
    s = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))
    path = _save(location, {"w": jax.device_put(value, s)})  # 8 KiB chunks
    target = NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("x", "y"))
    out, stats = restore_with_stats(path, {"w": target}, host_budget_bytes=4 << 10)
    _check_shards(out["w"], value)
    assert stats.bytes_read == value.nbytes
