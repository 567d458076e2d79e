"""Model surgery at load time (``restore(rename=...)``): leaves made of parts of saved leaves
(stacked, unstacked, transposed, concatenated, split, reshaped) are a *view* source (the names
are paired in surgery_source.py).

A view leaf is a virtual saved leaf (the target's name, shape and dtype) whose every region maps
to regions of one or more real saved leaves: a transpose permutes the box (and transposes the
buffer), a stack splits the box along the new axis into per-layer reads, a concatenation splits
it along the axis into pieces of each input, a reshape reads the saved boxes whose values are
the box's (``reshape_pieces``: one box where the box is whole along the split or merged axes but
the first, as for heads cut out of a (hidden, heads * head_dim) kernel). Restore's own reader
(``Reader``) plans, batches within the host budget and places view leaves as it does any leaf:
its chunk grid is cut at the boundaries of the regions this process's devices need (as for
safetensors), and a chunk is read as the real regions under it, through the source's own region
reader (native chunks verified, safetensors byte ranges, Orbax through TensorStore). A process
thus reads only what its shards need.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import (
    ARRAY_KINDS,
    PRNG_KEY,
    LeafRecord,
    ZarrStorage,
    dtype_from_name,
    storage_of,
    to_storage,
)
from ckpt._geometry import Box, box_shape, box_size, chunk_box, chunk_grid, common_grid, index_to_box, reshape_pieces
from ckpt._host import aligned_empty
from ckpt.storage import ChunkFiles, StoreCaps

# A region reader: {saved leaf index: [boxes]} -> {(index, box): numpy array, the logical dtype}.
Regions = Callable[[dict[int, list[Box]]], dict[tuple[int, Box], np.ndarray]]


# ---- the bound view: shapes, and each region as regions of saved leaves -------------------

# A view chunk's reshape pieces are asked for three times (what it needs, its parts, their
# placing): worked out once.
_pieces = functools.lru_cache(maxsize=1024)(reshape_pieces)


@dataclass(frozen=True)
class Node:
    op: str  # "leaf" or a Part's op
    shape: tuple[int, ...]
    dtype: np.dtype
    children: tuple[Node, ...] = ()
    axis: int = 0
    arg: Any = None  # leaf: the saved index; others as Part.arg (slice: (start, stop))

    def needs(self, box: Box) -> list[tuple[int, Box]]:
        if self.op == "leaf":
            return [(self.arg, box)]
        return [need for child, cbox in self._parts(box) for need in child.needs(cbox)]

    def make(self, box: Box, got: dict) -> np.ndarray:
        if self.op == "leaf":
            return got[(self.arg, box)]
        parts = [child.make(cbox, got) for child, cbox in self._parts(box)]
        if self.op == "reshape":
            return self._placed(box, parts)
        if self.op == "transpose":
            return np.transpose(parts[0], self.arg)
        if self.op == "stack":
            return np.stack(parts, axis=self.axis)
        if self.op == "unstack":
            return np.take(parts[0], 0, axis=self.axis)
        if self.op == "concat":
            return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self.axis)
        return parts[0]  # slice

    def _parts(self, box: Box) -> list[tuple[Node, Box]]:
        """The children and their boxes that `box` of this node is made of, in order."""
        a = self.axis
        if self.op == "reshape":  # one saved box per choice of a piece in each group
            groups = _pieces(box, self.children[0].shape, self.shape)
            return [(self.children[0], sum(combo, ())) for combo in itertools.product(*groups)]
        if self.op == "transpose":
            inverse = [0] * len(self.arg)
            for d, src in enumerate(self.arg):
                inverse[src] = d
            return [(self.children[0], tuple(box[inverse[j]] for j in range(len(box))))]
        if self.op == "stack":
            rest = box[:a] + box[a + 1:]
            return [(self.children[j], rest) for j in range(*box[a])]
        if self.op == "unstack":
            return [(self.children[0], box[:a] + ((self.arg, self.arg + 1),) + box[a:])]
        if self.op == "slice":
            start = self.arg[0]
            return [(self.children[0], box[:a] + ((box[a][0] + start, box[a][1] + start),) + box[a + 1:])]
        out, offset = [], 0
        for child in self.children:  # concat
            n = child.shape[a]
            lo, hi = max(box[a][0], offset), min(box[a][1], offset + n)
            if lo < hi:
                out.append((child, box[:a] + ((lo - offset, hi - offset),) + box[a + 1:]))
            offset += n
        return out


    def _placed(self, box: Box, parts: list[np.ndarray]) -> np.ndarray:
        """A reshape's box from its saved boxes (``reshape_pieces``): each group's pieces, flattened
        in turn, are that group's axes of the box, flattened."""
        groups = _pieces(box, self.children[0].shape, self.shape)
        sizes = [[box_size(p) for p in g] for g in groups]
        starts = [np.cumsum([0] + s).tolist() for s in sizes]
        out = np.empty(tuple(sum(s) for s in sizes), self.dtype)
        for combo, part in zip(itertools.product(*(range(len(g)) for g in groups)), parts):
            out[tuple(slice(starts[g][k], starts[g][k + 1]) for g, k in enumerate(combo))] = part.reshape(
                [sizes[g][k] for g, k in enumerate(combo)])
        return out.reshape(box_shape(box))


