"""CheckpointManager parity with Orbax's (issue 11): retention by metric and by time, the first
step and preemption saves, delete / read_only / reload / wait(timeout) / is_saving_in_progress,
restore options, step naming, Orbax step directories, damaged newest steps, and named items.

Tests that touch storage run on local disk and memory:// (the `location` fixture) unless they
need Orbax or signals (local disk / this process only)."""

import datetime
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt._manager.retention import StepFacts, best_step, steps_to_delete
from ckpt.cli._main import main
from support import PER_SHARD, Faults, flip_byte


def _values(step):
    return {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step * 1000,
            "b": np.full((8,), step, dtype=np.int32)}


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def _tree(step):
    mesh, v = _mesh(), _values(step)
    return {"w": jax.device_put(v["w"], NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(v["b"], NamedSharding(mesh, P())), "step": step}


def _check(restored, step):
    want = _values(step)
    assert restored["step"] == step
    for k, v in want.items():
        assert restored[k].dtype == v.dtype and np.array_equal(np.asarray(restored[k]), v), (step, k)


# ---- retention: pure decisions ------------------------------------------------------------------


def test_retention_by_metric_is_orbax_semantics():
    loss = {1: 5.0, 2: 1.0, 3: 4.0, 4: 0.5, 5: 3.0, 6: 2.0}
    facts = {s: StepFacts({"loss": v}) for s, v in loss.items()}
    by_loss = dict(facts=facts, best_fn=lambda m: m["loss"])
    # The 2 best (steps 4 and 2) and the newest (6) stay.
    assert steps_to_delete(list(loss), 2, **by_loss) == [1, 3, 5]
    assert steps_to_delete(list(loss), 2, **by_loss, best_mode="max") == [2, 4, 5]  # 1 and 3 best, 6 newest
    assert steps_to_delete(list(loss), None, **by_loss) == []
    assert steps_to_delete(list(loss), 2, 3, **by_loss) == [1, 5]  # step 3 is a multiple of 3
    assert best_step(list(loss), facts, lambda m: m["loss"], "min") == 4
    assert best_step(list(loss), facts, lambda m: m["loss"], "max") == 1
    # Steps without metrics: kept by default, deleted first otherwise.
    facts[7] = facts[8] = StepFacts(None)
    facts[9] = StepFacts({"loss": 9.0})
    steps = list(range(1, 10))
    assert steps_to_delete(steps, 2, **by_loss) == [1, 3, 5, 6]
    assert steps_to_delete(steps, 2, **by_loss, keep_checkpoints_without_metrics=False) == [1, 3, 5, 6, 7, 8]
    assert best_step(steps, facts, lambda m: m["loss"], "min") == 4
    assert best_step([7, 8], facts, lambda m: m["loss"], "min") is None
    # NaN (a diverged run) ranks worst in either mode.
    nan = {1: StepFacts({"loss": float("nan")}), 2: StepFacts({"loss": 1.0}), 3: StepFacts({"loss": 2.0})}
    assert steps_to_delete([1, 2, 3], 1, facts=nan, best_fn=lambda m: m["loss"]) == [1]
    assert steps_to_delete([1, 2, 3], 1, facts=nan, best_fn=lambda m: m["loss"], best_mode="max") == [1, 2]
    assert best_step([1, 2], nan, lambda m: m["loss"], "max") == 2


def test_retention_by_time_keeps_one_step_per_interval():
    created = {1: 0.0, 2: 10.0, 3: 59.0, 4: 61.0, 5: 100.0, 6: 125.0, 7: 130.0, 8: 131.0}
    facts = {s: StepFacts(None, t) for s, t in created.items()}
    # Oldest first, a step 60 s after the last one preserved: 1 (0 s), 4 (61 s), 6 (125 s).
    assert steps_to_delete(list(created), 1, facts=facts, keep_time_interval=60.0) == [2, 3, 5, 7]
    facts[4] = StepFacts(None, None)  # save time unknown: not preserved by time
    assert steps_to_delete(list(created), 1, facts=facts, keep_time_interval=60.0) == [2, 3, 4, 6, 7]


# ---- retention: a real manager ------------------------------------------------------------------


def test_best_fn_keeps_the_best_steps(location):
    loss = {1: 5.0, 2: 1.0, 3: 4.0, 4: 0.5, 5: 3.0, 6: 2.0}
    with ckpt.CheckpointManager(location("run"), max_to_keep=2, best_fn=lambda m: m["loss"],
                                best_mode="min") as manager:
        for step, value in loss.items():
            # metrics may be numpy / jax scalars: stored as Python numbers
            assert manager.save(step, _tree(step), metrics={"loss": np.float32(value), "acc": jnp.asarray(step / 10),
                                                            "phase": "train"})
        manager.wait()
        assert manager.all_steps() == [2, 4, 6]
        assert manager.best_step() == 4
        assert manager.metrics(4) == {"loss": 0.5, "acc": pytest.approx(0.4), "phase": "train"}
        assert type(manager.metrics(4)["loss"]) is float
        assert manager.metadata(4) == {}
        for step in manager.all_steps():
            _check(manager.restore(step), step)
        # A step without metrics is kept (keep_checkpoints_without_metrics defaults to True).
        manager.save(7, _tree(7), metadata={"note": "eval skipped"})
        manager.save(8, _tree(8), metrics={"loss": 9.0})
        manager.wait()
        assert manager.all_steps() == [2, 4, 7, 8]
        assert manager.metrics(7) is None and manager.metadata(7) == {"note": "eval skipped"}
        assert manager.best_step() == 4


def test_metrics_are_checked_when_saved(location):
    with ckpt.CheckpointManager(location("run"), best_fn=lambda m: m["loss"]) as manager:
        # Any JSON tree is accepted (nested metrics: tests/test_newcomer_api.py); an array is not.
        with pytest.raises(ckpt.CheckpointError, match=r"'hist' \(ndarray\) is not a number, a string"):
            manager.save(1, _tree(1), metrics={"loss": 1.0, "hist": np.arange(3)})
        with pytest.raises(ckpt.CheckpointError, match="key 3 is not a string"):
            manager.save(1, _tree(1), metrics={3: 1.0})
        with pytest.raises(ValueError, match="best_fn failed on the metrics of step 1"):
            manager.save(1, _tree(1), metrics={"acc": 1.0})
        with pytest.raises(ckpt.CheckpointError, match="'ckpt.metrics' is reserved"):
            manager.save(1, _tree(1), metadata={"ckpt.metrics": {}})
        with pytest.raises(TypeError, match="metrics for step 1 must be a dict"):
            manager.save(1, _tree(1), metrics=[1.0])
        assert manager.all_steps() == [] and manager.should_save(1)
    for kwargs, error in [({"best_mode": "lowest"}, ValueError), ({"best_fn": "loss"}, TypeError),
                          ({"keep_time_interval": -1}, ValueError), ({"keep_time_interval": "1h"}, TypeError),
                          ({"step_prefix": "a/b"}, ValueError), ({"step_format_fixed_length": 0}, ValueError)]:
        with pytest.raises(error, match=next(iter(kwargs))):
            ckpt.CheckpointManager(location("run2"), **kwargs)


def test_keep_time_interval_uses_the_saved_times(location):
    with ckpt.CheckpointManager(location("run"), max_to_keep=1,
                                keep_time_interval=datetime.timedelta(hours=1)) as manager:
        for step in range(1, 5):
            manager.save(step, _tree(step))
    # All saved within the hour: the oldest is the one kept for the interval, plus the newest.
    assert manager.all_steps() == [1, 4]
    _check(manager.restore(1), 1)
    _check(manager.restore(4), 4)


# ---- save policy ----------------------------------------------------------------------------------


def test_first_step_is_saved_then_the_interval(location):
    with ckpt.CheckpointManager(location("run"), save_interval_steps=10) as manager:
        assert manager.save(3, _tree(3))  # the first step of an empty directory
        assert not manager.save(4, _tree(4))
        assert manager.save(10, _tree(10))
    with ckpt.CheckpointManager(location("run"), save_interval_steps=10) as manager:
        assert not manager.save(11, _tree(11))  # not empty any more
        assert manager.all_steps() == [3, 10]
        _check(manager.restore(3), 3)


def test_preemption_sync_point_saves_off_interval(location, monkeypatch):
    from jax.experimental import multihost_utils

    asked = []

    def sync_point(step):
        asked.append(step)
        return step == 13

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", sync_point)
    with ckpt.CheckpointManager(location("run"), save_interval_steps=10) as manager:
        for step in range(13):
            manager.save(step, _tree(step))
        assert manager.save(13, _tree(13))
        assert not manager.is_saving_in_progress()  # committed before save returned
        assert manager.all_steps() == [0, 10, 13]
        assert manager.reached_preemption(13)
        assert asked.count(13) == 1  # asked once per step
    _check(ckpt.restore(manager.step_path(13)), 13)


def test_sigterm_saves_the_next_step_then_reaches_the_previous_handler(tmp_path, sigterm_recorder):
    """This process only: SIGTERM to itself, with a Python handler standing in for the default."""
    received, recorder = sigterm_recorder
    manager = ckpt.CheckpointManager(tmp_path / "run", save_interval_steps=100)
    assert signal.getsignal(signal.SIGTERM) is recorder  # not watched before the first save
    assert manager.save(0, _tree(0))
    assert signal.getsignal(signal.SIGTERM) is not recorder
    assert not manager.save(4, _tree(4))
    assert not manager.save(5, _tree(5))
    os.kill(os.getpid(), signal.SIGTERM)
    assert received == []  # held for the manager: the loop calls it at every step (4, 5)
    assert manager.should_save(6)
    assert manager.save(6, _tree(6))  # off-interval, committed on return
    assert received == [signal.SIGTERM]  # then handed on
    assert manager.all_steps() == [0, 6]
    assert not manager.should_save(7)
    assert signal.getsignal(signal.SIGTERM) is recorder  # put back when the notice was handed on
    manager.close()
    assert received == [signal.SIGTERM]
    os.kill(os.getpid(), signal.SIGTERM)  # our handler is gone: the previous one gets it
    assert received == [signal.SIGTERM] * 2
    _check(ckpt.restore(manager.step_path(6)), 6)


def test_sigterm_no_save_consumed_is_handed_on_at_close(tmp_path, sigterm_recorder):
    received, recorder = sigterm_recorder
    manager = ckpt.CheckpointManager(tmp_path / "run", save_interval_steps=100)
    manager.save(0, _tree(0))
    assert not manager.reached_preemption(0)  # the loop asks: a notice is held for it
    os.kill(os.getpid(), signal.SIGTERM)
    assert manager.reached_preemption(1) and received == []
    manager.close()
    assert received == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is recorder
    assert manager.all_steps() == [0]
    # A second SIGTERM while one is held goes on at once.
    with ckpt.CheckpointManager(tmp_path / "run2", save_interval_steps=100) as manager:
        manager.save(0, _tree(0))
        assert not manager.reached_preemption(0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM] * 2 and signal.getsignal(signal.SIGTERM) is recorder
    assert received == [signal.SIGTERM] * 2  # nothing left to hand on at close


# ---- delete, read_only, reload, wait, restore options ----------------------------------------------


def test_delete(location):
    with ckpt.CheckpointManager(location("run")) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step))
        manager.delete(3)  # waits for the save in flight
        assert manager.all_steps() == [1, 2]
        with pytest.raises(FileNotFoundError, match=r"step 3 .*committed steps: \[1, 2\]"):
            manager.delete(3)
        with pytest.raises(FileNotFoundError, match="step 3"):
            manager.restore(3)
        assert manager.latest_step() == 2 and manager.should_save(3)
        _check(manager.restore(), 2)
    assert [n for n in location.names("run") if n.startswith("step_")] == ["step_00000001", "step_00000002"]


