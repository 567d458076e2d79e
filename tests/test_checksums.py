"""Chunk checksums end to end: recorded at save, checked by restore, and a damaged, truncated or
missing chunk is always an error naming the leaf, the chunk and the file. On local disk and on
memory:// (damage is done through the storage interface)."""

import uuid

import crc32c
import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt._format.records import MANIFEST_NAME
from support import BIG, PER_SHARD, chunk_object, copy_tree, crc32c_reference, flip_byte, storage_of, truncate


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _values():
    return {
        "w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 4,  # 8 chunks of (32, 8)
        "b": (np.arange(64 * 64) % 200 - 100).astype(ml_dtypes.bfloat16).reshape(64, 64),  # 4 of (64, 16)
    }


@pytest.fixture(scope="module")
def saved(module_location):
    mesh = _mesh()
    v = _values()
    tree = {"params": {"w": jax.device_put(v["w"], NamedSharding(mesh, P("data", "model"))),
                       "b": jax.device_put(v["b"], NamedSharding(mesh, P(None, "model")))}}
    path = module_location("ckpt")
    ckpt.save(path, tree, options=PER_SHARD)  # the tests damage chunk files of each shard
    return module_location, path


@pytest.fixture
def copy(saved):
    """A private copy of the saved checkpoint (object by object, through the storage API)."""
    loc, path = saved
    name = f"copy-{uuid.uuid4().hex[:8]}"
    copy_tree(loc.storage("ckpt"), loc.storage(name))
    yield loc(name)
    loc.storage(name).delete_tree("")


def _chunk(path, leaf, index):
    """(storage of the checkpoint, key of the chunk file, its location as messages name it)."""
    storage = storage_of(path)
    key = chunk_object(path, f"params/{leaf}", index)
    return storage, key, storage.where(key)


def test_reference_crc32c_matches_the_standard_check_value():
    assert crc32c_reference(b"123456789") == 0xE3069283  # RFC 3720 / the CRC catalogue


def test_recorded_checksums_are_the_crc32c_of_each_chunk_file_in_row_major_order(saved):
    loc, path = saved
    storage = storage_of(path)
    manifest = msgpack.unpackb(storage.get(MANIFEST_NAME, max_bytes=BIG), raw=False)
    zarr_leaves = {l["path"]: l["storage"] for l in manifest["leaves"] if l["storage"]["type"] == "zarr"}
    assert set(zarr_leaves) == {"params/w", "params/b"}
    grids = {"params/w": (2, 4), "params/b": (1, 4)}
    for leaf, st in zarr_leaves.items():
        assert st["checksum"] == "crc32c"
        files = [f"{st['path']}/c/{'/'.join(map(str, i))}" for i in np.ndindex(*grids[leaf])]
        assert len(st["chunk_checksums"]) == len(files)
        for recorded, name in zip(st["chunk_checksums"], files):
            data = storage.get(name, max_bytes=BIG)
            # Two independent implementations: the one ckpt uses, and one from the definition.
            assert crc32c.crc32c(data) == recorded
            assert crc32c_reference(data) == recorded


def test_intact_checkpoint_restores_with_verification(saved):
    out = ckpt.restore(saved[1])
    v = _values()
    assert np.array_equal(out["params"]["w"], v["w"])
    assert out["params"]["b"].dtype == ml_dtypes.bfloat16
    assert np.array_equal(out["params"]["b"].view(np.uint16), v["b"].view(np.uint16))


@pytest.mark.parametrize("leaf,chunk", [("w", (1, 2)), ("b", (0, 3))])
def test_flipped_byte_raises_checksum_error_naming_leaf_chunk_and_file(copy, leaf, chunk):
    storage, key, chunk_file = _chunk(copy, leaf, chunk)
    flip_byte(storage, key)
    with pytest.raises(ckpt.ChecksumError) as e:
        ckpt.restore(copy)
    assert e.value.leaf == f"params/{leaf}"
    assert e.value.chunk == chunk
    assert e.value.file == chunk_file
    assert f"params/{leaf}" in str(e.value) and str(list(chunk)) in str(e.value) and chunk_file in str(e.value)
    with pytest.raises(ckpt.ChecksumError):  # restoring onto a mesh reads, and checks, the same chunk
        ckpt.restore(copy, mesh=_mesh())


def test_restore_checks_only_the_chunks_it_reads(copy):
    storage, key, _ = _chunk(copy, "w", (1, 2))
    flip_byte(storage, key)
    mesh = _mesh()
    target = {"params": {"b": NamedSharding(mesh, P(None, "model"))}}
    out = ckpt.restore(copy, target, partial=True)  # never reads params/w
    want = _values()["b"]
    for s in out["params"]["b"].addressable_shards:
        assert np.array_equal(np.asarray(s.data).view(np.uint16), want[s.index].view(np.uint16))


def test_verify_false_skips_the_check_and_returns_the_damaged_bytes(copy):
    storage, key, _ = _chunk(copy, "w", (1, 2))
    flip_byte(storage, key, byte=100)
    out = ckpt.restore(copy, verify=False)
    expected = _values()["w"].copy()
    expected[32:64, 16:24] = np.frombuffer(storage.get(key, max_bytes=BIG), dtype="<f4").reshape(32, 8)
    assert np.array_equal(out["params"]["w"], expected)
    # Exactly the one element holding byte 100 of that chunk changed.
    changed = np.argwhere(out["params"]["w"] != _values()["w"])
    assert changed.tolist() == [[32 + 100 // 4 // 8, 16 + 100 // 4 % 8]]


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_chunk_is_an_error_naming_the_chunk(copy, verify):
    storage, key, chunk_file = _chunk(copy, "w", (0, 3))
    truncate(storage, key, 1000)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(copy, verify=verify)
    msg = str(e.value)
    # (32, 8) float32: 1024 bytes expected, 1000 found
    assert "params/w" in msg and "[0, 3]" in msg and chunk_file in msg and "1000" in msg and "1024" in msg


@pytest.mark.parametrize("verify", [True, False])
def test_overlong_chunk_is_an_error_naming_the_chunk(copy, verify):
    storage, key, chunk_file = _chunk(copy, "b", (0, 2))
    storage.put(key, storage.get(key, max_bytes=BIG) + b"junk").result()
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(copy, verify=verify)
    msg = str(e.value)
    # (64, 16) bfloat16: 2048 bytes expected, 2052 found (object stores say only "more than":
    # reads are bounded by the recorded size, so the rest is never read)
    assert "params/b" in msg and "[0, 2]" in msg and chunk_file in msg and "2048" in msg
    assert "2052" in msg or "holds more than the 2048 bytes expected" in msg


@pytest.mark.parametrize("verify", [True, False])
def test_missing_chunk_is_an_error_never_fill_values(copy, verify):
    storage, key, chunk_file = _chunk(copy, "b", (0, 1))
    storage.delete(key)
    assert not storage.exists(key)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(copy, verify=verify)
    msg = str(e.value)
    assert "params/b" in msg and "[0, 1]" in msg and chunk_file in msg and "missing" in msg
