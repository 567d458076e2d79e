"""`ckpt export --format zarr`: a checkpoint as plain Zarr v3, one file per chunk, that stock
zarr-python and TensorStore's zarr3 driver read whatever format version the checkpoint has.

Every array leaf becomes a Zarr v3 array at its tree path (escaped as checkpoints escape it,
formats/SPEC.md section 2), with the metadata a checkpoint's own arrays have (section 7: one
little-endian ``bytes`` codec, default chunk keys, the storage dtype as ``data_type`` and the logical
dtype under ``attributes.jax_ckpt``, section 6), the checkpoint's chunk shape (the whole array for
inline and stacked data), and every chunk written. Value leaves (numbers, strings) go into the root
group's attributes under ``jax_ckpt_values``.

It streams as ``ckpt.safetensors.export`` does: chunks are read through restore's own reader (each
checked against its CRC-32C) in batches of at most half the host budget, or one chunk where a
single chunk is larger, and written as files while the next batch is read (so about the budget is
held at once). Everything is written into a temporary sibling directory renamed onto OUT when
complete, so OUT never holds half an export.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import (ARRAY_KINDS, GROUP_METADATA, PRNG_KEY, PY_BYTES, PY_COMPLEX, PY_FLOAT, PY_INT, ArraySpec,
                          LeafRecord, display_path, leaf_components, storage_paths, zarr_metadata)
from ckpt._format import dtype_from_name, storage_of, to_storage
from ckpt._geometry import Box, chunk_box, chunk_grid, full_box
from ckpt._host import Options, resolve
from ckpt._restore import Reader, RestoreStats, chunk_source, plan_leaf_read, require_manifest
from ckpt.safetensors import local_out_dir
from ckpt.storage import fsync_path, open_storage, pinned

ZARR_JSON = "zarr.json"
VALUES_KEY = "jax_ckpt_values"  # root group attribute: the value leaves, {leaf path: JSON value}
EXPORT_MARK = "zarr-export"  # attributes.jax_ckpt.export of the root group: what --overwrite may replace
# Files written and synced at once: file creation and fsync wait on the disk, not the CPU.
_WRITERS = 8


@dataclass(frozen=True)
class ZarrExport:
    """What ``export_zarr`` wrote: OUT, leaf path -> Zarr path of each array, the leaf paths of
    the values put in the root group's attributes, bytes of chunk data and chunk files."""

    out: str
    arrays: dict[str, str]
    values: tuple[str, ...]
    bytes: int
    chunks: int


def _json_float(x: float) -> float | str:
    # Zarr v3 writes non-finite floats as these strings (fill_value); JSON has no NaN.
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def json_value(rec: LeafRecord) -> Any:
    """A value leaf as strict JSON: ints as JSON numbers (outside [-2^63, 2^64) as decimal text,
    as the manifest stores them), floats (non-finite as "NaN", "Infinity", "-Infinity"), complex
    as [real, imag], bytes as base64 text; the leaf's kind says which (attributes.jax_ckpt.values)."""
    v = rec.value
    if rec.kind == PY_INT:
        return v if isinstance(v, str) or -(1 << 63) <= v < (1 << 64) else str(v)
    if rec.kind == PY_FLOAT:
        return _json_float(float(v))
    if rec.kind == PY_COMPLEX:
        return [_json_float(float(v[0])), _json_float(float(v[1]))]
    if rec.kind == PY_BYTES:
        return base64.b64encode(bytes(v)).decode("ascii")
    return v  # bool, str


def _out_dir(out: Any) -> str:
    return local_out_dir(out, "ckpt export --format zarr writes to a local directory, got OUT")


def _earlier_export(directory: str) -> bool:
    try:
        with open(os.path.join(directory, ZARR_JSON), "rb") as f:
            doc = json.loads(f.read())
        return doc["attributes"]["jax_ckpt"]["export"] == EXPORT_MARK
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _check_out(directory: str, overwrite: bool) -> bool:
    """Whether OUT holds an earlier zarr export to replace; raises where OUT may not be written."""
    if not os.path.lexists(directory):
        return False
    if not os.path.isdir(directory):
        raise FileExistsError(17, "OUT exists and is not a directory (ckpt export --format zarr writes a "
                              "directory)", directory)
    if not os.listdir(directory):
        return False
    if overwrite and _earlier_export(directory):
        return True
    why = ("--overwrite replaces only an earlier 'ckpt export --format zarr' (its root zarr.json says so), "
           "and this is not one" if overwrite else
           "ckpt export --format zarr writes into a new or empty directory (--overwrite replaces an earlier "
           "zarr export)")
    raise FileExistsError(39, f"OUT is not empty: {why}", directory)


