"""What a save or restore may take of the host: its Options, and host memory.

Options: the explicit configuration of a save, restore or manager, read when each starts.

Every field left at None takes its documented default, from the environment variable named
beside it when that is set (so a job can be tuned without code changes), else the built-in value.

Host memory the library freed, handed back to the kernel at once.

Host buffers below glibc's mmap threshold (dynamic, up to 32 MiB) live in the heap, and glibc
keeps a freed block resident for later reuse. When the library trades buffers of one size for
another (the save's staging pool, a restore's read batches), the holes stayed resident beside the
new buffers: a save with a 256 MiB budget peaked at 327 MiB of RSS over its input, 259 MiB with
``return_to_os`` after each free (docs/memory.md). The library does not change the process's
allocator settings; it only returns memory it has just freed.

Size: options, host memory and thread pools are what a save or restore takes of the host, one
budget's parts.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import queue
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Union

import numpy as np

# Packing small arrays (measured: docs/benchmarks.md, "Many small leaves"). An array of at most
# PACK_LIMIT bytes whose whole value one process holds is written by that process as one chunk:
# as a single-chunk Zarr array, or, when other such arrays have its shape and dtype, as one slice
# of a *stack* (a Zarr array of them all, chunked along its first dimension into chunks of about
# STACK_CHUNK_BYTES). Per-file costs (a create, a write, an fsync, a read) dwarf the bytes of
# small arrays: a 64x64 float32 array on 8 devices was 8 files of 2 KiB; 2,000 of them now fill
# eight 4 MiB chunk files.
PACK_LIMIT = 1 << 20



# The default chunk cap (issue 10): see docs/benchmarks.md for the measurement behind it.
MAX_CHUNK_BYTES = 64 << 20
# Packed layout (format version 3): the size past which a process begins a new data object.
# 2 GiB, Orbax's OCDBT target: objects per save stay within 8 per process from ~10 GB a process
# up (the 70B model at 64 hosts: 11 GB each, 6 objects; at 1,024 hosts: 690 MB, one). Where data
# objects are assembled in memory (object stores) a save keeps them within a quarter of its
# host budget, since it holds two assembly buffers of that size.
PACK_OBJECT_BYTES = 2 << 30
LAYOUTS = ("auto", "files", "packed")
ENGINE_NAMES = ("local", "tensorstore", "fsspec")

# host_budget_bytes="unlimited" (or CKPT_HOST_BUDGET_BYTES=unlimited) resolves to this: more
# bytes than any host has, so every comparison with it passes.
UNLIMITED = 1 << 62
# The default host budget when CKPT_HOST_BUDGET_BYTES is unset: this fraction of the host's
# physical memory (a training host's RAM is mostly the job's; a quarter leaves the rest to it).
DEFAULT_BUDGET_FRACTION = 4
FALLBACK_BUDGET = 2 << 30  # where the physical memory cannot be read
# The smallest chunk cap a small budget leads to (a page: staging buffers are whole pages).
MIN_CHUNK_CAP = 4096
# How long one storage operation on an object store (S3, GCS: the tensorstore and fsspec
# engines) may take, its retries included, before it fails naming the object and the operation
# (issue 28: a server that accepts requests and never answers held a save for 7 minutes). A save
# or restore against a server that never answers fails within twice this (docs/storage.md,
# "Timeouts"): its first operation, plus at most one read-back or cleanup after it.
REQUEST_TIMEOUT_S = 60.0
# Restoring replicated state (issue 24): a leaf whose shards have at least this many replicas
# on different processes is read once across them and exchanged over collectives. Orbax
# measured its single-replica restore 1.55x faster at 4 replicas and 0.79x at 2 (and this
# 2-core machine cannot show a gain at all: docs/benchmarks.md, "Replicated state").
SHARE_MIN_REPLICAS = 4
_SHARE_MODES = {"auto": "auto", "on": "on", "1": "on", "true": "on", "off": "off", "0": "off", "false": "off"}


def default_host_budget() -> int:
    """A quarter of the host's physical memory (os.sysconf), or 2 GiB where that is unknown."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_BUDGET
    return total // DEFAULT_BUDGET_FRACTION if total > 0 else FALLBACK_BUDGET


