"""How chunks sit in objects (docs/design.md, "The layout"): the files layout of format versions
1-2 (an object per chunk beside zarr.json files) and the packed layout of format version 3 (a
few data objects and an index object per process). Each is a ``SaveLayout`` with its
``ChunkWriter``, and a way its chunks are read: the files layout through the engine's chunk-file
reads (``ckpt.storage.ChunkFiles``), the packed layout through the index objects
(``PackedChunks``). The save's steps use them without asking which one a save has. A chunk's
encoding (today: its raw little-endian bytes) is the writers' business, in one place."""

from __future__ import annotations

from ckpt._layout.base import (FILES, PACKED, ChunkRuns, ChunkWriter, ManifestParts, SaveFacts, SaveLayout, array_specs,
                               group_paths, layout_name, metadata_share, save_layout)
from ckpt._layout.files import FilesSave, commit_written
from ckpt._layout.pack_writer import PackWriter
from ckpt._layout.packed_reader import PackedChunks, packed_reads
from ckpt._layout.packed import PackedSave, commit_packed

__all__ = [
    "FILES", "PACKED", "ChunkRuns", "ChunkWriter", "FilesSave", "ManifestParts", "PackWriter", "PackedChunks", "PackedSave",
    "SaveFacts", "SaveLayout",
    "array_specs", "commit_packed", "commit_written", "group_paths", "layout_name", "metadata_share", "packed_reads",
    "save_layout",
]
