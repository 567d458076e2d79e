"""`ckpt du`: what a checkpoint is made of, bytes per subtree, from its manifest alone."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt._format import ARRAY_KINDS, Manifest, display_path, leaf_components
from ckpt._format import dtype_from_name
from ckpt._geometry import chunk_grid


@dataclass
class Subtree:
    path: str
    arrays: int = 0
    values: int = 0
    data_bytes: int = 0  # the arrays' bytes
    stored_bytes: int = 0  # chunk files (edge chunks padded to the chunk shape) plus inline data
    inline_bytes: int = 0
    chunks: int = 0


def usage(manifest: Manifest, depth: int = 1) -> list[Subtree]:
    """Bytes per subtree of the first `depth` key-path components, largest first."""
    groups: dict[str, Subtree] = {}
    stack_chunks: dict[str, set[tuple[int, int]]] = {}  # subtree -> (stack, chunk) its stacked leaves lie in
    for comps, rec in zip(leaf_components(manifest.tree), manifest.leaves):
        key = display_path("/".join(comps[:depth]))
        g = groups.setdefault(key, Subtree(key))
        if rec.kind not in ARRAY_KINDS:
            g.values += 1
            continue
        g.arrays += 1
        itemsize = dtype_from_name(rec.dtype).itemsize
        g.data_bytes += math.prod(rec.shape) * itemsize
        st = rec.zarr
        if rec.stacked is not None:  # its slice of a stack's chunk files
            g.stored_bytes += rec.stacked.array.member_bytes
            # Several small leaves share one chunk of their stack: the subtree's chunks are the
            # distinct stack chunks its leaves lie in.
            per_chunk = rec.stacked.array.zarr.chunk_shape[0]
            stack_chunks.setdefault(key, set()).add((rec.stacked.stack, rec.stacked.index // per_chunk))
            continue
        if st is None:
            g.inline_bytes += len(rec.storage.data)
            g.stored_bytes += len(rec.storage.data)
            continue
        n = math.prod(chunk_grid(rec.shape, st.chunk_shape))
        g.chunks += n
        g.stored_bytes += n * math.prod(st.chunk_shape) * dtype_from_name(st.data_type).itemsize
    for key, chunks in stack_chunks.items():
        groups[key].chunks += len(chunks)
    return sorted(groups.values(), key=lambda g: (-g.stored_bytes, g.path))


def du_document(rows: list[Subtree], path: str, depth: int) -> dict:
    total = sum(r.stored_bytes for r in rows)
    return {
        "path": path, "depth": depth, "total_bytes": total,
        "subtrees": [{"path": r.path, "arrays": r.arrays, "values": r.values, "bytes": r.stored_bytes,
                      "data_bytes": r.data_bytes, "inline_bytes": r.inline_bytes, "chunks": r.chunks,
                      "share": r.stored_bytes / total if total else 0.0} for r in rows],
    }


def du_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    from ckpt.cli._render import human_bytes

    header = ["SUBTREE", "ARRAYS", "BYTES", "SHARE"]
    rows = [[s["path"], str(s["arrays"]), human_bytes(s["bytes"]), f"{100 * s['share']:.1f}%"] for s in doc["subtrees"]]
    return header, rows


def render_du(doc: dict) -> str:
    """Plain text: one line per subtree, then the total."""
    from ckpt.cli._render import human_bytes

    header, rows = du_rows(doc)
    table = [header] + rows
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in table]
    lines.append(f"total: {human_bytes(doc['total_bytes'])} in {len(rows)} subtree(s) of {doc['path']}")
    return "\n".join(lines)


def rich_du(doc: dict):
    from ckpt.cli._render import human_bytes
    from ckpt.cli._style import share_bar, styled, table

    header, rows = du_rows(doc)
    body = [[styled(r[0], "path"), r[1], r[2], r[3], share_bar(s["share"])] for r, s in zip(rows, doc["subtrees"])]
    return table(header + [""], body, right={1, 2, 3},
                 title=f"{doc['path']}: {human_bytes(doc['total_bytes'])}")
