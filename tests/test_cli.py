"""The `ckpt` console script, run as a subprocess on real checkpoints."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
import ckpt.storage
from ckpt.cli._main import main as cli_main
from ckpt._restore import restore_with_stats
from support import PER_SHARD  # these checkpoints keep one chunk file per shard: tests name chunks

_SCRIPT = os.path.join(os.path.dirname(sys.executable), "ckpt")
CKPT = [_SCRIPT] if os.path.exists(_SCRIPT) else [sys.executable, "-m", "ckpt"]


def run(*args, check_rc=None):
    p = subprocess.run([*CKPT, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check_rc is not None:
        assert p.returncode == check_rc, (p.returncode, p.stdout, p.stderr)
    return p


def _mesh(shape=(2, 4)):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model"))


W = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 8  # 8 chunks of (32, 8): 1 KiB each
MU = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)


def _train_state(step):
    """A training state after `step` steps of a toy optimiser (exact in float32)."""
    mesh = _mesh()
    spec = NamedSharding(mesh, P("data", "model"))
    return {
        "params": {"w": jax.device_put(W - 0.125 * step, spec),
                   "b": jax.device_put(np.full(32, 0.5, np.float32), NamedSharding(mesh, P("model")))},
        "opt": {"mu": jax.device_put(MU, spec), "count": np.int32(step)},
        "step": step,
        "tag": "run-1",
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli") / "run"
    manager = ckpt.CheckpointManager(directory, async_save=False, options=PER_SHARD)
    for step in (1, 2):
        manager.save(step, _train_state(step), metadata={"loss": 1.0 / step})
    manager.close()
    # A save that never committed, as a crash leaves it.
    tmp = directory / "step_00000003.tmp-0123456789ab"
    tmp.mkdir()
    (tmp / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    return directory


@pytest.fixture
def step2_copy(run_dir, tmp_path):
    dst = tmp_path / "step2"
    shutil.copytree(run_dir / "step_00000002", dst)
    return dst


def test_help_lists_every_command_and_each_command_explains_itself(capsys):
    out = run("--help", check_rc=0).stdout
    for command in ("ls", "inspect", "verify", "diff", "plan", "bench"):
        assert f"\n    {command} " in out
    for command, words in [("plan", ["--mesh", "--processes", "read amplification"]),
                           ("verify", ["CRC-32C", "progress"]), ("diff", ["--block-bytes", "NaN"])]:
        with pytest.raises(SystemExit) as e:
            cli_main([command, "--help"])
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert all(w in text for w in words), (command, text)


def test_ls_lists_steps_with_state_size_files_and_time(run_dir):
    rows = json.loads(run("ls", run_dir, "--json", check_rc=0).stdout)
    assert [(r["step"], r["state"]) for r in rows] == [(1, "committed"), (2, "committed"), (3, "uncommitted")]
    for r in rows:
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(r["path"]) for f in fs]
        assert (r["bytes"], r["files"]) == (sum(sizes), len(sizes))
    for r in rows[:2]:
        with open(os.path.join(r["path"], "manifest.msgpack"), "rb") as f:
            assert r["written"] == msgpack.unpackb(f.read(), raw=False)["created"]
    text = run("ls", run_dir, check_rc=0).stdout.splitlines()
    assert text[0].split() == ["STEP", "STATE", "SIZE", "FILES", "WRITTEN", "PATH"]
    assert text[1].split()[:2] == ["1", "committed"] and text[3].split()[:2] == ["3", "uncommitted"]
    assert str(rows[1]["files"]) in text[2].split()
    one = json.loads(run("ls", run_dir / "step_00000002", "--json", check_rc=0).stdout)
    assert [(r["step"], r["state"]) for r in one] == [(2, "committed")]


def test_inspect_shows_tree_shapes_dtypes_shardings_chunks_and_bytes(run_dir):
    path = run_dir / "step_00000002"
    doc = json.loads(run("inspect", path, "--json", check_rc=0).stdout)
    leaves = {l["path"]: l for l in doc["leaves"]}
    md = ckpt.metadata(path)
    w = leaves["params/w"]
    assert (w["shape"], w["dtype"], w["chunk_shape"], w["chunks"], w["nbytes"]) == ([64, 32], "float32", [32, 8], 8, 8192)
    assert w["mesh"] == {"axis_names": ["data", "model"], "axis_sizes": [2, 4]}
    assert w["partition_spec"] == ["data", "model"] and w["storage"] == "zarr"
    for name, meta in [("params/w", md["params"]["w"]), ("params/b", md["params"]["b"]), ("opt/mu", md["opt"]["mu"])]:
        leaf = leaves[name]
        assert tuple(leaf["shape"]) == meta.shape and leaf["dtype"] == str(meta.dtype) and leaf["nbytes"] == meta.nbytes
        assert leaf["chunk_shape"] == (list(meta.chunk_shape) if meta.chunk_shape else None)
    assert leaves["step"]["value"] == 2 and leaves["tag"]["value"] == "run-1"
    assert leaves["params/b"]["storage"] == "inline" and leaves["params/b"]["partition_spec"] == ["model"]
    arrays = [l for l in doc["leaves"] if "nbytes" in l]
    assert doc["totals"]["bytes"] == sum(l["nbytes"] for l in arrays) == 8192 * 2 + 128 + 4
    assert doc["totals"]["chunks"] == 16 and doc["user_metadata"] == {"loss": 0.5}

    text = run("inspect", path, check_rc=0).stdout
    w_line = next(line for line in text.splitlines() if line.strip().startswith("w "))
    for cell in ["float32", "[64,32]", "data=2,model=4", "P('data', 'model')", "[32,8]", "8", "8.00 KiB", "zarr"]:
        assert cell in w_line, (cell, w_line)
    assert "params/" in text and "step" in text and "= 2" in text and "total: 6 leaves" in text
    # A manager directory means its latest committed step, announced on stderr.
    p = run("inspect", run_dir, "--json", check_rc=0)
    assert json.loads(p.stdout)["path"] == str(path) and "step 2" in p.stderr


def test_verify_intact_checkpoint_exits_zero(run_dir):
    p = run("verify", run_dir / "step_00000001", check_rc=0)
    assert "read 16 chunks of 2 arrays" in p.stdout and "result: intact" in p.stdout
    assert "\r" not in p.stderr  # no progress bar when stderr is not a terminal


def test_verify_names_a_single_flipped_byte(step2_copy):
    chunk = step2_copy / "params" / "w" / "c" / "1" / "2"
    data = bytearray(chunk.read_bytes())
    data[517] ^= 0x01
    chunk.write_bytes(bytes(data))
    p = run("verify", step2_copy, check_rc=1)
    bad = [line for line in p.stdout.splitlines() if line.startswith("BAD ")]
    assert bad == [f"BAD leaf 'params/w', chunk [1, 2] ({chunk}): checksum mismatch: "
                   + bad[0].split("checksum mismatch: ")[1]]
    assert "1 bad chunk(s)" in p.stdout


def test_verify_names_every_bad_chunk_and_keeps_going(step2_copy):
    flipped = step2_copy / "opt" / "mu" / "c" / "0" / "0"
    truncated = step2_copy / "params" / "w" / "c" / "0" / "3"
    missing = step2_copy / "params" / "w" / "c" / "1" / "1"
    data = bytearray(flipped.read_bytes())
    data[0] ^= 0x80
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:300])
    missing.unlink()
    array_meta = step2_copy / "opt" / "mu" / "zarr.json"
    array_meta.unlink()
    p = run("verify", step2_copy, check_rc=1)
    bad = [line for line in p.stdout.splitlines() if line.startswith("BAD ")]
    assert len(bad) == 4, p.stdout
    # Array metadata first, then chunks in manifest (leaf, then row-major chunk) order.
    assert bad[0] == f"BAD leaf 'opt/mu' ({array_meta}): zarr.json is missing"
    assert bad[1].startswith(f"BAD leaf 'opt/mu', chunk [0, 0] ({flipped}): checksum mismatch")
    assert bad[2] == f"BAD leaf 'params/w', chunk [0, 3] ({truncated}): file is truncated: 300 of 1024 bytes"
    assert bad[3] == f"BAD leaf 'params/w', chunk [1, 1] ({missing}): file is missing"
    assert "read 16 chunks" in p.stdout
    assert "DAMAGED, 3 bad chunk(s) and 1 bad array metadata file(s) in 2 array(s)" in p.stdout


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_terminal(*args, stdout_tty=False, env=None):
    """Run the command with stderr (and stdout if `stdout_tty`) on a pseudo-terminal;
    (returncode, stdout text, terminal text)."""
    import pty

    master, slave = pty.openpty()
    try:
        p = subprocess.run([*CKPT, *map(str, args)], stdout=slave if stdout_tty else subprocess.PIPE,
                           stderr=slave, timeout=120, env={**os.environ, "COLUMNS": "160", **(env or {})})
        os.close(slave)
        chunks = []
        while True:
            try:
                block = os.read(master, 4096)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not block:
                break
            chunks.append(block)
    finally:
        os.close(master)
    return p.returncode, (p.stdout or b"").decode(), b"".join(chunks).decode()


def test_verify_shows_a_progress_bar_on_a_terminal(run_dir):
    rc, out, err = on_terminal("verify", run_dir / "step_00000001")
    plain = ANSI.sub("", err)
    assert rc == 0 and "\x1b[" in err  # drawn by rich, on the terminal
    assert "verify" in plain and "100%" in plain and "16.00 KiB / 16.00 KiB" in plain and "/s" in plain
    assert "result: intact" in out and "\x1b" not in out  # stdout is piped: plain text
    rc, out, err = on_terminal("verify", run_dir / "step_00000001", "--no-progress")
    assert rc == 0 and "100%" not in err


def test_diff_two_steps_of_a_training_run(run_dir):
    a, b = run_dir / "step_00000001", run_dir / "step_00000002"
    p = run("diff", a, b, "--json", check_rc=1)
    doc = json.loads(p.stdout)
    arrays = {d["path"]: d for d in doc["arrays"]}
    w1, w2 = W - 0.125, W - 0.25
    assert arrays["params/w"]["equal"] is False
    assert arrays["params/w"]["max_abs_diff"] == float(np.max(np.abs(w1 - w2))) == 0.125
    assert arrays["params/w"]["differing"] == int(np.sum(w1 != w2)) == 64 * 32
    assert arrays["opt/mu"]["equal"] is True and arrays["params/b"]["equal"] is True
    assert arrays["opt/count"] == {"path": "opt/count", "equal": False, "elements": 1, "differing": 1, "max_abs_diff": 1.0}
    values = {v["path"]: v for v in doc["values"]}
    assert values["step"] == {"path": "step", "equal": False, "a": 1, "b": 2} and values["tag"]["equal"] is True
    assert doc["only_in_a"] == doc["only_in_b"] == doc["shape_changed"] == doc["dtype_changed"] == []

    text = run("diff", a, b, check_rc=1).stdout
    assert "params/w   differ  max |a-b| = 0.125  (2048 of 2048 elements)" in text
    assert "opt/mu     equal" in text and "step: 1 -> 2" in text
    assert run("diff", b, b, check_rc=0).stdout.rstrip().endswith("0 dtype changes")


def test_diff_reports_keys_shapes_and_dtypes_and_streams_in_small_blocks(run_dir, tmp_path):
    other = tmp_path / "other"
    state = _train_state(2)
    # A dtype change (values rounded) and another chunking: (16, 32) instead of (32, 8).
    state["params"]["w"] = jax.device_put((W - 0.25).astype(ml_dtypes.bfloat16), NamedSharding(_mesh(), P("model")))
    state["opt"]["mu"] = jax.device_put(MU[:, :16], NamedSharding(_mesh(), P("data", "model")))  # shape
    del state["tag"]
    state["extra"] = np.zeros(3)
    ckpt.save(other, state, options=PER_SHARD)
    a = run_dir / "step_00000002"
    # 256-byte blocks: every 1 KiB chunk is compared in pieces, and B's chunking differs from A's.
    doc = json.loads(run("diff", a, other, "--json", "--block-bytes", "256", check_rc=1).stdout)
    assert doc["only_in_a"] == ["tag"] and doc["only_in_b"] == ["extra"]
    assert doc["shape_changed"] == [{"path": "opt/mu", "a": [64, 32], "b": [64, 16]}]
    assert doc["dtype_changed"] == [{"path": "params/w", "a": "float32", "b": "bfloat16"}]
    w = {d["path"]: d for d in doc["arrays"]}["params/w"]
    rounded = (W - 0.25).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert w["differing"] == int(np.sum(rounded != W - 0.25)) > 0
    assert w["max_abs_diff"] == float(np.max(np.abs(rounded - (W - 0.25))))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8)])
def test_plan_matches_the_bytes_a_real_restore_reads(run_dir, shape):
    path = run_dir / "step_00000002"
    mesh = _mesh(shape)
    _, stats = restore_with_stats(path, mesh=mesh)
    doc = json.loads(run("plan", path, "--mesh", f"data={shape[0]},model={shape[1]}", "--json", check_rc=0).stdout)
    total = doc["total"]
    assert (total["bytes_read"], total["bytes_needed"], total["chunks_read"]) == (
        stats.bytes_read, stats.bytes_needed, stats.chunks_read)
    per_leaf = {l["path"]: (l["bytes_read"], l["bytes_needed"]) for l in doc["per_leaf"]}
    assert per_leaf == {k: tuple(v) for k, v in stats.per_leaf.items()}
    assert doc["per_process"] == [{"process": 0, **total}]


def test_plan_splits_reads_over_processes_in_contiguous_device_blocks(run_dir):
    # 8 processes of one device on data=8,model=1: each device needs 8 rows of w and mu (1 KiB),
    # which lie in 4 chunks of (32, 8) (4 KiB); b (inline, replicated) is needed whole (128 B).
    path = run_dir / "step_00000002"
    doc = json.loads(run("plan", path, "--mesh", "data=8,model=1", "--processes", "8", "--json", check_rc=0).stdout)
    for p in doc["per_process"]:
        assert (p["bytes_read"], p["chunks_read"], p["bytes_needed"]) == (2 * 4096, 8, 2 * 1024 + 128 + 4)
        assert p["read_amplification"] == 4.0
    text = run("plan", path, "--mesh", "data=8,model=1", "--processes", "8", check_rc=0).stdout
    assert "in 8 process(es) of 1 device\n" in text and "4.00x" in text


def test_plan_names_every_leaf_that_cannot_be_placed(run_dir):
    path = run_dir / "step_00000002"
    p = run("plan", path, "--mesh", "data=3,model=4", check_rc=1)
    assert "cannot be placed (2 leaves of 4 arrays):" in p.stdout
    assert "params/w: dimension 0 of size 64 cannot be split over mesh axis data of size 3" in p.stdout
    assert "opt/mu: dimension 0 of size 64" in p.stdout
    p = run("plan", path, "--mesh", "rows=8", "--json", check_rc=1)
    why = {u["path"]: u["why"] for u in json.loads(p.stdout)["unplaceable"]}
    assert set(why) == {"params/w", "params/b", "opt/mu"}
    assert why["params/b"] == "saved PartitionSpec uses mesh axis 'model', which the mesh ('rows',) does not have"


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("case", ["missing", "not_checkpoint", "garbage_manifest", "truncated_manifest",
                                  "bad_field", "uncommitted", "newer_version", "bad_mesh", "file"])
def test_expected_errors_print_one_line_and_exit_2(run_dir, step2_copy, tmp_path, case):
    manifest = step2_copy / "manifest.msgpack"
    if case == "missing":
        args, words = ["inspect", tmp_path / "nope"], "no such file or directory"
    elif case == "not_checkpoint":
        (tmp_path / "empty").mkdir()
        args, words = ["verify", tmp_path / "empty"], "not a committed checkpoint"
    elif case == "garbage_manifest":
        _write(manifest, b"\xc1\xc1 not msgpack")
        args, words = ["inspect", step2_copy], "manifest is corrupted"
    elif case == "truncated_manifest":
        _write(manifest, manifest.read_bytes()[:200])
        args, words = ["verify", step2_copy], "manifest is corrupted"
    elif case == "bad_field":
        m = msgpack.unpackb(manifest.read_bytes(), raw=False)
        next(l for l in m["leaves"] if l["path"] == "params/w")["storage"]["chunk_checksums"].pop()
        m.pop("manifest_crc32c")  # (a hand-edited manifest without its checksum; with it: "corrupted")
        _write(manifest, msgpack.packb(m, use_bin_type=True))
        args, words = ["plan", step2_copy, "--mesh", "data=2"], "('params/w'): chunk_checksums has 7 entries, expected 8"
    elif case == "uncommitted":
        args, words = ["diff", run_dir / "step_00000002", run_dir / "step_00000003.tmp-0123456789ab"], "never committed"
    elif case == "newer_version":
        m = msgpack.unpackb(manifest.read_bytes(), raw=False)
        m["format_version"] = 99
        _write(manifest, msgpack.packb(m, use_bin_type=True))
        args, words = ["inspect", step2_copy], "format_version 99 is newer than this jax-ckpt reads"
    elif case == "bad_mesh":
        args, words = ["plan", step2_copy, "--mesh", "data:2"], "bad mesh 'data:2'"
    else:
        args, words = ["ls", manifest], "is not a directory"
    p = run(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"ckpt {args[0]}: error: ") and words in p.stderr, p.stderr


def test_bench_forwards_its_arguments(monkeypatch, capsys, tmp_path):
    """`ckpt bench` is the disk benchmark alone (ckpt/cli/_bench.py; tests/test_bench_cli.py runs
    it): its options reach the benchmark, its result is printed as given, bad values are one-line
    errors, and the developer benchmarks' other modes are not offered."""
    from ckpt.cli import _bench

    calls = []
    result = {"unique_gib": 0.5, "values_match": True}
    monkeypatch.setattr(_bench, "run", lambda gib, runs, root: calls.append((gib, runs, root)) or result)
    assert cli_main(["bench", "--gib", "0.5", "--runs", "1", "--dir", str(tmp_path), "--json"]) == 0
    assert calls == [(0.5, 1, str(tmp_path))]
    assert json.loads(capsys.readouterr().out) == result
    assert cli_main(["bench", "--json"]) == 0 and calls[-1] == (2.0, 3, "/tmp/ckpt-bench")  # the defaults
    capsys.readouterr()
    for bad in (["--runs", "0"], ["--gib", "-1"], ["--leaves", "400"], ["--memory"]):
        assert cli_main(["bench", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("ckpt bench: error: ") and len(err.splitlines()) == 1, err
    assert len(calls) == 2
    p = run("bench", "--help", check_rc=0)
    assert all(option in p.stdout for option in ("--gib", "--runs", "--dir", "--json")), p.stdout
    assert "--leaves" not in p.stdout and "--url" not in p.stdout and "python -m bench" in p.stdout


# ---- any location, through the storage interface ---------------------------------------------

def _storage(url, engine=None):
    return ckpt.storage.open_storage(url, ckpt.Options(engine=engine).resolved())


def _chunk_key(url, leaf, index, engine=None):
    """The storage key of a chunk of `leaf` in the checkpoint at `url` (with its generation prefix)."""
    from ckpt._format.validate import read_manifest

    rec = next(l for l in read_manifest(_storage(url, engine)).leaves if l.path == leaf)
    return f"{rec.zarr.path}/c/" + "/".join(map(str, index))


def cli(capsys, *args):
    """Run the command in this process (memory:// lives in this process); (rc, stdout, stderr)."""
    rc = cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def memory_run():
    """A manager-style run in memory://: steps 1 and 2 committed, step 3 never committed."""
    import uuid

    root = f"memory://cli/{uuid.uuid4().hex}/run"
    for step in (1, 2):
        ckpt.save(f"{root}/step_{step:08d}", _train_state(step), options=PER_SHARD)
    _storage(f"{root}/step_00000003").put("gen-0123456789ab/zarr.json", b"{}").result()
    return root


@pytest.fixture
def memory_copy():
    """A fresh checkpoint of step 2 in memory://, to damage."""
    import uuid

    url = f"memory://cli/{uuid.uuid4().hex}/ckpt"
    ckpt.save(url, _train_state(2), options=PER_SHARD)
    return url


def test_ls_on_memory_sizes_committed_steps_from_their_manifests(capsys, memory_run):
    rc, out, _ = cli(capsys, "ls", memory_run, "--json")
    assert rc == 0
    rows = json.loads(out)
    assert [(r["step"], r["state"], r["path"]) for r in rows] == [
        (1, "committed", f"{memory_run}/step_00000001"), (2, "committed", f"{memory_run}/step_00000002"),
        (3, "uncommitted", f"{memory_run}/step_00000003")]
    for r in rows[:2]:
        manifest = _storage(r["path"]).get("manifest.msgpack", max_bytes=1 << 20)
        # Two zarr arrays of 8 chunks of 1 KiB, plus the manifest; no listing of sizes needed.
        assert (r["bytes"], r["files"], r["sized_by"]) == (16 * 1024 + len(manifest), 17, "manifest")
        assert r["written"] == msgpack.unpackb(manifest, raw=False)["created"]
    assert (rows[2]["bytes"], rows[2]["files"], rows[2]["written"], rows[2]["sized_by"]) == (None, None, None, None)
    rc, out, _ = cli(capsys, "ls", memory_run)
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["STEP", "STATE", "SIZE", "FILES", "WRITTEN", "PATH"]
    assert lines[1].split()[:3] == ["1", "committed", f"~{(16 * 1024 + len(manifest)) / 1024:.2f}"]
    assert lines[1].split()[4] == "~17"
    assert lines[3].split()[:6] == ["3", "uncommitted", "-", "-", "-", f"{memory_run}/step_00000003"]
    assert "(leftover of a dead save: no save owns it" in lines[3]  # its generation has no owner record


def test_inspect_on_memory_picks_the_latest_step_and_shows_generation_paths(capsys, memory_run):
    rc, out, err = cli(capsys, "inspect", memory_run, "--json")
    assert rc == 0 and err == f"using step 2 (latest committed) of {memory_run}\n"
    doc = json.loads(out)
    assert doc["path"] == f"{memory_run}/step_00000002"
    w = {l["path"]: l for l in doc["leaves"]}["params/w"]
    assert (w["shape"], w["chunk_shape"], w["chunks"], w["nbytes"]) == ([64, 32], [32, 8], 8, 8192)
    assert w["storage_path"].startswith("gen-") and w["storage_path"].endswith("/params/w")
    assert doc["totals"]["chunks"] == 16 and doc["user_metadata"] is None
    rc, out, err = cli(capsys, "inspect", memory_run, "--step", "1")
    assert (rc, err) == (0, "") and out.startswith(f"checkpoint {memory_run}/step_00000001\n")
    w_line = next(line for line in out.splitlines() if line.strip().startswith("w "))
    assert w_line.split()[-2] == "zarr" and w_line.split()[-1].startswith("gen-"), w_line
    assert w_line.split()[-1] != w["storage_path"]  # each checkpoint has its own generation


def test_verify_on_memory_intact_and_damaged_through_the_storage_api(capsys, memory_run, memory_copy):
    rc, out, _ = cli(capsys, "verify", memory_run, "--step", "1")
    assert rc == 0 and f"verified {memory_run}/step_00000001\n" in out
    assert "read 16 chunks of 2 arrays (16.00 KiB)" in out and "result: intact" in out

    storage = _storage(memory_copy)
    missing, truncated = _chunk_key(memory_copy, "params/w", (1, 1)), _chunk_key(memory_copy, "params/w", (0, 3))
    flipped = _chunk_key(memory_copy, "opt/mu", (0, 0))
    storage.delete(missing)
    storage.put(truncated, storage.get(truncated, max_bytes=4096)[:300]).result()
    data = bytearray(storage.get(flipped, max_bytes=4096))
    data[0] ^= 0x80
    storage.put(flipped, bytes(data)).result()
    rc, out, _ = cli(capsys, "verify", memory_copy)
    bad = [line for line in out.splitlines() if line.startswith("BAD ")]
    assert rc == 1 and len(bad) == 3, out
    assert bad[0].startswith(f"BAD leaf 'opt/mu', chunk [0, 0] ({memory_copy}/{flipped}): checksum mismatch: ")
    assert bad[1] == (f"BAD leaf 'params/w', chunk [0, 3] ({memory_copy}/{truncated}): "
                      "file is truncated: 300 of 1024 bytes")
    assert bad[2] == f"BAD leaf 'params/w', chunk [1, 1] ({memory_copy}/{missing}): file is missing"
    assert "result: DAMAGED, 3 bad chunk(s) and 0 bad array metadata file(s) in 2 array(s)" in out


def test_diff_on_memory_identical_and_different(capsys, memory_run, memory_copy):
    rc, out, _ = cli(capsys, "diff", f"{memory_run}/step_00000002", memory_copy)
    assert rc == 0 and out.splitlines()[:2] == [f"A: {memory_run}/step_00000002", f"B: {memory_copy}"]
    assert out.rstrip().endswith("0 dtype changes")
    assert "summary: identical; 4 common arrays compared (4 equal, 0 differ)" in out
    rc, out, _ = cli(capsys, "diff", f"{memory_run}/step_00000001", memory_copy, "--json", "--block-bytes", "256")
    doc = json.loads(out)
    arrays = {d["path"]: d for d in doc["arrays"]}
    assert rc == 1 and doc["identical"] is False
    assert (arrays["params/w"]["differing"], arrays["params/w"]["max_abs_diff"]) == (64 * 32, 0.125)
    assert arrays["opt/mu"]["equal"] is True and arrays["opt/count"]["max_abs_diff"] == 1.0
    assert {v["path"]: v["equal"] for v in doc["values"]} == {"step": False, "tag": True}


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_diff_names_leaf_chunk_and_file_of_a_bad_chunk(capsys, memory_run, memory_copy, damage):
    storage, key = _storage(memory_copy), _chunk_key(memory_copy, "params/w", (0, 3))
    if damage == "truncated":
        storage.put(key, storage.get(key, max_bytes=4096)[:300]).result()
    else:
        storage.delete(key)
    rc, out, err = cli(capsys, "diff", f"{memory_run}/step_00000002", memory_copy, "--block-bytes", "256")
    assert (rc, out) == (2, "") and len(err.splitlines()) == 1, err
    assert err.startswith(f"ckpt diff: error: leaf 'params/w', chunk [0, 3] ({memory_copy}/{key}): ")
    assert ("truncated: 300 of 1024 bytes" if damage == "truncated" else "chunk file is missing") in err


@pytest.mark.parametrize("engine", ["fsspec", "tensorstore"])
def test_every_command_on_a_local_path_through_another_engine(tmp_path, engine):
    opts = ckpt.Options(engine=engine, pack_limit_bytes=0)
    a, b = tmp_path / "a", tmp_path / "b"
    ckpt.save(a, _train_state(1), options=opts)
    ckpt.save(b, _train_state(2), options=opts)
    rows = json.loads(run("ls", a, "--engine", engine, "--json", check_rc=0).stdout)
    with open(a / "manifest.msgpack", "rb") as f:
        manifest = f.read()
    assert [(r["step"], r["state"], r["path"], r["sized_by"]) for r in rows] == [
        (None, "committed", str(a), "manifest")]
    assert (rows[0]["bytes"], rows[0]["files"]) == (16 * 1024 + len(manifest), 17)
    # The default (local) engine reads the same checkpoint, generation prefix and all, and sizes it on disk.
    local = json.loads(run("ls", a, "--json", check_rc=0).stdout)[0]
    assert local["sized_by"] == "storage" and local["bytes"] > rows[0]["bytes"]

    doc = json.loads(run("inspect", a, "--engine", engine, "--json", check_rc=0).stdout)
    w = {l["path"]: l for l in doc["leaves"]}["params/w"]
    assert doc["path"] == str(a) and w["storage_path"].startswith("gen-") and w["chunks"] == 8

    out = run("verify", a, "--engine", engine, check_rc=0).stdout
    assert "read 16 chunks of 2 arrays" in out and "result: intact" in out
    doc = json.loads(run("diff", a, b, "--engine", engine, "--json", check_rc=1).stdout)
    assert {d["path"]: d["differing"] for d in doc["arrays"]} == {
        "params/w": 2048, "params/b": 0, "opt/mu": 0, "opt/count": 1}
    assert run("diff", b, b, "--engine", engine, check_rc=0).stdout.rstrip().endswith("0 dtype changes")
    plan = json.loads(run("plan", a, "--engine", engine, "--mesh", "data=2,model=4", "--json", check_rc=0).stdout)
    assert (plan["total"]["bytes_read"], plan["total"]["chunks_read"]) == (16 * 1024, 16)

    key = f"{w['storage_path']}/c/0/3"
    chunk = a / key
    chunk.write_bytes(chunk.read_bytes()[:300])
    out = run("verify", a, "--engine", engine, check_rc=1).stdout
    assert f"BAD leaf 'params/w', chunk [0, 3] ({chunk}): file is truncated: 300 of 1024 bytes" in out
    p = run("diff", a, b, "--engine", engine, check_rc=2)
    assert p.stderr.startswith(f"ckpt diff: error: leaf 'params/w', chunk [0, 3] ({chunk}): ")
    assert "truncated" in p.stderr and len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr


@pytest.mark.parametrize("args, words", [
    (["inspect", "{run}", "--step", "-1"], "argument --step: bad step '-1': steps are >= 0"),
    (["verify", "{run}", "--step", "x"], "argument --step: bad step 'x'"),
    (["plan", "{run}", "--step", "9", "--mesh", "data=2"], "no step 9 in {run} (committed steps: [1, 2])"),
    (["inspect", "nosuchscheme://bucket/x"], "unsupported checkpoint location 'nosuchscheme://bucket/x'"),
    (["ls", "{run}", "--engine", "zarr"], "argument --engine: invalid choice: 'zarr'"),
    (["inspect", "memory://x/y", "--engine", "local"], "the local engine serves local paths and file:// URLs"),
    (["diff", "{run}"], "the following arguments are required: B"),
    (["ls", "{run}/step_00000001/manifest.msgpack"], "step_00000001/manifest.msgpack is not a directory"),
    (["inspect", "{run}/step_00000001/manifest.msgpack"], "is not a checkpoint directory"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
])
def test_bad_input_prints_one_line_and_exits_2(run_dir, args, words):
    args = [a.format(run=run_dir) for a in args]
    p = run(*args)
    assert (p.returncode, p.stdout) == (2, ""), (p.stdout, p.stderr)
    assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    label = f"ckpt {args[0]}" if not args[0].startswith("-") else "ckpt"
    assert p.stderr.startswith(f"{label}: error: ") and words.format(run=run_dir) in p.stderr, p.stderr


def test_engine_option_is_offered_by_every_command_that_takes_a_location(capsys):
    for command in ("ls", "inspect", "verify", "diff", "plan"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--engine {local,tensorstore,fsspec}" in text, (command, text)


# ---- terminal output, --json everywhere, suggestions, help ------------------------------------
# In this process (cli()) where the command's output is all that is checked; a real terminal
# (on_terminal) where what is checked is how the terminal is detected.


def run_json(capsys, *args, rc=0):
    code, out, err = cli(capsys, *args, "--json")
    assert code == rc, (code, out, err)
    return json.loads(out)


def test_a_real_terminal_gets_rich_tables_and_a_pipe_gets_plain_text(run_dir):
    rc, out, term = on_terminal("ls", run_dir, stdout_tty=True)
    text = ANSI.sub("", term)
    assert rc == 0 and "\x1b[32mcommitted" in term  # committed steps in green, on the terminal
    assert "STEP" in text and "uncommitted" in text and "step_00000003" in text
    plain = run("ls", run_dir, check_rc=0)
    assert "\x1b" not in plain.stdout + plain.stderr


@pytest.mark.parametrize("args", [["ls", "{run}"], ["inspect", "{step2}"], ["du", "{step2}"],
                                  ["plan", "{step2}", "--mesh", "data=2,model=4"], ["diff", "{step1}", "{step2}"],
                                  ["verify", "{step2}", "--all"]])
def test_every_command_draws_with_rich_when_forced_and_plain_otherwise(capsys, monkeypatch, run_dir, args):
    args = [a.format(run=run_dir, step1=run_dir / "step_00000001", step2=run_dir / "step_00000002") for a in args]
    rc, plain, _ = cli(capsys, *args)
    assert rc in (0, 1) and plain.strip() and "\x1b" not in plain
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then treats the captured stdout as a terminal
    monkeypatch.setenv("COLUMNS", "160")
    rc2, drawn, _ = cli(capsys, *args)
    assert rc2 == rc and "\x1b[" in drawn
    words = [w for w in re.findall(r"[A-Za-z_]{4,}", plain) if w not in ("verified", "summary")][:6]
    assert all(w in ANSI.sub("", drawn) for w in words), (words, drawn)


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "du", "diff", "plan", "export"])
def test_every_command_that_prints_data_has_json(capsys, run_dir, tmp_path, command):
    path = run_dir / "step_00000002"
    args = {"ls": [run_dir], "inspect": [path], "verify": [path], "du": [path], "diff": [path, path],
            "plan": [path, "--mesh", "data=2,model=4"], "export": [path, tmp_path / "out"]}[command]
    assert run_json(capsys, command, *args)


def _chunk_files(checkpoint):
    """Every chunk file of a local checkpoint (the files under a Zarr array's c/ directory)."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(checkpoint) for f in fs
                  if f"{os.sep}c{os.sep}" in d + os.sep)


def test_verify_json_names_every_problem(capsys, run_dir, step2_copy):
    intact = run_json(capsys, "verify", run_dir / "step_00000002")
    chunk = _chunk_files(step2_copy)[0]
    data = bytearray(open(chunk, "rb").read())
    data[3] ^= 0x10
    _write(chunk, bytes(data))
    doc = run_json(capsys, "verify", step2_copy, rc=1)
    assert doc["intact"] is False and (doc["chunks"], doc["bytes"]) == (intact["chunks"], intact["bytes"])
    assert [p["file"] for p in doc["problems"]] == [chunk] and doc["problems"][0]["chunk"] is not None
    assert doc["problems"][0]["what"].startswith("checksum mismatch") and doc["problems"][0]["leaf"]


def test_verify_all_checks_every_step_under_one_progress_bar(capsys, run_dir, tmp_path):
    from ckpt.cli._render import human_bytes

    one = [run_json(capsys, "verify", run_dir / f"step_0000000{s}") for s in (1, 2)]
    total = one[0]["bytes"] + one[1]["bytes"]
    rc, out, _ = cli(capsys, "verify", run_dir, "--all")
    out = out.splitlines()
    assert rc == 0 and out[0].startswith(f"verified 2 committed step(s) of {run_dir}: "
                                         f"{one[0]['chunks'] + one[1]['chunks']} chunks ({human_bytes(total)}) in ")
    for k, s in enumerate(one):
        assert out[1 + k] == (f"step {k + 1}: {s['chunks']} chunks of {s['arrays']} arrays, "
                              f"{s['inline_arrays']} inline: intact")
    assert out[3].startswith("step 3: not verified, uncommitted") and "step_00000003.tmp-" in out[3]
    assert out[4] == "result: intact, every chunk of 2 step(s) matches its checksum"
    rc, _, term = on_terminal("verify", run_dir, "--all")
    plain = ANSI.sub("", term)
    assert rc == 0 and f"{human_bytes(total)} / {human_bytes(total)}" in plain  # one bar over all steps
    assert f"/ {human_bytes(one[0]['bytes'])}" not in plain

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    chunk = _chunk_files(copy / "step_00000001")[-1]
    _write(chunk, open(chunk, "rb").read()[:100])
    rc, out, _ = cli(capsys, "verify", copy, "--all")
    assert rc == 1 and f"({chunk}): file is truncated: 100 of " in out
    assert out.splitlines()[-1] == "result: DAMAGED, step(s) [1]"
    doc = run_json(capsys, "verify", copy, "--all", rc=1)
    assert [(s["step"], s["intact"]) for s in doc["steps"]] == [(1, False), (2, True)]
    assert [(s["step"], s["state"]) for s in doc["not_verified"]] == [(3, "uncommitted")]
    rc, out, err = cli(capsys, "verify", copy, "--all", "--step", "1")
    assert (rc, out) == (2, "") and "--all verifies every step" in err and len(err.splitlines()) == 1


def test_du_shows_bytes_per_subtree(capsys, run_dir):
    doc = run_json(capsys, "du", run_dir)
    subtrees = {s["path"]: s for s in doc["subtrees"]}
    assert list(subtrees) == ["params", "opt", "step", "tag"]  # largest first
    # w (64x32 float32) and b (32 float32); mu and count (int32): however they are laid out
    assert (subtrees["params"]["data_bytes"], subtrees["params"]["arrays"]) == (8192 + 128, 2)
    assert (subtrees["opt"]["data_bytes"], subtrees["opt"]["arrays"]) == (8192 + 4, 2)
    assert subtrees["params"]["bytes"] >= 8192 + 128 and subtrees["opt"]["bytes"] >= 8192 + 4
    assert subtrees["step"]["values"] == 1 and subtrees["step"]["bytes"] == 0
    assert doc["total_bytes"] == sum(s["bytes"] for s in doc["subtrees"])
    assert abs(sum(s["share"] for s in doc["subtrees"]) - 1) < 1e-9
    deep = run_json(capsys, "du", run_dir, "--depth", "2")
    assert {s["path"] for s in deep["subtrees"]} == {"params/w", "params/b", "opt/mu", "opt/count", "step", "tag"}
    assert sum(s["bytes"] for s in deep["subtrees"]) == doc["total_bytes"]
    rc, out, _ = cli(capsys, "du", run_dir)
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["SUBTREE", "ARRAYS", "BYTES", "SHARE"]
    p = subtrees["params"]
    assert lines[1].split()[:2] == ["params", "2"] and lines[1].split()[-1] == f"{100 * p['share']:.1f}%"
    assert lines[-1].startswith("total: ") and lines[-1].endswith(f"in 4 subtree(s) of {run_dir / 'step_00000002'}")


def test_export_from_the_cli_matches_the_safetensors_loader(capsys, run_dir, tmp_path):
    from safetensors.numpy import load_file

    names = tmp_path / "names.json"
    names.write_text(json.dumps({"opt.mu": None, "opt.count": "optimizer.count"}))
    out = tmp_path / "hf"
    doc = run_json(capsys, "export", run_dir, out, "--format", "safetensors", "--shard-size", "5KB",
                   "--rename-file", names, "--rename", r"^params\.=model.")
    assert doc["source"] == str(run_dir / "step_00000002") and doc["skipped"] == ["step", "tag"]
    assert doc["dropped"] == ["opt.mu"] and set(doc["tensors"]) == {"model.w", "model.b", "optimizer.count"}
    assert os.path.basename(doc["files"][-1]) == "model.safetensors.index.json" and len(doc["files"]) == 3
    loaded = {}
    for f in doc["files"][:-1]:
        loaded.update(load_file(f))
    assert np.array_equal(loaded["model.w"], W - 0.125 * 2) and np.array_equal(loaded["model.b"], np.full(32, 0.5))
    assert loaded["optimizer.count"] == 2 and loaded["optimizer.count"].dtype == np.int32
    rc, text, err = cli(capsys, "export", run_dir, out)
    assert (rc, text) == (2, "") and "already holds an export" in err and "--overwrite" in err
    assert len(err.splitlines()) == 1
    rc, text, _ = cli(capsys, "export", run_dir, out, "--overwrite", "--step", "1")
    assert rc == 0 and text.startswith(f"exported 4 tensors (16.13 KiB) of {run_dir / 'step_00000001'}\n")
    assert text.rstrip().endswith("not tensors, not exported (2): step, tag")
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # the earlier shards and index replaced
    back = ckpt.restore(out)
    assert np.array_equal(back["params"]["w"], W - 0.125)


@pytest.mark.parametrize("args, words", [
    (["export", "{run}", "{tmp}/o", "--rename", "no-equals-sign"], "bad --rename rule 'no-equals-sign'"),
    (["export", "{run}", "{tmp}/o", "--rename", "(=x"], "bad --rename rule '(=x'"),
    (["export", "{run}", "{tmp}/o", "--shard-size", "5 parsecs"], "bad size '5 parsecs'"),
    (["export", "{run}", "{tmp}/o", "--format", "gguf"], "argument --format: invalid choice: 'gguf'"),
    (["export", "{run}", "{tmp}/o", "--rename-file", "{tmp}/missing.json"], "No such file or directory"),
    (["export", "{run}", "{tmp}/o", "--rename", "^.*$=same"], "both become tensor 'same'"),
    (["export", "{run}", "{tmp}/o", "--host-budget", "0"], "bad size '0'"),
    (["verfy", "{run}"], "did you mean 'verify'?"),
    (["inspct", "{run}"], "did you mean 'inspect'?"),
    (["du", "{run}", "--step", "7"], "no step 7 in"),
    (["du", "{run}", "--depth", "0"], "--depth must be at least 1"),
])
def test_export_du_and_mistyped_commands_fail_in_one_line(capsys, run_dir, tmp_path, args, words):
    args = [a.format(run=run_dir, tmp=tmp_path) for a in args]
    rc, out, err = cli(capsys, *args)
    assert (rc, out) == (2, ""), (out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err and words in err, err
    assert err.startswith(f"ckpt {args[0]}: error: " if args[0] in ("export", "du") else "ckpt: error: "), err


def test_a_wild_command_gets_no_suggestion(capsys):
    rc, _, err = cli(capsys, "frobnicate")
    assert rc == 2 and "invalid choice: 'frobnicate'" in err and "did you mean" not in err


def test_help_is_wrapped_to_the_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "70")
    for command in ("export", "verify", "du"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        lines = capsys.readouterr().out.splitlines()
        assert max(len(line) for line in lines) <= 70, [line for line in lines if len(line) > 70]
        assert len(lines) > 10