def test_read_only_neither_saves_nor_deletes_nor_locks(location):
    writer = ckpt.CheckpointManager(location("run"), max_to_keep=1)
    writer.save(1, _tree(1))
    writer.wait()
    reader = ckpt.CheckpointManager(location("run"), read_only=True, max_to_keep=1)
    with pytest.raises(ckpt.CheckpointError, match="read-only"):
        reader.save(2, _tree(2))
    with pytest.raises(ckpt.CheckpointError, match="read-only"):
        reader.delete(1)
    writer.save(2, _tree(2))  # the reader holds no lock
    writer.close()
    assert reader.all_steps() == [2]
    _check(reader.restore(), 2)
    reader.close()


def test_reload_sees_steps_saved_elsewhere(location):
    first = ckpt.CheckpointManager(location("run"))
    with ckpt.CheckpointManager(location("run")) as other:
        other.save(5, _tree(5))
    assert first.should_save(5)  # decided from the directory as it was when opened
    first.reload()
    assert not first.should_save(5) and not first.save(5, _tree(5))
    assert first.save(6, _tree(6))
    first.close()
    assert first.all_steps() == [5, 6]


def test_wait_timeout_and_is_saving_in_progress(location):
    faults = Faults()
    manager = ckpt.CheckpointManager(location("run"), options=faults.options())
    gate = faults.hold("commit", times=1)
    assert not manager.is_saving_in_progress()
    manager.save(1, _tree(1))
    assert gate.entered.wait(30)
    assert manager.is_saving_in_progress()
    with pytest.raises(TimeoutError, match="step 1 .*still running"):
        manager.wait(timeout=0.05)
    gate.release.set()
    manager.wait(timeout=60)
    assert not manager.is_saving_in_progress()
    manager.close()
    _check(manager.restore(1), 1)


