"""The storage interface: everything that touches bytes, locations, listing and deletion.

A ``Storage`` is bound to one location (a directory or key prefix) and sees everything below it
by *key*: a relative, ``/``-separated path (``manifest.msgpack``, ``params/w/c/0/1``). It is
shaped like zarr-python's ``Store`` (get / set / set_if_not_exists / delete / list_dir, with
capability flags) for bytes, and like PyTorch DCP's ``StorageWriter`` for the commit: the save
path stages data with ``stage``, and ``commit(staged, manifest)`` makes it a checkpoint in one
step (``finish(metadata)`` in DCP). Engines implement the primitives; the commit built on them
lives here, once, for every backend:

* the manifest is the commit point: written last, and only where none is (a rename of a staged
  directory on local disk, a write-if-absent elsewhere);
* a location without a manifest is never a checkpoint;
* an overwrite never exposes a mix of old and new data: new data goes to a fresh place that only
  the new manifest points to (a staged directory swapped in by rename, or a fresh generation
  prefix), and old data is deleted only after the new manifest is in place.

Every error an engine raises reaches callers as ``OSError`` (``FileNotFoundError`` for a missing
object, ``PermissionError``, ``ENOSPC``, ``EIO``...) or ``CheckpointError``, naming the object.
"""

from __future__ import annotations

import errno
import json
import secrets
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._layout import Box, box_shape, chunk_key

MANIFEST_NAME = "manifest.msgpack"
TEMP_MARK = ".tmp-"
GENERATION_MARK = "gen-"  # generation prefixes of no-rename backends: gen-<12 hex digits>
GROUP_METADATA = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'


def is_temp_name(name: str) -> bool:
    return TEMP_MARK in name


class Usage(NamedTuple):
    """What a location holds on disk (``Storage.du``)."""

    bytes: int
    files: int
    modified: float  # newest modification time below it, seconds since the epoch


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


def aligned_empty(nbytes: int, alignment: int = 64) -> np.ndarray:
    """An uninitialised uint8 buffer whose data starts on an `alignment`-byte boundary
    (XLA's CPU client adopts such host buffers without copying them)."""
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset : offset + nbytes]


def chunk_bytes(data: np.ndarray, box: Box, chunk_shape: tuple[int, ...]) -> np.ndarray:
    """The bytes of a chunk file: `data` (the part of the chunk inside the array) padded to the
    full chunk shape with zeros (the fill value), as uint8."""
    if box_shape(box) != tuple(chunk_shape):
        full = np.zeros(chunk_shape, data.dtype)
        full[tuple(slice(0, n) for n in data.shape)] = data
        data = full
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def size_mismatch(where: str, got: int, want: int) -> CheckpointError:
    """The error for an object that does not hold the bytes it should (one wording everywhere)."""
    if got < want:
        return CheckpointError(f"{where} is truncated: {got} of {want} bytes")
    return CheckpointError(f"{where} holds {got} bytes, more than the {want} expected")


class Done:
    """A future that is already finished (for engines whose operation is synchronous)."""

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self._value, self._error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


def os_error(code: int, what: str, where: str) -> OSError:
    """An OSError of the right subclass for `code` (e.g. FileNotFoundError for ENOENT)."""
    return OSError(code, what, where)


@dataclass(frozen=True)
class Staged:
    """Where a save writes before its commit.

    storage: the location array keys are written under; prefix: prepended to every storage path
    recorded in the manifest (a generation prefix, or '' when the staged directory becomes the
    checkpoint by rename); info: what other processes need to find the same place
    (``Storage.staged_from(info)``), msgpack-able.
    """

    storage: "Storage"
    prefix: str
    info: dict


