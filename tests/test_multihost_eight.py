"""Eight processes under jax.distributed on 127.0.0.1 (issue 23): save and restore on local disk
and on SeaweedFS (S3) with every restored shard compared, resharding between 4 and 8 processes,
the figures each save reports (SaveHandle.stats), and a process SIGKILLed in the middle of a
save (nothing committed, the survivors' error names it).

The jobs (process start-up is most of the cost, so each does several things):
  four_a   4 processes x 2 devices: saves B (local disk).
  eight    8 processes x 1 device: restores B (4 -> 8); saves A on local disk and on S3 and
           restores both; then process 5 dies at its first chunk write of a save.
  four_b   4 processes x 2 devices: restores A (8 -> 4), local and S3.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ckpt
from multihost_data import bad_shards, build, die, hooked_writes, mesh_of, shardings_for
from multiproc import Worker, assert_all_succeeded, launch
from servers import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS

HERE = os.path.abspath(__file__)
BUCKET = "ckpt-eight"
TIMEOUT_S = 5  # CKPT_TIMEOUT_S of the jobs: below their jax heartbeat timeout (20 s)

# Sharded over the 8 processes, over both mesh axes, replicated, and small (packed) leaves.
A_ARRAYS = {
    "params/w": ((64, 48), np.float32, P("data", "model")),
    "params/v": ((128, 16), np.float32, P("data")),
    "params/r": ((64, 24), np.float32, P()),
    "opt/mu/w": ((64, 48), np.float32, P("data", "model")),
    "opt/norm": ((16,), np.float32, P()),
    "opt/bias": ((8,), np.float32, P("data")),
}
B_ARRAYS = {
    "params/w": ((32, 64), np.float32, P("data", "model")),
    "params/e": ((256, 8), np.float32, P("data")),
    "opt/s": ((24,), np.float32, P()),
}


def _check(w: Worker, tag: str, path: str, arrays: dict, mesh, seed: int) -> None:
    restored = ckpt.restore(path, mesh=mesh)
    bad, n = bad_shards(restored, arrays, shardings_for(arrays, mesh), seed=seed)
    w.report(check=tag, bad=bad, shards=n)


def run_four_a(w: Worker) -> None:
    mesh = mesh_of((4, 2))
    ckpt.save(f"{w.args['dir']}/b", build(B_ARRAYS, mesh, seed=2))
    _check(w, "b-on-4", f"{w.args['dir']}/b", B_ARRAYS, mesh, 2)


def run_eight(w: Worker) -> None:
    root, s3 = w.args["dir"], w.args["s3"]
    mesh = mesh_of((8, 1))
    _check(w, "b-on-8", f"{root}/b", B_ARRAYS, mesh, 2)  # saved by 4 processes

    for tag, path in (("local", f"{root}/a"), ("s3", f"{s3}/a")):
        handle = ckpt.save_async(path, build(A_ARRAYS, mesh, seed=1))
        handle.wait()
        w.report(check=f"stats-{tag}", stats=handle.stats)
        _check(w, f"a-{tag}", path, A_ARRAYS, mesh, 1)

    # Process 5 dies after its host copies, at its first chunk write.
    hooked = hooked_writes(die) if w.index == 5 else None
    w.survivors = [p for p in range(8) if p != 5]
    start = time.monotonic()
    try:
        ckpt.save(f"{root}/killed", build(A_ARRAYS, mesh, seed=3), options=hooked)
        w.report(check="killed", raised=None)
    except ckpt.CheckpointError as e:
        w.report(check="killed", raised=str(e), seconds=time.monotonic() - start,
                 entries=sorted(os.listdir(root)))


def run_four_b(w: Worker) -> None:
    mesh = mesh_of((4, 2))
    _check(w, "a-local-on-4", f"{w.args['dir']}/a", A_ARRAYS, mesh, 1)
    _check(w, "a-s3-on-4", f"{w.args['s3']}/a", A_ARRAYS, mesh, 1)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    with SeaweedFS(str(tmp_path_factory.mktemp("seaweedfs"))) as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, seaweed):
    root = tmp_path_factory.mktemp("eight")
    aws = tmp_path_factory.mktemp("aws")
    (aws / "credentials").write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                                     f"aws_secret_access_key = {SECRET_KEY}\n")
    (aws / "config").write_text(f"[default]\nregion = {REGION}\n")
    env = {"CKPT_TIMEOUT_S": str(TIMEOUT_S), **seaweed.env(),
           "AWS_SHARED_CREDENTIALS_FILE": str(aws / "credentials"), "AWS_CONFIG_FILE": str(aws / "config")}
    args = {"dir": str(root), "s3": f"s3://{BUCKET}/run"}
    out = {}
    for name, target, processes, devices in (("four_a", "run_four_a", 4, 2), ("eight", "run_eight", 8, 1),
                                             ("four_b", "run_four_b", 4, 2)):
        out[name] = launch(f"{HERE}:{target}", processes=processes, devices_per_process=devices, args=args,
                           env=env, timeout_s=420, heartbeat_timeout_s=20)
    return out


def _shards_ok(results, tag: str, arrays: dict, devices: int) -> None:
    for r in results:
        rec = r.one(tag)
        assert rec["bad"] == [], (tag, r.describe())
        assert rec["shards"] == len(arrays) * devices, (tag, rec)


def test_four_processes_save_and_eight_restore_every_shard(jobs):
    assert_all_succeeded(jobs["four_a"])
    _shards_ok(jobs["four_a"], "b-on-4", B_ARRAYS, 2)
    _shards_ok(jobs["eight"][:5] + jobs["eight"][6:], "b-on-8", B_ARRAYS, 1)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_eight_processes_save_and_restore_every_shard(jobs, where):
    survivors = jobs["eight"][:5] + jobs["eight"][6:]
    _shards_ok(survivors, f"a-{where}", A_ARRAYS, 1)
    assert_all_succeeded(jobs["four_b"])
    _shards_ok(jobs["four_b"], f"a-{where}-on-4", A_ARRAYS, 2)  # 8 -> 4 processes


@pytest.mark.parametrize("where", ["local", "s3"])
def test_each_save_reports_every_process_and_the_slowest(jobs, where):
    primary = jobs["eight"][0].one(f"stats-{where}")["stats"]
    table = primary["job"]["processes"]
    assert [row["process"] for row in table] == list(range(8))
    # Every byte written once, by one process: the job's bytes are the tree's (but for the
    # small replicated leaf, which the manifest holds inline).
    tree_bytes = sum(int(np.prod(shape)) * 4 for path, (shape, _, _) in A_ARRAYS.items() if path != "opt/norm")
    assert primary["job"]["bytes"] == sum(row["bytes"] for row in table) == tree_bytes
    assert primary["job"]["slowest"] in range(8) and primary["job"]["requests"] >= 8
    for row in table:
        assert row["write_s"] >= 0 and row["copy_s"] >= 0 and row["requests"] >= 0
    for r in jobs["eight"][1:5]:
        other = r.one(f"stats-{where}")["stats"]
        assert other["process"]["process"] == r.index
        assert other["job"]["slowest"] == primary["job"]["slowest"] and "processes" not in other["job"]


def test_sigkill_of_one_of_eight_commits_nothing_and_names_it(jobs):
    eight = jobs["eight"]
    assert eight[5].returncode == -signal.SIGKILL, eight[5].describe()
    for r in eight[:5] + eight[6:]:
        rec = r.one("killed")
        assert rec["raised"] and "process(es) [5]" in rec["raised"], rec
        assert "killed" not in rec["entries"] and not any(".tmp-" in e for e in rec["entries"]), rec
        assert rec["seconds"] < TIMEOUT_S + 12, rec  # the silence, then at most a few slices
    assert "nothing committed" in eight[0].one("killed")["raised"]
