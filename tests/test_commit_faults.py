"""Issue 28 at the storage level, without a network: faults injected through the Storage
interface (support.Faults) on memory:// (TensorStore's in-memory kvstore, which has generations).

A lost answer (the write landed, the client saw an error, or its own retry was refused as
"exists") must never turn a good save into a corrupt committed checkpoint; a save either commits
a checkpoint that restores bit-exact, raises and commits nothing, or raises saying that the
outcome is unknown and deletes nothing. Also: the saver lease (idempotent acquire, atomic
takeover), bounded time on every engine, a save stopping at its first failed chunk, and ``verify``
catching a chunk longer than recorded where the engine does not. The wire-level counterparts
(SeaweedFS behind a fault-injecting proxy) are tests/test_s3_faults.py.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import replace

from fsspec.implementations.memory import MemoryFileSystem
import numpy as np
import pytest
import tensorstore as ts

import ckpt
from ckpt._format import GENERATION_MARK, MANIFEST_NAME, read_manifest
from ckpt._host import REQUEST_TIMEOUT_S
from ckpt.storage import OutcomeUnknownError
from ckpt.storage._base import Storage
from ckpt.storage._fsspec import FsspecStorage
from ckpt.storage._location import open_storage
from ckpt._commit import create
from ckpt._commit.lease import LEASE_NAME, LEASE_TTL_S, SaverLease
from ckpt._commit.strategy import OWNER_NAME, owner_record
from ckpt.storage._tensorstore import TensorStoreStorage, shared_context
from support import (
    BIG, Faults, FaultyStorage, already_exists, committed_generations, connection_reset, io_error, keys,
    server_error, snapshot, storage_of, timed_out,
)

# Many small chunks: 64 chunk files of 4 KiB for "w".
OPTIONS = dict(max_chunk_bytes=4096, pack_limit_bytes=0)
LOST = [connection_reset, server_error, timed_out, already_exists]


def _tree(scale: float = 1.0) -> dict:
    return {"w": np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024) * scale,
            "b": np.linspace(0, 1, 7) * scale}


def _same(out: dict, want: dict) -> None:
    for k, v in want.items():
        got = np.asarray(out[k])
        assert got.dtype == v.dtype and np.array_equal(got.view(np.uint8), v.view(np.uint8)), k


@pytest.fixture
def path():
    root = f"memory://t/{uuid.uuid4().hex}"
    yield f"{root}/c"
    storage_of(root).delete_tree("")


def _is_manifest(where, args):
    return where.endswith("/" + MANIFEST_NAME)


def _is_owner(where, args):
    return where.endswith("/" + OWNER_NAME)


def _generations(path: str) -> list[str]:
    return [d for d in storage_of(path).list_dir("")[1] if d.startswith(GENERATION_MARK)]


# ---- items 1 and 2: idempotent conditional writes -------------------------------------------


@pytest.mark.parametrize("error", LOST, ids=lambda f: f.__name__)
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_lost_answer_to_the_manifest_write_commits(path, error, overwrite):
    """The manifest lands and the client sees a reset, a 500, its own timeout, or (its own retry
    of If-None-Match: *) "already exists": the save reads the manifest back, finds its own, and
    succeeds; the checkpoint restores bit-exact and holds only its own generation."""
    if overwrite:
        ckpt.save(path, _tree(), options=ckpt.Options(**OPTIONS))
    faults = Faults()
    faults.lose_answer("put" if overwrite else "put_if_absent", error, when=_is_manifest)
    ckpt.save(path, _tree(2), overwrite=overwrite, options=faults.options(**OPTIONS))
    _same(ckpt.restore(path), _tree(2))
    assert _generations(path) == committed_generations(path)
    assert not [k for k in keys(storage_of(path)) if k.endswith(OWNER_NAME)]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_manifest_write_whose_outcome_cannot_be_told_deletes_nothing(path, overwrite):
    """The manifest lands, its answer is lost, and the read-back fails too: the save raises
    OutcomeUnknownError (a CheckpointError) naming the location and saying so; nothing it wrote
    is deleted, so the manifest that did land restores."""
    if overwrite:
        ckpt.save(path, _tree(), options=ckpt.Options(**OPTIONS))
        (old,) = committed_generations(path)
    faults = Faults()
    faults.lose_answer("put" if overwrite else "put_if_absent", connection_reset, when=_is_manifest)
    faults.fail("get", io_error, when=_is_manifest, after=1 if overwrite else 0)  # (an overwrite reads the old one)
    with pytest.raises(OutcomeUnknownError, match="outcome of its commit is unknown") as e:
        ckpt.save(path, _tree(2), overwrite=overwrite, options=faults.options(**OPTIONS))
    assert isinstance(e.value, ckpt.CheckpointError) and path in str(e.value)
    assert "nothing it wrote was deleted" in str(e.value)
    assert not [op for op, where in faults.log if op in ("delete_tree", "abort", "delete")]
    _same(ckpt.restore(path), _tree(2))  # it had landed: committed, whole
    if overwrite:
        assert old in _generations(path)  # the old data stays too (only space)


def test_a_manifest_write_that_may_still_land_deletes_nothing(path):
    """A timeout of the client's own before the manifest landed, then a read-back showing none:
    the request may still be in flight, so the outcome is unknown and the generation stays."""
    faults = Faults()
    faults.fail("put_if_absent", timed_out, when=_is_manifest)
    with pytest.raises(OutcomeUnknownError, match="outcome of its commit is unknown"):
        ckpt.save(path, _tree(), options=faults.options(**OPTIONS))
    (gen,) = _generations(path)
    assert storage_of(path).exists(f"{gen}/{OWNER_NAME}")  # nothing deleted, its owner record included


def test_a_genuine_lost_race_stays_file_exists_and_removes_its_generation(path):
    """Another save's manifest is there when ours is written: FileExistsError, our generation is
    removed, the other checkpoint is untouched."""
    other = f"{path}-other"
    ckpt.save(other, _tree(3), options=ckpt.Options(**OPTIONS))
    theirs = storage_of(other).get(MANIFEST_NAME, max_bytes=BIG)
    faults = Faults()
    faults.before("put_if_absent", lambda key, data: storage_of(path).put(MANIFEST_NAME, theirs).result(),
                  when=_is_manifest)
    with pytest.raises(FileExistsError, match="another save committed a checkpoint here first"):
        ckpt.save(path, _tree(), options=faults.options(**OPTIONS))
    assert storage_of(path).get(MANIFEST_NAME, max_bytes=BIG) == theirs
    assert _generations(path) == []


@pytest.mark.parametrize("error", [server_error, io_error], ids=lambda f: f.__name__)
def test_a_manifest_write_that_provably_failed_removes_its_generation(path, error):
    """Item 6: every attempt failed before the server stored anything (503 SlowDown...), and the
    read-back shows no manifest: nothing was committed and the generation is removed."""
    faults = Faults()
    faults.fail("put_if_absent", error, when=_is_manifest)
    with pytest.raises(ckpt.CheckpointError, match="nothing committed"):
        ckpt.save(path, _tree(), options=faults.options(**OPTIONS))
    assert keys(storage_of(path)) == []
    ckpt.save(path, _tree(2), options=ckpt.Options(**OPTIONS))  # the place is free
    _same(ckpt.restore(path), _tree(2))


def test_an_overwrite_whose_manifest_write_provably_failed_keeps_the_old_checkpoint(path):
    ckpt.save(path, _tree(), options=ckpt.Options(**OPTIONS))
    (old,) = committed_generations(path)
    faults = Faults()
    faults.fail("put", server_error, when=_is_manifest)
    with pytest.raises(ckpt.CheckpointError, match="nothing committed"):
        ckpt.save(path, _tree(2), overwrite=True, options=faults.options(**OPTIONS))
    assert _generations(path) == [old]
    _same(ckpt.restore(path), _tree())


@pytest.mark.parametrize("error", LOST, ids=lambda f: f.__name__)
def test_a_lost_answer_to_the_owner_record_write_saves(path, error):
    """Item 2: the owner record (the first object of a save, written if absent) lands and its
    answer is lost: the save recognises its own record (records carry a token) and goes on."""
    faults = Faults()
    faults.lose_answer("put_if_absent", error, when=_is_owner)
    ckpt.save(path, _tree(), options=faults.options(**OPTIONS))
    _same(ckpt.restore(path), _tree())


def test_owner_records_are_unique():
    from ckpt._commit.strategy import owner_bytes

    assert owner_bytes() != owner_bytes()


def test_another_writers_object_is_not_taken_for_ours(path):
    storage = storage_of(path)
    storage.put("k", b"theirs").result()
    with pytest.raises(FileExistsError):
        create(storage, "k", b"ours")
    faults = Faults()
    faults.fail("put_if_absent", server_error)
    wrapped = faults.engine(path, ckpt.Options().resolved())
    with pytest.raises(FileExistsError, match="another writer"):
        create(wrapped, "k", b"ours")
    with pytest.raises(OSError, match="500"):  # missing on the read-back: provably not written
        create(wrapped, "k2", b"ours")
    assert not storage.exists("k2")


# ---- the saver lease: items 2 and 3 ---------------------------------------------------------


def _faulty(path: str, faults: Faults) -> FaultyStorage:
    return faults.engine(path, ckpt.Options().resolved())


def _stale_lease(storage: Storage) -> None:
    storage.put(LEASE_NAME, json.dumps({**owner_record(), "pid": 1, "host": "gone-host", "boot_id": "x",
                                        "time": time.time() - 10 * LEASE_TTL_S, "token": "dead"}).encode()).result()


@pytest.mark.parametrize("error", LOST, ids=lambda f: f.__name__)
def test_a_lost_answer_to_the_lease_write_does_not_make_a_manager_refuse_itself(path, error):
    faults = Faults()
    faults.lose_answer("put_if_absent", error, when=lambda where, args: where.endswith(LEASE_NAME))
    lease = SaverLease.acquire(_faulty(path, faults))
    try:
        assert json.loads(storage_of(path).get(LEASE_NAME, max_bytes=BIG))["token"] == lease.record["token"]
        with pytest.raises(ckpt.CheckpointError, match=r"another CheckpointManager \(pid"):
            SaverLease.acquire(storage_of(path))  # a second one is still refused
    finally:
        lease.release()
    assert not storage_of(path).exists(LEASE_NAME)


class _LeaseOverFaults(FaultyStorage):
    """A FaultyStorage whose saver lease runs over it (the faults see the lease's writes)."""

    def wrap(self, inner):
        return _LeaseOverFaults(inner, self.faults)

    @property
    def renames(self):  # (so the manager's commit, and its saver lock, are a generation's and a lease)
        return False


def test_the_only_manager_never_refuses_itself(path):
    faults = Faults()
    faults.lose_answer("put_if_absent", already_exists, when=lambda where, args: where.endswith(LEASE_NAME))

    def engine(text, options):
        return _LeaseOverFaults(open_storage(text, replace(options, engine=None)), faults)

    mgr = ckpt.CheckpointManager(path, options=ckpt.Options(engine=engine, **OPTIONS))
    try:
        mgr.save(1, _tree())
        mgr.wait()
        assert mgr.all_steps() == [1]
    finally:
        mgr.close()
    assert ("put_if_absent", f"{path}/{LEASE_NAME}") in faults.log


def test_exactly_one_of_two_racing_takeovers_wins(path):
    """Item 3: two managers find the same expired lease and replace it at once: the replace is a
    compare-and-swap on the version both read; one wins, the other's error names the winner."""
    _stale_lease(storage_of(path))
    faults = Faults()
    gate = faults.hold("put_if_version", timeout_s=30)
    results: list = [None, None]

    def take(i: int) -> None:
        try:
            results[i] = SaverLease.acquire(_faulty(path, faults))
        except BaseException as e:  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=take, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while len(gate.held) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert len(gate.held) == 2  # both read the stale version and are about to replace it
    gate.release.set()
    for t in threads:
        t.join(30)
    won = [r for r in results if isinstance(r, SaverLease)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1, results
    winner = won[0]
    assert "took over the expired saver lease" in str(lost[0]) and f"pid {winner.record['pid']}" in str(lost[0])
    assert json.loads(storage_of(path).get(LEASE_NAME, max_bytes=BIG))["token"] == winner.record["token"]
    winner.release()


def test_a_lost_answer_to_a_takeover_still_takes_over(path):
    _stale_lease(storage_of(path))
    faults = Faults()
    faults.lose_answer("put_if_version", connection_reset)
    lease = SaverLease.acquire(_faulty(path, faults))
    assert json.loads(storage_of(path).get(LEASE_NAME, max_bytes=BIG))["token"] == lease.record["token"]
    lease.release()


def test_a_lease_taken_over_is_not_renewed_over_the_winner(path):
    """A manager that stalled past the TTL and was taken over does not overwrite the new
    holder's lease when it renews: it learns that it lost it."""
    first = SaverLease.acquire(storage_of(path))
    first._stop.set()  # no background renewals in this test
    theirs = json.dumps({**owner_record(), "token": "winner"}).encode()
    storage_of(path).put(LEASE_NAME, theirs).result()  # (a takeover meanwhile)
    first.renew()
    assert first.lost is not None and "taken over" in first.lost
    assert storage_of(path).get(LEASE_NAME, max_bytes=BIG) == theirs


def test_a_renewal_whose_answer_was_lost_keeps_the_lease(path):
    faults = Faults()
    lease = SaverLease.acquire(_faulty(path, faults))
    lease._stop.set()
    faults.lose_answer("put_if_version", server_error)
    lease.renew()
    assert lease.lost is None and lease.version is not None
    lease.renew()  # over the version read back
    assert json.loads(storage_of(path).get(LEASE_NAME, max_bytes=BIG))["time"] == lease.record["time"]


# ---- item 4: bounded time ---------------------------------------------------------------------


class _BlackHoleKv:
    """A kvstore that accepts every request and never answers (TensorStore futures that never
    resolve)."""

    def __init__(self):
        self.promises = []

    def _never(self, *args, **kwargs):
        promise, future = ts.Promise.new()
        self.promises.append(promise)
        return future

    read = write = list = delete_range = _never


def _black_hole(url: str, timeout_s: float) -> TensorStoreStorage:
    class BlackHole(TensorStoreStorage):
        def _with_path(self, p, u):
            other = super()._with_path(p, u)
            other.__class__ = BlackHole
            other._kv = self._kv
            return other

    storage = BlackHole({"driver": "memory", "path": "bh/"}, url, shared_context("memory", 0), timeout_s=timeout_s)
    storage._kv = _BlackHoleKv()
    return storage


def test_a_save_and_a_restore_against_a_server_that_never_answers_fail_within_the_bound():
    url = f"memory://bh/{uuid.uuid4().hex}"
    options = ckpt.Options(engine=lambda text, opts: _black_hole(text, opts.request_timeout_s), request_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no answer within 0.5 s") as e:
        ckpt.save(url, _tree(), options=options)
    assert time.monotonic() - start < 2 * 0.5 + 1.5
    assert url in str(e.value) and "list" in str(e.value)
    start = time.monotonic()
    with pytest.raises((TimeoutError, ckpt.CheckpointError), match="no answer within 0.5 s") as e:
        ckpt.restore(url, options=options)
    assert time.monotonic() - start < 2 * 0.5 + 1.5
    assert url in str(e.value)


def test_a_chunk_write_that_never_completes_fails_the_save_within_the_bound(path):
    """The server stops answering mid-save (chunk writes hang): the save raises within about
    twice request_timeout_s, naming a chunk object."""
    promises = []  # kept alive: never resolved

    class Hanging(TensorStoreStorage):
        def write_chunk(self, handle, box, data):
            promise, future = ts.Promise.new()
            promises.append(promise)
            from ckpt.storage._tensorstore import MappedFuture

            return MappedFuture(future, self.where("w/c/0/0"), self._timeout_s, "write")

    def engine(text, opts):
        inner = open_storage(text, replace(opts, engine=None))
        inner.__class__ = Hanging
        return inner

    start = time.monotonic()
    with pytest.raises((OSError, ckpt.CheckpointError), match=r"write: no answer within 0.5 s") as e:
        ckpt.save(path, _tree(), options=ckpt.Options(engine=engine, request_timeout_s=0.5, **OPTIONS))
    assert "/w/c/0/0" in str(e.value)
    assert time.monotonic() - start < 2 * 0.5 + 2


def test_the_fsspec_engine_bounds_each_operation():
    class Slow(MemoryFileSystem):
        def cat_file(self, path, start=None, end=None, **kwargs):
            time.sleep(3)
            return super().cat_file(path, start, end, **kwargs)

    fs = Slow()
    root = f"/slow-{uuid.uuid4().hex}"
    fs.pipe_file(f"{root}/k", b"data")
    storage = FsspecStorage(fs, root, f"memory://{root.strip('/')}", 4, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"read: no answer within 0.3 s") as e:
        storage.get("k", max_bytes=100)
    assert time.monotonic() - start < 2.5
    assert e.value.filename == storage.where("k")


def test_request_timeout_option_and_environment(monkeypatch):
    monkeypatch.delenv("CKPT_REQUEST_TIMEOUT_S", raising=False)
    assert ckpt.Options().resolved().request_timeout_s == REQUEST_TIMEOUT_S <= 60
    monkeypatch.setenv("CKPT_REQUEST_TIMEOUT_S", "12.5")
    assert ckpt.Options().resolved().request_timeout_s == 12.5
    assert ckpt.Options(request_timeout_s=3).resolved().request_timeout_s == 3.0
    monkeypatch.setenv("CKPT_REQUEST_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="CKPT_REQUEST_TIMEOUT_S"):
        ckpt.Options().resolved()
    with pytest.raises(ValueError, match="request_timeout_s"):
        ckpt.Options(request_timeout_s=-1).resolved()


def test_s3_requests_get_timeouts_and_bounded_retries():
    """The fsspec engine's s3fs: botocore connect/read timeouts and a bounded number of
    attempts; content checksums left at botocore's default (computed and sent on every PUT)."""
    pytest.importorskip("s3fs")
    storage = open_storage("s3://bucket/x", ckpt.Options(engine="fsspec", request_timeout_s=20,
                                                           storage_options={"endpoint_url": "http://127.0.0.1:9",
                                                                            "key": "k", "secret": "s"}).resolved())
    config = storage.fs.config_kwargs
    assert config["read_timeout"] == 20 and config["connect_timeout"] == 10
    assert config["retries"] == {"max_attempts": 5, "mode": "legacy"}
    assert "request_checksum_calculation" not in config  # botocore default: when_supported
    assert storage.fs.retries == 2
    assert storage.caps.versioned_writes


# ---- item 5: a save stops at its first failed chunk -------------------------------------------


def test_a_save_stops_at_its_first_failed_chunk(path):
    faults = Faults()
    faults.fail("write_chunk", server_error, in_future=True, after=2, times=1)
    with pytest.raises((OSError, ckpt.CheckpointError), match="500"):
        ckpt.save(path, _tree(), options=faults.options(**OPTIONS))
    # 64 + 1 chunks to write; the 3rd fails at once: no more than one more write goes out.
    assert faults.calls["write_chunk"] <= 4, faults.calls
    assert keys(storage_of(path)) == []


def test_a_failed_chunk_write_cancels_writes_not_yet_started():
    """The fsspec engine's writes queue on a pool: the ones not started when a chunk fails are
    cancelled (concurrent.futures cancels only those), so no new PUT goes out."""
    started = []
    release = threading.Event()

    class Slow(MemoryFileSystem):
        def pipe_file(self, path, value, **kwargs):
            if "/c/" in path:  # a chunk: the first one fails, once the others queued up
                started.append(path)
                first = len(started) == 1
                release.wait(5)
                if first:
                    raise OSError(5, "injected failure of the first chunk")
            return super().pipe_file(path, value, **kwargs)

    fs = Slow()
    root = f"/ff-{uuid.uuid4().hex}"
    storage = FsspecStorage(fs, root, f"memory://{root.strip('/')}", 2, timeout_s=10)
    threading.Timer(0.3, release.set).start()
    with pytest.raises((OSError, ckpt.CheckpointError), match="injected failure"):
        ckpt.save(f"memory://{root.strip('/')}", _tree(), options=ckpt.Options(
            engine=lambda text, opts: storage, io_concurrency=2, **OPTIONS))
    assert len(started) < 16, len(started)  # of 65 chunk writes, 2 at a time


# ---- item 8: verify catches a chunk longer than recorded -------------------------------------


def test_verify_catches_a_chunk_longer_than_recorded_where_reads_do_not(path):
    from ckpt.cli._verify import verify_checkpoint

    ckpt.save(path, _tree(), options=ckpt.Options(**OPTIONS))
    storage = storage_of(path)
    manifest = read_manifest(storage)
    (gen,) = committed_generations(path)
    key = next(k for k in keys(storage) if k.startswith(f"{gen}/w/c/"))
    storage.put(key, storage.get(key, max_bytes=BIG) + b"\0").result()

    class RemoteLike(FaultyStorage):  # reads like TensorStore on S3: only the recorded size
        @property
        def caps(self):
            return replace(self.inner.caps, reads_refuse_longer=False)

        def wrap(self, inner):
            return RemoteLike(inner, self.faults)

        def read_chunk(self, path_, index, nbytes, into=None):
            from ckpt._geometry import chunk_key

            return np.frombuffer(self.inner.get(f"{path_}/{chunk_key(index)}", max_bytes=BIG)[:nbytes], np.uint8)

    remote = RemoteLike(storage, Faults())
    report = verify_checkpoint(remote, manifest)
    assert not report.intact
    assert any("more than the 4096 bytes expected" in str(p) for p in report.problems), report.problems
    assert verify_checkpoint(storage, manifest).problems  # (memory:// reads refuse it themselves)


def test_a_server_refusing_compare_and_swap_still_lets_a_lease_be_taken_over_and_renewed(path):
    """Ceph RGW refuses If-Match with a quoted ETag: every compare-and-swap fails although the
    object is unchanged. The takeover then falls back to a plain write checked by a read-back
    (documented as not atomic there), and renewals keep working."""
    from ckpt._commit import lease as lease_module

    _stale_lease(storage_of(path))
    faults = Faults()
    storage = _faulty(path, faults)

    class Refusing(type(storage)):
        def put_if_version(self, key, data, version):
            return None  # refused (412), nothing written

        def wrap(self, inner):
            return Refusing(inner, self.faults)

    refusing = Refusing(storage.inner, faults)
    try:
        lease = SaverLease.acquire(refusing)
        lease._stop.set()
        assert json.loads(storage_of(path).get(LEASE_NAME, max_bytes=BIG))["token"] == lease.record["token"]
        time.sleep(0.01)
        lease.renew()
        assert lease.lost is None
        assert json.loads(storage_of(path).get(LEASE_NAME, max_bytes=BIG))["time"] == lease.record["time"]
        lease.release()
    finally:
        lease_module._CAS_REFUSED.discard(refusing.url)


def test_a_manager_whose_lease_was_taken_over_refuses_to_save(path):
    mgr = ckpt.CheckpointManager(path, options=ckpt.Options(**OPTIONS))
    try:
        mgr.save(1, _tree())
        mgr.wait()
        theirs = json.dumps({**owner_record(), "token": "winner"}).encode()
        storage_of(path).put(LEASE_NAME, theirs).result()  # taken over while this one stalled
        mgr._saver_lock.renew()
        with pytest.raises(ckpt.CheckpointError, match="no longer holds its saver lease: taken over"):
            mgr.save(2, _tree(2))
        assert storage_of(path).get(LEASE_NAME, max_bytes=BIG) == theirs
    finally:
        mgr.close()
    assert storage_of(path).get(LEASE_NAME, max_bytes=BIG) == theirs  # (its release leaves the winner's)


def test_an_owner_record_write_of_unknown_outcome_fails_the_save_plainly(path):
    """Nothing can be committed before the owner record: an unknown outcome there is a plain
    failure (not OutcomeUnknownError), and the location holds no checkpoint."""
    faults = Faults()
    faults.fail("put_if_absent", timed_out, when=_is_owner)
    with pytest.raises(ckpt.CheckpointError, match="nothing committed") as e:
        ckpt.save(path, _tree(), options=faults.options(**OPTIONS))
    assert not isinstance(e.value, OutcomeUnknownError) and "owner record" in str(e.value)
    with pytest.raises((FileNotFoundError, ckpt.CheckpointError)):
        ckpt.restore(path)
