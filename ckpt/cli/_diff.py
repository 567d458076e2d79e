"""`ckpt diff A B`: what differs between two checkpoints, values included.

Arrays are compared block by block: A's chunks, split further when a chunk is larger than the
block budget, are read from both checkpoints (B through its own chunking), so memory stays at
a few blocks (plus the chunks under them) whatever the checkpoint size. Blocks are read through
restore's own chunk reader, on any storage: every chunk is checked against its CRC-32C, and a
missing, short or corrupted chunk stops the diff with an error naming leaf, chunk and file
rather than comparing garbage.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from ckpt._format import ARRAY_KINDS, NUMPY_SCALAR, PY_BOOL, PY_FLOAT, PY_INT, display_path
from ckpt._format import dtype_from_name, from_storage
from ckpt._geometry import Box, box_shape, chunk_box, chunk_grid
from ckpt._host import Options, resolve
from ckpt._restore import Reader, RestoreStats, plan_leaf_read
from ckpt.cli._opened import Opened

DEFAULT_BLOCK_BYTES = 64 << 20


@dataclass
class ArrayDiff:
    path: str
    elements: int
    differing: int = 0
    max_abs_diff: float = 0.0

    @property
    def equal(self) -> bool:
        return self.differing == 0


@dataclass
class DiffReport:
    a: str
    b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    kind_changes: list[tuple[str, str, str]] = field(default_factory=list)
    shape_changes: list[tuple[str, list, list]] = field(default_factory=list)
    dtype_changes: list[tuple[str, str, str]] = field(default_factory=list)
    arrays: list[ArrayDiff] = field(default_factory=list)
    values: list[tuple[str, Any, Any]] = field(default_factory=list)  # non-array leaves
    # ('metrics' or 'user_metadata', key, A's value, B's value): only keys whose values differ;
    # MISSING where one side lacks the key.
    metadata: list[tuple[str, str, Any, Any]] = field(default_factory=list)
    bytes_compared: int = 0
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.kind_changes or self.shape_changes
                    or self.dtype_changes or any(not d.equal for d in self.arrays)
                    or any(not same_value(a, b) for _, a, b in self.values) or self.metadata)


class _Missing:
    def __repr__(self) -> str:
        return "(absent)"


MISSING = _Missing()


class _Source:
    """Regions of one saved array as logical-dtype numpy arrays, read as restore reads them."""

    def __init__(self, opened: Opened, index: int, options: Options):
        self.rec = rec = opened.manifest.leaves[index]
        self.index = index
        self.logical = dtype_from_name(rec.dtype)
        self.foreign = None
        if opened.format != "jax-ckpt":  # an Orbax checkpoint or safetensors (ckpt.cli._foreign)
            from ckpt.cli._foreign import leaf_reader

            self.chunk_shape, self.foreign = leaf_reader(opened, index, options)
            return
        self.chunk_shape = rec.chunk_shape
        self.reader = Reader(opened.storage, opened.manifest.leaves, True, RestoreStats(), options)

    def read(self, box: Box) -> np.ndarray:
        """The region `box`, reading (and verifying) only the chunks that overlap it."""
        if self.foreign is not None:
            return self.foreign(box)
        rec = self.rec
        plan = plan_leaf_read(self.index, rec.shape, self.chunk_shape, self.logical.itemsize, [box])
        return from_storage(self.reader.read([plan])[self.index][box], self.logical)


def same_value(x: Any, y: Any) -> bool:
    """Equality of two non-array leaf values, with NaN equal to NaN."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and x == y


