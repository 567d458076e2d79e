"""Logical dtypes (what JAX holds) and storage dtypes (what the Zarr array declares).

Zarr v3's core data types are stored natively. Every other dtype JAX has is stored in a type
both zarr-python and TensorStore open, with the logical dtype recorded beside it:
- sub-byte integers (int2, int4, uint2, uint4) as int8/uint8 *values*;
- every other extended float (bfloat16, the float8 and float4 types) as the unsigned integer of
  the same width holding the *bits*, so no precision is lost and nothing is converted.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

_ZARR_CORE = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 "
    "float16 float32 float64 complex64 complex128".split()
)

BITS, VALUES, NATIVE = "bits", "values", "native"

# Every logical dtype the library writes, and so the only dtype names a manifest may hold
# (formats/SPEC.md section 6): the Zarr core types plus the ml_dtypes types. Anything else
# (object, str, datetime, structured, void, longdouble...) is refused on save and on read.
STORABLE = _ZARR_CORE | frozenset(
    name for name in dir(ml_dtypes)
    if not name.startswith("_") and isinstance(getattr(ml_dtypes, name), type)
    and issubclass(getattr(ml_dtypes, name), np.generic) and np.dtype(getattr(ml_dtypes, name)).name == name
)


# Cached (bounded): called for every leaf of every save and restore, and numpy's dtype names are
# computed in Python; trees of thousands of leaves use a handful of dtypes.
@functools.lru_cache(maxsize=1024)
def dtype_from_name(name: str) -> np.dtype:
    """np.dtype for a name such as 'float32' or 'bfloat16' (ml_dtypes names included)."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        return np.dtype(getattr(ml_dtypes, name))
    except AttributeError:
        raise TypeError(f"unknown dtype {name!r}") from None


@functools.lru_cache(maxsize=1024)
def storage_of(logical: np.dtype) -> tuple[np.dtype, str]:
    """(storage dtype, encoding) for a logical dtype; TypeError for a dtype outside STORABLE."""
    logical = np.dtype(logical)
    if logical.name not in STORABLE:
        raise TypeError(f"cannot store dtype {logical.name}")
    if logical.name in _ZARR_CORE:
        return logical, NATIVE
    try:
        info = ml_dtypes.iinfo(logical)
    except (ValueError, TypeError):
        info = None
    if info is not None:
        return np.dtype(np.int8 if info.min < 0 else np.uint8), VALUES
    if logical.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"cannot store dtype {logical.name}")
    return np.dtype(f"uint{8 * logical.itemsize}"), BITS


def to_storage(a: np.ndarray) -> np.ndarray:
    """The array as its storage dtype, little-endian and C-contiguous (a view where possible)."""
    storage, encoding = storage_of(a.dtype)
    if encoding == BITS:
        a = a.view(storage)
    elif encoding == VALUES:
        a = a.astype(storage)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    # ascontiguousarray turns a 0-d array into shape (1,); the reshape keeps the shape.
    return np.ascontiguousarray(a).reshape(a.shape)


def from_storage(a: np.ndarray, logical: np.dtype) -> np.ndarray:
    """Inverse of to_storage."""
    logical = np.dtype(logical)
    _, encoding = storage_of(logical)
    if encoding == BITS:
        return a.view(logical)
    if encoding == VALUES:
        return a.astype(logical)
    return a