def test_restore_passes_verify_and_options(location):
    with ckpt.CheckpointManager(location("run"), options=PER_SHARD) as manager:
        manager.save(1, _tree(1))
    step = location.storage("run", "step_00000001")
    chunk = next(k for k in _keys(step) if "w/c/" in k)
    flip_byte(step, chunk, byte=0)
    with pytest.raises(ckpt.ChecksumError):
        manager.restore(1)
    got = manager.restore(1, verify=False)
    assert not np.array_equal(got["w"], _values(1)["w"]) and np.array_equal(got["b"], _values(1)["b"])
    faults = Faults()
    manager.restore(1, verify=False, options=faults.options())
    assert faults.calls["read_chunk"] > 0  # this restore went through the given options


def _keys(storage, prefix=""):
    from support import keys

    return keys(storage, prefix)


def test_budget_keywords_map_onto_options(location):
    manager = ckpt.CheckpointManager(location("run"), host_budget_bytes=3 << 20, max_chunk_bytes=1 << 20,
                                     options=ckpt.Options(io_concurrency=3))
    assert (manager.options.host_budget_bytes, manager.options.max_chunk_bytes) == (3 << 20, 1 << 20)
    assert manager.options.io_concurrency == 3
    manager.save(1, _tree(1))
    manager.close()
    _check(manager.restore(1), 1)


