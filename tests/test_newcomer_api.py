"""The Python API at the edges a newcomer meets first (issue 26, "Python API"): a manager
directory given where one checkpoint is expected, target shardings that cannot split a
dimension, a mesh whose axes are named otherwise (``axis_names=``), nested metrics, a subtree
target, a target passed to ``CheckpointManager.restore`` by position, user metadata key order
and tuple keys, and the names ``ckpt.safetensors.export`` reports.

Every value restored is compared on every addressable shard against the numpy original.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt._format.records import seal
from ckpt.safetensors import export

W = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
B = np.arange(8, dtype=np.float32) - 3.5
M = np.linspace(0, 1, 64 * 8, dtype=np.float32).reshape(64, 8)


def _mesh(shape, names, n=None):
    devices = np.array(jax.devices()[: n or int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def _state(mesh):
    """A (model, optimizer) state on `mesh` (axes 'data' x 'model')."""
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    return {"model": {"w": put(W, P("data", "model")), "b": put(B, P("model"))},
            "opt": {"mu": put(M, P("data", None)), "count": 3}}


def _expect_on_every_shard(array, want, sharding=None):
    assert isinstance(array, jax.Array) and array.shape == want.shape and array.dtype == want.dtype
    if sharding is not None:
        assert array.sharding == sharding, (array.sharding, sharding)
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the state on mesh (data=4, model=2), as ckpt.save writes it."""
    root = tmp_path_factory.mktemp("newcomer")
    mesh = _mesh((4, 2), ("data", "model"))
    path = str(root / "ckpt")
    ckpt.save(path, _state(mesh))
    return path


# ---- 1. a manager directory where one checkpoint is expected -------------------------------


def test_manager_directory_lists_its_steps_for_restore_metadata_and_export(location, tmp_path):
    run = location("run")
    with ckpt.CheckpointManager(run) as manager:
        for step in range(1, 10):
            manager.save(step, {"x": np.full(3, step, np.float32)}, force=True)
    for call in (lambda: ckpt.restore(run), lambda: ckpt.metadata(run),
                 lambda: export(run, tmp_path / "out")):
        with pytest.raises(ckpt.CheckpointError) as info:
            call()
        text = str(info.value)
        assert "is a CheckpointManager directory" in text and "9 steps: 1, 2, 3, ..., 7, 8, 9 (latest 9)" in text
        assert location("run", "step_00000009") in text  # the step to restore, spelled out
        assert "a save may not have committed" not in text
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_manager_directory_of_bare_steps_and_orbax_steps(tmp_path):
    """Few steps: all listed, no ellipsis; bare numbers and Orbax's steps count as well."""
    bare = tmp_path / "bare"
    with ckpt.CheckpointManager(bare, step_prefix=None, step_format_fixed_length=None) as manager:
        manager.save(5, {"x": np.zeros(2)}, force=True)
        manager.save(19, {"x": np.zeros(2)}, force=True)
    (bare / "7").mkdir()
    (bare / "7" / "_CHECKPOINT_METADATA").write_text("{}")  # a finished Orbax step
    (bare / "23.orbax-checkpoint-tmp-1").mkdir()  # a save in progress: not a step
    with pytest.raises(ckpt.CheckpointError, match=r"3 steps \(1 of them Orbax's\): 5, 7, 19 \(latest 19\)"):
        ckpt.restore(bare)


def test_a_directory_without_steps_keeps_the_plain_message(tmp_path):
    (tmp_path / "d" / "notes").mkdir(parents=True)
    (tmp_path / "d" / "step_00000001").mkdir()  # named as a step, holds nothing committed
    with pytest.raises(ckpt.CheckpointError, match="is not a committed checkpoint: it has no manifest.msgpack"):
        ckpt.restore(tmp_path / "d")


# ---- 2. a target sharding that cannot split a dimension ------------------------------------


def _no_reads(monkeypatch):
    """Make any chunk read fail: a restore refused by a check must be refused before reading."""
    import ckpt._restore

    def reader(*args, **kwargs):
        raise AssertionError("the restore started reading")

    monkeypatch.setattr(ckpt._restore, "Reader", reader)


