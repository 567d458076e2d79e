"""Save and restore plans: which process writes or reads which region. Pure functions of
shapes, shardings and process indices; no I/O, no devices needed, deterministic, so every
process of a job computes the same plan on its own.

Size: the restore's pure planning (wants from a target or a mesh, regions, chunks, the budget's
plan) and the one skeleton every source restores through.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.tree_util as jtu
import ml_dtypes
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ckpt._errors import CheckpointError, TreeMismatchError
from ckpt._format import ARRAY_KINDS, PRNG_KEY, LeafRecord, display_path, leaf_components, match_target, unflatten
from ckpt._format import dtype_from_name
from ckpt._geometry import (Box, ShardingInfo, box_size, chunk_box, chunks_overlapping, count_overlapping,
                            mesh_fit_problem, normalize_spec, spec_axes)
from ckpt._restore.surgery_source import check_rename, pair_leaves
from ckpt._restore.view_source import ViewIO, build_view

# restore(partial=MATCHING): fill the leaves the checkpoint has; return the others' key paths.
MATCHING = "matching"

# What planning one chunk holds (its ChunkRead, index and box tuples, its place in the regions'
# lists: measured 340-390 bytes with tracemalloc, about as much again in the reader's maps of
# pieces and sources; 1 KiB leaves a margin): a plan of more chunks
# than the host budget holds at this rate is refused before it is built, so a checkpoint that
# claims 2**40 chunks (format version 3 records them outside the manifest) allocates nothing.
PLAN_BYTES_PER_CHUNK = 1024
# Plans of up to this many bytes are made whatever the budget (a budget of a few KiB, which cuts
# reads into small batches, still plans the 65,536 chunks a manifest of versions 1 and 2 can list
# in 320 KiB).
PLAN_ALLOWANCE = 64 << 20


def plan_budget(budget: int | None) -> int:
    """The bytes plans may take under a host budget of `budget` (None: that of Options())."""
    if budget is None:
        from ckpt._host import Options

        budget = Options().resolved().host_budget_bytes
    return max(budget, PLAN_ALLOWANCE)


def check_plan_size(chunks: int, budget: int | None, what: str) -> None:
    """CheckpointError when planning `chunks` chunks would take more than `budget` bytes of
    host memory (None: ``plan_budget(None)``)."""
    budget = plan_budget(None) if budget is None else budget
    if chunks * PLAN_BYTES_PER_CHUNK > budget:
        raise CheckpointError(f"{what}: reading it takes {chunks} chunks, whose plan alone ({PLAN_BYTES_PER_CHUNK} "
                              f"bytes a chunk) exceeds the host budget of {budget} bytes")


@dataclass(frozen=True)
class ChunkRead:
    index: tuple[int, ...]
    box: Box
    nbytes: int


@dataclass(frozen=True)
class RegionRead:
    """A region some local devices need, and the chunks (by index) that cover it."""

    box: Box
    chunks: tuple[tuple[int, ...], ...]
    nbytes: int


@dataclass(frozen=True)
class LeafReadPlan:
    leaf: int
    regions: tuple[RegionRead, ...]
    chunks: tuple[ChunkRead, ...]  # unique: each chunk is read once for all regions

    @functools.cached_property
    def bytes_read(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @functools.cached_property
    def bytes_needed(self) -> int:
        return sum(r.nbytes for r in self.regions)


def plan_leaf_read(
    leaf: int,
    shape: Sequence[int],
    chunk_shape: Sequence[int],
    itemsize: int,
    boxes: Iterable[Box],
    budget: int | None = None,
) -> LeafReadPlan:
    """Unique regions out of `boxes` and the unique chunks to read for them; CheckpointError
    when their chunks are more than `budget` can plan (``check_plan_size``)."""
    regions, chunks = [], {}
    boxes = sorted(set(boxes))
    check_plan_size(sum(count_overlapping(b, chunk_shape) for b in boxes), budget, f"leaf {leaf}")
    for box in boxes:
        idx = tuple(chunks_overlapping(box, chunk_shape))
        regions.append(RegionRead(box, idx, box_size(box) * itemsize))
        for i in idx:
            if i not in chunks:
                cbox = chunk_box(i, chunk_shape, shape)
                chunks[i] = ChunkRead(i, cbox, box_size(cbox) * itemsize)
    return LeafReadPlan(leaf, tuple(regions), tuple(chunks[i] for i in sorted(chunks)))


def batch_by_budget(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Split positions 0..n-1 into consecutive batches whose sizes sum to at most `budget`
    (a single item over budget forms a batch of its own)."""
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > budget:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        batches.append(current)
    return batches


