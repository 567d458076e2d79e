"""The manifest: one msgpack map at <checkpoint>/manifest.msgpack, written last.

Its presence is what makes a directory a committed checkpoint. formats/SPEC.md describes every
field; formats/manifest.schema.json is the same as a JSON Schema. msgpack only: no pickle,
nothing executable, and any language can read it.

The manifest protects itself: its last entry, ``manifest_crc32c``, is the CRC-32C of every byte
of the file before that CRC (SPEC section 8), and ``zarr_json_crc32c`` records the CRC-32C of
every ``zarr.json`` the checkpoint holds. A damaged manifest is an error naming the file, never
different data; a decoded manifest is validated (``_manifest_check``) before anything uses it.

A record says how its leaf's chunks are encoded, so a chunk's encoding lives here too (section
"A chunk's encoding" below; formats/SPEC.md sections 6 and 8): the storage dtype of every logical
dtype, the Zarr v3 metadata that declares it (the arrays' zarr.json), and the CRC-32C every chunk
is checked against.

Dtypes. Zarr v3's core data types are stored natively. Every other dtype JAX has is stored in a
type both zarr-python and TensorStore open, with the logical dtype recorded beside it:
- sub-byte integers (int2, int4, uint2, uint4) as int8/uint8 *values*;
- every other extended float (bfloat16, the float8 and float4 types) as the unsigned integer of
  the same width holding the *bits*, so no precision is lost and nothing is converted.

Checksums: CRC-32C (Castagnoli) of a chunk file's bytes. Chosen by measurement (bench/,
docs/design.md): hardware CRC-32C runs at ~15 GiB/s per core here and releases the GIL, so
checking every chunk costs a few percent of a disk-bound restore. It is also the checksum S3,
GCS and Zarr's own crc32c codec use, so anyone can check a chunk file with stock tools.
Computing it on the host copy at save time costs no extra read.

Size: the manifest's records and the encoding of the chunks they describe (storage dtypes,
zarr.json, CRC-32C) are one part of the on-disk contract (formats/SPEC.md sections 4-8).
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import crc32c
import ml_dtypes
import msgpack
import numpy as np

from ckpt._errors import CheckpointError

# ---- a chunk's encoding ----------------------------------------------------------------

# Dtypes

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


# Zarr v3 metadata

import numpy as np

GROUP_METADATA = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: np.dtype  # storage dtype
    attributes: dict = field(default_factory=dict)


def _fill_value(dtype: np.dtype):
    if dtype == np.bool_:
        return False
    if dtype.kind == "c":
        return [0.0, 0.0]
    return 0


def zarr_metadata(spec: ArraySpec) -> dict:
    """The array's Zarr v3 metadata (its zarr.json): uncompressed little-endian chunks."""
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(spec.shape),
        "data_type": spec.dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(spec.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": _fill_value(spec.dtype),
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "attributes": spec.attributes,
    }


def array_metadata_bytes(spec: ArraySpec) -> bytes:
    """The bytes of the array's zarr.json, as ``Storage.create_array`` writes them (the manifest
    records their CRC-32C)."""
    return json.dumps(zarr_metadata(spec)).encode()


# Checksums

import numpy as np

ALGORITHM = "crc32c"


def chunk_checksum(storage_array: np.ndarray) -> int:
    """CRC-32C of the bytes of a C-contiguous, little-endian storage array (= the chunk file)."""
    return crc32c.crc32c(np.ascontiguousarray(storage_array).reshape(-1).view(np.uint8))


# ---- the manifest's records -------------------------------------------------------------

FORMAT_NAME = "jax-ckpt"
FORMAT_VERSION = 3
# Stacked storage (small arrays packed into one Zarr array) needs version 2; a manifest without
# stacks is written as version 1, which every reader reads.
STACKS_VERSION = 2
# The packed layout (chunks in a few data objects per process, found through per-process index
# objects; SPEC section 13) needs version 3.
PACKED_VERSION = 3
MANIFEST_NAME = "manifest.msgpack"

# Leaf kinds.
JAX_ARRAY = "jax.Array"
NUMPY = "numpy.ndarray"
PRNG_KEY = "prng_key"
NUMPY_SCALAR = "numpy.scalar"
PY_INT, PY_FLOAT, PY_BOOL, PY_COMPLEX, PY_STR, PY_BYTES = "int", "float", "bool", "complex", "str", "bytes"
ARRAY_KINDS = (JAX_ARRAY, NUMPY, PRNG_KEY, NUMPY_SCALAR)

