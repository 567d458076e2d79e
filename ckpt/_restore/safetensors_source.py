"""Reading safetensors files as checkpoints: ``ckpt.restore`` and ``ckpt.metadata`` of a
``.safetensors`` file, a ``model.safetensors.index.json`` or a local directory of shards.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian N, N bytes of
JSON (``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}``), then
the tensors' bytes, C order, little-endian, offsets relative to the end of the header. Files are
untrusted input: the header is parsed here (no pickle, no third-party parser) and checked before
anything else is read: its length, UTF-8 JSON without duplicate keys, a dtype allow-list, sizes
that match shapes, offsets inside the file that cover the data exactly once.

A restore reads through restore's own reader (``ckpt._restore.Reader``): each tensor is given a
chunk grid cut at the boundaries of the regions this process's devices need (so a process reads
only its part) and a chunk is read as the byte ranges of its rows (``Storage.read_range``, confined
like every read of the storage).

Symbolic links: a link among the files is followed only when its target stays under the root
the files are read from (``Storage.read_range``); that root is the directory named (or the
named file's), except in a Hugging Face cache snapshot (``<repo>/snapshots/<revision>/``, beside a
``<repo>/blobs/`` directory), whose files are links into ``blobs/``: there the root is ``<repo>``.

Size: the safetensors format (header, index files, Hugging Face cache snapshots) and the source that
reads it are one reader.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import types
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from ckpt._errors import CheckpointError
from ckpt._format import (
    DICT,
    LEAF,
    MANIFEST_NAME,
    InlineStorage,
    LeafRecord,
    ZarrStorage,
    check_sharding,
    unflatten,
)
from ckpt._format import dtype_from_name, storage_of
from ckpt._geometry import Box, box_shape, chunk_box, chunk_grid, common_grid, index_to_box
from ckpt._host import aligned_empty
from ckpt._host import Options, resolve
from ckpt.storage import ChunkFiles, Storage, StoreCaps, location_text, open_storage, pinned

# safetensors dtype codes and the numpy/ml_dtypes names they are (byte-sized types only: the
# packed 4- and 6-bit types F4, F6_E2M3, F6_E3M2 are refused).
DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "F16": "float16",
    "BF16": "bfloat16", "U32": "uint32", "I32": "int32", "F32": "float32", "U64": "uint64", "I64": "int64",
    "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
CODES = {name: code for code, name in DTYPES.items()}
SUFFIX = ".safetensors"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
META_KEY = "jax_ckpt"  # our entry in __metadata__: JSON {"format_version": 1, "shardings": {name: record}}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_INDEX_BYTES = 100_000_000
MAX_NDIM = 64
# A region of a tensor is read as one range when that range holds at most this many bytes the
# region does not need (fewer, larger reads); otherwise it is split into rows.
DENSE_READ_BYTES = 1 << 16


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: where its bytes are and what they are."""

    name: str
    file: str  # object name inside the set's directory
    dtype: str  # numpy / ml_dtypes name
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int
    sharding: dict | None = None  # recorded by `ckpt export` (a manifest sharding record)


