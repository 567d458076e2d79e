"""`ckpt inspect` and `ckpt ls`: what a checkpoint holds, from its manifest alone, as JSON
documents and as text; and the small formatting helpers every command shares."""

from __future__ import annotations

import datetime
import math
from typing import Any

from ckpt._format import ARRAY_KINDS, CUSTOM, FORMAT_NAME, LEAF, LeafRecord, Manifest, child_names, display_path
from ckpt._geometry import ShardingInfo, chunk_grid
from ckpt._manager import METRICS_KEY
from ckpt._restore import array_metadata
from ckpt.cli._opened import Opened, StepRow


def human_bytes(n: float) -> str:
    """Bytes in binary units, as people read sizes ('8.00 KiB')."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def local_time(seconds: float) -> str:
    """A timestamp in the reader's time zone, to the second."""
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def json_safe(x: Any) -> Any:
    """The value with bytes as hex strings, non-finite floats as strings and tuples as lists."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (bytes, bytearray)):
        return {"bytes_hex": bytes(x).hex()}
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, complex):
        return [json_safe(x.real), json_safe(x.imag)]
    return x


def spec_text(spec: list) -> str:
    """A recorded PartitionSpec as JAX prints one: P('data', None, ('x', 'y'))."""
    def entry(e):
        if e is None:
            return "None"
        if isinstance(e, str):
            return repr(e)
        return "(" + ", ".join(repr(a) for a in e) + ("," if len(e) == 1 else "") + ")"

    spec = list(spec)
    while spec and spec[-1] is None:  # as PartitionSpec prints: trailing Nones say nothing
        spec.pop()
    return "P(" + ", ".join(entry(e) for e in spec) + ")"


def _shape_text(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def leaf_info(rec: LeafRecord) -> dict:
    """One leaf as `inspect --json` prints it."""
    if rec.kind not in ARRAY_KINDS:
        return {"path": rec.path, "kind": rec.kind, "value": json_safe(rec.py_value())}
    md = array_metadata(rec)
    info = ShardingInfo.from_record(rec.sharding)
    zarr = rec.zarr
    out = {
        "path": rec.path,
        "kind": rec.kind,
        "shape": list(md.shape),
        "dtype": str(md.dtype),
        "storage": "zarr" if zarr else "stacked" if rec.stacked else "inline",
        "storage_path": md.storage_path if zarr or rec.stacked else None,
        "chunk_shape": list(md.chunk_shape) if zarr else None,
        "chunks": math.prod(chunk_grid(rec.shape, zarr.chunk_shape)) if zarr else 0,
        "nbytes": md.nbytes,
        "sharding": info.kind if info else None,
        "mesh": None,
        "partition_spec": None,
    }
    if rec.kind == "prng_key":
        out["key_data"] = {"shape": list(rec.shape), "dtype": rec.dtype, "impl": rec.prng_impl}
    if info is not None and info.kind == "named":
        out["mesh"] = {"axis_names": list(info.axis_names), "axis_sizes": list(info.axis_sizes)}
        out["partition_spec"] = [e if e is None or isinstance(e, str) else list(e) for e in info.spec]
    elif info is not None and info.kind == "single_device":
        out["mesh"], out["partition_spec"] = {"axis_names": [], "axis_sizes": []}, []
    return out


def _metrics_of(user_metadata: Any) -> dict | None:
    metrics = user_metadata.get(METRICS_KEY) if isinstance(user_metadata, dict) else None
    return metrics if isinstance(metrics, dict) else None


def _without_metrics(user_metadata: Any) -> Any:
    if not isinstance(user_metadata, dict) or METRICS_KEY not in user_metadata:
        return user_metadata
    rest = {k: v for k, v in user_metadata.items() if k != METRICS_KEY}
    return rest or None


def inspect_document(opened: Opened) -> dict:
    """What `inspect --json` prints: the manifest, one plain JSON document (no data is read)."""
    m = opened.manifest
    leaves = [leaf_info(r) for r in m.leaves]
    arrays = [l for l in leaves if "nbytes" in l]
    zarr = [l for l in arrays if l["storage"] == "zarr"]
    stacked = [l for l in arrays if l["storage"] == "stacked"]
    stack_chunks = sum(math.prod(chunk_grid(s.shape, s.zarr.chunk_shape)) for s in m.stacks)
    return {
        "path": opened.root,
        "format": FORMAT_NAME,
        "format_version": m.format_version,
        "library_version": m.library_version,
        "created": m.created,
        # A CheckpointManager step keeps its metrics in the user metadata (ckpt._retention).
        "user_metadata": json_safe(_without_metrics(m.user_metadata)),
        "metrics": json_safe(_metrics_of(m.user_metadata)),
        "leaves": leaves,
        "totals": {
            "leaves": len(leaves),
            "arrays": len(arrays),
            "zarr_arrays": len(zarr),
            "stacked_arrays": len(stacked),
            "stacks": len(m.stacks),
            "inline_arrays": len(arrays) - len(zarr) - len(stacked),
            "chunks": sum(l["chunks"] for l in zarr) + stack_chunks,
            "bytes": sum(l["nbytes"] for l in arrays),
            "zarr_bytes": sum(l["nbytes"] for l in zarr + stacked),
            "inline_bytes": sum(l["nbytes"] for l in arrays if l["storage"] == "inline"),
        },
    }


def _tree_lines(tree: dict) -> list[tuple[int, str, int | None]]:
    """(depth, label, leaf index or None for an inner node) in tree order."""
    out: list[tuple[int, str, int | None]] = []

    def walk(node: dict, depth: int, label: str) -> None:
        kind = node["kind"]
        if kind == LEAF:
            out.append((depth, label, node["index"]))
            return
        children = node.get("children", [])
        names = child_names(node)
        if kind == "none":
            out.append((depth, f"{label or display_path('')} = None", None))
            return
        if label:
            out.append((depth, label + "/" + (f"  ({node['type']})" if kind == CUSTOM else ""), None))
        for name, child in zip(names, children):
            walk(child, depth + (1 if label else 0), name)

    if tree["kind"] == LEAF:
        out.append((0, display_path(""), tree["index"]))
    else:
        walk(tree, 0, "")
    return out


def _value_text(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


INSPECT_HEADER = ["NAME", "DTYPE", "SHAPE", "MESH", "SPEC", "CHUNK", "CHUNKS", "BYTES", "STORAGE"]


def inspect_rows(doc: dict, manifest: Manifest) -> list[list[str] | str]:
    """The rows of the inspect table in tree order: a list of cells per array, [name, kind,
    '= value'] per value leaf, and the name alone (a str) per inner node."""
    rows: list[list[str] | str] = []
    for depth, label, index in _tree_lines(manifest.tree):
        name = "  " * depth + label
        if index is None:
            rows.append(name)
            continue
        leaf = doc["leaves"][index]
        if "nbytes" not in leaf:
            rows.append([name, leaf["kind"], "= " + _value_text(manifest.leaves[index].py_value())])
            continue
        mesh = leaf["mesh"]
        mesh_text = ("-" if mesh is None else
                     ",".join(f"{a}={n}" for a, n in zip(mesh["axis_names"], mesh["axis_sizes"])) or "single device")
        spec = "-" if leaf["partition_spec"] is None else spec_text(leaf["partition_spec"])
        zarr = leaf["storage"] == "zarr"
        rows.append([
            name, leaf["dtype"], _shape_text(leaf["shape"]), mesh_text, spec,
            _shape_text(leaf["chunk_shape"]) if zarr else "-", str(leaf["chunks"]) if zarr else "-",
            human_bytes(leaf["nbytes"]),
            f"zarr {leaf['storage_path']}" if zarr else f"stacked {leaf['storage_path']}"
            if leaf["storage"] == "stacked" else "inline",
        ])
    return rows


def inspect_title(doc: dict) -> list[str]:
    """The lines above the inspect table."""
    out = [
        f"checkpoint {doc['path']}",
        f"format {doc['format']} v{doc['format_version']}, written by jax-ckpt {doc['library_version'] or '?'} "
        f"at {local_time(doc['created'])}",
    ]
    if doc.get("metrics"):
        out.append("metrics: " + ", ".join(f"{k}={_value_text(v)}" for k, v in doc["metrics"].items()))
    if doc["user_metadata"]:
        out.append(f"user_metadata: {_value_text(doc['user_metadata'])}")
    return out


def inspect_total(doc: dict) -> str:
    t = doc["totals"]
    stacked = f"{t['stacked_arrays']} in {t['stacks']} stacks, " if t.get("stacks") else ""
    return (f"total: {t['leaves']} leaves, {t['arrays']} arrays ({t['zarr_arrays']} zarr, {stacked}{t['inline_arrays']} "
            f"inline), {t['chunks']} chunks, {human_bytes(t['bytes'])} of array data "
            f"({human_bytes(t['zarr_bytes'])} in chunks, {human_bytes(t['inline_bytes'])} inline)")


def render_inspect(doc: dict, manifest: Manifest) -> str:
    """The inspect document as a table in tree order (the manifest gives the tree)."""
    header = INSPECT_HEADER
    rows = inspect_rows(doc, manifest)
    table = [header] + [r for r in rows if isinstance(r, list) and len(r) == len(header)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = inspect_title(doc) + ["", line(header)]
    for r in rows:
        if isinstance(r, str):
            out.append(r)
        elif len(r) == len(header):
            out.append(line(r))
        else:
            out.append(f"{r[0].ljust(widths[0])}  {r[1]} {r[2]}")
    out += ["", inspect_total(doc)]
    return "\n".join(out)


def ls_document(rows: list[StepRow]) -> list[dict]:
    """What `ls --json` prints. `bytes`/`files` are null where the storage cannot tell them;
    `sized_by` says where they come from ('storage' or, on storage that cannot list sizes,
    'manifest': chunk files and manifest only)."""
    return [
        {"step": r.step, "path": r.path, "state": r.state, "bytes": r.size, "files": r.files,
         "written": r.written, "problem": r.problem, "sized_by": r.sized_by}
        for r in rows
    ]


def render_ls(rows: list[StepRow]) -> str:
    """The steps as a table; '-' for what the storage cannot tell, '~' before sizes taken from
    the manifest (chunk files and manifest, not every small file)."""
    table = [LS_HEADER] + ls_rows(rows)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    right = {0, 2, 3}
    return "\n".join(
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in table
    )


LS_HEADER = ["STEP", "STATE", "SIZE", "FILES", "WRITTEN", "PATH"]


def ls_rows(rows: list[StepRow]) -> list[list[str]]:
    """The cells of each `ls` line."""
    table = []
    for r in rows:
        approx = "~" if r.sized_by == "manifest" else ""
        table.append([
            "-" if r.step is None else str(r.step), r.state,
            "-" if r.size is None else approx + human_bytes(r.size), "-" if r.files is None else approx + str(r.files),
            "-" if r.written is None else local_time(r.written), r.path + (f"  ({r.problem})" if r.problem else ""),
        ])
    return table
