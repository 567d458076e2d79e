"""The storage interface: every engine reads what every engine writes, the commit on backends
without renames (generations on memory://), racing saves, failures, and location parsing."""

import errno
import os
import uuid
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.storage._location import ENGINES, location_text, open_storage
from ckpt._format.records import GENERATION_MARK, MANIFEST_NAME
from support import Faults, Location, committed_generations, io_error, keys, race_two_saves, snapshot, storage_of, without_lease

# ---- the tree: bf16, int8 and float32; sharded over a 4x2 mesh and replicated; a scalar --------

SPECS = {
    "w": ((32, 64), np.float32, P("x", "y")),
    "e": ((32, 96), ml_dtypes.bfloat16, P(None, ("x", "y"))),
    "q": ((96, 64), np.int8, P()),  # replicated
    "r": ((64,), np.float32, P()),  # replicated, small: inline in the manifest
}


def _value(name):
    shape, dtype, _ = SPECS[name]
    n = int(np.prod(shape))
    base = (np.arange(n, dtype=np.int64) * 37 + sum(map(ord, name))) % 253 - 126
    return (base.astype(np.float32) / (4 if dtype != np.int8 else 1)).astype(dtype).reshape(shape)


def _mesh(shape=(4, 2), devices=None):
    devs = np.array(devices if devices is not None else jax.devices())
    return Mesh(devs.reshape(shape), ("x", "y"))


def _tree(mesh):
    tree = {k: jax.device_put(_value(k), NamedSharding(mesh, spec)) for k, (_, _, spec) in SPECS.items()}
    tree["step"] = 41
    return tree


def _same_bits(got, want) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def _assert_restored(out, mesh=None):
    assert out["step"] == 41 and type(out["step"]) is int
    for name, (_, _, spec) in SPECS.items():
        want = _value(name)
        got = out[name]
        if mesh is None:
            assert isinstance(got, np.ndarray) and _same_bits(got, want), name
            continue
        assert isinstance(got, jax.Array) and got.sharding == NamedSharding(mesh, spec), name
        assert len(got.addressable_shards) == 8
        for s in got.addressable_shards:
            assert np.array_equal(np.asarray(s.data), want[s.index]) and _same_bits(s.data, want[s.index]), (name, s.index)


# ---- cross-engine matrix on local disk ------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One checkpoint per engine, all of the same tree, on local disk."""
    root = tmp_path_factory.mktemp("engines")
    mesh = _mesh()
    out = {}
    for engine in ENGINES:
        path = str(root / engine)
        ckpt.save(path, _tree(mesh), options=ckpt.Options(engine=engine))
        out[engine] = path
    return out


def test_each_engine_writes_its_layout(written):
    # local: renamed into place, no generation; the others: one generation prefix
    assert committed_generations(written["local"]) == sorted(["w", "e", "q"])
    for engine in ("tensorstore", "fsspec"):
        (generation,) = committed_generations(written[engine])
        assert generation.startswith(GENERATION_MARK)
        assert sorted(os.listdir(written[engine])) == sorted([generation, MANIFEST_NAME])
    assert not [n for n in os.listdir(os.path.dirname(written["local"])) if ".tmp-" in n]


@pytest.mark.parametrize("reader", ENGINES)
@pytest.mark.parametrize("writer", ENGINES)
def test_every_engine_restores_what_every_engine_wrote(written, writer, reader):
    options = ckpt.Options(engine=reader)
    path = written[writer]
    _assert_restored(ckpt.restore(path, options=options))
    _assert_restored(ckpt.restore(path, mesh=_mesh(), options=options), _mesh())
    # onto another mesh: the same axis names over a 2x4 arrangement of the devices, reversed
    other = _mesh((2, 4), jax.devices()[::-1])
    _assert_restored(ckpt.restore(path, mesh=other, options=options), other)
    target = {k: NamedSharding(other, spec) for k, (_, _, spec) in SPECS.items()}
    target["step"] = 0
    _assert_restored(ckpt.restore(path, target, options=options), other)
    meta = ckpt.metadata(path, options=options)
    assert meta["w"].shape == (32, 64) and meta["e"].dtype == ml_dtypes.bfloat16 and meta["step"] == 41


