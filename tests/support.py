"""Helpers shared by several test modules: test locations (local disk or memory://), damage
done through the Storage API, and FaultyStorage, the one fault-injecting storage engine.

Fault injection goes through the storage interface, never by patching an engine::

    faults = Faults()
    faults.fail("write_chunk", after=3)          # the 4th chunk write on fails with ENOSPC
    gate = faults.hold("retire")                 # retire() waits until gate.release.set()
    ckpt.save(path, tree, options=faults.options())

``faults.options()`` is ``ckpt.Options(engine=faults.engine)``: the engine opens the location with
the default engine (or `inner_engine`) and wraps it in a FaultyStorage, whose derived locations
(children, parents, staged directories) are wrapped the same way.
"""

from __future__ import annotations

import errno
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

import ckpt
from ckpt._geometry import chunk_index_of, chunk_key
from ckpt.storage._base import Storage
from ckpt.storage._wrapper import WrapperStorage
from ckpt.storage._location import open_storage
from ckpt.storage._base import Done

BIG = 1 << 31  # max_bytes for reading whole objects in tests

# Options of a save that writes every array shard by shard, for tests that inspect, count or
# damage the per-shard chunk files of arrays small enough to be packed otherwise (one chunk, or a
# slice of a stack: Options.pack_limit_bytes; the packed layout has tests/test_small_leaves.py).
PER_SHARD = ckpt.Options(pack_limit_bytes=0)


# ---- locations ---------------------------------------------------------------------------------


def storage_of(location: Any) -> Storage:
    """The Storage of `location` with the default engine (as save and restore open it)."""
    return open_storage(location, ckpt.Options().resolved())