def _blocks(shape: tuple[int, ...], chunk_shape: tuple[int, ...], max_elements: int) -> Iterator[Box]:
    """Boxes covering the array: each chunk, cut along its leading dimensions into pieces of at
    most `max_elements` elements (a single row of the last dimension may exceed it)."""
    piece = list(chunk_shape)
    for d in range(len(piece)):
        inner = math.prod(piece[d + 1:])
        if math.prod(piece) <= max_elements:
            break
        piece[d] = max(1, max_elements // max(inner, 1))
    for index in itertools.product(*(range(n) for n in chunk_grid(shape, chunk_shape))):
        cbox = chunk_box(index, chunk_shape, shape)
        ranges = [range(a, b, p) for (a, b), p in zip(cbox, piece)]
        for starts in itertools.product(*ranges):
            yield tuple((s, min(s + p, b)) for s, p, (_, b) in zip(starts, piece, cbox))


def _is_integer(dtype: np.dtype) -> bool:
    if dtype.kind in "biu":
        return True
    try:
        ml_dtypes.iinfo(dtype)
        return True
    except (ValueError, TypeError):
        return False


def compare_values(a: np.ndarray, b: np.ndarray, atol: float = 0.0, rtol: float = 0.0) -> tuple[int, float]:
    """(number of elements that differ by more than ``atol + rtol * |b|``, as numpy.isclose
    judges them, B the reference; largest |a - b| of all elements that are not equal); NaN
    equals NaN. With no tolerance, exact equality."""
    if atol or rtol:
        wide = np.complex128 if np.complexfloating in (a.dtype.type.__mro__ + b.dtype.type.__mro__) else np.float64
        x, y = a.astype(wide), b.astype(wide)
        unequal = (x != y) & ~(np.isnan(x) & np.isnan(y))
        if not unequal.any():
            return 0, 0.0
        d = np.abs(x[unequal] - y[unequal])
        beyond = ~(d <= atol + rtol * np.abs(y[unequal]))  # inf vs finite, NaN vs number: beyond
        return int(beyond.sum()), float(np.max(d))
    if _is_integer(a.dtype) and _is_integer(b.dtype):
        x = a if a.dtype.kind in "iu" and a.dtype.itemsize == 8 else a.astype(np.int64)
        y = b if b.dtype.kind in "iu" and b.dtype.itemsize == 8 else b.astype(np.int64)
        ne = x != y
        if not ne.any():
            return 0, 0.0
        return int(ne.sum()), float(np.max(np.abs(x[ne].astype(np.float64) - y[ne].astype(np.float64))))
    wide = np.complex128 if np.complexfloating in (a.dtype.type.__mro__ + b.dtype.type.__mro__) else np.float64
    x, y = a.astype(wide), b.astype(wide)
    ne = (x != y) & ~(np.isnan(x) & np.isnan(y))
    if not ne.any():
        return 0, 0.0
    return int(ne.sum()), float(np.max(np.abs(x[ne] - y[ne])))


def _diff_array(a: Opened, ia: int, b: Opened, ib: int, block_bytes: int, report: DiffReport,
                options: Options, pool: ThreadPoolExecutor) -> ArrayDiff:
    src_a, src_b = _Source(a, ia, options), _Source(b, ib, options)
    ra = src_a.rec
    out = ArrayDiff(ra.path, math.prod(ra.shape))
    if out.elements == 0:
        return out
    itemsize = max(src_a.logical.itemsize, src_b.logical.itemsize, 8)  # compared as 8-byte values
    for box in _blocks(tuple(ra.shape), src_a.chunk_shape, max(1, block_bytes // itemsize)):
        from_a = pool.submit(src_a.read, box)  # A and B are read at the same time
        y = src_b.read(box)
        x = from_a.result()
        n, worst = compare_values(x, y, report.atol, report.rtol)
        out.differing += n
        if worst:
            out.max_abs_diff = worst if math.isnan(worst) or worst > out.max_abs_diff else out.max_abs_diff
        report.bytes_compared += math.prod(box_shape(box)) * (src_a.logical.itemsize + src_b.logical.itemsize)
    return out


def _number(opened: Opened, index: int, options: Options) -> int | float | bool | None:
    """The leaf as a Python number when it is one: a Python int, float or bool, or a 0-d numpy
    scalar of such a dtype (read); None for anything else."""
    rec = opened.manifest.leaves[index]
    if rec.kind in (PY_INT, PY_FLOAT, PY_BOOL):
        return rec.py_value()
    if rec.kind != NUMPY_SCALAR or tuple(rec.shape) != () or dtype_from_name(rec.dtype).kind not in "biuf":
        return None
    value = _Source(opened, index, options).read(()).item()
    return value if isinstance(value, (int, float, bool)) else None


def _metadata_changes(a: Opened, b: Opened) -> list[tuple[str, str, Any, Any]]:
    """The metrics and user metadata keys whose values differ (the manifests' user metadata;
    a CheckpointManager step keeps its metrics there)."""
    from ckpt.cli._render import _metrics_of, _without_metrics

    out = []
    for what, get in (("metrics", _metrics_of), ("user_metadata", _without_metrics)):
        x, y = get(a.manifest.user_metadata), get(b.manifest.user_metadata)
        if x is None and y is None:
            continue
        if not isinstance(x, dict) or not isinstance(y, dict):
            if not same_value(x, y):
                out.append((what, "", MISSING if x is None else x, MISSING if y is None else y))
            continue
        for key in list(x) + [k for k in y if k not in x]:
            vx, vy = x.get(key, MISSING), y.get(key, MISSING)
            if not same_value(vx, vy):
                out.append((what, str(key), vx, vy))
    return out


def diff_checkpoints(a: Opened, b: Opened, block_bytes: int = DEFAULT_BLOCK_BYTES,
                     options: Options | None = None, atol: float = 0.0, rtol: float = 0.0) -> DiffReport:
    """Compare two opened checkpoints, values included (see the module docstring); arrays are
    equal where every element is within ``atol + rtol * |B|`` (default: exactly)."""
    opts = resolve(options)
    report = DiffReport(a.root, b.root, atol=atol, rtol=rtol)
    report.metadata = _metadata_changes(a, b)
    la = {r.path: r for r in a.manifest.leaves}
    lb = {r.path: r for r in b.manifest.leaves}
    index_a = {r.path: i for i, r in enumerate(a.manifest.leaves)}
    index_b = {r.path: i for i, r in enumerate(b.manifest.leaves)}
    report.only_a = [p for p in la if p not in lb]
    report.only_b = [p for p in lb if p not in la]
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-diff") as pool:
        for path, ra in la.items():
            rb = lb.get(path)
            if rb is None:
                continue
            array_a, array_b = ra.kind in ARRAY_KINDS, rb.kind in ARRAY_KINDS
            if not array_a or not array_b:
                x, y = _number(a, index_a[path], opts), _number(b, index_b[path], opts)
                if ra.kind == rb.kind:
                    report.values.append((path, ra.py_value(), rb.py_value()))
                elif x is not None and y is not None:
                    # A number saved as a 0-d numpy scalar on one side and a Python number on the
                    # other (Orbax keeps a Python int as a scalar array; convert and jax-ckpt keep
                    # the int): compared as values, not reported as a change of kind.
                    report.values.append((path, x, y))
                else:
                    report.kind_changes.append((path, ra.kind, rb.kind))
                continue
            if (ra.kind == "prng_key") != (rb.kind == "prng_key") or ra.prng_impl != rb.prng_impl:
                report.kind_changes.append((path, f"{ra.kind} {ra.prng_impl or ''}".strip(),
                                            f"{rb.kind} {rb.prng_impl or ''}".strip()))
                continue
            if ra.dtype != rb.dtype:
                report.dtype_changes.append((path, ra.dtype, rb.dtype))
            if tuple(ra.shape) != tuple(rb.shape):
                report.shape_changes.append((path, list(ra.shape), list(rb.shape)))
                continue
            report.arrays.append(_diff_array(a, index_a[path], b, index_b[path], block_bytes, report, opts, pool))
    return report


def diff_document(r: DiffReport) -> dict:
    """What `diff --json` prints."""
    from ckpt.cli._render import json_safe

    return {
        "a": r.a, "b": r.b, "identical": r.identical,
        "only_in_a": r.only_a, "only_in_b": r.only_b,
        "kind_changed": [{"path": p, "a": x, "b": y} for p, x, y in r.kind_changes],
        "shape_changed": [{"path": p, "a": x, "b": y} for p, x, y in r.shape_changes],
        "dtype_changed": [{"path": p, "a": x, "b": y} for p, x, y in r.dtype_changes],
        "arrays": [{"path": d.path, "equal": d.equal, "elements": d.elements, "differing": d.differing,
                    "max_abs_diff": json_safe(d.max_abs_diff)} for d in r.arrays],
        "values": [{"path": p, "equal": same_value(x, y), "a": json_safe(x), "b": json_safe(y)} for p, x, y in r.values],
        "metadata_changed": [{"in": w, "key": k, "a": None if x is MISSING else json_safe(x),
                              "b": None if y is MISSING else json_safe(y), "only_in": "b" if x is MISSING else
                              "a" if y is MISSING else None} for w, k, x, y in r.metadata],
        "atol": r.atol, "rtol": r.rtol,
    }


def render_diff(r: DiffReport) -> str:
    """The report as text: one section per kind of difference, then a summary line."""
    from ckpt.cli._render import plural

    out = [f"A: {r.a}", f"B: {r.b}"]

    def section(title: str, lines: list[str]) -> None:
        if lines:
            out.append(f"{title} ({len(lines)}):")
            out.extend("  " + line for line in lines)

    section("only in A", [display_path(p) for p in r.only_a])
    section("only in B", [display_path(p) for p in r.only_b])
    section("kind changed", [f"{display_path(p)}: {x} -> {y}" for p, x, y in r.kind_changes])
    section("shape changed", [f"{display_path(p)}: {x} -> {y}" for p, x, y in r.shape_changes])
    section("dtype changed", [f"{display_path(p)}: {x} -> {y}" for p, x, y in r.dtype_changes])
    width = max([len(display_path(d.path)) for d in r.arrays] + [0])
    section("arrays", [
        f"{display_path(d.path):<{width}}  " + (
            ("equal" if not d.max_abs_diff else f"equal within tolerance  max |a-b| = {d.max_abs_diff:.6g}")
            if d.equal else
            f"differ  max |a-b| = {d.max_abs_diff:.6g}  ({d.differing} of {plural(d.elements, 'element')})")
        for d in r.arrays
    ])
    section("values", [
        f"{display_path(p)}: " + ("equal" if same_value(x, y) else f"{x!r} -> {y!r}") for p, x, y in r.values
    ])
    section("metadata changed", [f"{w}{'.' + k if k else ''}: {x!r} -> {y!r}" for w, k, x, y in r.metadata])
    differ = sum(not d.equal for d in r.arrays)
    changed = sum(not same_value(x, y) for _, x, y in r.values)
    tolerance = f" within atol={r.atol:g}, rtol={r.rtol:g}" if r.atol or r.rtol else ""
    out.append(
        f"summary: {'identical' if r.identical else 'different'}{tolerance}; {plural(len(r.arrays), 'common array')} compared "
        f"({len(r.arrays) - differ} equal, {differ} differ), {changed} of {len(r.values)} values changed, "
        f"{len(r.only_a)} only in A, {len(r.only_b)} only in B, {len(r.shape_changes)} shape and "
        f"{len(r.dtype_changes)} dtype changes" + (f", {len(r.metadata)} metadata change(s)" if r.metadata else "")
    )
    return "\n".join(out)