class RangeReader:
    """Byte ranges of the objects below one location, through the Storage interface alone
    (``size``, ``read_range``: confined like every read); thread-safe; counts what it reads.
    The storage is pinned (``Storage.pin``) until ``close()``."""

    def __init__(self, storage: Storage):
        self._pin = contextlib.ExitStack()
        self.storage = self._pin.enter_context(pinned(storage))
        self.bytes_read = 0
        self.reads = 0
        self._lock = threading.Lock()

    def size(self, key: str) -> int | None:
        """The object's size in bytes; None where the engine cannot tell without reading it."""
        return self.storage.size(key)

    def read(self, key: str, offset: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
        """`nbytes` bytes of object `key` from `offset`, into `out` (uint8, at least `nbytes`
        long) or a fresh buffer. CheckpointError naming the object when it ends before."""
        buf = self.storage.read_range(key, offset, nbytes, None if out is None else out[:nbytes])
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1
        return buf

    def close(self) -> None:
        self._pin.close()


@dataclass
class TensorSet:
    """The tensors of one file or of the shards an index names, below one directory."""

    reader: RangeReader
    where: str
    tensors: list[Tensor]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(header: bytes, data_bytes: int | None, file: str, where: str) -> tuple[list[Tensor], dict]:
    """The tensors and ``__metadata__`` of a header; `data_bytes`: bytes after the header (None
    when unknown). CheckpointError naming the file and the field at fault."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: not a valid safetensors file: {why}")

    try:
        doc = json.loads(header.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"header is not UTF-8 JSON ({e})") from None
    if not isinstance(doc, dict):
        raise bad("header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ is not a map of strings to strings")
    spans, tensors = [], []
    for name, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) - {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r} is not a map of dtype, shape and data_offsets")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if code not in DTYPES:
            raise bad(f"tensor {name!r} has dtype {code!r}, which jax-ckpt does not read "
                      f"(it reads {', '.join(DTYPES)})")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(n) and n >= 0 for n in shape):
            raise bad(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise bad(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
        itemsize = np.dtype(dtype_from_name(DTYPES[code])).itemsize
        want = math.prod(shape) * itemsize
        if offsets[1] - offsets[0] != want:
            raise bad(f"tensor {name!r} of shape {shape} {code} needs {want} bytes, "
                      f"its data_offsets {offsets} hold {offsets[1] - offsets[0]}")
        if data_bytes is not None and offsets[1] > data_bytes:
            raise bad(f"tensor {name!r} ends at byte {offsets[1]} of the data, which has {data_bytes} bytes")
        spans.append((offsets[0], offsets[1], name))
        tensors.append((name, DTYPES[code], tuple(shape), offsets[0], want))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {name!r} starts at byte {begin} of the data, expected {end} "
                      "(tensors must cover the data without gaps or overlaps)")
        end = stop
    if data_bytes is not None and end != data_bytes:
        raise bad(f"the tensors cover {end} bytes of data, the file holds {data_bytes}")
    return [Tensor(n, file, d, s, o, b) for n, d, s, o, b in tensors], meta


def _shardings(meta: dict, tensors: list[Tensor], where: str) -> dict[str, dict]:
    """The shardings `ckpt export` recorded in __metadata__ (checked like a manifest's)."""
    text = meta.get(META_KEY)
    if text is None:
        return {}
    by_name = {t.name: t for t in tensors}
    try:
        doc = json.loads(text)
        records = doc["shardings"] if isinstance(doc, dict) and doc.get("format_version") == 1 else None
        if not isinstance(records, dict):
            raise ValueError("expected {'format_version': 1, 'shardings': {...}}")
        for name, rec in records.items():
            if name not in by_name:
                raise ValueError(f"names tensor {name!r}, which the file does not hold")
            check_sharding(rec, len(by_name[name].shape))
            if rec is not None and rec.get("kind") != "named":
                raise ValueError(f"tensor {name!r}: only named shardings are recorded")
    except Exception as e:  # whatever the manifest's own check raises, it is this file's fault
        raise CheckpointError(f"{where}: __metadata__[{META_KEY!r}] is invalid: {e}") from None
    return records


def _read_file(reader: RangeReader, file: str) -> list[Tensor]:
    where = reader.storage.where(file)
    size = reader.size(file)
    if size is not None and size < 8:
        raise CheckpointError(f"{where}: not a valid safetensors file: {size} bytes, shorter than its 8-byte header length")
    n = int(np.frombuffer(reader.read(file, 0, 8).tobytes(), "<u8")[0])
    if n > MAX_HEADER_BYTES or (size is not None and n > size - 8):
        raise CheckpointError(f"{where}: not a valid safetensors file: header length {n} is larger than "
                              f"{'the file' if size is not None and n <= MAX_HEADER_BYTES else 'the 100 MB limit'}")
    header = reader.read(file, 8, n).tobytes()
    tensors, meta = parse_header(header, None if size is None else size - 8 - n, file, where)
    if size is None and tensors:  # no size from this engine: at least the last byte must be there
        last = max(t.offset + t.nbytes for t in tensors)
        if last:
            reader.read(file, 8 + n + last - 1, 1)
    shardings = _shardings(meta, tensors, where)
    return [replace(t, offset=8 + n + t.offset, sharding=shardings.get(t.name)) for t in tensors]


def _index_files(reader: RangeReader, index: str) -> dict[str, list[str]]:
    """{shard file: [tensor names]} from a model.safetensors.index.json (keys: names below the
    index's directory)."""
    where = reader.storage.where(index)
    # Read as a range (a Hugging Face cache's index is a link into blobs/, which get() refuses).
    size = reader.size(index)
    if size is None:
        text = reader.storage.get(index, max_bytes=MAX_INDEX_BYTES)
    elif size > MAX_INDEX_BYTES:
        raise CheckpointError(f"{where}: not a valid safetensors index: {size} bytes, more than the "
                              f"{MAX_INDEX_BYTES} bytes an index may hold")
    else:
        text = reader.read(index, 0, size).tobytes()
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: not a valid safetensors index: not JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where}: not a valid safetensors index: no 'weight_map' object")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if (not isinstance(file, str) or not file.endswith(SUFFIX) or "/" in file or "\\" in file
                or file.startswith(".")):
            raise CheckpointError(f"{where}: weight_map[{name!r}] = {file!r} is not a .safetensors file "
                                  "name in the index's directory")
        files.setdefault(file, []).append(name)
    return files


