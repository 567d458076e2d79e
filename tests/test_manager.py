"""CheckpointManager: retention, should_save, metadata, background failures, crash safety,
and exact resume of examples/train.py on the same and on another mesh.

Every test that touches storage runs on local disk and on memory:// (the `location` fixture);
faults and held deletions go through support.FaultyStorage. The SIGKILL and example-script
tests run other processes and stay on local disk."""

import glob
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
import ckpt._manager
from ckpt._manager.retention import steps_to_delete
from support import Faults, io_error, plant_dead_save, without_lease

REPO = Path(__file__).resolve().parent.parent


def _load_train():
    spec = importlib.util.spec_from_file_location("example_train", REPO / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _load_train()


def _values(step):
    """Host values of the test tree at `step` (a large and an inline array, and a Python int)."""
    return {
        "w": (np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step * 1000),
        "b": np.full((8,), step, dtype=np.int32),
    }


def _tree(step):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    v = _values(step)
    return {
        "w": jax.device_put(v["w"], NamedSharding(mesh, P("data", "model"))),
        "b": jax.device_put(v["b"], NamedSharding(mesh, P())),
        "step": step,
    }


def _assert_step_restores(manager, step):
    restored = manager.restore(step)
    expected = _values(step)
    assert restored["step"] == step
    for k in expected:
        assert restored[k].dtype == expected[k].dtype
        assert np.array_equal(restored[k], expected[k]), (step, k)


# ---- retention ---------------------------------------------------------------------------


def test_steps_to_delete_policy():
    assert steps_to_delete([1, 2, 3], None, None) == []
    assert steps_to_delete([1, 2, 3], None, 2) == []
    assert steps_to_delete([3, 1, 2], 1, None) == [1, 2]
    assert steps_to_delete(list(range(1, 11)), 2, 4) == [1, 2, 3, 5, 6, 7]
    assert steps_to_delete([5, 10, 15, 20], 3, None) == [5]
    assert steps_to_delete([], 1, None) == []
    assert steps_to_delete([7], 1, 100) == []  # the newest step is always kept


def _step_names(steps):
    return [f"step_{s:08d}" for s in steps]


def test_retention_keeps_newest_and_every_nth(location):
    with ckpt.CheckpointManager(location("run"), max_to_keep=2, keep_every_n_steps=4) as manager:
        for step in range(1, 11):
            assert manager.save(step, _tree(step))
        manager.wait()
        assert manager.all_steps() == [4, 8, 9, 10]
        assert manager.latest_step() == 10
        for step in manager.all_steps():
            _assert_step_restores(manager, step)
    assert location.names("run") == _step_names((4, 8, 9, 10))


def test_retention_runs_in_background(location):
    faults = Faults()
    gate = faults.hold("retire", times=1)  # the first deletion waits for the test
    manager = ckpt.CheckpointManager(location("run"), max_to_keep=1, options=faults.options())
    assert manager.save(1, _tree(1))
    assert manager.save(2, _tree(2))  # waits for step 1 to commit
    assert gate.entered.wait(30)  # step 2 committed; deleting step 1 is now held
    assert gate.held == [manager.step_path(1)]
    # Step 1 stopped being a step for this manager before its files go.
    with pytest.raises(FileNotFoundError, match="step 1 is not a committed checkpoint"):
        manager.restore(1)
    # The caller is not held by the deletion: saves, queries and restores go on.
    assert manager.save(3, _tree(3))
    _assert_step_restores(manager, 2)
    assert manager.latest_step() >= 2
    gate.release.set()
    manager.close()
    assert faults.calls["retire"] == 2  # steps 1 and 2
    assert manager.all_steps() == [3]
    assert location.names("run") == _step_names([3])
    _assert_step_restores(manager, 3)


def test_failed_deletion_warns_and_is_retried_by_the_next_commit(location):
    faults = Faults()
    faults.fail("retire", io_error, times=1)
    manager = ckpt.CheckpointManager(location("run"), max_to_keep=1, async_save=False, options=faults.options())
    manager.save(1, _tree(1))
    with pytest.warns(RuntimeWarning, match="could not delete step 1"):
        manager.save(2, _tree(2))
        manager.wait()
    assert manager.all_steps() == [1, 2]  # left whole, still committed
    _assert_step_restores(manager, 1)
    manager.save(3, _tree(3))
    manager.close()
    assert manager.all_steps() == [3]
    assert location.names("run") == _step_names([3])


def test_retention_skips_a_step_being_restored(location, monkeypatch):
    manager = ckpt.CheckpointManager(location("run"), max_to_keep=1, async_save=False)
    manager.save(1, _tree(1))
    real_restore = ckpt._manager._restore
    during = {}

    def restore_while_saving(path, *args, **kwargs):
        # Step 2 commits while step 1 is being read: retention must leave step 1 alone.
        manager.save(2, _tree(2))
        manager.wait()
        during["steps"] = manager.all_steps()
        return real_restore(path, *args, **kwargs)

    monkeypatch.setattr(ckpt._manager, "_restore", restore_while_saving)
    restored = manager.restore(1)
    assert during["steps"] == [1, 2]
    assert np.array_equal(restored["w"], _values(1)["w"])
    monkeypatch.undo()
    manager.save(3, _tree(3))  # the next commit deletes what was skipped
    manager.close()
    assert manager.all_steps() == [3]


def test_only_process_zero_deletes(location, monkeypatch):
    run = location.storage("run")
    # What a save that died leaves, with the owner record of a dead process: a temporary
    # directory (local disk), or a step's generation without a manifest (memory://, no renames).
    # The first is removed by the next commit beside it, which is the saving process's (the
    # coordinator's process 0, here this process); the second by the manager of process 0.
    if location.kind == "local":
        plant_dead_save(run, "step_00000005.tmp-0123456789ab")
        leftovers = []
    else:
        plant_dead_save(run, "step_00000006/gen-0123456789ab")
        leftovers = ["step_00000006"]
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with ckpt.CheckpointManager(location("run"), max_to_keep=1) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step))
    assert manager.all_steps() == [1, 2, 3]
    assert location.names("run") == sorted(_step_names((1, 2, 3)) + leftovers)
    monkeypatch.undo()
    with ckpt.CheckpointManager(location("run"), max_to_keep=1) as manager:
        manager.save(4, _tree(4))
    assert manager.all_steps() == [4]
    assert location.names("run") == _step_names([4])
    _assert_step_restores(manager, 4)