def _reshaped(shape: Sequence[int], old: tuple[int, ...], name: str) -> tuple[int, ...]:
    shape, size = [int(n) for n in shape], math.prod(old)
    if shape.count(-1) == 1 and all(n > 0 for n in shape if n != -1):
        rest = math.prod(n for n in shape if n != -1)
        shape[shape.index(-1)] = size // rest if size % rest == 0 else -1
    if not size or any(n < 1 for n in shape) or math.prod(shape) != size:
        raise CheckpointError(f"leaf {name!r}: reshape of shape {old} into {tuple(shape)}"
                              + ("" if size else " (an empty leaf)"))
    return tuple(shape)


def _axis(axis: int, ndim: int, name: str, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise CheckpointError(f"leaf {name!r}: {what} axis {axis} is out of range for {ndim} dimensions")
    return axis % ndim


def bind(src: Any, name: str, index: dict[str, int], records: Sequence[LeafRecord]) -> Node:
    """The Node of a target leaf `name` made as `src` says; CheckpointError naming the leaf where
    the shapes or dtypes do not fit."""
    if isinstance(src, str):
        rec = records[index[src]]
        if rec.kind not in ARRAY_KINDS or rec.kind == PRNG_KEY:
            raise CheckpointError(f"leaf {name!r}: saved leaf {src!r} is a {rec.kind}; surgery applies to arrays")
        return Node("leaf", tuple(rec.shape), dtype_from_name(rec.dtype), arg=index[src])
    kids = tuple(bind(s, name, index, records) for s in src.sources)
    dtypes = {k.dtype for k in kids}
    if len(dtypes) > 1:
        raise CheckpointError(f"leaf {name!r}: {src.op} of sources of dtypes {sorted(d.name for d in dtypes)}")
    first = kids[0]
    if src.op == "transpose":
        axes = src.arg if src.arg is not None else tuple(reversed(range(len(first.shape))))
        if sorted(axes) != list(range(len(first.shape))):
            raise CheckpointError(f"leaf {name!r}: transpose axes {axes} are not a permutation of "
                                  f"{len(first.shape)} dimensions (shape {first.shape})")
        return Node("transpose", tuple(first.shape[a] for a in axes), first.dtype, kids, 0, tuple(axes))
    if src.op == "reshape":
        return Node("reshape", _reshaped(src.arg, first.shape, name), first.dtype, kids)
    if src.op == "stack":
        if any(k.shape != first.shape for k in kids):
            raise CheckpointError(f"leaf {name!r}: stack of shapes {sorted({k.shape for k in kids})}; "
                                  "stacked leaves must have one shape")
        a = _axis(src.axis, len(first.shape) + 1, name, "stack")
        return Node("stack", first.shape[:a] + (len(kids),) + first.shape[a:], first.dtype, kids, a)
    a = _axis(src.axis, len(first.shape), name, src.op)
    if src.op == "unstack":
        if not 0 <= src.arg < first.shape[a]:
            raise CheckpointError(f"leaf {name!r}: unstack index {src.arg} is outside axis {a} of shape {first.shape}")
        return Node("unstack", first.shape[:a] + first.shape[a + 1:], first.dtype, kids, a, src.arg)
    if src.op == "concat":
        if any(k.shape[:a] + k.shape[a + 1:] != first.shape[:a] + first.shape[a + 1:] for k in kids):
            raise CheckpointError(f"leaf {name!r}: concat along axis {a} of shapes {[k.shape for k in kids]}")
        size = sum(k.shape[a] for k in kids)
        return Node("concat", first.shape[:a] + (size,) + first.shape[a + 1:], first.dtype, kids, a)
    sections, part = src.arg
    n = first.shape[a]
    if isinstance(sections, int):
        if sections < 1 or n % sections:
            raise CheckpointError(f"leaf {name!r}: split of axis {a} (size {n}) into {sections} equal pieces")
        sizes = [n // sections] * sections
    else:
        sizes = list(sections)
        if sum(sizes) != n or min(sizes, default=0) < 0:
            raise CheckpointError(f"leaf {name!r}: split sizes {sizes} do not add up to axis {a} (size {n})")
    if not 0 <= part < len(sizes):
        raise CheckpointError(f"leaf {name!r}: split piece {part} of {len(sizes)}")
    start = sum(sizes[:part])
    return Node("slice", first.shape[:a] + (sizes[part],) + first.shape[a + 1:], first.dtype, kids, a,
                (start, start + sizes[part]))


def view_record(name: str, node: Node) -> LeafRecord:
    """The virtual saved leaf a view presents (its chunk grid is set when the wants are known)."""
    sdtype, encoding = storage_of(node.dtype)
    return LeafRecord(name, "jax.Array", node.shape, node.dtype.name, {"kind": "single_device"},
                      ZarrStorage(name, node.shape, sdtype.name, encoding, "none"))


def _grid(shape: tuple[int, ...], boxes: list[Box], itemsize: int, limit: int) -> tuple[int, ...]:
    """The chunk grid of a view leaf: the boxes' bounding box where they fill it and it tiles
    the shape (a process's devices' block is one chunk: each saved chunk under it is read
    once), else the coarsest grid whose boundaries include every box's; cut further (by the
    smallest prime factor of its largest side) until a chunk holds at most `limit` bytes."""
    unique = set(boxes)
    bound = tuple((min(b[d][0] for b in unique), max(b[d][1] for b in unique)) for d in range(len(shape)))
    sizes = [hi - lo for lo, hi in bound]
    if (sum(math.prod(hi - lo for lo, hi in b) for b in unique) == math.prod(sizes)
            and all(s and n % s == 0 and lo % s == 0 for s, n, (lo, _) in zip(sizes, shape, bound))):
        out = sizes
    else:
        out = list(common_grid(shape, unique))
    while math.prod(out) * itemsize > limit and max(out) > 1:
        d = out.index(max(out))
        out[d] //= next(p for p in range(2, out[d] + 1) if out[d] % p == 0)
    return tuple(out)


class ViewChunks:
    """What restore's reader needs of a Storage (``where``, ``read_chunk``) over view leaves: a
    chunk is a box of a view leaf, made of the saved regions under it (one region read each)."""

    caps = StoreCaps("view")  # (reads into fresh buffers, no read window)
    read_chunk_async = ChunkFiles.read_chunk_async  # (read_chunk on the reader's executor)

    def __init__(self, nodes: dict[str, Node], leaves: dict[str, LeafRecord], regions: Regions):
        self.nodes, self.leaves, self.regions = nodes, leaves, regions

    def where(self, key: str) -> str:
        return f"the view of leaf {key.rsplit('/', 1)[0]!r}"

    def read_chunk(self, path: str, index: tuple[int, ...], nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        node, rec = self.nodes[path], self.leaves[path]
        box = chunk_box(index, rec.zarr.chunk_shape, rec.shape)
        asked: dict[int, list[Box]] = {}
        for i, b in node.needs(box):
            if b not in asked.setdefault(i, []):
                asked[i].append(b)
        value = to_storage(node.make(box, self.regions(asked)))
        out = aligned_empty(nbytes)
        out[:value.nbytes] = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        return out


@dataclass(frozen=True)
class ViewIO:
    """What a source lends its views: its region reader, restore's reader over a view
    (``reader(storage, leaves)``: a Reader that does not verify; the saved regions are), and
    the host budget a view chunk is cut to fit (an eighth of it)."""

    regions: Regions
    reader: Callable[[Any, list[LeafRecord]], Any]
    budget: int


def build_view(wants: list, leaves: list[LeafRecord], nodes: dict[int, Node], io: ViewIO) -> dict[int, Any]:
    """The value of every wanted view leaf (``_Want.index`` into `leaves` and `nodes`)."""
    if not wants:
        return {}
    if io is None:
        raise CheckpointError("this source does not read views (rename= parts)")
    limit = io.budget
    for w in wants:
        rec, node = leaves[w.index], nodes[w.index]
        boxes = ([tuple((0, n) for n in rec.shape)] if w.sharding is None else
                 [index_to_box(idx, rec.shape) for idx in w.sharding.addressable_devices_indices_map(rec.shape).values()])
        chunks = _grid(rec.shape, boxes, node.dtype.itemsize, max(1, limit // 8))
        rec.storage = replace(rec.zarr, chunk_shape=chunks, chunk_checksums=(0,) * math.prod(chunk_grid(rec.shape, chunks)))
    storage = ViewChunks({leaves[w.index].zarr.path: nodes[w.index] for w in wants},
                         {leaves[w.index].zarr.path: leaves[w.index] for w in wants}, io.regions)
    return io.reader(storage, leaves).run(wants)
