"""Orbax checkpoints read without Orbax: real checkpoints written here by orbax-checkpoint (a test
dependency) from an optax state with bf16, int8, typed and raw PRNG keys and scalars on a 4x2 mesh,
in every layout (OCDBT, per-array Zarr v2 and v3, OCDBT with Zarr v3, a CheckpointManager step
with a JSON item), restored with no target, with a target and on other meshes (2x4, 8, 1 device),
converted to jax-ckpt, and damaged. Plus a checkpoint orbax-checkpoint 0.11.0 wrote (tests/data).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import crc32c
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli._main import main

DATA_011 = os.path.join(os.path.dirname(__file__), "data", "orbax-0.11.0")
LAYOUTS = ["ocdbt", "zarr3", "zarr2", "ocdbt_zarr3", "manager"]


def _state():
    """An optax training state on a 4x2 mesh, deterministic values; also returns (numpy values by
    path, PartitionSpec by path) as restore without a target must give them."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))

    def put(a, *spec):
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))

    params = {
        "w": put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7, "data", "model"),
        "emb": put((np.arange(128 * 16, dtype=np.float32).reshape(128, 16) % 97).astype(ml_dtypes.bfloat16),
                   None, "model"),
        "q": put((np.arange(64 * 128) % 251 - 125).astype(np.int8).reshape(64, 128), "data", None),
        "b": put(np.arange(32, dtype=np.float32).astype(ml_dtypes.bfloat16), "model"),
    }
    opt = optax.adam(1e-3)
    opt_state = opt.init({k: v for k, v in params.items() if k != "q"})
    # Make the moments differ from zeros so that a misplaced shard would show.
    opt_state = jax.tree.map(lambda x: x + jnp.ones_like(x) * 3 if x.ndim else x + 5, opt_state)
    keys = jax.device_put(jax.random.split(jax.random.key(7), 8), NamedSharding(mesh, P("data")))
    state = {"params": params, "opt": opt_state, "step": 1234, "lr": 0.25, "keys": keys,
             "key": jax.random.key(11), "raw_key": jax.random.PRNGKey(5), "host": np.arange(3000, dtype=np.int64)}
    return mesh, state


def _expected(state):
    out, specs = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            out[name] = ("key", np.asarray(jax.random.key_data(leaf)))
        elif isinstance(leaf, jax.Array):
            out[name] = np.asarray(leaf)
        else:
            out[name] = leaf
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding):
            specs[name] = leaf.sharding.spec
    return out, specs


def _get(tree, path):
    for part in path.split("/"):
        if hasattr(tree, "_fields") and not part.isdigit():  # a NamedTuple (optax states)
            tree = getattr(tree, part)
        else:
            tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree


def _check_value(got, want, where):
    if isinstance(want, tuple) and want[0] == "key":
        assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key), where
        data = jax.random.key_data(got)
        if isinstance(got, jax.Array):
            for shard in data.addressable_shards:
                assert np.array_equal(np.asarray(shard.data), want[1][shard.index]), where
        assert np.array_equal(np.asarray(data), want[1]), where
    elif isinstance(want, np.ndarray):
        if isinstance(got, jax.Array):
            assert got.dtype == want.dtype, (where, got.dtype)
            for shard in got.addressable_shards:
                assert np.array_equal(np.asarray(shard.data), want[shard.index]), (where, shard.index)
        else:
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype, (where, type(got))
            assert np.array_equal(got, want), where
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


@pytest.fixture(scope="module")
def orbax_ckpts(tmp_path_factory):
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("orbax")
    mesh, state = _state()
    paths = {}
    ocp.StandardCheckpointer().save(root / "ocdbt", state)
    for name, ocdbt, zarr3 in [("zarr3", False, True), ("zarr2", False, False), ("ocdbt_zarr3", True, True)]:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)) as c:
            c.save(root / name, args=ocp.args.PyTreeSave(state))
    with ocp.CheckpointManager(root / "manager", options=ocp.CheckpointManagerOptions(max_to_keep=3)) as m:
        for step in (10, 20):
            m.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 meta=ocp.args.JsonSave({"step": step, "tag": "run-1"})))
        m.wait_until_finished()
    for name in LAYOUTS[:4]:
        paths[name] = str(root / name)
    paths["manager"] = str(root / "manager" / "20" / "state")
    paths["manager_root"], paths["step"] = str(root / "manager"), str(root / "manager" / "20")
    want, specs = _expected(state)
    return {"paths": paths, "want": want, "specs": specs, "mesh": mesh, "state": state, "root": root}


