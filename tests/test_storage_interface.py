"""The Storage interface itself: WrapperStorage forwards every member of it (checked against the
interface, so a member added later cannot be missed), a wrapped restore reads chunks through the
inner engine's own path, ranged reads (``read_range``, ``size``) on every engine and their rule
for symbolic links, and the library never writing ``os.environ``."""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ckpt
from ckpt._errors import CheckpointError
from ckpt._format import ArraySpec
from ckpt._host import aligned_empty
from ckpt.storage._base import ChunkFiles, LocalDirectory, Storage
from ckpt.storage._location import ENGINES, open_storage
from ckpt._commit import Leftover, commit_for
from ckpt.storage._tensorstore import TensorStoreStorage
from ckpt.storage._wrapper import WrapperStorage
from support import PER_SHARD, Faults, FaultyStorage, Location

PACKAGE = pathlib.Path(ckpt.__file__).resolve().parent

# Every public member of the interface: methods, properties and the capabilities value.
INTERFACE = sorted(name for name, _ in inspect.getmembers(Storage) if not name.startswith("_"))
# The optional protocols a capability brings (engines that declare it have them), and the
# members of one engine's own (versioned writes, packed data objects written in place).
OPTIONAL = sorted({n for cls in (ChunkFiles, LocalDirectory) for n, _ in inspect.getmembers(cls)
                   if not n.startswith("_")} | {"get_versioned", "put_if_version", "open_pack", "root"})


def test_the_interface_is_what_these_tests_enumerate():
    """At most 15 members and one capabilities value (issue 33), bytes only."""
    assert len(INTERFACE) <= 16 and "caps" in INTERFACE, INTERFACE
    assert {"url", "child", "get", "read_range", "put", "put_if_absent", "delete", "delete_tree", "list_dir",
            "stat_many"} <= set(INTERFACE)
    # Bytes only: how a checkpoint becomes visible is ckpt._commit's, how chunks sit in objects
    # ckpt._layout's (issue 33).
    assert not {"stage", "commit", "abort", "retire", "leftovers", "lock_saves", "create", "write_chunk",
                "create_array", "open_pack"} & set(INTERFACE)


@pytest.mark.parametrize("member", INTERFACE + OPTIONAL)
def test_the_wrapper_defines_every_member_of_the_interface(member):
    # Inherited from Storage would mean the base class's version runs over the wrapper (for
    # read_chunk_async: a thread pool instead of the engine's own asynchronous reads).
    assert member in vars(WrapperStorage), f"WrapperStorage does not forward Storage.{member}"


def _recording(storage: Storage, seen: list[str]) -> Storage:
    """`storage`, recording the name of every public member looked up on it (and on storages
    its engine derives with its own constructor)."""

    class Recording(type(storage)):
        def __getattribute__(self, attr):
            if not attr.startswith("_"):
                seen.append(attr)
            return object.__getattribute__(self, attr)

    storage.__class__ = Recording
    return storage


def _recording_wrapper(seen: list[str]) -> type:
    class RecordingWrapper(WrapperStorage):
        def __getattribute__(self, attr):
            if not attr.startswith("_") and attr not in ("inner", "wrap"):
                seen.append(attr)
            return object.__getattribute__(self, attr)

    return RecordingWrapper


def _calls(state: dict) -> list[tuple[str, object]]:
    """(member, call on a wrapper) for every member of the interface, in an order that works."""
    return [
        ("caps", lambda w: w.caps),
        ("url", lambda w: w.url), ("resolved_name", lambda w: w.resolved_name),
        ("where", lambda w: w.where("k")),
        ("child", lambda w: w.child("sub")), ("parent", lambda w: w.parent()),
        ("put", lambda w: w.put("d/k", b"abcdef").result()), ("put_if_absent", lambda w: w.put_if_absent("d/k2", b"x")),
        ("exists", lambda w: w.exists("d/k") and w.exists("")),
        ("list_dir", lambda w: w.list_dir("d")), ("stat_many", lambda w: w.stat_many(["d/k"])),
        ("get", lambda w: w.get("d/k", max_bytes=10)), ("size", lambda w: w.size("d/k")),
        ("read_range", lambda w: w.read_range("d/k", 1, 3)),
        ("delete", lambda w: w.delete("d/k2")), ("delete_tree", lambda w: w.delete_tree("d")),
    ]