# Arrays of at most this many bytes are stored inside the manifest, not as Zarr arrays.
INLINE_LIMIT = 4096

# The manifest's own checksum: the map's last entry, a 4-byte bin holding the big-endian CRC-32C
# of every byte before it. So a file that carries one ends with exactly these bytes plus the CRC.
CHECKSUM_KEY = "manifest_crc32c"
CHECKSUM_TRAILER = msgpack.packb(CHECKSUM_KEY) + b"\xc4\x04"
ZARR_JSON_KEY = "zarr_json_crc32c"


@dataclass(frozen=True)
class InlineStorage:
    """An array stored inside the manifest: its little-endian storage-dtype bytes."""

    data: bytes

    def to_record(self) -> dict:
        return {"type": "inline", "data": self.data}


@dataclass(frozen=True)
class ZarrStorage:
    """An array stored as a Zarr v3 array at `path` (relative to the checkpoint)."""

    path: str
    chunk_shape: tuple[int, ...]
    data_type: str  # the storage dtype's name
    encoding: str
    checksum: str = "crc32c"
    chunk_checksums: tuple[int, ...] = ()  # row-major over the chunk grid; filled at commit
    # Packed layout (version 3): the one process that wrote every chunk, when one did; its index
    # object is where a reader finds them (SPEC section 13). None otherwise.
    writer: int | None = None
    # Packed layout, arrays written whole by one process (stacks, small arrays): each chunk's
    # (data object, offset, length, CRC-32C), row-major, so that no reader needs an index object
    # for them (replicated small arrays would otherwise send every process to many indexes).
    places: tuple[tuple[str, int, int, int], ...] = ()

    def to_record(self) -> dict:
        rec = {"type": "zarr", "path": self.path, "chunk_shape": list(self.chunk_shape),
               "data_type": self.data_type, "encoding": self.encoding, "checksum": self.checksum,
               "chunk_checksums": list(self.chunk_checksums)}
        if self.writer is not None:
            rec["writer"] = self.writer
        if self.places:
            rec["places"] = [list(p) for p in self.places]
        return rec


@dataclass(frozen=True)
class Stack:
    """Small arrays of one shape and logical dtype stored as one Zarr array (format version 2):
    member k is index k along its first dimension; `zarr.chunk_shape` splits only that one."""

    shape: tuple[int, ...]  # (members, *member shape)
    dtype: str  # the members' logical dtype
    zarr: ZarrStorage

    def to_record(self) -> dict:
        rec = self.zarr.to_record()
        del rec["type"]
        return {"shape": list(self.shape), "dtype": self.dtype, **rec}

    @property
    def member_bytes(self) -> int:
        return math.prod(self.shape[1:]) * np.dtype(self.zarr.data_type).itemsize


@dataclass(frozen=True)
class StackedStorage:
    """An array stored as member `index` of stack number `stack` of the manifest (version 2)."""

    stack: int
    index: int
    array: Stack = field(compare=False, repr=False)  # that stack

    def to_record(self) -> dict:
        return {"type": "stacked", "stack": self.stack, "index": self.index}


