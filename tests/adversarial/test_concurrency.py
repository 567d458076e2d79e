"""A saving process and a reading process on one directory, for hundreds of steps: nothing the
reader does (opening managers, listing, restoring, `ckpt ls`, even `ckpt clean`) disturbs the
saver, every step the saver reports saved is whole, and no restore ever returns a mix of two
checkpoints, even of one path being overwritten under it (`restore(verify=False)`).

Both are real processes (POSIX only). Phase 1: the saver's CheckpointManager saves STEPS steps
(retention on) while the reader opens its own managers on the directory and reads. Phase 2: the
saver overwrites one checkpoint OVERWRITES times while the reader restores it without
verification and checks that every leaf comes from the same save.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ckpt

LONG = os.environ.get("CKPT_ADVERSARIAL") == "long"
STEPS = 500 if LONG else 100
OVERWRITES = 500 if LONG else 100

COMMON = textwrap.dedent("""
    import json, os, sys, time
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import ckpt

    def tree(version):
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        return {"w": jax.device_put(np.full((256, 128), version, np.float32), NamedSharding(mesh, P("data", "model"))),
                "b": np.full((64,), version, np.int32), "step": int(version)}

    def versions(out):
        # The version every leaf says it holds: one number if the restore is consistent.
        return {float(np.unique(np.asarray(out["w"]))[0]) if np.unique(np.asarray(out["w"])).size == 1 else -1.0,
                float(np.unique(out["b"])[0]) if np.unique(out["b"]).size == 1 else -1.0, float(out["step"])}
""")

SAVER = COMMON + textwrap.dedent("""
    directory, single, status = sys.argv[1:4]
    saved = []
    with ckpt.CheckpointManager(directory, max_to_keep=3, keep_every_n_steps=10) as manager:
        for step in range(1, int(sys.argv[4]) + 1):
            assert manager.save(step, tree(step), metadata={"step": step})
            manager.wait()  # raises if the save failed: every step must commit
            saved.append(step)
        kept = manager.all_steps()
    open(status + ".phase1", "w").write(json.dumps({"saved": saved, "kept": kept}))
    ckpt.save(single, tree(0))
    for version in range(1, int(sys.argv[5]) + 1):
        ckpt.save(single, tree(version), overwrite=True)
    open(status + ".phase2", "w").write("done")
""")

READER = COMMON + textwrap.dedent("""
    from ckpt.cli._main import main as cli
    import contextlib, io
    directory, single, status, report = sys.argv[1:5]
    seen = {"iterations": 0, "restores": 0, "raced": 0, "wrong": [], "errors": [], "overwrite_restores": 0,
            "mixed": [], "second_saver_refused": None}
    ALLOWED = (ckpt.CheckpointError, OSError)
    while not os.path.exists(directory):
        time.sleep(0.01)
    while not os.path.exists(status + ".phase1"):
        seen["iterations"] += 1
        m = ckpt.CheckpointManager(directory)  # opening must change nothing
        steps = m.all_steps()
        if steps:
            step = steps[-1]
            try:
                out = m.restore(step)
                seen["restores"] += 1
                if versions(out) != {float(step)} or m.metadata(step) != {"step": step}:
                    seen["wrong"].append(step)
            except ALLOWED as e:  # retention may delete the step while it is read: an error, never data
                seen["raced"] += 1
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for argv in (["ls", directory], ["clean", directory]):
                if cli(argv) not in (0, 1, 2):
                    seen["errors"].append(argv[0])
        if seen["second_saver_refused"] is None and steps:
            try:  # a second manager saving to the same directory: a clear error, not a race
                ckpt.CheckpointManager(directory).save(10**6, tree(-1.0))
                seen["second_saver_refused"] = "saved!"
            except ckpt.CheckpointError as e:
                seen["second_saver_refused"] = str(e)
    while not os.path.exists(status + ".phase2"):
        try:
            out = ckpt.restore(single, verify=False)
        except ALLOWED:
            seen["raced"] += 1  # the pinned directory was deleted under us: an error, never a mix
            continue
        seen["overwrite_restores"] += 1
        if len(versions(out)) != 1 or -1.0 in versions(out):
            seen["mixed"].append(sorted(versions(out)))
    open(report, "w").write(json.dumps(seen))
