"""`ckpt plan`: what `restore(path, mesh=...)` would read on a mesh that need not exist here.

Pure: the same layout (``named_boxes``) and read plan (``plan_leaf_read``) restore uses, for
every process of a job whose devices fill the mesh in row-major order, each process holding a
contiguous block of ``devices / processes`` mesh positions (as jax.make_mesh lays devices out
when each host contributes its local devices in process order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckpt._format import ARRAY_KINDS, JAX_ARRAY, PRNG_KEY, Manifest, display_path
from ckpt._format import dtype_from_name
from ckpt._geometry import ShardingInfo, full_box, mesh_fit_problem, named_boxes, spec_axes
from ckpt._restore import plan_leaf_read


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """'data=2,model=4' -> (('data', 'model'), (2, 4))."""
    names, sizes = [], []
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        name = name.strip()
        if not eq or not name or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"bad mesh {text!r}: write it as axis sizes, e.g. data=2,model=4")
        if name in names:
            raise ValueError(f"bad mesh {text!r}: axis {name!r} appears twice")
        names.append(name)
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


def parse_axis_names(text: str, mesh_names: tuple[str, ...]) -> dict[str, str]:
    """'data=x,model=y' (saved axis name = mesh axis name, as ``restore(axis_names=)``) -> a
    dict; ValueError naming the entry at fault."""
    out: dict[str, str] = {}
    for part in text.split(","):
        saved, eq, new = (x.strip() for x in part.partition("="))
        if not eq or not saved or not new:
            raise ValueError(f"bad --axis-names {text!r}: write it as saved=mesh axis names, e.g. data=x,model=y")
        if new not in mesh_names:
            raise ValueError(f"--axis-names maps {saved!r} to {new!r}, which is not an axis of the mesh {mesh_names}")
        if new in out.values() or saved in out:
            raise ValueError(f"bad --axis-names {text!r}: each saved axis and each mesh axis appears once")
        out[saved] = new
    return out


@dataclass
class ReadTotals:
    """Counted as RestoreStats counts them: `bytes_needed` includes arrays stored inline in the
    manifest (`inline_bytes`), which are never read from chunk files."""

    bytes_read: int = 0
    bytes_needed: int = 0
    chunks_read: int = 0
    inline_bytes: int = 0

    @property
    def amplification(self) -> float | None:
        """Bytes read from chunk files / bytes of chunked arrays the devices need."""
        from_chunks = self.bytes_needed - self.inline_bytes
        return self.bytes_read / from_chunks if from_chunks else None

    def add(self, read: int, needed: int, chunks: int, inline: int) -> None:
        self.bytes_read += read
        self.bytes_needed += needed
        self.chunks_read += chunks
        self.inline_bytes += inline


@dataclass
class DryRun:
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    processes: int
    per_process: list[ReadTotals]
    per_leaf: dict[str, ReadTotals] = field(default_factory=dict)
    unplaceable: list[tuple[str, str]] = field(default_factory=list)  # (leaf path, why)
    renamed: dict[str, str] = field(default_factory=dict)  # --axis-names: saved axis name -> mesh axis name
    # Saved meshes ((name, size) pairs) of the leaves whose axes the mesh lacks: for the hint.
    lacking_meshes: list[tuple[tuple[str, int], ...]] = field(default_factory=list)

    @property
    def total(self) -> ReadTotals:
        t = ReadTotals()
        for p in self.per_process:
            t.add(p.bytes_read, p.bytes_needed, p.chunks_read, p.inline_bytes)
        return t


def _placement(rec, names: tuple[str, ...], sizes: tuple[int, ...],
               renamed: dict[str, str] | None = None) -> tuple[dict | None, str | None]:
    """(mesh position -> box of the stored data, None) or (None, why it cannot be placed), each
    saved axis name renamed through `renamed` (``--axis-names``). A None mapping with no reason
    means: on the host, whole, in every process."""
    if rec.kind not in (JAX_ARRAY, PRNG_KEY):
        return None, None
    info = ShardingInfo.from_record(rec.sharding)
    if info is None or info.kind == "other":
        return None, "saved with a sharding that has no PartitionSpec; restore it with a target"
    ndim = len(rec.shape)
    spec = tuple(info.spec) if info.kind == "named" else ()
    spec = spec + (None,) * (ndim - len(spec))  # PRNG key data: trailing dimensions unsharded
    if renamed:
        spec = tuple(e if e is None else tuple(renamed.get(a, a) for a in spec_axes(e)) for e in spec)
    why = mesh_fit_problem(rec.shape, spec, names, sizes)
    if why is not None:
        return None, why
    return named_boxes(rec.shape, names, sizes, spec), None


def dry_run_restore(manifest: Manifest, names: tuple[str, ...], sizes: tuple[int, ...], processes: int = 1,
                    renamed: dict[str, str] | None = None) -> DryRun:
    devices = math.prod(sizes)
    if processes < 1 or devices % processes:
        raise ValueError(f"a mesh of {devices} devices cannot be split evenly over {processes} processes")
    per = devices // processes
    run = DryRun(names, sizes, processes, [ReadTotals() for _ in range(processes)], renamed=dict(renamed or {}))
    stack_chunks_read: set[tuple[int, int, int]] = set()  # (process, stack, chunk): each read once
    for i, rec in enumerate(manifest.leaves):
        if rec.kind not in ARRAY_KINDS:
            continue
        boxes_by_position, why = _placement(rec, names, sizes, run.renamed)
        if why is not None:
            run.unplaceable.append((rec.path, why))
            _note_lacking(run, rec)
            continue
        zarr = rec.zarr is not None
        # Inline data is one whole-array chunk (at least 1 per dimension, for empty arrays), as in restore.
        chunk_shape = rec.chunk_shape
        itemsize = dtype_from_name(rec.dtype).itemsize
        positions = list(boxes_by_position) if boxes_by_position is not None else []
        leaf = run.per_leaf.setdefault(rec.path, ReadTotals())
        for p in range(processes):
            if boxes_by_position is None:
                boxes = [full_box(rec.shape)]
            else:
                boxes = [boxes_by_position[c] for c in positions[p * per:(p + 1) * per]]
            plan = plan_leaf_read(i, rec.shape, chunk_shape, itemsize, boxes)
            if rec.stacked is not None:
                # As restore counts: a process reads the stack chunk holding the leaf once, for
                # all the members it needs from it; the leaf itself is its own bytes of it.
                stack = rec.stacked.array
                per_chunk = stack.zarr.chunk_shape[0]
                chunk = rec.stacked.index // per_chunk
                first = (p, rec.stacked.stack, chunk) not in stack_chunks_read
                stack_chunks_read.add((p, rec.stacked.stack, chunk))
                rows = min(per_chunk, stack.shape[0] - chunk * per_chunk)
                run.per_process[p].add(rows * stack.member_bytes if first else 0, plan.bytes_needed, int(first), 0)
                leaf.add(stack.member_bytes, plan.bytes_needed, 1, 0)  # its data lies in one stack chunk
                continue
            # As restore counts: inline data is needed but never read from storage.
            read, chunks, inline = (plan.bytes_read, len(plan.chunks), 0) if zarr else (0, 0, plan.bytes_needed)
            run.per_process[p].add(read, plan.bytes_needed, chunks, inline)
            leaf.add(read, plan.bytes_needed, chunks, inline)
    return run


def _note_lacking(run: DryRun, rec) -> None:
    """Record the saved mesh of `rec` when the mesh lacks one of its axes (for ``axis_hint``)."""
    info = ShardingInfo.from_record(rec.sharding)
    if info is None or info.kind != "named":
        return
    used = {run.renamed.get(a, a) for entry in info.spec for a in spec_axes(entry)}
    saved = tuple(zip(info.axis_names, info.axis_sizes))
    if not used <= set(run.axis_names) and saved not in run.lacking_meshes:
        run.lacking_meshes.append(saved)


def axis_hint(run: DryRun) -> str | None:
    """What to do when leaves use saved axes the mesh lacks: the saved mesh, and the
    ``--axis-names`` (``restore(axis_names=)``) that pairs the lacking saved axes in order with
    the mesh axes no saved axis takes, when their numbers agree (a guess, said as one)."""
    if not run.lacking_meshes:
        return None
    saved = "; ".join(",".join(f"{a}={n}" for a, n in m) for m in run.lacking_meshes)
    order = list(dict.fromkeys(a for m in run.lacking_meshes for a, _ in m))
    lacking = [a for a in order if run.renamed.get(a, a) not in run.axis_names]
    used = {run.renamed.get(a, a) for a in order}
    free = [a for a in run.axis_names if a not in used]
    text = f"the checkpoint was saved on mesh {saved}"
    if lacking and len(free) == len(lacking):
        guess = {**run.renamed, **dict(zip(lacking, free))}
        flag = ",".join(f"{k}={v}" for k, v in guess.items())
        return (f"{text}; if its axes are the mesh's under other names, plan with --axis-names {flag} "
                f"(restore(..., mesh=mesh, axis_names={guess!r}))")
    return f"{text}; map saved axis names to the mesh's with --axis-names SAVED=MESH,... (restore's axis_names=)"


# Leaves of one reason named in `plan`'s summary; the rest are counted (--per-leaf lists all).
_SHOWN_LEAVES = 3
# At most this many unplaceable leaves are listed one a line without --per-leaf.
_LISTED = 5


def unplaceable_lines(unplaceable: list[tuple[str, str]], per_leaf: bool) -> list[str]:
    """Each unplaceable (leaf, reason) on a line (few, or --per-leaf), else one line per reason:
    how many leaves, and the first few."""
    if per_leaf or len(unplaceable) <= _LISTED:
        return [f"  {display_path(p)}: {why}" for p, why in unplaceable]
    by_reason: dict[str, list[str]] = {}
    for p, why in unplaceable:
        by_reason.setdefault(why, []).append(display_path(p))
    out = []
    for why, paths in by_reason.items():
        more = f" and {len(paths) - _SHOWN_LEAVES} more" if len(paths) > _SHOWN_LEAVES else ""
        out.append(f"  {len(paths)} {'leaves' if len(paths) > 1 else 'leaf'}: {why} "
                   f"({', '.join(paths[:_SHOWN_LEAVES])}{more}; --per-leaf lists them)")
    return out


def _amp(t: ReadTotals) -> str:
    return "-" if t.amplification is None else f"{t.amplification:.2f}x"


def dry_run_document(run: DryRun, path: str) -> dict:
    def totals(t: ReadTotals) -> dict:
        return {"bytes_read": t.bytes_read, "bytes_needed": t.bytes_needed, "chunks_read": t.chunks_read,
                "inline_bytes": t.inline_bytes, "read_amplification": t.amplification}

    return {
        "path": path,
        "mesh": {"axis_names": list(run.axis_names), "axis_sizes": list(run.axis_sizes)},
        "processes": run.processes,
        "devices_per_process": math.prod(run.axis_sizes) // run.processes,
        "per_process": [{"process": p, **totals(t)} for p, t in enumerate(run.per_process)],
        "total": totals(run.total),
        "per_leaf": [{"path": k, **totals(t)} for k, t in run.per_leaf.items()],
        "unplaceable": [{"path": p, "why": why} for p, why in run.unplaceable],
        "axis_names": dict(run.renamed),
        "hint": axis_hint(run),
    }


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def render_dry_run(run: DryRun, path: str, per_leaf: bool) -> str:
    from ckpt.cli._render import human_bytes, plural

    devices = math.prod(run.axis_sizes)
    mesh = ",".join(f"{a}={n}" for a, n in zip(run.axis_names, run.axis_sizes))
    out = [
        f"restore of {path}",
        f"onto mesh {mesh} ({plural(devices, 'device')}) in {run.processes} process(es) of "
        f"{plural(devices // run.processes, 'device')}",
        "",
    ]

    def row(label: str, t: ReadTotals) -> list[str]:
        return [label, human_bytes(t.bytes_read), str(t.chunks_read), human_bytes(t.bytes_needed),
                human_bytes(t.inline_bytes), _amp(t)]

    header = ["PROCESS", "READ", "CHUNKS", "NEEDED", "OF IT INLINE", "AMPLIFICATION"]
    out += _table([header] + [row(str(p), t) for p, t in enumerate(run.per_process)] + [row("total", run.total)])
    if per_leaf:
        out += [""] + _table([["LEAF", *header[1:]]] + [row(display_path(k), t) for k, t in run.per_leaf.items()])
    if run.unplaceable:
        out += ["", f"cannot be placed ({plural(len(run.unplaceable), 'leaf', 'leaves')} of "
                      f"{plural(len(run.per_leaf) + len(run.unplaceable), 'array')}):"]
        out += unplaceable_lines(run.unplaceable, per_leaf)
        if (hint := axis_hint(run)) is not None:
            out += [f"hint: {hint}"]
    out += ["", "READ: bytes of chunk files read; NEEDED: bytes the devices (or host, for numpy arrays) need, "
            "of it INLINE: stored in the manifest; AMPLIFICATION: READ / (NEEDED - INLINE)"]
    return "\n".join(out)