def test_target_sharding_that_cannot_split_a_dimension_names_the_leaf_before_reading(saved, monkeypatch):
    path = saved
    _no_reads(monkeypatch)
    three = _mesh((3,), ("data",))
    targets = {
        "sharding": NamedSharding(three, P("data")),
        "struct": jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=NamedSharding(three, P("data"))),
    }
    for kind, leaf in targets.items():
        with pytest.raises(ckpt.CheckpointError) as info:
            ckpt.restore(path, {"model": {"w": leaf}}, partial=True)
        assert "leaf 'model/w': dimension 0 of size 64 cannot be split over mesh axis data of size 3" in str(info.value), kind
        assert "P('data',)" in str(info.value)
    # More PartitionSpec entries than dimensions: named too, not JAX's error.
    mesh = _mesh((2, 2, 2), ("a", "b", "c"))
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'model/b': the target's PartitionSpec .* has 2 entries, "
                                                   r"but the array has 1 dimensions"):
        ckpt.restore(path, {"model": {"b": NamedSharding(mesh, P("a", "b"))}}, partial=True)
    # The same target on a divisible mesh restores, every shard compared.
    monkeypatch.undo()
    four = _mesh((4,), ("data",))
    got = ckpt.restore(saved, {"model": {"w": NamedSharding(four, P("data"))}}, partial=True)
    _expect_on_every_shard(got["model"]["w"], W, NamedSharding(four, P("data")))


# ---- 3. a mesh whose axes are named otherwise ----------------------------------------------


def test_mesh_with_other_axis_names_lists_the_leaves_and_suggests_axis_names(saved):
    mesh = _mesh((2, 4), ("batch", "mp"))
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.restore(saved, mesh=mesh)
    text = str(info.value)
    assert "3 leafs" not in text and "3 leaves" in text  # every leaf concerned, counted
    for leaf in ("'model/w' ('data', 'model')", "'model/b' ('model')", "'opt/mu' ('data')"):
        assert leaf in text, (leaf, text)
    assert "saved on mesh ('data': 4, 'model': 2)" in text and "('batch': 2, 'mp': 4)" in text
    # As many unused mesh axes as missing saved ones: paired in order, offered as a guess.
    assert "restore with axis_names={'data': 'batch', 'model': 'mp'}" in text
    # Otherwise the generic form of the option.
    with pytest.raises(ckpt.CheckpointError, match=r"axis_names=\{'<saved name>': '<mesh axis>'\}"):
        ckpt.restore(saved, mesh=_mesh((2, 2, 2), ("x", "y", "z")))
    # A partial mapping: the guess completes it.
    with pytest.raises(ckpt.CheckpointError, match=r"2 leaves use .*axis_names=\{'data': 'batch', 'model': 'mp'\}"):
        ckpt.restore(saved, mesh=mesh, axis_names={"data": "batch"})


def test_many_leaves_are_counted_with_the_first_few_named(tmp_path):
    mesh = _mesh((4,), ("data",))
    tree = {f"layer{i}": jax.device_put(np.full((8,), i, np.float32), NamedSharding(mesh, P("data")))
            for i in range(8)}
    ckpt.save(tmp_path / "c", tree)
    with pytest.raises(ckpt.CheckpointError, match=r"8 leaves use .* and 3 more\. .*axis_names=\{'data': 'x'\}"):
        ckpt.restore(tmp_path / "c", mesh=_mesh((4,), ("x",)))


