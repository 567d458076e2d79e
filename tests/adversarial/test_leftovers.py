"""Leftovers of saves: only provably dead ones are removed, by the next save and by `ckpt clean`;
`ckpt ls` shows which is which; opening a manager changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli._main import main as cli_main
from support import Location, plant_dead_save, snapshot


def _tree(v=1.0):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    return {"w": jax.device_put(np.full((64, 32), v, np.float32), NamedSharding(mesh, P("data"))), "v": v}


HOLDER = textwrap.dedent("""
    import sys, time
    from ckpt.storage._local import LocalStorage
    from ckpt._commit import commit_for
    staged = commit_for(LocalStorage(sys.argv[1], 4)).stage(overwrite=False)   # lock held, owner record written
    print(staged.storage.where(""), flush=True)
    time.sleep(600)
""")


def _clean(capsys, *args) -> list[dict]:
    assert cli_main(["clean", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_local_only_dead_temporary_directories_are_removed(tmp_path, capsys):
    """POSIX only: a live save in another process (its lock held), a dead one, a fresh one
    without an owner record yet, and a user's directory that merely looks similar."""
    ckpt.save(tmp_path / "a", _tree())
    run = Location.make("local", tmp_path).storage()
    plant_dead_save(run, "b.tmp-0123456789ab")
    os.mkdir(tmp_path / "c.tmp-abcdefabcdef")  # just created: no owner record yet
    os.mkdir(tmp_path / "notes.tmp-mine")  # not a name the library gives: never touched
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "d")], env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        live = holder.stdout.readline().strip()
        assert os.path.isdir(live)
        before = snapshot(run)
        manager = ckpt.CheckpointManager(tmp_path)  # opening, listing and reading change nothing
        manager.all_steps()
        assert snapshot(run) == before
        assert cli_main(["ls", str(tmp_path)]) == 0
        listing = capsys.readouterr().out
        assert "b.tmp-0123456789ab  (leftover of a dead save" in listing
        assert f"{os.path.basename(live)}  (in use: a save in progress holds its lock (pid {holder.pid}" in listing
        dry = _clean(capsys, tmp_path, "--dry-run")
        assert {os.path.basename(r["path"]): r["dead"] for r in dry} == {
            "b.tmp-0123456789ab": True, "c.tmp-abcdefabcdef": False, os.path.basename(live): False}
        assert snapshot(run) == before
        done = _clean(capsys, tmp_path)
        assert [os.path.basename(r["path"]) for r in done if r["removed"]] == ["b.tmp-0123456789ab"]
        assert sorted(os.listdir(tmp_path)) == sorted(["a", "c.tmp-abcdefabcdef", "notes.tmp-mine",
                                                       os.path.basename(live)])
    finally:
        holder.kill()
        holder.wait()
    # Its owner is gone: the next save beside it removes it (a save_async leftover too).
    ckpt.save(tmp_path / "e", _tree())
    assert sorted(os.listdir(tmp_path)) == ["a", "c.tmp-abcdefabcdef", "e", "notes.tmp-mine"]
    # The unowned one goes once it is older than the grace period.
    old = time.time() - 3600
    os.utime(tmp_path / "c.tmp-abcdefabcdef", (old, old))
    assert [r["removed"] for r in _clean(capsys, tmp_path)] == [True]
    assert sorted(os.listdir(tmp_path)) == ["a", "e", "notes.tmp-mine"]


def test_object_store_generations_are_judged_by_their_owner_records(capsys):
    """memory://: a dead generation in an uncommitted step, a stale one inside a committed step,
    and a live one (a save of this process in progress): clean removes the first two only."""
    import uuid

    from ckpt._commit.strategy import OWNER_NAME, LiveMark, owner_bytes

    loc = Location.make("memory", None)
    run = loc.storage("run")
    ckpt.save(loc("run", "step_00000001"), _tree())
    plant_dead_save(run, "step_00000002/gen-0123456789ab")  # owner: a process that exited
    run.put("step_00000001/gen-aaaaaaaaaaaa/w/c/0", b"x").result()  # no owner record: dead
    live = f"gen-{uuid.uuid4().hex[:12]}"
    run.put(f"step_00000003/{live}/{OWNER_NAME}", owner_bytes()).result()
    mark = LiveMark(loc("run", "step_00000003", live))
    try:
        assert cli_main(["ls", loc("run")]) == 0
        listing = capsys.readouterr().out
        assert "step_00000003  (in use: a save in progress" in listing
        assert "step_00000002  (leftover of a dead save" in listing
        report = _clean(capsys, loc("run"))
        removed = sorted(r["path"].rsplit("/", 2)[-2] for r in report if r["removed"])
        assert removed == ["step_00000001", "step_00000002"]
        assert [r["dead"] for r in report if "step_00000003" in r["path"]] == [False]
        assert loc.names("run") == ["step_00000001", "step_00000003"]
        assert loc.names("run", "step_00000001") == sorted(
            ["manifest.msgpack"] + [n for n in loc.names("run", "step_00000001") if n.startswith("gen-")])
        assert ckpt.restore(loc("run", "step_00000001"))["v"] == 1.0
    finally:
        mark.release()
    # Once this process's save is no longer in progress, it is dead too.
    assert [r["removed"] for r in _clean(capsys, loc("run"))] == [True]
    assert loc.names("run") == ["step_00000001"]
    loc.cleanup()