# ---- naming, Orbax directories, damaged steps ------------------------------------------------------


def test_step_naming(location):
    with ckpt.CheckpointManager(location("run"), step_prefix=None, step_format_fixed_length=None) as manager:
        manager.save(7, _tree(7))
        manager.save(12, _tree(12))
    assert location.names("run")[:2] == ["12", "7"]
    assert manager.step_path(7) == location("run", "7")
    with ckpt.CheckpointManager(location("run"), step_prefix="ckpt", step_format_fixed_length=4) as manager:
        assert manager.all_steps() == [7, 12]  # steps under other names are found too
        _check(manager.restore(7), 7)
        manager.save(13, _tree(13))
    assert "ckpt_0013" in location.names("run")
    _check(ckpt.restore(location("run", "ckpt_0013")), 13)
    # With the default naming, `<n>` and `step_<n>` are steps; other checkpoints kept in the
    # directory (`ckpt_0013` here is one) are not, and retention leaves them alone.
    ckpt.save(location("run", "best_model_3"), _tree(3))
    with ckpt.CheckpointManager(location("run"), max_to_keep=1) as manager:
        assert manager.all_steps() == [7, 12]
        manager.save(14, _tree(14))
    assert manager.all_steps() == [14]
    assert sorted(n for n in location.names("run") if "_" in n) == ["best_model_3", "ckpt_0013", "step_00000014"]
    _check(ckpt.restore(location("run", "best_model_3")), 3)


def test_damaged_newest_step_is_skipped(location):
    with ckpt.CheckpointManager(location("run")) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step))
    flip_byte(location.storage("run", "step_00000003"), "manifest.msgpack")
    manager = ckpt.CheckpointManager(location("run"))
    with pytest.warns(RuntimeWarning, match=r"step 3 at .*step_00000003 is damaged"):
        assert manager.latest_step() == 2
    assert manager.all_steps() == [1, 2, 3]
    _check(manager.restore(), 2)
    with pytest.raises(ckpt.CheckpointError):
        manager.restore(3)
    manager.close()


