"""A user's wrapper (``ckpt.storage.WrapperStorage``, given as ``Options(engine=...)``) sees every
byte read and written by save, save_async, restore (a resharding one included), ``ckpt verify``
and a CheckpointManager's save / restore / retention cycle: manifest, index objects, data
objects, chunk files and ranged reads, on local disk, ``memory://`` and S3 (SeaweedFS on
loopback), in the files layout and the packed layout (format version 3) (issue 33).

The recording is compared with what the backend holds, listed without the wrapper (local disk:
``os.walk``; memory: the engine's own listing; S3: s3fs): every object there was written through
the wrapper, with as many bytes as it holds, and every byte a restore or verify needed was read
through it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import uuid

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt.storage import WrapperStorage, open_storage

KINDS = ["local", "memory", "s3"]
LAYOUTS = ["files", "packed"]
BUCKET = "ckpt-wrapper-test"
BIG = 1 << 31

# ---- the recording wrapper ------------------------------------------------------------------


@dataclasses.dataclass
class Log:
    """What went through the wrapper, by full location (``Storage.where``): byte writes
    (key -> [(op, start, nbytes)] in order), byte reads (key -> [(op, start, nbytes)]), and the
    calls that create an object from what the engine derives itself (``create_array``,
    ``put_group``: key -> op)."""

    writes: dict = dataclasses.field(default_factory=dict)
    reads: dict = dataclasses.field(default_factory=dict)
    made: dict = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def write(self, where, op, start, nbytes):
        with self.lock:
            self.writes.setdefault(where, []).append((op, start, nbytes))

    def read(self, where, op, start, nbytes):
        with self.lock:
            self.reads.setdefault(where, []).append((op, start, nbytes))

    def clear(self):
        with self.lock:
            self.writes, self.reads, self.made = {}, {}, {}


def _nbytes(data) -> int:
    return memoryview(data).nbytes


def _chunk_key(index) -> str:
    return "/".join(["c", *map(str, index)])  # Zarr v3's default chunk key encoding


class _Pack:
    """A data object written in place (``open_pack``, local disk): each ``write_at`` recorded."""

    def __init__(self, pack, where: str, log: Log):
        self._pack, self._where, self._log = pack, where, log

    def write_at(self, offset, data):
        self._log.write(self._where, "write_at", offset, _nbytes(data))
        return self._pack.write_at(offset, data)

    def close(self, size):
        return self._pack.close(size)

    def __getattr__(self, name):
        return getattr(self._pack, name)


class _ReadFuture:
    """A chunk read's future (``read_chunk_async``): its bytes recorded when taken."""

    def __init__(self, future, where: str, log: Log):
        self._future, self._where, self._log, self._seen = future, where, log, False

    def result(self, timeout=None):
        data = self._future.result(timeout) if timeout is not None else self._future.result()
        if not self._seen:
            self._seen = True
            self._log.read(self._where, "read_chunk_async", 0, _nbytes(data))
        return data

    def __getattr__(self, name):
        return getattr(self._future, name)


