"""Format version 3, the packed layout (formats/SPEC.md section 13), at the level of its pieces:
index objects encoded and decoded (and every hostile one refused, naming the file and the
process), lookups, the manifest's ``packed`` section, which processes held a chunk at save time
(checked against JAX's own NamedSharding layout), and formats/reference_reader.py reading a
version-3 checkpoint built here by hand from those pieces."""

import importlib.util
import itertools
import math
import os

import crc32c
import jax
import ml_dtypes
import msgpack
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ckpt import CheckpointError
from ckpt._format import (
    ALIGN,
    INDEX_DTYPE,
    INDEX_FORMAT,
    IndexRef,
    chunk_holders,
    decode_index,
    encode_index,
    packed_section,
    packed_section_check,
)
from ckpt._geometry import chunk_box, chunk_grid, index_to_box

FORMATS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "formats")


def _records(rows):
    """INDEX_DTYPE records from (array, chunk, object, offset, length, crc32c) rows."""
    return np.array([tuple(r) for r in rows], INDEX_DTYPE)


GOOD_OBJECTS = [("gen-3f9a0c1b2d4e/~data/1.0", 3 * ALIGN + 100), ("gen-3f9a0c1b2d4e/~data/1.1", 100)]
GOOD_ROWS = [
    (0, 0, 0, 0, 100, 11),
    (0, 1, 0, ALIGN, 100, 12),
    (2, 7, 1, 0, 100, 13),
    (-1, 0, 0, 3 * ALIGN, 100, 14),  # a stack's chunk
    (3, 4, -3, 0, 0, 0),  # a pointer: process 2 wrote it
]


def _decode(data, process=1, processes=4, size=None, crc=None, where="ckpt/gen-x/~index/1"):
    return decode_index(data, where=where, process=process, processes=processes,
                        expected_size=len(data) if size is None else size,
                        expected_crc=crc32c.crc32c(data) if crc is None else crc)


def test_encode_decode_round_trip_sorts_and_keeps_every_field():
    data = encode_index(1, GOOD_OBJECTS, _records(GOOD_ROWS[::-1]))  # any order in
    assert msgpack.unpackb(data, raw=False)["format"] == INDEX_FORMAT == "jax-ckpt-index"
    index = _decode(data)
    assert index.process == 1 and index.objects == tuple(GOOD_OBJECTS) and len(index) == 5
    assert INDEX_DTYPE.itemsize == 36
    want = sorted(GOOD_ROWS, key=lambda r: (r[0], r[1]))
    assert [tuple(int(v) for v in e) for e in index.entries] == want
    for row in GOOD_ROWS:
        got = index.find(row[0], row[1])
        assert got is not None and tuple(int(v) for v in got) == row
    # misses: absent chunk of a present array, absent arrays, out-of-range keys
    for array, chunk in [(0, 2), (1, 0), (2, 6), (2, 8), (-2, 0), (4, 0), (0, -1), (0, 2**40), (2**40, 0)]:
        assert index.find(array, chunk) is None, (array, chunk)


def test_an_empty_index_round_trips_and_finds_nothing():
    index = _decode(encode_index(0, [], _records([])), process=0)
    assert len(index) == 0 and index.objects == () and index.find(0, 0) is None


def test_find_with_chunk_indices_beyond_32_bits():
    rows = [(0, 2**33 + k, 0, k * ALIGN, 8, k) for k in range(5)] + [(1, 3, 0, 5 * ALIGN, 8, 9)]
    index = _decode(encode_index(1, [("~data/1.0", 6 * ALIGN)], _records(rows)))
    for row in rows:
        assert tuple(int(v) for v in index.find(row[0], row[1])) == row
    assert index.find(0, 2**33 + 5) is None and index.find(1, 4) is None and index.find(2, 0) is None


def test_find_on_a_large_index_matches_a_dict():
    rng = np.random.default_rng(0)
    keys = sorted({(int(a), int(c)) for a, c in zip(rng.integers(-50, 2000, 60_000), rng.integers(0, 64, 60_000))})
    rows = [(a, c, 0, i * ALIGN, 1, i % 2**32) for i, (a, c) in enumerate(keys)]
    index = _decode(encode_index(1, [("~data/1.0", len(rows) * ALIGN)], _records(rows)))
    table = {(a, c): r for a, c, *r in rows}
    for a, c in itertools.islice(itertools.product(range(-60, 2010, 7), range(0, 70, 3)), 20_000):
        got = index.find(a, c)
        assert (got is None) == ((a, c) not in table), (a, c)
        if got is not None:
            assert int(got["offset"]) == table[(a, c)][1]


def test_encode_refuses_duplicates():
    with pytest.raises(ValueError, match="chunk 1 of array 0 is recorded twice"):
        encode_index(0, GOOD_OBJECTS, _records([(0, 1, 0, 0, 1, 0), (0, 1, 0, ALIGN, 1, 0)]))


def _raw(doc):
    return msgpack.packb(doc, use_bin_type=True)