def test_axis_names_renames_the_saved_axes_every_shard_compared(saved):
    mesh = _mesh((2, 4), ("batch", "mp"))
    got = ckpt.restore(saved, mesh=mesh, axis_names={"data": "batch", "model": "mp"})
    _expect_on_every_shard(got["model"]["w"], W, NamedSharding(mesh, P("batch", "mp")))
    _expect_on_every_shard(got["model"]["b"], B, NamedSharding(mesh, P("mp")))
    _expect_on_every_shard(got["opt"]["mu"], M, NamedSharding(mesh, P("batch", None)))
    assert got["opt"]["count"] == 3
    # A saved axis not named keeps its name: the mesh must then have it.
    half = _mesh((2, 2), ("batch", "model"), n=4)
    got = ckpt.restore(saved, mesh=half, axis_names={"data": "batch"})
    _expect_on_every_shard(got["model"]["w"], W, NamedSharding(half, P("batch", "model")))
    # Wrong mappings are named.
    with pytest.raises(ValueError, match="maps 'data' to 'nope', which is not an axis of the mesh"):
        ckpt.restore(saved, mesh=mesh, axis_names={"data": "nope"})
    with pytest.raises(ValueError, match="each mesh axis takes one saved axis"):
        ckpt.restore(saved, mesh=mesh, axis_names={"data": "batch", "model": "batch"})
    with pytest.raises(ValueError, match="pass it with mesh="):
        ckpt.restore(saved, axis_names={"data": "batch"})
    with pytest.raises(TypeError, match="axis_names must be a dict"):
        ckpt.restore(saved, mesh=mesh, axis_names=[("data", "batch")])
    # A mapping whose sizes do not divide is the usual named error.
    odd = _mesh((3, 2), ("batch", "model"))
    with pytest.raises(ckpt.CheckpointError, match="leaf 'model/w': dimension 0 of size 64 cannot be split"):
        ckpt.restore(saved, mesh=odd, axis_names={"data": "batch"})


def test_manager_restore_forwards_axis_names_to_whole_steps_and_items(tmp_path):
    saved_mesh = _mesh((4, 2), ("data", "model"))
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, _state(saved_mesh))
    mesh = _mesh((2, 4), ("batch", "mp"))
    names = {"data": "batch", "model": "mp"}
    with ckpt.CheckpointManager(tmp_path / "run", read_only=True) as manager:
        whole = manager.restore(mesh=mesh, axis_names=names)
        item = manager.restore(1, mesh=mesh, axis_names=names, item="model")
        with pytest.raises(ckpt.CheckpointError, match="2 leaves use saved mesh axes"):
            manager.restore(1, mesh=mesh, item="model")  # the item's leaves only
    _expect_on_every_shard(whole["model"]["w"], W, NamedSharding(mesh, P("batch", "mp")))
    _expect_on_every_shard(whole["opt"]["mu"], M, NamedSharding(mesh, P("batch", None)))
    _expect_on_every_shard(item["w"], W, NamedSharding(mesh, P("batch", "mp")))
    _expect_on_every_shard(item["b"], B, NamedSharding(mesh, P("mp")))


# ---- 4. nested metrics ------------------------------------------------------------------------


def test_nested_metrics_are_stored_and_rank_steps_with_best_fn(tmp_path):
    accs = {1: 0.1, 2: 0.9, 3: 0.3, 4: 0.8, 5: 0.2}
    with ckpt.CheckpointManager(tmp_path / "run", max_to_keep=2, best_fn=lambda m: m["eval"]["acc"],
                                best_mode="max", async_save=False) as manager:
        for step, acc in accs.items():
            metrics = {"eval": {"acc": np.float32(acc), "per_class": [acc, 1 - acc], "note": None},
                       "train": {"loss": jnp.asarray(1.0 / step), "diverged": False}, "tags": ("a", "b")}
            assert manager.save(step, {"x": np.full(2, step, np.float32)}, metrics=metrics)
        manager.wait()
        # The best two (2 and 4) and the newest (5, never deleted) are kept.
        assert manager.all_steps() == [2, 4, 5] and manager.best_step() == 2
    with ckpt.CheckpointManager(tmp_path / "run", read_only=True, best_fn=lambda m: m["eval"]["acc"],
                                best_mode="max") as reopened:
        assert reopened.best_step() == 2
        got = reopened.metrics(2)
        assert got == {"eval": {"acc": pytest.approx(0.9), "per_class": [pytest.approx(0.9), pytest.approx(0.1)],
                                "note": None},
                       "train": {"loss": 0.5, "diverged": False}, "tags": ["a", "b"]}
        assert list(got) == ["eval", "train", "tags"] and list(got["eval"]) == ["acc", "per_class", "note"]
        assert reopened.metadata(2) == {}  # metrics are not user metadata
        np.testing.assert_array_equal(reopened.restore(2)["x"], np.full(2, 2, np.float32))