class Recording(WrapperStorage):
    """Records the key and byte count of every read and write made through it."""

    def __init__(self, inner, log: Log, handles: dict | None = None):
        super().__init__(inner)
        self.log = log
        self.handles = handles if handles is not None else {}  # id(handle) -> (handle, array location, chunk shape)

    def wrap(self, inner):
        return Recording(inner, self.log, self.handles)

    # reads
    def get(self, key, *, max_bytes):
        data = super().get(key, max_bytes=max_bytes)
        self.log.read(self.where(key), "get", 0, len(data))
        return data

    def get_versioned(self, key, *, max_bytes):
        data, version = super().get_versioned(key, max_bytes=max_bytes)
        if data is not None:
            self.log.read(self.where(key), "get_versioned", 0, len(data))
        return data, version

    def read_exact(self, key, nbytes, into=None):
        data = super().read_exact(key, nbytes, into)
        self.log.read(self.where(key), "read_exact", 0, data.nbytes)
        return data

    def read_range(self, key, start, length, into=None):
        data = super().read_range(key, start, length, into)
        self.log.read(self.where(key), "read_range", start, data.nbytes)
        return data

    def read_chunk(self, path, index, nbytes, into=None):
        data = super().read_chunk(path, index, nbytes, into)
        self.log.read(self.where(f"{path}/{_chunk_key(index)}"), "read_chunk", 0, data.nbytes)
        return data

    def read_chunk_async(self, path, index, nbytes, executor, into=None):
        future = super().read_chunk_async(path, index, nbytes, executor, into)
        return _ReadFuture(future, self.where(f"{path}/{_chunk_key(index)}"), self.log)

    # writes
    def put(self, key, data):
        self.log.write(self.where(key), "put", 0, _nbytes(data))
        return super().put(key, data)

    def put_if_absent(self, key, data):
        self.log.write(self.where(key), "put_if_absent", 0, _nbytes(data))
        return super().put_if_absent(key, data)

    def put_if_version(self, key, data, version):
        self.log.write(self.where(key), "put_if_version", 0, _nbytes(data))
        return super().put_if_version(key, data, version)

    def open_pack(self, key):
        return _Pack(super().open_pack(key), self.where(key), self.log)

    def open_arrays(self, arrays):
        handles = super().open_arrays(arrays)
        for k, handle in handles.items():
            path, spec = arrays[k]
            self.handles[id(handle)] = (handle, self.where(path), tuple(spec.chunk_shape))
        return handles

    def write_chunk(self, handle, box, data):
        _, array, chunk_shape = self.handles[id(handle)]
        index = tuple(lo // c for (lo, _), c in zip(box, chunk_shape))
        self.log.write(f"{array}/{_chunk_key(index)}", "write_chunk", 0, data.nbytes)
        return super().write_chunk(handle, box, data)

    def create_array(self, path, spec):
        self.log.made[self.where(f"{path}/zarr.json")] = "create_array"
        return super().create_array(path, spec)

    def put_group(self, path):
        self.log.made[self.where(f"{path}/zarr.json" if path else "zarr.json")] = "put_group"
        return super().put_group(path)


def recording_options(log: Log, **fields) -> ckpt.Options:
    def engine(location, options):
        return Recording(open_storage(location, dataclasses.replace(options, engine=None)), log)

    return ckpt.Options(engine=engine, pack_limit_bytes=8192, **fields)


# ---- where the checkpoints go, and what the backend holds (listed without the wrapper) ---------


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """SeaweedFS on loopback for this module (started only when an S3 case runs), with the
    standard AWS variables pointing at it."""
    from servers import SeaweedFS, serving_s3

    server = SeaweedFS(str(tmp_path_factory.mktemp("seaweedfs")))
    with serving_s3(server, BUCKET, tmp_path_factory.mktemp("aws")):
        yield server


class Backend:
    """A fresh root of one kind, and its objects as the backend itself lists them."""

    def __init__(self, kind: str, tmp_path, server=None):
        self.kind, self.server = kind, server
        if kind == "local":
            self.root = str(tmp_path / "root")
        elif kind == "memory":
            self.root = f"memory://t/{uuid.uuid4().hex}"
        else:
            self.prefix = uuid.uuid4().hex[:12]
            self.root = f"s3://{BUCKET}/{self.prefix}"

    def __call__(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def objects(self, *parts: str) -> dict[str, int]:
        """{full location: size} of every object at or below `parts`."""
        below = self(*parts)
        if self.kind == "local":
            out = {}
            for d, _, files in os.walk(below):
                for f in files:
                    out[os.path.join(d, f)] = os.path.getsize(os.path.join(d, f))
            return out
        if self.kind == "memory":
            store = open_storage(below, ckpt.Options().resolved())  # the engine, unwrapped
            out = {}

            def walk(prefix):
                files, dirs = store.list_dir(prefix)
                head = f"{prefix}/" if prefix else ""
                for f in files:
                    out[f"{below}/{head}{f}"] = len(store.get(head + f, max_bytes=BIG))
                for d in dirs:
                    walk(head + d)

            walk("")
            return out
        import s3fs

        from servers import ACCESS_KEY, SECRET_KEY

        fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=self.server.endpoint,
                               skip_instance_cache=True, use_listings_cache=False)
        found = fs.find(below[len("s3://"):], detail=True)
        return {f"s3://{k}": int(v["size"]) for k, v in found.items() if v.get("type") != "directory"}

    def cleanup(self) -> None:
        if self.kind == "memory":
            open_storage(self.root, ckpt.Options().resolved()).delete_tree("")


@pytest.fixture(params=KINDS)
def backend(request, tmp_path):
    server = request.getfixturevalue("s3_server") if request.param == "s3" else None
    b = Backend(request.param, tmp_path, server)
    yield b
    b.cleanup()


# ---- comparing the recording with the backend --------------------------------------------------

# A local save writes below `<name>.tmp-<hex>` and renames it into place.
_STAGED = re.compile(r"\.tmp-[0-9a-f]+(?=/|$)")


def _final(where: str) -> str:
    return _STAGED.sub("", where)


def _covered(spans) -> list[tuple[int, int]]:
    """The union of (start, nbytes) spans, as sorted disjoint [start, end) intervals."""
    out: list[list[int]] = []
    for start, n in sorted((s, n) for s, n in spans if n):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], start + n)
        else:
            out.append([start, start + n])
    return [tuple(x) for x in out]