def test_fsspec_engine_on_memory_is_its_own_store():
    # fsspec's memory:// file system is a different store from TensorStore's memory kvstore
    # (the default engine for memory://): each sees only what was written through it.
    path = f"memory://t/{uuid.uuid4().hex}/c"
    fsspec_engine = ckpt.Options(engine="fsspec")
    ckpt.save(path, _tree(_mesh()), options=fsspec_engine)
    try:
        _assert_restored(ckpt.restore(path, options=fsspec_engine))
        _assert_restored(ckpt.restore(path, mesh=_mesh(), options=fsspec_engine), _mesh())
        with pytest.raises(FileNotFoundError):
            ckpt.restore(path)  # the TensorStore memory kvstore holds nothing here
        storage = open_storage(path, fsspec_engine.resolved())
        (generation,) = committed_generations(storage)
        assert sorted(storage.list_dir("")[0] + storage.list_dir("")[1]) == sorted([MANIFEST_NAME, generation])
    finally:
        open_storage(path, fsspec_engine.resolved()).delete_tree("")


# ---- the commit on memory:// (no renames: generations) ---------------------------------------------


@pytest.fixture
def memory():
    loc = Location.make("memory", None)
    yield loc
    loc.cleanup()


def _scaled_tree(mesh, k):
    tree = _tree(mesh)
    tree["w"] = tree["w"] * k
    return tree


def test_overwrite_on_memory_leaves_only_the_new_generation(memory):
    mesh = _mesh()
    path = memory("c")
    ckpt.save(path, _tree(mesh))
    (old,) = committed_generations(path)
    old_keys = [k for k in keys(memory.storage("c")) if k.startswith(old + "/")]
    assert len(old_keys) > 3
    ckpt.save(path, _scaled_tree(mesh, 2), overwrite=True)
    (new,) = committed_generations(path)
    assert new != old
    assert memory.names("c") == sorted([MANIFEST_NAME, new])  # the old data was deleted after the commit
    assert not [k for k in keys(memory.storage("c")) if k.startswith(old)]
    out = ckpt.restore(path)
    assert np.array_equal(out["w"], _value("w") * 2) and _same_bits(out["e"], _value("e"))


def test_failed_save_on_memory_leaves_the_previous_checkpoint_and_no_generation(memory):
    mesh = _mesh()
    path = memory("c")
    ckpt.save(path, _tree(mesh))
    before = memory.snapshot()
    faults = Faults()
    faults.fail("write_chunk", after=2)
    with pytest.raises(OSError, match="No space left") as e:
        ckpt.save(path, _scaled_tree(mesh, 3), overwrite=True, options=faults.options())
    assert e.value.errno == errno.ENOSPC and path in str(e.value)
    assert memory.snapshot() == before
    assert len([n for n in memory.names("c") if n.startswith(GENERATION_MARK)]) == 1
    _assert_restored(ckpt.restore(path, mesh=mesh), mesh)


@pytest.mark.parametrize("overwrite", [False, True])
def test_manifest_write_failure_on_memory_commits_nothing(memory, overwrite):
    """The commit's one write (write-if-absent of a new checkpoint's manifest, or the replacing
    put of an overwrite) fails: the save raises, the previous checkpoint (if any) is whole, and a
    later save to the same place works."""
    mesh = _mesh()
    path = memory("c")
    if overwrite:
        ckpt.save(path, _tree(mesh))
    before = memory.snapshot()
    faults = Faults()
    faults.fail("put" if overwrite else "put_if_absent", io_error,
                when=lambda where, args: where.endswith("/" + MANIFEST_NAME))
    with pytest.raises((OSError, ckpt.CheckpointError), match="Input/output error") as e:
        ckpt.save(path, _scaled_tree(mesh, 2), overwrite=overwrite, options=faults.options())
    assert f"{path}/{MANIFEST_NAME}" in str(e.value)
    after = memory.snapshot()
    assert {k: after[k] for k in before} == before  # nothing that was there changed
    if overwrite:
        _assert_restored(ckpt.restore(path, mesh=mesh), mesh)
    else:
        # The manifest provably did not land (a read-back finds none): the save removed its
        # generation (issue 28, item 6), so nothing is left at the location.
        assert not [k for k in after if k.startswith("c/")]
        with pytest.raises(FileNotFoundError, match="no checkpoint at this path"):
            ckpt.restore(path)
    ckpt.save(path, _scaled_tree(mesh, 3), overwrite=overwrite)
    assert np.array_equal(ckpt.restore(path)["w"], _value("w") * 3)


