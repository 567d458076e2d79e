"""CheckpointManager never loses or destroys data by accident (issue 25, items 1 (manager), 6, 7, 9,
10): a manager never closed still commits its last save at exit, quietly; SIGTERM saves the
preemption step and leaves the decision to stop to the training loop; a dead uncommitted leftover
of a step does not block saving that step (a live one still does); a read-only manager never
says it would save; a step being deleted never shows as uncommitted in `ckpt ls`.

The exit and signal tests run a real Python process each, on local disk."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli._main import main
from support import dead_owner, plant_dead_save

REPO = Path(__file__).resolve().parent.parent


def _values(step):
    return {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step * 1000,
            "b": np.full((8,), step, dtype=np.int32)}


def _tree(step):
    mesh, v = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model")), _values(step)
    return {"w": jax.device_put(v["w"], NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(v["b"], NamedSharding(mesh, P())), "step": step}


def _check(restored, step):
    want = _values(step)
    assert restored["step"] == step
    for k, v in want.items():
        assert restored[k].dtype == v.dtype and np.array_equal(np.asarray(restored[k]), v), (step, k)


def _target():
    """Where to restore the test tree: the saved shardings, as jax.ShapeDtypeStruct."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                        if isinstance(a, jax.Array) else a, _tree(0))


def _check_shards(restored, step):
    """Every addressable shard of every restored array equals the saved values there."""
    want = _values(step)
    assert restored["step"] == step
    for k, v in want.items():
        arr = restored[k]
        assert isinstance(arr, jax.Array) and arr.shape == v.shape and arr.dtype == v.dtype, k
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), v[shard.index]), (step, k, shard.index)


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _ls(capsys, directory) -> list[dict]:
    capsys.readouterr()
    assert main(["ls", str(directory), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# ---- item 1 (manager) and item 10: a manager never closed ------------------------------------

_TREE_CODE = """
import sys
import jax, numpy as np, ckpt
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
def tree(step):
    w = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024) + step
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))), "step": step}
"""

NEVER_CLOSED = _TREE_CODE + """
manager = ckpt.CheckpointManager(sys.argv[1], max_to_keep=2)
for step in (1, 2, 3):
    assert manager.save(step, tree(step))
# no wait(), no close(): the interpreter exits with step 3 still being written
"""


def test_manager_never_closed_commits_its_last_save_at_exit(tmp_path):
    directory = tmp_path / "run"
    proc = _run(NEVER_CLOSED, str(directory))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    with ckpt.CheckpointManager(directory, read_only=True) as manager:
        assert manager.all_steps() == [2, 3]  # step 3 committed, and retention ran after it
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
        target = {"w": jax.ShapeDtypeStruct((4096, 1024), np.float32, sharding=NamedSharding(mesh, P("data", "model"))),
                  "step": 0}
        restored = manager.restore(3, target)
    assert restored["step"] == 3
    want = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024) + 3
    for shard in restored["w"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), want[shard.index]), shard.index
    assert sorted(os.listdir(directory)) == ["step_00000002", "step_00000003"]  # nothing uncommitted left


QUIET_EXIT = _TREE_CODE + """
manager = ckpt.CheckpointManager(sys.argv[1])
manager.save(1, tree(1))
manager.wait()  # committed; the manager still holds its directory lock at exit
print("saved")
"""


def test_manager_never_closed_exits_without_noise(tmp_path):
    proc = _run(QUIET_EXIT, str(tmp_path / "run"))
    assert proc.returncode == 0 and proc.stdout == "saved\n", proc.stderr
    assert proc.stderr == ""


# ---- item 6: SIGTERM in a single-process job ------------------------------------------------

PREEMPTED_LOOP = _TREE_CODE + """
import os, signal
manager = ckpt.CheckpointManager(sys.argv[1], max_to_keep=2, save_interval_steps=10)
for step in range(100):
    if step == 13:
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, mid-loop
    manager.save(step, tree(step))
    if manager.reached_preemption(step):
        print(f"preempted at {step}", flush=True)
        break
manager.close()
print("loop ended by its own code", flush=True)
"""


def test_sigterm_saves_the_preemption_step_and_the_loop_decides(tmp_path, capsys):
    directory = tmp_path / "run"
    proc = _run(PREEMPTED_LOOP, str(directory))
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "preempted at 13\nloop ended by its own code\n", proc.stderr
    with ckpt.CheckpointManager(directory, read_only=True) as manager:
        assert manager.all_steps() == [10, 13]  # retention ran to its end: step 0 is gone
        restored = manager.restore(13)
    assert restored["step"] == 13
    want = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024) + 13
    assert np.array_equal(np.asarray(restored["w"]), want)
    rows = _ls(capsys, directory)
    assert [(r["step"], r["state"]) for r in rows] == [(10, "committed"), (13, "committed")]
    assert sorted(os.listdir(directory)) == ["step_00000010", "step_00000013"]


TOLD_THEN_CLOSED = """
import os, signal, sys
import numpy as np, ckpt
manager = ckpt.CheckpointManager(sys.argv[1], save_interval_steps=100)
manager.save(0, {"w": np.arange(8)})
assert not manager.reached_preemption(0)  # the loop asks at every step: the notice is held for it
os.kill(os.getpid(), signal.SIGTERM)
assert manager.reached_preemption(1)  # the loop is told before it saves step 1, and stops
manager.close()
print("closed", flush=True)
"""