@dataclass
class _Want:
    """What to build for one saved array leaf."""

    index: int
    sharding: jax.sharding.Sharding | None  # None: a numpy array on the host
    dtype: np.dtype  # logical dtype to return (of the key data for PRNG keys)
    # A device layout other than the default one for the shard (jax.experimental.layout
    # Layout); None: the default. Placed with Format(layout, device).
    layout: Layout | None = None
    lossy_ok: bool = False  # allow_lossy_cast: a cast is not checked (cast_values)


def _key_trailing(impl: str) -> int:
    return len(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape)


def _key_data_sharding(sharding, rec: LeafRecord):
    trailing = _key_trailing(rec.prng_impl)
    if isinstance(sharding, NamedSharding):
        spec = normalize_spec(sharding.spec, len(rec.shape) - trailing)
        return NamedSharding(sharding.mesh, PartitionSpec(*spec, *([None] * trailing)),
                             memory_kind=sharding.memory_kind)
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    raise CheckpointError(f"leaf {display_path(rec.path)!r}: PRNG keys restore onto NamedSharding or a single device")


def logical_shape(rec: LeafRecord) -> tuple[int, ...]:
    """Shape as the user sees it (for PRNG keys, without the key data's trailing dims)."""
    if rec.kind == PRNG_KEY:
        return rec.shape[: len(rec.shape) - _key_trailing(rec.prng_impl)]
    return rec.shape


def _want_from_target(i: int, rec: LeafRecord, t: Any, allow_lossy_cast: bool = False) -> _Want | None:
    if rec.kind not in ARRAY_KINDS:
        return None
    shape, name = logical_shape(rec), display_path(rec.path)
    saved_dtype = dtype_from_name(rec.dtype)
    if isinstance(t, Format):
        # jax.experimental.layout.Format(layout, sharding): as a bare sharding (the saved dtype),
        # in that layout. Without a sharding there is nowhere to place it: refused, not numpy.
        if t.sharding is None:
            raise CheckpointError(f"leaf {name!r}: the target {t} has no sharding; a Format target needs "
                                  "Format(layout, sharding) with a concrete sharding")
        sharding = _concrete(t.sharding, name)
        return _device_want(i, rec, sharding, saved_dtype, saved_dtype, t.layout, allow_lossy_cast)
    if isinstance(t, jax.sharding.Sharding):
        return _device_want(i, rec, _concrete(t, name), saved_dtype, saved_dtype, None, allow_lossy_cast)
    if isinstance(t, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"leaf {name!r}: target shape {tuple(t.shape)} does not match saved shape {tuple(shape)}")
        is_key = jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key)
        if is_key != (rec.kind == PRNG_KEY):
            raise CheckpointError(f"leaf {name!r}: target dtype {t.dtype} but the checkpoint holds {rec.kind} {rec.dtype}")
        dtype = saved_dtype if is_key else np.dtype(t.dtype)
        if isinstance(t, np.ndarray):
            _check_cast_kind(name, saved_dtype, dtype, allow_lossy_cast)
            return _Want(i, None, dtype, lossy_ok=allow_lossy_cast)
        sharding = t.sharding or SingleDeviceSharding(jax.local_devices()[0])
        # A ShapeDtypeStruct made with sharding=Format(layout, ...) (or .like of an array), or an
        # array in a layout: that layout, where it is not the device's default. (Typed key
        # arrays have no format.)
        layout = getattr(getattr(t, "format", None), "layout", None)
        return _device_want(i, rec, _concrete(sharding, name), saved_dtype, dtype, layout, allow_lossy_cast)
    return _Want(i, None, saved_dtype)  # any other target leaf: as saved, on the host


