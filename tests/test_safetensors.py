"""safetensors: export checked against the `safetensors` package's own loader, value by value;
restore of safetensors files (ours and the package's) reading only the byte ranges needed;
hostile headers and indexes."""

from __future__ import annotations

import json
import os
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
import ckpt.safetensors as cs
from ckpt._restore.safetensors_source import restore_with_stats
from multiproc import Worker, assert_all_succeeded, launch

HERE = os.path.abspath(__file__)
RNG = np.random.default_rng(7)
W = RNG.standard_normal((64, 32)).astype(np.float32)
EMB = RNG.standard_normal((128, 64)).astype(ml_dtypes.bfloat16)
F8 = np.linspace(-4, 4, 300).astype(ml_dtypes.float8_e4m3fn)
F8B = np.linspace(-4, 4, 96).astype(ml_dtypes.float8_e5m2).reshape(8, 12)
IDS = np.arange(6000, dtype=np.int32).reshape(60, 100)
MASK = (np.arange(50) % 3 == 0)


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def _tree():
    mesh = _mesh()
    return {
        "params": {
            "dense": {"kernel": jax.device_put(W, NamedSharding(mesh, P("data", "model"))),
                      "bias": jnp.arange(32, dtype=jnp.bfloat16)},  # inline in the manifest
            "emb": jax.device_put(EMB, NamedSharding(mesh, P(None, "model"))),
        },
        "quant": {"f8": F8, "f8b": F8B},
        "ids": jax.device_put(IDS, NamedSharding(mesh, P("data"))),
        "mask": MASK,
        "scale": np.float32(0.5),
        "step": 7,
        "tag": "run",
    }


EXPECTED = {  # tensor name -> (safetensors dtype code, value)
    "params.dense.kernel": ("F32", W), "params.dense.bias": ("BF16", np.arange(32).astype(ml_dtypes.bfloat16)),
    "params.emb": ("BF16", EMB), "quant.f8": ("F8_E4M3", F8), "quant.f8b": ("F8_E5M2", F8B),
    "ids": ("I32", IDS), "mask": ("BOOL", MASK), "scale": ("F32", np.array(0.5, np.float32)),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("st") / "ckpt"
    ckpt.save(path, _tree())
    return path


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) and a.dtype.kind not in "biuc" else a


def _check_against_package(files: list[str]) -> set[str]:
    """Every tensor of `files`, read by the safetensors package, equals EXPECTED bit for bit."""
    seen = set()
    for file in files:
        with open(file, "rb") as f:
            raw = safetensors.deserialize(f.read())  # the package's own parser: dtype codes and bytes
        for name, view in raw:
            code, want = EXPECTED[name]
            assert (view["dtype"], list(view["shape"])) == (code, list(np.shape(want))), name
            assert bytes(view["data"]) == np.ascontiguousarray(want).tobytes(), name
            seen.add(name)
        with safetensors.safe_open(file, framework="flax") as f:  # bf16 as jax arrays
            for name in f.keys():
                if EXPECTED[name][0] not in ("F8_E4M3", "F8_E5M2"):  # its flax loader has no float8
                    assert np.array_equal(_bits(f.get_tensor(name)), _bits(EXPECTED[name][1])), name
        numpy_ok = {n for n, _ in raw if EXPECTED[n][0] in ("F32", "I32", "BOOL")}
        with safetensors.safe_open(file, framework="np") as f:
            for name in numpy_ok:
                assert np.array_equal(f.get_tensor(name), EXPECTED[name][1]), name
    return seen


def test_export_one_file_matches_the_safetensors_loader(saved, tmp_path):
    result = cs.export(saved, tmp_path / "out")
    assert result.files == (str(tmp_path / "out" / "model.safetensors"),)
    assert _check_against_package(list(result.files)) == set(EXPECTED)
    assert set(result.skipped) == {"step", "tag"} and result.dropped == ()
    assert result.bytes == sum(np.asarray(v).nbytes for _, v in EXPECTED.values())
    with safetensors.safe_open(result.files[0], framework="np") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    shardings = json.loads(meta["jax_ckpt"])["shardings"]
    assert shardings["params.dense.kernel"]["spec"] == ["data", "model"]
    assert shardings["ids"]["mesh"] == {"axis_names": ["data", "model"], "axis_sizes": [2, 4]}
    assert "params.dense.bias" not in shardings  # single device: nothing to record


