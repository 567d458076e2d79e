"""Every array of a checkpoint opens with plain zarr-python 3 and plain TensorStore, no ckpt code,
and holds the saved bytes (logical dtype recorded in the array's attributes)."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tensorstore as ts
import zarr
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt

NAMES = ["float32", "bfloat16", "float16", "int4", "uint4", "int8", "uint32", "bool", "complex64",
         "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "int2"]


def _value(name, seed):
    dt = np.dtype(jnp.dtype(name))
    rng = np.random.default_rng(seed)
    if dt == np.bool_:
        return rng.integers(0, 2, (64, 128)).astype(bool)
    if dt.kind == "c":
        return (rng.standard_normal((64, 128)) + 1j).astype(dt)
    try:
        info = ml_dtypes.iinfo(dt)
        return rng.integers(int(info.min), int(info.max) + 1, (64, 128)).astype(dt)
    except (ValueError, TypeError):
        return rng.standard_normal((64, 128)).astype(dt)


def _logical(stored: np.ndarray, attrs: dict) -> np.ndarray:
    """What a user of stock tools does with the recorded logical dtype."""
    info = attrs["jax_ckpt"]
    logical = np.dtype(getattr(ml_dtypes, info["dtype"], None) or info["dtype"])
    if info["encoding"] == "bits":
        return stored.view(logical)
    return stored.astype(logical)


def test_every_array_opens_with_zarr_python_and_tensorstore(tmp_path):
    sharding = NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))
    values = {n: _value(n, i) for i, n in enumerate(NAMES)}
    ckpt.save(tmp_path / "c", {"params": {n: jax.device_put(v, sharding) for n, v in values.items()}},
              options=ckpt.Options(pack_limit_bytes=0))  # shard by shard (stacks: test_small_leaves.py)

    group = zarr.open_group(str(tmp_path / "c"), mode="r")
    arrays = dict(group["params"].arrays())
    assert set(arrays) == set(NAMES)
    for name, expected in values.items():
        z = arrays[name]
        assert z.chunks == (16, 64)
        from_zarr = _logical(z[...], dict(z.attrs))
        assert from_zarr.dtype == expected.dtype
        assert np.array_equal(from_zarr.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8)), name

        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / "params" / name)}}).result()
        attrs = json.loads((tmp_path / "c" / "params" / name / "zarr.json").read_text())["attributes"]
        from_ts = _logical(t.read().result(), attrs)
        assert np.array_equal(from_ts.view(np.uint8), np.ascontiguousarray(expected).view(np.uint8)), name


def test_zarr_python_reads_one_chunk_region(tmp_path):
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    ckpt.save(tmp_path / "c", {"w": jax.device_put(value, sharding)})
    z = zarr.open_array(str(tmp_path / "c" / "w"), mode="r")
    assert np.array_equal(z[8:16], value[8:16])