class _Writer:
    """Files of the export under `root`, written and fsynced by a few threads; every directory
    made is remembered, to be fsynced once at the end."""

    def __init__(self, root: str):
        self.root = root
        self.dirs: set[str] = {root}
        self.pool = ThreadPoolExecutor(_WRITERS, thread_name_prefix="ckpt-export-zarr")
        self.pending: list = []

    def _mkdirs(self, rel_dir: str) -> None:
        path = self.root
        for part in rel_dir.split("/") if rel_dir else ():
            path = os.path.join(path, part)
            if path not in self.dirs:
                os.makedirs(path, exist_ok=True)
                self.dirs.add(path)

    def put(self, rel: str, data) -> None:
        self._mkdirs(rel.rpartition("/")[0])
        self.pending.append(self.pool.submit(_write_file, os.path.join(self.root, rel), data))

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    def finish(self) -> None:
        self.wait()
        for f in [self.pool.submit(_fsync_dir, d) for d in self.dirs]:
            f.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _write_file(path: str, data) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data).cast("B")
        while len(view):
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


_fsync_dir = fsync_path


def _chunk_key(zpath: str, index: tuple[int, ...]) -> str:
    return "/".join([zpath, "c", *map(str, index)])


def _chunk_bytes(data: np.ndarray, box: Box, chunk_shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The chunk file's contents: the whole chunk shape (an edge chunk zero-padded, as Zarr stores
    it), C order, little-endian storage dtype."""
    le = dtype.newbyteorder("<")
    shape = tuple(b - a for a, b in box)
    if shape == tuple(chunk_shape):
        return np.ascontiguousarray(data, dtype=le).reshape(-1).view(np.uint8)
    full = np.zeros(chunk_shape, dtype=le)
    full[tuple(slice(0, n) for n in shape)] = data
    return full.reshape(-1).view(np.uint8)


def _attributes(rec: LeafRecord, leaf_path: str, encoding: str) -> dict:
    info = {"path": leaf_path, "dtype": rec.dtype, "encoding": encoding, "kind": rec.kind}
    if rec.kind == PRNG_KEY:
        info["prng_impl"] = rec.prng_impl
    if rec.sharding is not None:
        info["sharding"] = rec.sharding
    return {"jax_ckpt": info}


def export_zarr(path: Any, out: Any, *, overwrite: bool = False, options: Options | None = None,
                progress: Callable[[int, int], None] | None = None) -> ZarrExport:
    """Write every array of the checkpoint at `path` as a plain Zarr v3 hierarchy in `out`
    (module docstring; docs/cli.md, "export"). FileExistsError where `out` is a non-empty
    directory that is not an earlier zarr export (or is one and `overwrite` is False);
    CheckpointError / ChecksumError / OSError as ``ckpt.restore`` raises them."""
    opts = resolve(options)
    directory = _out_dir(out)
    replace = _check_out(directory, overwrite)
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    with pinned(open_storage(path, opts)) as storage:
        manifest = require_manifest(storage)
        source = storage.url
        comps = leaf_components(manifest.tree)
        zpaths = storage_paths(comps)  # "~<leaf index>" where two paths clash (case-insensitively)
        leaf_paths = ["/".join(c) for c in comps]
        arrays = [i for i, r in enumerate(manifest.leaves) if r.kind in ARRAY_KINDS]
        itemsizes = {i: dtype_from_name(manifest.leaves[i].dtype).itemsize for i in arrays}
        total = sum(math.prod(manifest.leaves[i].shape) * itemsizes[i] for i in arrays)
        tmp = os.path.join(parent, f".{name}.tmp-{secrets.token_hex(6)}")
        os.mkdir(tmp)
        writer = _Writer(tmp)
        try:
            # Format version 3: chunks read through the index objects (packed data objects).
            reader = Reader(chunk_source(storage, manifest), manifest.leaves, True, RestoreStats(), opts)
            groups: set[str] = set()
            specs: dict[int, ArraySpec] = {}
            for i in arrays:
                rec = manifest.leaves[i]
                storage_dtype, encoding = storage_of(dtype_from_name(rec.dtype))
                parts = zpaths[i].split("/")
                groups.update("/".join(parts[:k]) for k in range(1, len(parts)))
                specs[i] = ArraySpec(tuple(rec.shape), tuple(rec.chunk_shape), storage_dtype,
                                     _attributes(rec, display_path(leaf_paths[i]), encoding))
                writer.put(f"{zpaths[i]}/{ZARR_JSON}", json.dumps(zarr_metadata(specs[i]), allow_nan=False).encode())
            done = chunks = 0
            for batch in _read_batches(manifest.leaves, arrays, itemsizes, reader, opts.host_budget_bytes):
                # The previous batch's files were written while this one was read; at most two
                # batches (each within half the budget) are alive at once.
                writer.wait()
                for i, box, data in batch:
                    spec = specs[i]
                    index = tuple(a // c for (a, _), c in zip(box, spec.chunk_shape))
                    writer.put(_chunk_key(zpaths[i], index), _chunk_bytes(data, box, spec.chunk_shape, spec.dtype))
                    done += data.nbytes
                    chunks += 1
                batch = data = None  # before the next batch is read
                if progress is not None:
                    progress(done, total)
            for g in sorted(groups):
                writer.put(f"{g}/{ZARR_JSON}", GROUP_METADATA)
            values = [i for i, r in enumerate(manifest.leaves) if r.kind not in ARRAY_KINDS]
            root = {"zarr_format": 3, "node_type": "group", "attributes": {
                "jax_ckpt": {"export": EXPORT_MARK, "source": source, "format_version": manifest.format_version,
                             "arrays": {leaf_paths[i]: zpaths[i] for i in arrays},
                             "values": {leaf_paths[i]: manifest.leaves[i].kind for i in values}},
                VALUES_KEY: {leaf_paths[i]: json_value(manifest.leaves[i]) for i in values}}}
            writer.put(ZARR_JSON, json.dumps(root, allow_nan=False).encode())
            writer.finish()
        except BaseException:
            writer.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        writer.close()
    _move_into_place(tmp, directory, replace)
    return ZarrExport(out=directory, arrays={leaf_paths[i]: zpaths[i] for i in arrays},
                      values=tuple(leaf_paths[i] for i in values), bytes=done, chunks=chunks)


def _source(rec: LeafRecord, index: tuple[int, ...], itemsize: int) -> tuple[tuple, int]:
    """(what the reader reads for chunk `index` of an array leaf, its bytes): the chunk, or for a
    member of a stack the stack's chunk holding it, read once for all its members in a batch."""
    stacked = rec.stacked
    if stacked is not None:
        st = stacked.array.zarr
        return ("s", st.path, stacked.index // st.chunk_shape[0]), \
            math.prod(st.chunk_shape) * np.dtype(st.data_type).itemsize
    return ("z", rec.path, index), math.prod(rec.chunk_shape) * itemsize


def _read_batches(leaves: list[LeafRecord], arrays: list[int], itemsizes: dict[int, int], reader: Reader,
                  budget: int) -> Iterator[list[tuple[int, Box, np.ndarray]]]:
    """Lists of (array leaf, chunk box, its data in the storage dtype) covering every chunk of
    `arrays`, each list read by one reader call: the chunks of consecutive leaves while what is
    read (each source chunk counted once) fits half the budget, or one chunk where a single one
    is larger. Batching across leaves reads a stack's chunk once for its members: leaf by leaf,
    a 4 MiB stack chunk was read again for each of its 6 KiB members (2,000 stacked leaves:
    8.2 GB read for 13 MB, measured)."""
    half = max(1, budget // 2)
    boxes: dict[int, list[Box]] = {}
    inline: list[tuple[int, Box, np.ndarray]] = []
    sources: set[tuple] = set()
    cost = 0

    def read() -> list[tuple[int, Box, np.ndarray]]:
        plans = [plan_leaf_read(i, leaves[i].shape, leaves[i].chunk_shape, itemsizes[i], b) for i, b in boxes.items()]
        regions = reader.read(plans) if plans else {}
        out = list(inline)
        for i, bs in boxes.items():
            for box in bs:
                data = regions[i].pop(box)
                if data.dtype != storage_of(data.dtype)[0]:  # a logical dtype: its storage bytes
                    data = to_storage(data)
                out.append((i, box, data))
        return out

    for i in arrays:
        rec = leaves[i]
        shape, chunk_shape = tuple(rec.shape), tuple(rec.chunk_shape)
        if rec.inline:  # in the manifest: a few KiB at most, one chunk
            if math.prod(shape):
                inline.append((i, full_box(shape), to_storage(rec.inline_array())))
            continue
        for index in itertools.product(*(range(n) for n in chunk_grid(shape, chunk_shape))):
            key, nbytes = _source(rec, index, itemsizes[i])
            if key not in sources:
                if cost and cost + nbytes > half:
                    yield read()
                    boxes, inline, sources, cost = {}, [], set(), 0
                sources.add(key)
                cost += nbytes
            boxes.setdefault(i, []).append(chunk_box(index, chunk_shape, shape))
    if boxes or inline:
        yield read()


def _move_into_place(tmp: str, directory: str, replace: bool) -> None:
    """The finished export becomes OUT: renamed onto a missing or empty OUT, or, replacing an
    earlier export, the old one renamed aside first and deleted after."""
    old = None
    try:
        if replace:
            old = f"{tmp}.old"
            os.rename(directory, old)
        os.rename(tmp, directory)  # replaces an empty directory; fails if something arrived since
    except BaseException:
        if old is not None and not os.path.exists(directory):
            os.rename(old, directory)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(os.path.dirname(directory))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def zarr_export_document(result: ZarrExport, source: str) -> dict:
    return {"source": source, "out": result.out, "format": "zarr", "arrays": result.arrays,
            "values": list(result.values), "bytes": result.bytes, "chunks": result.chunks}


def render_zarr_export(doc: dict) -> str:
    from ckpt.cli._render import human_bytes, plural

    lines = [(f"exported {plural(len(doc['arrays']), 'array')} ({human_bytes(doc['bytes'])}, "
              f"{plural(doc['chunks'], 'chunk file')}) of {doc['source']}"),
             f"to {doc['out']} as Zarr v3: zarr.open_group({doc['out']!r}) reads it"]
    if doc["values"]:
        shown = ", ".join(display_path(p) for p in doc["values"])
        lines.append(f"values in the root group's attributes ({VALUES_KEY}): {shown}")
    return "\n".join(lines)
