"""The packed layout (format version 3, formats/SPEC.md section 13) end to end in one process:
saves with ``Options(layout="packed")`` on every engine restore every shard exactly, write a few
data objects and no Zarr files, and damage, faults and budgets behave as in the files layout.
Multi-process saves (where the layout is the default) are in test_multihost*.py, test_scale.py
and the golden checkpoint of tests/test_format.py."""

from __future__ import annotations

import glob
import os

import jax
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt._format import INDEX_DTYPE
from support import Faults, flip_byte, manifest_of, storage_of, truncate


def _mesh(shape=(4, 2)):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("a", "b"))


def _tree(seed: int = 0):
    mesh = _mesh()
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((256, 96)).astype(np.float32)
    e = rng.standard_normal((64, 40)).astype(jax.numpy.bfloat16)
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))),  # 8 chunks of 64 x 48
        "e": jax.device_put(e, NamedSharding(mesh, P(None, "b"))),  # replicated over a: 2 chunks
        "n": np.arange(3000, dtype=np.int64) * (seed + 1),  # numpy, one chunk
        "small": [np.full(1500, i + seed, np.float32) for i in range(5)],  # a stack
        "tiny": np.float32(seed),  # inline
        "step": seed,
    }


def _check(out, tree) -> int:
    """Every leaf and every shard of `out` equals `tree`'s; returns the shards compared."""
    n = 0
    for (path, got), (_, want) in zip(jax.tree_util.tree_flatten_with_path(out)[0],
                                      jax.tree_util.tree_flatten_with_path(tree)[0]):
        if isinstance(got, jax.Array):
            for s in got.addressable_shards:
                assert np.array_equal(np.asarray(s.data), np.asarray(want)[s.index]), (path, s.index)
                n += 1
        else:
            assert np.array_equal(np.asarray(got), np.asarray(want)), path
            n += 1
    return n


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


ENGINES = {"local": {}, "tensorstore": {"engine": "tensorstore"}, "fsspec": {"engine": "fsspec"}}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_packed_save_restores_every_shard_on_every_engine(tmp_path, engine):
    path = str(tmp_path / "c")
    tree = _tree()
    options = ckpt.Options(layout="packed", **ENGINES[engine])
    ckpt.save(path, tree, options=options)
    files = _files(path)
    data = [f for f in files if "/~data/" in f or f.startswith("~data/")]
    assert data and all(os.path.basename(f).startswith("0.") for f in data), files
    assert not any(f.endswith("zarr.json") or "/c/" in f for f in files), files  # no Zarr files
    assert len(files) == len(data) + 2  # + its index object and the manifest
    manifest = msgpack.unpackb(open(os.path.join(path, "manifest.msgpack"), "rb").read(), strict_map_key=False)
    assert manifest["format_version"] == 3 and len(manifest["packed"]["indexes"]) == 1
    for mesh in (_mesh((4, 2)), _mesh((2, 4)), None):  # the saved mesh, another, and numpy
        out = ckpt.restore(path, mesh=mesh, options=options) if mesh is not None else ckpt.restore(path, options=options)
        assert _check(out, tree) >= 10


def test_packed_save_to_memory_and_metadata():
    path = "memory://packed-layout/c"
    tree = _tree(3)
    ckpt.save(path, tree, options=ckpt.Options(layout="packed"))
    assert _check(ckpt.restore(path, mesh=_mesh()), tree) > 10
    meta = ckpt.metadata(path)
    assert meta["w"].shape == (256, 96) and meta["step"] == 3


def test_data_objects_are_cut_at_pack_object_bytes_and_offsets_are_aligned(tmp_path):
    path = str(tmp_path / "c")
    tree = _tree()
    ckpt.save(path, tree, options=ckpt.Options(layout="packed", pack_object_bytes=40_000, pack_limit_bytes=0))
    sizes = [os.path.getsize(f) for f in sorted(glob.glob(f"{path}/~data/0.*"))]
    assert len(sizes) > 3 and all(s <= 40_000 or s <= 64 * 48 * 4 for s in sizes), sizes
    index = msgpack.unpackb(open(f"{path}/~index/0", "rb").read())
    entries = np.frombuffer(index["chunks"], INDEX_DTYPE)
    for e in entries:
        assert e["offset"] % (4096 if e["length"] >= 4096 else 64) == 0, e
        name, size = index["objects"][e["object"]]["name"], index["objects"][e["object"]]["size"]
        assert e["offset"] + e["length"] <= size == os.path.getsize(os.path.join(path, name))
    assert _check(ckpt.restore(path, mesh=_mesh()), tree) > 10


def _saved(tmp_path, **options):
    path = str(tmp_path / "c")
    ckpt.save(path, _tree(), options=ckpt.Options(layout="packed", pack_limit_bytes=0, **options))
    return path