def _root_of(directory: str) -> tuple[str, str]:
    """(the root files are read from, the directory's key prefix below it): the directory
    itself, or for a Hugging Face cache snapshot (``<repo>/snapshots/<rev>`` beside
    ``<repo>/blobs``) the repo, so that its links into ``blobs/`` stay under the root."""
    if "://" not in directory:
        snapshots = os.path.dirname(directory)
        repo = os.path.dirname(snapshots)
        if (os.path.basename(snapshots) == "snapshots" and os.path.basename(directory)
                and os.path.isdir(os.path.join(repo, "blobs"))):
            return repo, f"snapshots/{os.path.basename(directory)}/"
    return directory, ""


def _split(text: str) -> tuple[str, str]:
    if "://" in text:
        head, _, tail = text.rpartition("/")
        return head, tail
    return os.path.dirname(text) or "/", os.path.basename(text)


def is_safetensors(location: Any, options: Options | None = None) -> bool:
    """Whether `location` names safetensors rather than a jax-ckpt checkpoint: a ``.safetensors``
    file, a ``.safetensors.index.json``, or (not through a custom engine) a local directory
    without a manifest that holds them. Cheap: at most a stat for a local checkpoint, no I/O for
    a URL or a custom engine."""
    try:
        text = location_text(location)
    except (TypeError, CheckpointError):
        return False
    if text.endswith(SUFFIX) or text.endswith(SUFFIX + ".index.json"):
        return True
    if options is not None and callable(options.engine):
        return False  # a custom engine decides what its directories hold: named files only
    if "://" in text or os.path.exists(os.path.join(text, MANIFEST_NAME)) or not os.path.isdir(text):
        return False
    try:
        return any(n.endswith(SUFFIX) for n in os.listdir(text))
    except OSError:
        return False


def open_tensors(location: Any, options: Options | None = None) -> TensorSet:
    """Every tensor of a safetensors file, index, or directory of shards, headers checked."""
    opts = resolve(options)
    text = location_text(location)
    index = single = None
    if text.endswith(SUFFIX + ".index.json"):
        directory, index = _split(text)
    elif text.endswith(SUFFIX):
        directory, single = _split(text)
    else:
        directory = text
    root, prefix = _root_of(directory)
    reader = RangeReader(open_storage(root, opts))
    storage = reader.storage
    try:
        if index is None and single is None:
            objects = storage.list_dir(prefix)[0]
            if INDEX_NAME in objects:
                index = INDEX_NAME
            elif not any(n.endswith(SUFFIX) for n in objects):
                raise FileNotFoundError(2, "no .safetensors files or index here", storage.where(prefix.rstrip("/")))
        if single is not None:
            files = {single: None}
        elif index is not None:
            files = _index_files(reader, prefix + index)
        else:
            files = {n: None for n in storage.list_dir(prefix)[0] if n.endswith(SUFFIX)}
        files = {prefix + n: listed for n, listed in files.items()}
        index = None if index is None else prefix + index
        tensors: list[Tensor] = []
        seen: dict[str, str] = {}
        for file, listed in files.items():
            found = _read_file(reader, file)
            if listed is not None:
                names = {t.name for t in found}
                missing = [n for n in listed if n not in names]
                extra = sorted(names - set(listed))
                if missing or extra:
                    raise CheckpointError(
                        f"{storage.where(file)} does not match {storage.where(index)}: "
                        + (f"it lacks {missing[:5]} " if missing else "")
                        + (f"it holds {extra[:5]}, which the index maps elsewhere or not at all" if extra else ""))
            for t in found:
                if t.name in seen:
                    raise CheckpointError(f"tensor {t.name!r} is in both {seen[t.name]} and {file}")
                seen[t.name] = file
            tensors += found
    except BaseException:
        reader.close()
        raise
    where = storage.where(index or (prefix + single if single else prefix.rstrip("/")))
    return TensorSet(reader, where, sorted(tensors, key=lambda t: t.name))


