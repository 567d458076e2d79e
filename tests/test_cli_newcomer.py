"""The `ckpt` command as a newcomer meets it (issue 26, CLI): manager directories holding Orbax
and jax-ckpt steps, or steps saved with step_prefix=None; safetensors and Orbax checkpoints
wherever ckpt.metadata reads them; tables on 80-120 column terminals and piped; honest counts
and times; errors that name flags; an unreachable object store in one line."""

import json
import os
import re
import socket
import subprocess
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
import ckpt.safetensors
from test_cli import ANSI, CKPT, cli, on_terminal, run

W = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 8


def _state(step):
    return {"params": {"w": W + step, "b": np.full(32, step, np.float32)}, "step": step}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """What docs/migrating-from-orbax.md says a migrated run holds: Orbax steps 1 and 5, then
    jax-ckpt steps 12 and 19 saved by ckpt.CheckpointManager beside them."""
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("newcomer") / "run"
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(os.path.abspath(root), options=options) as m:
        for step in (1, 5):
            m.save(step, args=ocp.args.StandardSave(_state(step)), metrics={"loss": 1.0 / step})
        m.wait_until_finished()
    with ckpt.CheckpointManager(root, async_save=False) as m:
        for step in (12, 19):
            m.save(step, _state(step), metrics={"loss": 1.0 / step})
    return root


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    root = tmp_path_factory.mktemp("newcomer") / "bare"
    with ckpt.CheckpointManager(root, async_save=False, step_prefix=None, step_format_fixed_length=None) as m:
        for step in (3, 7):
            m.save(step, _state(step))
    assert sorted(os.listdir(root)) == ["3", "7"]
    return root


# ---- 1. Orbax and jax-ckpt steps in one manager directory --------------------------------------

def test_ls_lists_orbax_and_jax_ckpt_steps_together(capsys, mixed):
    rc, out, err = cli(capsys, "ls", mixed, "--json")
    rows = json.loads(out)
    assert rc == 0 and [(r["step"], r["state"]) for r in rows] == [(1, "orbax"), (5, "orbax"), (12, "committed"),
                                                                   (19, "committed")]
    assert [os.path.basename(r["path"]) for r in rows] == ["1", "5", "step_00000012", "step_00000019"]
    rc, out, _ = cli(capsys, "ls", mixed)
    assert rc == 0 and re.search(r"^\s+5\s+orbax\s", out, re.M) and re.search(r"^\s+19\s+committed\s", out, re.M)