def _budget(value: Any) -> int:
    if isinstance(value, str) and value.strip().lower() == "unlimited":
        return UNLIMITED
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Options.host_budget_bytes must be a positive integer or 'unlimited', got {value!r}")
    return value


def _env_budget() -> int:
    text = os.environ.get("CKPT_HOST_BUDGET_BYTES")
    if text is None or text.strip() == "":
        return default_host_budget()
    if text.strip().lower() == "unlimited":
        return UNLIMITED
    return _env_int("CKPT_HOST_BUDGET_BYTES", 0)


def save_chunk_cap(options: "Options") -> int:
    """The chunk cap of a save with resolved `options`: max_chunk_bytes, and at most a quarter
    of the host budget, so that several chunks are staged and written at once within it."""
    return max(MIN_CHUNK_CAP, min(options.max_chunk_bytes, options.host_budget_bytes // 4))

EngineChoice = Union[str, Callable[[str, "Options"], Any], None]


def _env_value(name: str, default: Any, convert: Callable[[str], Any], kind: str, valid: Callable[[Any], bool],
               requirement: str) -> Any:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = convert(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not {kind}") from None
    if not valid(value):
        raise ValueError(f"environment variable {name}={text!r} must be {requirement}")
    return value


def _env_int(name: str, default: int, minimum: int = 1) -> int:
    return _env_value(name, default, int, "an integer", lambda v: v >= minimum, f"at least {minimum}")


def _env_seconds(name: str, default: float) -> float:
    return _env_value(name, default, float, "a number of seconds", lambda v: v > 0 and v != float("inf"),
                      "a positive number of seconds")


def _share(value: Any) -> str:
    """share_replicas as "auto", "on" or "off" (from the field, else CKPT_SHARE_REPLICAS)."""
    if value is None:
        text = os.environ.get("CKPT_SHARE_REPLICAS", "").strip().lower() or "auto"
        if text not in _SHARE_MODES:
            raise ValueError(f"environment variable CKPT_SHARE_REPLICAS={text!r} must be auto, on or off (1/0)")
        return _SHARE_MODES[text]
    if value is True or value is False:
        return "on" if value else "off"
    if isinstance(value, str) and value.strip().lower() in ("auto", "on", "off"):
        return value.strip().lower()
    raise ValueError(f"Options.share_replicas must be True, False or 'auto', got {value!r}")


def _layout(value: Any) -> str:
    """layout as "auto", "files" or "packed" (from the field, else CKPT_LAYOUT)."""
    text = value if value is not None else (os.environ.get("CKPT_LAYOUT", "").strip().lower() or "auto")
    if text not in LAYOUTS:
        where = "Options.layout" if value is not None else "environment variable CKPT_LAYOUT"
        raise ValueError(f"{where} must be one of {', '.join(LAYOUTS)}, got {text!r}")
    return text


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"Options.{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Options.{name} must be a positive integer, got {value!r}")
    return value


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Options.{name} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Options:
    """How ckpt talks to storage and how much memory it uses (``options=`` of every call).

    Every field left at None takes the environment variable named beside it when that is set,
    else the built-in default; both are read when a save, restore, metadata call or manager
    starts (``resolved()``). A field given is checked when the Options is made: ValueError (or
    TypeError for ``storage_options``) naming it. Frozen: make variants with
    ``dataclasses.replace``.

    Attributes:
        engine: ``"local"``, ``"tensorstore"`` or ``"fsspec"``, or a callable
            ``(location, options) -> Storage`` (e.g. a wrapping engine that injects faults).
            None: the default for the location's scheme (docs/storage.md).
        storage_options: passed to the engine: for ``fsspec``, keyword arguments of the file
            system (``endpoint_url``, ``key``, ...); for ``tensorstore``, entries merged into the
            kvstore spec.
        io_concurrency: storage operations in flight per process (``CKPT_IO_CONCURRENCY``;
            default max(8, 2 x cores)).
        max_inflight_bytes: bytes handed to storage and not yet durable, per process
            (``CKPT_MAX_INFLIGHT_BYTES``; default 256 MiB).
        host_budget_bytes: the host memory of one save, restore or export, in bytes, or
            ``"unlimited"``. A save counts its staging buffers, the chunks handed to storage and
            not yet durable, and the staging pool's free buffers; it also caps chunks at a
            quarter of it. A restore counts chunks read and regions assembled, not yet placed
            on devices (``CKPT_HOST_BUDGET_BYTES``, an integer or ``unlimited``; default a
            quarter of the host's physical memory; docs/memory.md).
        staging_pool: keep a save's host buffers for its next chunks and for the next save,
            within the host budget (``CKPT_STAGING_POOL``, ``0`` turns it off; default on;
            ``ckpt.release_host_memory()`` frees them).
        pack_limit_bytes: arrays of at most this many bytes whose whole value one process holds
            are written by it as one chunk, many same-shaped ones together as a stack (formats/
            SPEC.md section 7.1), instead of one file per shard (``CKPT_PACK_LIMIT_BYTES``;
            default 1 MiB; ``0`` writes every array shard by shard).
        max_chunk_bytes: the largest chunk a save writes: a shard bigger than this is split
            evenly into chunks of at most this size (``CKPT_MAX_CHUNK_BYTES``; default 64 MiB;
            a save also keeps chunks within a quarter of its host budget).
        request_timeout_s: the longest one storage operation on an object store (S3, GCS,
            through the ``tensorstore`` or ``fsspec`` engine) may take, retries included, before
            it fails with an error naming the object and the operation; a save or restore
            against a server that never answers raises within twice this
            (``CKPT_REQUEST_TIMEOUT_S``; default 60 s; docs/storage.md, "Timeouts"). Local
            disk is not bounded.
        share_replicas: restoring replicated state in a multi-process job: a leaf whose
            shards are replicated on several processes is read from storage once in total,
            split among those processes, and the pieces exchanged over the devices'
            interconnect (docs/multihost.md, "Replicated state"). ``"auto"``: from 4 replicas
            across processes; ``True``: from 2; ``False``: every process reads its own replica
            (``CKPT_SHARE_REPLICAS``: ``auto``, ``on``/``1`` or ``off``/``0``; default auto).
            Without replicas across processes a restore is the same either way.
        layout: how a save lays out its chunks: ``"files"``, one object per chunk (Zarr v3
            arrays, formats/SPEC.md versions 1-2); ``"packed"``, each process's chunks in a few
            data objects with an index object per process (format version 3: objects per save
            grow with processes, not with chunks; docs/multihost.md); ``"auto"``: packed when
            the save runs on several processes, else files (``CKPT_LAYOUT``; default auto).
        pack_object_bytes: packed layout: the size at which a data object is written
            (``CKPT_PACK_OBJECT_BYTES``; default 2 GiB; on object stores also at most a quarter
            of the host budget, since a save assembles data objects in two buffers of that size,
            and about a sixth of the process's bytes, at least 64 MiB, so that its uploads run in
            parallel).
    """

    engine: EngineChoice = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    io_concurrency: int | None = None
    max_inflight_bytes: int | None = None
    host_budget_bytes: int | str | None = None
    staging_pool: bool | None = None
    pack_limit_bytes: int | None = None
    max_chunk_bytes: int | None = None
    request_timeout_s: float | None = None
    share_replicas: bool | str | None = None
    layout: str | None = None
    pack_object_bytes: int | None = None

    def __post_init__(self) -> None:
        # Every field given is checked now, naming it: Options(io_concurrency=0) used to fail
        # only at the first save. (Environment variables are read, and checked, by resolved().)
        engine = self.engine
        if not (engine is None or callable(engine) or engine in ENGINE_NAMES):
            raise ValueError(f"Options.engine: unknown storage engine {engine!r}; engines: {', '.join(ENGINE_NAMES)}, "
                             "or a callable (location, options) -> Storage")
        if not isinstance(self.storage_options, Mapping):
            raise TypeError(f"Options.storage_options must be a dict, got {type(self.storage_options).__name__}")
        if self.staging_pool is not None and not isinstance(self.staging_pool, bool):
            raise ValueError(f"Options.staging_pool must be True or False, got {self.staging_pool!r}")
        for name in ("io_concurrency", "max_inflight_bytes", "max_chunk_bytes", "pack_object_bytes"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        checks = (("host_budget_bytes", _budget), ("share_replicas", _share), ("layout", _layout),
                  ("pack_limit_bytes", lambda v: _non_negative("pack_limit_bytes", v)),
                  ("request_timeout_s", lambda v: _seconds("request_timeout_s", v)))
        for name, check in checks:
            if getattr(self, name) is not None:
                check(getattr(self, name))

    def resolved(self) -> "Options":
        """A copy with every default filled in (environment variables are read now).

        Returns:
            An ``Options`` whose numeric and pool fields are all set.

        Raises:
            ValueError: a field or environment variable is not a positive integer (a
                non-negative one for ``pack_limit_bytes``; ``host_budget_bytes`` also accepts
                ``"unlimited"``; ``request_timeout_s`` a positive number of seconds).
        """
        return replace(
            self,
            io_concurrency=_positive("io_concurrency", self.io_concurrency) if self.io_concurrency is not None
            else _env_int("CKPT_IO_CONCURRENCY", max(8, 2 * (os.cpu_count() or 1))),
            max_inflight_bytes=_positive("max_inflight_bytes", self.max_inflight_bytes)
            if self.max_inflight_bytes is not None else _env_int("CKPT_MAX_INFLIGHT_BYTES", 256 << 20),
            host_budget_bytes=_budget(self.host_budget_bytes)
            if self.host_budget_bytes is not None else _env_budget(),
            staging_pool=bool(self.staging_pool) if self.staging_pool is not None
            else os.environ.get("CKPT_STAGING_POOL", "1") != "0",
            pack_limit_bytes=_non_negative("pack_limit_bytes", self.pack_limit_bytes)
            if self.pack_limit_bytes is not None else _env_int("CKPT_PACK_LIMIT_BYTES", PACK_LIMIT, minimum=0),
            max_chunk_bytes=_positive("max_chunk_bytes", self.max_chunk_bytes)
            if self.max_chunk_bytes is not None else _env_int("CKPT_MAX_CHUNK_BYTES", MAX_CHUNK_BYTES),
            request_timeout_s=_seconds("request_timeout_s", self.request_timeout_s)
            if self.request_timeout_s is not None else _env_seconds("CKPT_REQUEST_TIMEOUT_S", REQUEST_TIMEOUT_S),
            share_replicas=_share(self.share_replicas),
            layout=_layout(self.layout),
            pack_object_bytes=_positive("pack_object_bytes", self.pack_object_bytes)
            if self.pack_object_bytes is not None else _env_int("CKPT_PACK_OBJECT_BYTES", PACK_OBJECT_BYTES),
        )


def resolve(options: Options | None) -> Options:
    if options is None:
        return Options().resolved()
    if not isinstance(options, Options):
        raise TypeError(f"options must be a ckpt.Options, got {type(options).__name__}")
    return options.resolved()


# ---- host memory ---------------------------------------------------------------------

PAGE = 4096
POOLED_MIN_BYTES = 1 << 20  # smaller read buffers are left to the allocator


def _libc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _libc_trim()


def return_to_os() -> None:
    """Return the free pages of the C heap to the kernel (glibc ``malloc_trim``; elsewhere
    nothing). Call it right after freeing a large buffer; it costs well under a millisecond."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def unreferenced(buf: np.ndarray) -> bool:
    """Whether nothing but `buf` itself refers to its memory (an aligned view from
    ``aligned_empty``): no view of it handed out is alive any more.

    Views reference the array that owns the memory (`buf.base`), not `buf`: expected are
    buf.base, `owner` here, and getrefcount's argument. More means a view is alive somewhere
    (a storage engine that kept the chunk, a device that adopted it): never reuse it."""
    owner = buf.base
    return owner is not None and sys.getrefcount(owner) <= 3


class HostBudget:
    """The host bytes of one save or restore: `held` now against its `limit`, and the most it
    ever held (`high_water`), counted by ``take`` and ``give`` (thread-safe). The library's one
    budget type: a restore's reader counts into one where it allocates (its ``ReadBuffers``
    too), and a save's ``SaveBudget`` is one that also waits for room and pools buffers."""

    def __init__(self, limit: int):
        self.limit, self.held, self.high_water = limit, 0, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            self.held += n
            self.high_water = max(self.high_water, self.held)

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class ReadBuffers:
    """The page-aligned read buffers of one restore, reused batch after batch.

    A restore larger than its budget reads batch after batch; buffers the batch is done with
    (those no device adopted and no result kept) are read into again by the next batch, so its
    reads land in pages the process already holds instead of freshly faulted ones. Free buffers
    are counted in the restore's budget meter (`budget`: take/give); before a batch, free buffers
    of sizes the batch does not read are dropped, so free and used together stay within what
    the batch was planned for."""

    def __init__(self, budget) -> None:
        self.budget = budget
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def prepare(self, sizes: list[int]) -> None:
        """Before a batch reading buffers of `sizes`: keep as many free buffers of each size as
        it reads, drop the rest."""
        wanted = Counter(sizes)
        dropped = 0
        with self._lock:
            for n, bufs in self._free.items():
                while len(bufs) > wanted.get(n, 0):
                    bufs.pop()
                    dropped += n
            self._free = {n: b for n, b in self._free.items() if b}
        if dropped:
            self.budget.give(dropped)
            return_to_os()

    def get(self, nbytes: int) -> np.ndarray | None:
        """A buffer of `nbytes` (whole pages) plus one page, as the local engine reads into:
        a free one (uncounted here: the caller counts what it holds) or a new one; None for a
        buffer below POOLED_MIN_BYTES (the engine allocates it: small blocks are reused by the
        allocator itself)."""
        if nbytes < POOLED_MIN_BYTES:
            return None
        with self._lock:
            bufs = self._free.get(nbytes)
            buf = bufs.pop() if bufs else None
        if buf is not None:
            self.budget.give(nbytes)
            return buf
        from ckpt._host import aligned_empty

        return aligned_empty(nbytes + PAGE, PAGE)

    def put_back(self, buffers: list[np.ndarray]) -> None:
        """After a batch (its other bytes given back): keep the buffers of `buffers` nothing
        refers to any more, as far as the budget has room for them (counted)."""
        kept = 0
        with self._lock:
            for buf in buffers:
                n = len(buf) - PAGE
                if unreferenced(buf) and self.budget.held + kept + n <= self.budget.limit:
                    self._free.setdefault(n, []).append(buf)
                    kept += n
        self.budget.take(kept)

    def close(self) -> None:
        """Drop every free buffer (the restore is done)."""
        self.prepare([])


# Cyclic garbage collection paused while a save or restore builds its per-leaf objects.
# A tree of thousands of leaves makes tens of thousands of short-lived containers (records, plans,
# boxes, futures), which trigger the collector's full collections; each walks every object of the
# process, about 0.1 s in a process that has imported JAX, and a 4,000-leaf save or restore paid
# one or two of them (docs/benchmarks.md, "Many small leaves"). Reference counting frees these
# objects anyway; the collector runs again, as usual, once the call returns.
@contextlib.contextmanager
def gc_paused():
    """Disable the cyclic collector for the block (or decorated call), if it was enabled."""
    if not gc.isenabled():  # the caller turned it off: leave that alone
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def aligned_empty(nbytes: int, alignment: int = 64) -> np.ndarray:
    """An uninitialised uint8 buffer whose data starts on an `alignment`-byte boundary
    (XLA's CPU client adopts such host buffers without copying them)."""
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset : offset + nbytes]


# ---- thread pools ---------------------------------------------------------------------


class _ExitSafePool(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose work still runs where no thread may start: Python 3.12.0 and
    3.12.1 refuse every new thread once the interpreter is exiting ("can't create new thread at
    interpreter shutdown", even in the threading exit hooks; allowed again from 3.12.2, CPython
    gh-113964), which is when a save the program did not wait() for finishes (_save's exit hook).
    Such work runs on the threads the pool already has or, where it has none, in the submitting
    thread (the engines' work never submits to its own pool, so this cannot deadlock)."""

    def _adjust_thread_count(self) -> None:
        try:
            super()._adjust_thread_count()
        except RuntimeError as e:
            if "interpreter shutdown" not in str(e):
                raise
            if getattr(self, "_threads", None):
                return  # (queued: a thread of the pool takes it)
            while True:  # no thread at all: run what is queued here (submit queued it before)
                try:
                    item = self._work_queue.get_nowait()
                except queue.Empty:
                    return
                if item is not None:
                    item.run()


_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(name: str, concurrency: int) -> ThreadPoolExecutor:
    """The process's thread pool `name` of `concurrency` threads (engines doing blocking I/O
    share one per name and width rather than starting threads per storage or per save)."""
    with _pools_lock:
        if (name, concurrency) not in _pools:
            _pools[name, concurrency] = _ExitSafePool(concurrency, thread_name_prefix=name)
        return _pools[name, concurrency]