# ---- should_save and save ------------------------------------------------------------------


def test_should_save_and_force(location):
    manager = ckpt.CheckpointManager(location("run"), save_interval_steps=3, async_save=False)
    # The first step of an empty directory is saved whatever the interval (as Orbax does).
    assert all(manager.should_save(s) for s in range(10))
    assert manager.save(3, _tree(3))
    assert manager.all_steps() == [3]  # async_save=False: committed on return
    assert [s for s in range(10) if manager.should_save(s)] == [6, 9]
    assert not manager.save(5, _tree(5))
    assert not manager.should_save(3)
    assert not manager.save(3, _tree(3), force=True)  # a step is saved once
    assert manager.save(4, _tree(4), force=True)
    assert not manager.should_save(3) and manager.should_save(6)
    manager.close()
    with pytest.raises(ckpt.CheckpointError, match="closed"):
        manager.save(6, _tree(6))

    reopened = ckpt.CheckpointManager(location("run"), save_interval_steps=3)
    assert not reopened.should_save(3) and reopened.should_save(6)
    assert reopened.all_steps() == [3, 4]
    _assert_step_restores(reopened, 3)
    _assert_step_restores(reopened, 4)
    reopened.close()


def test_reached_preemption(location, monkeypatch):
    from jax.experimental import multihost_utils

    manager = ckpt.CheckpointManager(location("run"))
    assert manager.reached_preemption(5) is False  # no jax.distributed, no preemption service

    def not_initialized(step):
        raise RuntimeError("Preemption sync manager has not been initialized.")

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", not_initialized)
    assert manager.reached_preemption(5) is False
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda step: step == 7)
    assert [s for s in range(10) if manager.reached_preemption(s)] == [7]
    manager.close()