def test_flat_metrics_still_rank_and_bad_metrics_are_named(tmp_path):
    with ckpt.CheckpointManager(tmp_path / "run", max_to_keep=1, best_fn=lambda m: m["loss"],
                                async_save=False) as manager:
        manager.save(1, {"x": np.zeros(2)}, metrics={"loss": 0.5})
        manager.save(2, {"x": np.zeros(2)}, metrics={"loss": 0.7})
        manager.save(3, {"x": np.zeros(2)}, metrics={"loss": 0.1})
        manager.wait()
        assert manager.all_steps() == [3] and manager.metrics(3) == {"loss": 0.1}
        with pytest.raises(ckpt.CheckpointError, match=r"value of 'eval/hist/1' \(ndarray\) is not a number"):
            manager.save(4, {"x": np.zeros(2)}, metrics={"eval": {"hist": [1, np.zeros(3)]}, "loss": 0.0})
        with pytest.raises(ckpt.CheckpointError, match=r"key 1 in 'eval' is not a string"):
            manager.save(4, {"x": np.zeros(2)}, metrics={"eval": {1: 0.5}, "loss": 0.0})
        deep: dict = {"loss": 0.0}
        at = deep
        for _ in range(40):
            at["d"] = {}
            at = at["d"]
        with pytest.raises(ckpt.CheckpointError, match="nested deeper than 32 levels"):
            manager.save(4, {"x": np.zeros(2)}, metrics=deep)
        with pytest.raises(ValueError, match="best_fn failed on the metrics of step 4"):
            manager.save(4, {"x": np.zeros(2)}, metrics={"eval": {"acc": 1.0}})
        assert manager.all_steps() == [3]


def test_hostile_user_metadata_in_a_manifest_is_refused(tmp_path):
    """Whatever a manifest's user metadata holds, reading it ends in a CheckpointError naming
    the manifest: nesting past msgpack's stack, and array map keys nested in arrays."""
    ckpt.save(tmp_path / "c", {"x": np.arange(4, dtype=np.float32)})
    manifest = tmp_path / "c" / "manifest.msgpack"
    doc = msgpack.unpackb(manifest.read_bytes(), raw=False, strict_map_key=False)
    doc.pop("manifest_crc32c", None)
    packed_deep = b"\x91" * 5000 + b"\x01"  # 5000 nested one-element arrays, past any stack
    for user in (packed_deep,):
        head = msgpack.packb({**doc, "user_metadata": "PLACEHOLDER"}, use_bin_type=True)
        body = head.replace(msgpack.packb("PLACEHOLDER"), user)
        manifest.write_bytes(body)
        with pytest.raises(ckpt.CheckpointError, match="manifest.msgpack: manifest is corrupted"):
            ckpt.restore(tmp_path / "c")
    # A sealed manifest whose user metadata holds tuple keys (what a save of such metadata
    # writes) reads back, keys as tuples.
    manifest.write_bytes(seal({**doc, "user_metadata": {"k": {(1, "a"): 2}}}))
    np.testing.assert_array_equal(ckpt.restore(tmp_path / "c")["x"], np.arange(4, dtype=np.float32))
    # Array keys decode anywhere now; outside the user metadata the validation refuses them.
    manifest.write_bytes(seal({**doc, "zarr_json_crc32c": {(1, 2): 5}}))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest is corrupted: zarr_json_crc32c entry \(1, 2\)"):
        ckpt.restore(tmp_path / "c")
    leaf = {**doc["leaves"][0], "sharding": {(1,): "x"}}
    manifest.write_bytes(seal({**doc, "leaves": [leaf]}))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest is corrupted: leaf 0 \('x'\): sharding"):
        ckpt.restore(tmp_path / "c")


# ---- 5. a subtree target; a target passed by position -------------------------------------------