def test_orbax_manager_directory(tmp_path):
    import orbax.checkpoint as ocp

    directory = tmp_path / "orbax"
    options = ocp.CheckpointManagerOptions(max_to_keep=5, best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(directory, options=options) as m:
        for step in (10, 20):
            host = _values(step)
            m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": host["w"], "b": host["b"]}),
                                                 meta=ocp.args.JsonSave({"step": step})),
                   metrics={"loss": step / 100})
        m.wait_until_finished()
    assert sorted(os.listdir(directory)) == ["10", "20"]
    with ckpt.CheckpointManager(directory, max_to_keep=2, save_interval_steps=10) as manager:
        assert manager.all_steps() == [10, 20] and manager.latest_step() == 20
        state = manager.restore(20, item="state")
        assert np.array_equal(state["w"], _values(20)["w"]) and np.array_equal(state["b"], _values(20)["b"])
        assert manager.restore(10, item="meta") == {"step": 10}
        assert manager.metrics(20) == {"loss": 0.2}
        assert not manager.save(20, _tree(20))  # the Orbax step is a step
        assert manager.save(30, _tree(30))
        manager.wait()
        assert manager.all_steps() == [20, 30]  # retention removed Orbax's step 10
        _check(manager.restore(), 30)
        assert np.array_equal(manager.restore(20, item="state")["w"], _values(20)["w"])
    assert sorted(os.listdir(directory)) == ["20", "step_00000030"]


# ---- items ------------------------------------------------------------------------------------------


def _items(step):
    return {"state": _tree(step),
            "data_iterator": {"position": 17 * step, "grain": b'{"next_index": 17}',
                              "shuffle": np.arange(2048, dtype=np.int64) + step},
            "config": {"lr": 0.1, "name": "run-a"}}


def test_items_restore_alone(location):
    faults = Faults()
    with ckpt.CheckpointManager(location("run"), options=faults.options(pack_limit_bytes=0)) as manager:
        manager.save(4, _items(4))
        manager.wait()
        faults.log.clear()
        it = manager.restore(4, item="data_iterator")
        assert it["position"] == 68 and it["grain"] == b'{"next_index": 17}'
        assert np.array_equal(it["shuffle"], np.arange(2048, dtype=np.int64) + 4)
        reads = [where for op, where in faults.log if op == "read_chunk"]
        assert reads and all("data_iterator" in w for w in reads)  # nothing of "state" was read
        assert manager.restore(4, item="config") == {"lr": 0.1, "name": "run-a"}
        state = manager.restore(4, item="state", mesh=_mesh())
        _check(state, 4)
        assert state["w"].sharding.spec == P("data", "model")
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) else x, _tree(0))
        _check(manager.restore(4, target, item="state"), 4)
        with pytest.raises(ckpt.TreeMismatchError):
            manager.restore(4, {"w": target["w"]}, item="state")
        assert set(manager.restore(4, {"w": target["w"]}, item="state", partial=True)) == {"w"}
        with pytest.raises(KeyError, match=r"no item 'optimizer'; its items: \['config', 'data_iterator', 'state'\]"):
            manager.restore(4, item="optimizer")
        whole = manager.restore(4)
        assert set(whole) == {"state", "data_iterator", "config"}
        _check(whole["state"], 4)


# ---- ckpt inspect ------------------------------------------------------------------------------------


def test_inspect_shows_metrics(location, capsys):
    with ckpt.CheckpointManager(location("run")) as manager:
        manager.save(1, _tree(1), metrics={"loss": 0.5, "split": "val"}, metadata={"epoch": 2})
    assert main(["inspect", manager.step_path(1)]) == 0
    out = capsys.readouterr().out
    assert "metrics: loss=0.5, split='val'" in out and "user_metadata: {'epoch': 2}" in out
    assert main(["inspect", "--json", manager.step_path(1)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["metrics"] == {"loss": 0.5, "split": "val"} and doc["user_metadata"] == {"epoch": 2}