def test_bad_arguments(location):
    for kwargs in ({"max_to_keep": 0}, {"save_interval_steps": 0}, {"keep_every_n_steps": -1},
                   {"save_interval_steps": None}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ckpt.CheckpointManager(location("run"), **kwargs)
    manager = ckpt.CheckpointManager(location("run"))
    with pytest.raises(ValueError, match="step must be >= 0"):
        manager.save(-1, _tree(0))
    with pytest.raises(TypeError, match="integer"):
        manager.should_save(1.5)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        manager.restore()
    manager.save(2, _tree(2))
    manager.wait()
    with pytest.raises(FileNotFoundError, match=r"step 7 .*committed steps: \[2\]"):
        manager.restore(7)
    manager.close()


def test_directory_that_is_a_file(tmp_path):
    """POSIX only: object stores have no files that block a directory."""
    (tmp_path / "file").write_text("x")
    manager = ckpt.CheckpointManager(tmp_path / "file")  # opening reads only
    assert manager.all_steps() == []
    with pytest.raises(NotADirectoryError):
        manager.save(1, _tree(1))


def test_metadata_round_trip(location):
    meta = {"loss": 0.25, "loader": {"epoch": 3, "position": [12, 7]}, "note": "warmup", "raw": b"\x00\x01",
            "best": None, "done": False, "big": 2**62}
    with ckpt.CheckpointManager(location("run")) as manager:
        assert manager.save(7, _tree(7), metadata=meta)
        meta["loss"] = 99.0  # the manager stored a copy
        assert manager.save(8, _tree(8))
        manager.wait()
        stored = manager.metadata(7)
        assert stored == {**meta, "loss": 0.25}
        assert manager.metadata() == {}  # the latest step (8) has none
        with pytest.raises(ckpt.CheckpointError, match=r"'acc' \(float32\) cannot be stored"):
            manager.save(9, _tree(9), metadata={"acc": np.float32(0.5)})
        with pytest.raises(ckpt.CheckpointError, match="key 3 is not a string"):
            manager.save(9, _tree(9), metadata={3: "x"})
        assert manager.all_steps() == [7, 8] and manager.should_save(9)
    # Each step is a checkpoint of its own.
    path = manager.step_path(7)
    assert path == location("run", "step_00000007")
    assert ckpt.metadata(path)["w"].shape == (64, 32)
    assert np.array_equal(ckpt.restore(path)["w"], _values(7)["w"])
    assert ckpt.metadata(path)["step"] == 7


# ---- failures and crashes ------------------------------------------------------------------


def _fail_step(faults, step, after=0):
    """Make the chunk writes of `step` fail (all but the first `after`), as a full disk would."""
    faults.fail("write_chunk", after=after, when=lambda where, args: f"step_{step:08d}" in where)


@pytest.mark.parametrize("surfaces_on", ["save", "wait", "close"])
def test_background_failure_surfaces(location, surfaces_on):
    faults = Faults()
    manager = ckpt.CheckpointManager(location("run"), max_to_keep=1, options=faults.options())
    assert manager.save(1, _tree(1))
    manager.wait()
    before = location.snapshot("run")
    _fail_step(faults, 2)
    assert manager.save(2, _tree(2))  # starts; the failure happens in the background
    call = {"save": lambda: manager.save(3, _tree(3)), "wait": manager.wait, "close": manager.close}[surfaces_on]
    with pytest.raises(ckpt.CheckpointError, match="step 2 .*failed in the background") as info:
        call()
    assert isinstance(info.value.__cause__, OSError) and "No space left" in str(info.value)
    assert manager.all_steps() == [1]
    assert manager.latest_step() == 1
    _assert_step_restores(manager, 1)
    # Nothing of step 2 is left behind (a lease a manager holds on memory:// is no step's data).
    assert without_lease(location.snapshot("run")) == without_lease(before)
    faults.clear()
    if surfaces_on != "close":
        # The failure was reported once; the manager goes on, and step 2 may be saved again.
        assert manager.should_save(2)
        assert manager.save(2, _tree(2))
        manager.close()
        assert manager.all_steps() == [2]
        _assert_step_restores(manager, 2)
        assert location.names("run") == _step_names([2])


def test_leftovers_of_a_failed_save_are_removed_by_the_next_save(location):
    """A save whose writes fail and whose cleanup fails too leaves staged data; opening the next
    manager leaves it alone (it reads only), and that manager's first save removes it."""
    faults = Faults()
    # (shard by shard, so that step 2 has several chunk files to write)
    manager = ckpt.CheckpointManager(location("run"), options=faults.options(pack_limit_bytes=0))
    manager.save(1, _tree(1))
    manager.wait()
    _fail_step(faults, 2, after=1)  # one chunk of step 2 is written
    faults.fail("abort", io_error)
    manager.save(2, _tree(2))
    with pytest.raises(ckpt.CheckpointError, match="step 2 .*failed in the background"):
        manager.close()
    assert faults.calls["abort"] == 1
    leftover = [n for n in location.names("run") if n != "step_00000001"]
    assert len(leftover) == 1 and leftover[0].startswith("step_00000002")
    assert manager.all_steps() == [1]
    with ckpt.CheckpointManager(location("run")) as reopened:
        _assert_step_restores(reopened, 1)
        assert location.names("run") == sorted(_step_names([1]) + leftover)
        reopened.save(3, _tree(3))
    assert location.names("run") == _step_names([1, 3])


def test_context_exit_keeps_the_body_exception(location):
    faults = Faults()
    with pytest.raises(KeyError, match="from the loop") as info:
        with ckpt.CheckpointManager(location("run"), options=faults.options()) as manager:
            _fail_step(faults, 1)
            assert manager.save(1, _tree(1))
            raise KeyError("from the loop")
    assert any("step 1" in note and "failed in the background" in note for note in info.value.__notes__)
    assert manager.all_steps() == []


CRASH_CHILD = textwrap.dedent("""
    import os, sys, time
    directory, ready, tests = sys.argv[1:4]
    sys.path.insert(0, tests)
    import jax
    from test_manager import _tree
    from support import Faults
    import ckpt

    faults = Faults()
    manager = ckpt.CheckpointManager(directory, options=faults.options())
    manager.save(1, _tree(1))
    manager.wait()

    def write_then_hang(future, handle, box, data):
        future.result()  # part of step 2 is on disk
        with open(ready, "w"):
            pass
        time.sleep(600)

    faults.after("write_chunk", write_then_hang)
    manager.save(2, _tree(2))
    time.sleep(600)
""")


def test_sigkill_during_save_leaves_previous_step(tmp_path):
    """POSIX only: a real process killed with SIGKILL in the middle of a save."""
    child = tmp_path / "crash_child.py"
    child.write_text(CRASH_CHILD)
    directory, ready = tmp_path / "run", tmp_path / "ready"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(child), str(directory), str(ready), str(REPO / "tests")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "the child never started saving step 2"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    (leftover,) = glob.glob(str(directory / "step_00000002.tmp-*"))
    assert any(files for _, _, files in os.walk(leftover))  # the save really was under way

    manager = ckpt.CheckpointManager(directory)
    assert manager.all_steps() == [1]
    assert manager.latest_step() == 1
    _assert_step_restores(manager, 1)
    assert os.path.exists(leftover)  # opening and reading change nothing
    assert manager.save(2, _tree(2))
    manager.close()
    assert not os.path.exists(leftover)  # the save removed it: its owner is dead
    assert manager.all_steps() == [1, 2]
    _assert_step_restores(manager, 2)


# ---- resume ---------------------------------------------------------------------------------


def _host_state(state):
    return jax.tree.map(np.asarray, state)


def _assert_states_equal(got, want):
    got_leaves, got_def = jax.tree.flatten(got)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(np.asarray(g), np.asarray(w))


_step_fns = {}


def _step_fn(mesh):
    """One jitted step per mesh for the whole module (each new jit compiles again)."""
    if mesh not in _step_fns:
        _step_fns[mesh] = train.make_train_step(mesh)
    return _step_fns[mesh]


def _reference(first_mesh, second_mesh, split, total):
    """Host states at `split` and at `total` of a run without checkpoints that takes its
    first `split` steps on first_mesh and the rest on second_mesh."""
    state = train.train(None, train.init_state(first_mesh), _step_fn(first_mesh), split)
    at_split = _host_state(state)
    state = jax.device_put(state, train.state_shardings(second_mesh))
    return at_split, _host_state(train.train(None, state, _step_fn(second_mesh), total))


@pytest.mark.parametrize("resume_mesh", [(4, 2), (2, 4)])
def test_resume_is_bit_exact(location, resume_mesh):
    mesh_a, mesh_b = train.make_mesh((4, 2)), train.make_mesh(resume_mesh)
    at_10, want = _reference(mesh_a, mesh_b, 10, 20)

    with ckpt.CheckpointManager(location("run"), save_interval_steps=5) as manager:
        train.train(manager, train.init_state(mesh_a), _step_fn(mesh_a), 10)
    with ckpt.CheckpointManager(location("run"), save_interval_steps=5) as manager:
        assert manager.all_steps() == [0, 5, 10]
        assert manager.metadata()["next_batch"] == 10
        state = train.restore_state(manager, mesh_b)
        _assert_states_equal(_host_state(state), at_10)
        assert state["params"]["layer1"]["w"].sharding == train.state_shardings(mesh_b)["params"]["layer1"]["w"]
        got = train.train(manager, state, _step_fn(mesh_b), 20)
        _assert_states_equal(_host_state(got), want)
        manager.wait()
        assert manager.all_steps() == [0, 5, 10, 15, 20]
        _assert_states_equal(_host_state(manager.restore(20, train.state_shardings(mesh_b))), want)
    assert not np.array_equal(want["params"]["layer1"]["w"], at_10["params"]["layer1"]["w"])


def test_train_example_resumes_on_another_mesh(tmp_path):
    """Local disk only: the example runs in processes of its own."""
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)  # the example sets up its 8 devices itself
    script = str(REPO / "examples" / "train.py")
    first = subprocess.run([sys.executable, script, "--dir", str(run), "--steps", "10"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    second = subprocess.run([sys.executable, script, "--dir", str(run), "--steps", "20", "--resume", "--mesh", "2x4"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "restored step 10" in second.stdout
    assert "now on mesh {'data': 2, 'model': 4}" in second.stdout

    mesh_b = train.make_mesh((2, 4))
    _, want = _reference(train.make_mesh((4, 2)), mesh_b, 10, 20)
    with ckpt.CheckpointManager(run) as manager:
        assert manager.all_steps() == [10, 15, 20]
        _assert_states_equal(_host_state(manager.restore(20, train.state_shardings(mesh_b))), want)