def _device_want(i: int, rec: LeafRecord, sharding: jax.sharding.Sharding, saved: np.dtype, asked: np.dtype,
                 layout: Any, allow_lossy_cast: bool) -> _Want:
    """A leaf placed on devices: in the dtype a device holds for `asked` (without
    jax_enable_x64, 64-bit types are held in 32 bits: casting on the host checks the values,
    where device_put would wrap them silently), in `layout` where it is not the default."""
    name = display_path(rec.path)
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(asked))
    _check_cast_kind(name, saved, dtype, allow_lossy_cast)
    _check_fits(name, tuple(logical_shape(rec)), sharding)
    layout = _custom_layout(name, rec, sharding, dtype, layout)
    return _Want(i, sharding, dtype, layout, allow_lossy_cast)


def _check_fits(name: str, shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> None:
    """CheckpointError naming the leaf where `sharding` cannot lay out `shape` (a dimension its
    mesh axes do not divide, more PartitionSpec entries than dimensions), before anything is
    read: JAX would raise deep inside the placement, naming no leaf. JAX's ``shard_shape`` (cached)
    decides first: 0.7 us a leaf where the sharding fits, against 4.3 us for ``mesh_fit_problem``
    on every leaf (timeit, this 2-core machine shared with other work), which only explains a
    refusal."""
    try:
        sharding.shard_shape(shape)
        return
    except Exception as e:  # noqa: BLE001 (any sharding type: said in its own words, with the leaf)
        error = e
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if len(spec) > len(shape):
            raise CheckpointError(f"leaf {name!r}: the target's PartitionSpec {sharding.spec} has {len(spec)} "
                                  f"entries, but the array has {len(shape)} dimensions (shape {shape})")
        names = tuple(sharding.mesh.axis_names)
        why = mesh_fit_problem(shape, normalize_spec(spec), names, tuple(sharding.mesh.shape[a] for a in names))
        if why is not None:
            raise CheckpointError(f"leaf {name!r}: {why} (the target's sharding is {sharding.spec}); "
                                  "give it a PartitionSpec whose axes divide the shape")
    raise CheckpointError(f"leaf {name!r}: the target's sharding {sharding} cannot lay out shape {shape}: "
                          f"{type(error).__name__}: {error}") from None


@functools.lru_cache(maxsize=1024)
def _default_layout(device, dtype: np.dtype, shard_shape: tuple[int, ...]) -> Layout:
    """The layout `device` gives a shard by default (asked once per kind of shard: leaves of a
    model share a handful)."""
    try:
        return Layout.from_pjrt_layout(device.client.get_default_layout(dtype, shard_shape, device))
    except Exception:  # noqa: BLE001 (a backend that does not say, or a key dtype: row-major)
        return Layout(tuple(range(len(shard_shape))))


def _custom_layout(name: str, rec: LeafRecord, sharding: jax.sharding.Sharding, dtype: np.dtype,
                   layout: Any) -> Layout | None:
    """`layout` where it differs from the devices' default for this leaf's shards; None where it
    is the default (placing with it would only add a copy) or not given. A layout that cannot
    be restored into is refused naming the leaf."""
    if layout is None:
        return None
    if not isinstance(layout, Layout):  # Layout.AUTO: the compiler's choice, not a layout to restore into
        asked = "Layout.AUTO" if layout is Layout.AUTO else layout  # (jax 0.12 prints it AutoLayout)
        raise CheckpointError(f"leaf {name!r}: the target asks for layout {asked}; restore into a concrete "
                              "jax.experimental.layout.Layout (or none: the default), then let jit relayout it")
    shape = logical_shape(rec)
    if sorted(layout.major_to_minor) != list(range(len(shape))):
        raise CheckpointError(f"leaf {name!r}: layout major_to_minor={layout.major_to_minor} is not a permutation "
                              f"of the {len(shape)} dimensions of shape {tuple(shape)}")
    devices = sharding.addressable_devices or sharding.device_set
    default = _default_layout(min(devices, key=lambda d: d.id), dtype, tuple(sharding.shard_shape(shape)))
    # As jax compares a user's layout with a device's: without a tiling, by dimension order.
    same = layout.major_to_minor == default.major_to_minor if not layout.tiling else layout == default
    if same:
        return None
    if rec.kind == PRNG_KEY:
        raise CheckpointError(f"leaf {name!r}: a PRNG key array restores in the default layout only "
                              f"(the target asks for {layout})")
    return layout


def _concrete(sharding: jax.sharding.Sharding, name: str) -> jax.sharding.Sharding:
    """A target sharding on an AbstractMesh (jax.eval_shape / nnx.eval_shape under
    ``jax.set_mesh``) on the concrete mesh in context."""
    if not (isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh)):
        return sharding
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        raise CheckpointError(f"leaf {name!r}: the target's sharding is on an abstract mesh ({_mesh_text(sharding.mesh)}) "
                              "and no mesh is set; restore inside `with jax.set_mesh(mesh)` with a mesh of that "
                              "shape, or give shardings on a concrete mesh")
    if mesh.abstract_mesh != sharding.mesh:
        # The abstract state was built under another mesh (e.g. 4x2, restored under 2x4): its
        # shardings cannot be moved to this one; built again here, they are on it.
        ours, theirs = _mesh_text(sharding.mesh), _mesh_text(mesh.abstract_mesh)
        if ours == theirs:  # same names and sizes: the axis types differ
            ours, theirs = _mesh_text(sharding.mesh, types=True), _mesh_text(mesh.abstract_mesh, types=True)
        raise CheckpointError(
            f"leaf {name!r}: the target's sharding is on an abstract mesh ({ours}) that does not match the mesh "
            f"of the enclosing `jax.set_mesh` ({theirs}); build the abstract target again under this mesh "
            "(`with jax.set_mesh(mesh): target = jax.eval_shape(...)`, or nnx.eval_shape) and restore into it")
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _mesh_text(mesh: jax.sharding.AbstractMesh, *, types: bool = False) -> str:
    """'data=4, model=2' (with `types`: 'data=4 Explicit, ...')."""
    kinds = getattr(mesh, "axis_types", None) or (None,) * len(mesh.axis_names)
    return ", ".join(f"{n}={s}" + (f" {getattr(t, 'name', t)}" if types else "")
                     for n, s, t in zip(mesh.axis_names, mesh.axis_sizes, kinds))


