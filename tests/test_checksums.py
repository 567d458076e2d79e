"""Chunk checksums end to end: recorded at save, checked by restore, and a damaged, truncated or
missing chunk is always an error naming the leaf, the chunk and the file."""

import os
import shutil

import crc32c
import google_crc32c
import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _values():
    return {
        "w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 4,  # 8 chunks of (32, 8)
        "b": (np.arange(64 * 64) % 200 - 100).astype(ml_dtypes.bfloat16).reshape(64, 64),  # 4 of (64, 16)
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    mesh = _mesh()
    v = _values()
    tree = {"params": {"w": jax.device_put(v["w"], NamedSharding(mesh, P("data", "model"))),
                       "b": jax.device_put(v["b"], NamedSharding(mesh, P(None, "model")))}}
    path = str(tmp_path_factory.mktemp("checksums") / "ckpt")
    ckpt.save(path, tree)
    return path


@pytest.fixture
def copy(saved, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved, dst)
    return dst


def _flip(path, byte=100):
    with open(path, "r+b") as f:
        f.seek(byte)
        b = f.read(1)
        f.seek(byte)
        f.write(bytes([b[0] ^ 0x10]))


def test_recorded_checksums_are_the_crc32c_of_each_chunk_file_in_row_major_order(saved):
    with open(os.path.join(saved, "manifest.msgpack"), "rb") as f:
        manifest = msgpack.unpackb(f.read(), raw=False)
    zarr_leaves = {l["path"]: l["storage"] for l in manifest["leaves"] if l["storage"]["type"] == "zarr"}
    assert set(zarr_leaves) == {"params/w", "params/b"}
    grids = {"params/w": (2, 4), "params/b": (1, 4)}
    for path, st in zarr_leaves.items():
        assert st["checksum"] == "crc32c"
        files = [os.path.join(saved, st["path"], "c", *map(str, i)) for i in np.ndindex(*grids[path])]
        assert len(st["chunk_checksums"]) == len(files)
        for recorded, name in zip(st["chunk_checksums"], files):
            with open(name, "rb") as f:
                data = f.read()
            # Two independent implementations: the one ckpt uses and the one zarr's crc32c codec uses.
            assert crc32c.crc32c(data) == recorded
            assert int.from_bytes(google_crc32c.Checksum(data).digest(), "big") == recorded


def test_intact_checkpoint_restores_with_verification(saved):
    out = ckpt.restore(saved)
    v = _values()
    assert np.array_equal(out["params"]["w"], v["w"])
    assert out["params"]["b"].dtype == ml_dtypes.bfloat16
    assert np.array_equal(out["params"]["b"].view(np.uint16), v["b"].view(np.uint16))


@pytest.mark.parametrize("leaf,chunk", [("w", (1, 2)), ("b", (0, 3))])
def test_flipped_byte_raises_checksum_error_naming_leaf_chunk_and_file(copy, leaf, chunk):
    chunk_file = os.path.join(copy, "params", leaf, "c", *map(str, chunk))
    _flip(chunk_file)
    with pytest.raises(ckpt.ChecksumError) as e:
        ckpt.restore(copy)
    assert e.value.leaf == f"params/{leaf}"
    assert e.value.chunk == chunk
    assert e.value.file == chunk_file
    assert f"params/{leaf}" in str(e.value) and str(list(chunk)) in str(e.value) and chunk_file in str(e.value)
    with pytest.raises(ckpt.ChecksumError):  # restoring onto a mesh reads, and checks, the same chunk
        ckpt.restore(copy, mesh=_mesh())


def test_restore_checks_only_the_chunks_it_reads(copy):
    _flip(os.path.join(copy, "params", "w", "c", "1", "2"))
    mesh = _mesh()
    target = {"params": {"b": NamedSharding(mesh, P(None, "model"))}}
    out = ckpt.restore(copy, target, partial=True)  # never reads params/w
    assert np.array_equal(np.asarray(out["params"]["b"]).view(np.uint16), _values()["b"].view(np.uint16))


def test_verify_false_skips_the_check_and_returns_the_damaged_bytes(copy):
    chunk_file = os.path.join(copy, "params", "w", "c", "1", "2")
    _flip(chunk_file, byte=100)
    out = ckpt.restore(copy, verify=False)
    expected = _values()["w"].copy()
    with open(chunk_file, "rb") as f:
        expected[32:64, 16:24] = np.frombuffer(f.read(), dtype="<f4").reshape(32, 8)
    assert np.array_equal(out["params"]["w"], expected)
    # Exactly the one element holding byte 100 of that chunk changed.
    changed = np.argwhere(out["params"]["w"] != _values()["w"])
    assert changed.tolist() == [[32 + 100 // 4 // 8, 16 + 100 // 4 % 8]]


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_chunk_is_an_error_naming_the_chunk(copy, verify):
    chunk_file = os.path.join(copy, "params", "w", "c", "0", "3")
    with open(chunk_file, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(copy, verify=verify)
    msg = str(e.value)
    assert "params/w" in msg and "[0, 3]" in msg and chunk_file in msg


@pytest.mark.parametrize("verify", [True, False])
def test_missing_chunk_is_an_error_never_fill_values(copy, verify):
    chunk_file = os.path.join(copy, "params", "b", "c", "0", "1")
    os.remove(chunk_file)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(copy, verify=verify)
    msg = str(e.value)
    assert "params/b" in msg and "[0, 1]" in msg and chunk_file in msg
