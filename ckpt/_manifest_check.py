"""Structural checks of a decoded manifest, so that tools reading damaged or hand-edited
checkpoints fail with one clear message naming the field at fault instead of a KeyError deep
inside. The rules are those of formats/SPEC.md ("Manifest")."""

from __future__ import annotations

import math
from typing import Any

from ckpt import _dtypes
from ckpt._errors import CheckpointError
from ckpt._layout import chunk_grid
from ckpt._manifest import ARRAY_KINDS, InlineStorage, Manifest, ZarrStorage
from ckpt._tree import CUSTOM, DICT, LEAF, LIST, NONE, TUPLE, display_path

VALUE_KINDS = ("int", "float", "bool", "complex", "str", "bytes")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x: Any, *, positive: bool) -> bool:
    return isinstance(x, list) and all(_is_int(n) and (n > 0 if positive else n >= 0) for n in x)


def _check_tree(node: Any, where: str, seen: list[int]) -> None:
    if not isinstance(node, dict) or "kind" not in node:
        raise ValueError(f"tree node at {where or '<root>'} is not a map with a 'kind'")
    kind = node["kind"]
    if kind == LEAF:
        if not _is_int(node.get("index")):
            raise ValueError(f"tree leaf at {where or '<root>'} has no integer 'index'")
        seen.append(node["index"])
        return
    if kind == NONE:
        return
    if kind not in (DICT, LIST, TUPLE, CUSTOM):
        raise ValueError(f"tree node at {where or '<root>'} has an unknown kind {kind!r}")
    children = node.get("children")
    if not isinstance(children, list):
        raise ValueError(f"tree node at {where or '<root>'} has no 'children' list")
    if kind in (DICT, CUSTOM):
        keys = node.get("keys")
        if not isinstance(keys, list) or len(keys) != len(children):
            raise ValueError(f"tree node at {where or '<root>'}: 'keys' and 'children' differ in length")
    for i, child in enumerate(children):
        _check_tree(child, f"{where}/{i}" if where else str(i), seen)


def _check_sharding(sharding: Any, ndim: int) -> None:
    if sharding is None:
        return
    if not isinstance(sharding, dict) or sharding.get("kind") not in ("named", "single_device", "other"):
        raise ValueError(f"sharding {sharding!r} is not one of the recorded kinds")
    if sharding["kind"] != "named":
        return
    mesh, spec = sharding.get("mesh"), sharding.get("spec")
    if not isinstance(mesh, dict) or not isinstance(spec, list):
        raise ValueError("named sharding needs 'mesh' and 'spec'")
    names, sizes = mesh.get("axis_names"), mesh.get("axis_sizes")
    if not isinstance(names, list) or not _int_list(sizes, positive=True) or len(names) != len(sizes):
        raise ValueError("sharding mesh needs equally long 'axis_names' and positive 'axis_sizes'")
    if len(spec) > ndim:
        raise ValueError(f"PartitionSpec has {len(spec)} entries for {ndim} dimensions")
    for entry in spec:
        axes = [] if entry is None else [entry] if isinstance(entry, str) else entry
        if not isinstance(axes, list) or any(a not in names for a in axes):
            raise ValueError(f"PartitionSpec entry {entry!r} names an axis the mesh {names} does not have")


def _check_storage(storage: Any, shape: list[int], logical: str) -> InlineStorage | ZarrStorage:
    storage_dtype, encoding = _dtypes.storage_of(_dtypes.dtype_from_name(logical))
    if not isinstance(storage, dict) or storage.get("type") not in ("inline", "zarr"):
        raise ValueError("storage is neither 'inline' nor 'zarr'")
    if storage["type"] == "inline":
        data, want = storage.get("data"), math.prod(shape) * storage_dtype.itemsize
        if not isinstance(data, bytes) or len(data) != want:
            got = len(data) if isinstance(data, bytes) else type(data).__name__
            raise ValueError(f"inline data has {got} bytes, expected {want}")
        return InlineStorage(data)
    path, chunk_shape = storage.get("path"), storage.get("chunk_shape")
    if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
        raise ValueError(f"storage path {path!r} is not a relative path inside the checkpoint")
    if not _int_list(chunk_shape, positive=True) or len(chunk_shape) != len(shape):
        raise ValueError(f"chunk_shape {chunk_shape!r} does not fit shape {shape}")
    if storage.get("data_type") != storage_dtype.name or storage.get("encoding") != encoding:
        raise ValueError(
            f"data_type {storage.get('data_type')!r} / encoding {storage.get('encoding')!r} do not match "
            f"dtype {logical} (expected {storage_dtype.name} / {encoding})"
        )
    if storage.get("checksum") != "crc32c":
        raise ValueError(f"unknown checksum algorithm {storage.get('checksum')!r}")
    sums, want = storage.get("chunk_checksums"), math.prod(chunk_grid(shape, chunk_shape))
    if not isinstance(sums, list) or len(sums) != want or not all(_is_int(s) and 0 <= s < 2**32 for s in sums):
        got = len(sums) if isinstance(sums, list) else type(sums).__name__
        raise ValueError(f"chunk_checksums has {got} entries, expected {want} 32-bit values")
    return ZarrStorage.from_record(storage)


def _check_leaf(rec) -> None:
    if not isinstance(rec.path, str):
        raise ValueError("'path' is not a string")
    if rec.kind in VALUE_KINDS:
        return
    if rec.kind not in ARRAY_KINDS:
        raise ValueError(f"unknown kind {rec.kind!r}")
    if not _int_list(list(rec.shape) if isinstance(rec.shape, tuple) else rec.shape, positive=False):
        raise ValueError(f"shape {rec.shape!r} is not a list of sizes")
    if not isinstance(rec.dtype, str):
        raise ValueError(f"dtype {rec.dtype!r} is not a name")
    try:
        _dtypes.dtype_from_name(rec.dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {rec.dtype!r}") from None
    if rec.kind == "prng_key" and not isinstance(rec.prng_impl, str):
        raise ValueError("PRNG key leaf has no 'prng_impl'")
    _check_sharding(rec.sharding, len(rec.shape))
    if not isinstance(rec.storage, (InlineStorage, ZarrStorage)):
        rec.storage = _check_storage(rec.storage, list(rec.shape), rec.dtype)


def check_manifest(manifest: Manifest, where: str) -> Manifest:
    """Raise CheckpointError naming the first field that breaks the format; return `manifest`,
    its records' storage now typed (InlineStorage / ZarrStorage)."""
    try:
        seen: list[int] = []
        _check_tree(manifest.tree, "", seen)
        if sorted(seen) != list(range(len(manifest.leaves))):
            raise ValueError(f"tree leaves do not refer to each of the {len(manifest.leaves)} leaves exactly once")
        if manifest.user_metadata is not None and not isinstance(manifest.user_metadata, dict):
            raise ValueError("user_metadata is neither nil nor a map")
    except ValueError as e:
        raise CheckpointError(f"{where}: manifest is corrupted: {e}") from None
    for i, rec in enumerate(manifest.leaves):
        try:
            _check_leaf(rec)
        except (ValueError, TypeError, AttributeError) as e:
            name = display_path(rec.path) if isinstance(rec.path, str) else f"#{i}"
            raise CheckpointError(f"{where}: manifest is corrupted: leaf {i} ({name!r}): {e}") from None
    return manifest
