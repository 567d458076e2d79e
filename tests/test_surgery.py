"""Model surgery at load time (``restore(rename=...)``, ``ckpt.surgery``, ``partial="matching"``).

Every building block (stack, unstack, transpose, concat, split, reshape) and a plain rename, in one
restore, from native checkpoints, Orbax checkpoints and safetensors, on local disk and S3, on 1
process and on 4 real processes (one launch checks all three sources): the values of every shard
are compared with numpy's, and the bytes each process reads are counted through a recording
wrapper (``ckpt.storage.WrapperStorage``; for Orbax, whose arrays TensorStore reads itself,
TensorStore's own count of the bytes its kvstores read): a process reads only the regions its
shards need, within 1.1x (Orbax: of the stored chunk files under its shards, found exactly by
restoring arrays of element numbers through the same surgery).
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import replace

import jax
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multiproc import Worker, assert_all_succeeded, launch

import ckpt
from ckpt import surgery as S
from ckpt.storage import open_storage
from support import ReadCounter

HERE = os.path.abspath(__file__)
L, H, OUT, HEAD = 4, 64, 128, 32  # layers, hidden, mlp width, per-head rows of q/k/v


def saved_arrays() -> dict[str, np.ndarray]:
    """A Llama-like set in PyTorch layout ((out, in) weights), by saved name."""
    rng = np.random.default_rng(7)
    out = {"model.embed.weight": rng.standard_normal((H, H)), "model.scan": rng.standard_normal((L, H, 2 * HEAD)),
           "model.fused": rng.standard_normal((2 * H, H))}
    for i in range(L):
        out[f"model.layers.{i}.mlp.weight"] = rng.standard_normal((OUT, H))
        for x in "qkv":
            out[f"model.layers.{i}.attn.{x}.weight"] = rng.standard_normal((HEAD, H))
    return {k: v.astype(np.float32) for k, v in out.items()}


def rename() -> dict:
    """target name -> what it is made of: every building block, and a plain rename."""
    layer = "model.layers.{}."
    out = {
        "embed": "model.embed.weight",
        "mlp": S.stack([S.transpose(layer.format(i) + "mlp.weight") for i in range(L)]),
        "scan_mlp": S.stack([layer.format(i) + "mlp.weight" for i in range(L)]),
        "qkv": S.stack([S.concat([S.transpose(layer.format(i) + f"attn.{x}.weight") for x in "qkv"], axis=1)
                        for i in range(L)]),
        "half": S.split("model.fused", 2, 1),
        # (hidden, heads * head_dim) as (hidden, heads, head_dim), as MaxText keeps q; and merged axes
        "heads": S.reshape(S.transpose("model.layers.0.attn.q.weight"), (H, 4, -1)),
        "merged": S.reshape("model.scan", (L, H * 2 * HEAD)),
    }
    out.update({f"unscanned.{i}": S.unstack("model.scan", i) for i in range(L)})
    return out


def references(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    layer = "model.layers.{}."
    out = {
        "embed": a["model.embed.weight"],
        "mlp": np.stack([a[layer.format(i) + "mlp.weight"].T for i in range(L)]),
        "scan_mlp": np.stack([a[layer.format(i) + "mlp.weight"] for i in range(L)]),
        "qkv": np.stack([np.concatenate([a[layer.format(i) + f"attn.{x}.weight"].T for x in "qkv"], 1)
                         for i in range(L)]),
        "half": a["model.fused"][H:],
        "heads": a["model.layers.0.attn.q.weight"].T.reshape(H, 4, HEAD // 4),
        "merged": a["model.scan"].reshape(L, H * 2 * HEAD),
    }
    out.update({f"unscanned.{i}": a["model.scan"][i] for i in range(L)})
    return out


def target(mesh: Mesh) -> dict:
    """Shardings whose regions are rows of the saved (out, in) tensors (contiguous bytes)."""
    def sd(shape, spec):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))

    return {"embed": sd((H, H), P("a", None)), "mlp": sd((L, H, OUT), P(None, None, "a")),
            "scan_mlp": sd((L, OUT, H), P("a", None, None)), "qkv": sd((L, H, 3 * HEAD), P(None, None, "a")),
            "half": sd((H, H), P("a", None)), "heads": sd((H, 4, HEAD // 4), P(None, "a", None)),
            "merged": sd((L, H * 2 * HEAD), P("a", None)), "unscanned": {str(i): sd((H, 2 * HEAD), P("a", None)) for i in range(L)}}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _nested(flat: dict) -> dict:
    out: dict = {}
    for name, v in flat.items():
        node, parts = out, name.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


def needed_bytes(tgt: dict) -> int:
    """Bytes of the unique regions this process's devices hold (what it must read, at least)."""
    total = 0
    for leaf in _flat(tgt).values():
        boxes = {tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(idx, leaf.shape))
                 for idx in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()}
        total += sum(int(np.prod([b - a for a, b in box])) * 4 for box in boxes)
    return total