def test_export_sharded_writes_an_index_like_save_pretrained(saved, tmp_path):
    result = cs.export(saved, tmp_path / "out", shard_size=10_000)
    names = [os.path.basename(f) for f in result.files]
    n = len(names) - 1
    assert n >= 3 and names[-1] == "model.safetensors.index.json"
    assert names[:-1] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == result.bytes
    assert index["weight_map"] == result.tensors and set(index["weight_map"]) == set(EXPECTED)
    for file in result.files[:-1]:
        with safetensors.safe_open(file, framework="np") as f:
            held = set(f.keys())
        assert held == {t for t, name in index["weight_map"].items() if name == os.path.basename(file)}
        assert os.path.getsize(file) <= 10_000 + 4096 or len(held) == 1  # a larger tensor stands alone
    assert _check_against_package(list(result.files[:-1])) == set(EXPECTED)
    # Restored as a checkpoint, directory or index: the same values, and the recorded specs.
    back = ckpt.restore(tmp_path / "out", mesh=_mesh())
    assert back["params"]["emb"].sharding.spec == P(None, "model")
    assert back["params"]["dense"]["kernel"].sharding.spec == P("data", "model")
    assert back["mask"].sharding.spec == P()  # no sharding recorded: replicated
    for name, (_, want) in EXPECTED.items():
        node = back
        for part in name.split("."):
            node = node[part]
        assert np.array_equal(_bits(node), _bits(want)), name
    md = ckpt.metadata(tmp_path / "out" / "model.safetensors.index.json")
    assert md["params"]["emb"].partition_spec == P(None, "model") and md["params"]["emb"].dtype == ml_dtypes.bfloat16


def test_export_streams_within_the_host_budget(tmp_path):
    big = np.arange(2048 * 256, dtype=np.float32).reshape(2048, 256)  # 2 MiB in 8 chunks of 256 KiB
    mesh = jax.make_mesh((8,), ("data",))
    # "a" (inline, written first) lets the measurement start after the manifest is read.
    ckpt.save(tmp_path / "big", {"a": np.ones(4, np.float32), "w": jax.device_put(big, NamedSharding(mesh, P("data")))})
    for budget, bound in [(64 << 10, 3 * (256 << 10)), (1 << 20, 2 * (1 << 20))]:
        out = tmp_path / f"out{budget}"
        peaks = []

        def progress(done, total):
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.reset_peak()

        tracemalloc.start()
        try:
            cs.export(tmp_path / "big", out, options=ckpt.Options(host_budget_bytes=budget), progress=progress)
        finally:
            tracemalloc.stop()
        assert len(peaks) > 2 and max(peaks[1:]) < bound, (budget, peaks)  # never the 2 MiB array at once
        assert np.array_equal(safetensors.numpy.load_file(out / "model.safetensors")["w"], big)


def test_rename_mapping_function_and_errors(saved, tmp_path):
    mapping = {"params.dense.kernel": "model.fc.weight", "params.emb": None}
    result = cs.export(saved, tmp_path / "a", rename=mapping)
    assert "model.fc.weight" in result.tensors and "params.emb" not in result.tensors
    assert result.dropped == ("params.emb",)  # named as tensors are (and as rename sees them)
    result = cs.export(saved, tmp_path / "b", rename=lambda n: None if n.startswith("quant.") else "m." + n)
    assert set(result.tensors) == {"m." + n for n in EXPECTED if not n.startswith("quant.")}
    with pytest.raises(ckpt.CheckpointError, match="both become tensor 'x'"):
        cs.export(saved, tmp_path / "c", rename=lambda n: "x")
    with pytest.raises(FileExistsError):
        cs.export(saved, tmp_path / "a")
    cs.export(saved, tmp_path / "a", overwrite=True)
    assert sorted(os.listdir(tmp_path / "a")) == ["model.safetensors"]


def test_dtypes_without_a_safetensors_code_are_named(tmp_path):
    ckpt.save(tmp_path / "q", {"w": np.arange(8000).astype(ml_dtypes.int4), "b": np.ones(3, np.float32)})
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w': dtype int4 has no safetensors equivalent"):
        cs.export(tmp_path / "q", tmp_path / "out")
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")
    result = cs.export(tmp_path / "q", tmp_path / "out", rename={"w": None})
    assert list(result.tensors) == ["b"]


