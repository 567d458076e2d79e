"""Round-trip matrix: save meshes x PartitionSpecs x restore targets, every shard checked, on
local disk and on memory:// (the `module_location` fixture)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt
from support import PER_SHARD, chunk_object, keys, leaf_storage_path

SHAPE = (24, 96)  # divisible by 8, 4, 3 and 2, and above the inline limit


def _mesh(shape, names, devices=None):
    devs = np.array(devices if devices is not None else jax.devices()[: int(np.prod(shape))])
    return Mesh(devs.reshape(shape), names)


SAVE_CASES = {
    "8-sharded": ((8,), ("x",), P("x", None)),
    "8-sharded-dim1": ((8,), ("x",), P(None, "x")),
    "8-replicated": ((8,), ("x",), P()),
    "4x2-full": ((4, 2), ("x", "y"), P("x", "y")),
    "4x2-x-repl-y": ((4, 2), ("x", "y"), P("x", None)),
    "4x2-replicated": ((4, 2), ("x", "y"), P()),
    "2x2x2-full": ((2, 2, 2), ("x", "y", "z"), P("x", ("y", "z"))),
    "2x2x2-x-repl": ((2, 2, 2), ("x", "y", "z"), P(("x", "y"), None)),
    "2x2x2-replicated": ((2, 2, 2), ("x", "y", "z"), P()),
    "one-device": None,
}


def _value(seed):
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def _saved_sharding(case):
    spec = SAVE_CASES[case]
    if spec is None:
        return SingleDeviceSharding(jax.devices()[3])
    shape, names, pspec = spec
    return NamedSharding(_mesh(shape, names), pspec)


@pytest.fixture(scope="module")
def saved(module_location):
    """One checkpoint per save case, holding two arrays (so the tree has structure)."""
    out = {}
    for i, case in enumerate(SAVE_CASES):
        sharding = _saved_sharding(case)
        values = {"a": _value(2 * i), "b": {"c": _value(2 * i + 1)}}
        tree = jax.tree.map(lambda v: jax.device_put(v, sharding), values)
        path = module_location(case)
        ckpt.save(path, tree)
        out[case] = (path, values, sharding)
    return out


def _targets():
    devs = jax.devices()
    return {
        "same": None,  # filled with the saved sharding
        "mesh2x4": NamedSharding(_mesh((2, 4), ("x", "y")), P("x", "y")),
        "mesh2x4-swapped": NamedSharding(_mesh((2, 4), ("y", "x")), P("x", "y")),
        "mesh8": NamedSharding(_mesh((8,), ("d",)), P("d")),
        "mesh8-reversed-dim1": NamedSharding(_mesh((8,), ("d",), devs[::-1]), P(None, "d")),
        "mesh3": NamedSharding(_mesh((3,), ("d",)), P("d")),  # 8-row chunks cut across saved ones
        "mesh3-dim1": NamedSharding(_mesh((3,), ("d",), devs[5:8]), P(None, "d")),
        "one-device": SingleDeviceSharding(devs[6]),
    }


def assert_array_matches(restored, expected: np.ndarray, sharding=None):
    """Every addressable shard equals the expected values at its index."""
    assert isinstance(restored, jax.Array)
    assert restored.shape == expected.shape and restored.dtype == expected.dtype
    if sharding is not None:
        assert restored.sharding == sharding
    shards = restored.addressable_shards
    assert len(shards) == len(restored.sharding.addressable_devices)
    for s in shards:
        assert np.array_equal(np.asarray(s.data), expected[s.index]), f"shard on {s.device} at {s.index}"


@pytest.mark.parametrize("case", list(SAVE_CASES))
@pytest.mark.parametrize("target", list(_targets()))
def test_restore_onto_target_sharding(saved, case, target):
    path, values, saved_sharding = saved[case]
    sharding = _targets()[target] or saved_sharding
    as_sds = jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)
    # Three ways to say the same target: ShapeDtypeStruct, bare Sharding, and a jax.Array.
    tree = {"a": as_sds, "b": {"c": sharding}}
    out = ckpt.restore(path, tree)
    assert_array_matches(out["a"], values["a"], sharding)
    assert_array_matches(out["b"]["c"], values["b"]["c"], sharding)
    like = jax.device_put(np.zeros(SHAPE, np.float32), sharding)
    out = ckpt.restore(path, {"a": like, "b": {"c": like}})
    assert_array_matches(out["a"], values["a"], sharding)


@pytest.mark.parametrize("case", [c for c in SAVE_CASES if c != "one-device"])
def test_restore_with_mesh_keeps_saved_specs(saved, case):
    path, values, saved_sharding = saved[case]
    names = saved_sharding.mesh.axis_names
    # The same axis names on a different arrangement of the 8 devices.
    sizes = {"8": (8,), "4x2": (2, 4), "2x2x2": (2, 2, 2)}[case.split("-")[0]]
    mesh = _mesh(sizes, names, jax.devices()[::-1])
    out = ckpt.restore(path, mesh=mesh)
    want = NamedSharding(mesh, saved_sharding.spec)
    assert_array_matches(out["a"], values["a"], want)
    assert_array_matches(out["b"]["c"], values["b"]["c"], want)


def test_restore_with_mesh_from_one_device_is_replicated(saved):
    path, values, _ = saved["one-device"]
    mesh = _mesh((4, 2), ("x", "y"))
    out = ckpt.restore(path, mesh=mesh)
    assert_array_matches(out["a"], values["a"], NamedSharding(mesh, P()))


@pytest.mark.parametrize("case", list(SAVE_CASES))
def test_restore_as_numpy(saved, case):
    path, values, _ = saved[case]
    out = ckpt.restore(path)
    assert isinstance(out["a"], np.ndarray) and isinstance(out["b"]["c"], np.ndarray)
    assert np.array_equal(out["a"], values["a"]) and np.array_equal(out["b"]["c"], values["b"]["c"])


def test_restore_casts_dtype(saved):
    path, values, sharding = saved["4x2-full"]
    sds = jax.ShapeDtypeStruct(SHAPE, jax.numpy.bfloat16, sharding=sharding)
    out = ckpt.restore(path, {"a": sds, "b": {"c": sharding}})
    assert out["a"].dtype == jax.numpy.bfloat16
    assert_array_matches(out["a"], values["a"].astype(jax.numpy.bfloat16), sharding)


def test_partial_restore(saved):
    path, values, sharding = saved["4x2-full"]
    out = ckpt.restore(path, {"b": {"c": sharding}}, partial=True)
    assert list(out) == ["b"]
    assert_array_matches(out["b"]["c"], values["b"]["c"], sharding)


def test_only_needed_chunks_are_read(location):
    """One shard's region reads back after every other chunk file of the array is deleted
    (through the storage API; reads go through the reader restore uses); the whole array then
    fails naming a missing chunk."""
    mesh = _mesh((4, 2), ("x", "y"))
    value = _value(7)
    path = location("c")
    ckpt.save(path, {"w": jax.device_put(value, NamedSharding(mesh, P("x", "y")))}, options=PER_SHARD)
    storage = location.storage("c")
    chunk_dir = f"{leaf_storage_path(path, 'w')}/c"
    files = keys(storage, chunk_dir)
    assert len(files) == 8
    keep = chunk_object(path, "w", (1, 0))  # rows 6:12, columns 0:48
    assert keep in files
    for f in files:
        if f != keep:
            storage.delete(f)
    assert keys(storage, chunk_dir) == [keep]
    box = ((6, 12), (0, 48))
    regions, stats = ckpt._restore.read_regions(path, "w", [box])
    assert stats.chunks_read == 1 and stats.bytes_read == 6 * 48 * 4
    assert np.array_equal(regions[box], value[6:12, 0:48])
    # A region inside the kept chunk reads only that chunk too.
    inner = ((7, 9), (10, 20))
    regions, stats = ckpt._restore.read_regions(path, "w", [inner])
    assert stats.chunks_read == 1 and np.array_equal(regions[inner], value[7:9, 10:20])
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w', chunk \[0, 0\].*w/c/0/0") as e:
        ckpt.restore(path)
    assert storage.where(chunk_object(path, "w", (0, 0))) in str(e.value)