def _want_for_mesh(i: int, rec: LeafRecord, mesh: jax.sharding.Mesh, allow_lossy_cast: bool = False,
                   axis_names: dict[str, str] | None = None) -> _Want | None:
    """The leaf on `mesh` with its saved PartitionSpec, each saved axis name renamed through
    `axis_names` (saved name -> `mesh`'s; checked by ``check_axis_names``)."""
    if rec.kind not in ARRAY_KINDS:
        return None
    dtype = dtype_from_name(rec.dtype)
    if rec.kind not in ("jax.Array", PRNG_KEY):
        return _Want(i, None, dtype)
    info, name = ShardingInfo.from_record(rec.sharding), display_path(rec.path)
    shape = logical_shape(rec)
    if info.kind == "single_device":
        spec = ()
    elif info.kind == "named":
        spec = info.spec
    else:
        raise CheckpointError(f"leaf {name!r} was saved with a sharding that has no PartitionSpec; pass a target")
    if axis_names:
        spec = tuple(_renamed_entry(e, axis_names) for e in spec)
    names = tuple(mesh.axis_names)
    lacking = [a for e in spec for a in spec_axes(e) if a not in names]
    if lacking:
        raise _MissingAxes(name, lacking, info, mesh)
    why = mesh_fit_problem(shape, spec, names, tuple(mesh.shape[a] for a in names))
    if why is not None:
        raise CheckpointError(f"leaf {name!r}: {why}")
    return _device_want(i, rec, NamedSharding(mesh, PartitionSpec(*spec)), dtype, dtype, None, allow_lossy_cast)


def _renamed_entry(entry: Any, axis_names: dict[str, str]) -> Any:
    if entry is None:
        return None
    if isinstance(entry, str):
        return axis_names.get(entry, entry)
    return tuple(axis_names.get(a, a) for a in entry)


class _MissingAxes(CheckpointError):
    """A leaf's saved PartitionSpec names axes the target mesh lacks (``wants_for_mesh`` gathers
    these into one error over every leaf)."""

    def __init__(self, leaf: str, lacking: list[str], info: ShardingInfo, mesh: jax.sharding.Mesh) -> None:
        self.leaf, self.lacking = leaf, lacking
        self.saved = tuple(zip(info.axis_names or (), info.axis_sizes or ()))
        super().__init__(f"leaf {leaf!r}: saved PartitionSpec uses mesh axis {lacking[0]!r}, which the mesh "
                         f"{tuple(mesh.axis_names)} does not have")


