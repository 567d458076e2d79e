"""Every error of the core API, its message, and that a failed save loses nothing."""

import os

import jax
import msgpack
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt import _storage


@pytest.fixture
def sharding():
    return NamedSharding(jax.make_mesh((4, 2), ("x", "y")), P("x", "y"))


def _tree(sharding, fill=1.0):
    return {"params": {"w": jax.device_put(np.full((32, 64), fill, np.float32), sharding),
                       "b": jax.device_put(np.full((64, 32), fill, np.float32), sharding)}, "step": 1}


def _listing(d):
    return sorted(os.listdir(d))


def test_existing_path_raises_file_exists_and_is_untouched(tmp_path, sharding):
    ckpt.save(tmp_path / "c", _tree(sharding, 1.0))
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ckpt.save(tmp_path / "c", _tree(sharding, 2.0))
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert np.all(ckpt.restore(tmp_path / "c")["params"]["w"] == 1.0)


class _FailingWrites:
    """Make the storage engine's n-th chunk write fail, as a full disk would."""

    def __init__(self, monkeypatch, after: int):
        self.calls = 0
        real = _storage.TensorStoreEngine.write

        def write(engine, handle, box, data):
            self.calls += 1
            if self.calls > after:
                raise OSError(28, "No space left on device (injected)")
            return real(engine, handle, box, data)

        monkeypatch.setattr(_storage.TensorStoreEngine, "write", write)


def test_failed_save_leaves_nothing_behind(tmp_path, sharding, monkeypatch):
    _FailingWrites(monkeypatch, after=3)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(tmp_path / "c", _tree(sharding))
    assert _listing(tmp_path) == []  # no checkpoint, no temporary directory


def test_failed_overwrite_keeps_previous_checkpoint(tmp_path, sharding, monkeypatch):
    ckpt.save(tmp_path / "c", _tree(sharding, 1.0))
    _FailingWrites(monkeypatch, after=5)
    handle = ckpt.save_async(tmp_path / "c", _tree(sharding, 2.0), overwrite=True)
    with pytest.raises(OSError, match="No space left"):
        handle.wait()
    assert _listing(tmp_path) == ["c"]
    out = ckpt.restore(tmp_path / "c")
    assert np.all(out["params"]["w"] == 1.0) and np.all(out["params"]["b"] == 1.0)


def test_unsupported_leaf_is_named_and_nothing_is_written(tmp_path, sharding):
    tree = _tree(sharding)
    tree["params"]["fn"] = lambda x: x
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'params/fn': cannot save a value of type builtins.function"):
        ckpt.save(tmp_path / "c", tree)
    assert _listing(tmp_path) == []


def test_deleted_array_is_named(tmp_path, sharding):
    tree = _tree(sharding)
    tree["params"]["w"].delete()
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'params/w'.*deleted"):
        ckpt.save(tmp_path / "c", tree)
    assert _listing(tmp_path) == []


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckpt.restore(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        ckpt.metadata(tmp_path / "nope")


def test_directory_without_manifest_is_not_a_checkpoint(tmp_path, sharding):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="is not a committed checkpoint"):
        ckpt.restore(tmp_path / "empty")
    # A save's leftover temporary directory: everything but the manifest.
    ckpt.save(tmp_path / "c", _tree(sharding))
    leftover = tmp_path / "c.tmp-0123456789ab"
    os.rename(tmp_path / "c", leftover)
    (leftover / "manifest.msgpack").unlink()
    with pytest.raises(ckpt.CheckpointError, match="temporary directory of a save that never committed"):
        ckpt.restore(leftover)
    with pytest.raises(ckpt.CheckpointError, match="not a committed checkpoint"):
        ckpt.metadata(leftover)


def _rewrite_manifest(path, edit):
    m = path / "manifest.msgpack"
    doc = msgpack.unpackb(m.read_bytes(), strict_map_key=False)
    edit(doc)
    m.write_bytes(msgpack.packb(doc, use_bin_type=True))


def test_newer_format_version_says_which_version_is_needed(tmp_path, sharding):
    ckpt.save(tmp_path / "c", _tree(sharding))
    _rewrite_manifest(tmp_path / "c", lambda d: d.update(format_version=7))
    with pytest.raises(ckpt.CheckpointError, match=r"format_version 7 is newer.*reads format version 7"):
        ckpt.restore(tmp_path / "c")


