"""A jax-ckpt reader written from formats/SPEC.md alone: zarr-python, msgpack and numpy (with
ml_dtypes for bfloat16 and the other extended types). No jax-ckpt, JAX or TensorStore.

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
import zarr

SUPPORTED_VERSION = 2
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


def read_leaves(root: str, check: bool = True) -> list:
    """Every leaf's value, by leaf index."""
    manifest = read_manifest(root)
    if check:
        _check_zarr_json(root, manifest)
    stacks = manifest.get("stacks", []) if manifest["format_version"] >= 2 else []
    checked: set = set()
    return [_value(leaf) if leaf["kind"] in VALUE_KINDS else _array(root, leaf, check, stacks, checked)
            for leaf in manifest["leaves"]]


def read_checkpoint(root: str, check: bool = True):
    """The saved tree as dicts, lists, tuples, numpy arrays and Python values."""
    return _tree(read_manifest(root)["tree"], read_leaves(root, check))