def _is_metadata(where: str) -> bool:
    return where.rsplit("/", 1)[-1] == "zarr.json"


def assert_written_through_the_wrapper(log: Log, objects: dict[str, int]) -> None:
    """Every object of `objects` was written through the wrapper, with exactly its bytes: its
    last whole-object write (put, put_if_absent, a chunk) of its size, or (a data object written
    in place) ranges covering it; Zarr metadata at least created through it."""
    writes: dict[str, list] = {}
    for where, ops in log.writes.items():
        writes.setdefault(_final(where), []).extend(ops)
    made = {_final(w) for w in log.made}
    assert objects, "the backend holds nothing"
    for where, size in sorted(objects.items()):
        ops = writes.get(where)
        if ops is None and _is_metadata(where):
            assert where in made, f"{where} ({size} bytes) was not written through the wrapper"
            continue
        assert ops, f"{where} ({size} bytes) was not written through the wrapper; written: {sorted(writes)}"
        if all(op == "write_at" for op, _, _ in ops):
            assert _covered((s, n) for _, s, n in ops) == [(0, size)], (where, size, ops)
        else:
            whole = [n for op, _, n in ops if op != "write_at"]
            assert whole[-1] == size, f"{where}: the wrapper saw {whole[-1]} bytes written, it holds {size}"
    written = {w for w in writes if not _is_metadata(w)}
    assert written, "nothing was written through the wrapper"


def assert_read_through_the_wrapper(log: Log, objects: dict[str, int], *, metadata: bool,
                                    others: bool = False) -> None:
    """Every byte of every object in `objects` (Zarr metadata only when `metadata`) was read
    through the wrapper, and nothing else was read of them: the ranged reads of each data
    object together cover it exactly. `others`: objects not in `objects` may be read too (a
    manager reads other steps' manifests)."""
    reads: dict[str, list] = {}
    for where, ops in log.reads.items():
        reads.setdefault(where, []).extend(ops)
    for where, size in sorted(objects.items()):
        if _is_metadata(where) and not metadata:
            continue
        ops = reads.get(where)
        assert ops, f"{where} ({size} bytes) was not read through the wrapper; read: {sorted(reads)}"
        assert _covered((s, n) for _, s, n in ops) == [(0, size)], (where, size, ops)
        for _, s, n in ops:
            assert s + n <= size, (where, size, ops)
    assert others or set(reads) <= set(objects), f"read, not in the checkpoint: {set(reads) - set(objects)}"


def checkpoint_objects(objects: dict[str, int]) -> dict[str, int]:
    """The checkpoint's own objects (manifest, index and data objects, chunk files, Zarr
    metadata): without a save's owner record or a manager's lease, if any is left."""
    return {w: s for w, s in objects.items() if not w.rsplit("/", 1)[-1].startswith((".owner", ".jax-ckpt"))}


# ---- the tree -----------------------------------------------------------------------------------

W = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
V = (np.arange(64 * 64, dtype=np.int32).reshape(64, 64) * 7) - 100
# Above the manifest's inline limit (4 KiB), within pack_limit_bytes: s1 and s2 are written as
# one stack's chunk; w and v, shard by shard; small, inline in the manifest.
S = np.linspace(0, 1, 1536, dtype=np.float32)


def make_tree(step: int = 3):
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    return {"w": jax.device_put(W + step, NamedSharding(mesh, P("x", "y"))),
            "v": jax.device_put(V + step, NamedSharding(mesh, P(None, "x"))),
            "small": np.arange(16, dtype=np.int32), "s1": jax.numpy.asarray(S + step),
            "s2": jax.numpy.asarray(S - step), "step": step}


def assert_values(out, step: int = 3, sharding=None) -> None:
    assert out["step"] == step and np.array_equal(np.asarray(out["small"]), np.arange(16, dtype=np.int32))
    for name, want in (("w", W + step), ("v", V + step), ("s1", S + step), ("s2", S - step)):
        got = out[name]
        assert got.shape == want.shape and got.dtype == want.dtype
        if sharding is not None and name == "w":
            assert got.sharding == sharding
        if not isinstance(got, jax.Array):
            assert np.array_equal(got, want), name
            continue
        for shard in got.addressable_shards:  # every shard, against its region of the saved value
            assert np.array_equal(np.asarray(shard.data), want[shard.index]), (name, shard.index)


