"""How chunks sit in objects (docs/design.md, "The layout"): the files layout of format versions
1-2 (an object per chunk beside zarr.json files) and the packed layout of format version 3 (a
few data objects and an index object per process). Each is a ``SaveLayout`` with its
``ChunkWriter``; the save's steps use them without asking which one a save has. A chunk's
encoding (today: its raw little-endian bytes) is the writers' business, in one place."""

from __future__ import annotations

from ckpt._layout.arrays import array_specs, group_paths, metadata_share
from ckpt._layout.base import FILES, PACKED, ChunkRuns, ChunkWriter, ManifestParts, SaveFacts, SaveLayout, layout_name
from ckpt._layout.files import FilesSave, commit_written
from ckpt._layout.pack_writer import PackWriter
from ckpt._layout.packed import PackedSave, commit_packed

__all__ = [
    "FILES", "PACKED", "ChunkRuns", "ChunkWriter", "FilesSave", "ManifestParts", "PackWriter", "PackedSave", "SaveFacts",
    "SaveLayout",
    "array_specs", "commit_packed", "commit_written", "group_paths", "layout_name", "metadata_share",
    "save_layout",
]


def save_layout(name: str, plan, shards, target_bytes: int, budget, caps, writes: list) -> SaveLayout:
    """This process's part of a save in the layout `name` (``layout_name``), taking from
    `budget` now what the layout needs while the save runs (the packed layout's assembly
    buffers, on object stores)."""
    if name == PACKED:
        return PackedSave.prepare(plan, shards, target_bytes, budget, caps, writes)
    return FilesSave()