class Storage(ABC):
    """One location and everything below it. See the module docstring for the contract.

    Capability flags:
      ``renames``: a staged directory is published by an atomic rename (local disk);
      ``conditional_writes``: ``put_if_absent`` is atomic against other writers.
    """

    engine: str = "?"
    renames: bool = False
    conditional_writes: bool = False

    # ---- location ----------------------------------------------------------------------

    @property
    @abstractmethod
    def url(self) -> str:
        """The location, as shown in messages (a local path or a URL)."""

    @property
    def name(self) -> str:
        """The last component of the location."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @abstractmethod
    def child(self, key: str) -> "Storage":
        """The storage of the location `key` below this one."""

    @abstractmethod
    def parent(self) -> "Storage":
        """The storage of the location that holds this one."""

    def make_dirs(self) -> None:
        """Create this location where the backend has directories (a no-op on object stores)."""

    def where(self, key: str) -> str:
        """The full location of `key`, for messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    # ---- bytes -------------------------------------------------------------------------

    @abstractmethod
    def get(self, key: str, *, max_bytes: int) -> bytes:
        """The object's bytes. FileNotFoundError when missing; CheckpointError when it holds more
        than `max_bytes` (nothing larger is ever read)."""

    @abstractmethod
    def read_exact(self, key: str, nbytes: int) -> np.ndarray:
        """The object's bytes into a fresh 64-byte-aligned uint8 buffer. FileNotFoundError when
        missing; CheckpointError naming the object when it does not hold exactly `nbytes`."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> Any:
        """Write (or replace) a small object; returns a future, durable once it resolves."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Write the object only if none exists; FileExistsError otherwise. Atomic where
        ``conditional_writes`` is set."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object `key` exists."""

    @abstractmethod
    def exists_any(self) -> bool:
        """Whether anything exists at or below this location."""

    @abstractmethod
    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """(objects, sub-locations) directly below `prefix`, names only, sorted."""

    def du(self) -> Usage | None:
        """Bytes, objects and newest modification time at or below this location, or None where
        the engine cannot tell without reading every object (``ckpt ls`` then sizes committed
        checkpoints from their manifests)."""
        return None

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; a missing one is not an error."""

    @abstractmethod
    def delete_tree(self, prefix: str = "") -> None:
        """Delete everything at or below `prefix` (this whole location for '')."""

    # ---- arrays ------------------------------------------------------------------------

    def create_array(self, path: str, spec: ArraySpec) -> Any:
        """Write the array's zarr.json; returns a future."""
        return self.put(f"{path}/zarr.json", json.dumps(zarr_metadata(spec)).encode())

    def put_group(self, path: str) -> Any:
        """Write a group's zarr.json ('' for the root); returns a future."""
        return self.put(f"{path}/zarr.json" if path else "zarr.json", GROUP_METADATA)

    @abstractmethod
    def open_arrays(self, arrays: dict[Any, tuple[str, ArraySpec]]) -> dict[Any, Any]:
        """Handles to write chunks of many arrays (by caller's key), without touching storage."""

    @abstractmethod
    def write_chunk(self, handle: Any, box: Box, data: np.ndarray) -> Any:
        """Write one whole chunk (`box` is the chunk's region of the array, `data` its values, in
        the storage dtype); returns a future, durable once it resolves. The caller owns `data` and
        does not change it until then."""

    def read_chunk(self, path: str, index: tuple[int, ...], nbytes: int) -> np.ndarray:
        """The bytes of one chunk file of the array at `path` (see read_exact)."""
        return self.read_exact(f"{path}/{chunk_key(index)}", nbytes)

    # ---- commit ------------------------------------------------------------------------

    def stage(self, *, overwrite: bool) -> Staged:
        """Check this location and prepare the place a save writes to (primary process only).
        FileExistsError when a checkpoint is here and not `overwrite`.

        Default (no rename): a fresh generation prefix inside this location."""
        if not overwrite and self.exists(MANIFEST_NAME):
            raise FileExistsError(errno.EEXIST, "checkpoint already exists (pass overwrite=True to replace it)", self.url)
        generation = f"{GENERATION_MARK}{secrets.token_hex(6)}"
        return Staged(self.child(generation), generation + "/", {"generation": generation})

    def staged_from(self, info: dict) -> Staged:
        """The same Staged as the primary's ``stage`` returned, from its `info`."""
        generation = info["generation"]
        return Staged(self.child(generation), generation + "/", info)

    def commit(self, staged: Staged, manifest: bytes, *, overwrite: bool,
               old_data: Callable[[], Iterable[str]] | None = None) -> None:
        """Write the manifest last, making the staged data a checkpoint at this location.

        Default (no rename): the manifest is written if absent (FileExistsError when another save
        committed first; its data is untouched), or, when overwriting, replaced in one write; then
        the previous checkpoint's data is deleted. `old_data()` names the top-level entries the
        previous manifest referenced (evaluated before the new manifest is written).
        """
        stale = list(old_data()) if (overwrite and old_data is not None) else []
        if overwrite:
            self.put(MANIFEST_NAME, manifest).result()
        else:
            self.put_if_absent(MANIFEST_NAME, manifest)
        # Committed: from here on nothing may fail the save. Old data that cannot be deleted
        # now is unreferenced and only costs space.
        keep = staged.prefix.rstrip("/")
        for entry in stale:
            if entry == keep:
                continue
            try:
                self.delete(entry) if entry.endswith(".json") else self.delete_tree(entry)
            except OSError as e:
                warnings.warn(f"checkpoint {self.url} committed, but its previous data {self.where(entry)} "
                              f"could not be deleted: {e}", RuntimeWarning, stacklevel=2)

    def abort(self, staged: Staged) -> None:
        """Remove what a save that will not commit staged."""
        staged.storage.delete_tree("")

    def retire(self) -> None:
        """Delete the checkpoint at this location so that no moment shows a half-deleted one as
        committed: the manifest goes first, then the data."""
        self.delete(MANIFEST_NAME)
        self.delete_tree("")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
