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

SUPPORTED_VERSION = 1
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


def _check_chunks(root: str, leaf: dict, shape: list[int], sdtype: np.dtype) -> None:
    """Section 8: every chunk file exists, has the right size and its recorded CRC-32C."""
    st = leaf["storage"]
    chunk_shape = st["chunk_shape"]
    grid = [math.ceil(n / c) for n, c in zip(shape, chunk_shape)]
    size = math.prod(chunk_shape) * sdtype.itemsize
    for flat, index in enumerate(np.ndindex(*grid)):  # row-major, like the recorded list
        path = os.path.join(root, st["path"], "c", *map(str, index))
        if not os.path.isfile(path):
            raise FormatError(f"{leaf['path']}: chunk {list(index)} is missing ({path})")
        with open(path, "rb") as f:
            data = f.read()
        if len(data) != size:
            raise FormatError(f"{leaf['path']}: chunk {list(index)} has {len(data)} bytes, expected {size}")
        inside = [min(c, n - i * c) for i, c, n in zip(index, chunk_shape, shape)]
        if inside != list(chunk_shape):  # a partial edge chunk: only the part inside counts
            part = np.frombuffer(data, sdtype.newbyteorder("<")).reshape(chunk_shape)
            data = np.ascontiguousarray(part[tuple(slice(0, k) for k in inside)]).tobytes()
        if crc32c(data) != st["chunk_checksums"][flat]:
            raise FormatError(f"{leaf['path']}: chunk {list(index)} does not match its CRC-32C")


def _array(root: str, leaf: dict, check: bool):
    """Sections 5.1, 6, 7."""
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
            _check_chunks(root, leaf, shape, sdtype)
        arr = zarr.open_array(os.path.join(root, st["path"]), mode="r")
        if list(arr.shape) != shape or np.dtype(arr.dtype) != sdtype:
            raise FormatError(f"{leaf['path']}: zarr.json says {arr.shape} {arr.dtype}")
        stored = np.asarray(arr[...])
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


def read_manifest(root: str) -> dict:
    """Sections 3, 9 and 11."""
    if ".tmp-" in os.path.basename(os.path.normpath(root)):
        raise FormatError(f"{root} is an uncommitted save")
    path = os.path.join(root, "manifest.msgpack")
    if not os.path.isfile(path):
        raise FormatError(f"{root} is not a committed checkpoint")
    with open(path, "rb") as f:
        manifest = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    if not isinstance(manifest, dict) or manifest.get("format") != "jax-ckpt":
        raise FormatError(f"{path} is not a jax-ckpt manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise FormatError(f"{path}: invalid format_version {version!r}")
    if version > SUPPORTED_VERSION:
        raise FormatError(f"{path}: format_version {version} is newer than this reader ({SUPPORTED_VERSION})")
    return manifest


def read_leaves(root: str, check: bool = True) -> list:
    """Every leaf's value, by leaf index."""
    manifest = read_manifest(root)
    return [_value(leaf) if leaf["kind"] in VALUE_KINDS else _array(root, leaf, check) for leaf in manifest["leaves"]]


def read_checkpoint(root: str, check: bool = True):
    """The saved tree as dicts, lists, tuples, numpy arrays and Python values."""
    return _tree(read_manifest(root)["tree"], read_leaves(root, check))