# Leaves named in the error of a mesh that lacks saved axes; the rest are counted.
_SHOWN_LEAVES = 5


def check_axis_names(axis_names: Any, mesh: jax.sharding.Mesh | None) -> dict[str, str] | None:
    """`axis_names` (``restore(axis_names=)``: saved axis name -> name of an axis of `mesh`) as a
    dict, or ValueError / TypeError naming the entry at fault."""
    if axis_names is None:
        return None
    if mesh is None:
        raise ValueError("axis_names renames the saved mesh axes for mesh=; pass it with mesh= "
                         "(with a target, the target's shardings say where each array goes)")
    if not isinstance(axis_names, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in axis_names.items()):
        raise TypeError(f"axis_names must be a dict of saved axis name -> mesh axis name (str -> str), "
                        f"got {axis_names!r}")
    names = tuple(mesh.axis_names)
    for saved, new in axis_names.items():
        if new not in names:
            raise ValueError(f"axis_names maps {saved!r} to {new!r}, which is not an axis of the mesh {names}")
    targets = list(axis_names.values())
    for new in set(targets):
        if targets.count(new) > 1:
            raise ValueError(f"axis_names maps {[k for k, v in axis_names.items() if v == new]} all to {new!r}; "
                             "each mesh axis takes one saved axis")
    return dict(axis_names)


def wants_for_mesh(indexed: Iterable[tuple[int, LeafRecord]], mesh: jax.sharding.Mesh,
                   allow_lossy_cast: bool = False, axis_names: Any = None) -> list[_Want | None]:
    """``_want_for_mesh`` of every (index, record); where saved axes are missing from `mesh`,
    one CheckpointError over all the leaves: how many and which (the first few), the saved
    and the target axis names, and the ``axis_names=`` mapping that would fit where one can
    be guessed (axes of the same size, in mesh order)."""
    mapping = check_axis_names(axis_names, mesh)
    out: list[_Want | None] = []
    missing: list[_MissingAxes] = []
    for i, rec in indexed:
        try:
            out.append(_want_for_mesh(i, rec, mesh, allow_lossy_cast, mapping))
        except _MissingAxes as e:
            missing.append(e)
            out.append(None)
    if missing:
        raise CheckpointError(_missing_axes_message(missing, mesh, mapping or {}))
    return out


def _missing_axes_message(missing: list[_MissingAxes], mesh: jax.sharding.Mesh, mapping: dict[str, str]) -> str:
    names = tuple(mesh.axis_names)
    target = ", ".join(f"{a!r}: {mesh.shape[a]}" for a in names)
    saved_meshes = list(dict.fromkeys(e.saved for e in missing))
    saved = "; ".join("(" + ", ".join(f"{a!r}: {n}" for a, n in m) + ")" for m in saved_meshes)
    shown = ", ".join(f"{e.leaf!r} ({', '.join(map(repr, e.lacking))})" for e in missing[:_SHOWN_LEAVES])
    more = f" and {len(missing) - _SHOWN_LEAVES} more" if len(missing) > _SHOWN_LEAVES else ""
    # The saved axes the mesh lacks (saved names, in the saved mesh's order), paired in order
    # with the mesh's axes no saved axis takes: a guess, shown as one.
    inverse = {v: k for k, v in mapping.items()}
    lacking = {inverse.get(a, a) for e in missing for a in e.lacking}
    order = [a for m in saved_meshes for a, _ in m]
    lacking_saved = [a for a in dict.fromkeys(order) if a in lacking] + sorted(lacking - set(order))
    used = {mapping.get(a, a) for a in order} & set(names)
    free = [a for a in names if a not in used]
    hint = ("map each saved axis name to one of the mesh's with axis_names={'<saved name>': '<mesh axis>'}")
    if len(free) == len(lacking_saved):
        guess = {**mapping, **dict(zip(lacking_saved, free))}
        hint = (f"if they are the same axes under other names, restore with axis_names={guess!r} (saved name -> "
                "mesh axis name)")
    return (f"{len(missing)} {'leaves use' if len(missing) > 1 else 'leaf uses'} saved "
            f"mesh axes that the target mesh ({target}) does not have: {shown}{more}. The checkpoint was saved on "
            f"mesh {saved}; {hint}, or pass a target with the shardings you want")


