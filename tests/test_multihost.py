"""Multi-process save and restore under jax.distributed, with real processes on 127.0.0.1.

The jobs, most reused for several checks (process start-up is most of the cost):
  save_job     2 processes x 4 devices: saves X; a plan mismatch, a planning error, an existing
               destination, a write failure on one process; a manager with retention.
  job_4x2      4 processes x 2 devices: restores X on other meshes; saves Y; a replicated tree Z.
  job_2x4      2 processes x 4 devices: restores Y.
  sigkill_job  3 processes x 2 devices: a save that outlasts the timeout (all alive) succeeds;
               then one process SIGKILLs itself in the middle of a save.
  preemption   2 processes x 4 devices, once per victim: a manager in a training loop; one
               process gets SIGTERM, and every process saves the same (sync point) step.
The `run_*` functions run inside the processes (see multiproc.py) and report what they saw; the
tests assert on those reports. This process (1 x 8 devices) restores X and Y once more.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from multihost_data import (
    R_ARRAYS, R_CHUNK_BYTES, X_ARRAYS, Y_ARRAYS, Z_KIB, die, disk_full, hooked_writes, no_op, stall_once,
    tmp_entries, bad_shards, build, mesh_of, reshard_check, restore_checks, shardings_for, values, x_tree,
)
from multiproc import Worker, assert_all_succeeded, launch

HERE = os.path.abspath(__file__)
TIMEOUT_ENV = {"CKPT_TIMEOUT_S": "10"}  # below the jobs' jax heartbeat timeout (multiproc.py)

# ---- code run inside the processes -----------------------------------------------------------


def run_save_job(w: Worker) -> None:
    root = w.args["dir"]
    mesh = mesh_of((2, 4))
    ckpt.save(f"{root}/x", x_tree(mesh))
    w.report(check="save-x")

    mismatched = x_tree(mesh)
    if w.index == 1:
        mismatched["params"]["extra"] = jnp.zeros(8)
    try:
        ckpt.save(f"{root}/mismatch", mismatched)
        w.report(check="mismatch", raised=None)
    except ckpt.CheckpointError as e:
        w.barrier("mismatch-done")
        w.report(check="mismatch", raised=str(e), exists=os.path.exists(f"{root}/mismatch"), tmp=tmp_entries(root))

    unplannable = x_tree(mesh)
    if w.index == 1:
        unplannable["opt"]["schedule"] = object()
    try:
        ckpt.save(f"{root}/unplannable", unplannable)
        w.report(check="plan-error", raised=None)
    except ckpt.CheckpointError as e:
        w.report(check="plan-error", raised=str(e), exists=os.path.exists(f"{root}/unplannable"))

    try:
        ckpt.save(f"{root}/x", x_tree(mesh, seed=1))  # exists, and no overwrite=True
        w.report(check="exists", raised=None)
    except OSError as e:
        w.report(check="exists", raised=type(e).__name__, tmp=tmp_entries(root))

    hooked = hooked_writes(disk_full if w.index == 1 else no_op)
    try:
        ckpt.save(f"{root}/x", x_tree(mesh, seed=1), overwrite=True, options=hooked)
        w.report(check="write-failure", raised=None)
    except (ckpt.CheckpointError, OSError) as e:
        w.barrier("write-failure-done")
        survivor = ckpt.restore(f"{root}/x")
        bad, _ = bad_shards(survivor, X_ARRAYS)
        w.report(check="write-failure", raised=f"{type(e).__name__}: {e}", tmp=tmp_entries(root), bad=bad,
                 step=survivor["step"])

    manager_dir = f"{root}/run"
    with ckpt.CheckpointManager(manager_dir, max_to_keep=2) as mgr:
        for step in range(1, 5):
            mgr.save(step, build(X_ARRAYS, mesh, seed=step))
    w.barrier("manager-closed")
    with ckpt.CheckpointManager(manager_dir) as mgr:
        steps = mgr.all_steps()
        bad, n = bad_shards(mgr.restore(mesh=mesh), X_ARRAYS, shardings_for(X_ARRAYS, mesh), seed=4)
        w.report(check="manager", steps=steps, bad=bad, shards=n, entries=sorted(os.listdir(manager_dir)))

    from jax._src.distributed import global_state

    w.barrier("before-kv-listing")
    w.report(check="kv", keys=sorted(k for k, _ in global_state.client.key_value_dir_get("jax_ckpt/")))


def run_job_4x2(w: Worker) -> None:
    root = w.args["dir"]
    mesh = mesh_of((4, 2))
    restore_checks(w, "x-on-4x2", f"{root}/x", X_ARRAYS, mesh)
    ckpt.save(f"{root}/y", build(Y_ARRAYS, mesh))
    w.report(check="save-y")
    ckpt.save(f"{root}/r", build(R_ARRAYS, mesh), options=ckpt.Options(max_chunk_bytes=R_CHUNK_BYTES))
    reshard_check(w, "r-on-2x4", f"{root}/r")

    replicated = NamedSharding(mesh, P())
    z = {f"r{i}": jax.device_put(values(f"r{i}", (kib * 256,), np.float32), replicated) for i, kib in enumerate(Z_KIB)}
    written = []
    ckpt.save(f"{root}/z", z, options=hooked_writes(lambda data: written.append(data.nbytes)))
    w.report(check="balanced", bytes=sum(written), chunks=len(written))
    restored = ckpt.restore(f"{root}/z")
    bad = [k for k in z if not np.array_equal(restored[k], values(k, (Z_KIB[int(k[1:])] * 256,), np.float32))]
    w.report(check="z-restored", bad=bad)


def run_job_2x4(w: Worker) -> None:
    restore_checks(w, "y-on-2x4", f"{w.args['dir']}/y", Y_ARRAYS, mesh_of((2, 4)))
    reshard_check(w, "r-on-2x4", f"{w.args['dir']}/r")


def run_sigkill_job(w: Worker) -> None:
    root = w.args["dir"]
    mesh = mesh_of((3, 2))
    arrays = {"w": ((24, 16), np.float32, P("data", "model")), "b": ((1536,), np.float32, P())}
    ckpt.save(f"{root}/step_1", build(arrays, mesh, seed=1))
    w.report(check="step-1")

    # A process busy for longer than the timeout is alive, not missing: its first write stalls.
    hooked = hooked_writes(stall_once(1.5 * float(os.environ["CKPT_TIMEOUT_S"])) if w.index == 1 else no_op)
    start = time.monotonic()
    ckpt.save(f"{root}/slow", build(arrays, mesh, seed=3), options=hooked)
    elapsed = time.monotonic() - start
    w.report(check="slow-save", seconds=elapsed, bad=bad_shards(ckpt.restore(f"{root}/slow"), arrays, seed=3)[0])

    # process 2 dies after its host copies, at its first chunk write
    hooked = hooked_writes(die) if w.index == 2 else None
    w.survivors = [0, 1]
    start = time.monotonic()
    try:
        ckpt.save(f"{root}/step_2", build(arrays, mesh, seed=2), options=hooked)
        w.report(check="killed-save", raised=None)
        return
    except ckpt.CheckpointError as e:
        elapsed, message = time.monotonic() - start, str(e)
    w.barrier("survivors-raised", 30, [0, 1])
    tree = ckpt.restore(f"{root}/step_1", mesh=mesh)
    bad, n = bad_shards(tree, arrays, shardings_for(arrays, mesh), seed=1)
    bad_np, _ = bad_shards(ckpt.restore(f"{root}/step_1"), arrays, seed=1)
    w.report(check="killed-save", raised=message, seconds=elapsed, entries=sorted(os.listdir(root)),
             bad=bad + bad_np, shards=n)


PREEMPT_ARRAYS = {"w": ((16, 32), np.float32, P("data", "model")), "b": ((40,), np.float32, P())}
PREEMPT_NOTICE_STEP = 5


def run_preemption_job(w: Worker) -> None:
    # A training loop with a manager whose interval never comes due; one process receives the
    # scheduler's SIGTERM at step 5. JAX's preemption service turns it into a sync point that
    # every process reaches at the same step: the manager saves that step there, and the loop
    # stops after it.
    mesh = mesh_of((2, 4))
    manager = ckpt.CheckpointManager(w.args["dir"], save_interval_steps=10_000)
    saved, step = [], 0
    for step in range(1, 400):
        tree = build(PREEMPT_ARRAYS, mesh, seed=step)
        if step == PREEMPT_NOTICE_STEP and w.index == w.args["victim"]:
            os.kill(os.getpid(), signal.SIGTERM)
        if manager.save(step, tree):
            saved.append(step)
        if manager.reached_preemption(step):
            manager.wait()
            break
        time.sleep(0.02)
    restored = manager.restore(step, mesh=mesh)
    bad, n = bad_shards(restored, PREEMPT_ARRAYS, shardings_for(PREEMPT_ARRAYS, mesh), seed=step)
    w.report(check="preempted", stopped=step, saved=saved, steps=manager.all_steps(), bad=bad, shards=n)
    manager.close()


# ---- the tests -------------------------------------------------------------------------------


def _job(target: str, processes: int, devices: int, root, env=TIMEOUT_ENV, **kw):
    return launch(f"{HERE}:{target}", processes=processes, devices_per_process=devices,
                  args={"dir": str(root)}, env=env, **kw)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("multihost")


@pytest.fixture(scope="module")
def save_job(root):
    results = _job("run_save_job", 2, 4, root)
    assert_all_succeeded(results)
    return results


@pytest.fixture(scope="module")
def job_4x2(root, save_job):
    results = _job("run_job_4x2", 4, 2, root)
    assert_all_succeeded(results)
    return results


@pytest.fixture(scope="module")
def job_2x4(root, job_4x2):
    results = _job("run_job_2x4", 2, 4, root)
    assert_all_succeeded(results)
    return results


def _all_restored(results, tag: str, arrays: dict, devices_per_process: int) -> None:
    for r in results:
        for variant in ("mesh", "swapped"):
            rec = r.one(f"{tag}-{variant}")
            assert rec["bad"] == [], r.describe()
            assert rec["shards"] == len(arrays) * devices_per_process, r.describe()


def test_save_2x4_restore_4x2_other_mesh(job_4x2):
    _all_restored(job_4x2, "x-on-4x2", X_ARRAYS, 2)
    for r in job_4x2:
        per_leaf = r.one("x-on-4x2-mesh")["per_leaf"]
        # Each process reads only the saved chunks its own devices overlap. params/w: it needs
        # 8 of 32 rows; the 2x4 save cut 16-row chunks, so it reads 16 rows (4 of 8 chunks).
        assert per_leaf["params/w"] == [2 * 8 * 64 * 4, 8 * 64 * 4]
        # params/emb: 2 of the 8 column blocks, which are exactly 2 saved chunks.
        assert per_leaf["params/emb"] == [16 * 12 * 4, 16 * 12 * 4]
        # replicated leaves are needed whole; on 4 processes they are read once in total, by one
        # of them (docs/multihost.md, "Replicated state"; tests/test_shared_restore.py)
        assert per_leaf["opt/mu"][1] == 32 * 64 * 4
    assert sum(r.one("x-on-4x2-mesh")["per_leaf"]["opt/mu"][0] for r in job_4x2) == 32 * 64 * 4


def test_save_4x2_restore_2x4(job_2x4):
    _all_restored(job_2x4, "y-on-2x4", Y_ARRAYS, 4)


@pytest.mark.parametrize("processes", [2, 4])
def test_plan_equals_what_a_4x2_to_2x4_reshard_reads(root, job_4x2, job_2x4, processes):
    """`ckpt plan` predicts each process's reads of a real multi-process restore exactly, and
    with chunks cut at most R_CHUNK_BYTES each process reads at most 1.1x what it needs."""
    import json
    import subprocess
    import sys

    results = job_2x4 if processes == 2 else job_4x2
    path = str(root / "r")
    meta = ckpt.metadata(path)["r"]
    for name, (shape, dtype, _) in R_ARRAYS.items():  # the save cut its shards into small chunks
        chunk = meta[name.split("/")[1]].chunk_shape
        assert np.prod(chunk) * np.dtype(dtype).itemsize <= R_CHUNK_BYTES, (name, chunk)
    doc = json.loads(subprocess.run(
        [sys.executable, "-m", "ckpt", "plan", path, "--mesh", "data=2,model=4", "--processes", str(processes),
         "--json"], capture_output=True, text=True, timeout=120, check=True).stdout)
    for r, planned in zip(results, doc["per_process"]):
        got = r.one("r-on-2x4")
        assert got["bad"] == [] and got["shards"] == len(R_ARRAYS) * 8 // processes, r.describe()
        assert (planned["bytes_read"], planned["bytes_needed"], planned["chunks_read"]) == (
            got["bytes_read"], got["bytes_needed"], got["chunks_read"]), (planned, got)
        assert planned["read_amplification"] <= 1.1, planned


@pytest.mark.parametrize("which", ["x", "y"])
def test_restore_on_one_process_and_as_numpy(root, job_4x2, which):
    arrays = X_ARRAYS if which == "x" else Y_ARRAYS
    mesh = Mesh(np.array(jax.devices()).reshape(1, 8), ("data", "model"))
    path = str(root / which)
    bad, n = bad_shards(ckpt.restore(path, mesh=mesh), arrays, shardings_for(arrays, mesh))
    assert bad == [] and n == 8 * len(arrays)
    bad, n = bad_shards(ckpt.restore(path), arrays)
    assert bad == [] and n == len(arrays)
    if which == "x":
        tree = ckpt.restore(path)
        assert np.array_equal(tree["table"], values("table", (64, 40), np.float64))
        assert (tree["step"], tree["name"]) == (7, "run-x")


def test_replicated_writes_are_balanced(job_4x2):
    unique = sum(kib * 1024 for kib in Z_KIB)
    written = [r.one("balanced")["bytes"] for r in job_4x2]
    assert sum(written) == unique  # every leaf written once, by one process
    assert sum(r.one("balanced")["chunks"] for r in job_4x2) == len(Z_KIB)
    for share in written:
        assert 0.20 <= share / unique <= 0.30, written
    assert all(r.one("z-restored")["bad"] == [] for r in job_4x2)


def test_plan_mismatch_commits_nothing(save_job):
    for r in save_job:
        rec = r.one("mismatch")
        assert rec["raised"] and "disagree" in rec["raised"] and "[1]" in rec["raised"], rec
        assert rec["exists"] is False and rec["tmp"] == []


def test_planning_error_on_one_process_is_raised_on_all(save_job):
    own, other = save_job[1].one("plan-error"), save_job[0].one("plan-error")
    assert own["raised"] and "'opt/schedule'" in own["raised"] and "builtins.object" in own["raised"], own
    assert other["raised"] and "process(es) [1] could not plan the save" in other["raised"], other
    assert "'opt/schedule'" in other["raised"] and not other["exists"] and not own["exists"]


def test_existing_destination_is_refused_on_all(save_job):
    for r in save_job:
        assert r.one("exists") == {"check": "exists", "raised": "FileExistsError", "tmp": []}


def test_timeout_setting_is_validated(monkeypatch):
    from ckpt._distributed import DEFAULT_TIMEOUT_S, coordination_timeout

    monkeypatch.delenv("CKPT_TIMEOUT_S", raising=False)
    assert coordination_timeout() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("CKPT_TIMEOUT_S", "2.5")
    assert coordination_timeout() == 2.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("CKPT_TIMEOUT_S", bad)
        with pytest.raises(ckpt.CheckpointError, match="CKPT_TIMEOUT_S"):
            coordination_timeout()


def test_write_failure_on_one_process_keeps_previous_checkpoint(save_job):
    for r in save_job:
        rec = r.one("write-failure")
        assert rec["raised"] and "No space left on device" in rec["raised"], rec
        assert rec["bad"] == [] and rec["step"] == 7 and rec["tmp"] == [], rec
    assert "process 1" in save_job[0].one("write-failure")["raised"]


def test_manager_retention_across_two_processes(save_job):
    for r in save_job:
        rec = r.one("manager")
        assert rec["steps"] == [3, 4] and rec["entries"] == ["step_00000003", "step_00000004"], rec
        assert rec["bad"] == [] and rec["shards"] == 4 * len(X_ARRAYS)


def test_coordination_keys_are_removed_after_saves(save_job):
    for r in save_job:
        assert r.one("kv")["keys"] == ["jax_ckpt/alive/0", "jax_ckpt/alive/1"]


def test_sigkill_mid_save_fails_survivors_and_keeps_previous_step(tmp_path):
    timeout_s = 4
    results = _job("run_sigkill_job", 3, 2, tmp_path, env={"CKPT_TIMEOUT_S": str(timeout_s)}, timeout_s=90,
                   heartbeat_timeout_s=20)
    assert results[2].returncode == -signal.SIGKILL, results[2].describe()
    assert results[2].one("step-1")
    for r in results:  # a save that outlasts the timeout, with every process alive, succeeds
        rec = r.one("slow-save")
        assert rec["seconds"] > 1.5 * timeout_s and rec["bad"] == [], rec
    for r in results[:2]:
        assert r.returncode == 0, r.describe()
        rec = r.one("killed-save")
        assert rec["raised"] and "process(es) [2]" in rec["raised"], rec
        # they waited out the silence, and raised long before jax's heartbeat timeout (20 s)
        assert timeout_s <= rec["seconds"] < timeout_s + 8, rec
        assert rec["entries"] == ["slow", "step_1"], rec  # no step_2; the primary removed its temp dir
        assert rec["bad"] == [] and rec["shards"] == 2 * 2, rec
    assert "nothing committed" in results[0].one("killed-save")["raised"]


@pytest.mark.parametrize("victim", [0, 1])
def test_preemption_notice_on_one_process_saves_the_same_step_on_all(tmp_path, victim):
    results = launch(f"{HERE}:run_preemption_job", processes=2, devices_per_process=4,
                     args={"dir": str(tmp_path), "victim": victim}, env=TIMEOUT_ENV, timeout_s=120)
    assert_all_succeeded(results)  # the SIGTERM was a notice: no process was killed by it
    recs = [r.one("preempted") for r in results]
    stopped = recs[0]["stopped"]
    assert stopped > PREEMPT_NOTICE_STEP and all(rec["stopped"] == stopped for rec in recs), recs
    for rec in recs:  # the first step (a manager saves it) and the sync point's step, nothing else
        assert rec["saved"] == [1, stopped] and rec["steps"] == [1, stopped], rec
        assert rec["bad"] == [] and rec["shards"] == 4 * len(PREEMPT_ARRAYS), rec
    bad, n = bad_shards(ckpt.CheckpointManager(str(tmp_path), read_only=True).restore(stopped), PREEMPT_ARRAYS,
                        seed=stopped)
    assert bad == [] and n == len(PREEMPT_ARRAYS)
