"""Zarr v3 metadata of the arrays and groups a checkpoint holds (their zarr.json files), as
every engine writes them and the manifest records their CRC-32C (formats/SPEC.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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