# ---- casts ------------------------------------------------------------------------------
# A target dtype other than the saved one casts (numpy's astype), unless the cast can change
# values beyond rounding; then it is refused naming the leaf, unless allow_lossy_cast=True:
# - by kind, whatever the values (refused before anything is read): a float or complex to an
#   integer or bool (truncation; NaN and inf have no integer), a complex to a real (drops the
#   imaginary part), an integer to bool (2 becomes True);
# - by value (checked on the values read, every region of the leaf): an integer to an integer
#   type whose range does not hold every value (narrowing, signed <-> unsigned with negatives
#   or values over the signed maximum); any cast to a float or complex type where a finite value
#   would become infinite or NaN (float32 -> float16 of 1e5; float8 without infinities).
# Float widening and narrowing otherwise, integer -> float and bool -> anything round at most.
# The dtype a device holds counts: without jax_enable_x64, int64 is placed as int32.


@functools.lru_cache(maxsize=256)
def _kind(dtype: np.dtype) -> str | None:
    """'b', 'i' (signed), 'u' (unsigned), 'f' or 'c' (ml_dtypes' types included), or None."""
    if dtype.kind in "biufc":
        return dtype.kind
    try:
        ml_dtypes.finfo(dtype)
        return "f"
    except (TypeError, ValueError):
        pass
    try:
        return "i" if ml_dtypes.iinfo(dtype).min < 0 else "u"
    except (TypeError, ValueError):
        return None


def _refusal(name: str, saved: np.dtype, dtype: np.dtype, why: str, note: str = "") -> CheckpointError:
    return CheckpointError(f"leaf {name!r}: casting saved {saved.name} to {dtype.name}{note} {why}; pass "
                           "allow_lossy_cast=True to cast anyway")


def held_note(want: _Want, saved: np.dtype) -> str:
    """Why a leaf nobody asked to cast is cast: the dtype its device holds."""
    held = np.dtype(jax.dtypes.canonicalize_dtype(saved))
    if want.sharding is not None and want.dtype != saved and held == want.dtype:
        return f" (a device array holds {want.dtype.name} without jax_enable_x64)"
    return ""


def _check_cast_kind(name: str, saved: np.dtype, dtype: np.dtype, allow: bool, note: str = "") -> None:
    """The refusals by kind (the rule above), before anything is read."""
    if allow or saved == dtype:
        return
    s, t = _kind(saved), _kind(dtype)
    if s == "b":
        return
    if s is None or t is None:
        raise _refusal(name, saved, dtype, "is not a cast between numbers", note)
    if s in "fc" and t in "iub":
        raise _refusal(name, saved, dtype, "would drop fractions, NaN and infinities (a float to an integer)", note)
    if s == "c" and t == "f":
        raise _refusal(name, saved, dtype, "would drop the imaginary part", note)
    if t == "b":
        raise _refusal(name, saved, dtype, "would turn every nonzero value into True", note)


def _range(dtype: np.dtype) -> tuple[float, float]:
    if _kind(dtype) in "iu":
        info = ml_dtypes.iinfo(dtype)
        return int(info.min), int(info.max)
    top = float(ml_dtypes.finfo(dtype).max)
    return -top, top


