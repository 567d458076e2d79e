"""Dtype casts on restore (issue 25, item 11): a target dtype other than the saved one casts, but
a cast that can change values beyond rounding is refused, naming the leaf, unless
``allow_lossy_cast=True``. By kind, whatever the values: float or complex to an integer or bool,
complex to real, a number to bool. By value: an integer to a narrower integer (or signed <->
unsigned) where a value does not fit, and any cast to a float or complex type where a finite value
would become infinite (or NaN). Float widening and narrowing, int -> float and bool -> number
are rounding at most, and pass. Values are compared on every restored shard."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt
from ckpt._restore import restore_with_stats


def _mesh():
    return jax.make_mesh((4, 2), ("x", "y"))


def _shards_equal(arr, want: np.ndarray) -> None:
    assert arr.dtype == want.dtype
    assert len(arr.addressable_shards) == len(arr.sharding.device_set)
    for s in arr.addressable_shards:
        got = np.asarray(s.data)
        assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(want[s.index]).view(np.uint8)), s.device


def _save(tmp_path, values: dict, sharded=True) -> str:
    mesh = _mesh()
    tree = {k: jax.device_put(v, NamedSharding(mesh, P("x"))) if sharded and v.ndim else v for k, v in values.items()}
    path = str(tmp_path / "c")
    ckpt.save(path, tree)
    return path


def _target(kind: str, shape, dtype):
    if kind == "numpy":
        return np.zeros(shape, dtype)
    spec = P(None, "y") if len(shape) > 1 else P("y")
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(_mesh(), spec))


def _as_result(kind, out, want):
    if kind == "numpy":
        assert isinstance(out, np.ndarray) and out.dtype == want.dtype
        assert np.array_equal(out.view(np.uint8), want.view(np.uint8))
    else:
        _shards_equal(out, want)


FLOATS = np.array([[2047.0, 1.5, -3.25, 0.0], [-129.0, 127.0, 255.0, 1e-3]] * 4, np.float32)


@pytest.mark.parametrize("kind", ["numpy", "sharded"])
def test_float_to_int8_is_refused_naming_the_leaf(tmp_path, kind):
    path = _save(tmp_path, {"w": FLOATS})
    # Before this was refused, 2047.0 came back as -1.
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w'.*float32.*int8.*allow_lossy_cast"):
        ckpt.restore(path, {"w": _target(kind, FLOATS.shape, np.int8)})
    # Even where every value would fit: float -> int is refused by kind.
    small = {"v": np.arange(32, dtype=np.float32).reshape(8, 4) * 2}
    path2 = _save(tmp_path / "b", small)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'v'.*float32.*int32.*allow_lossy_cast"):
        ckpt.restore(path2, {"v": _target(kind, (8, 4), np.int32)})


@pytest.mark.parametrize("kind", ["numpy", "sharded"])
def test_allow_lossy_cast_casts_as_numpy_does(tmp_path, kind):
    path = _save(tmp_path, {"w": FLOATS})
    with np.errstate(invalid="ignore", over="ignore"):
        want = FLOATS.astype(np.int8)
    out = ckpt.restore(path, {"w": _target(kind, FLOATS.shape, np.int8)}, allow_lossy_cast=True)
    _as_result(kind, out["w"], want)
    out, _ = restore_with_stats(path, {"w": _target(kind, FLOATS.shape, np.int8)}, allow_lossy_cast=True)
    _as_result(kind, out["w"], want)


@pytest.mark.parametrize("kind", ["numpy", "sharded"])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float64])
def test_float_widening_and_narrowing_pass(tmp_path, kind, dtype):
    if dtype == np.float64 and kind == "sharded" and not jax.config.jax_enable_x64:
        dtype = np.float32  # a device array of float64 needs x64
    path = _save(tmp_path, {"w": FLOATS})
    out = ckpt.restore(path, {"w": _target(kind, FLOATS.shape, dtype)})
    _as_result(kind, out["w"], FLOATS.astype(dtype))


@pytest.mark.parametrize("kind", ["numpy", "sharded"])
def test_float_overflow_to_inf_is_refused(tmp_path, kind):
    values = FLOATS.copy()
    values[5, 2] = 1e5  # beyond float16's 65504
    path = _save(tmp_path, {"w": values})
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w'.*float16"):
        ckpt.restore(path, {"w": _target(kind, values.shape, np.float16)})
    with np.errstate(over="ignore"):
        want = values.astype(np.float16)
    out = ckpt.restore(path, {"w": _target(kind, values.shape, np.float16)}, allow_lossy_cast=True)
    _as_result(kind, out["w"], want)
    # Infinities and NaNs saved as such stay what they are: no refusal.
    values[5, 2], values[0, 0], values[1, 1] = np.inf, -np.inf, np.nan
    path = _save(tmp_path / "b", {"w": values})
    out = ckpt.restore(path, {"w": _target(kind, values.shape, np.float16)})
    _as_result(kind, out["w"], values.astype(np.float16))
    # float8 without infinities: an overflow becomes NaN, refused too.
    path = _save(tmp_path / "c", {"w": FLOATS * 1000})
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w'.*float8_e4m3fn"):
        ckpt.restore(path, {"w": _target(kind, FLOATS.shape, ml_dtypes.float8_e4m3fn)})


@pytest.mark.parametrize("kind", ["numpy", "sharded"])
def test_integer_narrowing_by_value(tmp_path, kind):
    fits = np.array([[-(2**31), 2**31 - 1, 0, 7]] * 8, np.int64)
    over = fits.copy()
    over[3, 1] = 2**31
    path = _save(tmp_path, {"fits": fits, "over": over}, sharded=False)
    out = ckpt.restore(path, {"fits": _target(kind, fits.shape, np.int32)}, partial=True)
    _as_result(kind, out["fits"], fits.astype(np.int32))
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'over'.*int64.*int32.*2147483648"):
        ckpt.restore(path, {"over": _target(kind, over.shape, np.int32)}, partial=True)
    out = ckpt.restore(path, {"over": _target(kind, over.shape, np.int32)}, partial=True, allow_lossy_cast=True)
    _as_result(kind, out["over"], over.astype(np.int32))


@pytest.mark.parametrize("kind", ["numpy", "sharded"])
def test_signed_unsigned_by_value(tmp_path, kind):
    pos = np.arange(32, dtype=np.int32).reshape(8, 4)
    neg = pos - 3
    big = (pos.astype(np.uint32) + np.uint32(2**31))
    path = _save(tmp_path, {"pos": pos, "neg": neg, "big": big})
    out = ckpt.restore(path, {"pos": _target(kind, pos.shape, np.uint32), "neg": _target(kind, neg.shape, np.int32),
                              "big": _target(kind, big.shape, np.uint32)})
    _as_result(kind, out["pos"], pos.astype(np.uint32))
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'neg'.*-3"):
        ckpt.restore(path, {"neg": _target(kind, neg.shape, np.uint32)}, partial=True)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'big'"):
        ckpt.restore(path, {"big": _target(kind, big.shape, np.int32)}, partial=True)
    out = ckpt.restore(path, {"pos": _target(kind, pos.shape, np.int8)}, partial=True)
    _as_result(kind, out["pos"], pos.astype(np.int8))


@pytest.mark.parametrize("kind", ["numpy", "sharded"])
def test_bool_complex_and_int_to_float(tmp_path, kind):
    flags = (np.arange(32).reshape(8, 4) % 3 == 0)
    ints = np.arange(32, dtype=np.int32).reshape(8, 4) * 3000  # up to 93,000: beyond float16
    comp = (np.arange(32).reshape(8, 4) + 1j).astype(np.complex64)
    path = _save(tmp_path, {"flags": flags, "ints": ints, "comp": comp, "ones": np.ones((8, 4), np.int32)})
    # bool -> number and int -> float: exact or rounding.
    out = ckpt.restore(path, {"flags": _target(kind, flags.shape, np.int32),
                              "ints": _target(kind, ints.shape, ml_dtypes.bfloat16)}, partial=True)
    _as_result(kind, out["flags"], flags.astype(np.int32))
    _as_result(kind, out["ints"], ints.astype(ml_dtypes.bfloat16))
    # int -> float16 beyond its range: refused.
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'ints'.*float16"):
        ckpt.restore(path, {"ints": _target(kind, ints.shape, np.float16)}, partial=True)
    # complex -> real, and a number -> bool: refused by kind (even ones, which would be exact).
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'comp'.*complex64.*float32"):
        ckpt.restore(path, {"comp": _target(kind, comp.shape, np.float32)}, partial=True)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'ones'.*bool"):
        ckpt.restore(path, {"ones": _target(kind, (8, 4), np.bool_)}, partial=True)
    with np.errstate(all="ignore"):
        out = ckpt.restore(path, {"comp": _target(kind, comp.shape, np.float32),
                                  "ones": _target(kind, (8, 4), np.bool_)}, partial=True, allow_lossy_cast=True)
    _as_result(kind, out["comp"], comp.real.astype(np.float32))
    _as_result(kind, out["ones"], np.ones((8, 4), bool))


def test_device_placement_does_not_wrap_64_bit_integers(tmp_path):
    """Without x64, a device array holds int32: a saved int64 value that does not fit is refused
    instead of wrapping on its way to the device (2**40 -> 0), also for a bare sharding target."""
    narrow = jax.dtypes.canonicalize_dtype(np.int64)
    values = np.array([2**40, 1, 2, 3], np.int64)
    path = _save(tmp_path, {"step": values, "ok": np.arange(4, dtype=np.int64)}, sharded=False)
    one = SingleDeviceSharding(jax.devices()[0])
    for t in (one, jax.ShapeDtypeStruct((4,), np.int64, sharding=one)):
        if narrow == np.int64:  # x64: a device holds int64, nothing is narrowed
            _shards_equal(ckpt.restore(path, {"step": t}, partial=True)["step"], values)
            continue
        with pytest.raises(ckpt.CheckpointError, match=r"leaf 'step'.*int64.*int32"):
            ckpt.restore(path, {"step": t}, partial=True)
    out = ckpt.restore(path, {"ok": one}, partial=True)
    _shards_equal(out["ok"], np.arange(4, dtype=narrow))
    # asked for: as jax itself would place it.
    out = ckpt.restore(path, {"step": one}, partial=True, allow_lossy_cast=True)
    _shards_equal(out["step"], values.astype(narrow))


def test_a_streamed_shard_is_checked_in_every_piece(tmp_path):
    """A shard larger than the host budget is converted piece by piece: an overflow in a late
    piece is refused too."""
    rows = 512
    values = np.ones((rows, 1024), np.int64)
    values[-1, -1] = 2**40
    path = str(tmp_path / "c")
    ckpt.save(path, {"w": values}, options=ckpt.Options(max_chunk_bytes=64 << 10))
    one = SingleDeviceSharding(jax.devices()[1])
    target = {"w": jax.ShapeDtypeStruct(values.shape, np.int32, sharding=one)}
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w'.*int64.*int32"):
        restore_with_stats(path, target, host_budget_bytes=1 << 20)
    values[-1, -1] = 5
    path = str(tmp_path / "d")
    ckpt.save(path, {"w": values}, options=ckpt.Options(max_chunk_bytes=64 << 10))
    out, _ = restore_with_stats(path, target, host_budget_bytes=1 << 20)
    _shards_equal(out["w"], values.astype(np.int32))


def test_safetensors_and_orbax_sources_apply_the_same_rule(tmp_path):
    import safetensors.numpy

    file = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": FLOATS}, file)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w'.*int8"):
        ckpt.restore(file, {"w": _target("sharded", FLOATS.shape, np.int8)})
    out = ckpt.restore(file, {"w": _target("sharded", FLOATS.shape, np.int8)}, allow_lossy_cast=True)
    with np.errstate(invalid="ignore", over="ignore"):
        _shards_equal(out["w"], FLOATS.astype(np.int8))
    out = ckpt.restore(file, {"w": _target("sharded", FLOATS.shape, np.float16)})
    _shards_equal(out["w"], FLOATS.astype(np.float16))

    import orbax.checkpoint as ocp

    where = tmp_path / "orbax"
    saver = ocp.StandardCheckpointer()
    saver.save(where, {"w": jax.device_put(FLOATS, NamedSharding(_mesh(), P("x")))})
    saver.wait_until_finished()
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w'.*int8"):
        ckpt.restore(str(where), {"w": _target("sharded", FLOATS.shape, np.int8)})
    out = ckpt.restore(str(where), {"w": _target("sharded", FLOATS.shape, np.int8)}, allow_lossy_cast=True)
    with np.errstate(invalid="ignore", over="ignore"):
        _shards_equal(out["w"], FLOATS.astype(np.int8))
    out = ckpt.restore(str(where), {"w": _target("sharded", FLOATS.shape, ml_dtypes.bfloat16)})
    _shards_equal(out["w"], FLOATS.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("item", [None, "params"])
def test_the_manager_applies_the_same_rule_and_passes_the_option(tmp_path, item):
    values = np.array([0.5, 2047.0, -3.25], np.float32)
    with ckpt.CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        mgr.save(1, {"params": {"w": values}})
        target = {"w": np.zeros(3, np.int8)} if item else {"params": {"w": np.zeros(3, np.int8)}}
        with pytest.raises(ckpt.CheckpointError, match=r"params/w.*allow_lossy_cast=True"):
            mgr.restore(1, target, item=item)
        out = mgr.restore(1, target, item=item, allow_lossy_cast=True)
    got = out["w"] if item else out["params"]["w"]
    assert got.dtype == np.int8 and np.array_equal(got, values.astype(np.int8))