class Location:
    """Where a test keeps its checkpoints: a local directory (``kind == "local"``) or a unique
    ``memory://t/<uuid>`` prefix (``kind == "memory"``, TensorStore's in-memory kvstore, shared by
    the whole test process). ``loc("a", "b")`` is the location text of ``a/b`` below it."""

    def __init__(self, kind: str, root: str):
        self.kind, self.root = kind, root.rstrip("/")

    @classmethod
    def make(cls, kind: str, tmp_dir) -> "Location":
        if kind == "local":
            return cls(kind, str(tmp_dir))
        if kind == "memory":
            return cls(kind, f"memory://t/{uuid.uuid4().hex}")
        raise ValueError(kind)

    def __call__(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def storage(self, *parts: str) -> Storage:
        return storage_of(self(*parts))

    def names(self, *parts: str) -> list[str]:
        """Every entry directly below (objects and sub-locations), sorted."""
        files, dirs = self.storage(*parts).list_dir("")
        return sorted(files + dirs)

    def snapshot(self, *parts: str) -> dict[str, bytes]:
        return snapshot(self.storage(*parts))

    def cleanup(self) -> None:
        if self.kind == "memory":
            self.storage().delete_tree("")

    def __repr__(self) -> str:
        return f"Location({self.kind}: {self.root})"


# ---- reading and damaging through the Storage API ---------------------------------------------


def keys(storage: Storage, prefix: str = "") -> list[str]:
    """Every object at or below `prefix`, as keys relative to `storage`, sorted."""
    files, dirs = storage.list_dir(prefix)
    head = prefix.strip("/") + "/" if prefix.strip("/") else ""
    out = [head + f for f in files]
    for d in dirs:
        out += keys(storage, head + d)
    return sorted(out)


def snapshot(storage: Storage) -> dict[str, bytes]:
    """Every object below `storage` with its bytes."""
    return {k: storage.get(k, max_bytes=BIG) for k in keys(storage)}


def copy_tree(src: Storage, dst: Storage) -> None:
    futures = [dst.put(k, v) for k, v in snapshot(src).items()]
    for f in futures:
        f.result()


def manifest_of(location: Any):
    """The manifest at `location` (a location, or a Storage as is)."""
    from ckpt._format.validate import read_manifest

    return read_manifest(storage_of(location))


def leaf_storage_path(location: Any, leaf: str) -> str:
    """Where the zarr array of `leaf` lives below the checkpoint (a generation prefix included)."""
    from ckpt._format.tree import leaf_components

    manifest = manifest_of(location)
    paths = ["/".join(c) for c in leaf_components(manifest.tree)]
    return manifest.leaves[paths.index(leaf)].zarr.path


def chunk_object(location: Any, leaf: str, index) -> str:
    """The key of one chunk file of `leaf` below the checkpoint at `location`."""
    return f"{leaf_storage_path(location, leaf)}/{chunk_key(index)}"


def flip_byte(storage: Storage, key: str, byte: int = 100) -> None:
    data = bytearray(storage.get(key, max_bytes=BIG))
    data[byte] ^= 0x10
    storage.put(key, bytes(data)).result()


def truncate(storage: Storage, key: str, nbytes: int) -> None:
    storage.put(key, storage.get(key, max_bytes=BIG)[:nbytes]).result()


# ---- leftovers of saves -----------------------------------------------------------------------

SAVER_LEASE = ".jax-ckpt-saver"  # a saving manager's lease object, on storage without locks


def without_lease(listing):
    """A listing (names, or a snapshot dict) without a saving manager's lease object."""
    if isinstance(listing, dict):
        return {k: v for k, v in listing.items() if k != SAVER_LEASE}
    return [n for n in listing if n != SAVER_LEASE]


def dead_owner() -> bytes:
    """An owner record (ckpt._commit.OWNER_NAME) of a process of this machine that has exited."""
    import json
    import subprocess
    import sys

    from ckpt._commit.strategy import owner_record

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return json.dumps({**owner_record(), "pid": proc.pid, "start": "1"}).encode()


def plant_dead_save(storage: Storage, name: str) -> None:
    """What a save killed mid-way leaves at `name` below `storage`: staged data and the owner
    record of a process that is gone."""
    from ckpt._commit.strategy import OWNER_NAME

    storage.put(f"{name}/w/c/0/0", b"x" * 64).result()
    storage.put(f"{name}/{OWNER_NAME}", dead_owner()).result()


# ---- CRC-32C, independently of the library ---------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c_reference(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected), bit by bit from its definition (RFC 3720 B.4)."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---- fault injection -------------------------------------------------------------------------


def disk_full(where: str) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device (injected)", where)


def io_error(where: str) -> OSError:
    return OSError(errno.EIO, "Input/output error (injected)", where)


def connection_reset(where: str) -> OSError:
    """What a client sees when the connection drops after the server took the request."""
    return ConnectionResetError(errno.ECONNRESET, "Connection reset by peer (injected)", where)


def server_error(where: str) -> OSError:
    """An HTTP 500 (InternalError), after retries: the request may or may not have been applied."""
    return OSError(errno.EIO, "500 InternalError (injected)", where)


def timed_out(where: str) -> OSError:
    """The client's own bound ran out: the request may still be in flight."""
    return TimeoutError(errno.ETIMEDOUT, "no answer (injected timeout)", where)


def already_exists(where: str) -> OSError:
    """What a client's own retry of a conditional write gets once its first attempt landed."""
    return FileExistsError(errno.EEXIST, "already exists (injected: 412 to our own retry)", where)


class Gate:
    """Holds the matching calls until ``release`` is set; ``entered`` is set by the first one."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.held: list[str] = []  # where each held call was


@dataclass
class _Rule:
    op: str
    action: Callable  # (storage, where, args) -> None, may raise or block
    after: int = 0
    times: int | None = None
    when: Callable | None = None  # (where, args) -> bool
    seen: int = 0  # matching calls so far
    result: Callable | None = None  # (result, *args) -> result, for `after` hooks
    in_future: bool = False


class Faults:
    """What FaultyStorage does on each operation, shared by every storage derived from one.

    Operations are Storage method names (``write_chunk``, ``put``, ``put_if_absent``, ``commit``,
    ``retire``, ``delete_tree``...). Each rule counts the calls it matches (`when(where, args)`,
    if given, filters them; `where` is the object or location the call is about) and acts on the
    calls numbered after `after` (for `times` calls, or all).
    """

    def __init__(self, inner_engine: str | None = None):
        self.inner_engine = inner_engine
        self.calls: Counter = Counter()  # op -> calls so far
        self.log: list[tuple[str, str]] = []  # (op, where) of every call, in order
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()

    # -- wiring --

    def engine(self, location: str, options: ckpt.Options) -> Storage:
        return FaultyStorage(open_storage(location, replace(options, engine=self.inner_engine)), self)

    def options(self, **kwargs) -> ckpt.Options:
        return ckpt.Options(engine=self.engine, **kwargs)

    # -- rules --

    def fail(self, op: str, error: Callable[[str], BaseException] = disk_full, *, after: int = 0,
             times: int | None = None, when=None, in_future: bool = False) -> None:
        """Matching calls raise ``error(where)`` (or, with `in_future`, return a future that does:
        how an engine reports a write that fails on the device)."""

        def act(storage, where, args):
            raise error(where)

        self._add(_Rule(op, act, after, times, when, in_future=in_future))

    def hold(self, op: str, *, after: int = 0, times: int | None = None, when=None, timeout_s: float = 60) -> Gate:
        """Matching calls wait for the returned gate's release before going on."""
        gate = Gate()

        def act(storage, where, args):
            gate.held.append(where)
            gate.entered.set()
            if not gate.release.wait(timeout_s):
                raise TimeoutError(f"the test never released the gate on {op}")

        self._add(_Rule(op, act, after, times, when))
        return gate

    def lose_answer(self, op: str, error: Callable[[str], BaseException] = connection_reset, *, after: int = 0,
                    times: int | None = None, when=None) -> None:
        """Matching calls are performed (the write lands; a returned future is waited for),
        then report ``error(key)``, as when the server's answer is lost: raised, or for a call
        that returns a future, a future that raises it."""

        def lost(result, *args):
            e = error(str(args[0]) if args else "?")
            if hasattr(result, "result"):
                result.result()
                return Done(error=e)
            raise e

        self._add(_Rule(op, lambda storage, where, args: None, after, times, when, result=lost))

    def before(self, op: str, fn: Callable, *, when=None) -> None:
        """Call ``fn(*args)`` ahead of every matching call."""
        self._add(_Rule(op, lambda storage, where, args: fn(*args), when=when))

    def after(self, op: str, fn: Callable, *, when=None) -> None:
        """Replace the result of every matching call by ``fn(result, *args)``."""
        self._add(_Rule(op, lambda storage, where, args: None, when=when, result=fn))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    # -- used by FaultyStorage --

    def call(self, storage: "FaultyStorage", op: str, where: str, args: tuple, forward: Callable) -> Any:
        with self._lock:
            self.calls[op] += 1
            self.log.append((op, where))
            active = []
            for rule in self._rules:
                if rule.op != op or (rule.when is not None and not rule.when(where, args)):
                    continue
                rule.seen += 1
                if rule.seen > rule.after and (rule.times is None or rule.seen <= rule.after + rule.times):
                    active.append(rule)
        for rule in active:
            try:
                rule.action(storage, where, args)
            except BaseException as e:
                if rule.in_future:
                    return Done(error=e)
                raise
        result = forward(*args)
        for rule in active:
            if rule.result is not None:
                result = rule.result(result, *args)
        return result


@dataclass(frozen=True)
class _Handle:
    inner: Any
    path: str
    chunk_shape: tuple


class FaultyStorage(WrapperStorage):
    """A WrapperStorage whose every operation goes through its Faults."""

    def __init__(self, inner: Storage, faults: Faults):
        super().__init__(inner)
        self.faults = faults

    def wrap(self, inner: Storage) -> "FaultyStorage":
        return FaultyStorage(inner, self.faults)

    def _call(self, op: str, where: str, forward: Callable, *args) -> Any:
        return self.faults.call(self, op, where, args, forward)

    def get(self, key, *, max_bytes):
        return self._call("get", self.where(key), lambda k: self.inner.get(k, max_bytes=max_bytes), key)

    def read_exact(self, key, nbytes, into=None):
        return self._call("read_exact", self.where(key), self.inner.read_exact, key, nbytes, into)

    def read_chunk(self, path, index, nbytes, into=None):
        return self._call("read_chunk", self.where(f"{path}/{chunk_key(index)}"), self.inner.read_chunk,
                          path, index, nbytes, into)

    def read_chunk_async(self, path, index, nbytes, executor, into=None):
        # The restore's chunk reads, seen as "read_chunk" (same arguments) and issued through the
        # inner engine's own read_chunk_async: the production path, not a thread-pool fallback.
        return self._call("read_chunk", self.where(f"{path}/{chunk_key(index)}"),
                          lambda p, i, n, b: self.inner.read_chunk_async(p, i, n, executor, b),
                          path, index, nbytes, into)

    def read_range(self, key, start, length, into=None):
        return self._call("read_range", self.where(key), self.inner.read_range, key, start, length, into)

    def put(self, key, data):
        return self._call("put", self.where(key), self.inner.put, key, data)

    def open_pack(self, key):
        where = self.where(key)
        return _FaultyPack(self, self._call("open_pack", where, self.inner.open_pack, key), where)

    def put_if_absent(self, key, data):
        return self._call("put_if_absent", self.where(key), self.inner.put_if_absent, key, data)

    def get_versioned(self, key, *, max_bytes):
        return self._call("get_versioned", self.where(key), lambda k: self.inner.get_versioned(k, max_bytes=max_bytes),
                          key)

    def put_if_version(self, key, data, version):
        return self._call("put_if_version", self.where(key), self.inner.put_if_version, key, data, version)

    def exists(self, key):
        return self._call("exists", self.where(key), self.inner.exists, key)

    def list_dir(self, prefix=""):
        return self._call("list_dir", self.where(prefix), self.inner.list_dir, prefix)

    def delete(self, key):
        return self._call("delete", self.where(key), self.inner.delete, key)

    def delete_tree(self, prefix=""):
        return self._call("delete_tree", self.where(prefix), self.inner.delete_tree, prefix)

    def create_array(self, path, spec):
        return self._call("create_array", self.where(path), self.inner.create_array, path, spec)

    def put_group(self, path):
        return self._call("put_group", self.where(path), self.inner.put_group, path)

    def open_arrays(self, arrays):
        handles = self._call("open_arrays", self.url, self.inner.open_arrays, arrays)
        return {k: _Handle(h, arrays[k][0], tuple(arrays[k][1].chunk_shape)) for k, h in handles.items()}

    def write_chunk(self, handle: _Handle, box, data):
        where = self.where(f"{handle.path}/{chunk_key(chunk_index_of(box, handle.chunk_shape))}")
        return self._call("write_chunk", where, lambda h, b, d: self.inner.write_chunk(h.inner, b, d),
                          handle, box, data)

    def sync(self, key=""):
        return self._call("sync", self.where(key), self.inner.sync, key)

    def stat_many(self, keys):
        return self._call("stat_many", self.url, self.inner.stat_many, list(keys))



def _commit_steps_through_faults() -> None:
    """The commit's own steps (``ckpt._commit``: stage, staged_from, commit, abort, retire, the
    saver lock as ``lock_saves``, a rename backend's ``publish``) are Faults operations too, for
    a strategy over a FaultyStorage: tests fail or hold a whole step at once, besides the byte
    primitives each step is made of (which the FaultyStorage sees anyway)."""
    from ckpt._commit import generation, rename

    def through(cls, method, op, where_of):
        plain = getattr(cls, method)

        def faulty(self, *args, **kwargs):
            store = self.store
            if not isinstance(store, FaultyStorage):
                return plain(self, *args, **kwargs)
            return store._call(op, where_of(self, args), lambda *a: plain(self, *a, **kwargs), *args)

        setattr(cls, method, faulty)

    url = lambda self, args: self.store.url  # noqa: E731
    for cls in (generation.GenerationCommit, rename.RenameCommit):
        through(cls, "stage", "stage", url)
        through(cls, "staged_from", "staged_from", url)
        through(cls, "commit", "commit", url)
        through(cls, "abort", "abort", lambda self, args: args[0].storage.url)
        through(cls, "retire", "retire", url)
        through(cls, "lock", "lock_saves", url)
    through(rename.RenameCommit, "_publish", "publish", url)


_commit_steps_through_faults()


class _FaultyPack:
    """A data object of the packed layout opened through a FaultyStorage: its chunk writes
    (``write_at``) and its close (``close_pack``) are operations the faults see."""

    def __init__(self, storage, inner, where):
        self.storage, self.inner, self.where = storage, inner, where

    def write_at(self, offset, data):
        return self.storage._call("write_at", self.where, self.inner.write_at, offset, data)

    def close(self, size):
        return self.storage._call("close_pack", self.where, self.inner.close, size)


def write_hook_options(before: Callable[[np.ndarray], None]) -> ckpt.Options:
    """Options whose storage calls ``before(data)`` ahead of every chunk write of this process
    (in the packed layout on local disk: each chunk's write into its data object)."""
    faults = Faults()
    faults.before("write_chunk", lambda handle, box, data: before(data))
    # (the packed layout of multi-process saves writes its chunks into data objects in place)
    faults.before("write_at", lambda offset, data: before(data))
    return faults.options()


def committed_generations(location: Any) -> list[str]:
    """The top-level entries the manifest at `location` points into."""
    manifest = manifest_of(location)
    paths = [l.zarr.path for l in manifest.leaves if l.zarr is not None] + [s.zarr.path for s in manifest.stacks]
    return sorted({p.split("/", 1)[0] for p in paths})


__all__ = [
    "BIG", "PER_SHARD", "Faults", "already_exists", "connection_reset", "server_error", "timed_out", "FaultyStorage", "Gate", "Location", "SAVER_LEASE", "chunk_object", "committed_generations",
    "copy_tree", "crc32c_reference", "dead_owner", "disk_full", "flip_byte", "io_error", "keys", "leaf_storage_path",
    "manifest_of", "plant_dead_save", "snapshot", "storage_of", "truncate", "without_lease", "write_hook_options",
]


def race_two_saves(path: str, trees: tuple, engine: Any = None, timeout_s: float = 60) -> list:
    """Two saves of trees[0] and trees[1] to `path`, each held at its commit until both have
    staged and written everything, then released together. Returns each save's error (None for
    a save that reported success)."""
    gates, handles = [], []
    for tree in trees:
        faults = Faults(inner_engine=engine)
        gates.append(faults.hold("commit"))
        handles.append(ckpt.save_async(path, tree, options=faults.options()))
    for gate in gates:
        assert gate.entered.wait(timeout_s)
    errors: list = [None, None]

    def finish(i: int) -> None:
        try:
            handles[i].wait(timeout_s)
        except BaseException as e:  # noqa: BLE001 (handed back to the test)
            errors[i] = e

    threads = [threading.Thread(target=finish, args=(i,)) for i in (0, 1)]
    for th in threads:
        th.start()
    for gate in gates:
        gate.release.set()
    for th in threads:
        th.join(timeout_s)
    return errors


class ReadCounter(WrapperStorage):
    """A wrapper that counts the data bytes read through it: byte ranges and chunk reads, each
    by ``count(nbytes)`` (a subclass says where the count goes and what else it counts)."""

    def count(self, nbytes: int) -> None:
        raise NotImplementedError

    def read_range(self, key, start, length, into=None):
        self.count(length)
        return super().read_range(key, start, length, into)

    def read_chunk(self, path, index, nbytes, into=None):
        self.count(nbytes)
        return super().read_chunk(path, index, nbytes, into)

    def read_chunk_async(self, path, index, nbytes, executor, into=None):
        self.count(nbytes)
        return super().read_chunk_async(path, index, nbytes, executor, into)