""")


def test_a_reader_never_disturbs_a_saver_and_never_sees_a_mix(tmp_path):
    directory, single, status, report = (str(tmp_path / n) for n in ("run", "single", "status", "report.json"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    saver = subprocess.Popen([sys.executable, "-c", SAVER, directory, single, status, str(STEPS), str(OVERWRITES)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reader = subprocess.Popen([sys.executable, "-c", READER, directory, single, status, report],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        saver_out = saver.communicate(timeout=3600 if LONG else 300)[0].decode(errors="replace")
        reader_out = reader.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        for p in (saver, reader):
            if p.poll() is None:
                p.kill()
    assert saver.returncode == 0, saver_out[-4000:]
    assert reader.returncode == 0, reader_out[-4000:]
    phase1 = json.loads(open(status + ".phase1").read())
    seen = json.loads(open(report).read())
    print(f"\nconcurrency: {STEPS} steps saved, {OVERWRITES} overwrites; reader: {json.dumps(seen)}")

    # Every step was saved and reported as such; the ones retention keeps are whole.
    assert phase1["saved"] == list(range(1, STEPS + 1))
    expected_kept = sorted(set(range(STEPS - 2, STEPS + 1)) | set(range(10, STEPS + 1, 10)))
    assert phase1["kept"] == expected_kept
    manager = ckpt.CheckpointManager(directory)
    assert manager.all_steps() == expected_kept
    for step in expected_kept:
        out = ckpt.restore(manager.step_path(step))  # every chunk verified
        assert np.array_equal(out["w"], np.full((256, 128), step, np.float32)) and out["step"] == step
        assert np.array_equal(out["b"], np.full((64,), step, np.int32))
    assert sorted(os.listdir(directory)) == [f"step_{s:08d}" for s in expected_kept]  # no leftovers

    # The reader really worked alongside, and never saw wrong or mixed data.
    assert seen["iterations"] >= 10 and seen["restores"] >= 5, seen
    assert seen["wrong"] == [] and seen["errors"] == [], seen
    assert seen["overwrite_restores"] >= 5 and seen["mixed"] == [], seen
    assert seen["second_saver_refused"] and "another CheckpointManager" in seen["second_saver_refused"], seen
    out = ckpt.restore(single)
    assert out["step"] == OVERWRITES and np.array_equal(out["w"], np.full((256, 128), OVERWRITES, np.float32))


def test_two_managers_saving_to_one_directory_get_a_clear_error(tmp_path):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tree = {"w": jax.device_put(np.ones((64, 32), np.float32), NamedSharding(mesh, P("data")))}
    first = ckpt.CheckpointManager(tmp_path / "run")
    first.save(1, tree)
    second = ckpt.CheckpointManager(tmp_path / "run")  # opening and reading are fine
    assert second.all_steps() == [1] or second.all_steps() == []
    with pytest.raises(ckpt.CheckpointError, match=f"another CheckpointManager \\(process {os.getpid()}\\)"):
        second.save(2, tree)
    first.close()
    assert second.save(2, tree)  # the directory is free once the first one closed
    second.close()
    assert second.all_steps() == [1, 2]


def test_restore_reads_the_checkpoint_it_opened_even_if_it_is_replaced_meanwhile(tmp_path):
    """The pin, deterministically: the restore opens (and pins) the old checkpoint, an overwrite
    swaps a new one in before any chunk is read; the restore still returns the old values or an
    error, never a mix."""
    from support import Faults

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))

    def tree(v):
        return {"w": jax.device_put(np.full((1024, 512), v, np.float32), NamedSharding(mesh, P("data", "model"))),
                "v": v}

    path = tmp_path / "c"
    ckpt.save(path, tree(1.0))
    faults = Faults()
    swapped = []

    def overwrite_first(*args):
        if not swapped:
            swapped.append(1)
            ckpt.save(path, tree(2.0), overwrite=True)

    faults.before("read_chunk", overwrite_first)
    try:
        out = ckpt.restore(path, verify=False, options=faults.options())
    except (ckpt.CheckpointError, OSError):
        out = None  # the old directory was removed under the pinned reader: an error, not a mix
    assert swapped
    if out is not None:
        assert out["v"] == 1.0 and np.all(np.asarray(out["w"]) == 1.0)
    assert ckpt.restore(path)["v"] == 2.0
