"""`ckpt inspect` and `ckpt ls`: what a checkpoint holds, from its manifest alone, as JSON
documents and as text; and the small formatting helpers every command shares.

Size: `inspect` and `ls` as documents and as text share one order of fields; apart, they drifted.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from ckpt._format import dtype_from_name
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


def _foreign_leaf(rec: LeafRecord, file: str) -> dict:
    """A safetensors tensor as `inspect --json` prints it (its file instead of a Zarr array)."""
    info = ShardingInfo.from_record(rec.sharding)
    named = info is not None and info.kind == "named"
    return {
        "path": rec.path, "kind": rec.kind, "shape": list(rec.shape), "dtype": rec.dtype, "storage": "safetensors",
        "storage_path": file, "chunk_shape": None, "chunks": 0,
        "nbytes": math.prod(rec.shape) * dtype_from_name(rec.dtype).itemsize,
        "sharding": info.kind if info else None,
        "mesh": {"axis_names": list(info.axis_names), "axis_sizes": list(info.axis_sizes)} if named else None,
        "partition_spec": [e if e is None or isinstance(e, str) else list(e) for e in info.spec] if named else None,
    }


FORMAT_NAMES = {"orbax": "orbax-checkpoint", "safetensors": "safetensors"}


def inspect_document(opened: Opened) -> dict:
    """What `inspect --json` prints: the manifest, one plain JSON document (no data is read)."""
    m = opened.manifest
    if opened.format == "safetensors":
        leaves = [_foreign_leaf(r, f) for r, f in zip(m.leaves, opened.source["files"])]
    else:
        leaves = [leaf_info(r) for r in m.leaves]
    arrays = [l for l in leaves if "nbytes" in l]
    zarr = [l for l in arrays if l["storage"] == "zarr"]
    stacked = [l for l in arrays if l["storage"] == "stacked"]
    stack_chunks = sum(math.prod(chunk_grid(s.shape, s.zarr.chunk_shape)) for s in m.stacks)
    doc = {
        "path": opened.root,
        "format": FORMAT_NAMES.get(opened.format, FORMAT_NAME),
        "format_version": m.format_version if opened.format == "jax-ckpt" else None,
        "library_version": m.library_version if opened.format == "jax-ckpt" else None,
        "created": m.created if opened.format == "jax-ckpt" else opened.created,
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
            "inline_arrays": len([l for l in arrays if l["storage"] == "inline"]),
            "chunks": sum(l["chunks"] for l in zarr) + stack_chunks,
            "bytes": sum(l["nbytes"] for l in arrays),
            "zarr_bytes": sum(l["nbytes"] for l in zarr + stacked),
            "inline_bytes": sum(l["nbytes"] for l in arrays if l["storage"] == "inline"),
        },
    }
    if opened.format == "orbax":
        layout = opened.source[0]
        doc["orbax"] = {"what": opened.what, "items": [{"name": i.name, "kind": i.kind, "layout": i.layout}
                                                       for i in layout.items]}
    elif opened.format == "safetensors":
        doc["totals"]["safetensors_files"] = len(set(opened.source["files"]))
    return doc


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
_RIGHT = {6, 7}  # CHUNKS and BYTES, right-aligned
# Columns left out, in this order, when the table is wider than the terminal (each named in a
# note under the table); NAME, DTYPE, SHAPE, SPEC and BYTES are always shown.
_DROP_ORDER = ["CHUNK", "STORAGE", "CHUNKS", "MESH"]
LONG_MESH = 32  # a mesh text longer than this is named once above the table (m1, m2...)
ELLIPSIS = "…"


def _mesh_text(mesh: dict | None) -> str:
    if mesh is None:
        return "-"
    return ",".join(f"{a}={n}" for a, n in zip(mesh["axis_names"], mesh["axis_sizes"])) or "single device"


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
        spec = "-" if leaf["partition_spec"] is None else spec_text(leaf["partition_spec"])
        zarr = leaf["storage"] == "zarr"
        rows.append([
            name, leaf["dtype"], _shape_text(leaf["shape"]), _mesh_text(leaf["mesh"]), spec,
            _shape_text(leaf["chunk_shape"]) if zarr else "-", str(leaf["chunks"]) if zarr else "-",
            human_bytes(leaf["nbytes"]),
            "inline" if leaf["storage"] == "inline" else f"{leaf['storage']} {leaf['storage_path']}",
        ])
    return rows


def inspect_title(doc: dict) -> list[str]:
    """The lines above the inspect table."""
    out = [f"checkpoint {doc['path']}"]
    if doc.get("orbax"):
        out.append(f"{doc['orbax']['what']}: read by ckpt.restore through TensorStore; "
                   "'ckpt convert' makes a jax-ckpt checkpoint of it")
    elif doc["format"] == "safetensors":
        out.append(f"safetensors, {doc['totals'].get('safetensors_files', 1)} file(s): read by ckpt.restore "
                   "(no checksums)")
    else:
        out.append(f"format {doc['format']} v{doc['format_version']}, written by jax-ckpt "
                   f"{doc['library_version'] or '?'} at {local_time(doc['created'])}")
    if doc.get("metrics"):
        out.append("metrics: " + ", ".join(f"{k}={_value_text(v)}" for k, v in doc["metrics"].items()))
    if doc["user_metadata"]:
        out.append(f"user_metadata: {_value_text(doc['user_metadata'])}")
    return out


def inspect_total(doc: dict) -> str:
    t = doc["totals"]
    if doc["format"] == "safetensors":
        return f"total: {plural(t['arrays'], 'tensor')}, {human_bytes(t['bytes'])} in {t.get('safetensors_files', 1)} file(s)"
    stacked = f"{t['stacked_arrays']} in {plural(t['stacks'], 'stack')}, " if t.get("stacks") else ""
    return (f"total: {plural(t['leaves'], 'leaf', 'leaves')}, {plural(t['arrays'], 'array')} ({t['zarr_arrays']} zarr, {stacked}{t['inline_arrays']} "
            f"inline), {plural(t['chunks'], 'chunk')}, {human_bytes(t['bytes'])} of array data "
            f"({human_bytes(t['zarr_bytes'])} in chunks, {human_bytes(t['inline_bytes'])} inline)")


# Members of a stack chunk named in full in `verify`'s report; past it, the first few and the last.
_STACK_NAMED = 8


def stack_label(stack: int, members: list[tuple[int, str]], rows: tuple[int, int] | None = None) -> str:
    """How `verify` names stack `stack` (``members``: (index in the stack, leaf path)), or with
    `rows` (first, end) only its chunk holding those members: 'stack 0, chunk members 4-7 (4
    leaves: a, b, c, d)', so that a damaged chunk names the leaves it holds, not the stack's."""
    if rows is not None:
        members = [(i, p) for i, p in members if rows[0] <= i < rows[1]]
    names = [display_path(p) for _, p in sorted(members)]
    what = f"stack {stack}" if rows is None else f"stack {stack}, members {rows[0]}-{rows[1] - 1}"
    if not names:
        return what
    shown = ", ".join(names) if len(names) <= _STACK_NAMED else f"{', '.join(names[:3])} ... {names[-1]}"
    return f"{what} ({plural(len(names), 'leaf', 'leaves')}: {shown})"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 chunk', '2 chunks' ('1 leaf', '2 leaves' with `many`)."""
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def _crop(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + ELLIPSIS


def inspect_lines(doc: dict, manifest: Manifest, width: int | None = None) -> list[list[tuple[str, str | None]]]:
    """The inspect output as lines of (text, meaning) segments (meaning: a style name of
    ckpt.cli._style, or None), fitted to `width` columns (None: as wide as it takes, for pipes).

    Nothing is cut silently: a mesh too long for its column is named once above the table (m1,
    m2...) and its name shown in the column; on a narrow terminal, whole columns are left out
    (in _DROP_ORDER) and named in a note under the table; and if the table is still too wide, the
    longest cells are cut with an ellipsis, which the note explains. Inner nodes and values are
    lines of their own that never set a column's width."""
    header = list(INSPECT_HEADER)
    rows = inspect_rows(doc, manifest)
    cells = [r for r in rows if isinstance(r, list) and len(r) == len(header)]
    meshes: dict[str, str] = {}

    def fits(cols: list[int], widths: list[int]) -> bool:
        return width is None or sum(widths[c] for c in cols) + 2 * (len(cols) - 1) <= width

    def natural(cols: list[int]) -> list[int]:
        return [max([len(header[c])] + [len(r[c]) for r in cells]) if c in cols else 0 for c in range(len(header))]

    cols = list(range(len(header)))
    if any(len(r[3]) > LONG_MESH for r in cells) or not fits(cols, natural(cols)):
        for r in cells:
            if r[3] not in ("-", "single device") and (len(r[3]) > LONG_MESH or width is not None):
                r[3] = meshes.setdefault(r[3], f"m{len(meshes) + 1}")
    widths = natural(cols)
    dropped = []
    for name in _DROP_ORDER:
        if fits(cols, widths):
            break
        cols.remove(header.index(name))
        dropped.append(name)
        widths = natural(cols)
    cut = False
    while not fits(cols, widths):
        # Cut the widest of the cells that may be cut (NAME, SHAPE, SPEC, STORAGE), one column
        # a character at a time, to at least 6 characters.
        c = max((c for c in (0, 2, 4, 8) if c in cols and widths[c] > 6), key=lambda c: widths[c], default=None)
        if c is None:
            break
        widths[c] -= 1
        cut = True

    def line(cs: list[str], meaning: str | None = None) -> list[tuple[str, str | None]]:
        parts = []
        for k, c in enumerate(cols):
            text = _crop(cs[c], widths[c])
            text = text.rjust(widths[c]) if c in _RIGHT else text.ljust(widths[c])
            style = meaning or {1: "dtype", 8: "dim" if cs[c] == "inline" else None}.get(c)
            parts.append((text if k == len(cols) - 1 else text + "  ", style))
        last, style = parts[-1]
        parts[-1] = (last.rstrip(), style)
        return parts

    out: list[list[tuple[str, str | None]]] = []
    title = inspect_title(doc)
    out.append([(title[0], "header")])
    out += [[(t, "dim")] for t in title[1:]]
    for text, label in meshes.items():
        # Wrapped after its commas (never inside an axis name) to the terminal's width.
        parts, line_text = text.split(","), f"mesh {label}: "
        for k, part in enumerate(parts):
            part += "," if k < len(parts) - 1 else ""
            if width is not None and len(line_text) + len(part) > width and line_text.strip():
                out.append([(line_text.rstrip(), "dim")])
                line_text = "  "
            line_text += part
        out.append([(line_text, "dim")])
    out.append([])
    out.append(line(header, "header"))
    for r in rows:
        if isinstance(r, str):
            out.append([(r, "header")])
        elif len(r) == len(header):
            out.append(line(r))
        else:  # a value leaf: its kind and value
            pad = max(widths[0], len(r[0]))
            out.append([(f"{r[0].ljust(pad)}  ", None), (r[1], "dtype"), (" " + r[2], "value")])
    out.append([])
    out.append([(inspect_total(doc), "header")])
    if dropped or cut:
        what = []
        if dropped:
            what.append(f"column(s) {', '.join(dropped)} left out")
        if cut:
            what.append(f"cells ending in {ELLIPSIS} cut")
        out.append([(f"note: {' and '.join(what)} to fit {width} columns; a wider terminal, or "
                     "--json, shows everything", "note")])
    return out


def render_inspect(doc: dict, manifest: Manifest, width: int | None = None) -> str:
    """The inspect document as a table in tree order (the manifest gives the tree)."""
    return "\n".join("".join(t for t, _ in line).rstrip() for line in inspect_lines(doc, manifest, width))


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
