"""The manifest: one msgpack map at <checkpoint>/manifest.msgpack, written last.

Its presence is what makes a directory a committed checkpoint. formats/SPEC.md describes every
field; formats/manifest.schema.json is the same as a JSON Schema. msgpack only: no pickle,
nothing executable, and any language can read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ckpt._errors import CheckpointError

FORMAT_NAME = "jax-ckpt"
FORMAT_VERSION = 1
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

    def to_record(self) -> dict:
        return {"type": "zarr", "path": self.path, "chunk_shape": list(self.chunk_shape),
                "data_type": self.data_type, "encoding": self.encoding, "checksum": self.checksum,
                "chunk_checksums": list(self.chunk_checksums)}

    @classmethod
    def from_record(cls, rec: dict) -> "ZarrStorage":
        return cls(rec["path"], tuple(rec["chunk_shape"]), rec["data_type"], rec["encoding"],
                   rec["checksum"], tuple(rec["chunk_checksums"]))


@dataclass
class LeafRecord:
    """One leaf as the manifest records it.

    For array kinds, `shape` and `dtype` are those of the stored data (for PRNG keys: the key
    data, e.g. uint32 with a trailing dimension of 2). `storage` is an InlineStorage or a
    ZarrStorage (a raw map only between decoding and ``check_manifest``, which types it).
    """

    path: str
    kind: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    sharding: dict | None = None
    storage: InlineStorage | ZarrStorage | dict | None = None
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

    @classmethod
    def from_record(cls, rec: dict) -> "LeafRecord":
        return cls(
            path=rec["path"],
            kind=rec["kind"],
            shape=tuple(rec["shape"]) if "shape" in rec else None,
            dtype=rec.get("dtype"),
            sharding=rec.get("sharding"),
            storage=rec.get("storage"),
            value=rec.get("value"),
            prng_impl=rec.get("prng_impl"),
        )

    @property
    def zarr(self) -> ZarrStorage | None:
        """The Zarr storage of a validated array record, None when inline (or not an array)."""
        return self.storage if isinstance(self.storage, ZarrStorage) else None

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The chunk shape reads plan with: the Zarr chunks, or one chunk for inline data (at
        least 1 per dimension, for empty arrays)."""
        if self.zarr is not None:
            return self.zarr.chunk_shape
        return tuple(max(1, n) for n in self.shape)

    def inline_array(self) -> np.ndarray:
        """The value of an inline array record, in its logical dtype."""
        from ckpt import _dtypes

        logical = _dtypes.dtype_from_name(self.dtype)
        storage_dtype, _ = _dtypes.storage_of(logical)
        a = np.frombuffer(self.storage.data, dtype=storage_dtype.newbyteorder("<")).reshape(self.shape)
        return _dtypes.from_storage(a.astype(storage_dtype), logical)

    def py_value(self) -> Any:
        """The Python value of a non-array leaf."""
        if self.kind == PY_INT:
            return int(self.value)
        if self.kind == PY_COMPLEX:
            return complex(self.value[0], self.value[1])
        return self.value


@dataclass
class Manifest:
    tree: dict
    leaves: list[LeafRecord]
    user_metadata: dict | None = None
    created: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    library_version: str = ""

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "format": FORMAT_NAME,
                "format_version": self.format_version,
                "library_version": self.library_version,
                "created": self.created,
                "tree": self.tree,
                "leaves": [leaf.to_record() for leaf in self.leaves],
                "user_metadata": self.user_metadata,
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes, where: str) -> "Manifest":
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as e:
            raise CheckpointError(f"{where}: manifest is corrupted ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where}: not a {FORMAT_NAME} manifest")
        version = doc.get("format_version")
        if not isinstance(version, int) or version < 1:
            raise CheckpointError(f"{where}: manifest has an invalid format_version {version!r}")
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: checkpoint format_version {version} is newer than this jax-ckpt reads "
                f"(up to {FORMAT_VERSION}); upgrade jax-ckpt to a release that reads format version {version}"
            )
        try:
            return cls(
                tree=doc["tree"],
                leaves=[LeafRecord.from_record(r) for r in doc["leaves"]],
                user_metadata=doc.get("user_metadata"),
                created=doc.get("created", 0.0),
                format_version=version,
                library_version=doc.get("library_version", ""),
            )
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: manifest is missing a field ({e})") from None