# ---- as a checkpoint ------------------------------------------------------------------------

def tree_of(names: list[str], where: str) -> dict:
    """The manifest tree encoding of tensors named 'a.b.c' (nested dicts), leaf i = names[i]."""
    root: dict = {}
    for i, name in enumerate(names):
        node, parts = root, name.split(".")
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            child = node.get(part)
            if (child is not None and (last or isinstance(child, int))):
                other = names[child] if isinstance(child, int) else next(
                    n for n in names if n.startswith(".".join(parts[:k + 1]) + "."))
                raise CheckpointError(f"{where}: tensor names {other!r} and {name!r} do not form a tree "
                                      "(one is a prefix of the other at a '.')")
            if last:
                node[part] = i
            else:
                node = node.setdefault(part, {})

    def encode(node) -> dict:
        if isinstance(node, int):
            return {"kind": LEAF, "index": node}
        return {"kind": DICT, "keys": list(node), "children": [encode(c) for c in node.values()]}

    return encode(root)


def _record(i: int, t: Tensor) -> LeafRecord:
    logical = dtype_from_name(t.dtype)
    storage_dtype, encoding = storage_of(logical)
    storage: Any = (InlineStorage(b"") if t.nbytes == 0 else
                    ZarrStorage(str(i), tuple(t.shape), storage_dtype.name, encoding, "none"))
    return LeafRecord(t.name, "jax.Array", tuple(t.shape), logical.name,
                      t.sharding or {"kind": "single_device"}, storage)




def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def read_box(reader: RangeReader, t: Tensor, box: Box, out: np.ndarray) -> None:
    """Fill `out` (uint8, C-contiguous, the box's bytes) with a region of tensor `t`, reading
    only byte ranges of that region (rows of it where one range would read much more)."""
    itemsize = dtype_from_name(t.dtype).itemsize
    shape_b = tuple(t.shape) + (itemsize,)
    strides = _c_strides(shape_b)

    def fill(bx: Box, dst: np.ndarray) -> None:
        start = sum(a * s for (a, _), s in zip(bx, strides))
        span = sum((b - 1) * s for (_, b), s in zip(bx, strides)) + 1 - start
        need = dst.size
        if span == need:
            reader.read(t.file, t.offset + start, need, out=dst.reshape(-1))
            return
        split = next((d for d, (a, b) in enumerate(bx) if b - a > 1), None)
        if span - need <= DENSE_READ_BYTES or split is None:
            buf = reader.read(t.file, t.offset + start, span)
            dst[...] = np.lib.stride_tricks.as_strided(buf, shape=box_shape(bx), strides=strides, writeable=False)
            return
        a, b = bx[split]
        for i in range(a, b):
            sub = bx[:split] + ((i, i + 1),) + bx[split + 1:]
            fill(sub, dst[(slice(None),) * split + (slice(i - a, i - a + 1),)])

    fill(tuple(box) + ((0, itemsize),), out.reshape(box_shape(box) + (itemsize,)))


