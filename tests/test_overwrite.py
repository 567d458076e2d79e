"""``overwrite=True`` replaces a jax-ckpt checkpoint and nothing else (issue 25, item 2): user files,
a regular file, a CheckpointManager directory, an Orbax checkpoint or an object-store prefix
holding other objects are refused, overwrite or not, with an error naming what is there; what was
there is left exactly as it was, and nothing is written."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

import ckpt
from ckpt.storage import open_storage

ORBAX_0_11 = Path(__file__).parent / "data" / "orbax-0.11.0" / "zarr2"  # an Orbax PyTree checkpoint
TREE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 3}


def _snapshot(path: Path) -> dict:
    """Every file below `path` (or `path` itself) with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _refused(path: str, overwrite: bool, what: str) -> None:
    with pytest.raises(FileExistsError, match=f"exists and is not a jax-ckpt checkpoint \\({what}") as e:
        ckpt.save(path, TREE, overwrite=overwrite)
    assert e.value.filename == path
    assert "pass overwrite=True" not in str(e.value)  # never an invitation to destroy it


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_user_files_is_never_replaced(tmp_path, overwrite):
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = _snapshot(folder)
    _refused(str(folder), overwrite, "a directory holding 2 entries: 'notes.txt', 'sub/'")
    assert _snapshot(folder) == before
    assert sorted(os.listdir(tmp_path)) == ["mine"]  # no staged directory left beside it


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_regular_file_is_never_replaced(tmp_path, overwrite):
    f = tmp_path / "model.txt"
    f.write_text("not a checkpoint")
    _refused(str(f), overwrite, "a file")
    assert f.read_text() == "not a checkpoint" and sorted(os.listdir(tmp_path)) == ["model.txt"]


def test_a_manager_directory_with_its_steps_is_never_replaced(tmp_path):
    run = tmp_path / "run"
    with ckpt.CheckpointManager(str(run), async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(4, step, np.float32)})
    before = _snapshot(run)
    _refused(str(run), True, "a directory holding")
    assert _snapshot(run) == before
    with ckpt.CheckpointManager(str(run)) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert np.array_equal(mgr.restore(2)["w"], np.full(4, 2, np.float32))


def test_an_orbax_checkpoint_is_never_replaced(tmp_path):
    orbax = tmp_path / "orbax"
    shutil.copytree(ORBAX_0_11, orbax)
    before = _snapshot(orbax)
    expected = ckpt.restore(str(orbax))
    _refused(str(orbax), True, "a directory holding")
    assert _snapshot(orbax) == before
    again = ckpt.restore(str(orbax))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(_leaves(expected), _leaves(again)))


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_a_symbolic_link_is_not_replaced_by_a_directory(tmp_path):
    target = tmp_path / "real"
    ckpt.save(str(target), TREE)
    link = tmp_path / "link"
    link.symlink_to(target)
    _refused(str(link), True, "a symbolic link to")
    assert link.is_symlink() and np.array_equal(ckpt.restore(str(target))["w"], TREE["w"])


@pytest.mark.parametrize("engine", ["tensorstore", "fsspec"])
def test_an_object_store_prefix_holding_other_objects_is_never_replaced(engine):
    location = f"memory://overwrite-{uuid.uuid4().hex[:8]}/run"
    options = ckpt.Options(engine=engine)
    storage = open_storage(location, options.resolved())
    storage.put("weights.bin", b"someone else's").result()
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=r"exists and is not a jax-ckpt checkpoint \(it holds 1 entry: "
                                                  r"'weights.bin'\)") as e:
            ckpt.save(location, TREE, overwrite=overwrite, options=options)
        assert e.value.filename == location
    assert sorted(sum(storage.list_dir(""), [])) == ["weights.bin"]
    assert storage.get("weights.bin", max_bytes=100) == b"someone else's"


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_checkpoint_is_still_replaced_and_an_empty_directory_is_used(tmp_path, where):
    path = str(tmp_path / "c") if where == "local" else f"memory://overwrite-{uuid.uuid4().hex[:8]}/c"
    ckpt.save(path, TREE)
    with pytest.raises(FileExistsError, match="checkpoint already exists"):
        ckpt.save(path, TREE)
    ckpt.save(path, {"w": np.zeros(5, np.int8)}, overwrite=True)
    assert np.array_equal(ckpt.restore(path)["w"], np.zeros(5, np.int8))
    if where == "local":
        empty = tmp_path / "empty"
        empty.mkdir()
        ckpt.save(str(empty), TREE, overwrite=True)  # an empty directory holds nothing to lose
        out = ckpt.restore(str(empty))
        assert np.array_equal(out["w"], TREE["w"]) and out["step"] == 3
