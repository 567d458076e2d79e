"""The written format: golden checkpoints of every format version stay readable, a reader written
from formats/SPEC.md alone (formats/reference_reader.py) agrees with ckpt.restore, and manifests
match formats/manifest.schema.json."""

import ast
import copy
import dataclasses
import importlib.util
import json
import os
import shutil
from typing import NamedTuple

import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt

FORMATS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "formats")
GOLDEN_V1 = os.path.join(FORMATS, "golden", "v1", "checkpoint")
GOLDEN_V2 = os.path.join(FORMATS, "golden", "v2", "checkpoint")
GOLDEN_V3 = os.path.join(FORMATS, "golden", "v3", "checkpoint")
GOLDEN = {"golden_v1": GOLDEN_V1, "golden_v2": GOLDEN_V2, "golden_v3": GOLDEN_V3}


def _load(name):
    spec = importlib.util.spec_from_file_location(f"formats_{name}", os.path.join(FORMATS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load("reference_reader")


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


# What formats/make_golden.py wrote for format version 1, restated here independently.
def _golden_v1_expected():
    return {
        "params/dense/kernel": np.arange(16 * 96, dtype=np.float32).reshape(16, 96) * 0.5 - 100.0,
        "params/dense/bias": np.arange(96, dtype=np.float32) / 8,
        "params/embed": np.array([(i % 64) * 0.25 for i in range(64 * 48)], dtype=ml_dtypes.bfloat16).reshape(64, 48),
        "quant/w_int4": np.array([i % 16 - 8 for i in range(64 * 80)], dtype=ml_dtypes.int4).reshape(64, 80),
        "quant/scale_int8": np.array([-4, -3, -2, -1, 0, 1, 2, 3], dtype=np.int8),
        "quant/fp8": np.linspace(-2, 2, 16, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).reshape(4, 4),
        "data/valid": np.array([i % 3 == 0 for i in range(4100)]),
        "mask": np.array([[(i + j) % 2 == 0 for j in range(8)] for i in range(8)]),
        "opt/0": np.array(5, dtype=np.int32),
        "opt/1/0": np.float32(0.25),
        "rng": np.asarray(jax.random.key_data(jax.random.key(42))),
        "step": 7, "name": "golden-v1", "lr": 0.125, "flag": True, "big": 1180591620717411303424,
        "z": complex(1, 2), "blob": b"\x00\x01ckpt",
    }


def _get(tree, path):
    for part in path.split("/"):
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return tree


def _key_data(x):
    """A typed PRNG key array (restore gives keys as keys) as its key data, anything else as is."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return x


def _assert_same_value(got, want, where):
    got, want = _key_data(got), _key_data(want)
    if isinstance(want, (np.ndarray, np.generic)):
        assert type(got) is type(want), (where, type(got))
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, got.shape)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), where
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def test_golden_v1_restores_to_the_stated_values():
    out = ckpt.restore(GOLDEN_V1)
    for path, want in _golden_v1_expected().items():
        _assert_same_value(_get(out, path), want, path)
    assert out["opt"][1][1] is None and isinstance(out["opt"], tuple) and isinstance(out["opt"][1], list)
    with open(os.path.join(GOLDEN_V1, "manifest.msgpack"), "rb") as f:
        assert msgpack.unpackb(f.read(), raw=False)["format_version"] == 1


def test_golden_v1_restores_onto_a_mesh_with_its_saved_shardings():
    mesh = _mesh()
    out = ckpt.restore(GOLDEN_V1, mesh=mesh)
    want = _golden_v1_expected()
    for path, spec in [("params/dense/kernel", P("data", "model")), ("params/embed", P(None, "model")),
                       ("quant/w_int4", P("data"))]:
        arr = _get(out, path)
        assert isinstance(arr, jax.Array) and arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim)
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), want[path][shard.index]), (path, shard.index)
    key = out["rng"]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert np.array_equal(np.asarray(jax.random.key_data(key)), want["rng"])


# What formats/make_golden.py wrote for format version 2: version 1's values (name aside), with
# single-chunk arrays where version 1 had one chunk per shard, plus two stacks (SPEC 7.1).
def _golden_v2_expected():
    want = {**_golden_v1_expected(), "name": "golden-v2"}
    for i in range(3):
        want[f"layers/{i}/kernel"] = np.arange(32 * 40, dtype=np.float32).reshape(32, 40) * 0.25 + i
        want[f"layers/{i}/scale"] = np.array([(k % 128) * 0.5 - i for k in range(2560)], dtype=ml_dtypes.bfloat16)
    return want


def test_golden_v2_restores_to_the_stated_values_and_onto_a_mesh():
    out = ckpt.restore(GOLDEN_V2)
    want = _golden_v2_expected()
    for path, value in want.items():
        _assert_same_value(_get(out, path), value, path)
    manifest = _manifest(GOLDEN_V2)
    assert manifest["format_version"] == 2 and [s["shape"] for s in manifest["stacks"]] == [[3, 32, 40], [3, 2560]]
    kinds = {l["path"]: l["storage"]["type"] for l in manifest["leaves"] if "storage" in l}
    assert kinds["layers/1/kernel"] == kinds["layers/2/scale"] == "stacked" and kinds["params/dense/kernel"] == "zarr"
    mesh = _mesh()
    out = ckpt.restore(GOLDEN_V2, mesh=mesh)
    for path, spec in [("layers/1/kernel", P("data", "model")), ("layers/2/scale", P()),
                       ("params/dense/kernel", P("data", "model"))]:
        arr = _get(out, path)
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), path
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), want[path][shard.index]), (path, shard.index)


# What formats/make_golden.py wrote for format version 3 (4 processes x 2 devices, the packed
# layout, SPEC section 13): version 2's values (name aside), plus an array replicated along the
# mesh's data axis (pointers in the index objects) and one replicated everywhere.
def _golden_v3_expected():
    want = {**_golden_v2_expected(), "name": "golden-v3"}
    want["dp"] = np.arange(48 * 40, dtype=np.float32).reshape(48, 40) - 7.5
    want["everywhere"] = np.arange(3 * 1000, dtype=np.int32).reshape(3, 1000) * 3
    return want


def test_golden_v3_restores_to_the_stated_values_and_onto_meshes():
    from ckpt._format import INDEX_DTYPE

    want = _golden_v3_expected()
    out = ckpt.restore(GOLDEN_V3)
    for path, value in want.items():
        _assert_same_value(_get(out, path), value, path)
    manifest = _manifest(GOLDEN_V3)
    assert manifest["format_version"] == 3 and len(manifest["packed"]["indexes"]) == 4
    storage = {l["path"]: l["storage"] for l in manifest["leaves"] if l.get("storage", {}).get("type") == "zarr"}
    shardings = {l["path"]: l["sharding"] for l in manifest["leaves"] if l.get("sharding")}
    # What the lookup rule of SPEC 13.5 has to cover: places, writers, mesh tables and pointers.
    assert storage["everywhere"]["places"] and storage["everywhere"]["writer"] in range(4)
    assert shardings["dp"]["mesh_processes"] == 0 and "writer" not in storage["dp"]
    entries = [np.frombuffer(msgpack.unpackb(open(os.path.join(GOLDEN_V3, "~index", str(p)), "rb").read())["chunks"],
                             INDEX_DTYPE) for p in range(4)]
    assert sum(int((e["object"] < 0).sum()) for e in entries) > 0  # pointers
    assert not any(name == "zarr.json" for _, _, files in os.walk(GOLDEN_V3) for name in files)
    # Onto meshes: the saved 2x4, and 4x2 (every process's chunks read through another layout).
    for shape in ((2, 4), (4, 2)):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "model"))
        out = ckpt.restore(GOLDEN_V3, mesh=mesh)
        for path, spec in [("dp", P(None, "model")), ("layers/1/kernel", P("data", "model")),
                           ("everywhere", P()), ("params/dense/kernel", P("data", "model"))]:
            arr = _get(out, path)
            assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), path
            for shard in arr.addressable_shards:
                assert np.array_equal(np.asarray(shard.data), want[path][shard.index]), (path, shard.index)


def test_golden_checkpoints_are_tiny_and_exist_for_every_version():
    from ckpt._format.records import FORMAT_VERSION

    for version in range(1, FORMAT_VERSION + 1):
        root = os.path.join(FORMATS, "golden", f"v{version}", "checkpoint")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
        assert 0 < size < 100_000, (version, size)


def test_reference_reader_imports_only_zarr_msgpack_numpy_ml_dtypes():
    with open(os.path.join(FORMATS, "reference_reader.py")) as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "math", "os", "zarr", "msgpack", "numpy", "ml_dtypes"}, imported


def test_reference_crc32c_matches_the_check_value():
    assert reference.crc32c(b"123456789") == 0xE3069283
    assert reference.crc32c(b"56789", reference.crc32c(b"1234")) == 0xE3069283


class Pair(NamedTuple):
    first: jax.Array
    second: list


@dataclasses.dataclass
class State:
    count: jax.Array
    scale: float


jax.tree_util.register_dataclass(State, data_fields=["count", "scale"], meta_fields=[])


def _fresh_tree():
    """More than the golden checkpoint holds: custom nodes, other key kinds, dtypes and specs."""
    mesh = _mesh()

    def put(a, *spec):
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))

    return {
        "pair": Pair(put(np.arange(64 * 64, dtype=np.float16).reshape(64, 64), "data", "model"),
                     [np.arange(1100, dtype=np.uint64), {"x": 3}]),
        "state": State(put(np.arange(2048, dtype=np.int32) - 1000, "model"), 0.5),
        "grouped": put(np.arange(4096, dtype=np.int32), ("data", "model")),  # one dim over two axes
        "c64": put((np.arange(1024) + 1j * np.arange(1024)).astype(np.complex64), "data"),
        "keys": jax.random.split(jax.random.key(3, impl="rbg"), 256),
        "e5m2": put(np.linspace(-3, 3, 96 * 64, dtype=np.float32).astype(ml_dtypes.float8_e5m2).reshape(96, 64)),
        "uint4": put((np.arange(8 * 1024) % 16).astype(ml_dtypes.uint4).reshape(8, 1024), "data"),
        "int_keys": {7: [None, ()], 3: np.float64(1.5)},
    }


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("format") / "fresh")
    ckpt.save(path, _fresh_tree(), options=ckpt.Options(pack_limit_bytes=0))  # one chunk per shard
    return path


def _assert_same_tree(got, want, where="<root>"):
    got, want = _key_data(got), _key_data(want)
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, list(got), list(want))
        for k in want:
            _assert_same_tree(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same_tree(g, w, f"{where}/{i}")
    elif want is None:
        assert got is None, where
    elif isinstance(want, (np.ndarray, np.generic)):
        assert type(got) is type(want) and got.dtype == want.dtype and np.shape(got) == np.shape(want), where
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), where
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


@pytest.mark.parametrize("which", ["golden_v1", "golden_v2", "golden_v3", "fresh"])
def test_reference_reader_returns_what_restore_returns(which, fresh):
    path = GOLDEN.get(which, fresh)
    by_spec = reference.read_checkpoint(path)
    _assert_same_tree(by_spec, ckpt.restore(path))
    if which == "fresh":  # and both hold the saved values
        saved = _fresh_tree()
        assert np.array_equal(by_spec["pair"]["first"], np.asarray(saved["pair"].first))
        assert np.array_equal(by_spec["pair"]["second"][0], saved["pair"].second[0])
        assert by_spec["state"]["scale"] == 0.5
        assert np.array_equal(by_spec["keys"], np.asarray(jax.random.key_data(saved["keys"])))
        assert np.array_equal(by_spec["uint4"].astype(np.uint8), np.arange(8 * 1024).reshape(8, 1024) % 16)
        assert by_spec["int_keys"][7] == [None, ()] and list(by_spec["int_keys"]) == [3, 7]


def test_reference_reader_refuses_damage_and_newer_versions(fresh, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(fresh, bad)
    chunk = os.path.join(bad, "pair", "first", "c", "1", "3")
    with open(chunk, "r+b") as f:
        f.write(b"\xff\xff")
    with pytest.raises(reference.FormatError, match=r"chunk \[1, 3\]"):
        reference.read_checkpoint(bad)
    newer = str(tmp_path / "newer")
    shutil.copytree(GOLDEN_V1, newer)
    _rewrite_manifest(newer, lambda m: m.update(format_version=4))
    with pytest.raises(reference.FormatError, match="format_version 4 is newer"):
        reference.read_checkpoint(newer)
    with pytest.raises(ckpt.CheckpointError, match="format_version 4 is newer"):
        ckpt.restore(newer)


def _rewrite_manifest(root, change):
    path = os.path.join(root, "manifest.msgpack")
    with open(path, "rb") as f:
        m = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    change(m)
    with open(path, "wb") as f:
        f.write(msgpack.packb(m, use_bin_type=True))


# A validator for the subset of JSON Schema formats/manifest.schema.json uses (no jsonschema
# package here), with the schema's "x-msgpack": "bin" marking byte strings.
_TYPES = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def _errors(value, schema, root, where="$"):
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return _errors(value, target, root, where)
    errs = []
    if schema.get("x-msgpack") == "bin" and not isinstance(value, bytes):
        errs.append(f"{where}: not bin")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            return [f"{where}: {value!r:.40} is not {types}"]
    if "const" in schema and not (value == schema["const"] and type(value) is type(schema["const"])):
        errs.append(f"{where}: {value!r:.40} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{where}: {value!r:.40} not in {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errs.append(f"{where}: below minimum")
        if "maximum" in schema and value > schema["maximum"]:
            errs.append(f"{where}: above maximum")
    if isinstance(value, dict):
        errs += [f"{where}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        for k, sub in schema.get("properties", {}).items():
            if k in value:
                errs += _errors(value[k], sub, root, f"{where}.{k}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errs.append(f"{where}: too few items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errs.append(f"{where}: too many items")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items")
            if sub is not None:
                errs += _errors(item, sub, root, f"{where}[{i}]")
    if "oneOf" in schema:
        ok = [s for s in schema["oneOf"] if not _errors(value, s, root, where)]
        if len(ok) != 1:
            errs.append(f"{where}: matches {len(ok)} of oneOf")
    if "anyOf" in schema and not any(not _errors(value, s, root, where) for s in schema["anyOf"]):
        errs.append(f"{where}: matches none of anyOf")
    return errs


def _schema():
    with open(os.path.join(FORMATS, "manifest.schema.json")) as f:
        return json.load(f)


def _manifest(root):
    with open(os.path.join(root, "manifest.msgpack"), "rb") as f:
        return msgpack.unpackb(f.read(), raw=False, strict_map_key=False)


@pytest.mark.parametrize("which", ["golden_v1", "golden_v2", "golden_v3", "fresh"])
def test_manifests_match_the_json_schema(which, fresh):
    schema = _schema()
    manifest = _manifest(GOLDEN.get(which, fresh))
    assert _errors(manifest, schema, schema) == []


def test_the_schema_rejects_broken_manifests():
    schema = _schema()
    good = _manifest(GOLDEN_V1)
    breakages = [
        lambda m: m.pop("leaves"),
        lambda m: m.update(format="other"),
        lambda m: m["leaves"][0].update(kind="pickle"),
        lambda m: next(l for l in m["leaves"] if l["kind"] == "jax.Array")["storage"].update(type="npy"),
        lambda m: next(l for l in m["leaves"] if l.get("storage", {}).get("type") == "zarr")["storage"]
        .update(chunk_checksums=[-1]),
        lambda m: next(l for l in m["leaves"] if l.get("storage", {}).get("type") == "inline")["storage"]
        .update(data="not bytes"),
        lambda m: m["tree"].update(kind="set"),
    ]
    for i, breakage in enumerate(breakages):
        broken = copy.deepcopy(good)
        breakage(broken)
        assert _errors(broken, schema, schema), f"breakage {i} went unnoticed"


def test_stock_zarr_sees_every_array_with_its_logical_dtype_attribute(fresh):
    import zarr

    manifest = _manifest(fresh)
    for leaf in manifest["leaves"]:
        st = leaf.get("storage")
        if not st or st["type"] != "zarr":
            continue
        arr = zarr.open_array(os.path.join(fresh, st["path"]), mode="r")
        assert arr.attrs["jax_ckpt"] == {"path": leaf["path"], "dtype": leaf["dtype"], "encoding": st["encoding"]}
        assert list(arr.chunks) == st["chunk_shape"] and str(arr.dtype) == st["data_type"]