class _ChunkSource:
    """What restore's reader needs of a Storage (``where``, ``read_chunk``), over tensors: a chunk
    of leaf i is its box of tensor i, read as byte ranges."""

    caps = StoreCaps("safetensors")  # (ranged reads into fresh buffers, no read window)
    read_chunk_async = ChunkFiles.read_chunk_async  # (read_chunk on the reader's executor)

    def __init__(self, tset: TensorSet, leaves: list[LeafRecord]):
        self.tset, self.leaves = tset, leaves

    def where(self, key: str) -> str:
        t = self.tset.tensors[int(key.split("/", 1)[0])]
        return f"{self.tset.reader.storage.where(t.file)}, tensor {t.name!r}"

    def read_chunk(self, path: str, index: tuple[int, ...], nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
        i = int(path)
        t, rec = self.tset.tensors[i], self.leaves[i]
        out = aligned_empty(nbytes)
        read_box(self.tset.reader, t, chunk_box(index, rec.zarr.chunk_shape, t.shape), out)
        return out


def _boxes(want, rec: LeafRecord) -> list[Box]:
    if want.sharding is None:
        return [tuple((0, n) for n in rec.shape)]
    return [index_to_box(idx, rec.shape) for idx in want.sharding.addressable_devices_indices_map(rec.shape).values()]


def restore_with_stats(location: Any, target: Any = None, *, mesh: jax.sharding.Mesh | None = None,
                       partial: bool = False, options: Options | None = None, allow_lossy_cast: bool = False,
                       axis_names: dict[str, str] | None = None, rename: Any = None):
    """``ckpt.restore`` of safetensors (see ``restore``); also returns the RestoreStats and the
    RangeReader's byte count."""
    from ckpt._restore.read import Reader, RestoreStats
    from ckpt._restore.plan import Asked, restore_tree
    from ckpt._restore.view_source import ViewIO

    asked = Asked(target, mesh, partial, False, allow_lossy_cast, axis_names, rename)
    opts = resolve(options)
    tset = open_tensors(location, opts)
    stats = RestoreStats()
    try:
        leaves = [_record(i, t) for i, t in enumerate(tset.tensors)]
        tree = tree_of([t.name for t in tset.tensors], tset.where)

        def build(wants: list) -> dict[int, Any]:
            for w in wants:
                rec = leaves[w.index]
                if rec.zarr is not None:
                    chunks = common_grid(rec.shape, _boxes(w, rec))
                    # No checksums in safetensors (the reader is told not to verify).
                    rec.storage = replace(rec.zarr, chunk_shape=chunks,
                                          chunk_checksums=(0,) * math.prod(chunk_grid(rec.shape, chunks)))
            return Reader(_ChunkSource(tset, leaves), leaves, False, stats, opts).run(wants)

        def regions(wanted: dict[int, list[Box]]) -> dict[tuple[int, Box], np.ndarray]:  # (rename= parts)
            out = {}
            for i, boxes in wanted.items():
                t = tset.tensors[i]
                for b in boxes:
                    buf = aligned_empty(math.prod(box_shape(b)) * np.dtype(dtype_from_name(t.dtype)).itemsize)
                    read_box(tset.reader, t, b, buf)
                    out[(i, b)] = buf.view(dtype_from_name(t.dtype)).reshape(box_shape(b))
            return out

        view = (ViewIO(regions, lambda v, every: Reader(v, every, False, stats, opts), opts.host_budget_bytes)
                if asked.rename is not None else None)
        result = restore_tree(tree, leaves, asked, build, view=view)
    finally:
        tset.reader.close()
    return result, stats, tset.reader.bytes_read


def restore(location: Any, target: Any = None, *, mesh: jax.sharding.Mesh | None = None,
            partial: bool = False, options: Options | None = None, allow_lossy_cast: bool = False,
            axis_names: dict[str, str] | None = None, rename: Any = None) -> Any:
    """Tensors named 'a.b.c' come back as the tree {'a': {'b': {'c': ...}}}; a target's key
    paths match those names. With `mesh`, tensors ``ckpt export`` recorded a sharding for take
    its PartitionSpec; others are replicated over the mesh."""
    return restore_with_stats(location, target, mesh=mesh, partial=partial, options=options,
                              allow_lossy_cast=allow_lossy_cast, axis_names=axis_names, rename=rename)[0]


def metadata(location: Any, options: Options | None = None) -> Any:
    """The tree of ArrayMetadata of safetensors, from the headers alone."""
    from jax.sharding import PartitionSpec

    from ckpt._geometry import ShardingInfo
    from ckpt._restore.plan import ArrayMetadata

    tset = open_tensors(location, options)
    tset.reader.close()
    values = []
    for t in tset.tensors:
        info = ShardingInfo.from_record(t.sharding)
        named = info is not None and info.kind == "named"
        values.append(ArrayMetadata(
            shape=tuple(t.shape), dtype=dtype_from_name(t.dtype),
            mesh_axis_names=info.axis_names if named else None, mesh_axis_sizes=info.axis_sizes if named else None,
            partition_spec=PartitionSpec(*info.spec) if named else None, chunk_shape=None, nbytes=t.nbytes,
            kind="jax.Array" if named else "numpy.ndarray", storage_path=t.file.rsplit("/", 1)[-1],
        ))
    return unflatten(tree_of([t.name for t in tset.tensors], tset.where), values)


# This format as a source of ckpt.restore and ckpt.metadata (``ckpt._restore.source``).
SOURCE = types.SimpleNamespace(detect=is_safetensors, restore=restore, metadata=metadata)