def _optional_calls(state: dict, local: bool, versioned: bool) -> list[tuple[str, object]]:
    """(member, call on a wrapper) for the optional protocols' members an engine declares."""
    spec = ArraySpec((4,), (4,), np.dtype("float32"))

    def pin(w):
        w.put("d/k", b"abcdef").result()
        with w.pin() as pinned:
            assert pinned.get("d/k", max_bytes=10) == b"abcdef"

    def open_pack(w):
        pack = w.open_pack("d/p")
        pack.write_at(64, np.arange(4, dtype=np.uint8)).result()
        pack.close(68).result()
        assert w.get("d/p", max_bytes=100) == bytes(64) + bytes(range(4))

    chunk_files = [
        ("read_exact", lambda w: (w.put("d/e", b"abcdef").result(), w.read_exact("d/e", 6))),
        # (create_array and put_group write a zarr.json through the wrapper's own put, where the
        # wrapper sees its bytes: tests/test_wrapper_sees_every_byte.py)
        ("put", lambda w: w.create_array("a", spec).result()),
        ("put", lambda w: w.put_group("").result()),
        ("open_arrays", lambda w: state.update(handle=w.open_arrays({0: ("a", spec)})[0])),
        ("write_chunk", lambda w: w.write_chunk(state["handle"], ((0, 4),), np.arange(4, dtype=np.float32)).result()),
        ("read_chunk", lambda w: w.read_chunk("a", (0,), 16)),
        ("read_chunk_async", lambda w: w.read_chunk_async("a", (0,), 16, state["pool"]).result()),
    ]
    versioned_writes = [
        ("get_versioned", lambda w: state.update(version=w.get_versioned("d/e", max_bytes=10)[1])),
        ("put_if_version", lambda w: w.put_if_version("d/e", b"abcdef", state["version"])),
    ]
    directory = [("root", lambda w: w.root), ("make_dirs", lambda w: w.make_dirs()), ("pin", pin),
                 ("sync", lambda w: w.sync("")), ("du", lambda w: w.du()), ("open_pack", open_pack)]
    return chunk_files + (versioned_writes if versioned else []) + (directory if local else [])


def _each_call_reaches_the_inner_storage(kind: str, tmp_path, calls_of) -> None:
    """Call each (member, call) of `calls_of(state, inner)` on a wrapper of a `kind` storage; each
    must reach the inner storage as itself."""
    inner_seen: list[str] = []
    loc = Location.make(kind, tmp_path)
    inner = _recording(open_storage(loc("c"), ckpt.Options().resolved()), inner_seen)
    wrapper = _recording_wrapper([])(inner)
    state = {"pool": ThreadPoolExecutor(2)}
    try:
        for member, call in calls_of(state, inner):
            inner_seen.clear()
            call(wrapper)
            assert member in inner_seen, f"{member} did not reach the inner storage: {inner_seen}"
    finally:
        state["pool"].shutdown()
        loc.cleanup()


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_every_optional_member_a_wrapper_forwards_reaches_the_inner_storage(kind, tmp_path):
    """The members of the optional protocols an engine declares in its caps reach it through a
    wrapper as themselves (the engine's own, never a fallback)."""

    def calls_of(state, inner):
        assert inner.caps.renames == (kind == "local") and inner.caps.writes_in_place == (kind == "local")
        # Versioned writes where a lease needs them (memory:// and object stores); local disk
        # has its directory lock.
        assert inner.caps.versioned_writes == (kind != "local")
        return _optional_calls(state, local=inner.caps.renames, versioned=inner.caps.versioned_writes)

    _each_call_reaches_the_inner_storage(kind, tmp_path, calls_of)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_every_call_on_a_wrapper_reaches_the_inner_storage(kind, tmp_path):
    """Each member called on a wrapper reaches the inner storage as itself."""

    def calls_of(state, inner):
        calls = _calls(state)
        assert sorted(m for m, _ in calls) == INTERFACE, "a member of the interface has no call here: add one"
        return calls

    _each_call_reaches_the_inner_storage(kind, tmp_path, calls_of)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_every_step_of_a_commit_over_a_wrapper_runs_on_its_primitives(kind, tmp_path):
    """The commit strategies (ckpt._commit) work on a store through its members only: each step
    called over a wrapper reaches the inner storage through the wrapper's primitives."""
    inner_seen: list[str] = []
    wrapper_seen: list[str] = []
    loc = Location.make(kind, tmp_path)
    inner = _recording(open_storage(loc("c"), ckpt.Options().resolved()), inner_seen)
    wrapper = _recording_wrapper(wrapper_seen)(inner)
    strategy = commit_for(wrapper)
    state: dict = {}
    steps = [
        ("stage", lambda c: state.update(staged=c.stage(overwrite=False))),
        ("staged_from", lambda c: c.staged_from(state["staged"].info).storage.put("x", b"1").result()),
        ("commit", lambda c: c.commit(state["staged"], b"manifest", overwrite=False)),
        ("abort", lambda c: c.abort(c.stage(overwrite=True))),
        ("leftovers", lambda c: commit_for(c.staging_area()).leftovers()),
        ("remove_leftover", lambda c: c.remove_leftover(Leftover("x.tmp-000000000000", True, "test"))),
        ("remove_dead_leftovers", lambda c: c.remove_dead_leftovers()),
        ("lock", lambda c: c.lock().release()),
        ("retire", lambda c: c.retire()),
    ]
    try:
        for name, step in steps:
            inner_seen.clear()
            wrapper_seen.clear()
            step(strategy)
            if name in ("stage", "staged_from", "commit", "abort", "retire"):
                assert wrapper_seen and inner_seen, f"{name}: no primitive of it went through the wrapper"
        assert not wrapper.exists("manifest.msgpack") and not inner.exists("manifest.msgpack")  # retired
    finally:
        loc.cleanup()


