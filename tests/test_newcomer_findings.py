"""The findings of issue 37's newcomer trial (besides model surgery), each as a user met it: an
abstract target under another mesh, tuple keys, a path under a file, a folder of other files,
`ckpt plan` on a mesh with other axis names, `ckpt export --rename` dropping many names, integer
items of a manager step, Options checked when made, and what the README says `make` does.
(`ckpt inspect` of an exported safetensors file: tests/test_cli_every_file.py; `ckpt verify` of a
damaged stack chunk: tests/test_small_leaves.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli._main import main

ROOT = Path(__file__).resolve().parent.parent


def _layers(mesh, n: int = 10) -> dict:
    return {f"layer{i}": {"w": jax.device_put(np.arange(64.0).reshape(8, 8) + i, NamedSharding(mesh, P("data", "model"))),
                          "b": jax.device_put(np.arange(8.0) - i, NamedSharding(mesh, P("model")))} for i in range(n)}


def test_an_abstract_target_of_another_mesh_says_both_meshes_and_how_to_rebuild(tmp_path):
    m42, m24 = jax.make_mesh((4, 2), ("data", "model")), jax.make_mesh((2, 4), ("data", "model"))
    ckpt.save(tmp_path / "c", _layers(m42, 1))
    with jax.set_mesh(m42):
        abstract = jax.eval_shape(lambda: _layers(m42.abstract_mesh, 1))
    with jax.set_mesh(m24), pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(tmp_path / "c", abstract)
    msg = str(e.value)
    assert "does not match the mesh of the enclosing `jax.set_mesh`" in msg, msg
    assert "(data=4, model=2)" in msg and "(data=2, model=4)" in msg and "jax.eval_shape" in msg, msg
    with pytest.raises(ckpt.CheckpointError, match=r"abstract mesh \(data=4, model=2\) and no mesh is set"):
        ckpt.restore(tmp_path / "c", abstract)
    with jax.set_mesh(m24):  # the advice works: rebuilt under the new mesh, it restores
        again = ckpt.restore(tmp_path / "c", jax.eval_shape(lambda: _layers(m24.abstract_mesh, 1)))
    assert np.array_equal(np.asarray(again["layer0"]["w"]), np.arange(64.0).reshape(8, 8))
    assert again["layer0"]["w"].sharding.mesh.shape == {"data": 2, "model": 4}


def test_a_tuple_key_is_refused_naming_it(tmp_path):
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save(tmp_path / "c", {"params": {("a", 1): np.arange(3)}})
    msg = str(e.value)
    assert "the dict at 'params' has the key ('a', 1) (tuple)" in msg and "strings or integers" in msg, msg
    assert not (tmp_path / "c").exists()
    with pytest.raises(ckpt.CheckpointError, match=r"the dict at '<root>' has the key True \(bool\)"):
        ckpt.save(tmp_path / "d", {True: np.arange(3)})
    ckpt.save(tmp_path / "e", {"a": {3: np.arange(3)}})  # integer keys round-trip
    assert list(ckpt.restore(tmp_path / "e")["a"]) == [3]


def test_a_path_under_a_file_names_the_file(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    for where in ("train.py/ckpt", "train.py/runs/ckpt"):
        with pytest.raises(NotADirectoryError, match=re.escape(f"{tmp_path / 'train.py'} is a file, not a directory")):
            ckpt.save(tmp_path / where, {"w": np.arange(3)})
    with pytest.raises(NotADirectoryError, match="train.py is a file"):
        ckpt.restore(tmp_path / "train.py" / "ckpt")
    assert (tmp_path / "train.py").read_text() == "print('hi')\n"


def test_a_folder_of_other_files_is_neither_a_checkpoint_nor_a_manager_directory(tmp_path, capsys):
    folder = tmp_path / "photos"
    (folder / "holiday").mkdir(parents=True)
    (folder / "a.jpg").write_bytes(b"jpeg")
    words = "is neither a checkpoint (no manifest.msgpack) nor a manager directory"
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(folder)
    assert words in str(e.value) and "may not have committed" not in str(e.value)
    for command in ("inspect", "ls", "verify", "du"):
        assert main([command, str(folder)]) == 2
        assert words in capsys.readouterr().err, command


def test_plan_on_a_mesh_with_other_axis_names_summarizes_and_hints(tmp_path, capsys):
    ckpt.save(tmp_path / "c", _layers(jax.make_mesh((4, 2), ("data", "model"))))
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "c"), "--mesh", "x=2,y=4"]) == 1
    out = capsys.readouterr().out
    assert "cannot be placed (20 leaves of 20 arrays):" in out, out
    assert len([line for line in out.splitlines() if "saved PartitionSpec uses mesh axis" in line]) == 2, out
    assert "10 leaves: saved PartitionSpec uses mesh axis 'data'" in out and "and 7 more" in out, out
    assert ("hint: the checkpoint was saved on mesh data=4,model=2; if its axes are the mesh's under other names, "
            "plan with --axis-names data=x,model=y") in out, out
    assert main(["plan", str(tmp_path / "c"), "--mesh", "x=2,y=4", "--axis-names", "data=x,model=y", "--json"]) == 0
    renamed = json.loads(capsys.readouterr().out)
    assert main(["plan", str(tmp_path / "c"), "--mesh", "data=2,model=4", "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert renamed["total"] == same["total"] and renamed["total"]["bytes_needed"] > 0
    assert renamed["axis_names"] == {"data": "x", "model": "y"} and renamed["unplaceable"] == []
    assert main(["plan", str(tmp_path / "c"), "--mesh", "x=2,y=4", "--axis-names", "data=z"]) == 2
    assert "--axis-names maps 'data' to 'z', which is not an axis of the mesh ('x', 'y')" in capsys.readouterr().err


def test_export_rename_counts_the_names_it_drops(tmp_path, capsys):
    tree = {"model": {"w": np.arange(4.0)}, "opt": {f"mu{i:02d}": np.arange(3.0) for i in range(40)}}
    ckpt.save(tmp_path / "c", tree)
    capsys.readouterr()
    assert main(["export", "--no-progress", str(tmp_path / "c"), str(tmp_path / "hf"), "--rename", r"^opt\..*$="]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("dropped by --rename")]
    assert line == "dropped by --rename (40): opt.mu00, opt.mu01, opt.mu02, opt.mu03, opt.mu04 and 35 more (--json lists them all)"
    assert main(["export", "--no-progress", "--json", "--overwrite", str(tmp_path / "c"), str(tmp_path / "hf"),
                 "--rename", r"^opt\..*$="]) == 0
    assert len(json.loads(capsys.readouterr().out)["dropped"]) == 40


def test_a_manager_restores_an_item_by_integer_key(tmp_path):
    """``nnx.state((model, optimizer))`` is keyed 0 and 1: the items are integers."""
    state = {0: {"w": np.arange(6.0)}, 1: {"mu": np.ones(6), "count": np.int32(3)}}
    with ckpt.CheckpointManager(tmp_path / "run") as m:
        m.save(5, state)
        m.wait()
        model = m.restore(5, item=0)
        assert list(model) == ["w"] and np.array_equal(model["w"], np.arange(6.0))
        opt = m.restore(5, {"mu": jax.ShapeDtypeStruct((6,), np.float64), "count": np.int32(0)}, item=1)
        assert np.array_equal(np.asarray(opt["mu"]), np.ones(6)) and opt["count"] == 3
        with pytest.raises(KeyError, match=r"no item 2; its items: \[0, 1\]"):
            m.restore(5, item=2)
        with pytest.raises(TypeError, match="a string or an integer"):
            m.restore(5, item=1.0)


@pytest.mark.parametrize("field, value", [("io_concurrency", 0), ("max_inflight_bytes", -1), ("max_chunk_bytes", 0),
                                          ("pack_object_bytes", 0), ("host_budget_bytes", 0), ("pack_limit_bytes", -1),
                                          ("request_timeout_s", 0), ("share_replicas", "maybe"), ("layout", "zip"),
                                          ("staging_pool", "yes"), ("engine", "s3"), ("storage_options", 3)])
def test_every_option_is_checked_when_made(field, value):
    with pytest.raises((ValueError, TypeError), match=field if field != "engine" else "unknown storage engine 's3'"):
        ckpt.Options(**{field: value})


def test_the_readme_says_what_make_demo_and_make_test_do():
    readme, makefile = (ROOT / "README.md").read_text(), (ROOT / "Makefile").read_text()
    demo_dir = re.search(r"^DEMO_DIR \?= (\S+)$", makefile, re.M).group(1)
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    test = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    for script in re.findall(r"examples/\w+\.py", demo):
        assert f"`{script}`" in readme, script
    assert f"`{demo_dir}`" in readme and "DEMO_DIR=" in readme
    assert "mkdocs build" in test and "builds the documentation site" in readme
