"""Every `ckpt` command on every kind of file and directory the library writes (issue 37): each
either succeeds (exit 0, or 1 for what verify / diff / plan report) or prints one line of error
(exit 2), never a traceback. `ckpt bench` takes no path and is left out."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli._main import main


def _tree():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    return {"params": {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
                       "b": jax.device_put(np.arange(32, dtype=np.float32), NamedSharding(mesh, P("model")))},
            "host": np.arange(3000, dtype=np.int64), "step": 7, "name": "run"}


def _first_file(root: str, skip: tuple[str, ...]) -> str:
    for dirpath, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f not in skip:
                return os.path.join(dirpath, f)
    raise AssertionError(f"no file in {root}")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, str]:
    """Name -> path of everything the library writes: checkpoints in both layouts, a manager
    directory and one of its steps, safetensors (a file, an export directory, shards and their
    index), a Zarr export, and single files inside a checkpoint."""
    root = tmp_path_factory.mktemp("written")
    out = {"checkpoint": str(root / "files"), "packed": str(root / "packed"), "manager": str(root / "run")}
    tree = _tree()
    ckpt.save(out["checkpoint"], tree)
    ckpt.save(out["packed"], tree, options=ckpt.Options(layout="packed"))
    with ckpt.CheckpointManager(out["manager"]) as m:
        m.save(1, tree)
        m.save(2, tree, metadata={"note": "x"}, metrics={"loss": 1.0})
    out["step"] = os.path.join(out["manager"], "step_00000002")
    for name, args in [("safetensors-dir", ["--format", "safetensors"]),
                       ("safetensors-shards", ["--format", "safetensors", "--shard-size", "4KB"]),
                       ("zarr-export", ["--format", "zarr"])]:
        out[name] = str(root / name)
        assert main(["export", *args, "--no-progress", out["checkpoint"], out[name]]) == 0
    out["safetensors-file"] = os.path.join(out["safetensors-dir"], "model.safetensors")
    out["safetensors-index"] = os.path.join(out["safetensors-shards"], "model.safetensors.index.json")
    out["safetensors-shard"] = os.path.join(out["safetensors-shards"], "model-00001-of-00003.safetensors")
    assert os.path.isfile(out["safetensors-shard"]), os.listdir(out["safetensors-shards"])
    out["manifest-file"] = os.path.join(out["checkpoint"], "manifest.msgpack")
    out["chunk-file"] = _first_file(out["checkpoint"], ("manifest.msgpack", "zarr.json"))
    out["zarr-json"] = os.path.join(out["checkpoint"], "zarr.json")
    return out


COMMANDS = {
    "ls": lambda t, new: ["ls", t],
    "inspect": lambda t, new: ["inspect", t],
    "inspect-json": lambda t, new: ["inspect", "--json", t],
    "verify": lambda t, new: ["verify", t],
    "du": lambda t, new: ["du", t],
    "export": lambda t, new: ["export", "--no-progress", t, new],
    "export-zarr": lambda t, new: ["export", "--format", "zarr", "--no-progress", t, new],
    "convert": lambda t, new: ["convert", t, new],
    "clean": lambda t, new: ["clean", "--dry-run", t],
    "diff": lambda t, new: ["diff", t, t],
    "plan": lambda t, new: ["plan", "--mesh", "data=2,model=4", t],
}
TARGETS = ["checkpoint", "packed", "manager", "step", "safetensors-dir", "safetensors-shards", "zarr-export",
           "safetensors-file", "safetensors-index", "safetensors-shard", "manifest-file", "chunk-file", "zarr-json"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_command_succeeds_or_prints_one_line(written, target, tmp_path, capsys):
    failures = []
    for n, (command, argv) in enumerate(COMMANDS.items()):
        args = argv(written[target], str(tmp_path / f"out{n}"))
        capsys.readouterr()
        try:
            code = main(args)
        except BaseException as e:  # what the user would see as a traceback
            failures.append(f"ckpt {' '.join(args)}: raised {type(e).__name__}: {e}")
            continue
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        if code == 2 and (len(lines) != 1 or not lines[0].startswith(f"ckpt {args[0]}: error: ")):
            failures.append(f"ckpt {' '.join(args)}: exit 2 with {len(lines)} lines of error: {err[-600:]}")
        elif code not in (0, 1, 2) or "Traceback" in err:
            failures.append(f"ckpt {' '.join(args)}: exit {code}: {err[-600:]}")
    assert not failures, "\n".join(failures)