def test_a_wrapped_memory_restore_reads_chunks_through_the_inner_engines_read_chunk_async():
    """Fault injection over memory:// reads as production does: every chunk through the
    TensorStore engine's own read_chunk_async (issued from the reader's thread), none through
    the thread-pool fallback (read_chunk on the reader's pool)."""
    seen: list[tuple[str, str]] = []  # (method, thread)

    class Inner(TensorStoreStorage):
        def read_chunk_async(self, *args, **kwargs):
            seen.append(("read_chunk_async", threading.current_thread().name))
            return super().read_chunk_async(*args, **kwargs)

        def read_chunk(self, *args, **kwargs):
            seen.append(("read_chunk", threading.current_thread().name))
            return super().read_chunk(*args, **kwargs)

    faults = Faults()

    def engine(text, options):
        inner = open_storage(text, replace(options, engine=None))
        assert type(inner) is TensorStoreStorage
        inner.__class__ = Inner
        return FaultyStorage(inner, faults)

    mesh = jax.make_mesh((4, 2), ("x", "y"))
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    path = f"memory://t/{uuid.uuid4().hex}/c"
    ckpt.save(path, {"w": jax.device_put(value, NamedSharding(mesh, P("x", "y")))}, options=PER_SHARD)
    try:
        out = ckpt.restore(path, options=ckpt.Options(engine=engine))
        assert out["w"].dtype == value.dtype and out["w"].tobytes() == value.tobytes()
        assert [m for m, _ in seen].count("read_chunk_async") == 8, seen  # one per shard's chunk
        assert not [m for m, _ in seen if m == "read_chunk"], "a chunk was read through the thread-pool fallback"
        assert all(not t.startswith("ckpt-read") for _, t in seen), seen  # issued from the reader's thread
        assert faults.calls["read_chunk"] == 8  # and the fault injector saw each read
    finally:
        open_storage(path, ckpt.Options().resolved()).delete_tree("")


def test_a_chunk_read_failure_injected_over_memory_names_the_chunk():
    path = f"memory://t/{uuid.uuid4().hex}/c"
    ckpt.save(path, {"w": np.arange(1 << 16, dtype=np.float32)}, options=PER_SHARD)
    faults = Faults(inner_engine=None)
    faults.fail("read_chunk", lambda where: OSError(5, "Input/output error (injected)", where))
    try:
        with pytest.raises(CheckpointError, match=r"leaf 'w', chunk \[0\].*Input/output error \(injected\)"):
            ckpt.restore(path, options=faults.options())
    finally:
        open_storage(path, ckpt.Options().resolved()).delete_tree("")


# ---- ranged reads ---------------------------------------------------------------------------------

DATA = bytes(range(256)) * 4


