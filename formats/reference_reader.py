"""A jax-ckpt reader written from formats/SPEC.md alone: zarr-python, msgpack and numpy (with
ml_dtypes for bfloat16 and the other extended types). No jax-ckpt, JAX or TensorStore. Format
version 3 (section 13, the packed layout: no Zarr files) is read with msgpack and numpy alone.

    from reference_reader import read_checkpoint
    tree = read_checkpoint("/ckpts/step_00001000")   # dicts, lists, tuples, numpy arrays, values

tests/test_format.py checks that it returns what ``ckpt.restore(path)`` returns. Section numbers
below refer to SPEC.md.
"""

from __future__ import annotations

import math
import os

import ml_dtypes
import msgpack
import numpy as np

SUPPORTED_VERSION = 3
PACKED_VERSION = 3  # section 13: chunks in data objects, found through per-process index objects
VALUE_KINDS = {"int", "float", "bool", "complex", "str", "bytes"}
_ZARR_CORE = set(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 complex64 complex128".split()
)


class FormatError(Exception):
    pass


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C (section 8), bit by table; slow, for small checkpoints and for reference."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def logical_dtype(name: str) -> np.dtype:
    """Section 6: numpy names, else ml_dtypes names."""
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def storage_dtype(logical: np.dtype) -> tuple[np.dtype, str]:
    """(storage dtype, encoding) of a logical dtype, by the rule of section 6."""
    if logical.name in _ZARR_CORE:
        return logical, "native"
    try:
        signed = ml_dtypes.iinfo(logical).min < 0
        return np.dtype(np.int8 if signed else np.uint8), "values"
    except (ValueError, TypeError):
        return np.dtype(f"uint{8 * logical.itemsize}"), "bits"


def decode(stored: np.ndarray, logical: np.dtype, encoding: str) -> np.ndarray:
    if encoding == "bits":
        return stored.view(logical)
    if encoding == "values":
        return stored.astype(logical)
    return stored


def _value(leaf: dict):
    """Section 5.2."""
    kind, v = leaf["kind"], leaf["value"]
    if kind == "int":
        return int(v)  # decimal text beyond the msgpack integer range
    if kind == "complex":
        return complex(v[0], v[1])
    return v


def _check_chunks(root: str, name: str, st: dict, shape: list[int], sdtype: np.dtype) -> None:
    """Section 8: every chunk file of the Zarr array `st` describes (a leaf's zarr storage, or a
    stack) exists, has the right size and its recorded CRC-32C; `name` is for messages."""
    chunk_shape = st["chunk_shape"]
    grid = [math.ceil(n / c) for n, c in zip(shape, chunk_shape)]
    size = math.prod(chunk_shape) * sdtype.itemsize
    for flat, index in enumerate(np.ndindex(*grid)):  # row-major, like the recorded list
        path = os.path.join(root, st["path"], "c", *map(str, index))
        if not os.path.lexists(path):
            raise FormatError(f"{name}: chunk {list(index)} is missing ({path})")
        data = _read_file(path)
        if len(data) != size:
            raise FormatError(f"{name}: chunk {list(index)} has {len(data)} bytes, expected {size}")
        inside = [min(c, n - i * c) for i, c, n in zip(index, chunk_shape, shape)]
        if inside != list(chunk_shape):  # a partial edge chunk: only the part inside counts
            part = np.frombuffer(data, sdtype.newbyteorder("<")).reshape(chunk_shape)
            data = np.ascontiguousarray(part[tuple(slice(0, k) for k in inside)]).tobytes()
        if crc32c(data) != st["chunk_checksums"][flat]:
            raise FormatError(f"{name}: chunk {list(index)} does not match its CRC-32C")