def test_subtree_target_gets_a_hint_naming_the_subtree(saved):
    mesh = _mesh((4, 2), ("data", "model"))
    model = {"w": jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=NamedSharding(mesh, P("data", "model"))),
             "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("model")))}
    with pytest.raises(ckpt.TreeMismatchError) as info:
        ckpt.restore(saved, model)
    text = str(info.value)
    assert "the target matches the checkpoint's subtree 'model'" in text
    assert "ckpt.restore(path, {'model': target}, partial=True)['model']" in text and "item='model'" in text
    assert set(info.value.unexpected) == {"w", "b"}  # the error's fields are unchanged
    # The recipe the hint gives works, every shard compared.
    got = ckpt.restore(saved, {"model": model}, partial=True)["model"]
    _expect_on_every_shard(got["w"], W, NamedSharding(mesh, P("data", "model")))
    _expect_on_every_shard(got["b"], B, NamedSharding(mesh, P("model")))
    # A target that matches nothing gets no hint.
    with pytest.raises(ckpt.TreeMismatchError) as info:
        ckpt.restore(saved, {"nope": np.zeros(3)})
    assert "subtree" not in str(info.value)


def test_subtree_hint_for_other_formats_too(saved, tmp_path):
    """The hint comes from the tree matching every format shares: safetensors here."""
    export(saved, tmp_path / "hf")
    with pytest.raises(ckpt.TreeMismatchError, match="the target matches the checkpoint's subtree 'model'"):
        ckpt.restore(tmp_path / "hf", {"w": np.zeros((64, 8), np.float32), "b": np.zeros(8, np.float32)})
    got = ckpt.restore(tmp_path / "hf", {"model": {"w": np.zeros((64, 8), np.float32)}}, partial=True)
    np.testing.assert_array_equal(got["model"]["w"], W)


def test_manager_restore_with_a_positional_target_says_target_equals(tmp_path):
    mesh = _mesh((4, 2), ("data", "model"))
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, _state(mesh))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                            if isinstance(a, jax.Array) else a, _state(mesh))
    with ckpt.CheckpointManager(tmp_path / "run", read_only=True) as manager:
        with pytest.raises(TypeError, match=r"pass it by keyword: manager.restore\(target=abstract_state\)"):
            manager.restore(abstract)
        got = manager.restore(target=abstract)
        assert manager.restore(np.int64(1), target=abstract)["opt"]["count"] == 3  # numpy steps still work
    _expect_on_every_shard(got["model"]["w"], W, NamedSharding(mesh, P("data", "model")))
    _expect_on_every_shard(got["opt"]["mu"], M, NamedSharding(mesh, P("data", None)))


# ---- 6. user metadata: key order, tuple keys --------------------------------------------------


def test_user_metadata_keeps_key_order_and_tuple_keys(tmp_path):
    metadata = {"zeta": 1, "alpha": {"y": 2, "b": 3, "m": {"3": 0, "1": 1}},
                "table": {(0, "a"): 1.5, (2, ("x", 3)): "nested", 7: "int key"}, "seq": (1, (2, 3))}
    with ckpt.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"x": np.zeros(2)}, metadata=metadata)
    with ckpt.CheckpointManager(tmp_path / "run", read_only=True) as manager:
        got = manager.metadata(1)
    assert list(got) == ["zeta", "alpha", "table", "seq"]
    assert list(got["alpha"]) == ["y", "b", "m"] and list(got["alpha"]["m"]) == ["3", "1"]
    assert list(got["table"]) == [(0, "a"), (2, ("x", 3)), 7]
    assert got["table"] == {(0, "a"): 1.5, (2, ("x", 3)): "nested", 7: "int key"}
    assert got["seq"] == [1, [2, 3]]  # tuples that are not keys come back as lists (documented)


# ---- 7. export names ---------------------------------------------------------------------------


def test_export_reports_every_name_in_tensor_style_and_skips_prng_keys(tmp_path):
    tree = {"params": {"dense": {"kernel": np.ones((2, 3), np.float32)}, "emb": np.zeros((4, 2), np.float32)},
            "state": {"rng": jax.random.key(0), "step": 7}}
    ckpt.save(tmp_path / "c", tree)
    result = export(tmp_path / "c", tmp_path / "out", rename={"params.emb": None})
    assert set(result.tensors) == {"params.dense.kernel"}
    assert result.dropped == ("params.emb",)
    assert set(result.skipped) == {"state.rng", "state.step"}  # PRNG keys are skipped, named as tensors are