def _files(tmp_path) -> pathlib.Path:
    """A directory with a file, a link to a file under it, a link to a directory under it, a
    link out of it, and a FIFO."""
    root = tmp_path / "d"
    (root / "blobs").mkdir(parents=True)
    (root / "f.bin").write_bytes(DATA)
    (root / "blobs" / "b").write_bytes(DATA[::-1])
    (root / "in.bin").symlink_to("blobs/b")
    (root / "dir").symlink_to("blobs", target_is_directory=True)
    (tmp_path / "outside.bin").write_bytes(DATA)
    (root / "out.bin").symlink_to(tmp_path / "outside.bin")
    (root / "up.bin").symlink_to("../outside.bin")
    os.mkfifo(root / "fifo")
    return root


@pytest.mark.parametrize("engine", ENGINES)
def test_read_range_on_local_files(engine, tmp_path):
    root = _files(tmp_path)
    s = open_storage(str(root), ckpt.Options(engine=engine).resolved())
    assert s.size("f.bin") == len(DATA)
    got = s.read_range("f.bin", 10, 100)
    assert got.dtype == np.uint8 and got.tobytes() == DATA[10:110]
    into = aligned_empty(200)
    got = s.read_range("f.bin", 1000, 24, into)
    assert got.tobytes() == DATA[1000:] and np.shares_memory(got, into)
    assert s.read_range("f.bin", 5, 0).tobytes() == b""
    with pytest.raises(CheckpointError, match=rf"{root}/f.bin is truncated: it ends before byte 1025"):
        s.read_range("f.bin", 1000, 25)
    with pytest.raises(FileNotFoundError):
        s.read_range("missing.bin", 0, 1)
    with pytest.raises(FileNotFoundError):
        s.size("missing.bin")
    with pytest.raises(CheckpointError, match="not a relative path inside"):
        s.read_range("../outside.bin", 0, 1)
    with pytest.raises(CheckpointError):
        s.read_range("fifo", 0, 1)  # refused, never waited on
    with pytest.raises(ValueError):
        s.read_range("f.bin", -1, 4)


@pytest.mark.parametrize("engine", ENGINES)
def test_read_range_follows_links_only_within_the_location(engine, tmp_path):
    root = _files(tmp_path)
    s = open_storage(str(root), ckpt.Options(engine=engine).resolved())
    # Under the location: followed, to the target's bytes.
    assert s.read_range("in.bin", 5, 7).tobytes() == DATA[::-1][5:12] and s.size("in.bin") == len(DATA)
    assert s.read_range("dir/b", 0, 3).tobytes() == DATA[::-1][:3]
    # Out of it: refused, naming the link.
    for key in ("out.bin", "up.bin"):
        for call in (lambda: s.read_range(key, 0, 1), lambda: s.size(key)):
            with pytest.raises(CheckpointError) as e:
                call()
            assert f"{root}/{key} is a symbolic link to {tmp_path.resolve()}/outside.bin, which is outside" in str(e.value)
    # A checkpoint's own reads never follow a link, even one under the location.
    for call in (lambda: s.read_exact("in.bin", len(DATA)), lambda: s.get("in.bin", max_bytes=1 << 20)):
        with pytest.raises(CheckpointError, match="symbolic link"):
            call()


def test_a_pinned_local_storage_keeps_its_ranged_files_open_only_while_pinned(tmp_path):
    root = _files(tmp_path)
    s = open_storage(str(root), ckpt.Options().resolved())
    open_fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = open_fds()
    with s.pin() as pinned:
        for _ in range(3):
            assert pinned.read_range("f.bin", 3, 4).tobytes() == DATA[3:7]
            assert pinned.read_range("in.bin", 0, 2).tobytes() == DATA[::-1][:2]
        assert pinned.size("f.bin") == len(DATA)
        assert open_fds() == before + 3  # the directory and the two files, each opened once
        with pytest.raises(CheckpointError, match="outside"):
            pinned.read_range("out.bin", 0, 1)  # still refused while pinned
    assert open_fds() == before
    assert s.read_range("f.bin", 3, 4).tobytes() == DATA[3:7] and open_fds() == before  # unpinned: none kept


