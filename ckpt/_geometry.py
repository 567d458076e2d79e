"""Boxes, chunk grids and shardings: the geometry the plans work in (pure, no I/O).

A *box* is a region of an array as ((start, stop), ...) per dimension. A device's shard,
a chunk of a saved array, and a region a restore needs are all boxes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

Box = tuple[tuple[int, int], ...]


def index_to_box(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """Box for a tuple of slices (as in Sharding.devices_indices_map)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    box = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {index}")
        box.append((start, stop))
    return tuple(box)


def box_to_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    return math.prod(box_shape(box))


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices selecting `inner` inside an array holding `outer`."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def chunk_grid(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Number of chunks along each dimension."""
    return tuple(-(-n // c) for n, c in zip(shape, chunk_shape))


def chunk_box(index: Sequence[int], chunk_shape: Sequence[int], shape: Sequence[int]) -> Box:
    return tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(index, chunk_shape, shape))


def chunk_index_of(box: Box, chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Index of the chunk that starts at `box`'s corner."""
    return tuple(a // c for (a, _), c in zip(box, chunk_shape))


def chunks_overlapping(box: Box, chunk_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Indices of every chunk that overlaps `box`, in row-major order (`count_overlapping` of
    them: callers planning from a checkpoint's claims check that count against their budget
    before asking for the list)."""
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunk_shape)]
    return list(itertools.product(*ranges))


def count_overlapping(box: Box, chunk_shape: Sequence[int]) -> int:
    """How many chunks overlap `box` (the length of ``chunks_overlapping``), without listing them."""
    return math.prod(max(0, -(-b // c) - a // c) for (a, b), c in zip(box, chunk_shape))


def flat_chunk_index(index: Sequence[int], grid: Sequence[int]) -> int:
    """Row-major position of a chunk in its grid (the order of recorded checksums)."""
    flat = 0
    for i, n in zip(index, grid):
        flat = flat * n + i
    return flat


def chunk_key(index: Sequence[int]) -> str:
    """Zarr v3 default chunk key ('c/0/1'; 'c' for a 0-d array)."""
    return "/".join(["c", *map(str, index)])


Spec = tuple  # normalised PartitionSpec: entries are None, an axis name, or a tuple of names


def normalize_spec(spec: Iterable, ndim: int | None = None) -> Spec:
    """Spec entries as None / name / tuple of names; padded with None to `ndim` if given.

    ``P.UNCONSTRAINED`` becomes None: on an array that exists (what a save sees) JAX lays such a
    dimension out unsplit, exactly as None."""
    out = []
    for entry in spec:
        if _is_unconstrained(entry):
            out.append(None)
        elif entry is None or isinstance(entry, str):
            out.append(entry)
        else:
            names = tuple(entry)
            out.append(names[0] if len(names) == 1 else (names or None))
    if ndim is not None:
        out += [None] * (ndim - len(out))
    return tuple(out)


def _is_unconstrained(entry) -> bool:
    # jax.sharding.PartitionSpec.UNCONSTRAINED, recognised by type name so that this module
    # keeps from importing jax.
    return type(entry).__name__ == "UnconstrainedSingleton"


def fit_spec(spec: Spec, ndim: int) -> Spec:
    """A normalised `spec` cut to `ndim` entries.

    JAX accepts a PartitionSpec longer than the array's rank when the extra entries are None
    (``P(None)`` on a 0-d array, ``P('x', None, None)`` on a 1-d one): they shard nothing. A
    manifest records exactly one entry per dimension at most (readers refuse more), so those
    entries are dropped. An extra entry that names mesh axes would mean a layout no array of this
    rank has: ValueError."""
    extra = [e for e in spec[ndim:] if e is not None]
    if extra:
        raise ValueError(f"PartitionSpec {spec} shards over mesh axes {extra} beyond the array's {ndim} dimensions")
    return tuple(spec[:ndim])


def spec_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_fit_problem(shape: Sequence[int], spec: Iterable, axis_names: Sequence[str],
                     axis_sizes: Sequence[int]) -> str | None:
    """Why a saved PartitionSpec cannot lay out an array of `shape` on a mesh with these axes
    (an axis the mesh lacks, or a dimension its axes do not divide), or None when it can.
    The one check restore(mesh=) and `ckpt plan` both make."""
    sizes = dict(zip(axis_names, axis_sizes))
    for dim, entry in enumerate(spec):
        axes = spec_axes(entry)
        for a in axes:
            if a not in sizes:
                return f"saved PartitionSpec uses mesh axis {a!r}, which the mesh {tuple(axis_names)} does not have"
        parts = math.prod(sizes[a] for a in axes)
        if shape[dim] % parts:
            return (f"dimension {dim} of size {shape[dim]} cannot be split over mesh axis "
                    f"{'x'.join(axes)} of size {parts}")
    return None


@dataclass(frozen=True)
class ShardingInfo:
    """How an array was sharded when saved, in terms that do not need the devices.

    kind: 'named' (a mesh and PartitionSpec), 'single_device', or 'other'.
    """

    kind: str
    axis_names: tuple[str, ...] | None = None
    axis_sizes: tuple[int, ...] | None = None
    spec: Spec | None = None

    def to_record(self) -> dict:
        rec: dict = {"kind": self.kind}
        if self.kind == "named":
            rec["mesh"] = {"axis_names": list(self.axis_names), "axis_sizes": list(self.axis_sizes)}
            rec["spec"] = [e if e is None or isinstance(e, str) else list(e) for e in self.spec]
        return rec

    @classmethod
    def from_record(cls, rec: dict | None) -> "ShardingInfo | None":
        if rec is None:
            return None
        if rec["kind"] != "named":
            return cls(rec["kind"])
        spec = tuple(e if e is None or isinstance(e, str) else tuple(e) for e in rec["spec"])
        mesh = rec["mesh"]
        return cls("named", tuple(mesh["axis_names"]), tuple(mesh["axis_sizes"]), spec)


def describe_sharding(sharding, ndim: int | None = None) -> ShardingInfo:
    """ShardingInfo of a jax.sharding.Sharding; with `ndim` (the array's rank), its spec is cut
    to that many entries (`fit_spec`)."""
    import jax

    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        names = tuple(mesh.axis_names)
        spec = normalize_spec(sharding.spec)
        if ndim is not None:
            spec = fit_spec(spec, ndim)
        return ShardingInfo("named", names, tuple(int(mesh.shape[n]) for n in names), spec)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return ShardingInfo("single_device")
    return ShardingInfo("other")


def named_boxes(
    shape: Sequence[int], axis_names: Sequence[str], axis_sizes: Sequence[int], spec: Spec
) -> dict[tuple[int, ...], Box]:
    """Box of every mesh position (row-major mesh coordinates) under NamedSharding(mesh, spec).

    Pure: the same layout jax computes, for meshes that need not exist on this machine.
    Raises ValueError naming the axis when a dimension is not divisible.
    """
    sizes = dict(zip(axis_names, axis_sizes))
    spec = normalize_spec(spec, len(shape))
    per_dim = []
    for dim, (n, entry) in enumerate(zip(shape, spec)):
        axes = spec_axes(entry)
        for a in axes:
            if a not in sizes:
                raise ValueError(f"mesh has no axis {a!r} (dimension {dim})")
        parts = math.prod(sizes[a] for a in axes)
        if n % parts:
            raise ValueError(
                f"dimension {dim} of size {n} is not divisible by mesh axes {list(axes)} of total size {parts}"
            )
        per_dim.append((axes, n // parts))
    out = {}
    for coord in itertools.product(*(range(s) for s in axis_sizes)):
        pos = dict(zip(axis_names, coord))
        box = []
        for (axes, step), n in zip(per_dim, shape):
            k = 0
            for a in axes:
                k = k * sizes[a] + pos[a]
            box.append((k * step, (k + 1) * step) if axes else (0, n))
        out[coord] = tuple(box)
    return out


def common_grid(shape: tuple[int, ...], boxes: list[Box]) -> tuple[int, ...]:
    """The coarsest chunk shape whose chunk boundaries include every box's (each box is whole
    chunks): per dimension, the greatest common divisor of the extent and the boxes' bounds."""
    out = []
    for d, n in enumerate(shape):
        g = n
        for b in boxes:
            g = math.gcd(math.gcd(g, b[d][0]), b[d][1])
        out.append(max(1, g))
    return tuple(out)


# ---- a reshape as regions: a box of the new shape as boxes of the old one ----------------------

def reshape_groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The runs of axes a reshape maps onto each other: [((old lo, old hi), (new lo, new hi))],
    each pair of runs of one size (a reshape splits and merges adjacent axes, C order). The
    shapes hold no zero and have one size."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        i0, j0, a, b = i, j, 1, 1
        if i < len(old):
            a, i = old[i], i + 1
        if j < len(new):
            b, j = new[j], j + 1
        while a != b:
            if a < b:
                a, i = a * old[i], i + 1
            else:
                b, j = b * new[j], j + 1
        while i < len(old) and old[i] == 1 and (j == len(new) or new[j] != 1):  # (a trailing 1 joins)
            i += 1
        groups.append(((i0, i), (j0, j)))
    return groups


def _flat_runs(box: Box, shape: Sequence[int]) -> list[tuple[int, int]]:
    """The C-order flat ranges of `box` within `shape`, in order, adjacent ones joined."""
    d = len(box)
    while d > 0 and box[d - 1] == (0, shape[d - 1]):
        d -= 1  # box[d:] is whole: each run spans it
    inner = math.prod(shape[d:])
    if d == 0:
        return [(0, inner)]
    lo, hi = box[d - 1]
    runs: list[tuple[int, int]] = []
    for outer in itertools.product(*(range(a, b) for a, b in box[:d - 1])):
        base = 0
        for k, n in zip(outer, shape[:d - 1]):
            base = base * n + k
        start, stop = (base * shape[d - 1] + lo) * inner, (base * shape[d - 1] + hi) * inner
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], stop)
        else:
            runs.append((start, stop))
    return runs


def _run_boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """The boxes of `shape` the flat range [start, stop) is made of, in C order (each one's own
    C order is increasing flat order)."""
    if start >= stop:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    a, r = divmod(start, inner)
    b, s = divmod(stop, inner)
    if a == b:
        return [((a, a + 1),) + x for x in _run_boxes(r, s, shape[1:])]
    out: list[Box] = []
    if r:
        out += [((a, a + 1),) + x for x in _run_boxes(r, inner, shape[1:])]
        a += 1
    if b > a:
        out.append(((a, b),) + full_box(shape[1:]))
    if s:
        out += [((b, b + 1),) + x for x in _run_boxes(0, s, shape[1:])]
    return out


def reshape_pieces(box: Box, old: Sequence[int], new: Sequence[int]) -> list[list[Box]]:
    """A box of shape `new` as boxes of shape `old`, group by group (``reshape_groups``): for each
    group, the boxes over its old axes whose values, flattened in turn, are the values of the
    box's new axes of that group, flattened. The box's values are then the product of the
    groups' pieces (one old box per choice of a piece in each group), placed group by group."""
    out = []
    for (i0, i1), (j0, j1) in reshape_groups(old, new):
        pieces = []
        for start, stop in _flat_runs(box[j0:j1], new[j0:j1]):
            pieces += _run_boxes(start, stop, old[i0:i1])
        out.append(pieces)
    return out