def test_old_data_that_cannot_be_deleted_after_an_overwrite_only_warns(memory):
    """Once the new manifest is in place the save has succeeded: failing to delete the previous
    generation is a warning (twice: the overwrite's deletion, then its removal of dead leftovers
    retries it), and what is left is data no manifest points to."""
    mesh = _mesh()
    path = memory("c")
    ckpt.save(path, _tree(mesh))
    (old,) = committed_generations(path)
    faults = Faults()
    faults.fail("delete_tree", io_error, when=lambda where, args: where.endswith("/" + old))
    with pytest.warns(RuntimeWarning) as warned:
        ckpt.save(path, _scaled_tree(mesh, 2), overwrite=True, options=faults.options())
    assert [str(w.message).split(": [Errno")[0] for w in warned] == [
        f"checkpoint {path} committed, but its previous data {path}/{old} could not be deleted",
        f"could not remove leftovers of earlier saves in {path}"]
    assert faults.calls["delete_tree"] == 2
    (new,) = committed_generations(path)
    assert memory.names("c") == sorted([MANIFEST_NAME, new, old])
    out = ckpt.restore(path, mesh=mesh)
    for s in out["w"].addressable_shards:
        assert np.array_equal(np.asarray(s.data), (_value("w") * 2)[s.index])


def test_retire_on_memory_deletes_the_manifest_before_the_data(memory):
    """A manager's deletion of an old step on a backend without renames: the step stops being
    committed (its manifest goes) before any of its data is deleted."""
    faults = Faults()
    gate = faults.hold("delete_tree", when=lambda where, args: "step_00000001" in where)
    manager = ckpt.CheckpointManager(memory("run"), max_to_keep=1, options=faults.options())
    mesh = _mesh()
    manager.save(1, _tree(mesh))
    manager.save(2, _scaled_tree(mesh, 2))
    assert gate.entered.wait(30)
    step1 = memory.storage("run", "step_00000001")
    assert not step1.exists(MANIFEST_NAME) and len(keys(step1)) > 3  # uncommitted, data still there
    assert manager.all_steps() == [2]
    gate.release.set()
    manager.close()
    assert memory.names("run") == ["step_00000002"]
    assert np.array_equal(manager.restore(2)["w"], _value("w") * 2)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_racing_saves_exactly_one_commits(kind, tmp_path):
    """Two saves to the same new location, both staged and written before either commits: one
    commits, the other raises FileExistsError and leaves nothing behind."""
    loc = Location.make(kind, tmp_path)
    mesh = _mesh()
    path = loc("c")
    errors = race_two_saves(path, (_scaled_tree(mesh, 1), _scaled_tree(mesh, 2)))
    try:
        failed = [i for i in (0, 1) if errors[i] is not None]
        assert len(failed) == 1, errors
        (loser,) = failed
        assert isinstance(errors[loser], FileExistsError), repr(errors[loser])
        assert errors[loser].filename == path and "committed nothing" in str(errors[loser])
        winner = 1 - loser
        out = ckpt.restore(path)
        assert np.array_equal(out["w"], _value("w") * (winner + 1))
        if kind == "memory":
            # the loser's generation is gone: only the winner's data and manifest are left
            assert loc.names("c") == sorted([MANIFEST_NAME, *committed_generations(path)])
        else:
            assert os.listdir(tmp_path) == ["c"]
    finally:
        loc.cleanup()


def test_manager_on_memory(memory):
    mesh = _mesh()
    with ckpt.CheckpointManager(memory("run"), max_to_keep=2) as manager:
        for step in range(1, 5):
            tree = _scaled_tree(mesh, step)
            assert manager.save(step, tree, metadata={"loss": 1.0 / step})
        manager.wait()
        assert manager.all_steps() == [3, 4]
        # (and, while the manager saves, its lease: storage without locks has no other way)
        assert without_lease(memory.names("run")) == ["step_00000003", "step_00000004"]
        out = manager.restore(mesh=mesh)
        assert np.array_equal(np.asarray(out["w"]), _value("w") * 4)
        assert manager.metadata(3) == {"loss": 1.0 / 3}
    reopened = ckpt.CheckpointManager(memory("run"))
    assert reopened.latest_step() == 4
    out = ckpt.restore(reopened.step_path(3))
    assert np.array_equal(out["w"], _value("w") * 3) and _same_bits(out["q"], _value("q"))
    reopened.close()


# ---- locations --------------------------------------------------------------------------------------


def _small():
    return {"a": np.arange(2048, dtype=np.float32), "n": 3}


def _restores(path, **kw):
    out = ckpt.restore(path, **kw)
    return np.array_equal(out["a"], np.arange(2048, dtype=np.float32)) and out["n"] == 3