def check_values(out: dict, refs: dict) -> list[str]:
    """The names of the leaves one of whose shards differs from numpy's reference."""
    bad = []
    for name, arr in _flat(out).items():
        if arr.shape != refs[name].shape or not all(
                np.array_equal(np.asarray(s.data), refs[name][s.index]) for s in arr.addressable_shards):
            bad.append(name)
    return bad


class Recording(ReadCounter):
    """Counts the data bytes read: chunks and byte ranges (not the manifest)."""

    def __init__(self, inner, counter=None):
        super().__init__(inner)
        self.counter = counter if counter is not None else COUNT

    def wrap(self, inner):
        return type(self)(inner, self.counter)

    def count(self, nbytes: int) -> None:
        with self.counter["lock"]:
            self.counter["bytes"] += nbytes


COUNT = {"bytes": 0, "lock": threading.Lock()}


def recording_options() -> ckpt.Options:
    def engine(text, options):
        return Recording(open_storage(text, replace(options, engine=None)))
    return ckpt.Options(engine=engine)


def _ts_bytes_read() -> int:
    import tensorstore as ts
    return sum(v["value"] for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
               if m["name"].endswith("/bytes_read") for v in m["values"])


class Getting(Recording):
    """Also counts whole objects got (an Orbax checkpoint's own metadata files)."""

    def get(self, key, *, max_bytes):
        out = super().get(key, max_bytes=max_bytes)
        self.count(len(out))
        return out


def restore_counted(path: str, kind: str, mesh: Mesh) -> tuple[dict, int]:
    """The restore of every block from `path`, and the data bytes it read (Orbax: what
    TensorStore read, less the Orbax metadata files the library read through its store where
    that store is TensorStore's too, as on S3)."""
    tgt = target(mesh)
    if kind == "orbax":
        COUNT["bytes"] = 0
        opts = ckpt.Options(engine=lambda text, o: Getting(open_storage(text, replace(o, engine=None))))
        before = _ts_bytes_read()
        out = ckpt.restore(path, tgt, rename=rename(), partial=True, options=opts)
        through_ts = open_storage(path, ckpt.Options().resolved()).caps.engine == "tensorstore"
        return out, _ts_bytes_read() - before - (COUNT["bytes"] if through_ts else 0)
    COUNT["bytes"] = 0
    out = ckpt.restore(path, tgt, rename=rename(), partial=True, options=recording_options())
    return out, COUNT["bytes"]


# ---- writing the three kinds of source ------------------------------------------------------

def _save_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


def write_native(path: str, arrays: dict) -> None:
    """Saved in chunks finer than any region restored (so that reading exactly them is possible)."""
    mesh = _save_mesh()

    def put(v):
        spec = P("a", "b", None) if v.ndim == 3 else P(("a", "b"), None)
        return jax.device_put(v, NamedSharding(mesh, spec))

    # (no stacks of small arrays, chunks of at most 4 KiB: finer than any region restored)
    ckpt.save(path, _nested({k: put(v) for k, v in arrays.items()}), max_chunk_bytes=4096,
              options=ckpt.Options(pack_limit_bytes=0))


def write_orbax(path: str, arrays: dict) -> None:
    import orbax.checkpoint as ocp

    mesh = _save_mesh()
    tree = {k: jax.device_put(v, NamedSharding(mesh, P("a", "b", None) if v.ndim == 3
                                               else P(("a", "b"), None))) for k, v in arrays.items()}
    chunks = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=4096), _nested(tree))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)) as c:
        c.save(path, args=ocp.args.PyTreeSave(_nested(tree), save_args=chunks))


def write_safetensors(path: str, arrays: dict) -> None:
    safetensors.numpy.save_file(arrays, path, metadata={"format": "pt"})


