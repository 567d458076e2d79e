"""Every dtype JAX has and every leaf kind, saved and restored bit for bit; custom nodes. On local
disk and on memory:// (the `location` fixture)."""

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from support import PER_SHARD, committed_generations, keys as stored_keys

DTYPES_32 = [
    "float32", "float16", "bfloat16", "int8", "int16", "int32", "uint8", "uint16", "uint32", "bool",
    "complex64", "int4", "uint4", "int2", "uint2",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
    "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float4_e2m1fn",
]
DTYPES_64 = ["float64", "int64", "uint64", "complex128"]


def _dtype(name):
    return jnp.dtype(name)


def _values(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    try:
        info = ml_dtypes.iinfo(dt)
        return rng.integers(int(info.min), int(info.max) + 1, shape).astype(dt)
    except (ValueError, TypeError):
        pass
    return (rng.standard_normal(shape) * 4).astype(dt)


def _bits(a):
    """Exact comparison, NaNs included: the underlying bytes."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype.itemsize >= 1 else a


def _check_restored(arr, expected, sharding):
    assert arr.dtype == expected.dtype, (arr.dtype, expected.dtype)
    assert arr.sharding == sharding
    for s in arr.addressable_shards:
        assert np.array_equal(_bits(np.asarray(s.data)), _bits(expected[s.index]))


def _roundtrip_dtypes(location, names):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", "y"))
    big = {n: _values(_dtype(n), (64, 128), i) for i, n in enumerate(names)}  # chunked Zarr arrays
    small = {n: _values(_dtype(n), (8, 4), 100 + i) for i, n in enumerate(names)}  # inline
    tree = {
        "big": {n: jax.device_put(v, sharding) for n, v in big.items()},
        "small": {n: jax.device_put(v, sharding) for n, v in small.items()},
    }
    ckpt.save(location("c"), tree, options=PER_SHARD)  # chunk shapes checked below
    out = ckpt.restore(location("c"), jax.tree.map(lambda a: a.sharding, tree))
    for n in names:
        _check_restored(out["big"][n], big[n], sharding)
        _check_restored(out["small"][n], small[n], sharding)
    host = ckpt.restore(location("c"))
    for n in names:
        assert host["big"][n].dtype == big[n].dtype
        assert np.array_equal(_bits(host["big"][n]), _bits(big[n]))
        assert np.array_equal(_bits(host["small"][n]), _bits(small[n]))
    meta = ckpt.metadata(location("c"))
    for n in names:
        assert meta["big"][n].dtype == big[n].dtype and meta["big"][n].shape == (64, 128)
        assert meta["big"][n].chunk_shape == (16, 64)
    return location("c"), big


def test_every_dtype_round_trips(location):
    _roundtrip_dtypes(location, DTYPES_32)


def test_64_bit_dtypes_round_trip(location):
    with jax.enable_x64(True):
        _roundtrip_dtypes(location, DTYPES_64)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_prng_keys_restore_as_keys(location, impl):
    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    keys = jax.device_put(jax.random.split(jax.random.key(3, impl=impl), 1024), sharding)
    single = jax.random.key(7, impl=impl)
    ckpt.save(location("c"), {"keys": keys, "single": single})
    out = ckpt.restore(location("c"), {"keys": sharding, "single": single})
    assert out["keys"].dtype == keys.dtype and jax.random.key_impl(out["keys"]) == jax.random.key_impl(keys)
    assert out["keys"].sharding == sharding
    for s in out["keys"].addressable_shards:
        want = np.asarray(jax.random.key_data(keys))[s.index]
        assert np.array_equal(np.asarray(jax.random.key_data(s.data)), want)
    assert np.array_equal(jax.random.key_data(out["single"]), jax.random.key_data(single))
    # The restored keys draw the same numbers.
    assert np.array_equal(jax.random.normal(out["single"], (4,)), jax.random.normal(single, (4,)))
    meta = ckpt.metadata(location("c"))
    assert meta["keys"].shape == (1024,) and meta["keys"].dtype == keys.dtype
    plain = ckpt.restore(location("c"))  # no target: typed keys too (they have no numpy form)
    assert plain["keys"].dtype == keys.dtype and jax.random.key_impl(plain["keys"]) == jax.random.key_impl(keys)
    assert np.array_equal(jax.random.key_data(plain["keys"]), jax.random.key_data(keys))
    assert np.array_equal(jax.random.key_data(plain["single"]), jax.random.key_data(single))
    mesh2 = jax.make_mesh((2, 4), ("y", "x"))
    on_mesh = ckpt.restore(location("c"), mesh=mesh2)
    assert on_mesh["keys"].sharding == NamedSharding(mesh2, P("x"))
    assert np.array_equal(jax.random.key_data(on_mesh["keys"]), jax.random.key_data(keys))


def test_host_leaf_kinds_round_trip(location):
    tree = {
        "np_big": np.arange(3000, dtype=np.float64).reshape(30, 100),
        "np_small": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_bf16": np.arange(4096, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "np_scalar": np.float32(2.5),
        "np_int_scalar": np.int64(-7),
        "int": 42,
        "big_int": 2**70 + 1,
        "neg": -(2**40),
        "float": 0.1,
        "bool": True,
        "complex": 1 + 2j,
        "str": "héllo/world",
        "bytes": b"\x00\x01",
        "none": None,
        "empty_dict": {},
        "empty_list": [],
        "empty_tuple": (),
        "nested": [1, (2.0, "x", None), {"k": [np.ones(3, np.uint8)]}],
        "zero_size": np.zeros((0, 5), np.float32),
    }
    ckpt.save(location("c"), tree)
    out = ckpt.restore(location("c"))
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(out)):
        assert type(a) is type(b), (jax.tree_util.keystr(path), type(a), type(b))
        if isinstance(a, (np.ndarray, np.generic)):
            assert a.dtype == b.dtype and np.shape(a) == np.shape(b)
            assert np.array_equal(a, b)
        else:
            assert a == b
    meta = ckpt.metadata(location("c"))
    assert meta["int"] == 42 and meta["str"] == "héllo/world" and meta["none"] is None
    assert meta["np_big"].shape == (30, 100) and meta["np_big"].chunk_shape == (30, 100)
    assert meta["np_small"].chunk_shape is None  # inline


class Layer(NamedTuple):
    w: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    step: int
    layers: list
    opt: dict


def _state(sharding):
    def put(seed, shape):
        return jax.device_put(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), sharding)

    return State(step=5, layers=[Layer(put(0, (32, 64)), put(1, (32, 64))), Layer(put(2, (32, 64)), put(3, (32, 64)))],
                 opt={"mu": put(4, (32, 64))})


def test_custom_nodes_come_back_as_themselves_with_a_target(location):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, P("x", "y"))
    state = _state(sharding)
    ckpt.save(location("c"), state)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                          if isinstance(a, jax.Array) else a, state)
    out = ckpt.restore(location("c"), target)
    assert isinstance(out, State) and isinstance(out.layers[0], Layer) and out.step == 5
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(state)):
        if isinstance(b, jax.Array):
            assert a.sharding == b.sharding
            for s in a.addressable_shards:
                assert np.array_equal(np.asarray(s.data), np.asarray(b)[s.index])
    # Without a target, custom nodes come back as dicts keyed by field name.
    host = ckpt.restore(location("c"))
    assert set(host) == {"step", "layers", "opt"} and host["step"] == 5
    assert set(host["layers"][1]) == {"w", "b"}
    assert np.array_equal(host["layers"][1]["b"], np.asarray(state.layers[1].b))


def test_odd_keys_get_safe_storage_paths(location):
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    v = {k: jax.device_put(np.full((64, 32), i, np.float32), sharding)
         for i, k in enumerate(["a/b", "..", ".hidden", "zarr.json", "", "ünï", "A", "a", "manifest.msgpack"])}
    tree = {"x": v, "ints": {7: v["A"], 10: v["a"]}}
    ckpt.save(location("c"), tree, options=PER_SHARD)  # every leaf its own Zarr directory
    out = ckpt.restore(location("c"))
    for i, k in enumerate(v):
        assert np.array_equal(out["x"][k], np.full((64, 32), i, np.float32)), k
    assert list(out["ints"]) == [7, 10]  # int keys stay ints
    assert np.array_equal(out["ints"][7], np.asarray(v["A"]))
    # No storage path component is empty, hidden, or a way out of the checkpoint.
    stored = stored_keys(location.storage("c"))
    assert len(stored) > 11 * 8
    for k in stored:
        for part in k.split("/"):
            assert part not in ("", ".", "..") and not part.startswith("."), k
    if location.kind == "local":
        for p in Path(location("c")).rglob("zarr.json"):
            assert p.resolve().is_relative_to(Path(location("c")).resolve())


def test_overwrite_replaces_atomically(location):
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    first = jax.device_put(np.ones((64, 16), np.float32), sharding)
    second = jax.device_put(np.full((64, 16), 2.0, np.float32), sharding)
    ckpt.save(location("c"), {"w": first})
    ckpt.save(location("c"), {"w": second, "extra": 1}, overwrite=True)
    out = ckpt.restore(location("c"))
    assert np.array_equal(out["w"], np.asarray(second)) and out["extra"] == 1
    assert location.names() == ["c"]  # no temporary directories left
    if location.kind == "memory":  # and only the new generation, next to the manifest
        assert location.names("c") == sorted(["manifest.msgpack", *committed_generations(location("c"))])