# ---- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_restore_and_verify_go_through_the_wrapper(backend, layout, monkeypatch):
    log = Log()
    options = recording_options(log, layout=layout)
    tree = make_tree()

    # save: every object of the committed checkpoint written through the wrapper, with its bytes
    ckpt.save(backend("c"), tree, options=options)
    objects = backend.objects("c")
    assert any(w.endswith("/manifest.msgpack") for w in objects)
    if layout == "packed":
        assert any("/~index/" in w for w in objects) and any("/~data/" in w for w in objects), sorted(objects)
    else:
        assert all(any(f"/{a}/c/" in w for w in objects) for a in ("w", "v", "~stacks/0")), sorted(objects)
    assert_written_through_the_wrapper(log, objects)

    # save_async (over the first: an overwrite)
    log.clear()
    ckpt.save_async(backend("c"), make_tree(), overwrite=True, options=options).wait()
    objects = checkpoint_objects(backend.objects("c"))
    assert_written_through_the_wrapper(log, objects)

    # restore: every byte it needed (manifest, index objects, every chunk) read through it
    log.clear()
    out = ckpt.restore(backend("c"), options=options)
    assert_values(out)
    assert_read_through_the_wrapper(log, objects, metadata=False)

    # restore onto another mesh (resharded): the same bytes, through the wrapper
    log.clear()
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharding = NamedSharding(mesh, P("b", "a"))
    target = {"w": jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=sharding),
              "v": jax.ShapeDtypeStruct(V.shape, V.dtype, sharding=NamedSharding(mesh, P("a", None))),
              "small": jax.ShapeDtypeStruct((16,), np.int32), "s1": jax.ShapeDtypeStruct(S.shape, S.dtype),
              "s2": jax.ShapeDtypeStruct(S.shape, S.dtype), "step": 0}
    out = ckpt.restore(backend("c"), target, options=options)
    assert_values(out, sharding=sharding)
    assert_read_through_the_wrapper(log, objects, metadata=False)
    log.clear()
    out = ckpt.restore(backend("c"), mesh=mesh, axis_names={"x": "b", "y": "a"}, options=options)
    assert_values(out)
    assert_read_through_the_wrapper(log, objects, metadata=False)

    # ckpt verify: the CLI's own command, its storage engine the wrapper. (`--engine` takes an
    # engine's name only, so the wrapper is given where the CLI makes its Options.)
    from ckpt.cli._main import main as cli

    monkeypatch.setattr("ckpt.cli._opened.cli_options", lambda engine, locations: options.resolved())
    log.clear()
    assert cli(["verify", "--no-progress", backend("c")]) == 0
    assert_read_through_the_wrapper(log, objects, metadata=layout == "files")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_managers_saves_restores_and_retention_go_through_the_wrapper(backend, layout):
    log = Log()
    options = recording_options(log, layout=layout)
    with ckpt.CheckpointManager(backend("run"), max_to_keep=2, options=options) as manager:
        for step in (1, 2, 3):
            manager.save(step, make_tree(step))
        manager.wait()
        assert manager.all_steps() == [2, 3]
    # Retention deleted step 1; every object left (the steps kept, the manager's own records)
    # was written through the wrapper with its bytes.
    objects = backend.objects("run")
    assert not [w for w in objects if "step_00000001" in w], sorted(objects)
    assert_written_through_the_wrapper(log, objects)

    log.clear()
    with ckpt.CheckpointManager(backend("run"), options=options, read_only=True) as manager:
        assert_values(manager.restore(3), step=3)
    step3 = checkpoint_objects(backend.objects("run", "step_00000003"))
    assert_read_through_the_wrapper(log, step3, metadata=False, others=True)


@pytest.mark.parametrize("kind", KINDS)
def test_zarr_metadata_bytes_go_through_the_wrapper(kind, request, tmp_path):
    """The files layout's zarr.json objects (the root group's and each array's): their bytes
    through the wrapper's put, not only a create_array / put_group call."""
    server = request.getfixturevalue("s3_server") if kind == "s3" else None
    backend = Backend(kind, tmp_path, server)
    log = Log()
    try:
        ckpt.save(backend("c"), make_tree(), options=recording_options(log, layout="files"))
        metadata = {w: s for w, s in backend.objects("c").items() if _is_metadata(w)}
        assert len(metadata) == 5, sorted(metadata)  # the root group, w, v, the ~stacks group, stack 0
        writes = {_final(w): ops for w, ops in log.writes.items()}
        for where, size in metadata.items():
            assert where in writes, f"{where}: {size} bytes written without the wrapper seeing them"
            assert writes[where][-1][2] == size
    finally:
        backend.cleanup()