def test_restore_a_file_written_by_the_safetensors_package(tmp_path):
    tensors = {"model.layers.0.w": W, "model.layers.1.w": W * 2, "model.ids": IDS, "lm_head": IDS[:4].astype(np.float16)}
    file = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
    host = ckpt.restore(file)
    assert set(host) == {"model", "lm_head"} and set(host["model"]["layers"]) == {"0", "1"}
    assert np.array_equal(host["model"]["layers"]["1"]["w"], W * 2) and host["lm_head"].dtype == np.float16
    mesh = _mesh()
    target = {"model": {"layers": {"0": {"w": NamedSharding(mesh, P("data", "model"))},
                                   "1": {"w": jax.ShapeDtypeStruct(W.shape, jnp.bfloat16,
                                                                   sharding=NamedSharding(mesh, P("model")))}},
                        "ids": NamedSharding(mesh, P(None, "model"))},
              "lm_head": NamedSharding(mesh, P())}
    out = ckpt.restore(file, target)
    assert out["model"]["layers"]["0"]["w"].sharding == target["model"]["layers"]["0"]["w"]
    for shard in out["model"]["layers"]["0"]["w"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), W[shard.index])
    assert out["model"]["layers"]["1"]["w"].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out["model"]["layers"]["1"]["w"]), (W * 2).astype(ml_dtypes.bfloat16))
    assert np.array_equal(np.asarray(out["model"]["ids"]), IDS)
    with pytest.raises(ckpt.TreeMismatchError):
        ckpt.restore(file, {"model": {"ids": None}})
    # partial: only the asked tensor's bytes (and the header) are read
    header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    _, stats, read = restore_with_stats(file, {"model": {"ids": NamedSharding(mesh, P("data"))}}, partial=True)
    assert read == 8 + (header - 8) + IDS.nbytes and stats.bytes_read == IDS.nbytes


def test_restore_reads_only_the_rows_and_ranges_needed(tmp_path):
    from ckpt._restore.safetensors_source import open_tensors, read_box
    from ckpt._host import aligned_empty

    big = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    file = tmp_path / "big.safetensors"
    safetensors.numpy.save_file({"w": big}, file)
    tset = open_tensors(file)
    t = tset.tensors[0]
    try:
        for box in [((128, 256), (0, 1024)), ((0, 512), (512, 768)), ((7, 9), (100, 900)), ((3, 4), (5, 6))]:
            before = tset.reader.bytes_read
            out = aligned_empty(4 * (box[0][1] - box[0][0]) * (box[1][1] - box[1][0]))
            read_box(tset.reader, t, box, out)
            got = out.view(np.float32).reshape(box[0][1] - box[0][0], -1)
            assert np.array_equal(got, big[box[0][0]:box[0][1], box[1][0]:box[1][1]]), box
            read = tset.reader.bytes_read - before
            assert read <= got.nbytes + 64 * 1024, (box, read)  # ranges, not the 2 MiB tensor
    finally:
        tset.reader.close()


def run_restore_half_each(w: Worker) -> None:
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    target = {"w": NamedSharding(mesh, P("data", None)), "b": NamedSharding(mesh, P())}
    out, _, read = restore_with_stats(w.args["file"], target)
    ok = all(np.array_equal(np.asarray(s.data), np.load(w.args["npy"])[s.index]) for s in out["w"].addressable_shards)
    w.report(check="restore", read=read, ok=ok, b=np.asarray(out["b"].addressable_shards[0].data).tolist())


def test_each_process_reads_only_its_part(tmp_path):
    big = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)  # 1 MiB
    np.save(tmp_path / "w.npy", big)
    file = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"w": big, "b": np.arange(4, dtype=np.float32)}, file)
    header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    results = launch(f"{HERE}:run_restore_half_each", processes=2, devices_per_process=4,
                     args={"file": str(file), "npy": str(tmp_path / "w.npy")})
    assert_all_succeeded(results)
    for r in results:
        rec = r.one("restore")
        assert rec["ok"] and rec["b"] == [0, 1, 2, 3]
        assert rec["read"] == header + big.nbytes // 2 + 16, rec  # its half of w, all of b