def test_a_flipped_byte_in_a_data_object_names_the_leaf_chunk_and_object(tmp_path):
    path = _saved(tmp_path)
    index = msgpack.unpackb(open(f"{path}/~index/0", "rb").read())
    entries = np.frombuffer(index["chunks"], INDEX_DTYPE)
    manifest = manifest_of(path)
    w = [i for i, l in enumerate(manifest.leaves) if l.path == "w"][0]
    e = entries[(entries["array"] == w) & (entries["chunk"] == 5)][0]
    name = index["objects"][e["object"]]["name"]
    flip_byte(storage_of(path), name, int(e["offset"]) + 10)
    with pytest.raises(ckpt.ChecksumError) as err:
        ckpt.restore(path, mesh=_mesh())
    assert "'w'" in str(err.value) and name in str(err.value) and "[2, 1]" in str(err.value), str(err.value)
    out = ckpt.restore(path, mesh=_mesh(), verify=False)  # the damaged bytes, as stored
    assert not np.array_equal(np.asarray(out["w"]), np.asarray(_tree()["w"]))
    # ckpt verify: one problem, that chunk, in that data object
    from ckpt.cli._locate import open_checkpoint
    from ckpt.cli._verify import verify_checkpoint

    opened = open_checkpoint(path)
    rep = verify_checkpoint(opened.storage, opened.manifest)
    assert not rep.intact and [(p.leaf, p.chunk) for p in rep.problems] == [("w", (2, 1))], rep.problems
    assert name in rep.problems[0].file and "checksum mismatch" in rep.problems[0].what


def test_a_truncated_data_object_or_damaged_index_is_an_error_naming_it(tmp_path):
    path = _saved(tmp_path)
    objects = sorted(glob.glob(f"{path}/~data/0.*"))
    truncate(storage_of(path), os.path.relpath(objects[-1], path), 100)
    with pytest.raises(ckpt.CheckpointError, match=r"~data/0\.\d+"):
        ckpt.restore(path, mesh=_mesh())
    path2 = str(tmp_path / "d")
    ckpt.save(path2, _tree(), options=ckpt.Options(layout="packed", pack_limit_bytes=0))
    flip_byte(storage_of(path2), "~index/0", 40)
    with pytest.raises(ckpt.CheckpointError, match=r"~index/0: index object of process 0: .*CRC-32C"):
        ckpt.restore(path2, mesh=_mesh())


@pytest.mark.parametrize("op", ["write_at", "close_pack"])
def test_a_failed_data_object_write_commits_nothing_and_keeps_the_old_checkpoint(tmp_path, op):
    path = str(tmp_path / "c")
    old = _tree(1)
    ckpt.save(path, old, options=ckpt.Options(layout="packed"))
    faults = Faults()
    faults.fail(op, after=1)
    with pytest.raises((ckpt.CheckpointError, OSError)):
        ckpt.save(path, _tree(2), overwrite=True, options=faults.options(layout="packed", pack_limit_bytes=0,
                                                                          pack_object_bytes=20_000))
    assert faults.calls[op] >= 1
    assert _check(ckpt.restore(path, mesh=_mesh()), old) > 10
    assert [e for e in os.listdir(tmp_path) if e != "c"] == []  # nothing staged left


def test_object_store_assembly_buffers_stay_within_the_host_budget():
    path = "memory://packed-layout/budget"
    mesh = _mesh()
    big = np.arange(8 * 1024 * 1024, dtype=np.float32).reshape(2048, 4096)  # 32 MiB, 8 shards of 4 MiB
    tree = {"x": jax.device_put(big, NamedSharding(mesh, P("a", "b")))}
    budget = 24 << 20
    handle = ckpt.save_async(path, tree, options=ckpt.Options(layout="packed", host_budget_bytes=budget))
    handle.wait()
    assert handle._budget.high_water <= budget  # noqa: SLF001 (the save's budget)
    assert _check(ckpt.restore(path, mesh=mesh), tree) == 8


def test_a_newer_layout_option_is_refused_clearly(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="Options.layout must be one of auto, files, packed"):
        ckpt.save(str(tmp_path / "c"), {"x": np.zeros(3)}, options=ckpt.Options(layout="zip"))
    monkeypatch.setenv("CKPT_LAYOUT", "tar")
    with pytest.raises(ValueError, match="CKPT_LAYOUT"):
        ckpt.save(str(tmp_path / "d"), {"x": np.zeros(3)})


def test_chunks_that_follow_each_other_are_read_as_one_range():
    """A restore reads the chunks of one data object that follow each other with one ranged
    read (packed_source.read_chunks), and still checks each chunk against its own CRC-32C."""
    path = "memory://packed-layout/ranges"
    tree = _tree(5)
    ckpt.save(path, tree, options=ckpt.Options(layout="packed", pack_limit_bytes=0))
    faults = Faults()
    out = ckpt.restore(path, mesh=_mesh(), options=faults.options())
    assert _check(out, tree) > 10
    reads = faults.calls["read_range"] + faults.calls["read_chunk"] + faults.calls["read_chunk_async"]
    assert 1 <= reads <= 3, faults.calls  # 16 chunks, all in one data object
    # A damaged chunk inside a merged range is still named alone.
    storage = storage_of(path)
    manifest = manifest_of(path)
    index = msgpack.unpackb(storage.get(manifest.layout.indexes[0].name, max_bytes=1 << 20))
    entries = np.frombuffer(index["chunks"], INDEX_DTYPE)
    w = [i for i, l in enumerate(manifest.leaves) if l.path == "w"][0]
    e = entries[(entries["array"] == w) & (entries["chunk"] == 3)][0]
    flip_byte(storage, index["objects"][e["object"]]["name"], int(e["offset"]) + 7)
    with pytest.raises(ckpt.ChecksumError, match=r"'w', chunk \[1, 1\]"):
        ckpt.restore(path, mesh=_mesh())
