"""`ckpt export --format zarr`: plain Zarr v3 (one file per chunk, a zarr.json per array and group)
that stock zarr-python and TensorStore's zarr3 driver read, no ckpt code, value for value."""

import base64
import json
import math
import os
import pathlib
import uuid

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.cli._main import main as cli_main

GOLDEN = sorted((pathlib.Path(__file__).resolve().parent.parent / "formats" / "golden").glob("v*/checkpoint"))


def export(capsys, src, out, *flags):
    """Run `ckpt export --format zarr` in this process; its --json document."""
    capsys.readouterr()
    rc = cli_main(["export", "--format", "zarr", str(src), str(out), "--no-progress", "--json", *map(str, flags)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def refused(capsys, *args):
    """Run `ckpt export ...` expecting the one-line error; the error."""
    capsys.readouterr()
    rc = cli_main(["export", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    assert (rc, captured.out) == (2, ""), captured
    assert captured.err.startswith("ckpt export: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


# ---- what a user of stock tools does --------------------------------------------------------

def logical(stored: np.ndarray, attrs: dict) -> np.ndarray:
    """SPEC section 6: the logical dtype from the array's attributes."""
    info = attrs["jax_ckpt"]
    dtype = np.dtype(getattr(ml_dtypes, info["dtype"], None) or info["dtype"])
    return stored.view(dtype) if info["encoding"] == "bits" else stored.astype(dtype)


def py_value(kind: str, v):
    """A value leaf back from the root group's jax_ckpt_values (docs/cli.md, "export")."""
    special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    if kind == "int":
        return int(v)
    if kind == "float":
        return special.get(v, v) if isinstance(v, str) else float(v)
    if kind == "complex":
        return complex(*(special.get(x, x) for x in v))
    if kind == "bytes":
        return base64.b64decode(v)
    return v


def read_with_zarr(out) -> tuple[dict, dict, dict]:
    """(leaf path -> logical numpy array, leaf path -> value, leaf path -> zarr chunk shape)."""
    group = zarr.open_group(str(out), mode="r")
    info = group.attrs["jax_ckpt"]
    arrays, chunks = {}, {}
    for leaf, zpath in info["arrays"].items():
        z = group[zpath]
        assert isinstance(z, zarr.Array) and z.attrs["jax_ckpt"]["path"] == (leaf or "<root>")
        arrays[leaf] = logical(z[...], dict(z.attrs))
        chunks[leaf] = tuple(z.chunks)
    values = {leaf: py_value(kind, group.attrs["jax_ckpt_values"][leaf]) for leaf, kind in info["values"].items()}
    return arrays, values, chunks


def read_with_tensorstore(out) -> dict:
    """leaf path -> logical numpy array, through TensorStore's zarr3 driver on the file kvstore
    (missing chunks are errors, never fill values)."""
    info = json.loads((pathlib.Path(out) / "zarr.json").read_text())["attributes"]["jax_ckpt"]
    arrays = {}
    for leaf, zpath in info["arrays"].items():
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(str(out), zpath)},
                     "fill_missing_data_reads": False}, open=True, read=True).result()
        attrs = json.loads((pathlib.Path(out) / zpath / "zarr.json").read_text())["attributes"]
        arrays[leaf] = logical(t.read().result(), attrs)
    return arrays


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (NaN and -0.0 included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def flat(tree) -> dict:
    """leaf path ('params/w', list positions as digits) -> leaf, as the manifest names them."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))) for k in path]
        out["/".join(parts)] = leaf
    return out


def expected_array(leaf) -> np.ndarray:
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    return np.asarray(leaf)


def check_export(out, tree, metadata) -> None:
    """Every array of `tree` read back with zarr-python and with TensorStore, byte for byte, in
    the checkpoint's chunk shape (`metadata`: ckpt.metadata of the source); every value leaf from
    the root group's attributes."""
    expected = flat(tree)
    meta = flat(metadata)
    arrays, values, chunks = read_with_zarr(out)
    from_ts = read_with_tensorstore(out)
    is_array = {p for p, v in expected.items() if isinstance(v, (np.ndarray, np.generic, jax.Array))}
    assert set(arrays) == set(from_ts) == is_array
    assert set(values) == set(expected) - is_array
    for path in is_array:
        want = expected_array(expected[path])
        assert same(arrays[path], want), path
        assert same(from_ts[path], want), path
        recorded = meta[path].chunk_shape  # None when inline: then one chunk (at least 1 a dimension)
        assert chunks[path] == (tuple(recorded) if recorded is not None else tuple(max(1, n) for n in want.shape)), path
    for path in set(values):
        want, got = expected[path], values[path]
        assert type(got) is type(want), (path, got, want)
        assert got == want or (isinstance(want, float) and math.isnan(want) and math.isnan(got)), (path, got, want)


# ---- trees ----------------------------------------------------------------------------------

def a_tree() -> dict:
    mesh = jax.make_mesh((4, 2), ("x", "y"))

    def put(a, *spec):
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))

    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    w[0, :4] = [np.nan, -0.0, np.inf, -np.inf]
    return {
        "params": {
            "w": put(w, "x", None),  # float32, sharded over the 8 CPU devices
            "embed": put(rng.standard_normal((128, 64)).astype(ml_dtypes.bfloat16), "x", "y"),
            "q": put(rng.integers(-8, 8, (64, 32)).astype(ml_dtypes.int4), None, "y"),  # int4: int8 values
            "f8": rng.standard_normal((48, 40)).astype(ml_dtypes.float8_e4m3fn),  # numpy, uint8 bits
            "bias": put(np.arange(96, dtype=np.float32) / 8, "y"),  # inline in the manifest
        },
        "layers": [{"k": np.full((40, 40), k, np.float32) + np.eye(40, dtype=np.float32)} for k in range(3)],
        "table": np.arange(100 * 7, dtype=np.int32).reshape(100, 7),
        "mask": rng.integers(0, 2, (70, 90)).astype(bool),
        "scalar": np.float32(1.5),
        "zero_d": np.array(3, np.int64),
        "empty": np.zeros((0, 4), np.float32),
        "rng": jax.random.key(7),
        "nested": {"pair": (np.arange(2000, dtype=np.int16), [np.complex64(1 + 2j), None])},
        "step": 12, "lr": 0.125, "name": "run/α", "flag": True, "big": 2**70, "nan": math.nan, "z": 1 - 2j,
        "blob": b"\x00\x01ckpt",
    }


SAVES = {
    # One process holds everything: small arrays written whole, a few stacked (format version 2).
    "files": ckpt.Options(layout="files"),
    # Chunked by sharding, shards split into 4 KiB chunks (chunk shape != shard shape).
    "files-chunked": ckpt.Options(layout="files", pack_limit_bytes=0, max_chunk_bytes=4096),
    # Format version 3: chunks packed into data objects, no zarr.json: the export is the stock route.
    "packed": ckpt.Options(layout="packed"),
    "packed-chunked": ckpt.Options(layout="packed", pack_limit_bytes=0, max_chunk_bytes=4096),
}
VERSION = {"files": 2, "files-chunked": 1, "packed": 3, "packed-chunked": 3}


@pytest.mark.parametrize("save", sorted(SAVES))
def test_stock_zarr_and_tensorstore_read_every_value_of_an_export(tmp_path, capsys, save):
    tree = a_tree()
    ckpt.save(tmp_path / "c", tree, options=SAVES[save])
    doc = export(capsys, tmp_path / "c", tmp_path / "out")
    check_export(tmp_path / "out", tree, ckpt.metadata(tmp_path / "c"))
    assert doc["format"] == "zarr" and doc["out"] == str(tmp_path / "out")
    root = zarr.open_group(str(tmp_path / "out"), mode="r").attrs["jax_ckpt"]
    assert root["format_version"] == VERSION[save]  # the route taken is the one named
    assert doc["arrays"]["params/w"] == "params/w" and doc["arrays"]["nested/pair/0"] == "nested/pair/0"
    assert sorted(doc["values"]) == ["big", "blob", "flag", "lr", "name", "nan", "step", "z"]
    # One file per chunk, a zarr.json per array and per group, nothing else; no temporary left.
    files = {str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file()}
    metas = {f for f in files if f.endswith("zarr.json")}
    assert len(files) - len(metas) == doc["chunks"]
    assert {"zarr.json", "params/zarr.json", "layers/zarr.json", "layers/0/zarr.json", "nested/pair/zarr.json"} <= metas
    assert len(metas) == len(doc["arrays"]) + len({"", "params", "layers", "layers/0", "layers/1", "layers/2",
                                                     "nested", "nested/pair", "nested/pair/1"})
    assert sorted(os.listdir(tmp_path)) == ["c", "out"]
    if save.endswith("chunked"):
        assert zarr.open_array(str(tmp_path / "out" / "params" / "w"), mode="r").chunks == (16, 64)


def test_a_tree_that_is_one_array_and_names_zarr_cannot_keep(tmp_path, capsys):
    """The root leaf is `_root`; a key that is not a plain name is escaped as the checkpoint
    escapes it, and paths that clash case-insensitively move to `~<leaf index>`."""
    ckpt.save(tmp_path / "one", np.arange(5000, dtype=np.float64))
    doc = export(capsys, tmp_path / "one", tmp_path / "one.zarr")
    assert doc["arrays"] == {"": "_root"}
    assert same(zarr.open_group(str(tmp_path / "one.zarr"), mode="r")["_root"][...], np.arange(5000, dtype=np.float64))

    tree = {"a b/c": np.arange(2000, dtype=np.int32), "W": np.ones(2000, np.float32), "w": np.zeros(2000, np.float32),
            "zarr.json": np.arange(3000, dtype=np.uint8)}
    ckpt.save(tmp_path / "odd", tree)
    doc = export(capsys, tmp_path / "odd", tmp_path / "odd.zarr")
    assert doc["arrays"] == {"W": "W", "a b/c": "a%20b%2Fc", "w": "~2", "zarr.json": "%7Aarr.json"}
    check_export(tmp_path / "odd.zarr", tree, ckpt.metadata(tmp_path / "odd"))


@pytest.mark.parametrize("golden", GOLDEN, ids=lambda p: p.parent.name)
def test_golden_checkpoints_export_to_what_restore_returns(tmp_path, capsys, golden):
    """Every format version's golden checkpoint (v1, v2, and any later one as it lands)."""
    export(capsys, golden, tmp_path / "out")
    check_export(tmp_path / "out", ckpt.restore(golden), ckpt.metadata(golden))


def test_a_checkpoint_in_memory_and_a_step_of_a_manager_directory(tmp_path, capsys):
    """The source is read through ckpt.storage (memory:// here: the generation layout); a manager
    directory exports its latest step, or --step N."""
    tree = {"w": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
                                NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))), "step": 1}
    for layout in ("files-chunked", "packed-chunked"):
        url = f"memory://export-zarr/{uuid.uuid4().hex}/c"
        ckpt.save(url, tree, options=SAVES[layout])
        export(capsys, url, tmp_path / layout)
        check_export(tmp_path / layout, tree, ckpt.metadata(url))

    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, {"w": np.full((40, 40), step, np.float32), "step": step})
    doc = export(capsys, tmp_path / "run", tmp_path / "latest")
    assert doc["source"].endswith("step_00000002")
    assert zarr.open_group(str(tmp_path / "latest"), mode="r").attrs["jax_ckpt_values"] == {"step": 2}
    export(capsys, tmp_path / "run", tmp_path / "first", "--step", "1")
    assert same(zarr.open_array(str(tmp_path / "first" / "w"), mode="r")[...], np.full((40, 40), 1, np.float32))