def cast_values(a: np.ndarray, dtype: np.dtype, name: str, allow: bool, note: str = "") -> np.ndarray:
    """`a` (the saved logical dtype) cast to `dtype`, refused (the rule above) where a value would
    change beyond rounding, unless `allow`. Checks are reductions over `a` (no copies); only
    where one finds a value out of a float type's range are both arrays compared in full."""
    dtype = np.dtype(dtype)
    saved = a.dtype
    _check_cast_kind(name, saved, dtype, allow, note)
    s, t = _kind(saved), _kind(dtype)
    check = not allow and a.size and s != "b"
    if check and s in "iu" and t in "iu":
        lo, hi = _range(dtype)
        slo, shi = _range(saved)
        if slo < lo or shi > hi:
            least, most = int(a.min()), int(a.max())
            if least < lo or most > hi:
                bad = most if most > hi else least
                raise _refusal(name, saved, dtype, f"would change values: {bad} is outside {dtype.name}'s "
                               f"range [{lo}, {hi}]", note)
    with np.errstate(all="ignore"):  # overflow was refused above, or asked for
        # (complex -> real, asked for: numpy's astype keeps the real part, and warns)
        out = (a.real if s == "c" and t != "c" else a).astype(dtype)
    if check and t in "fc" and _range(saved)[1] > _range(dtype)[1]:  # (widening: nothing to check)
        _, top = _range(dtype)
        parts = [(a, out)] if s != "c" else [(a.real, out.real), (a.imag, out.imag)]
        if s != "c" and t == "c":
            parts = [(a, out.real)]
        for src, got in parts:
            with np.errstate(invalid="ignore"):
                most, least = float(src.max()), float(src.min())
            if most <= top and least >= -top:  # (False for NaN: then compared in full)
                continue
            with np.errstate(invalid="ignore"):
                bad = np.isfinite(src) & ~np.isfinite(got)
            if bad.any():
                value = src[np.unravel_index(int(np.argmax(bad)), bad.shape)]
                raise _refusal(name, saved, dtype, f"would change values: {value} overflows {dtype.name} "
                               f"(largest finite {top:g})", note)
    return out


@dataclass(frozen=True)
class ArrayMetadata:
    """One saved array, as ``ckpt.metadata`` describes it (no data is read).

    Attributes:
        shape: the shape, as restored.
        dtype: the dtype, as restored (a PRNG key array has its key dtype, e.g. ``key<fry>``).
        mesh_axis_names: axis names of the mesh it was saved on; None for numpy arrays and
            shardings without a mesh (a single device gives an empty mesh).
        mesh_axis_sizes: the sizes of those axes.
        partition_spec: the PartitionSpec it was saved with (``PartitionSpec()`` for a single
            device); None where there is none.
        chunk_shape: the Zarr chunk shape (the saved shard shape, divided evenly where it exceeds
            ``max_chunk_bytes``; or the whole shape for a small
            array written as one chunk or in a stack); None when stored inline (or for
            safetensors).
        nbytes: bytes of the stored data.
        kind: ``'jax.Array'``, ``'numpy.ndarray'``, ``'numpy.scalar'`` or ``'prng_key'``.
        storage_path: where its data is inside the checkpoint: the Zarr array's path (None when
            inline; for a small array stored in a stack, the stack's path and the index along
            its first dimension, ``~stacks/0[17]``), or for safetensors the file holding it.
    """

    shape: tuple[int, ...]
    dtype: Any
    mesh_axis_names: tuple[str, ...] | None
    mesh_axis_sizes: tuple[int, ...] | None
    partition_spec: PartitionSpec | None
    chunk_shape: tuple[int, ...] | None
    nbytes: int
    kind: str
    storage_path: str | None = None

    @property
    def mesh(self) -> dict[str, int] | None:
        """The saved mesh as ``{axis name: size}``; None when it was saved without one."""
        if self.mesh_axis_names is None:
            return None
        return dict(zip(self.mesh_axis_names, self.mesh_axis_sizes))


def array_metadata(rec: LeafRecord) -> ArrayMetadata:
    data_dtype = dtype_from_name(rec.dtype)
    dtype: Any = data_dtype
    if rec.kind == PRNG_KEY:
        dtype = jax.eval_shape(lambda: jax.random.key(0, impl=rec.prng_impl)).dtype
    info = ShardingInfo.from_record(rec.sharding)
    names = sizes = spec = None
    if info is not None and info.kind == "named":
        names, sizes, spec = info.axis_names, info.axis_sizes, PartitionSpec(*info.spec)
    elif info is not None and info.kind == "single_device":
        names, sizes, spec = (), (), PartitionSpec()
    zarr = rec.zarr
    stacked = rec.stacked
    return ArrayMetadata(
        shape=tuple(logical_shape(rec)),
        dtype=dtype,
        mesh_axis_names=names,
        mesh_axis_sizes=sizes,
        partition_spec=spec,
        chunk_shape=zarr.chunk_shape if zarr else tuple(rec.shape) if stacked else None,
        nbytes=math.prod(rec.shape) * data_dtype.itemsize,
        kind=rec.kind,
        storage_path=zarr.path if zarr else f"{stacked.array.zarr.path}[{stacked.index}]" if stacked else None,
    )


