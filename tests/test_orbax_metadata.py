"""An Orbax step's custom metadata (issue 37; MaxText writes ``{"scan_layers": true}``) is read
by ``CheckpointManager.metadata``, carried through ``ckpt convert``, shown by ``ckpt inspect``,
so that ``ckpt diff`` of an Orbax step (or its conversion) against the same state saved by
jax-ckpt finds nothing; ``ckpt convert`` of a directory mixing Orbax and jax-ckpt steps says
which step it uses and why."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli._main import main

CUSTOM = {"scan_layers": True, "model": "llama", "layers": [0, 1]}
METRICS = {"loss": 0.5}


def _state():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(np.arange(32, dtype=np.float32), NamedSharding(mesh, P("model")))}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An Orbax CheckpointManager directory (step 5, with custom metadata and metrics) that a
    jax-ckpt manager went on saving into (step 19), and the same state saved by jax-ckpt alone."""
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("mixed")
    state = _state()
    with ocp.CheckpointManager(root / "run", options=ocp.CheckpointManagerOptions(
            best_fn=lambda m: m["loss"], best_mode="min")) as m:
        m.save(5, args=ocp.args.StandardSave(state), metrics=METRICS, custom_metadata=CUSTOM)
        m.wait_until_finished()
    with ckpt.CheckpointManager(root / "run", step_prefix=None, step_format_fixed_length=None) as m:
        m.save(19, state, metadata=CUSTOM, metrics=METRICS)
    with ckpt.CheckpointManager(root / "native") as m:
        m.save(5, state, metadata=CUSTOM, metrics=METRICS)
    return root


def test_the_manager_reads_an_orbax_steps_custom_metadata(run):
    with ckpt.CheckpointManager(run / "run", read_only=True, step_prefix=None, step_format_fixed_length=None) as m:
        assert m.all_steps() == [5, 19]
        assert m.metadata(5) == CUSTOM
        assert m.metrics(5) == METRICS
        assert m.metadata(19) == CUSTOM


def test_inspect_shows_it_and_diff_finds_no_difference(run, capsys):
    orbax_step, native_step = str(run / "run" / "5"), str(run / "native" / "step_00000005")
    assert main(["inspect", orbax_step]) == 0
    out = capsys.readouterr().out
    assert "scan_layers" in out and "llama" in out, out
    assert main(["diff", orbax_step, native_step]) == 0, capsys.readouterr()


def test_convert_carries_it_and_says_which_step_of_a_mixed_directory(run, tmp_path, capsys):
    dest = tmp_path / "converted"
    assert main(["convert", str(run / "run"), str(dest)]) == 0
    err = capsys.readouterr().err
    assert "step 5 (the latest Orbax step; the latest step overall, 19, is a jax-ckpt checkpoint)" in err, err
    assert main(["diff", str(dest), str(run / "native" / "step_00000005")]) == 0, capsys.readouterr()
    converted = ckpt.restore(dest)
    want = _state()
    for k in want:
        assert np.array_equal(converted[k], np.asarray(want[k])), k