def test_memory_stays_within_the_host_budget(tmp_path, capsys, monkeypatch):
    """Chunks are read in groups of at most half the budget (--host-budget), never a whole
    array at once: counted at the reader, on a 2 MiB array of 64 chunks exported within 128 KiB."""
    from ckpt.cli import _export_zarr

    value = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    ckpt.save(tmp_path / "c", {"w": jax.device_put(value, NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))},
              options=ckpt.Options(pack_limit_bytes=0, max_chunk_bytes=32 * 1024))
    reads = []

    class Counting(_export_zarr.Reader):
        def read(self, plans):
            reads.append(sum(p.bytes_read for p in plans))
            return super().read(plans)

    monkeypatch.setattr(_export_zarr, "Reader", Counting)
    doc = export(capsys, tmp_path / "c", tmp_path / "out", "--host-budget", "128KiB")
    assert doc["chunks"] == 64 and doc["bytes"] == value.nbytes
    assert len(reads) == 32 and max(reads) <= 64 * 1024, reads  # two 32 KiB chunks per read
    assert same(zarr.open_array(str(tmp_path / "out" / "w"), mode="r")[...], value)


@pytest.mark.parametrize("layout", ["files", "packed"])
def test_a_stack_chunk_is_read_once_for_all_its_members(tmp_path, capsys, monkeypatch, layout):
    """Small arrays saved in a stack (format version 2 and 3) are exported leaf by leaf but read
    in batches across leaves: each stack chunk once, not once a member."""
    from ckpt.cli import _export_zarr

    tree = {f"layer{i:03d}": np.full((40, 40), i, np.float32) for i in range(300)}
    ckpt.save(tmp_path / "c", tree, options=ckpt.Options(layout=layout))
    metadata = ckpt.metadata(tmp_path / "c")
    assert all("~stacks/" in m.storage_path for m in metadata.values())
    readers = []

    class Keeping(_export_zarr.Reader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    monkeypatch.setattr(_export_zarr, "Reader", Keeping)
    doc = export(capsys, tmp_path / "c", tmp_path / "out")
    assert doc["chunks"] == 300 and readers[0].stats.bytes_read == 300 * 40 * 40 * 4
    check_export(tmp_path / "out", tree, metadata)


def test_edge_chunks_are_written_whole_as_zarr_stores_them():
    """A chunk that overhangs the array (SPEC section 7 lets a reader meet one) is the whole chunk
    shape, zero-padded, as zarr-python writes it."""
    from ckpt.cli._export_zarr import _chunk_bytes

    data = np.arange(6, dtype=np.uint16).reshape(2, 3)
    out = _chunk_bytes(data, ((4, 6), (3, 6)), (4, 4), np.dtype(np.uint16))
    want = np.zeros((4, 4), "<u2")
    want[:2, :3] = data
    assert out.tobytes() == want.tobytes()


# ---- refusals ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("export-zarr") / "c"
    ckpt.save(path, {"w": np.arange(2000, dtype=np.float32), "step": 3})
    return path


def test_out_must_be_new_or_empty_and_overwrite_replaces_only_an_earlier_export(tmp_path, capsys, small):
    out = tmp_path / "out"
    out.mkdir()
    export(capsys, small, out)  # an empty directory is fine
    err = refused(capsys, small, out, "--format", "zarr")
    assert "OUT is not empty" in err and "--overwrite" in err and str(out) in err
    doc = export(capsys, small, out, "--overwrite")  # an earlier zarr export: replaced
    assert doc["chunks"] == 1 and sorted(os.listdir(tmp_path)) == ["out"]

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for flags in ((), ("--overwrite",)):
        err = refused(capsys, small, mine, "--format", "zarr", *flags)
        assert "OUT is not empty" in err and str(mine) in err
    assert err.count("is not one") == 1  # --overwrite says why it does not apply
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"

    (tmp_path / "file").write_text("x")
    assert "not a directory" in refused(capsys, small, tmp_path / "file", "--format", "zarr")
    assert "local directory" in refused(capsys, small, "s3://bucket/out", "--format", "zarr")


@pytest.mark.parametrize("flags, words", [
    (("--rename", "^w=x"), "--rename applies to --format safetensors only"),
    (("--rename-file", "names.json"), "--rename-file applies to --format safetensors only"),
    (("--shard-size", "1GB"), "--shard-size applies to --format safetensors only"),
    (("--format", "gguf"), "argument --format: invalid choice: 'gguf' (choose from 'safetensors', 'zarr')"),
])
def test_safetensors_flags_are_refused_with_zarr(tmp_path, capsys, small, flags, words):
    args = [small, tmp_path / "out", *flags] + (["--format", "zarr"] if "gguf" not in flags else [])
    assert words in refused(capsys, *args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["files", "packed"])
def test_a_damaged_chunk_fails_the_export_and_leaves_nothing(tmp_path, capsys, layout):
    """Every chunk is checked against its CRC-32C on the way (a chunk file, or a data object of
    format version 3); a failed export leaves neither OUT nor its temporary directory."""
    ckpt.save(tmp_path / "c", {"w": np.arange(4000, dtype=np.float32)}, options=ckpt.Options(layout=layout))
    data_files = (tmp_path / "c" / "w").rglob("*") if layout == "files" else (tmp_path / "c" / "~data").rglob("*")
    damaged = next(p for p in data_files if p.is_file() and p.name != "zarr.json")
    data = bytearray(damaged.read_bytes())
    data[10] ^= 1
    damaged.write_bytes(bytes(data))
    err = refused(capsys, tmp_path / "c", tmp_path / "out", "--format", "zarr")
    assert "crc32c is" in err and "leaf 'w', chunk [0]" in err
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_the_default_format_exports_a_packed_checkpoint_too(tmp_path, capsys):
    """`ckpt export` (safetensors) reads format version 3's data objects through their index, as
    the Zarr route does."""
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    ckpt.save(tmp_path / "c", {"w": jax.device_put(value, NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))},
              options=ckpt.Options(layout="packed", pack_limit_bytes=0))
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "c"), str(tmp_path / "hf"), "--no-progress"]) == 0
    assert same(ckpt.restore(tmp_path / "hf")["w"], value)


def test_a_safetensors_source_is_refused(tmp_path, capsys, small):
    export_dir = tmp_path / "hf"
    capsys.readouterr()
    assert cli_main(["export", str(small), str(export_dir), "--no-progress"]) == 0
    err = refused(capsys, export_dir, tmp_path / "out", "--format", "zarr")
    assert "is safetensors" in err