def test_corrupted_manifest(tmp_path, sharding):
    ckpt.save(tmp_path / "c", _tree(sharding))
    (tmp_path / "c" / "manifest.msgpack").write_bytes(b"\xc1garbage")
    with pytest.raises(ckpt.CheckpointError, match="manifest is corrupted"):
        ckpt.restore(tmp_path / "c")


def test_tree_mismatch_lists_every_missing_and_unexpected_path(tmp_path, sharding):
    ckpt.save(tmp_path / "c", _tree(sharding))
    target = {"params": {"w": sharding, "extra": sharding}, "other": {"x": sharding}}
    with pytest.raises(ckpt.TreeMismatchError) as e:
        ckpt.restore(tmp_path / "c", target)
    assert sorted(e.value.missing) == ["params/b", "step"]
    assert sorted(e.value.unexpected) == ["other/x", "params/extra"]
    msg = str(e.value)
    for p in ["params/b", "step", "other/x", "params/extra"]:
        assert p in msg
    # partial=True allows a subset, never keys that were not saved.
    with pytest.raises(ckpt.TreeMismatchError) as e:
        ckpt.restore(tmp_path / "c", target, partial=True)
    assert e.value.missing == [] and sorted(e.value.unexpected) == ["other/x", "params/extra"]


def test_shape_mismatch_names_leaf_and_both_shapes(tmp_path, sharding):
    ckpt.save(tmp_path / "c", _tree(sharding))
    target = jax.tree.map(lambda a: a.sharding if isinstance(a, jax.Array) else a, _tree(sharding))
    target["params"]["w"] = jax.ShapeDtypeStruct((64, 64), np.float32, sharding=sharding)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'params/w': target shape \(64, 64\) does not match saved shape \(32, 64\)"):
        ckpt.restore(tmp_path / "c", target)


def test_mesh_missing_axis_or_indivisible_dimension(tmp_path, sharding):
    ckpt.save(tmp_path / "c", _tree(sharding))
    other = jax.make_mesh((8,), ("data",))
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'params/(b|w)'.*mesh axis 'x'.*does not have"):
        ckpt.restore(tmp_path / "c", mesh=other)
    three = jax.sharding.Mesh(np.array(jax.devices()[:3]).reshape(3, 1), ("x", "y"))
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'params/(b|w)': dimension 0 of size (32|64) cannot be split over mesh axis x of size 3"):
        ckpt.restore(tmp_path / "c", mesh=three)


def test_target_and_mesh_together(tmp_path, sharding):
    ckpt.save(tmp_path / "c", _tree(sharding))
    with pytest.raises(ValueError, match="either target or mesh"):
        ckpt.restore(tmp_path / "c", {"params": {"w": sharding, "b": sharding}, "step": 0}, mesh=sharding.mesh)


def test_unsupported_url_scheme(sharding):
    with pytest.raises(ckpt.CheckpointError, match="unsupported checkpoint URL scheme 'ftp'"):
        ckpt.save("ftp://host/x", _tree(sharding))


def test_file_url_is_accepted(tmp_path, sharding):
    ckpt.save(f"file://{tmp_path}/c", _tree(sharding))
    assert np.all(ckpt.restore(tmp_path / "c")["params"]["w"] == 1.0)


def test_metadata_and_restore_in_a_process_with_one_device(tmp_path, sharding):
    """A checkpoint saved on 8 devices opens in a process that has a single device."""
    import subprocess
    import sys

    ckpt.save(tmp_path / "c", _tree(sharding, 3.0))
    code = (
        "import jax, numpy as np, ckpt\n"
        "assert len(jax.devices()) == 1\n"
        f"m = ckpt.metadata({str(tmp_path / 'c')!r})\n"
        "w = m['params']['w']\n"
        "assert w.shape == (32, 64) and w.mesh == {'x': 4, 'y': 2} and w.chunk_shape == (8, 32), w\n"
        f"host = ckpt.restore({str(tmp_path / 'c')!r})\n"
        "assert np.all(host['params']['w'] == 3.0) and host['step'] == 1\n"
        f"one = ckpt.restore({str(tmp_path / 'c')!r}, mesh=jax.make_mesh((1, 1), ('x', 'y')))\n"
        "assert np.all(np.asarray(one['params']['b']) == 3.0)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