# ---- the one restore skeleton every source runs (native checkpoints, Orbax, safetensors): the
# target (or mesh=) matched against the saved tree, each leaf's want, the source's own build of
# the wanted arrays, the tree rebuilt. A source brings its records and its build; the rest is here.


@dataclass(frozen=True)
class Asked:
    """What a caller of ``restore`` asked for, besides the location and the options."""

    target: Any = None
    mesh: Any = None
    partial: bool = False
    verify: bool = True
    allow_lossy_cast: bool = False
    axis_names: dict[str, str] | None = None
    rename: Any = None  # restore(rename=): a dict, a function or regex rules (surgery_source.py)

    def __post_init__(self) -> None:
        if self.target is not None and self.mesh is not None:
            raise ValueError("pass either target or mesh, not both")
        if self.partial not in (False, True, MATCHING):
            raise ValueError(f"partial must be True, False or {MATCHING!r}, got {self.partial!r}")
        if self.rename is not None:
            check_rename(self.rename)
        if (self.rename is not None or self.partial == MATCHING) and self.target is None:
            raise ValueError("rename= and partial='matching' need a target (the leaves to fill, in your names)")


def restore_tree(tree: dict, records: Sequence[LeafRecord], asked: Asked,
                 build: Callable[[list[_Want]], dict[int, Any]], *, paths: list[str] | None = None,
                 chosen: Callable[[list[int]], None] | None = None, view: ViewIO | None = None) -> Any:
    """The saved `tree` (its leaves `records`, by index) restored as `asked`: `build(wants)` gives
    the value of every wanted array leaf by index (the source's reader); other leaves are their
    recorded values. `paths`: the leaves' key paths as targets match them (default: from `tree`);
    `chosen(indices)`: told which leaves the target chose, before any want is made; `view`: how
    the source reads the regions of leaves that ``rename=`` parts are made of (surgery_source.py).
    With ``partial="matching"``: (the tree, the key paths of the target leaves the checkpoint
    lacks, which keep the target's own leaves)."""
    if paths is None:
        paths = ["/".join(c) for c in leaf_components(tree)]
    views, nodes, missing = [], {}, []
    if asked.target is None:
        pairs = [(i, None) for i in range(len(records))]
        treedef = None
    elif asked.rename is not None or asked.partial == MATCHING:
        treedef, pairs, views, nodes, missing = pair_leaves(asked.target, paths, records, asked.rename, asked.partial,
                                                            chosen)
        chosen = None  # (told already)
    else:
        treedef, pairs = _match(asked, paths)
    every = list(records) + views
    if chosen is not None:
        chosen([i for i, _ in pairs])
    if asked.target is None and asked.mesh is not None:
        wants = wants_for_mesh([(i, records[i]) for i, _ in pairs], asked.mesh, asked.allow_lossy_cast,
                               asked.axis_names)
    else:
        wants = [_want_from_target(i, every[i], t, asked.allow_lossy_cast) for i, t in pairs]
    built = build([w for w in wants if w is not None and w.index < len(records)])
    if views:  # (rename= parts: read through the source's view)
        built.update(build_view([w for w in wants if w is not None and w.index >= len(records)], every, nodes, view))
    values = [built[i] if i in built else every[i].py_value() for i, _ in pairs]
    if treedef is None:
        return unflatten(tree, values)
    if asked.partial != MATCHING:
        return jtu.tree_unflatten(treedef, values)
    for pos, leaf, _ in missing:  # (positions in target order: each goes in before the later ones)
        values.insert(pos, leaf)
    return jtu.tree_unflatten(treedef, values), [path for _, _, path in missing]


def _match(asked: Asked, paths: list[str]) -> tuple[Any, list[tuple[int, Any]]]:
    """``match_target``, whose error for target leaves the checkpoint lacks says how to restore
    the rest (``partial="matching"``)."""
    try:
        return match_target(asked.target, paths, partial=asked.partial)
    except TreeMismatchError as e:
        if e.unexpected:
            e.args = (f"{e.args[0]}\n  to restore the leaves the checkpoint has and keep the target's own for these "
                      f"{len(e.unexpected)} (a model grown since: more layers, a new head), pass partial={MATCHING!r}: "
                      "restore then returns (tree, missing key paths)",)
        raise