def test_file_url_naming_another_host_is_refused():
    with pytest.raises(ckpt.CheckpointError, match="'otherhost'"):
        ckpt.save("file://otherhost/x", _small())
    with pytest.raises(ckpt.CheckpointError, match="'otherhost'"):
        location_text("file://otherhost/x")


def test_local_file_urls_are_local_paths(tmp_path):
    assert location_text("file://localhost/tmp/x") == "/tmp/x"
    assert location_text("file:///tmp/x") == "/tmp/x"
    assert location_text("file:///tmp/a%20b") == "/tmp/a b"
    ckpt.save(f"file://localhost{tmp_path}/a", _small())
    ckpt.save(f"file://{tmp_path}/b", _small())
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]
    assert _restores(tmp_path / "a") and _restores(f"file://{tmp_path}/b")
    assert storage_of(f"file:///{tmp_path}/a").caps.engine == "local"


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert location_text("~/c") == str(tmp_path / "c")
    ckpt.save("~/c", _small())
    assert (tmp_path / "c" / MANIFEST_NAME).is_file()
    assert _restores("~/c")


def test_path_objects(tmp_path):
    class FsPath:
        def __init__(self, path):
            self.path = path

        def __fspath__(self):
            return self.path

    ckpt.save(Path(tmp_path) / "p", _small())
    ckpt.save(FsPath(str(tmp_path / "f")), _small())
    assert sorted(os.listdir(tmp_path)) == ["f", "p"]
    assert _restores(FsPath(str(tmp_path / "p"))) and _restores(tmp_path / "f")
    assert _restores(str(tmp_path / "f").encode())


def test_epath_like_object_whose_text_is_a_url():
    class RemotePath:
        """Like etils.epath.Path for a remote location: str() is the URL, os.fspath() fails."""

        def __init__(self, url):
            self.url = url

        def __fspath__(self):
            raise TypeError("not a local path")

        def __str__(self):
            return self.url

        def __truediv__(self, other):
            return RemotePath(f"{self.url}/{other}")

    class GPath:  # an object that only says what it is through str()
        def __init__(self, url):
            self.url = url

        def __str__(self):
            return self.url

    root = RemotePath(f"memory://t/{uuid.uuid4().hex}")
    try:
        ckpt.save(root / "c", _small())
        assert _restores(f"{root}/c") and _restores(GPath(f"{root}/c"))
        assert ckpt.metadata(root / "c")["n"] == 3
        with ckpt.CheckpointManager(root / "run") as manager:
            manager.save(1, _small())
        assert ckpt.CheckpointManager(GPath(f"{root}/run")).all_steps() == [1]
    finally:
        storage_of(str(root)).delete_tree("")


def test_unknown_scheme_lists_the_supported_ones():
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save("foo://x", _small())
    msg = str(e.value)
    assert "foo://x" in msg
    for scheme in ("file://", "memory://", "s3://", "gs://"):
        assert scheme in msg
    with pytest.raises(ckpt.CheckpointError, match="foo://x"):
        ckpt.restore("foo://x")


def test_unknown_engine_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="unknown storage engine 'nope'.*local, tensorstore, fsspec"):
        ckpt.save(tmp_path / "c", _small(), options=ckpt.Options(engine="nope"))
    with pytest.raises(ValueError, match="'nope'"):
        ckpt.restore(tmp_path / "c", options=ckpt.Options(engine="nope"))
    with pytest.raises(ValueError, match="'nope'"):
        ckpt.CheckpointManager(tmp_path / "run", options=ckpt.Options(engine="nope"))
    assert os.listdir(tmp_path) == []


def test_engine_factory_must_return_a_storage(tmp_path):
    with pytest.raises(TypeError, match="not a ckpt Storage"):
        ckpt.save(tmp_path / "c", _small(), options=ckpt.Options(engine=lambda location, options: object()))


def test_local_engine_serves_only_local_paths():
    with pytest.raises(ckpt.CheckpointError, match="local engine"):
        ckpt.save("memory://t/x", _small(), options=ckpt.Options(engine="local"))


def test_wrapper_sees_every_operation_of_a_save_and_restore(memory):
    faults = Faults()
    path = memory("c")
    ckpt.save(path, _tree(_mesh()), options=faults.options(pack_limit_bytes=0))
    assert faults.calls["write_chunk"] >= 8 and faults.calls["stage"] == 1 and faults.calls["commit"] == 1
    _assert_restored(ckpt.restore(path, mesh=_mesh(), options=faults.options()), _mesh())
    assert faults.calls["read_chunk"] >= 3 and faults.calls["get"] >= 1
    assert snapshot(memory.storage("c"))  # and the data is really in the memory store
