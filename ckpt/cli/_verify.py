"""`ckpt verify`: read every chunk of a checkpoint and check it against the manifest.

Chunks are read whole through the storage interface (``Storage.read_chunk``, as restore reads
them) on any backend, and checked as formats/SPEC.md defines them (uncompressed, little-endian,
C order, CRC-32C of the part inside the array): the check is exactly the one a third-party reader
would make, a missing or short chunk is reported as such rather than as a decode error, and a
bad chunk does not stop the scan, so every bad chunk is named.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

import crc32c
import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import ARRAY_KINDS, Manifest, ZarrStorage, display_path
from ckpt._geometry import box_shape, chunk_box, chunk_grid, chunk_key
from ckpt.cli._render import stack_label
from ckpt.storage import Storage

ZARR_JSON_LIMIT = 1 << 20  # an array's zarr.json is a few hundred bytes
# Chunks in flight at once: each is held whole in memory while it is checked.
WORKERS = max(4, min(16, 2 * (os.cpu_count() or 1)))


@dataclass(frozen=True)
class Problem:
    """Something wrong with one chunk (chunk is not None) or with a whole array."""

    leaf: str
    chunk: tuple[int, ...] | None
    file: str
    what: str

    def __str__(self) -> str:
        where = "" if self.chunk is None else f", chunk {list(self.chunk)}"
        return f"leaf {display_path(self.leaf)!r}{where} ({self.file}): {self.what}"


@dataclass
class VerifyReport:
    arrays: int = 0
    inline_arrays: int = 0
    chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class _ChunkTask:
    order: tuple[int, int]
    leaf: str
    index: tuple[int, ...]
    array: str  # the array's storage path (from the manifest)
    file: str  # the chunk's full location, for messages
    chunk_shape: tuple[int, ...]
    box_shape: tuple[int, ...]
    dtype: np.dtype  # storage dtype, little-endian
    expected_crc: int
    packed: bool = False  # in a data object of the packed layout (format version 3)

    @property
    def file_bytes(self) -> int:
        return math.prod(self.chunk_shape) * self.dtype.itemsize


def _metadata_crc_problem(raw: bytes, crc: int | None) -> str | None:
    """Why a zarr.json's bytes are not those the manifest recorded (None when they are, or when
    the manifest predates recording them)."""
    if crc is None:
        return None
    got = crc32c.crc32c(raw)
    if got != crc:
        return f"zarr.json was changed after the save: its crc32c is {got:#010x}, the manifest records {crc:#010x}"
    return None


def _array_metadata_problem(storage: Storage, array: str, st: ZarrStorage, shape: list[int],
                            crc: int | None = None) -> tuple[str | None, bool]:
    """(why the array's zarr.json does not describe the layout the manifest records, or differs
    from the bytes whose CRC-32C the manifest records (`crc`), or None; whether its chunk files
    can still be checked as the manifest lays them out)."""
    try:
        raw = storage.get(f"{array}/zarr.json", max_bytes=ZARR_JSON_LIMIT)
        meta = json.loads(raw)
    except FileNotFoundError:
        return "zarr.json is missing", True
    except (OSError, CheckpointError, ValueError) as e:
        return f"zarr.json is unreadable ({_without(str(e), storage.where(f'{array}/zarr.json'))})", True
    if not isinstance(meta, dict):
        return "zarr.json is not a JSON object", True
    grid = meta.get("chunk_grid") or {}
    codecs = meta.get("codecs")
    checks = [
        (meta.get("zarr_format") == 3 and meta.get("node_type") == "array", "is not a Zarr v3 array", True),
        (meta.get("shape") == list(shape), f"shape {meta.get('shape')} differs from the manifest's {list(shape)}",
         True),
        (meta.get("data_type") == st.data_type,
         f"data_type {meta.get('data_type')!r} differs from the manifest's {st.data_type!r}", False),
        (grid.get("name") == "regular"
         and (grid.get("configuration") or {}).get("chunk_shape") == list(st.chunk_shape),
         f"chunk grid {grid} differs from the manifest's chunk_shape {list(st.chunk_shape)}", False),
        ((meta.get("chunk_key_encoding") or {}).get("name") == "default"
         and ((meta.get("chunk_key_encoding") or {}).get("configuration") or {}).get("separator", "/") == "/",
         f"chunk_key_encoding {meta.get('chunk_key_encoding')} is not the default '/' encoding", False),
        (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)
         and codecs[0].get("name") == "bytes"
         and (codecs[0].get("configuration") or {}).get("endian", "little") == "little",
         f"codecs {codecs} are not the single little-endian 'bytes' codec of this format", False),
    ]
    for ok, why, chunks_readable in checks:
        if not ok:
            return why, chunks_readable
    return _metadata_crc_problem(raw, crc), True


def _group_metadata_problems(storage: Storage, manifest: Manifest, arrays: set[str]) -> list[Problem]:
    """Every group zarr.json the manifest records a CRC-32C for, read and checked."""
    problems = []
    for key, crc in sorted((manifest.zarr_json or {}).items()):
        if key in arrays:
            continue
        group = key[: -len("zarr.json")].rstrip("/")
        try:
            why = _metadata_crc_problem(storage.get(key, max_bytes=ZARR_JSON_LIMIT), crc)
        except FileNotFoundError:
            why = "zarr.json is missing"
        except (OSError, CheckpointError) as e:
            why = f"zarr.json is unreadable ({_without(str(e), storage.where(key))})"
        if why is not None:
            problems.append(Problem(f"<group {group or '/'}>", None, storage.where(key), why))
    return problems


def _without(text: str, where: str) -> str:
    """An engine's message about the object at `where`, with `where` said as 'file' (the problem
    line names the file already)."""
    return "file" + text[len(where):] if text.startswith(where) else text


def _longer_problem(storage: Storage, task: _ChunkTask) -> str | None:
    """Why the chunk file is longer than recorded, or None (a read past its end finds nothing)."""
    try:
        storage.read_range(f"{task.array}/{chunk_key(task.index)}", task.file_bytes, 1)
    except CheckpointError:  # it ends where it should
        return None
    except FileNotFoundError:
        return "file is missing"
    except OSError as e:
        return f"cannot read the file ({e.strerror or e})"
    return f"file holds more than the {task.file_bytes} bytes expected"


def _check_chunk(storage: Storage, task: _ChunkTask) -> str | None:
    """Why the chunk is bad, or None when it is intact."""
    try:
        raw = storage.read_chunk(task.array, task.index, task.file_bytes)
    except FileNotFoundError:
        return "file is missing"
    except CheckpointError as e:  # the engines report a wrong size this way
        return _without(str(e), task.file)
    except OSError as e:
        return f"cannot read the file ({e.strerror or e})"
    if not storage.caps.reads_refuse_longer and not task.packed:
        # The engine reads only the recorded size (TensorStore on S3/GCS: a longer object's tail
        # is never read, so restores are unaffected): one ranged read of the byte past the end
        # tells a chunk file longer than recorded (docs/storage.md, "Confined reads").
        longer = _longer_problem(storage, task)
        if longer is not None:
            return longer
    if task.box_shape == task.chunk_shape:
        crc = crc32c.crc32c(raw)
    else:
        # An edge chunk: the checksum covers the part inside the array, not the padding.
        part = raw.view(task.dtype).reshape(task.chunk_shape)[tuple(slice(0, n) for n in task.box_shape)]
        crc = crc32c.crc32c(np.ascontiguousarray(part).reshape(-1).view(np.uint8))
    if crc != task.expected_crc:
        return f"checksum mismatch: crc32c of the data is {crc:#010x}, the manifest records {task.expected_crc:#010x}"
    return None


def _tasks(storage: Storage, manifest: Manifest, report: VerifyReport) -> list[_ChunkTask]:
    tasks = []
    if manifest.layout is not None:  # version 3: the structure every process relies on, first
        from ckpt.cli._verify_packed import packed_problems

        found, listable = packed_problems(storage, manifest)
        report.problems += [Problem(*p) for p in found]
        if not listable:
            return []
    for i, rec in enumerate(manifest.leaves):
        if rec.kind not in ARRAY_KINDS:
            continue
        st = rec.zarr
        if rec.stacked is not None:
            report.arrays += 1  # its stack's chunks are checked below
            continue
        if st is None:
            report.inline_arrays += 1  # its length was checked with the manifest
            continue
        report.arrays += 1
        array = st.path
        if manifest.layout is None:  # (version 3 has no zarr.json: the manifest holds the metadata)
            why, chunks_readable = _array_metadata_problem(storage, array, st, list(rec.shape),
                                                           (manifest.zarr_json or {}).get(f"{array}/zarr.json"))
            if why is not None:
                report.problems.append(Problem(rec.path, None, storage.where(f"{array}/zarr.json"), why))
            if not chunks_readable:
                continue
        dtype = np.dtype(st.data_type).newbyteorder("<")
        chunk_shape = st.chunk_shape
        grid = chunk_grid(rec.shape, chunk_shape)
        for flat, index in enumerate(np.ndindex(*grid)):
            task = _task((i, flat), rec.path, tuple(index), array, chunk_shape,
                         box_shape(chunk_box(index, chunk_shape, rec.shape)), dtype, st, flat, storage, report)
            if task is not None:
                tasks.append(task)
    members: dict[int, list[tuple[int, str]]] = {}
    for rec in manifest.leaves:
        if rec.stacked is not None:
            members.setdefault(rec.stacked.stack, []).append((rec.stacked.index, rec.path))
    for s, stack in enumerate(manifest.stacks):
        st, names = stack.zarr, members.get(s, [])
        name = stack_label(s, names)
        if manifest.layout is None:
            why, chunks_readable = _array_metadata_problem(storage, st.path, st, list(stack.shape),
                                                           (manifest.zarr_json or {}).get(f"{st.path}/zarr.json"))
            if why is not None:
                report.problems.append(Problem(name, None, storage.where(f"{st.path}/zarr.json"), why))
            if not chunks_readable:
                continue
        dtype = np.dtype(st.data_type).newbyteorder("<")
        for flat, index in enumerate(np.ndindex(*chunk_grid(stack.shape, st.chunk_shape))):
            rows = (index[0] * st.chunk_shape[0], min((index[0] + 1) * st.chunk_shape[0], stack.shape[0]))
            task = _task((len(manifest.leaves) + s, flat), stack_label(s, names, rows), tuple(index), st.path, st.chunk_shape,
                         box_shape(chunk_box(index, st.chunk_shape, stack.shape)), dtype, st, flat, storage, report)
            if task is not None:
                tasks.append(task)
    if manifest.layout is None:
        arrays = {f"{l.zarr.path}/zarr.json" for l in manifest.leaves if l.zarr is not None}
        arrays |= {f"{stack.zarr.path}/zarr.json" for stack in manifest.stacks}
        report.problems += _group_metadata_problems(storage, manifest, arrays)
    return tasks


def _task(order, leaf: str, index: tuple, array: str, chunk_shape, box, dtype, st, flat: int, storage: Storage,
          report: VerifyReport) -> _ChunkTask | None:
    """The check of one chunk: its file and recorded CRC-32C from the manifest, or (format version
    3) from the index object that holds it; None, with the problem reported, when that index
    object cannot say."""
    if not st.chunk_checksums:
        try:
            crc, where = storage.chunk_check(array, index)
            return _ChunkTask(order, leaf, index, array, where, chunk_shape, box, dtype, crc, packed=True)
        except CheckpointError as e:
            report.problems.append(Problem(leaf, index, storage.where(array), str(e)))
            return None
    return _ChunkTask(order, leaf, index, array, storage.where(f"{array}/{chunk_key(index)}"), chunk_shape, box,
                      dtype, st.chunk_checksums[flat])


def verify_checkpoints(checkpoints: list[tuple[Storage, Manifest]],
                       progress: Callable[[int, int], None] | None = None) -> list[VerifyReport]:
    """Check every chunk of every array of each checkpoint (one report each), all chunks on one
    pool; `progress(done_bytes, total_bytes)` is called as chunks finish, over all of them."""
    start = time.perf_counter()
    reports = [VerifyReport() for _ in checkpoints]
    # Each checkpoint's own time: from its first chunk sent to the pool to its last chunk checked
    # (checkpoints are queued one after the other, so these spans barely overlap).
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tasks = [(k, t) for k, (storage, manifest) in enumerate(checkpoints)
             for t in _tasks(storage, manifest, reports[k])]
    total = sum(t.file_bytes for _, t in tasks)
    done = 0
    found: list[tuple[int, tuple[int, int], Problem]] = []
    if progress is not None:
        progress(0, total)
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="ckpt-verify") as pool:
        pending: dict = {}
        queue = iter(tasks)
        while True:
            while len(pending) < WORKERS and (item := next(queue, None)) is not None:
                k, task = item
                first.setdefault(k, time.perf_counter())
                pending[pool.submit(_check_chunk, checkpoints[k][0], task)] = item
            if not pending:
                break
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                k, task = pending.pop(fut)
                why = fut.result()
                if why is not None:
                    found.append((k, task.order, Problem(task.leaf, task.index, task.file, why)))
                reports[k].bytes += task.file_bytes
                reports[k].chunks += 1
                last[k] = time.perf_counter()
                done += task.file_bytes
            if progress is not None:
                progress(done, total)
    for k, _, problem in sorted(found, key=lambda x: (x[0], x[1])):
        reports[k].problems.append(problem)
    end = time.perf_counter()
    for k, r in enumerate(reports):
        # A checkpoint without chunks (every array inline) took only its share of the setup.
        r.seconds = last[k] - first[k] if k in first else 0.0
    if len(reports) == 1:
        reports[0].seconds = end - start  # one checkpoint: everything, metadata checks included
    return reports


def verify_checkpoint(storage: Storage, manifest: Manifest,
                      progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check every chunk of every array of the checkpoint at `storage`; `progress(done_bytes,
    total_bytes)` is called as chunks finish."""
    return verify_checkpoints([(storage, manifest)], progress)[0]


def verify_document(report: VerifyReport, path: str) -> dict:
    """What `verify --json` prints for one checkpoint."""
    return {
        "path": path, "intact": report.intact, "arrays": report.arrays, "inline_arrays": report.inline_arrays,
        "chunks": report.chunks, "bytes": report.bytes, "seconds": report.seconds,
        "problems": [{"leaf": p.leaf, "chunk": None if p.chunk is None else list(p.chunk), "file": p.file,
                      "what": p.what} for p in report.problems],
    }