def _array(root: str, leaf: dict, check: bool, stacks: list, checked: set):
    """Sections 5.1, 6, 7 (7.1: stacks, whose chunks are checked once, `checked` holding those
    done)."""
    logical = logical_dtype(leaf["dtype"])
    sdtype, encoding = storage_dtype(logical)
    shape = list(leaf["shape"])
    st = leaf["storage"]
    if st["type"] in ("zarr", "stacked"):
        import zarr  # (versions 1 and 2 only: version 3 has no Zarr files)
    if st["type"] == "inline":
        stored = np.frombuffer(st["data"], dtype=sdtype.newbyteorder("<")).reshape(shape).astype(sdtype)
    elif st["type"] == "zarr":
        if st["data_type"] != sdtype.name or st["encoding"] != encoding:
            raise FormatError(f"{leaf['path']}: storage {st['data_type']}/{st['encoding']} does not match {logical}")
        if check:
            _check_chunks(root, leaf["path"], st, shape, sdtype)
        arr = zarr.open_array(os.path.join(root, st["path"]), mode="r")
        if list(arr.shape) != shape or np.dtype(arr.dtype) != sdtype:
            raise FormatError(f"{leaf['path']}: zarr.json says {arr.shape} {arr.dtype}")
        stored = np.asarray(arr[...])
    elif st["type"] == "stacked":
        stack = stacks[st["stack"]]
        if stack["dtype"] != leaf["dtype"] or list(stack["shape"][1:]) != shape:
            raise FormatError(f"{leaf['path']}: stack {st['stack']} holds {stack['dtype']} {stack['shape'][1:]}")
        if stack["data_type"] != sdtype.name or stack["encoding"] != encoding:
            raise FormatError(f"stack {st['stack']}: storage {stack['data_type']}/{stack['encoding']} does not match {logical}")
        if check and st["stack"] not in checked:
            _check_chunks(root, f"stack {st['stack']}", stack, list(stack["shape"]), sdtype)
            checked.add(st["stack"])
        arr = zarr.open_array(os.path.join(root, stack["path"]), mode="r")
        if list(arr.shape) != list(stack["shape"]) or np.dtype(arr.dtype) != sdtype:
            raise FormatError(f"stack {st['stack']}: zarr.json says {arr.shape} {arr.dtype}")
        stored = np.asarray(arr[st["index"]])
    else:
        raise FormatError(f"{leaf['path']}: unknown storage type {st['type']!r}")
    value = decode(stored, logical, encoding)
    if leaf["kind"] == "numpy.scalar":
        return value[()]
    return value  # prng_key: the key data; jax.random.wrap_key_data(value, impl=leaf["prng_impl"])


def _tree(node: dict, values: list):
    """Section 4."""
    kind = node["kind"]
    if kind == "leaf":
        return values[node["index"]]
    if kind == "none":
        return None
    children = [_tree(c, values) for c in node["children"]]
    if kind == "dict":
        return dict(zip(node["keys"], children))
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    if kind == "custom":
        keys = node["keys"]
        if keys and all(entry != "index" for entry, _ in keys):
            return {name: c for (_, name), c in zip(keys, children)}
        return tuple(children)
    raise FormatError(f"unknown tree node kind {kind!r}")


def _read_file(path: str) -> bytes:
    """A regular file inside the checkpoint, reached through no symbolic link (section 9)."""
    if os.path.islink(path) or not os.path.isfile(path):
        raise FormatError(f"{path} is missing, a link or not a regular file")
    with open(path, "rb") as f:
        return f.read()


def _check_seal(data: bytes, manifest: dict, path: str) -> None:
    """Section 8.1: a manifest whose last entry is a 4-byte bin must end with the
    ``manifest_crc32c`` entry holding the CRC-32C of the bytes before it."""
    key, value = list(manifest.items())[-1] if manifest else (None, None)
    if "manifest_crc32c" not in manifest and not (isinstance(value, bytes) and len(value) == 4):
        return  # written before manifests carried a checksum
    trailer = msgpack.packb("manifest_crc32c") + b"\xc4\x04"
    if key != "manifest_crc32c" or data[-len(trailer) - 4:-4] != trailer:
        raise FormatError(f"{path}: malformed manifest_crc32c entry")
    if crc32c(data[:-4]) != int.from_bytes(data[-4:], "big"):
        raise FormatError(f"{path}: the manifest does not match its CRC-32C")


def _check_zarr_json(root: str, manifest: dict) -> None:
    """Section 8.2: every zarr.json the manifest records a CRC-32C for."""
    for key, crc in manifest.get("zarr_json_crc32c", {}).items():
        if crc32c(_read_file(os.path.join(root, key))) != crc:
            raise FormatError(f"{key} does not match the CRC-32C the manifest records")