def _meshes():
    devices = np.array(jax.devices())
    return {"2x4": jax.make_mesh((2, 4), ("data", "model")),
            "8": Mesh(devices.reshape(8, 1), ("data", "model")),
            "1": Mesh(devices[:1].reshape(1, 1), ("data", "model"))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_restore_without_target_gives_every_value(orbax_ckpts, layout):
    out = ckpt.restore(orbax_ckpts["paths"][layout])
    for path, want in orbax_ckpts["want"].items():
        _check_value(_get(out, path), want, path)
    # As Orbax returns them: sequences as lists, an empty optax state as None, numbers as numbers.
    assert isinstance(out["opt"], list) and out["opt"][1] is None
    assert type(out["step"]) is int and type(out["lr"]) is float


@pytest.mark.parametrize("mesh_name", ["2x4", "8", "1"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_restore_on_other_meshes_with_the_saved_specs(orbax_ckpts, layout, mesh_name):
    mesh = _meshes()[mesh_name]
    out = ckpt.restore(orbax_ckpts["paths"][layout], mesh=mesh)
    for path, spec in orbax_ckpts["specs"].items():
        got = _get(out, path)
        assert got.sharding.mesh == mesh and got.sharding.is_equivalent_to(NamedSharding(mesh, spec), got.ndim), \
            (path, got.sharding)
    for path, want in orbax_ckpts["want"].items():
        _check_value(_get(out, path), want, path)


@pytest.mark.parametrize("layout", ["ocdbt", "zarr2"])
def test_restore_with_a_target_gives_its_node_types_shardings_and_dtypes(orbax_ckpts, layout):
    mesh = _meshes()["2x4"]
    state = orbax_ckpts["state"]
    def last_dim_on_model(x):
        spec = P(*([None] * (x.ndim - 1)), "model") if x.ndim and x.shape[-1] % 4 == 0 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    target = jax.tree.map(lambda x: last_dim_on_model(x) if isinstance(x, jax.Array) else x, state)
    target["params"]["w"] = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("model", "data")))
    target["host"] = np.zeros(3000, np.int64)
    out = ckpt.restore(orbax_ckpts["paths"][layout], target)
    assert type(out["opt"][0]) is optax.ScaleByAdamState and type(out["opt"][1]) is optax.EmptyState
    assert out["params"]["w"].sharding.spec == P("model", "data")
    assert out["keys"].sharding.spec == P("model") and jax.dtypes.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
    assert isinstance(out["host"], np.ndarray) and out["step"] == 1234
    for path, want in orbax_ckpts["want"].items():
        _check_value(_get(out, path), want, path)
    # A dtype the target asks for casts; a partial target reads only its leaves.
    part = ckpt.restore(orbax_ckpts["paths"][layout],
                        {"params": {"emb": jax.ShapeDtypeStruct((128, 16), jnp.float32)}}, partial=True)
    assert part["params"]["emb"].dtype == jnp.float32
    assert np.array_equal(np.asarray(part["params"]["emb"]), orbax_ckpts["want"]["params/emb"].astype(np.float32))
    with pytest.raises(ckpt.TreeMismatchError):
        ckpt.restore(orbax_ckpts["paths"][layout], {"params": {"nope": jax.ShapeDtypeStruct((1,), jnp.float32)}})


def test_metadata_describes_without_reading_data(orbax_ckpts):
    meta = ckpt.metadata(orbax_ckpts["paths"]["ocdbt"])
    w = meta["params"]["w"]
    assert (w.shape, w.dtype, w.mesh, w.partition_spec) == ((64, 32), np.float32, {"data": 4, "model": 2},
                                                            P("data", "model"))
    assert meta["keys"].shape == (8,) and meta["keys"].kind == "prng_key" and meta["keys"].partition_spec == P("data")
    assert meta["params"]["emb"].dtype == ml_dtypes.bfloat16 and meta["params"]["q"].dtype == np.int8


def test_manager_step_holds_every_item_and_the_root_says_which_step(orbax_ckpts, capsys):
    paths = orbax_ckpts["paths"]
    step = ckpt.restore(paths["step"])
    assert step["meta"] == {"step": 20, "tag": "run-1"}
    _check_value(step["state"]["params"]["w"], orbax_ckpts["want"]["params/w"], "w")
    only_state = ckpt.restore(paths["step"], {"state": {"step": 0}}, partial=True)
    assert only_state == {"state": {"step": 1234}}
    with pytest.raises(ckpt.CheckpointError, match="CheckpointManager directory.*20"):
        ckpt.restore(paths["manager_root"])
    assert main(["ls", paths["manager_root"]]) == 0
    out = capsys.readouterr().out
    assert "orbax" in out and os.path.join(paths["manager_root"], "10") in out
    assert main(["inspect", paths["manager_root"]]) == 0
    text = capsys.readouterr()
    assert "Orbax CheckpointManager step" in text.out and "key<fry>" in text.out and "step 20 (latest)" in text.err
    assert main(["verify", paths["step"]]) == 2
    assert "is an Orbax checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convert_writes_a_checkpoint_with_every_value(orbax_ckpts, layout, tmp_path):
    dest = str(tmp_path / "converted")
    ckpt.convert(orbax_ckpts["paths"][layout], dest)
    for path, want in orbax_ckpts["want"].items():
        _check_value(_get(ckpt.restore(dest), path), want, path)
    out = ckpt.restore(dest, mesh=_meshes()["2x4"])
    for path, want in orbax_ckpts["want"].items():
        _check_value(_get(out, path), want, path)
    for path, spec in orbax_ckpts["specs"].items():
        assert _get(out, path).sharding.spec == spec
    assert ckpt.metadata(dest)["params"]["w"].chunk_shape == (16, 16)  # the saved shard shape
    assert main(["verify", dest]) == 0
    with pytest.raises(FileExistsError):
        ckpt.convert(orbax_ckpts["paths"][layout], dest)


def _manifest_doc(path) -> dict:
    with open(os.path.join(path, "manifest.msgpack"), "rb") as f:
        return msgpack.unpackb(f.read())


def _check_commit_record(dest) -> dict:
    """The manifest a convert wrote is the one a save writes: format version 1 (no stacks: the
    lowest version that describes it), the CRC-32C of every zarr.json the checkpoint holds, and
    `ckpt verify` passes; returns the manifest document."""
    doc = _manifest_doc(dest)
    assert doc["format_version"] == 1 and "stacks" not in doc
    on_disk = {}
    for d, _, files in os.walk(dest):
        if "zarr.json" in files:
            with open(os.path.join(d, "zarr.json"), "rb") as f:
                on_disk[os.path.relpath(os.path.join(d, "zarr.json"), dest).replace(os.sep, "/")] = crc32c.crc32c(f.read())
    zarr_leaves = [leaf for leaf in doc["leaves"] if (leaf.get("storage") or {}).get("type") == "zarr"]
    assert zarr_leaves and "zarr.json" in on_disk  # (arrays, and the root group)
    assert doc["zarr_json_crc32c"] == on_disk
    assert {f"{leaf['storage']['path']}/zarr.json" for leaf in zarr_leaves} <= set(on_disk)
    return doc


@pytest.mark.parametrize("layout", ["ocdbt", "zarr2"])
def test_a_converted_checkpoint_is_committed_as_a_save_is_and_verifies(orbax_ckpts, layout, tmp_path, capsys):
    dest = str(tmp_path / "converted")
    ckpt.convert(orbax_ckpts["paths"][layout], dest)
    doc = _check_commit_record(dest)
    capsys.readouterr()
    assert main(["verify", dest]) == 0
    out = capsys.readouterr().out
    assert f"verified {dest}" in out and "result: intact, every chunk matches its checksum" in out
    zarr_leaves = sum((leaf.get("storage") or {}).get("type") == "zarr" for leaf in doc["leaves"])
    assert f"chunks of {zarr_leaves} arrays" in out
    got = ckpt.restore(dest)
    for path, want in orbax_ckpts["want"].items():
        _check_value(_get(got, path), want, path)

    # The recorded checksums are checked: a zarr.json changed after the convert is named.
    w_json = os.path.join(dest, "params", "w", "zarr.json")
    meta = json.loads(open(w_json).read())
    meta["attributes"]["jax_ckpt"]["note"] = "edited"
    with open(w_json, "w") as f:
        f.write(json.dumps(meta))
    assert main(["verify", dest]) == 1
    out = capsys.readouterr().out
    assert "params/w/zarr.json" in out and "zarr.json was changed after the save" in out and "DAMAGED" in out


def test_a_convert_to_a_generation_prefix_records_its_checksums_there(orbax_ckpts, capsys):
    # No rename (memory://): the data goes under a generation prefix, and so do the recorded keys.
    dest = f"memory://convert/{uuid.uuid4().hex}/c"
    ckpt.convert(orbax_ckpts["paths"]["zarr3"], dest)
    capsys.readouterr()
    assert main(["verify", dest]) == 0
    assert "result: intact" in capsys.readouterr().out
    from support import manifest_of

    manifest = manifest_of(dest)
    assert manifest.format_version == 1 and not manifest.stacks
    prefixes = {key.split("/", 1)[0] for key in manifest.zarr_json}
    assert len(prefixes) == 1 and prefixes.pop().startswith("gen-")
    arrays = {f"{leaf.zarr.path}/zarr.json" for leaf in manifest.leaves if leaf.zarr is not None}
    assert arrays and arrays < set(manifest.zarr_json)
    _check_value(ckpt.restore(dest)["params"]["w"], orbax_ckpts["want"]["params/w"], "w")


def test_convert_checks_its_files_are_there_before_committing(orbax_ckpts, tmp_path, monkeypatch):
    """A chunk file removed from the staged place before the commit (another process cleaning
    up, say) fails the convert as it fails a save, and nothing is committed or left behind."""
    import ckpt._convert as convert_module
    from ckpt._geometry import chunk_key

    real, removed = convert_module._convert_leaf, []

    def convert_leaf_then_lose_a_chunk(arrays, i, leaf, staged, path, specs, options):
        rec = real(arrays, i, leaf, staged, path, specs, options)
        if i in specs and not removed:
            removed.append(f"{path}/{chunk_key((0,) * len(rec.shape))}")
            staged.storage.delete(removed[0])
        return rec

    monkeypatch.setattr(convert_module, "_convert_leaf", convert_leaf_then_lose_a_chunk)
    dest = tmp_path / "out" / "converted"
    dest.parent.mkdir()
    with pytest.raises(ckpt.CheckpointError,
                       match=r"convert to .*converted: 1 file\(s\) it wrote are gone or changed before the commit.*"
                             r"\(missing\).*nothing was committed") as err:
        ckpt.convert(orbax_ckpts["paths"]["zarr3"], dest)
    assert removed and removed[0] in str(err.value)
    assert os.listdir(dest.parent) == []  # no checkpoint, no staged leftovers


def test_convert_command_and_a_whole_step(orbax_ckpts, tmp_path, capsys):
    dest = str(tmp_path / "step")
    assert main(["convert", orbax_ckpts["paths"]["manager_root"], dest, "--step", "10"]) == 0
    assert "converted Orbax CheckpointManager step" in capsys.readouterr().out
    out = ckpt.restore(dest)
    assert out["meta"] == {"step": 10, "tag": "run-1"}
    _check_value(out["state"]["keys"], orbax_ckpts["want"]["keys"], "keys")
    assert main(["convert", str(tmp_path), str(tmp_path / "x")]) == 2


def test_convert_streams_leaf_by_leaf(orbax_ckpts, tmp_path):
    # Chunk reads go in batches of at most max_inflight_bytes: one chunk (16x16 f32 = 1 KiB) here.
    dest = str(tmp_path / "small_batches")
    ckpt.convert(orbax_ckpts["paths"]["zarr3"], dest, options=ckpt.Options(max_inflight_bytes=1024))
    _check_value(ckpt.restore(dest)["params"]["w"], orbax_ckpts["want"]["params/w"], "w")


def _copy(orbax_ckpts, layout, tmp_path):
    dst = tmp_path / layout
    shutil.copytree(orbax_ckpts["paths"][layout], dst)
    return dst


def test_damaged_checkpoints_are_refused_with_the_leaf_and_file(orbax_ckpts, tmp_path):
    bad = _copy(orbax_ckpts, "zarr2", tmp_path)
    os.remove(bad / "params.w" / "1.0")
    with pytest.raises(ckpt.CheckpointError, match=r"params/w.*7 of its 8 chunks"):
        ckpt.restore(bad)
    with pytest.raises(ckpt.CheckpointError, match="params/w"):
        ckpt.convert(bad, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert ckpt.restore(bad, {"lr": 0.0}, partial=True) == {"lr": 0.25}  # the rest still reads

    huge = _copy(orbax_ckpts, "zarr2", tmp_path / "huge")  # claims a 4 TiB array in one stored chunk
    zarray = json.loads((huge / "params.w" / ".zarray").read_text())
    (huge / "params.w" / ".zarray").write_text(json.dumps({**zarray, "shape": [2**40], "chunks": [2**40]}))
    for f in os.listdir(huge / "params.w"):
        if f != ".zarray":
            os.remove(huge / "params.w" / f)
    (huge / "params.w" / "0").write_bytes(b"\x00" * 16)
    assert ckpt.metadata(huge)["params"]["w"].shape == (2**40,)  # describing it allocates nothing
    with pytest.raises(ckpt.CheckpointError, match="params/w.*more than this machine's memory"):
        ckpt.restore(huge)
    with pytest.raises(ckpt.CheckpointError, match="params/w.*more than this machine's memory"):
        ckpt.restore(huge, {"params": {"w": NamedSharding(_meshes()["8"], P("data"))}}, partial=True)
    with pytest.raises(ckpt.CheckpointError, match="params/w.*more than this machine's memory"):
        ckpt.convert(huge, tmp_path / "never")

    (bad / "_METADATA").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="_METADATA is not valid JSON"):
        ckpt.restore(bad)
    (bad / "_METADATA").write_text('{"tree_metadata": {"x": {"key_metadata": [{"key": "..", "key_type": 2}], '
                                   '"value_metadata": {"value_type": "jax.Array", "skip_deserialize": false}}}}')
    with pytest.raises(ckpt.CheckpointError, match="not a path inside the checkpoint"):
        ckpt.restore(bad)
    (bad / "_METADATA").write_text('{"tree_metadata": {"x": {"key_metadata": [{"key": "x", "key_type": 2}], '
                                   '"value_metadata": {"value_type": "my.Custom", "skip_deserialize": false}}}}')
    with pytest.raises(ckpt.CheckpointError, match="custom Orbax TypeHandler"):
        ckpt.restore(bad)

    ocdbt = _copy(orbax_ckpts, "ocdbt", tmp_path)
    for d, _, files in os.walk(ocdbt):
        for f in files:
            if os.path.basename(d) == "d":  # OCDBT data files
                with open(os.path.join(d, f), "r+b") as fh:
                    fh.truncate(16)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.restore(ocdbt)

    odd = _copy(orbax_ckpts, "zarr3", tmp_path)
    shardings = json.loads((odd / "_sharding").read_text())
    shardings["cGFyYW1zLnc="] = '{"sharding_type": "GSPMDSharding"}'  # params.w
    (odd / "_sharding").write_text(json.dumps(shardings))
    out = ckpt.restore(odd, {"params": {"w": NamedSharding(_meshes()["2x4"], P("data"))}}, partial=True)
    _check_value(out["params"]["w"], orbax_ckpts["want"]["params/w"], "w")  # a target still works
    with pytest.raises(ckpt.CheckpointError, match="params/w.*no PartitionSpec"):
        ckpt.restore(odd, mesh=_meshes()["2x4"])


def test_a_checkpoint_orbax_0_11_wrote(tmp_path):
    """tests/data/orbax-0.11.0: written by orbax-checkpoint 0.11.0 (jax 0.5.0; make_orbax_0_11.py):
    no use_ocdbt flag, no write_shape, no array_metadatas, no typed keys yet."""
    want = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
    for path in ["manager/3/state", "manager/3", "zarr2"]:
        out = ckpt.restore(os.path.join(DATA_011, path))
        out = out.get("state", out)
        assert np.array_equal(out["params"]["w"], want) and out["step"] == 3
        assert out["params"]["emb"].dtype == ml_dtypes.bfloat16 and out["opt"][1] is None
        assert np.array_equal(out["params"]["emb"], (np.arange(128 * 16, dtype=np.float32).reshape(128, 16) % 97
                                                      ).astype(ml_dtypes.bfloat16))
        on_mesh = ckpt.restore(os.path.join(DATA_011, path), mesh=_meshes()["2x4"])
        w = on_mesh.get("state", on_mesh)["params"]["w"]
        assert w.sharding.spec == P("data", "model")
        for shard in w.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), want[shard.index])
    assert ckpt.restore(os.path.join(DATA_011, "manager/3"))["meta"] == {"step": 3}
    ckpt.convert(os.path.join(DATA_011, "manager/3/state"), tmp_path / "c")
    assert np.array_equal(ckpt.restore(tmp_path / "c")["params"]["w"], want)
    _check_commit_record(tmp_path / "c")
    assert main(["verify", str(tmp_path / "c")]) == 0


def test_a_step_with_metrics_restores_its_state_alone(tmp_path):
    import orbax.checkpoint as ocp

    """Orbax keeps a step's metrics (best_fn) as a JSON item named `metrics` in a file of that
    name: metadata of the step, so a whole-step restore gives the saved state only."""
    state = {"w": jnp.arange(8.0), "b": np.int8(3)}
    with ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
            best_fn=lambda m: m["loss"], best_mode="min", max_to_keep=2)) as m:
        m.save(1, args=ocp.args.StandardSave(state), metrics={"loss": 0.5})
        m.wait_until_finished()
    assert (tmp_path / "1" / "metrics" / "metrics").is_file()
    got = ckpt.restore(tmp_path / "1")
    assert sorted(got) == ["b", "w"]
    assert np.array_equal(got["w"], np.arange(8.0)) and got["b"] == 3
