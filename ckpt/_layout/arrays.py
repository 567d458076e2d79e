"""The arrays of a save as a chunk layout stores them: their ids, storage paths and specs, and
which process writes which metadata object (the files layout's zarr.json files)."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from ckpt._format import ArraySpec, Stack


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