def read_manifest(root: str) -> dict:
    """Sections 3, 8.1, 9 and 11."""
    if ".tmp-" in os.path.basename(os.path.normpath(root)) or ".tmp-" in os.path.basename(os.path.realpath(root)):
        raise FormatError(f"{root} is an uncommitted save")
    path = os.path.join(root, "manifest.msgpack")
    if not os.path.lexists(path):
        raise FormatError(f"{root} is not a committed checkpoint")
    data = _read_file(path)
    manifest = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(manifest, dict) or manifest.get("format") != "jax-ckpt":
        raise FormatError(f"{path} is not a jax-ckpt manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise FormatError(f"{path}: invalid format_version {version!r}")
    if version > SUPPORTED_VERSION:
        raise FormatError(f"{path}: format_version {version} is newer than this reader ({SUPPORTED_VERSION})")
    _check_seal(data, manifest, path)
    return manifest


# ---- version 3, the packed layout (section 13) ----------------------------------------------

MAX_MESH_DEVICES = 1 << 20  # 13.4: a larger mesh table is refused
INDEX_RECORD = np.dtype([("array", "<i4"), ("chunk", "<i8"), ("object", "<i4"),
                         ("offset", "<u8"), ("length", "<u8"), ("crc32c", "<u4")])  # 36 bytes


def _inside(name, what: str) -> str:
    """Section 2: a relative path that cannot leave the checkpoint."""
    parts = name.split("/") if isinstance(name, str) and name else [""]
    if any(p in ("", ".", "..") or p.startswith(".") or "\\" in p or "\0" in p for p in parts):
        raise FormatError(f"{what} {name!r} is not a path inside the checkpoint")
    return name


def _no_link(root: str, name: str) -> str:
    """The path of `name` below `root`, a regular file reached through no symbolic link (13.8)."""
    path = root
    for part in name.split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            raise FormatError(f"{path} is a symbolic link")
    if not os.path.isfile(path):
        raise FormatError(f"{path} is missing or not a regular file")
    return path


def _read_range(path: str, size: int, offset: int, length: int) -> bytes:
    """`length` bytes at `offset` of a regular file (no link) of exactly `size` bytes."""
    if os.path.islink(path) or not os.path.isfile(path):
        raise FormatError(f"{path} is missing, a link or not a regular file")
    if os.path.getsize(path) != size:
        raise FormatError(f"{path} has {os.path.getsize(path)} bytes, its index records {size}")
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _step(length: int, align: int) -> int:
    """13.2: a chunk of at least `align` bytes starts at a multiple of `align`, a smaller one at a
    multiple of 64."""
    return align if length >= align else min(align, 64)


class Packed:
    """Section 13: every process's index object, loaded and checked (a reference reader may load
    them all; a reader of a large checkpoint reads only those the lookup rule names), and each
    chunk found by the lookup rule (13.4), read from its data object and checked."""

    def __init__(self, root: str, manifest: dict):
        section = manifest.get("packed")
        if not isinstance(section, dict):
            raise FormatError(f"{root}: a version-3 manifest without a 'packed' section")
        self.root, self.align = root, section["align"]
        if self.align != 4096:
            raise FormatError(f"{root}: packed.align is {self.align!r}, not 4096 (13.4)")
        self.meshes = [(list(m["axis_sizes"]), np.frombuffer(m["processes"], "<u4")) for m in section["meshes"]]
        for sizes, procs in self.meshes:
            if math.prod(sizes) > MAX_MESH_DEVICES or len(procs) != math.prod(sizes) or \
                    any(int(p) >= len(section["indexes"]) for p in set(procs.tolist())):
                raise FormatError(f"{root}: mesh {sizes} is larger than {MAX_MESH_DEVICES} devices, or its "
                                  "table does not name one process of the save per device (13.4)")
        self.indexes = [self._load(p, ref, len(section["indexes"])) for p, ref in enumerate(section["indexes"])]
        self.stacks: dict = {}

    def _load(self, p: int, ref: dict, processes: int) -> tuple:
        """(name, objects [(name, size)], {(array, chunk): (object, offset, length, crc32c)}),
        checked by the rules of 13.3."""
        name = _inside(ref["name"], "index object")
        data = _read_file(os.path.join(self.root, name))
        if ref["process"] != p or len(data) != ref["size"] or crc32c(data) != ref["crc32c"]:
            raise FormatError(f"{name}: index object of process {p} does not match the size and CRC-32C "
                              "the manifest records")
        doc = msgpack.unpackb(data, raw=False)
        if not isinstance(doc, dict) or doc.get("format") != "jax-ckpt-index" or doc.get("process") != p:
            raise FormatError(f"{name}: not the jax-ckpt-index object of process {p}")
        objects = [(_inside(o["name"], f"{name}: data object"), o["size"]) for o in doc["objects"]]
        if len({o for o, _ in objects}) != len(objects) or any(o == "manifest.msgpack" for o, _ in objects):
            raise FormatError(f"{name}: names a data object twice, or the manifest")
        if len(doc["chunks"]) % INDEX_RECORD.itemsize:
            raise FormatError(f"{name}: 'chunks' is not a whole number of records")
        records = np.frombuffer(doc["chunks"], INDEX_RECORD).tolist()
        keys = [(array, chunk) for array, chunk, *_ in records]
        if keys != sorted(set(keys)):
            raise FormatError(f"{name}: records not sorted by (array, chunk), or one recorded twice")
        for a, c, obj, offset, length, crc in records:
            if c < 0 or obj >= len(objects):
                raise FormatError(f"{name}: record ({a}, {c}) names no chunk or no data object")
            if obj < 0 and (-1 - obj >= processes or -1 - obj == p or (offset, length, crc) != (0, 0, 0)):
                raise FormatError(f"{name}: record ({a}, {c}) is not a pointer to another process of the save")
            if obj >= 0 and (offset % _step(length, self.align) or offset + length > objects[obj][1]):
                raise FormatError(f"{name}: record ({a}, {c}) is not aligned or ends beyond its data object")
        return name, objects, {(a, c): tuple(rest) for a, c, *rest in records}

    def check_structure(self, manifest: dict) -> None:
        """The rules of 13.8 that hold the checkpoint together before a chunk is read: every chunk
        placed once; data objects of their sizes, ending at their last chunk, reached through no
        link, each named by one index; no two places overlapping; pointers and every process's
        route leading to the place; the manifest's places those of the index."""
        arrays = {i: (leaf["storage"], leaf.get("sharding"), list(leaf["shape"]), leaf["dtype"])
                  for i, leaf in enumerate(manifest["leaves"]) if leaf.get("storage", {}).get("type") == "zarr"}
        names = {i: manifest["leaves"][i]["path"] for i in arrays}
        for s, stack in enumerate(manifest.get("stacks") or []):
            arrays[-1 - s] = (stack, None, list(stack["shape"]), stack["dtype"])
            names[-1 - s] = f"stack {s}"
        grids = {a: [math.ceil(n / c) for n, c in zip(shape, st["chunk_shape"])] for a, (st, _, shape, _) in arrays.items()}
        for a, (st, sharding, _, _) in arrays.items():  # 13.4: writers and meshes of the save
            writer = st.get("writer")  # (nil: no writer recorded)
            if writer is not None and not (type(writer) is int and 0 <= writer < len(self.indexes)):
                raise FormatError(f"{names[a]}: writer {writer!r} is not a process of the save")
            if not (isinstance(sharding, dict) and sharding.get("kind") == "named" and "mesh_processes" in sharding):
                continue
            m = sharding["mesh_processes"]  # (present: an int, a mesh of the sharding's axis sizes)
            if not (type(m) is int and 0 <= m < len(self.meshes)
                    and list(self.meshes[m][0]) == list(sharding["mesh"]["axis_sizes"])):
                raise FormatError(f"{names[a]}: mesh_processes {m!r} is not a mesh of the sharding's axis sizes")
        placed, extents, owners = {}, [], {}
        index_names = {n for n, _, _ in self.indexes}
        for p, (iname, objects, records) in enumerate(self.indexes):
            for oname, size in objects:
                if oname in owners or oname in index_names:
                    raise FormatError(f"{oname}: named by two index objects, or an index object")
                owners[oname] = p
                path = _no_link(self.root, oname)
                if os.path.getsize(path) != size:
                    raise FormatError(f"{path} has {os.path.getsize(path)} bytes, {iname} records {size}")
                ends = [off + ln for (obj, off, ln, _) in records.values() if obj >= 0 and objects[obj][0] == oname]
                if not ends or max(ends) != size:
                    raise FormatError(f"{oname}: holds no chunk, or does not end where its last chunk ends ({iname})")
            for (a, c), (obj, off, ln, crc) in records.items():
                if a not in arrays or c >= math.prod(grids[a]):
                    raise FormatError(f"{iname}: records chunk {c} of array {a}, which the manifest does not have")
                if obj < 0:
                    continue
                st, _, _, dtype = arrays[a]
                if ln != math.prod(st["chunk_shape"]) * storage_dtype(logical_dtype(dtype))[0].itemsize:
                    raise FormatError(f"{iname}: chunk {c} of array {a} has the wrong length")
                if (a, c) in placed:
                    raise FormatError(f"{iname}: chunk {c} of array {a} is placed twice")
                placed[(a, c)] = (p, objects[obj][0], off, ln, crc)
                extents.append((objects[obj][0], off, ln))
        extents.sort()
        for (n0, o0, l0), (n1, o1, _) in zip(extents, extents[1:]):
            if n0 == n1 and o1 < o0 + l0:
                raise FormatError(f"{n1}: two chunks overlap at byte {o1}")
        total = sum(math.prod(g) for g in grids.values())
        if total > len(placed):
            raise FormatError(f"{self.root}: the manifest's arrays have {total} chunks, the index objects place "
                              f"{len(placed)}")
        for p, (iname, _, records) in enumerate(self.indexes):
            for (a, c), (obj, *_) in records.items():
                if obj < 0 and placed.get((a, c), (None,))[0] != -1 - obj:
                    raise FormatError(f"{iname}: chunk {c} of array {a} points to an index that does not place it")
        for a, (st, sharding, shape, _) in arrays.items():
            for flat, index in enumerate(np.ndindex(*grids[a])):
                self._check_chunk(names[a], a, flat, index, st, sharding, shape, placed)

    def _check_chunk(self, what: str, a: int, flat: int, index: tuple, st: dict, sharding, shape: list,
                     placed: dict) -> None:
        """One chunk: placed, as the manifest's places say, and in the index of every process a
        restore's lookup (13.5 rules 1, 2) reads for it."""
        place = placed.get((a, flat))
        if place is None:
            raise FormatError(f"{what}: chunk {list(index)} is placed by no index object")
        if st.get("places") is not None and list(st["places"][flat]) != list(place[1:]):
            raise FormatError(f"{what}: chunk {list(index)}: the manifest's place is not the index's")
        if st.get("writer") is not None:
            routes = [st["writer"]]
        elif isinstance(sharding, dict) and sharding.get("kind") == "named" and "mesh_processes" in sharding:
            routes = self._holders(sharding, shape, st["chunk_shape"], index)
        else:
            routes = []
        for p in routes:
            if (a, flat) not in self.indexes[p][2]:
                raise FormatError(f"{what}: chunk {list(index)} is in no index object where section 13.5 says "
                                  f"({self.indexes[p][0]}, read by the restore of process {p} or of another)")

    def _holders(self, sharding: dict, shape: list, chunk_shape: list, index: tuple) -> list:
        """13.4 rule 2: the processes whose devices held the shard containing the chunk."""
        sizes, procs = self.meshes[sharding["mesh_processes"]]
        names = sharding["mesh"]["axis_names"]
        size_of = dict(zip(names, sizes))
        spec = list(sharding["spec"]) + [None] * (len(shape) - len(sharding["spec"]))
        held = set()
        for pos, coord in enumerate(np.ndindex(*sizes)):  # row-major mesh positions
            at = dict(zip(names, coord))
            for d, entry in enumerate(spec):
                axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
                k, parts = 0, 1
                for a in axes:
                    k, parts = k * size_of[a] + at[a], parts * size_of[a]
                step = shape[d] // parts
                lo = index[d] * chunk_shape[d]
                if not k * step <= lo < min(lo + chunk_shape[d], shape[d]) <= (k + 1) * step:
                    break
            else:
                held.add(int(procs[pos]))
        return sorted(held)

    def _locate(self, what: str, array: int, flat: int, index: tuple, st: dict, sharding, shape: list):
        """13.4: (process, record) of the index entry that locates the chunk."""
        if st.get("writer") is not None:
            candidates = [st["writer"]]
        elif isinstance(sharding, dict) and sharding.get("kind") == "named" and "mesh_processes" in sharding:
            candidates = self._holders(sharding, shape, st["chunk_shape"], index)[:1]
        else:
            candidates = range(len(self.indexes))
        for p in candidates:
            rec = self.indexes[p][2].get((array, flat))
            if rec is None:
                continue
            if rec[0] < 0:  # a pointer: process -1 - object wrote it
                q = -1 - rec[0]
                rec = self.indexes[q][2].get((array, flat)) if q < len(self.indexes) else None
                if rec is None or rec[0] < 0:
                    raise FormatError(f"{what}: chunk {list(index)}: {self.indexes[p][0]} points to process {q}, "
                                      "whose index does not locate it")
                p = q
            return p, rec
        raise FormatError(f"{what}: chunk {list(index)} is in no index object where section 13.4 says "
                          f"({', '.join(self.indexes[p][0] for p in candidates)})")

    def array(self, what: str, array: int, st: dict, sharding, shape: list, sdtype: np.dtype, check: bool):
        """The stored array (storage dtype) of a leaf's zarr record or a stack, chunk by chunk."""
        chunk_shape = st["chunk_shape"]
        grid = [math.ceil(n / c) for n, c in zip(shape, chunk_shape)]
        out = np.empty(shape, sdtype)
        for flat, index in enumerate(np.ndindex(*grid)):
            p, (obj, offset, length, crc) = self._locate(what, array, flat, index, st, sharding, shape)
            index_name, objects, _ = self.indexes[p]
            if obj >= len(objects) or length != math.prod(chunk_shape) * sdtype.itemsize or offset % (self.align if length >= self.align else min(self.align, 64)):
                raise FormatError(f"{what}: chunk {list(index)}: {index_name} records {length} bytes at {offset} "
                                  f"of object {obj}")
            name, size = objects[obj]
            places = st.get("places")
            if places is not None and list(places[flat]) != [name, offset, length, crc]:
                # 13.4: a reader may use the places or the index; both must say the same
                raise FormatError(f"{what}: chunk {list(index)}: the manifest's place {places[flat]} is not "
                                  f"{index_name}'s record {[name, offset, length, crc]}")
            data = _read_range(os.path.join(self.root, name), size, offset, length)
            if len(data) != length:
                raise FormatError(f"{what}: chunk {list(index)} lies beyond the end of {name}")
            chunk = np.frombuffer(data, sdtype.newbyteorder("<")).reshape(chunk_shape)
            box = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(index, chunk_shape, shape))
            part = chunk[tuple(slice(0, b.stop - b.start) for b in box)]  # a partial edge chunk: the part inside
            if check and crc32c(np.ascontiguousarray(part).tobytes()) != crc:
                raise FormatError(f"{what}: chunk {list(index)} ({name} at {offset}) does not match its CRC-32C")
            out[box] = part
        return out

    def leaf(self, i: int, leaf: dict, stacks: list, check: bool):
        """Leaf `i` of a version-3 manifest: section 5.1, with zarr and stacked storage in data
        objects (inline as before)."""
        st = leaf["storage"]
        if st["type"] not in ("zarr", "stacked"):
            return _array(self.root, leaf, check, stacks, set())
        logical = logical_dtype(leaf["dtype"])
        sdtype, encoding = storage_dtype(logical)
        shape = list(leaf["shape"])
        if st["type"] == "zarr":
            if st["data_type"] != sdtype.name or st["encoding"] != encoding:
                raise FormatError(f"{leaf['path']}: storage {st['data_type']}/{st['encoding']} does not match {logical}")
            stored = self.array(leaf["path"], i, st, leaf["sharding"], shape, sdtype, check)
        else:
            s = st["stack"]
            stack = stacks[s]
            if stack["dtype"] != leaf["dtype"] or list(stack["shape"][1:]) != shape:
                raise FormatError(f"{leaf['path']}: stack {s} holds {stack['dtype']} {stack['shape'][1:]}")
            if s not in self.stacks:
                self.stacks[s] = self.array(f"stack {s}", -1 - s, stack, None, list(stack["shape"]), sdtype, check)
            stored = self.stacks[s][st["index"]]
        value = decode(stored, logical, encoding)
        return value[()] if leaf["kind"] == "numpy.scalar" else value


def read_leaves(root: str, check: bool = True) -> list:
    """Every leaf's value, by leaf index."""
    manifest = read_manifest(root)
    if check:
        _check_zarr_json(root, manifest)
    stacks = manifest.get("stacks", []) if manifest["format_version"] >= 2 else []
    if manifest["format_version"] >= PACKED_VERSION:
        packed = Packed(root, manifest)
        packed.check_structure(manifest)
        return [_value(leaf) if leaf["kind"] in VALUE_KINDS else packed.leaf(i, leaf, stacks, check)
                for i, leaf in enumerate(manifest["leaves"])]
    checked: set = set()
    return [_value(leaf) if leaf["kind"] in VALUE_KINDS else _array(root, leaf, check, stacks, checked)
            for leaf in manifest["leaves"]]


def read_checkpoint(root: str, check: bool = True):
    """The saved tree as dicts, lists, tuples, numpy arrays and Python values."""
    return _tree(read_manifest(root)["tree"], read_leaves(root, check))