@dataclass
class LeafRecord:
    """One leaf as the manifest records it.

    For array kinds, `shape` and `dtype` are those of the stored data (for PRNG keys: the key
    data, e.g. uint32 with a trailing dimension of 2). `storage` is an InlineStorage or a
    ZarrStorage. Records a reader gets have passed ``_manifest_check`` (every field typed and
    within bounds).
    """

    path: str
    kind: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    sharding: dict | None = None
    storage: InlineStorage | ZarrStorage | StackedStorage | dict | None = None
    value: Any = None
    prng_impl: str | None = None

    def to_record(self) -> dict:
        rec: dict = {"path": self.path, "kind": self.kind}
        if self.kind in ARRAY_KINDS:
            storage = self.storage.to_record() if hasattr(self.storage, "to_record") else self.storage
            rec.update(shape=list(self.shape), dtype=self.dtype, sharding=self.sharding, storage=storage)
            if self.prng_impl is not None:
                rec["prng_impl"] = self.prng_impl
        else:
            rec["value"] = self.value
        return rec

    @property
    def zarr(self) -> ZarrStorage | None:
        """The Zarr storage of a validated array record, None when inline (or not an array)."""
        return self.storage if isinstance(self.storage, ZarrStorage) else None

    @property
    def stacked(self) -> StackedStorage | None:
        """The stack membership of a validated array record stored in a stack, else None."""
        return self.storage if isinstance(self.storage, StackedStorage) else None

    @property
    def inline(self) -> bool:
        """Whether a validated array record's data is inside the manifest."""
        return isinstance(self.storage, InlineStorage)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The chunk shape reads plan with: the Zarr chunks, or one chunk for inline and stacked
        data (at least 1 per dimension, for empty arrays)."""
        if self.zarr is not None:
            return self.zarr.chunk_shape
        return tuple(max(1, n) for n in self.shape)

    def inline_array(self) -> np.ndarray:
        """The value of an inline array record, in its logical dtype."""

        logical = dtype_from_name(self.dtype)
        storage_dtype, _ = storage_of(logical)
        a = np.frombuffer(self.storage.data, dtype=storage_dtype.newbyteorder("<")).reshape(self.shape)
        return from_storage(a.astype(storage_dtype), logical)

    def py_value(self) -> Any:
        """The Python value of a non-array leaf."""
        if self.kind == PY_INT:
            return int(self.value)
        if self.kind == PY_COMPLEX:
            return complex(self.value[0], self.value[1])
        return self.value


# The reserved key of a manifest's user metadata under which a CheckpointManager step keeps its
# metrics (a converted Orbax step too: `ckpt diff` compares them separately).
METRICS_KEY = "ckpt.metrics"


@dataclass
class Manifest:
    tree: dict
    leaves: list[LeafRecord]
    user_metadata: dict | None = None
    created: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    library_version: str = ""
    # CRC-32C of every zarr.json (key relative to the checkpoint -> CRC); None in manifests
    # written before the format recorded them.
    zarr_json: dict[str, int] | None = None
    stacks: list[Stack] = field(default_factory=list)  # format version 2
    # Format version 3, packed layout: the manifest's "packed" section as written (a map), and
    # as validated (a PackedLayout, set by the reader's checks).
    packed: dict | None = None
    layout: Any = field(default=None, compare=False, repr=False)

    def encode(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "library_version": self.library_version,
            "created": self.created,
            "tree": self.tree,
            "leaves": [leaf.to_record() for leaf in self.leaves],
            "user_metadata": self.user_metadata,
        }
        if self.stacks:
            doc["stacks"] = [s.to_record() for s in self.stacks]
        if self.zarr_json is not None:
            doc[ZARR_JSON_KEY] = dict(self.zarr_json)
        if self.packed is not None:
            doc["packed"] = self.packed
        return seal(doc)


def seal(doc: dict) -> bytes:
    """The manifest map `doc` packed, with its checksum as the last entry (SPEC section 8)."""
    packed = msgpack.packb({**doc, CHECKSUM_KEY: bytes(4)}, use_bin_type=True)
    if not packed.endswith(CHECKSUM_TRAILER + bytes(4)):
        raise ValueError(f"{CHECKSUM_KEY} must be the manifest's last entry")
    return packed[:-4] + crc32c.crc32c(packed[:-4]).to_bytes(4, "big")


def check_seal(data: bytes, doc: dict, where: str) -> None:
    """Raise CheckpointError unless the manifest's checksum (if it has one) matches its bytes.
    A manifest without one (written before the format had it) is accepted as it is. A manifest
    whose last entry holds 4 bytes is taken as sealed whatever that entry's key says (no
    unsealed manifest ends so), so that a flip inside the key cannot pass for an old manifest."""
    last_key, last_value = next(reversed(doc.items()), (None, None))
    if CHECKSUM_KEY not in doc and not (isinstance(last_value, bytes) and len(last_value) == 4):
        return
    if last_key != CHECKSUM_KEY:
        raise CheckpointError(f"{where}: manifest is corrupted: its last entry {last_key!r} is not {CHECKSUM_KEY!r}")
    recorded = doc[CHECKSUM_KEY]
    if not (isinstance(recorded, bytes) and len(recorded) == 4 and list(doc)[-1] == CHECKSUM_KEY
            and data[-len(CHECKSUM_TRAILER) - 4:-4] == CHECKSUM_TRAILER and data[-4:] == recorded):
        raise CheckpointError(f"{where}: manifest is corrupted: its {CHECKSUM_KEY} entry is malformed")
    actual = crc32c.crc32c(data[:-4])
    if actual != int.from_bytes(recorded, "big"):
        raise CheckpointError(
            f"{where}: manifest is corrupted: its CRC-32C is {actual:#010x}, but it records "
            f"{int.from_bytes(recorded, 'big'):#010x} (the file was damaged after it was written)"
        )


TEMP_MARK = ".tmp-"


GENERATION_MARK = "gen-"  # generation prefixes of no-rename backends: gen-<12 hex digits>


def is_temp_name(name: str) -> bool:
    return TEMP_MARK in name
