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
from ckpt._format import dtypes as _dtypes
from ckpt._geometry import ShardingInfo, full_box, mesh_fit_problem, named_boxes
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

    @property
    def total(self) -> ReadTotals:
        t = ReadTotals()
        for p in self.per_process:
            t.add(p.bytes_read, p.bytes_needed, p.chunks_read, p.inline_bytes)
        return t


def _placement(rec, names: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[dict | None, str | None]:
    """(mesh position -> box of the stored data, None) or (None, why it cannot be placed).
    A None mapping with no reason means: on the host, whole, in every process."""
    if rec.kind not in (JAX_ARRAY, PRNG_KEY):
        return None, None
    info = ShardingInfo.from_record(rec.sharding)
    if info is None or info.kind == "other":
        return None, "saved with a sharding that has no PartitionSpec; restore it with a target"
    ndim = len(rec.shape)
    spec = tuple(info.spec) if info.kind == "named" else ()
    spec = spec + (None,) * (ndim - len(spec))  # PRNG key data: trailing dimensions unsharded
    why = mesh_fit_problem(rec.shape, spec, names, sizes)
    if why is not None:
        return None, why
    return named_boxes(rec.shape, names, sizes, spec), None


def dry_run_restore(manifest: Manifest, names: tuple[str, ...], sizes: tuple[int, ...], processes: int = 1) -> DryRun:
    devices = math.prod(sizes)
    if processes < 1 or devices % processes:
        raise ValueError(f"a mesh of {devices} devices cannot be split evenly over {processes} processes")
    per = devices // processes
    run = DryRun(names, sizes, processes, [ReadTotals() for _ in range(processes)])
    stack_chunks_read: set[tuple[int, int, int]] = set()  # (process, stack, chunk): each read once
    for i, rec in enumerate(manifest.leaves):
        if rec.kind not in ARRAY_KINDS:
            continue
        boxes_by_position, why = _placement(rec, names, sizes)
        if why is not None:
            run.unplaceable.append((rec.path, why))
            continue
        zarr = rec.zarr is not None
        # Inline data is one whole-array chunk (at least 1 per dimension, for empty arrays), as in restore.
        chunk_shape = rec.chunk_shape
        itemsize = _dtypes.dtype_from_name(rec.dtype).itemsize
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
        out += ["", f"cannot be placed ({len(run.unplaceable)}):"]
        out += [f"  {display_path(p)}: {why}" for p, why in run.unplaceable]
    out += ["", "READ: bytes of chunk files read; NEEDED: bytes the devices (or host, for numpy arrays) need, "
            "of it INLINE: stored in the manifest; AMPLIFICATION: READ / (NEEDED - INLINE)"]
    return "\n".join(out)