def test_sigterm_the_loop_was_told_of_is_not_a_kill_at_close(tmp_path):
    proc = _run(TOLD_THEN_CLOSED, str(tmp_path / "run"))
    assert (proc.returncode, proc.stdout) == (0, "closed\n"), proc.stderr
    assert np.array_equal(ckpt.restore(tmp_path / "run" / "step_00000000")["w"], np.arange(8))


def test_a_step_being_deleted_is_not_shown_as_uncommitted(tmp_path, capsys):
    """What retention cut off by a kill leaves: a step renamed to '.tmp-deleted-' and not removed."""
    directory = tmp_path / "run"
    with ckpt.CheckpointManager(directory) as manager:
        manager.save(12, _tree(12))
        manager.save(15, _tree(15))
    os.rename(directory / "step_00000012", directory / "step_00000012.tmp-deleted-0123456789ab")
    rows = _ls(capsys, directory)
    assert all(r["state"] != "uncommitted" for r in rows), rows
    (retired,) = [r for r in rows if r["path"].endswith(".tmp-deleted-0123456789ab")]
    assert retired["state"] == "deleted" and "ckpt clean" in retired["problem"], retired
    assert [(r["step"], r["state"]) for r in rows if r["state"] == "committed"] == [(15, "committed")]
    capsys.readouterr()
    assert main(["ls", str(directory)]) == 0
    assert "uncommitted" not in capsys.readouterr().out
    assert main(["clean", str(directory)]) == 0
    assert sorted(os.listdir(directory)) == ["step_00000015"]
    _check(ckpt.restore(directory / "step_00000015"), 15)


# ---- item 7: an uncommitted step directory --------------------------------------------------


def test_dead_uncommitted_step_is_replaced(location):
    from support import storage_of

    directory = location("run")
    with ckpt.CheckpointManager(directory) as manager:
        manager.save(1, _tree(1))
        # A save of step 5 that died: its staged directory (local disk: renamed into place, or
        # copied) or its generation (elsewhere), owned by a process that has exited.
        planted = "step_00000005" if location.kind == "local" else "step_00000005/gen-0123456789ab"
        plant_dead_save(storage_of(directory), planted)
        assert manager.all_steps() == [1]
        assert manager.save(5, _tree(5))
        manager.wait()
        assert manager.all_steps() == [1, 5]
        _check_shards(manager.restore(5, _target()), 5)
    assert [n for n in location.names("run") if n.startswith("step_")] == ["step_00000001", "step_00000005"]
    # The dead save's staged data is gone (its record; elsewhere its whole generation).
    assert not storage_of(directory).exists(f"{planted}/.owner")
    if location.kind != "local":
        assert "gen-0123456789ab" not in location.names("run", "step_00000005")


def test_dead_generations_of_an_uncommitted_step_are_replaced(tmp_path):
    """A step directory holding only generations of dead saves (another engine's layout)."""
    directory = tmp_path / "run"
    step = directory / "step_00000005" / "gen-0123456789ab"
    step.mkdir(parents=True)
    (step / ".owner").write_bytes(dead_owner())
    (step / "data").write_bytes(b"x" * 64)
    with ckpt.CheckpointManager(directory) as manager:
        assert manager.all_steps() == []
        assert manager.save(5, _tree(5))
        manager.wait()
        _check_shards(manager.restore(5, _target()), 5)
    assert not (directory / "step_00000005" / "gen-0123456789ab").exists()


def test_live_uncommitted_step_is_refused(tmp_path):
    """A step directory whose owner record names a process that runs: never replaced."""
    from ckpt._commit.strategy import _process_start, owner_record

    directory = tmp_path / "run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        step = directory / "step_00000005"
        step.mkdir(parents=True)
        record = {**owner_record(), "pid": sleeper.pid, "start": _process_start(sleeper.pid)}
        (step / ".owner").write_text(json.dumps(record))
        (step / "data").write_bytes(b"live bytes")
        with ckpt.CheckpointManager(directory) as manager:
            with pytest.raises(FileExistsError, match=rf"step 5 .*pid {sleeper.pid}") as info:
                manager.save(5, _tree(5))
            assert str(step) in str(info.value)
            assert manager.all_steps() == []
            assert manager.save(6, _tree(6))  # the manager still works
        _check_shards(ckpt.restore(directory / "step_00000006", _target()), 6)
        assert (step / "data").read_bytes() == b"live bytes" and (step / ".owner").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_unowned_uncommitted_step_is_refused(tmp_path):
    """A step directory nothing proves abandoned (user files, no owner record) is left alone."""
    directory = tmp_path / "run"
    step = directory / "step_00000005"
    step.mkdir(parents=True)
    (step / "notes.txt").write_text("mine")
    with ckpt.CheckpointManager(directory) as manager:
        with pytest.raises(FileExistsError, match=r"step 5 .*no owner record"):
            manager.save(5, _tree(5))
    assert (step / "notes.txt").read_text() == "mine"


# ---- item 9: read-only ------------------------------------------------------------------------


def test_read_only_manager_never_should_save(location):
    reader = ckpt.CheckpointManager(location("run"), read_only=True)
    assert not reader.should_save(0)
    assert not reader.should_save(10)
    with pytest.raises(ckpt.CheckpointError, match="read-only"):
        reader.save(0, _tree(0))
    with ckpt.CheckpointManager(location("run")) as writer:
        assert writer.should_save(0)
        writer.save(0, _tree(0))
    reader.reload()
    assert not reader.should_save(1)
    _check_shards(reader.restore(0, _target()), 0)
    reader.close()
