"""What a chunk layout is to the save: a ``ChunkWriter`` that puts one process's chunks into
objects, and a ``SaveLayout`` that does the rest of one process's part of a save in that layout
(its report to the primary, and, on the primary, the manifest's records and the commit).

The layout of a save is a value chosen once (``layout_name``) and agreed by every process; the
save's steps (``ckpt/_save/``) call these interfaces and never ask which layout it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from ckpt._commit import Staged
from ckpt._format import ArraySpec, LeafRecord, Stack
from ckpt._geometry import Box
from ckpt.storage import Storage, StoreCaps

# The layouts by name (Options.layout, CKPT_LAYOUT): the files of format versions 1-2, one object
# per chunk; the packed layout of format version 3, a few data objects per process.
FILES, PACKED = "files", "packed"


def layout_name(option: str, processes: int) -> str:
    """The layout of a save: `option` (``Options.layout``), ``auto`` meaning packed when the save
    runs on several processes (O(processes) objects, not O(chunks): issue 23)."""
    return PACKED if option == PACKED or (option == "auto" and processes > 1) else FILES


class ChunkWriter(ABC):
    """Where the save's writer hands this process's chunks. Futures resolve once durable; the
    caller does not change a chunk's data until then. `requests`: what it sent so far."""

    requests: int = 0

    @abstractmethod
    def write_chunk(self, array: int, box: Box, data: Any) -> Any:
        """Write the chunk of array `array` (an id of ``array_specs``) covering `box` (the chunk's
        region; an edge chunk's data is the part inside the array), in the storage dtype."""

    @abstractmethod
    def write_metadata(self) -> list:
        """Write this process's share of the layout's metadata objects, after its chunks;
        futures."""


@dataclass
class SaveFacts:
    """What a layout's commit needs of the save (the primary's): where it goes, what it holds."""

    storage: Storage
    staged: Staged
    tree: dict  # the encoded tree (the manifest's `tree`)
    leaves: list  # the save's Leaf descriptions (``ckpt._save.plan``), by leaf index
    stacks: list[Stack]
    specs: dict[int, tuple[str, ArraySpec]]  # array_specs(leaves, stacks)
    overwrite: bool
    user_metadata: dict | None
    process: int
    processes: int
    io_concurrency: int = 8
    extra: dict = field(default_factory=dict)


@dataclass
class ManifestParts:
    """What a commit writes into the manifest besides the layout's own section: the encoded
    tree, every leaf as the manifest records it (storage paths with the staged prefix, chunk
    checksums filled in), the stacks likewise complete, and the user's metadata."""

    tree: dict
    records: list[LeafRecord]
    stacks: list[Stack] = field(default_factory=list)
    user_metadata: dict | None = None


class SaveLayout(ABC):
    """One process's part of one save in a chunk layout (`name`: ``FILES`` or ``PACKED``);
    ``save_layout`` picks among the layouts defined by name (``ckpt._layout`` defines both)."""

    name: str
    _by_name: dict[str, type["SaveLayout"]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        SaveLayout._by_name[cls.name] = cls

    @classmethod
    def prepare(cls, plan, shards, target_bytes: int, budget: Any, caps: StoreCaps, writes: list) -> "SaveLayout":
        """This process's part of a save (`plan`, its `shards`), taking from `budget` now what
        the layout needs while the save runs."""
        return cls()

    @abstractmethod
    def open(self, facts: SaveFacts) -> ChunkWriter:
        """The writer of this process's chunks into the staged place."""

    def max_inflight_writes(self, caps: StoreCaps, io_concurrency: int) -> int | None:
        """The most writes handed to storage and not yet durable (None: bytes bound them)."""
        return None

    def close(self) -> None:
        """Every chunk written is durable (raises the first failure)."""

    def abandon(self) -> None:
        """After a failure: every write started has ended (errors not raised)."""

    def release(self, budget: Any) -> None:
        """Give back what the layout took from the save's host budget."""

    @abstractmethod
    def report(self, facts: SaveFacts, sums: dict) -> dict | None:
        """After this process's writes: write what the primary needs of them (an index object)
        and return what this process's status says of it (O(1) bytes), or None."""

    @abstractmethod
    def commit(self, facts: SaveFacts, statuses: list[dict]) -> None:
        """The primary, once every process reported: build the manifest from the statuses and
        commit it (``ckpt._commit``)."""


class ChunkRuns(ABC):
    """The optional protocol of a chunk reader that reads many chunks at once (a packed
    checkpoint: the chunks that follow each other in a data object, as one range); the restore's
    reader asks for a batch's chunks together where its source is one (checked once, with
    ``isinstance``), and one by one (``read_chunk_async``) elsewhere."""

    @abstractmethod
    def read_chunks(self, requests: list[tuple], executor: Any) -> dict[Any, Any]:
        """Start reading many chunks: {key: future of its bytes} for `requests` of (key, array
        path, chunk index, bytes)."""


# ---- the arrays of a save, as every layout stores them ---------------------------------


def array_specs(leaves: list, stacks: list[Stack]) -> dict[int, tuple[str, ArraySpec]]:
    """(storage path, spec) of every Zarr array of the save, by array id: a leaf's index, or
    ``-1 - s`` for stack s (the ids of the plan's writes)."""
    specs = {}
    for i, leaf in enumerate(leaves):
        st = leaf.record.zarr
        if st is not None:
            attrs = {"jax_ckpt": {"path": leaf.record.path, "dtype": leaf.record.dtype, "encoding": st.encoding}}
            specs[i] = (st.path, ArraySpec(tuple(leaf.record.shape), tuple(leaf.chunk_shape),
                                           np.dtype(st.data_type), attrs))
    members: dict[int, list[str]] = {}
    for leaf in leaves:
        if leaf.record.stacked is not None:
            members.setdefault(leaf.record.stacked.stack, []).append(leaf.record.path)
    for s, stack in enumerate(stacks):
        # The member leaves' paths in stack order, so that a Zarr user can find a leaf's slice.
        attrs = {"jax_ckpt": {"dtype": stack.dtype, "encoding": stack.zarr.encoding, "members": members[s]}}
        specs[-1 - s] = (stack.zarr.path, ArraySpec(stack.shape, stack.zarr.chunk_shape,
                                                     np.dtype(stack.zarr.data_type), attrs))
    return specs


def metadata_share(specs: dict[int, tuple[str, ArraySpec]], process: int, processes: int) -> list[tuple[str, ArraySpec]]:
    """The arrays whose zarr.json `process` writes: every `processes`-th in the specs' order
    (the same on every process), so that no process writes thousands of small files (a 70B
    model's 2,169 leaves made process 0 write 2,897 of them at any scale: issue 23)."""
    return [item for k, item in enumerate(specs.values()) if k % processes == process]


def group_paths(array_paths: Iterable[str], prefix: str) -> set[str]:
    """The Zarr groups a save writes a zarr.json for, so stock zarr can browse the tree: the root
    and every group above an array. None in a generation prefix without arrays: no manifest path
    would reference it, so no overwrite could ever find and delete it."""
    array_paths = list(array_paths)
    groups = {""} if array_paths or not prefix else set()
    for path in array_paths:
        parts = path.split("/")
        groups.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return groups


def save_layout(name: str, plan, shards, target_bytes: int, budget, caps, writes: list) -> SaveLayout:
    """This process's part of a save in the layout `name` (``layout_name``), taking from
    `budget` now what the layout needs while the save runs (the packed layout's assembly
    buffers, on object stores)."""
    return SaveLayout._by_name[name].prepare(plan, shards, target_bytes, budget, caps, writes)