def test_inspect_takes_the_latest_step_of_either_kind_and_any_step_by_number(capsys, mixed):
    rc, out, err = cli(capsys, "inspect", mixed, "--json")
    assert rc == 0 and err == f"using step 19 (latest committed) of {mixed}\n"
    doc = json.loads(out)
    assert doc["path"] == str(mixed / "step_00000019") and doc["metrics"] == {"loss": 1.0 / 19}
    rc, out, err = cli(capsys, "inspect", mixed, "--step", "19")
    assert (rc, err) == (0, "") and out.startswith(f"checkpoint {mixed}/step_00000019\n") and "step  int = 19" in out
    rc, out, err = cli(capsys, "inspect", mixed, "--step", "5", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["format"] == "orbax-checkpoint" and doc["path"] == str(mixed / "5")
    assert doc["metrics"] == {"loss": 0.2}  # Orbax's best_fn metrics, shown as a jax-ckpt step's
    assert {l["path"]: l["shape"] for l in doc["leaves"] if "shape" in l}["params/w"] == [64, 32]
    rc, _, err = cli(capsys, "inspect", mixed, "--step", "4")
    assert rc == 2 and err.strip() == f"ckpt inspect: error: no step 4 in {mixed} (committed steps: [1, 5, 12, 19])"


def test_every_command_sees_both_kinds(capsys, mixed, tmp_path):
    # verify: jax-ckpt steps checked, Orbax ones listed with the reason they are not.
    rc, out, _ = cli(capsys, "verify", mixed, "--all")
    assert rc == 0 and "step 12: 1 chunk of 1 array, 1 inline: intact" in out and "step 19:" in out
    assert "step 5: not verified, orbax (Orbax stores no checksums)" in out
    rc, _, err = cli(capsys, "verify", mixed, "--step", "5")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Orbax stores no checksums" in err and "ckpt convert" in err
    # du, plan and export: the latest step (19); du and export refuse an Orbax step in one line.
    for args in (["du"], ["plan", "--mesh", "data=1"], ["export", str(tmp_path / "hf")]):
        rc, out, err = cli(capsys, args[0], mixed, *args[1:])
        assert rc == 0 and (f"using step 19 (latest committed) of {mixed}" in err  # export names it in its result
                            or f"of {mixed}/step_00000019" in out), (args, out, err)
        if args[0] != "plan":
            rc, _, err = cli(capsys, args[0], mixed, "--step", "5", *args[1:])
            assert rc == 2 and "is an Orbax checkpoint" in err and len(err.strip().splitlines()) == 1, err
    assert np.array_equal(ckpt.restore(tmp_path / "hf")["params"]["w"], W + 19)
    # plan of an Orbax step: what restore would read of it, from its layout.
    rc, out, _ = cli(capsys, "plan", mixed, "--step", "5", "--mesh", "data=2", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["format"] == "orbax-checkpoint" and doc["path"] == str(mixed / "5")
    assert doc["total"]["bytes_needed"] == W.nbytes + 32 * 4 + 8  # numpy arrays (no mesh recorded): once, on the host
    assert doc["total"]["bytes_read"] >= W.nbytes and doc["total"]["chunks_read"] >= 3
    # diff: an Orbax step against a jax-ckpt one, values compared.
    rc, out, _ = cli(capsys, "diff", mixed / "5", mixed / "step_00000019", "--json")
    doc = json.loads(out)
    arrays = {a["path"]: a for a in doc["arrays"]}
    assert rc == 1 and arrays["params/w"]["differing"] == 64 * 32 and arrays["params/w"]["max_abs_diff"] == 14.0
    assert doc["metadata_changed"] == [{"in": "metrics", "key": "loss", "a": 0.2, "b": 1.0 / 19, "only_in": None}]
    rc, out, _ = cli(capsys, "diff", mixed / "5", mixed / "5")
    assert rc == 0 and "summary: identical" in out
    assert cli(capsys, "convert", mixed, tmp_path / "converted", "--step", "5")[0] == 0
    rc, out, _ = cli(capsys, "diff", mixed / "5", tmp_path / "converted", "--json")
    doc = json.loads(out)
    assert [(a["path"], a["equal"]) for a in doc["arrays"]] == [("params/b", True), ("params/w", True)]
    # Orbax keeps the Python int `step` as a 0-d array, the converted checkpoint as an int: one value.
    assert not (doc["only_in_a"] or doc["only_in_b"] or doc["kind_changed"]), doc
    assert doc["values"] == [{"path": "step", "equal": True, "a": 5, "b": 5}]
    assert doc["metadata_changed"] == []  # the conversion keeps the step's metrics (issue 37)


# ---- 2. step_prefix=None -----------------------------------------------------------------------

def test_a_manager_directory_saved_with_step_prefix_none(capsys, bare):
    rc, out, _ = cli(capsys, "ls", bare, "--json")
    assert rc == 0 and [(r["step"], r["state"]) for r in json.loads(out)] == [(3, "committed"), (7, "committed")]
    rc, out, err = cli(capsys, "inspect", bare)
    assert rc == 0 and err == f"using step 7 (latest committed) of {bare}\n" and "step  int = 7" in out
    rc, out, err = cli(capsys, "verify", bare, "--step", "3")
    assert rc == 0 and out.startswith(f"verified {bare}/3\n") and "result: intact" in out
    rc, out, _ = cli(capsys, "verify", bare, "--all")
    assert rc == 0 and "verified 2 committed step(s)" in out
    rc, out, _ = cli(capsys, "du", bare, "--json")
    assert rc == 0 and json.loads(out)["path"] == str(bare / "7")
    (bare / "9.tmp-0123456789ab").mkdir()  # a save of step 9 just begun
    try:
        rc, out, _ = cli(capsys, "ls", bare, "--json")
        assert [(r["step"], r["state"]) for r in json.loads(out)][-1] == (9, "uncommitted")
        rc, _, err = cli(capsys, "inspect", bare, "--step", "9")
        assert rc == 2 and f"step 9 in {bare} is not committed" in err and "committed steps: [3, 7]" in err
        assert cli(capsys, "inspect", bare)[2] == f"using step 7 (latest committed) of {bare}\n"
    finally:
        (bare / "9.tmp-0123456789ab").rmdir()


# ---- 3. whatever ckpt.metadata reads -----------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("newcomer")
    tree = {"model": {"emb": (np.arange(128 * 16, dtype=np.float32).reshape(128, 16) % 97).astype(ml_dtypes.bfloat16),
                      "w": W, "n": np.arange(10, dtype=np.int64)}, "step": 3}
    ckpt.save(root / "src", tree)
    ckpt.safetensors.export(root / "src", root / "one")
    ckpt.safetensors.export(root / "src", root / "sharded", shard_size=5000)
    assert sorted(os.listdir(root / "sharded"))[-1] == "model.safetensors.index.json"
    return root


@pytest.mark.parametrize("where", ["one", "one/model.safetensors", "sharded", "sharded/model.safetensors.index.json"])
def test_inspect_reads_safetensors_as_metadata_does(capsys, exported, where):
    path = exported / where
    rc, out, err = cli(capsys, "inspect", path, "--json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    md = ckpt.metadata(path)
    assert doc["format"] == "safetensors" and doc["totals"]["arrays"] == 3
    for leaf in doc["leaves"]:
        a, b = leaf["path"].split("/")
        assert (tuple(leaf["shape"]), leaf["dtype"], leaf["nbytes"]) == (md[a][b].shape, str(md[a][b].dtype), md[a][b].nbytes)
        assert leaf["storage"] == "safetensors" and leaf["storage_path"] == md[a][b].storage_path
    rc, text, _ = cli(capsys, "inspect", path)
    emb = next(line for line in text.splitlines() if line.strip().startswith("emb "))
    assert rc == 0 and "bfloat16" in emb and "[128,16]" in emb and "safetensors model" in emb


def test_diff_compares_safetensors_with_the_checkpoint_they_came_from(capsys, exported):
    rc, out, _ = cli(capsys, "diff", exported / "src", exported / "sharded", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["only_in_a"] == ["step"] and doc["only_in_b"] == []  # a number is not a tensor
    assert {a["path"]: a["equal"] for a in doc["arrays"]} == {"model/emb": True, "model/w": True, "model/n": True}
    rc, out, _ = cli(capsys, "diff", exported / "one/model.safetensors", exported / "sharded")
    assert rc == 0 and "summary: identical" in out


# ---- 4. tables on a terminal -------------------------------------------------------------------

AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context", "context_autoregressive", "tensor",
        "tensor_transpose", "tensor_sequence", "expert", "autoregressive")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Flax NNX model's state (class annotations on every variable) with bfloat16 params on a
    12-axis mesh, as MaxText lays them out."""
    from flax import nnx

    root = tmp_path_factory.mktemp("newcomer") / "wide"
    mesh = Mesh(np.array(jax.devices()[:8]).reshape((2, 1, 4) + (1,) * 9), AXES)
    model = nnx.Linear(32, 64, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    state = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(("data", "stage"), ("fsdp", "tensor"))))
                         if x.ndim == 2 else jax.device_put(x, NamedSharding(mesh, P(("fsdp", "tensor")))), state)
    ckpt.save(root, {"params": state, "step": 1})
    return root


def _table_lines(text):
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("NAME"))
    return lines[start:]


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_inspect_fits_a_terminal_and_never_cuts_a_value_silently(wide, columns):
    rc, _, term = on_terminal("inspect", wide, stdout_tty=True, env={"COLUMNS": str(columns)})
    text = ANSI.sub("", term).replace("\r", "")
    assert rc == 0 and "\x1b[" in term
    assert max(len(line) for line in text.splitlines()) <= columns, text
    table = _table_lines(text)
    header = table[0].split()
    kernel = next(line for line in table if "[32,64]" in line)  # kernel/ (Param) then its value
    # Every value is whole, or visibly cut (an ellipsis), or its column is named as left out.
    assert "bfloat16" in kernel and "[32,64]" in kernel, kernel
    for value in ["value", "bfloat16", "[32,64]", "P(('data', 'stage'), ('fsdp', 'tensor'))", "4.00 KiB"]:
        cut = [value[:k] + "…" for k in range(1, len(value))]
        assert value in kernel or any(c in kernel for c in cut), (value, kernel)
    left_out = [c for c in ["MESH", "CHUNK", "CHUNKS", "STORAGE"] if c not in header]
    if left_out:
        note = next(line for line in text.splitlines() if line.startswith("note:"))
        assert all(c in note for c in left_out) and str(columns) in note, note
    # The 12-axis mesh is named once above the table, in full, wrapped after its commas.
    assert "mesh m1: " + ",".join(f"{a}={n}" for a, n in zip(AXES, (2, 1, 4) + (1,) * 9)) in text.replace(",\n  ", ",")
    # NNX class annotations are lines of their own: the NAME column stays as narrow as the names.
    assert "  kernel/  (flax.nnx.variablelib.Param)" in table and table[0].index("DTYPE") == len("    value  ")


def test_inspect_piped_prints_whole_lines_with_a_long_mesh_named_once(wide):
    out = run("inspect", wide, check_rc=0).stdout
    assert "\x1b" not in out and "…" not in out and "note:" not in out
    assert max(len(line) for line in _table_lines(out)) < 130  # each row once carried the 170-character mesh
    assert "mesh m1: " + ",".join(f"{a}={n}" for a, n in zip(AXES, (2, 1, 4) + (1,) * 9)) in out
    kernel = next(line for line in out.splitlines() if line.strip().startswith("value") and "[32,64]" in line)
    for cell in ["bfloat16", "[32,64]", "m1", "P(('data', 'stage'), ('fsdp', 'tensor'))", "inline"]:
        assert cell in kernel, (cell, kernel)


# ---- 5. honest numbers, flags, suggestions, unreachable stores ---------------------------------

def test_verify_all_json_times_each_step_and_the_whole(capsys, bare):
    rc, out, _ = cli(capsys, "verify", bare, "--all", "--json")
    doc = json.loads(out)
    steps = [s["seconds"] for s in doc["steps"]]
    # Each step's own span (first chunk sent to last chunk checked), within the whole: not the
    # total repeated, as every step's `seconds` once was.
    assert rc == 0 and len(steps) == 2 and doc["seconds"] > 0 and all(0 < s < doc["seconds"] for s in steps)


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    path = tmp_path_factory.mktemp("newcomer") / "stacked"
    ckpt.save(path, {"small": {f"b{i}": np.full(2048, i, np.float32) for i in range(20)}, "w": W})
    from ckpt._format import read_manifest
    from ckpt.storage import open_storage

    manifest = read_manifest(open_storage(path, ckpt.Options().resolved()))
    assert manifest.stacks and sum(l.stacked is not None for l in manifest.leaves) == 20
    return path


def test_stacked_leaves_count_the_stack_chunks_they_lie_in(capsys, stacked):
    doc = json.loads(cli(capsys, "du", stacked, "--json")[1])
    small = next(s for s in doc["subtrees"] if s["path"] == "small")
    inspect = json.loads(cli(capsys, "inspect", stacked, "--json")[1])
    assert small["arrays"] == 20 and small["chunks"] >= 1
    assert sum(s["chunks"] for s in doc["subtrees"]) == inspect["totals"]["chunks"]
    plan = json.loads(cli(capsys, "plan", stacked, "--mesh", "data=1", "--per-leaf", "--json")[1])
    leaves = {l["path"]: l for l in plan["per_leaf"]}
    assert leaves["small/b3"]["chunks_read"] == 1 and leaves["w"]["chunks_read"] == 1
    rc, text, _ = cli(capsys, "plan", stacked, "--mesh", "data=1", "--per-leaf")
    assert rc == 0 and re.search(r"^small/b3\s+\S+ \S+\s+1\s", text, re.M), text


def test_no_output_says_1_chunks(capsys, bare, mixed):
    texts = [cli(capsys, *args)[1] for args in (["verify", bare], ["verify", bare, "--all"], ["inspect", bare],
                                                ["inspect", mixed, "--step", "19"])]
    assert all(t for t in texts)
    assert not any(re.search(r"\b1 (chunks|arrays|inline arrays)\b", t) for t in texts), texts
    assert "read 1 chunk of 1 array" in texts[0] and "step 7: 1 chunk of 1 array" in texts[1]


def test_errors_name_the_flags_and_mistyped_options_get_a_suggestion(capsys, bare, tmp_path):
    assert cli(capsys, "export", bare, tmp_path / "hf")[0] == 0
    rc, _, err = cli(capsys, "export", bare, tmp_path / "hf")
    assert rc == 2 and "--overwrite" in err and "overwrite=True" not in err
    # No abbreviations: '--overwrit' is not taken for '--overwrite' (it once was, silently).
    rc, _, err = cli(capsys, "export", bare, tmp_path / "hf", "--overwrit")
    assert rc == 2 and "unrecognized arguments: --overwrit; did you mean --overwrite?" in err
    rc, _, err = cli(capsys, "inspect", bare, "--stpe", "3")
    assert rc == 2 and "did you mean --step?" in err
    rc, _, err = cli(capsys, "diff", bare, bare, "--atoll", "1")
    assert rc == 2 and "did you mean --atol?" in err
    rc, _, err = cli(capsys, "ls", bare, "--jsno")
    assert rc == 2 and "did you mean --json?" in err and len(err.strip().splitlines()) == 1


def test_convert_onto_a_checkpoint_names_the_flag(capsys, mixed, tmp_path):
    ckpt.save(tmp_path / "taken", {"x": np.zeros(2)})
    rc, _, err = cli(capsys, "convert", mixed / "5", tmp_path / "taken")
    assert rc == 2 and "pass --overwrite to replace it" in err and "overwrite=True" not in err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.mark.parametrize("engine", ["tensorstore", "fsspec"])
def test_an_unreachable_object_store_is_one_line_soon(engine):
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1", "HOME": "/nonexistent",
           "CKPT_REQUEST_TIMEOUT_S": "20"}
    start = time.monotonic()
    p = subprocess.run([*CKPT, "inspect", "s3://bucket/run", "--engine", engine], capture_output=True, text=True,
                       env=env, timeout=120)
    seconds = time.monotonic() - start
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt inspect: error:") and "s3://bucket/run" in lines[0], p.stderr
    # Not a timing assertion on the machine's speed: the library's retries take ~9 s (tensorstore)
    # and ~30 s (fsspec) here; the CLI's take one or two (docs/cli.md). 20 s leaves room for a busy machine.
    assert seconds < 20, seconds


# ---- 6. diff --atol/--rtol, metrics and user metadata -------------------------------------------

def test_diff_tolerances_and_metadata(capsys, tmp_path):
    a = {"w": W, "i": np.arange(8)}
    b = {"w": W + np.where(np.arange(64 * 32).reshape(64, 32) % 2, 1e-3, 0).astype(np.float32), "i": np.arange(8) + 1}
    for name, tree, meta in [("a", a, {"run": "x", "lr": 0.1, "eval": "acc"}), ("b", b, {"run": "x", "lr": 0.2, "seed": 3})]:
        with ckpt.CheckpointManager(tmp_path / f"run_{name}", async_save=False) as m:
            m.save(1, tree, metadata=meta)
        os.rename(tmp_path / f"run_{name}" / "step_00000001", tmp_path / name)
    rc, out, _ = cli(capsys, "diff", tmp_path / "a", tmp_path / "b", "--json")
    doc = json.loads(out)
    arrays = {x["path"]: x for x in doc["arrays"]}
    assert rc == 1 and arrays["w"]["differing"] == 64 * 16 and arrays["i"]["differing"] == 8
    changes = {(c["in"], c["key"]): (c["a"], c["b"], c["only_in"]) for c in doc["metadata_changed"]}
    assert changes == {("user_metadata", "lr"): (0.1, 0.2, None), ("user_metadata", "eval"): ("acc", None, "a"),
                       ("user_metadata", "seed"): (None, 3, "b")}
    rc, out, _ = cli(capsys, "diff", tmp_path / "a", tmp_path / "b", "--atol", "1e-2")
    assert rc == 1 and re.search(r"^  w\s+equal within tolerance  max \|a-b\| = 0\.001", out, re.M), out
    assert re.search(r"^  i\s+differ", out, re.M) and "user_metadata.lr: 0.1 -> 0.2" in out
    rc, out, _ = cli(capsys, "diff", tmp_path / "a", tmp_path / "b", "--atol", "1", "--json")
    assert all(x["equal"] for x in json.loads(out)["arrays"])
    rc, out, _ = cli(capsys, "diff", tmp_path / "a", tmp_path / "b", "--rtol", "0.6", "--json")
    arrays = {x["path"]: x for x in json.loads(out)["arrays"]}
    assert arrays["w"]["equal"] and arrays["i"]["differing"] == 1  # only 0 vs 1 is beyond 60 % of B
    with_metrics = tmp_path / "m"
    with ckpt.CheckpointManager(with_metrics, async_save=False) as m:
        m.save(1, a, metrics={"loss": 0.5})
        m.save(2, a, metrics={"loss": 0.25})
    rc, out, _ = cli(capsys, "diff", with_metrics / "step_00000001", with_metrics / "step_00000002")
    assert rc == 1 and "metrics.loss: 0.5 -> 0.25" in out and "1 metadata change(s)" in out


@pytest.mark.parametrize("columns", [40, 60, 100])
def test_ls_du_and_plan_tables_never_crop_a_cell(capsys, mixed, stacked, columns):
    """rich shrinks a table wider than the terminal by cutting cells without a mark ('b' for
    bfloat16, '4' for '4.00 KiB'): names and paths fold instead, other cells stay whole, and a
    terminal too narrow even for that gets the rows as plain lines it wraps."""
    from ckpt.cli._render import human_bytes

    rows = json.loads(cli(capsys, "ls", mixed, "--json")[1])
    rc, _, term = on_terminal("ls", mixed, stdout_tty=True, env={"COLUMNS": str(columns)})
    text = ANSI.sub("", term).replace("\r", "")
    assert rc == 0 and max(len(line) for line in text.splitlines()) <= columns
    for r in rows:
        assert re.search(rf"\b{r['state']}\b", text) and human_bytes(r["bytes"]) in text, (r, text)
    plan = json.loads(cli(capsys, "plan", stacked, "--mesh", "data=1", "--per-leaf", "--json")[1])
    rc, _, term = on_terminal("plan", stacked, "--mesh", "data=1", "--per-leaf", stdout_tty=True,
                              env={"COLUMNS": str(columns)})
    text = ANSI.sub("", term).replace("\r", "")
    assert rc == 0 and max(len(line) for line in text.splitlines()) <= columns
    for leaf in plan["per_leaf"]:
        assert human_bytes(leaf["bytes_read"]) in text and f"{leaf['read_amplification']:.2f}x" in text
    du = json.loads(cli(capsys, "du", stacked, "--json")[1])
    rc, _, term = on_terminal("du", stacked, stdout_tty=True, env={"COLUMNS": str(columns)})
    text = ANSI.sub("", term).replace("\r", "")
    assert rc == 0 and all(human_bytes(s["bytes"]) in text and f"{100 * s['share']:.1f}%" in text
                           for s in du["subtrees"]), text
