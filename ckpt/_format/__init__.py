"""The on-disk contract (formats/SPEC.md): manifest records and their validation, the tree
encoding, dtypes, checksums and Zarr metadata. No devices, no I/O of its own; every layer above
imports it through this door."""

from __future__ import annotations

# The door: what other layers of ckpt use from here (dtypes as a namespace: _dtypes.storage_of...).
from ckpt._format import dtypes
from ckpt._format.checksum import ALGORITHM, chunk_checksum
from ckpt._format.manifest import find_manifest, read_manifest
from ckpt._format.records import (
    ARRAY_KINDS, FORMAT_NAME, GENERATION_MARK, INLINE_LIMIT, InlineStorage, JAX_ARRAY, LeafRecord, MANIFEST_NAME, Manifest, NUMPY, NUMPY_SCALAR, PRNG_KEY, PY_BOOL, PY_BYTES, PY_COMPLEX, PY_FLOAT, PY_INT, PY_STR, STACKS_VERSION, Stack, StackedStorage, TEMP_MARK, ZarrStorage, is_temp_name,
)
from ckpt._format.tree import (
    CUSTOM, DICT, FlatLeaf, LEAF, LIST, NONE, TUPLE, child_names, display_path, flatten, join_path, leaf_components, match_target, storage_paths, unflatten,
)
from ckpt._format.validate import check_sharding
from ckpt._format.zarr import ArraySpec, GROUP_METADATA, array_metadata_bytes, zarr_metadata  # noqa: F401