def _file_with(header: bytes | dict, data: bytes = b"", length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize("content, words", [
    (b"\x01\x02", "shorter than its 8-byte header length"),
    (_file_with(GOOD, bytes(8), length=1 << 62), "header length"),
    (_file_with(GOOD, bytes(8), length=10**9), "header length"),
    (_file_with(b"{not json", bytes(8)), "not UTF-8 JSON"),
    (_file_with(b"\xff\xfe{}"), "not UTF-8 JSON"),
    (_file_with(b"[1, 2]"), "not a JSON object"),
    (_file_with(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', bytes(8)), "duplicate key 'a'"),
    (_file_with({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1)), "dtype 'F4'"),
    (_file_with({"a": {"dtype": "O", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "dtype 'O'"),
    (_file_with({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)), "not a list of sizes"),
    (_file_with({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, bytes(8)), "not a list of sizes"),
    (_file_with({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "needs 12 bytes"),
    (_file_with({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8)), "data_offsets"),
    (_file_with({"a": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 8]}}, bytes(8)), "needs"),
    (_file_with({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4)), "ends at byte 8"),
    (_file_with({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), "gaps or overlaps"),
    (_file_with({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), "gaps or overlaps"),
    (_file_with(GOOD, bytes(16)), "cover 8 bytes of data, the file holds 16"),
    (_file_with({"__metadata__": {"x": 1}, **GOOD}, bytes(8)), "__metadata__"),
    (_file_with({"__metadata__": {"jax_ckpt": "{bad"}, **GOOD}, bytes(8)), "jax_ckpt"),
    (_file_with({"__metadata__": {"jax_ckpt": json.dumps({"format_version": 1, "shardings": {"a": {
        "kind": "named", "mesh": {"axis_names": ["x"], "axis_sizes": [2]}, "spec": ["y"]}}})}, **GOOD}, bytes(8)),
     "names an axis"),
    (_file_with({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "a.b": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}}, bytes(8)), "do not form a tree"),
])
def test_hostile_headers_are_errors(tmp_path, content, words):
    file = tmp_path / "bad.safetensors"
    file.write_bytes(content)
    for call in (lambda: ckpt.restore(file), lambda: ckpt.metadata(file)):
        with pytest.raises(ckpt.CheckpointError) as e:
            call()
        assert words in str(e.value) and str(file) in str(e.value), str(e.value)


@pytest.mark.parametrize("weight_map, words", [
    ({"a": "../escape.safetensors"}, "is not a .safetensors file name"),
    ({"a": "/abs.safetensors"}, "is not a .safetensors file name"),
    ({"a": "x.bin"}, "is not a .safetensors file name"),
    ({"a": "one.safetensors", "zz": "one.safetensors"}, "it lacks ['zz']"),
    ({}, "it holds ['a']"),
])
def test_hostile_indexes_are_errors(tmp_path, weight_map, words):
    (tmp_path / "one.safetensors").write_bytes(_file_with(GOOD, bytes(8)))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map or {"b": "one.safetensors"}}))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(tmp_path)
    assert words in str(e.value), str(e.value)


def test_directory_of_files_without_index_and_a_tensor_in_two_files(tmp_path):
    safetensors.numpy.save_file({"a.x": W}, tmp_path / "one.safetensors")
    safetensors.numpy.save_file({"a.y": IDS}, tmp_path / "two.safetensors")
    out = ckpt.restore(tmp_path)
    assert np.array_equal(out["a"]["x"], W) and np.array_equal(out["a"]["y"], IDS)
    safetensors.numpy.save_file({"a.y": IDS}, tmp_path / "three.safetensors")
    with pytest.raises(ckpt.CheckpointError, match="tensor 'a.y' is in both"):
        ckpt.restore(tmp_path)
    with pytest.raises(FileNotFoundError):
        ckpt.restore(tmp_path / "missing.safetensors")


def test_restore_from_an_object_store_reads_ranges_through_its_engine(tmp_path):
    """memory:// (the tensorstore engine): the file is read with ranged reads, not fetched whole."""
    import uuid

    from ckpt.storage._location import open_storage

    file = tmp_path / "m.safetensors"
    big = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    safetensors.numpy.save_file({"w": big, "b": IDS[:2]}, file)
    url = f"memory://st/{uuid.uuid4().hex}"
    open_storage(url, ckpt.Options().resolved()).put("m.safetensors", file.read_bytes()).result()
    target = {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    out, _, read = restore_with_stats(f"{url}/m.safetensors", target, partial=True)
    header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
    # the header, w, and the file's last byte (this engine cannot tell a size without a read)
    assert np.array_equal(np.asarray(out["w"]), big) and read == header + big.nbytes + 1
    md = ckpt.metadata(f"{url}/m.safetensors")
    assert md["w"].shape == (256, 256) and md["b"].dtype == np.int32


# ---- symbolic links: followed only when they stay under the root (docs/storage.md) ---------------


def _hf_snapshot(tmp_path):
    """A Hugging Face cache repo: two shards and their index stored in blobs/ under content
    names, and a snapshot directory of links to them (as huggingface_hub lays them out)."""
    repo = tmp_path / "hub" / "models--org--model"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    shards = {"model-00001-of-00002.safetensors": {"a.w": W, "a.emb": EMB},
              "model-00002-of-00002.safetensors": {"b.ids": IDS, "b.f8": F8}}
    weight_map = {}
    for i, (name, tensors) in enumerate(shards.items()):
        safetensors.numpy.save_file(tensors, repo / "blobs" / f"blob{i}")
        (snap / name).symlink_to(f"../../blobs/blob{i}")
        weight_map.update({t: name for t in tensors})
    (repo / "blobs" / "index").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (snap / "model.safetensors.index.json").symlink_to("../../blobs/index")
    return repo, snap


def _dtype_shape_bytes(a) -> tuple:
    a = np.asarray(a)
    return a.dtype, a.shape, a.tobytes()


def test_a_hugging_face_cache_snapshot_restores_through_its_links_into_blobs(tmp_path):
    repo, snap = _hf_snapshot(tmp_path)
    want = {"a": {"w": W, "emb": EMB}, "b": {"ids": IDS, "f8": F8}}
    for location in (snap, snap / "model.safetensors.index.json"):
        out = ckpt.restore(location)
        assert jax.tree.map(_dtype_shape_bytes, out) == jax.tree.map(_dtype_shape_bytes, want), location
    one = ckpt.restore(snap / "model-00002-of-00002.safetensors")
    assert jax.tree.map(_dtype_shape_bytes, one) == jax.tree.map(_dtype_shape_bytes, {"b": want["b"]})
    mesh = _mesh()
    out = ckpt.restore(snap, {"a": {"w": NamedSharding(mesh, P("data", "model")), "emb": NamedSharding(mesh, P())},
                              "b": {"ids": NamedSharding(mesh, P("data")), "f8": NamedSharding(mesh, P())}})
    for shard in out["a"]["w"].addressable_shards:
        assert _dtype_shape_bytes(shard.data) == _dtype_shape_bytes(W[shard.index])
    assert _dtype_shape_bytes(out["b"]["ids"]) == _dtype_shape_bytes(IDS)
    md = ckpt.metadata(snap)
    assert md["a"]["emb"].shape == EMB.shape and md["a"]["emb"].dtype == EMB.dtype
    assert md["b"]["ids"].storage_path == "model-00002-of-00002.safetensors"


def test_a_link_that_leaves_the_root_is_refused_naming_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    safetensors.numpy.save_file({"w": W}, elsewhere / "real.safetensors")
    # A plain directory: its root is itself, so a link out of it is refused...
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(elsewhere / "real.safetensors")
    # ...and a Hugging Face snapshot whose link leaves its repo, through blobs/ or around it.
    repo, snap = _hf_snapshot(tmp_path)
    (snap / "model-00001-of-00002.safetensors").unlink()
    (snap / "model-00001-of-00002.safetensors").symlink_to("../../../../elsewhere/real.safetensors")
    cases = [(plain, plain / "model.safetensors"), (plain / "model.safetensors", plain / "model.safetensors"),
             (snap, snap / "model-00001-of-00002.safetensors")]
    for location, link in cases:
        for call in (ckpt.restore, ckpt.metadata):
            with pytest.raises(ckpt.CheckpointError) as e:
                call(location)
            text = str(e.value)
            assert f"{link} is a symbolic link to {elsewhere.resolve()}/real.safetensors, which is outside" in text, text
    # An index that is a link out of the root is refused the same way.
    (snap / "model-00001-of-00002.safetensors").unlink()
    (snap / "model-00001-of-00002.safetensors").symlink_to("../../blobs/blob0")
    (snap / "model.safetensors.index.json").unlink()
    (elsewhere / "index.json").write_text((repo / "blobs" / "index").read_text())
    (snap / "model.safetensors.index.json").symlink_to(elsewhere / "index.json")
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors.index.json is a symbolic link to .*, which is outside"):
        ckpt.restore(snap)