def test_read_range_on_memory_and_the_default_of_the_interface():
    s = open_storage(f"memory://t/{uuid.uuid4().hex}", ckpt.Options().resolved())
    s.put("x/f.bin", DATA).result()
    try:
        assert s.size("x/f.bin") is None  # a kvstore tells no size without reading
        with pytest.raises(FileNotFoundError):
            s.size("x/missing")
        for read in (s.read_range, lambda *a: Storage.read_range(s, *a)):  # the engine's, the base class's
            assert read("x/f.bin", 250, 12).tobytes() == DATA[250:262]
            with pytest.raises(CheckpointError, match="truncated: it ends before byte 1030"):
                read("x/f.bin", 1020, 10)
            with pytest.raises(FileNotFoundError):
                read("x/missing", 0, 1)
        assert Storage.size(s, "x/f.bin") is None  # stat_many can only tell that it exists here
    finally:
        s.delete_tree("")


# ---- the environment ---------------------------------------------------------------------------

_ENV_METHODS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")) or (
        isinstance(node, ast.Name) and node.id in ("environ", "environb"))


def environ_writes(source: str, filename: str = "<source>") -> list[str]:
    """Every place `source` writes the process environment: os.environ[...] = / del / +=,
    os.environ.setdefault/update/pop/popitem/clear(...), os.putenv / os.unsetenv."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
            found.append(f"{filename}:{node.lineno}")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in _ENV_METHODS and _is_environ(f.value):
                found.append(f"{filename}:{node.lineno}")
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("putenv", "unsetenv"):
                found.append(f"{filename}:{node.lineno}")
    return found


def test_the_scan_finds_every_kind_of_environment_write():
    source = "\n".join([
        "import os", "from os import environ, putenv", "os.environ['A'] = '1'", "os.environ.setdefault('A', '1')",
        "os.environ.update(A='1')", "os.putenv('A', '1')", "del os.environ['A']", "environ['B'] = '2'",
        "putenv('B', '2')", "os.environ.pop('A', None)", "os.environ['A'] += 'x'", "os.unsetenv('A')",
        "os.environ.get('A')", "x = os.environ['A']", "dict(os.environ)",  # reads: not found
    ])
    assert sorted(int(w.rsplit(":", 1)[1]) for w in environ_writes(source)) == list(range(3, 13))


def test_the_library_never_writes_the_environment():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += environ_writes(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, f"ckpt/ writes os.environ at {found}"


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_save_and_restore_leave_the_environment_as_it_was(kind, tmp_path):
    loc = Location.make(kind, tmp_path)
    before = dict(os.environ)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    value = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    tree = {"w": jax.device_put(value, NamedSharding(mesh, P("x", "y"))), "step": 3}
    try:
        ckpt.save(loc("c"), tree)
        ckpt.save(loc("c"), tree, overwrite=True)
        out = ckpt.restore(loc("c"))
        assert out["step"] == 3 and out["w"].tobytes() == value.tobytes()
        assert ckpt.metadata(loc("c"))["w"].shape == (128, 64)
        with ckpt.CheckpointManager(loc("run")) as manager:
            manager.save(1, tree)
            manager.wait()
            assert manager.restore(1)["w"].tobytes() == value.tobytes()
        assert dict(os.environ) == before
    finally:
        loc.cleanup()


def test_gcs_emulator_settings_reach_the_libraries_without_the_environment(monkeypatch):
    """With STORAGE_EMULATOR_HOST set: gcsfs's core file system is opened (no experimental
    bucket probe) with anonymous credentials; TensorStore, whose GCS endpoint only an environment
    variable sets, is refused with what to set until the user sets it. Nothing is written to
    the environment either way."""
    gcsfs_core = pytest.importorskip("gcsfs.core")
    for name in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")
    before = dict(os.environ)
    s = open_storage("gs://bucket/p", ckpt.Options(engine="fsspec").resolved())
    assert type(s.fs) is gcsfs_core.GCSFileSystem and s.fs.credentials.token == "anon"
    with pytest.raises(CheckpointError, match="set TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:9"):
        open_storage("gs://bucket/p", ckpt.Options(engine="tensorstore").resolved())
    assert dict(os.environ) == before
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "http://127.0.0.1:9")
    before = dict(os.environ)
    s = open_storage("gs://bucket/p", ckpt.Options(engine="tensorstore").resolved())
    assert s.caps.engine == "tensorstore" and not s.caps.conditional_writes  # (the emulator's gap: docs/storage.md)
    assert dict(os.environ) == before