def _header_bytes(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _orbax_chunks(path: str, tgt: dict) -> tuple[int, int]:
    """(stored bytes of the Orbax chunk files under this process's shards of `tgt`, each file
    once; the same counted once for each target leaf that needs the file). Which saved elements
    a shard needs is found by restoring *indices*: the surgery applied to arrays of each saved
    element's number (``references``)."""
    import json

    arrays = saved_arrays()
    offsets = np.cumsum([0] + [a.size for a in arrays.values()])
    numbers = {n: (o + np.arange(a.size)).reshape(a.shape) for (n, a), o in zip(arrays.items(), offsets)}
    refs = references(numbers)
    counted, once = 0, set()
    for name, leaf in _flat(tgt).items():
        mask = np.zeros(offsets[-1], bool)
        for idx in leaf.sharding.addressable_devices_indices_map(leaf.shape).values():
            mask[refs[name][idx]] = True
        for (saved, a), o in zip(arrays.items(), offsets):
            touched = mask[o:o + a.size].reshape(a.shape)
            if not touched.any():
                continue
            with open(os.path.join(path, saved, "zarr.json")) as f:
                chunk = json.load(f)["chunk_grid"]["configuration"]["chunk_shape"]
            for i in np.ndindex(*(-(-n // c) for n, c in zip(a.shape, chunk))):
                if touched[tuple(slice(k * c, (k + 1) * c) for k, c in zip(i, chunk))].any():
                    file = os.path.join(path, saved, "c", *map(str, i))
                    counted += os.path.getsize(file)
                    once.add(file)
    return sum(os.path.getsize(f) for f in once), counted


def expected_read(kind: str, path: str, tgt: dict) -> tuple[int, int, int]:
    """(the least data bytes a restore of `tgt` may read, the bytes it needs, the bytes read
    besides data): native chunks and safetensors ranges are read once for each target leaf that
    needs them; Orbax's compressed chunk files too, or once where TensorStore serves two view
    leaves' reads of one file at once; each Orbax array's zarr.json and safetensors' header are
    read besides."""
    if kind == "safetensors":
        need = needed_bytes(tgt)
        return need, need, _header_bytes(path)
    if kind != "orbax":
        need = needed_bytes(tgt)
        return need, need, 0
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    metadata = sum(os.path.getsize(f) for f in files if f.endswith("/zarr.json"))
    return *_orbax_chunks(path, tgt), metadata


# ---- one process -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("surgery")
    arrays = saved_arrays()
    paths = {"native": str(root / "native"), "orbax": str(root / "orbax"), "safetensors": str(root / "m.safetensors")}
    write_native(paths["native"], arrays)
    write_orbax(paths["orbax"], arrays)
    write_safetensors(paths["safetensors"], arrays)
    return paths, references(arrays)


@pytest.mark.parametrize("kind", ["native", "safetensors", "orbax"])
def test_every_block_on_one_process_reads_only_what_it_needs(sources, kind):
    paths, refs = sources
    mesh = _save_mesh()
    out, read = restore_counted(paths[kind], kind, mesh)
    assert check_values(out, refs) == []
    assert out["qkv"].sharding == NamedSharding(mesh, P(None, None, "a"))
    least, need, extra = expected_read(kind, paths[kind], target(mesh))
    assert least <= read - extra <= 1.1 * need, (kind, read, least, need)


def test_plain_renames_function_and_rules(sources):
    paths, _ = sources
    arrays = saved_arrays()
    want = {str(i): arrays[f"model.layers.{i}.mlp.weight"] for i in range(L)}
    tgt = {"w": {k: np.zeros_like(v) for k, v in want.items()}}
    for rename_ in ([(r"^model\.layers\.(\d+)\.mlp\.weight$", r"w.\1")],
                    lambda n: n.replace("model.layers.", "w.").replace(".mlp.weight", "") if "mlp" in n else None):
        for kind in ("native", "safetensors", "orbax"):
            out = ckpt.restore(paths[kind], tgt, rename=rename_, partial=True)
            assert all(np.array_equal(out["w"][k], want[k]) for k in want), kind


def test_unmatched_and_doubly_matched_names_are_listed(sources):
    paths, _ = sources
    tgt = {"a": np.zeros((H, H), np.float32), "b": np.zeros((H, H), np.float32)}
    with pytest.raises(ckpt.TreeMismatchError) as e:
        ckpt.restore(paths["native"], tgt, rename={"a": "model.embed.weight", "b": S.transpose("model.nope")},
                     partial=True)
    assert "b (from 'model.nope')" in str(e.value) and e.value.unexpected == ["b (from 'model.nope')"]
    with pytest.raises(ckpt.TreeMismatchError, match=r"match several saved leaves: 'a \(from model.layers.0.mlp.weight, model.layers.1"):
        ckpt.restore(paths["native"], {"a": np.zeros((OUT, H), np.float32)},
                     rename=[(r"^model\.layers\.\d+\.mlp\.weight$", "a")], partial=True)
    with pytest.raises(ckpt.TreeMismatchError, match="missing from target"):  # the rest of the checkpoint
        ckpt.restore(paths["native"], {"a": np.zeros((H, H), np.float32)}, rename={"a": "model.embed.weight"})


def test_shape_and_dtype_errors_name_the_leaf(sources):
    paths, _ = sources
    with pytest.raises(ckpt.CheckpointError, match="leaf 'x': target shape .* saved shape"):
        ckpt.restore(paths["safetensors"], {"x": np.zeros((H, H), np.float32)},
                     rename={"x": S.transpose("model.fused")}, partial=True)
    with pytest.raises(ckpt.CheckpointError, match="leaf 'x': concat along axis 0"):
        ckpt.restore(paths["native"], {"x": np.zeros((H, H), np.float32)},
                     rename={"x": S.concat(["model.fused", "model.scan"])}, partial=True)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'x': reshape of shape \(128, 64\) into \(3, -1\)"):
        ckpt.restore(paths["native"], {"x": np.zeros((H, H), np.float32)},
                     rename={"x": S.reshape("model.fused", (3, -1))}, partial=True)
    with pytest.raises(TypeError, match="rename must be"):
        ckpt.restore(paths["native"], {"x": 0}, rename=3)


@pytest.mark.parametrize("kind", ["native", "safetensors", "orbax"])
def test_reshape_regions_cutting_across_axes(sources, kind):
    """Shards that cut across split and merged axes: each is read as several saved boxes."""
    paths, _ = sources
    scan = saved_arrays()["model.scan"]  # (L, H, 2 * HEAD)
    mesh = _save_mesh()
    cases = {  # target name: (new shape, its sharding)
        "rows": ((L * H, 2 * HEAD), P("a", "b")),  # merged (L, H): a shard's rows cross layers
        "cut": ((L, 2 * H, HEAD), P(None, ("a", "b"), None)),  # split last axis, shards across the old rows
        "flat": ((L * H * 2 * HEAD,), P(("a", "b"))),
        "odd": ((8, 2, 4, 4, 64), P(None, "b", None, "a", None)),  # old axes neither split nor merged whole
    }
    tgt = {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))
           for k, (shape, spec) in cases.items()}
    out = ckpt.restore(paths[kind], tgt, rename={k: S.reshape("model.scan", shape) for k, (shape, _) in cases.items()},
                       partial=True)
    assert check_values(out, {k: scan.reshape(shape) for k, (shape, _) in cases.items()}) == []


def test_restore_what_matches_keeps_the_targets_own_leaves(sources, tmp_path):
    paths, _ = sources
    arrays = saved_arrays()
    mesh = _save_mesh()
    grown = {"model": {"layers": {str(i): {"mlp": {"weight": jax.device_put(
        np.full((OUT, H), -1.0, np.float32), NamedSharding(mesh, P("a")))}} for i in range(L + 2)}}}
    with pytest.raises(ckpt.TreeMismatchError, match="(?s)not in checkpoint .2.*partial='matching'"):
        ckpt.restore(paths["native"], grown, partial=True)
    for kind in ("native", "safetensors", "orbax"):
        out, missing = ckpt.restore(paths[kind], grown, partial="matching")
        assert missing == [f"model/layers/{i}/mlp/weight" for i in (L, L + 1)], kind
        assert np.array_equal(out["model"]["layers"]["1"]["mlp"]["weight"], arrays["model.layers.1.mlp.weight"])
        assert out["model"]["layers"][str(L)]["mlp"]["weight"] is grown["model"]["layers"][str(L)]["mlp"]["weight"]
    # with rename=: a scanned leaf of 6 layers cannot be filled from 4: it is reported, the rest restored
    tgt = {"embed": np.zeros((H, H), np.float32), "new_head": jax.ShapeDtypeStruct((H, 8), np.float32)}
    out, missing = ckpt.restore(paths["native"], tgt, rename={"embed": "model.embed.weight"}, partial="matching")
    assert missing == ["new_head"] and out["new_head"] is tgt["new_head"]
    assert np.array_equal(out["embed"], arrays["model.embed.weight"])


def test_manager_restores_a_step_through_rename(tmp_path):
    """A trainer's step restored into a grown, renamed model: CheckpointManager.restore(rename=)."""
    arrays = saved_arrays()
    layers = {str(i): {"w": arrays[f"model.layers.{i}.mlp.weight"]} for i in range(L)}
    with ckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(10, {"params": {"layers": layers}, "opt": {"count": np.int32(3)}})
        mgr.wait()
        tgt = {"scan": np.zeros((L, H, OUT), np.float32), "head": np.zeros((H, 8), np.float32)}
        parts = {"scan": S.stack([S.transpose(f"params.layers.{i}.w") for i in range(L)])}
        out, missing = mgr.restore(10, target=tgt, rename=parts, partial="matching")
        assert missing == ["head"] and out["head"] is tgt["head"]
        assert np.array_equal(out["scan"], np.stack([arrays[f"model.layers.{i}.mlp.weight"].T for i in range(L)]))
        with pytest.raises(ValueError, match="rename= applies to a whole step"):
            mgr.restore(10, target=tgt, rename=parts, item="params")


# ---- S3 ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_sources(sources, tmp_path_factory):
    from servers import SeaweedFS, serving_s3

    server = SeaweedFS(str(tmp_path_factory.mktemp("seaweedfs")))
    with serving_s3(server, "surgery", tmp_path_factory.mktemp("aws")):
        root = f"s3://surgery/{uuid.uuid4().hex[:8]}"
        arrays = saved_arrays()
        write_native(f"{root}/native", arrays)
        store = open_storage(root, ckpt.Options().resolved())
        with open(sources[0]["safetensors"], "rb") as f:
            store.put("m.safetensors", f.read()).result()
        local = sources[0]["orbax"]
        for d, _, files in os.walk(local):  # the Orbax checkpoint, object by object
            for name in files:
                with open(os.path.join(d, name), "rb") as f:
                    store.put(os.path.relpath(os.path.join("orbax", os.path.relpath(d, local), name)), f.read()).result()
        yield ({"native": f"{root}/native", "safetensors": f"{root}/m.safetensors", "orbax": f"{root}/orbax"},
               sources[1], sources[0])


@pytest.mark.parametrize("kind", ["native", "safetensors", "orbax"])
def test_every_block_from_s3_reads_only_what_it_needs(s3_sources, kind):
    paths, refs, local = s3_sources
    mesh = _save_mesh()
    out, read = restore_counted(paths[kind], kind, mesh)
    assert check_values(out, refs) == []
    least, need, extra = expected_read(kind, local[kind], target(mesh))
    assert least <= read - extra <= 1.1 * need, (kind, read, least, need)


# ---- four processes: one launch, all three sources ---------------------------------------------

def run_every_source(w: Worker) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    refs = references(saved_arrays())
    local = w.args.get("local") or w.args["paths"]  # (what each source holds, read from disk)
    for kind, path in w.args["paths"].items():
        out, read = restore_counted(path, kind, mesh)
        least, need, extra = expected_read(kind, local[kind], target(mesh))
        w.report(check=kind, bad=check_values(out, refs), read=read - extra, least=least, need=need)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_every_block_on_four_processes_each_reads_its_part(sources, request, where):
    if where == "s3":
        paths, _, local = request.getfixturevalue("s3_sources")
        args = {"paths": paths, "local": local}
    else:
        paths, args = sources[0], {"paths": sources[0]}
    results = launch(f"{HERE}:run_every_source", processes=4, devices_per_process=2, args=args, timeout_s=240)
    assert_all_succeeded(results)
    whole = needed_bytes(target(_save_mesh()))
    for r in results:
        for kind in paths:
            rec = r.one(kind)
            assert rec["bad"] == [], (kind, r.index, rec)
            assert rec["need"] < whole / 2, rec  # its part, not the whole
            assert rec["least"] <= rec["read"] <= 1.1 * rec["need"], (kind, r.index, rec)