def _good_doc(**change):
    doc = {"format": INDEX_FORMAT, "process": 1,
           "objects": [{"name": n, "size": s} for n, s in GOOD_OBJECTS],
           "chunks": _records(GOOD_ROWS).tobytes()}
    doc.update(change)
    return doc


def _rows_doc(rows, **change):
    return _good_doc(chunks=_records(rows).tobytes(), **change)


HOSTILE = {
    "not msgpack": (b"\xc1\x00\x01", "is not msgpack"),
    "truncated": (_raw(_good_doc())[:-7], "is not msgpack"),
    "trailing bytes": (_raw(_good_doc()) + b"\x00", "is not msgpack"),
    "not a map": (_raw([1, 2]), "is not a jax-ckpt-index map"),
    "wrong format": (_raw(_good_doc(format="jax-ckpt")), "is not a jax-ckpt-index map"),
    "wrong process": (_raw(_good_doc(process=2)), "names process 2"),
    "process not an int": (_raw(_good_doc(process="1")), "names process '1'"),
    "objects not a list": (_raw(_good_doc(objects={"name": "x"})), "'objects' is not a list"),
    "object size not an int": (_raw(_good_doc(objects=[{"name": "~data/1.0", "size": "9"}])), "object 0 is not"),
    "object size negative": (_raw(_good_doc(objects=[{"name": "~data/1.0", "size": -1}])), "object 0 is not"),
    "object name escapes": (_raw(_good_doc(objects=[{"name": "../other/~data/1.0", "size": 9}])), "object 0 is not"),
    "object name absolute": (_raw(_good_doc(objects=[{"name": "/etc/passwd", "size": 9}])), "object 0 is not"),
    "object name not a str": (_raw(_good_doc(objects=[{"name": b"~data/1.0", "size": 9}])), "object 0 is not"),
    "chunks not bytes": (_raw(_good_doc(chunks="abc")), r"'chunks' \(str\) is not a whole number of 36-byte"),
    "chunks a partial record": (_raw(_good_doc(chunks=_records(GOOD_ROWS).tobytes()[:-1])),
                                r"'chunks' \(179 bytes\) is not a whole number of 36-byte"),
    "unsorted": (_raw(_rows_doc([(0, 1, 0, 0, 1, 0), (0, 0, 0, ALIGN, 1, 0)])),
                 r"record 1 \(array 0, chunk 0\): not sorted"),
    "unsorted arrays": (_raw(_rows_doc([(1, 0, 0, 0, 1, 0), (0, 5, 0, ALIGN, 1, 0)])),
                        r"record 1 \(array 0, chunk 5\): not sorted"),
    "duplicate": (_raw(_rows_doc([(0, 1, 0, 0, 1, 0), (0, 1, 0, ALIGN, 1, 0)])),
                  r"record 1 \(array 0, chunk 1\): recorded twice"),
    "negative chunk": (_raw(_rows_doc([(0, -1, 0, 0, 1, 0)])), "negative chunk index"),
    "object out of range": (_raw(_rows_doc([(0, 0, 2, 0, 1, 0)])), r"object out of range \(2 objects\)"),
    "unaligned offset": (_raw(_rows_doc([(0, 0, 0, 100, 1, 0)])), "offset not a multiple of 4096"),
    "past the object": (_raw(_rows_doc([(0, 0, 1, 0, 101, 0)])), "offset \\+ length lies beyond"),
    "offset past the object": (_raw(_rows_doc([(0, 0, 1, ALIGN, 1, 0)])), "offset \\+ length lies beyond"),
    "offset+length overflows": (_raw(_rows_doc([(0, 0, 0, 2**64 - ALIGN, ALIGN + 1, 0)])),
                                "offset \\+ length lies beyond"),
    "pointer past the processes": (_raw(_rows_doc([(0, 0, -5, 0, 0, 0)])),
                                   "points to a process that is not another of the save's 4"),
    "pointer to itself": (_raw(_rows_doc([(0, 0, -2, 0, 0, 0)])), "points to a process that is not another"),
    "pointer with a location": (_raw(_rows_doc([(0, 0, -1, ALIGN, 0, 0)])), "a pointer with a non-zero offset"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_decode_refuses_a_hostile_index_naming_the_file_and_the_process(case):
    data, message = HOSTILE[case]
    record = r"(record \d+ \(array -?\d+, chunk -?\d+\): )?"
    with pytest.raises(CheckpointError, match=r"^ckpt/gen-x/~index/1: index object of process 1: " + record + message):
        _decode(data)


def test_decode_refuses_wrong_size_and_crc_before_anything_else():
    data = encode_index(1, GOOD_OBJECTS, _records(GOOD_ROWS))
    with pytest.raises(CheckpointError, match=rf"^w: index object of process 1: has {len(data)} bytes, the manifest records {len(data) + 1}"):
        _decode(data, size=len(data) + 1, where="w")
    with pytest.raises(CheckpointError, match="^w: index object of process 1: does not match the CRC-32C"):
        _decode(data, crc=crc32c.crc32c(data) ^ 1, where="w")
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x10  # a damaged object read back with the manifest's figures
    with pytest.raises(CheckpointError, match="does not match the CRC-32C"):
        _decode(bytes(flipped), crc=crc32c.crc32c(data))
    # the good one with its own figures passes, and a record is checked against `align`
    assert len(_decode(data)) == 5
    big = encode_index(1, [("~data/1.0", 4 * ALIGN)], _records([(0, 0, 0, ALIGN, 2 * ALIGN, 1)]))
    assert len(decode_index(big, where="w", process=1, processes=4, expected_size=len(big),
                            expected_crc=crc32c.crc32c(big))) == 1
    with pytest.raises(CheckpointError, match="offset not a multiple of 8192"):
        decode_index(big, where="w", process=1, processes=4, expected_size=len(big),
                     expected_crc=crc32c.crc32c(big), align=2 * ALIGN)
    # a chunk shorter than `align` needs only SMALL_ALIGN (SPEC 13.2)
    small = encode_index(1, [("~data/1.0", 4 * ALIGN)], _records([(0, 0, 0, 64, 100, 1), (0, 1, 0, 100, 28, 2)]))
    with pytest.raises(CheckpointError, match="record 1 .*offset not a multiple"):
        decode_index(small, where="w", process=1, processes=4, expected_size=len(small),
                     expected_crc=crc32c.crc32c(small))


# ---- the manifest's packed section -----------------------------------------------------------


def _section():
    return packed_section(
        ALIGN,
        [IndexRef(0, "gen-3f9a0c1b2d4e/~index/0", 120, 7), (1, "gen-3f9a0c1b2d4e/~index/1", 99, 2**32 - 1)],
        [((2, 4), np.arange(8) // 4), ((8,), np.array([1, 0, 1, 0, 1, 0, 1, 0]))],
    )


def test_packed_section_round_trips_through_msgpack():
    doc = msgpack.unpackb(msgpack.packb(_section(), use_bin_type=True), raw=False)
    assert doc["meshes"][0]["processes"] == np.arange(8, dtype="<u4").__floordiv__(4).tobytes()
    layout = packed_section_check(doc, "m")
    assert layout.align == ALIGN
    assert layout.indexes == (IndexRef(0, "gen-3f9a0c1b2d4e/~index/0", 120, 7),
                              IndexRef(1, "gen-3f9a0c1b2d4e/~index/1", 99, 2**32 - 1))
    assert [sizes for sizes, _ in layout.meshes] == [(2, 4), (8,)]
    assert layout.meshes[0][1].dtype == np.uint32
    assert layout.meshes[0][1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.meshes[1][1].tolist() == [1, 0, 1, 0, 1, 0, 1, 0]


def _broken(change):
    doc = msgpack.unpackb(msgpack.packb(_section(), use_bin_type=True), raw=False)
    change(doc)
    return doc


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(align=4000), "align 4000 is not 4096"),
    (lambda d: d.update(align=64), "align 64 is not 4096"),  # (a power of two, but not the format's)
    (lambda d: d["indexes"][0].update(size=2**31), "index of process 0: size 2147483648 .* at most 1073741824"),
    (lambda d: d.update(align=True), "align True is not"),
    (lambda d: d.update(indexes=[]), "'indexes' is not a non-empty list"),
    (lambda d: d["indexes"].reverse(), "index 0 is not a map for process 0"),
    (lambda d: d["indexes"][1].update(name="../x"), "index of process 1: name '../x' is not a path inside"),
    (lambda d: d["indexes"][1].update(name=d["indexes"][0]["name"]), "two processes name the same index object"),
    (lambda d: d["indexes"][0].update(size=-1), "index of process 0: size -1"),
    (lambda d: d["indexes"][0].update(crc32c=2**32), "index of process 0: size 120 / crc32c 4294967296"),
    (lambda d: d.update(meshes={}), "'meshes' is not a list"),
    (lambda d: d["meshes"][0].update(axis_sizes=[2, 0]), r"mesh 0: axis_sizes \[2, 0\]"),
    (lambda d: d["meshes"][0].update(axis_sizes=[2**13, 2**12]), "mesh 0: axis_sizes"),
    (lambda d: d["meshes"][1].update(processes=bytes(28)), "mesh 1: 'processes' is not 8 little-endian uint32"),
    (lambda d: d["meshes"][1].update(processes=np.full(8, 2, "<u4").tobytes()), "mesh 1: names process 2 of a save by 2"),
    (lambda d: d.pop("meshes"), "'meshes' is not a list"),
])
def test_packed_section_check_refuses(change, message):
    with pytest.raises(CheckpointError, match=r"^ckpt/manifest.msgpack: the manifest's 'packed' section: " + message):
        packed_section_check(_broken(change), "ckpt/manifest.msgpack")
    with pytest.raises(CheckpointError, match="is not a map"):
        packed_section_check([], "m")


# ---- chunk holders, against JAX's own layout -------------------------------------------------

MESHES = {
    "2x4": ((2, 4), ("data", "model")),
    "8": ((8,), ("x",)),
    "2x2x2": ((2, 2, 2), ("a", "b", "c")),
    "4x2": ((4, 2), ("model", "data")),
}
SPECS = {
    "2x4": [P(), P("data"), P("model"), P("data", "model"), P("model", "data"), P(("data", "model")),
            P(None, "model"), P(("model", "data"), None), P(None, ("data", "model"))],
    "8": [P(), P("x"), P(None, "x")],
    "2x2x2": [P("a", "c"), P(("c", "a"), "b"), P(None, ("b", "a", "c")), P("b")],
    "4x2": [P("data", "model"), P(("data", "model"))],
}
# device id -> process: 4 processes x 2 devices in id order, and a permuted assignment
DEVICE_PROCESSES = {"blocks": [0, 0, 1, 1, 2, 2, 3, 3], "permuted": [3, 1, 0, 2, 1, 3, 2, 0]}


def _cases():
    for mesh_name, specs in SPECS.items():
        for spec in specs:
            for table in DEVICE_PROCESSES:
                yield mesh_name, spec, table


@pytest.mark.parametrize("mesh_name, spec, table", list(_cases()), ids=lambda x: str(x).replace(" ", ""))
def test_chunk_holders_agree_with_named_sharding(mesh_name, spec, table):
    sizes, names = MESHES[mesh_name]
    devices = np.array(jax.devices()[:8]).reshape(sizes)
    mesh = Mesh(devices, names)
    proc_of = DEVICE_PROCESSES[table]
    mesh_processes = np.array([proc_of[d.id] for d in mesh.devices.flat], np.uint32)
    record_spec = [e if e is None or isinstance(e, str) else list(e) for e in spec]  # as a manifest has it
    shape = (16, 24)
    sharding = NamedSharding(mesh, spec)
    index_map = sharding.devices_indices_map(shape)
    shard = sharding.shard_shape(shape)
    divided = tuple(n // 2 if n % 2 == 0 else n for n in shard)
    checked = 0
    for chunk_shape in {shard, divided, (shard[0], 1)}:
        for index in itertools.product(*(range(g) for g in chunk_grid(shape, chunk_shape))):
            box = chunk_box(index, chunk_shape, shape)
            want = sorted({proc_of[d.id] for d, idx in index_map.items()
                           if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(box, index_to_box(idx, shape)))})
            got = chunk_holders(sizes, mesh_processes, record_spec, shape, chunk_shape, index, axis_names=names)
            assert list(got) == want and want, (chunk_shape, index, got, want)
            checked += 1
    assert checked >= math.prod(chunk_grid(shape, shard))


def test_chunk_holders_of_a_scalar_and_of_a_rank_beyond_the_spec():
    procs = np.array([2, 0, 1, 0, 3, 3, 2, 1], np.uint32)
    assert chunk_holders((2, 4), procs, [], (), (), (), axis_names=("data", "model")) == (0, 1, 2, 3)
    # spec shorter than the rank: the trailing dimensions are not split
    assert chunk_holders((2, 4), procs, ["data"], (4, 6, 2), (2, 3, 2), (1, 1, 0), axis_names=("data", "model")) == (1, 2, 3)
    assert chunk_holders((2, 4), procs, ["data"], (4, 6, 2), (2, 3, 2), (0, 1, 0), axis_names=("data", "model")) == (0, 1, 2)


@pytest.mark.parametrize("args, message", [
    ((["y"], (8,), (4,), (0,)), "names an axis the mesh"),
    ((["data", "data"], (8, 8), (4, 4), (0, 0)), "names an axis the mesh .* or another dimension uses"),
    ((["model"], (6,), (3,), (0,)), "dimension 0 of size 6 is not divisible into 4 shards"),
    ((["data"], (8,), (3,), (1,)), r"chunk \[1\] of chunk shape \[3\] does not lie inside one shard"),
    ((["data"], (8,), (4,), (2,)), r"chunk \[2\] .* does not lie inside one shard"),
])
def test_chunk_holders_refuses_what_does_not_fit(args, message):
    procs = np.arange(8, dtype=np.uint32)
    with pytest.raises(CheckpointError, match=message):
        chunk_holders((2, 4), procs, *args, axis_names=("data", "model"))
    with pytest.raises(CheckpointError, match="does not match its 7 device processes"):
        chunk_holders((2, 4), procs[:7], ["data"], (8,), (4,), (0,), axis_names=("data", "model"))


# ---- the reference reader on a hand-made version-3 checkpoint --------------------------------


def _load_reference():
    spec = importlib.util.spec_from_file_location("formats_reference_reader_v3", os.path.join(FORMATS, "reference_reader.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load_reference()
GEN = "gen-0123456789ab/"


def _seal(doc):
    """The manifest's bytes with its checksum entry last (SPEC section 8.1)."""
    data = msgpack.packb({**doc, "manifest_crc32c": bytes(4)}, use_bin_type=True)
    return data[:-4] + crc32c.crc32c(data[:-4]).to_bytes(4, "big")


class _Writer:
    """Writes a version-3 checkpoint by SPEC section 13: each process's chunks into its data
    objects at aligned offsets, its index object, and the manifest."""

    def __init__(self, root, processes, pointers=True):
        self.root, self.processes, self.pointers = root, processes, pointers
        self.objects = {p: [bytearray()] for p in range(processes)}
        self.rows = {p: [] for p in range(processes)}

    def chunk(self, process, array, flat, data: np.ndarray, crc_data=None, obj=0):
        objects = self.objects[process]
        while len(objects) <= obj:
            objects.append(bytearray())
        buf = objects[obj]
        offset = -(-len(buf) // ALIGN) * ALIGN
        buf.extend(bytes(offset - len(buf)))
        raw = np.ascontiguousarray(data).tobytes()
        buf.extend(raw)
        crc = crc32c.crc32c(raw if crc_data is None else np.ascontiguousarray(crc_data).tobytes())
        self.rows[process].append((array, flat, obj, offset, len(raw), crc))

    def pointer(self, holder, writer, array, flat):
        self.rows[holder].append((array, flat, -1 - writer, 0, 0, 0))

    def finish(self, leaves, tree, meshes=(), stacks=None):
        refs = []
        os.makedirs(os.path.join(self.root, GEN, "~data"), exist_ok=True)
        os.makedirs(os.path.join(self.root, GEN, "~index"), exist_ok=True)
        for p in range(self.processes):
            names = []
            for k, buf in enumerate(self.objects[p]):
                if not buf:
                    continue
                name = f"{GEN}~data/{p}.{k}"
                with open(os.path.join(self.root, name), "wb") as f:
                    f.write(buf)
                names.append((name, len(buf)))
            data = encode_index(p, names, _records(self.rows[p]))
            name = f"{GEN}~index/{p}"
            with open(os.path.join(self.root, name), "wb") as f:
                f.write(data)
            refs.append(IndexRef(p, name, len(data), crc32c.crc32c(data)))
        doc = {"format": "jax-ckpt", "format_version": 3, "library_version": "test", "created": 0.0,
               "tree": tree, "leaves": leaves, "user_metadata": None,
               "packed": packed_section(ALIGN, refs, meshes)}
        if stacks is not None:
            doc["stacks"] = stacks
        with open(os.path.join(self.root, "manifest.msgpack"), "wb") as f:
            f.write(_seal(doc))


def _zarr(path, chunk_shape, data_type, encoding="native", **extra):
    return {"type": "zarr", "path": GEN + path, "chunk_shape": list(chunk_shape), "data_type": data_type,
            "encoding": encoding, "checksum": "crc32c", "chunk_checksums": [], **extra}


def _named(sizes, names, spec, m):
    return {"kind": "named", "mesh": {"axis_names": list(names), "axis_sizes": list(sizes)}, "spec": spec,
            "mesh_processes": m}


def _hand_made(root):
    """Four processes on a 2x4 mesh ('data', 'model'), mesh position i on process i // 2:
    leaf 0 sharded over both axes (each chunk written by its holder), leaf 1 replicated over
    'data' (each chunk written by one holder, the other points to it), leaf 2 numpy written
    whole by process 3 (`writer`), leaf 3 bfloat16 with no mesh table (found by searching every
    index), leaf 4 a stack member, leaf 5 inline, leaf 6 a value."""
    values = {
        "w": np.arange(8 * 16, dtype=np.float32).reshape(8, 16) - 40,
        "rep": np.arange(4 * 12, dtype=np.int32).reshape(4, 12) * 3,
        "np": np.arange(2000, dtype=np.int16) - 1000,
        "bf": (np.arange(64, dtype=np.float32) / 4).astype(ml_dtypes.bfloat16).reshape(8, 8),
        "st": np.arange(6, dtype=np.float64) + 0.5,
        "small": np.array([1, 2, 3], np.uint8),
        "step": 12,
    }
    sizes, names = (2, 4), ("data", "model")
    mesh_procs = np.arange(8) // 2
    w = _Writer(root, 4)
    # leaf 0: spec (data, model), shard (4, 4), chunks (2, 4): grid (4, 4)
    for i, j in itertools.product(range(4), range(4)):
        holders = chunk_holders(sizes, mesh_procs, ["data", "model"], (8, 16), (2, 4), (i, j), axis_names=names)
        assert len(holders) == 1
        w.chunk(holders[0], 0, i * 4 + j, values["w"][2 * i:2 * i + 2, 4 * j:4 * j + 4], obj=j % 2)
    # leaf 1: spec (None, model): chunk j (4, 3) held by positions (0, j) and (1, j)
    for j in range(4):
        holders = chunk_holders(sizes, mesh_procs, [None, "model"], (4, 12), (4, 3), (0, j), axis_names=names)
        assert holders == (j // 2, 2 + j // 2)
        w.chunk(holders[1], 1, j, values["rep"][:, 3 * j:3 * j + 3])
        w.pointer(holders[0], holders[1], 1, j)
    # leaf 2: written whole by process 3
    w.chunk(3, 2, 0, values["np"])
    # leaf 3: bfloat16 bits, chunks (4, 8), on processes 1 and 2, no mesh table
    bits = values["bf"].view(np.uint16)
    w.chunk(1, 3, 0, bits[:4])
    w.chunk(2, 3, 1, bits[4:])
    # stack 0: members of shape (6,), chunks of 2 members, 3 members: last chunk partial,
    # stored whole (zeros beyond the stack), CRC of the part inside
    stack = np.stack([values["st"], values["st"] * 2, values["st"] * 3])
    w.chunk(0, -1, 0, stack[:2])
    w.chunk(0, -1, 1, np.concatenate([stack[2:], np.zeros((1, 6))]), crc_data=stack[2:])
    leaves = [
        {"path": "w", "kind": "jax.Array", "shape": [8, 16], "dtype": "float32",
         "sharding": _named(sizes, names, ["data", "model"], 0), "storage": _zarr("w", (2, 4), "float32")},
        {"path": "rep", "kind": "jax.Array", "shape": [4, 12], "dtype": "int32",
         "sharding": _named(sizes, names, [None, "model"], 0), "storage": _zarr("rep", (4, 3), "int32")},
        {"path": "np", "kind": "numpy.ndarray", "shape": [2000], "dtype": "int16", "sharding": None,
         "storage": _zarr("np", (2000,), "int16", writer=3)},
        {"path": "bf", "kind": "jax.Array", "shape": [8, 8], "dtype": "bfloat16", "sharding": {"kind": "other"},
         "storage": _zarr("bf", (4, 8), "uint16", "bits")},
        {"path": "st", "kind": "numpy.ndarray", "shape": [6], "dtype": "float64", "sharding": None,
         "storage": {"type": "stacked", "stack": 0, "index": 0}},
        {"path": "small", "kind": "numpy.ndarray", "shape": [3], "dtype": "uint8", "sharding": None,
         "storage": {"type": "inline", "data": values["small"].tobytes()}},
        {"path": "step", "kind": "int", "value": 12},
    ]
    stacks = [{"path": GEN + "~stacks/0", "shape": [3, 6], "dtype": "float64", "chunk_shape": [2, 6],
               "data_type": "float64", "encoding": "native", "checksum": "crc32c", "chunk_checksums": [], "writer": 0}]
    keys = ["w", "rep", "np", "bf", "st", "small", "step"]
    tree = {"kind": "dict", "keys": keys, "children": [{"kind": "leaf", "index": i} for i in range(len(keys))]}
    w.finish(leaves, tree, meshes=[(sizes, mesh_procs)], stacks=stacks)
    return values


def test_reference_reader_reads_a_hand_made_version_3_checkpoint(tmp_path):
    root = str(tmp_path / "v3")
    values = _hand_made(root)
    got = reference.read_checkpoint(root)
    assert list(got) == list(values)
    for k, want in values.items():
        if isinstance(want, np.ndarray):
            assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
            assert got[k].tobytes() == want.tobytes(), k
        else:
            assert got[k] == want
    assert not any(name.endswith("zarr.json") for _, _, files in os.walk(root) for name in files)


def _rewrite(path, change):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    change(data)
    with open(path, "wb") as f:
        f.write(data)


def _reseal(root, change):
    path = os.path.join(root, "manifest.msgpack")
    with open(path, "rb") as f:
        doc = msgpack.unpackb(f.read(), raw=False)
    doc.pop("manifest_crc32c")
    change(doc)
    with open(path, "wb") as f:
        f.write(_seal(doc))


def test_reference_reader_refuses_damage_in_a_version_3_checkpoint(tmp_path):
    import shutil

    good = str(tmp_path / "good")
    _hand_made(good)

    def damaged(name, change=None, reseal=None):
        root = str(tmp_path / name)
        shutil.copytree(good, root)
        if change is not None:
            _rewrite(os.path.join(root, change[0]), change[1])
        if reseal is not None:
            _reseal(root, reseal)
        return root

    def flip(offset):
        def change(data):
            data[offset] ^= 1
        return change

    # a chunk's bytes: its CRC-32C in the index no longer matches
    with pytest.raises(reference.FormatError, match=r"w: chunk \[0, 0\] .*does not match its CRC-32C"):
        reference.read_checkpoint(damaged("chunk", (GEN + "~data/0.0", flip(5))))
    # an index object: the manifest's CRC-32C of it no longer matches
    with pytest.raises(reference.FormatError, match=r"~index/2.*CRC-32C"):
        reference.read_checkpoint(damaged("index", (GEN + "~index/2", flip(40))))
    # a data object cut short
    with pytest.raises(reference.FormatError, match="~data/3.0"):
        reference.read_checkpoint(damaged("short", (GEN + "~data/3.0", lambda d: d.__delitem__(slice(-10, None)))))
    # the writer named wrongly: the chunk is not where the rule says
    with pytest.raises(reference.FormatError, match=r"np: chunk \[0\] is in no index object .*~index/1"):
        reference.read_checkpoint(damaged("writer", reseal=lambda d: d["leaves"][2]["storage"].update(writer=1)))
    # a mesh table that sends the reader to a process without the chunk
    bad_table = np.roll(np.arange(8) // 2, 2).astype("<u4").tobytes()
    with pytest.raises(reference.FormatError, match=r"w: chunk \[0, 0\] is in no index object"):
        reference.read_checkpoint(damaged("mesh", reseal=lambda d: d["packed"]["meshes"][0].update(processes=bad_table)))
    # an index object rewritten unsorted, with the manifest's figures of it updated to match
    root = damaged("unsorted")
    name = GEN + "~index/0"
    with open(os.path.join(root, name), "rb") as f:
        doc = msgpack.unpackb(f.read(), raw=False)
    doc["chunks"] = np.frombuffer(doc["chunks"], INDEX_DTYPE)[::-1].tobytes()
    data = msgpack.packb(doc, use_bin_type=True)
    with open(os.path.join(root, name), "wb") as f:
        f.write(data)
    _reseal(root, lambda d: d["packed"]["indexes"][0].update(size=len(data), crc32c=crc32c.crc32c(data)))
    with pytest.raises(reference.FormatError, match="~index/0: records not sorted"):
        reference.read_checkpoint(root)
    # newer versions are refused
    with pytest.raises(reference.FormatError, match="newer"):
        reference.read_checkpoint(damaged("newer", reseal=lambda d: d.update(format_version=4)))


def test_a_version_3_manifest_matches_the_json_schema(tmp_path):
    import json

    from test_format import (
        _errors,  # the schema subset validator of tests/test_format.py
    )

    root = str(tmp_path / "v3")
    _hand_made(root)
    with open(os.path.join(root, "manifest.msgpack"), "rb") as f:
        manifest = msgpack.unpackb(f.read(), raw=False)
    with open(os.path.join(FORMATS, "manifest.schema.json")) as f:
        schema = json.load(f)
    assert _errors(manifest, schema, schema) == []
    assert schema["if"]["properties"]["format_version"] == {"const": 3} and schema["then"] == {"required": ["packed"]}
    for breakage in [lambda m: m["packed"].pop("indexes"),
                     lambda m: m["packed"]["indexes"][0].update(crc32c=-1),
                     lambda m: m["packed"]["meshes"][0].update(processes="not bin"),
                     lambda m: m["leaves"][2]["storage"].update(writer=-1),
                     lambda m: m["leaves"][0]["sharding"].update(mesh_processes="0"),
                     lambda m: m.update(format_version=4)]:
        broken = msgpack.unpackb(msgpack.packb(manifest, use_bin_type=True), raw=False)
        breakage(broken)
        assert _errors(broken, schema, schema), breakage


@pytest.mark.parametrize("pack_limit", [0, None], ids=["chunk-per-shard", "stacks"])
def test_reference_reader_reads_what_a_packed_save_writes(tmp_path, pack_limit):
    """A save with layout="packed" (format version 3), read by the reference reader: the same
    values as ckpt.restore and as saved, and no Zarr file written."""
    from test_format import _assert_same_tree, _fresh_tree

    import ckpt

    root = str(tmp_path / "packed")
    options = ckpt.Options(layout="packed") if pack_limit is None else ckpt.Options(layout="packed", pack_limit_bytes=0)
    tree = _fresh_tree()
    # small arrays one process holds whole: stacked with the default pack limit; five of about
    # 1 MB make a stack of 4-member chunks (chunks near 4 MiB), the last one partial
    tree["small"] = [np.arange(250_000, dtype=np.float32) * (k + 1) for k in range(5)]
    ckpt.save(root, tree, options=options)
    with open(os.path.join(root, "manifest.msgpack"), "rb") as f:
        manifest = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    assert manifest["format_version"] == 3 and manifest["packed"]["indexes"]
    assert bool(manifest.get("stacks")) == (pack_limit is None)
    files = [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]
    assert not any(f.endswith("zarr.json") or "/c/" in f for f in files), files
    by_spec = reference.read_checkpoint(root)
    _assert_same_tree(by_spec, ckpt.restore(root))
    assert np.array_equal(by_spec["pair"]["first"], np.asarray(tree["pair"].first))
    assert np.array_equal(by_spec["grouped"], np.asarray(tree["grouped"]))
    assert np.array_equal(by_spec["keys"], np.asarray(jax.random.key_data(tree["keys"])))
    assert np.array_equal(by_spec["uint4"].astype(np.uint8), np.arange(8 * 1024).reshape(8, 1024) % 16)
    for k in range(5):
        assert np.array_equal(by_spec["small"][k], tree["small"][k])
    if pack_limit is None:
        (stack,) = [s for s in manifest["stacks"] if s["shape"] == [5, 250_000]]
        assert stack["chunk_shape"] == [4, 250_000]  # two chunks, the second holding one member


# ---- issue 36: checks before use, bounded memory, verify on every route --------------------------

GOLDEN_V3 = os.path.join(FORMATS, "golden", "v3", "checkpoint")


def _golden_copy(tmp_path):
    import shutil

    root = str(tmp_path / "golden")
    shutil.copytree(GOLDEN_V3, root)
    return root


def _verify_json(root):
    import contextlib
    import io
    import json

    from ckpt.cli._main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["verify", root, "--json", "--no-progress"])
    return rc, (json.loads(out.getvalue()) if out.getvalue().strip() else None), err.getvalue()


def test_verify_names_a_pointer_missing_on_another_process_route(tmp_path):
    """Process 1's index loses its pointer for a chunk process 1 held but process 0 wrote:
    process 0's restore reads the chunk fine, process 1's would not find it. Verify refuses,
    naming the leaf, the chunk and process 1's index; the reference reader refuses too."""
    root = _golden_copy(tmp_path)
    name = "~index/1"
    with open(os.path.join(root, name), "rb") as f:
        doc = msgpack.unpackb(f.read(), raw=False)
    rows = np.frombuffer(doc["chunks"], INDEX_DTYPE)
    keep = ~((rows["array"] == 22) & (rows["object"] < 0))  # quant/w_int4, chunk 0: a pointer to 0
    assert (~keep).sum() == 1
    doc["chunks"] = rows[keep].tobytes()
    data = msgpack.packb(doc, use_bin_type=True)
    with open(os.path.join(root, name), "wb") as f:
        f.write(data)
    _reseal(root, lambda d: d["packed"]["indexes"][1].update(size=len(data), crc32c=crc32c.crc32c(data)))
    import ckpt

    restored = ckpt.restore(root)  # process 0's route: intact
    assert restored["quant"]["w_int4"].shape == (64, 80)
    rc, report, _ = _verify_json(root)
    assert rc == 1 and report["intact"] is False
    (problem,) = [p for p in report["problems"] if "lacks it" in p["what"]]
    assert problem["leaf"] == "quant/w_int4" and problem["chunk"] == [0, 0] and problem["file"].endswith("~index/1")
    with pytest.raises(reference.FormatError, match=r"quant/w_int4: chunk \[0, 0\] .*~index/1"):
        reference.read_checkpoint(root)


def test_verify_refuses_a_longer_data_object_and_a_link_and_accepts_changed_padding(tmp_path):
    import shutil

    for how in ("longer", "link", "padding"):
        root = _golden_copy(tmp_path / how)
        path = os.path.join(root, "~data", "1.0")
        if how == "longer":
            with open(path, "ab") as f:
                f.write(b"\0")
        elif how == "link":
            shutil.move(path, path + "-moved")
            os.symlink("1.0-moved", path)
        else:  # process 1's chunks: 8192 + 12000 ends the last, 4736 + 768 = 5504 .. 8192 is padding
            _rewrite(path, lambda d: d.__setitem__(6000, 0x5A))
        rc, report, _ = _verify_json(root)
        if how == "padding":
            assert rc == 0 and report["intact"], report
            reference.read_checkpoint(root)
            continue
        assert rc == 1 and any(p["file"].endswith("~data/1.0") for p in report["problems"]), report
        with pytest.raises(reference.FormatError, match="1.0"):
            reference.read_checkpoint(root)


def test_a_claim_of_2_40_chunks_is_refused_before_anything_is_planned():
    from ckpt._restore import plan_leaf_read
    from ckpt._restore.plan import plan_budget

    with pytest.raises(CheckpointError, match="exceeds the host budget"):
        plan_leaf_read(0, (2**40,), (1,), 4, [((0, 2**40),)], budget=plan_budget(256 << 20))
    with pytest.raises(CheckpointError, match="exceeds the host budget"):
        plan_leaf_read(0, (2**24,), (1,), 4, [((0, 2**24),)], budget=plan_budget(256 << 20))
    # the plans of a tiny budget: 65,536 chunks within the 64 MiB allowance
    assert len(plan_leaf_read(0, (65536,), (1,), 4, [((0, 65536),)], budget=plan_budget(4096)).chunks) == 65536


def test_chunk_holders_keeps_one_table_per_spec_whatever_the_shapes():
    """A mesh table shared by leaves of many shapes is sorted once per spec (issue 36: it was
    copied per (spec, shape)), and the cache holds at most its byte limit."""
    from ckpt._format import packed

    table = (np.arange(1024 * 1024) % 4).astype(np.uint32)
    packed._CACHE.clear()
    packed._cached_bytes[0] = 0
    for k in range(1, 200):
        got = chunk_holders((1024, 1024), table, ("x", "y"), (1024 * k, 1024), (k, 1), (3, 5), axis_names=("x", "y"))
        assert got == (int(table[3 * 1024 + 5]),)
    assert len(packed._CACHE) == 1 and packed._cached_bytes[0] <= packed._CACHE_BYTES
