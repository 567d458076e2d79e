"""Export a checkpoint as Hugging Face style safetensors files (``ckpt export`` on the shell).

Reading goes the other way with no function of its own: ``ckpt.restore`` and ``ckpt.metadata``
accept a ``.safetensors`` file, a ``model.safetensors.index.json`` or a local directory of
shards (docs/frameworks.md).

``export`` streams: every array is read through restore's own chunk reader (each chunk checked
against its CRC-32C) one block at a time and written at its offset in the output file, so host
memory stays within ``Options.host_budget_bytes`` (or one chunk, where a single chunk is larger),
whatever the checkpoint's size.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import ARRAY_KINDS, PRNG_KEY, LeafRecord, display_path, leaf_components
from ckpt._format import dtype_from_name, to_storage
from ckpt._geometry import Box, ShardingInfo, chunk_box, chunk_grid, full_box
from ckpt._host import Options, resolve
from ckpt._restore import CODES, INDEX_NAME, META_KEY, SINGLE_NAME, plan_leaf_read, require_manifest
from ckpt.storage import open_storage

__all__ = ["ExportResult", "export"]

DEFAULT_SHARD_SIZE = 5 * 10**9  # as transformers' save_pretrained: "5GB"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

Rename = Callable[[str], "str | None"] | Mapping[str, "str | None"]


@dataclass(frozen=True)
class ExportResult:
    """What ``export`` wrote.

    Attributes:
        files: the files written, full paths: the shards, then the index when there is one.
        tensors: tensor name -> the file (name inside `out`) that holds it.
        bytes: bytes of tensor data written (headers not counted).
        skipped: default tensor names (key paths joined with '.', as `rename` receives them)
            of the leaves that are not tensors: numbers, strings and PRNG keys.
        dropped: default tensor names (the same style) of the arrays that `rename` dropped.
    """

    files: tuple[str, ...]
    tensors: dict[str, str]
    bytes: int
    skipped: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class _Entry:
    leaf: int
    path: str
    name: str
    code: str
    shape: tuple[int, ...]
    itemsize: int
    sharding: dict | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def _renamed(name: str, rename: Rename | None) -> str | None:
    if rename is None:
        return name
    if callable(rename):
        return rename(name)
    return rename.get(name, name)


def _entries(manifest, rename: Rename | None) -> tuple[list[_Entry], list[str], list[str]]:
    comps = leaf_components(manifest.tree)
    entries, skipped, dropped, seen = [], [], [], {}
    for i, rec in enumerate(manifest.leaves):
        path = display_path("/".join(comps[i]))
        # skipped and dropped are reported as tensor names are (and as `rename` sees them):
        # one naming style across ExportResult.
        default = ".".join(comps[i]) or display_path("")
        if rec.kind not in ARRAY_KINDS or rec.kind == PRNG_KEY:
            skipped.append(default)
            continue
        name = _renamed(".".join(comps[i]), rename)
        if name is None or name == "":
            dropped.append(default)
            continue
        if not isinstance(name, str) or name == "__metadata__":
            raise CheckpointError(f"leaf {path!r}: rename gave {name!r}, which is not a tensor name")
        if name in seen:
            raise CheckpointError(f"leaves {seen[name]!r} and {path!r} both become tensor {name!r}")
        seen[name] = path
        code = CODES.get(rec.dtype)
        if code is None:
            raise CheckpointError(
                f"leaf {path!r}: dtype {rec.dtype} has no safetensors equivalent (safetensors has "
                f"{', '.join(sorted(CODES))}); drop it with a rename that maps {name!r} to nothing")
        info = ShardingInfo.from_record(rec.sharding)
        sharding = rec.sharding if info is not None and info.kind == "named" else None
        entries.append(_Entry(i, path, name, code, tuple(rec.shape),
                              dtype_from_name(rec.dtype).itemsize, sharding))
    return entries, skipped, dropped


def _pack(entries: list[_Entry], shard_size: int) -> list[list[_Entry]]:
    """Consecutive groups of at most `shard_size` bytes (a larger tensor gets a file of its own)."""
    files: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > shard_size:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files if files[0] else []


def _header(entries: list[_Entry]) -> tuple[bytes, dict[str, int]]:
    """The file's 8-byte length and JSON header (padded to 8 bytes) and each tensor's data
    offset. Tensors are laid out largest item size first, so each starts aligned to its own."""
    offsets, doc, pos = {}, {}, 0
    for e in sorted(entries, key=lambda e: (-e.itemsize, e.name)):
        offsets[e.name] = pos
        doc[e.name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    shardings = {e.name: e.sharding for e in entries if e.sharding is not None}
    meta = {"format": "pt", META_KEY: json.dumps({"format_version": 1, "shardings": shardings}, separators=(",", ":"))}
    text = json.dumps({"__metadata__": meta, **doc}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    header = len(text).to_bytes(8, "little") + text
    return header, {name: len(header) + off for name, off in offsets.items()}


def _blocks(shape: tuple[int, ...], chunk_shape: tuple[int, ...], itemsize: int, budget: int) -> Iterator[Box]:
    """Boxes covering the array, read one at a time: bands of whole chunk rows over the full
    width (one contiguous write each) while a band and the chunks under it fit the budget,
    else single chunks."""
    if not shape:
        yield ()
        return
    row_bytes = math.prod(shape[1:]) * itemsize
    band_bytes = chunk_shape[0] * row_bytes
    half = max(1, budget // 2)  # the chunks read, and the band assembled from them
    if band_bytes <= half:
        step = chunk_shape[0] * max(1, half // max(band_bytes, 1))
        for r in range(0, shape[0], step):
            yield ((r, min(r + step, shape[0])),) + full_box(shape[1:])
        return
    for index in itertools.product(*(range(n) for n in chunk_grid(shape, chunk_shape))):
        yield chunk_box(index, chunk_shape, shape)


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _write_box(fd: int, base: int, shape: tuple[int, ...], itemsize: int, box: Box, data: np.ndarray) -> None:
    """Write a box of the array (C-order `data`) where it belongs in the tensor at `base`: one
    write per contiguous run (one in all when the box spans whole rows)."""
    src = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d], acc = acc, acc * shape[d]
    j = len(shape)
    while j > 0 and box[j - 1] == (0, shape[j - 1]):
        j -= 1
    if j == 0:
        _pwrite(fd, src, base)
        return
    run = (box[j - 1][1] - box[j - 1][0]) * strides[j - 1] * itemsize
    for n, idx in enumerate(itertools.product(*(range(a, b) for a, b in box[: j - 1]))):
        first = sum(i * s for i, s in zip(idx, strides)) + box[j - 1][0] * strides[j - 1]
        _pwrite(fd, src[n * run:(n + 1) * run], base + first * itemsize)


def local_out_dir(out: Any, what: str = "export writes to a local directory, got") -> str:
    """The absolute local directory an export writes to; CheckpointError for a URL."""
    if hasattr(out, "__fspath__"):
        out = os.fspath(out)
    if not isinstance(out, str) or "://" in out:
        raise CheckpointError(f"{what} {out!r}")
    return os.path.abspath(os.path.expanduser(out))


def export(path: Any, out: Any, *, shard_size: int = DEFAULT_SHARD_SIZE, rename: Rename | None = None,
           overwrite: bool = False, options: Options | None = None,
           progress: Callable[[int, int], None] | None = None) -> ExportResult:
    """Write the arrays of a checkpoint as Hugging Face style safetensors files in `out`.

    One ``model.safetensors`` when the data fits `shard_size`, else
    ``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size"}, "weight_map": {name: file}}``), as ``save_pretrained``
    writes them. Tensor names are the key paths joined with '.' (``params/dense/kernel`` ->
    ``params.dense.kernel``), then passed through `rename`. Dtypes are kept (bfloat16 as
    ``BF16``, float8_e4m3fn as ``F8_E4M3``, float8_e5m2 as ``F8_E5M2``...). The header's
    ``__metadata__`` holds ``"format": "pt"`` (what transformers checks for) and, under
    ``"jax_ckpt"``, each tensor's saved mesh and PartitionSpec, which ``ckpt.restore(mesh=)``
    uses. Files are written under temporary names and renamed into place when complete.

    Only arrays become tensors: numbers, strings and PRNG key arrays (typed keys, which have no
    safetensors dtype) are skipped and listed in ``ExportResult.skipped``. ``skipped``,
    ``dropped`` and the keys of ``tensors`` all use tensor-name style (``params.dense.kernel``;
    ``skipped`` and ``dropped`` hold the default names, before `rename`).

    Args:
        path: a committed checkpoint (any location ``ckpt.restore`` reads).
        out: a local directory; created if missing.
        shard_size: the most tensor bytes per file (default 5 GB, 5 * 10**9); a larger tensor
            gets a file of its own.
        rename: a function of the default name returning the tensor's name (None or '' drops
            the array), or a mapping from default names to names (None drops; names not in it
            are kept).
        overwrite: replace files of an earlier export in `out` (``model.safetensors``,
            ``model-*-of-*.safetensors``, the index) instead of raising.
        options: engine, concurrency and the host budget (``ckpt.Options``).
        progress: called as ``progress(bytes_done, bytes_total)`` after each block written.

    Returns:
        An ``ExportResult``: the files written, which file holds each tensor, the bytes, and
        the leaves not exported (skipped: not tensors, PRNG keys included; dropped by
        `rename`), named as tensors are.

    Raises:
        FileNotFoundError: nothing exists at `path`.
        FileExistsError: `out` already holds an export and `overwrite` is False.
        CheckpointError: `path` is not a committed checkpoint (a CheckpointManager directory:
            the message lists its steps and names the latest), a chunk is missing or damaged
            (naming leaf, chunk and file), an array's dtype has no safetensors equivalent
            (int4, float8_e4m3fnuz, complex128...: drop it with `rename`), two leaves get the
            same name, or `out` is not a local directory.
        ChecksumError: a chunk does not match its saved checksum.
        OSError: reading the checkpoint or writing `out` failed.
    """
    from ckpt._restore import Reader, RestoreStats, chunk_source

    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
    opts = resolve(options)
    directory = local_out_dir(out)
    storage = open_storage(path, opts)
    manifest = require_manifest(storage)
    entries, skipped, dropped = _entries(manifest, rename)
    groups = _pack(entries, shard_size)
    names = ([SINGLE_NAME] if len(groups) == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    os.makedirs(directory, exist_ok=True)
    existing = [n for n in os.listdir(directory) if n in (SINGLE_NAME, INDEX_NAME) or _SHARD_NAME.match(n)]
    if existing and not overwrite:
        raise FileExistsError(17, f"already holds an export ({', '.join(sorted(existing))}); replace it with "
                              "overwrite=True (ckpt export --overwrite)", directory)
    total = sum(e.nbytes for e in entries)
    reader = Reader(chunk_source(storage, manifest), manifest.leaves, True, RestoreStats(), opts)  # v3: via the index
    done = 0
    written: list[tuple[str, str]] = []  # (temporary, final)
    try:
        for group, name in zip(groups, names):
            tmp = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(6)}")
            written.append((tmp, os.path.join(directory, name)))
            header, offsets = _header(group)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.ftruncate(fd, len(header) + sum(e.nbytes for e in group))
                _pwrite(fd, memoryview(header), 0)
                for e in group:
                    done = _write_tensor(fd, offsets[e.name], e, manifest.leaves[e.leaf], reader, opts,
                                         done, total, progress)
                os.fsync(fd)
            finally:
                os.close(fd)
        if len(groups) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {e.name: n for group, n in zip(groups, names) for e in group}}
            tmp = os.path.join(directory, f".{INDEX_NAME}.tmp-{secrets.token_hex(6)}")
            written.append((tmp, os.path.join(directory, INDEX_NAME)))
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        for tmp, _ in written:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        raise
    for name in existing:  # an earlier export's files, replaced as a whole
        os.remove(os.path.join(directory, name))
    for tmp, final in written:
        os.replace(tmp, final)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return ExportResult(
        files=tuple(final for _, final in written),
        tensors={e.name: n for group, n in zip(groups, names) for e in group},
        bytes=total, skipped=tuple(skipped), dropped=tuple(dropped),
    )


def _write_tensor(fd: int, base: int, e: _Entry, rec: LeafRecord, reader, opts: Options, done: int, total: int,
                  progress: Callable[[int, int], None] | None) -> int:
    """Write one tensor block by block; returns the bytes done so far."""
    if rec.inline:  # inline in the manifest: a few KiB at most
        _pwrite(fd, memoryview(to_storage(rec.inline_array()).reshape(-1).view(np.uint8)), base)
        done += e.nbytes
        if progress is not None:
            progress(done, total)
        return done
    for box in _blocks(e.shape, rec.chunk_shape, e.itemsize, opts.host_budget_bytes):
        plan = plan_leaf_read(e.leaf, rec.shape, rec.chunk_shape, e.itemsize, [box])
        data = reader.read([plan])[e.leaf][box]  # storage dtype: the same bytes as the logical dtype
        _write_box(fd, base, e.shape, e.itemsize, box, data)
        done += data.nbytes
        del data
        if progress is not None:
            progress(done, total)
    return done
