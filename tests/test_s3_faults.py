"""s3:// under routine faults on the wire (issue 28): a real S3 server (SeaweedFS, started on
127.0.0.1 for this module) behind a fault-injecting HTTP proxy (tests/faultproxy.py), the library
pointed at the proxy as its S3 endpoint, both engines, several seeds.

What every test holds to: a save either commits a checkpoint that restores bit-exact, or raises
and commits nothing, or (the manifest write's outcome unknown) raises saying so and leaves what
it wrote; no committed checkpoint ever fails to restore. Outcomes are judged by listing the
prefix directly on SeaweedFS (botocore, not through the proxy) and restoring every committed
manifest found there directly, every leaf compared.

Items 1-7 of the issue, then what must keep passing (transient faults on restore's GETs, a slow
server). Each call runs under a time limit: past it the proxy is healed (rules dropped, held
connections reset) so that nothing hangs the session, and the test fails saying so.

``CKPT_FAULT_SEEDS=0,1,2,3`` runs more seeds (default 0,1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

import ckpt
from faultproxy import FaultProxy
from servers import SeaweedFS, point_aws_at
from support import dead_owner

BUCKET = "ckpt-faults"
ENGINES = ["tensorstore", "fsspec"]
SEEDS = [int(s) for s in os.environ.get("CKPT_FAULT_SEEDS", "0,1").split(",") if s.strip()]

# Keys on the wire (path-style: /<bucket>/<prefix>/<key>).
MANIFEST = r"/manifest\.msgpack$"
OWNER = r"/\.owner$"
LEASE = r"/\.jax-ckpt-saver$"
CHUNK = r"/c(/\d+)+$"  # zarr v3 chunk keys: <array>/c/<i>/<j>

# A save here: small arrays written shard by shard (no packing), in chunks of 16 KiB.
CHUNK_BYTES = 16 << 10
LIMIT_S = 90.0  # any one save or restore, faults included (past it: healed, and a failure)
# Wording of "the outcome of the manifest write is unknown" (issue 28, item 1): loose on purpose.
UNKNOWN = re.compile(r"(?i)unknown|not known|cannot (be )?(determined|determine|tell)|could not (be )?(determined|"
                     r"determine|tell)|may (or may not )?have (been )?(committed|written|landed)|might have")


# ---- the server, the proxy, and where the library is pointed ----------------------------------


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedFS(str(tmp_path_factory.mktemp("seaweedfs")))
    server.start()
    try:
        server.make_bucket(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def proxy(s3, tmp_path_factory):
    """The proxy in front of the server; the standard AWS variables point at the proxy, so
    every s3:// call of the library (both engines) goes through it."""
    patch = pytest.MonkeyPatch()
    _forget_s3fs_instances()
    try:
        with FaultProxy(s3.endpoint) as px:
            point_aws_at(patch, s3.env(), tmp_path_factory.mktemp("aws"), endpoint=px.endpoint)
            yield px
    finally:
        patch.undo()
        _forget_s3fs_instances()


def _forget_s3fs_instances() -> None:
    """fsspec caches file systems by their arguments (and thread): one made before the endpoint
    variables changed would still talk to another server."""
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def faults(proxy, request):
    """The proxy with no rules and its RNG seeded with the test's `seed` (0 if it has none);
    healed at the end whatever happened."""
    seed = getattr(request.node, "callspec", None) and request.node.callspec.params.get("seed", 0) or 0
    proxy.clear(seed=seed)
    yield proxy
    proxy.heal()
    proxy.clear()


@pytest.fixture
def root(s3):
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


def options(engine: str, **kw) -> ckpt.Options:
    """Through the proxy (the environment's endpoint)."""
    return ckpt.Options(**{"engine": engine, "pack_limit_bytes": 0, "max_chunk_bytes": CHUNK_BYTES, **kw})


def direct(s3: SeaweedFS, engine: str) -> ckpt.Options:
    """Straight to the server, not through the proxy."""
    so = {"endpoint": s3.endpoint} if engine == "tensorstore" else {"endpoint_url": s3.endpoint}
    return ckpt.Options(engine=engine, storage_options=so)


def key_of(path: str) -> str:
    return path.split(f"s3://{BUCKET}/", 1)[1].rstrip("/")


def listing(s3: SeaweedFS, path: str) -> list[str]:
    """Every object below `path` on the server (keys relative to it), listed directly."""
    client, prefix, out = s3.client(), key_of(path) + "/", []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out += [o["Key"][len(prefix):] for o in page.get("Contents", [])]
    return sorted(out)


# ---- trees and checks ---------------------------------------------------------------------------


def tree(k: int, rows: int = 64) -> dict:
    """float32 `rows` x 512 (8 chunks of 16 KiB at 64 rows), int8 32 x 256 (1 chunk), a small
    float32 vector, a Python int."""
    rng = np.random.default_rng(1000 + k)
    return {"w": rng.standard_normal((rows, 512)).astype(np.float32),
            "e": rng.integers(-128, 128, (32, 256), dtype=np.int8),
            "b": np.arange(k, k + 6, dtype=np.float32),
            "step": k}


def assert_tree(out: dict, k: int, rows: int = 64) -> None:
    want = tree(k, rows)
    assert sorted(out) == sorted(want), sorted(out)
    assert out["step"] == want["step"]
    for name in ("w", "e", "b"):
        got = np.asarray(out[name])
        assert got.dtype == want[name].dtype and got.shape == want[name].shape, name
        assert np.array_equal(got, want[name]), f"leaf {name!r} differs"


def restore_direct(s3, path: str, engine: str) -> dict:
    return ckpt.restore(path, options=direct(s3, engine))


def check_committed(s3, root: str, expected: dict[str, tuple], engine: str) -> None:
    """Every manifest on the server below `root` is one of `expected` (path -> (k, rows)) and
    restores, directly, to exactly that tree (a committed checkpoint that does not restore is
    the failure issue 28 is about)."""
    for key in listing(s3, root):
        if key.rsplit("/", 1)[-1] != "manifest.msgpack":
            continue
        path = f"{root}/{key[:-len('/manifest.msgpack')]}" if "/" in key else root
        assert path in expected, f"a committed checkpoint nobody should have committed: {path}"
        try:
            out = restore_direct(s3, path, engine)
        except Exception as e:  # noqa: BLE001 - reported as the failure it is
            pytest.fail(f"the committed checkpoint {path} does not restore: {type(e).__name__}: {e}")
        assert_tree(out, *expected[path])


def says_unknown(error: BaseException) -> bool:
    """Whether `error` says that the outcome (committed or not) is unknown."""
    return type(error).__name__ == "OutcomeUnknownError" or UNKNOWN.search(str(error)) is not None


@dataclass
class Outcome:
    value: Any
    error: BaseException | None
    seconds: float


def bounded(proxy: FaultProxy, limit_s: float, fn: Callable, *args, **kwargs) -> Outcome:
    """fn(*args, **kwargs) on a thread, at most `limit_s`: past it, the proxy is healed (rules
    dropped, black-holed connections reset) so that the call can end, and the test fails."""
    box: dict = {}

    def run():
        t = time.monotonic()
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
        box["seconds"] = time.monotonic() - t

    th = threading.Thread(target=run, name="bounded-call", daemon=True)
    th.start()
    th.join(limit_s)
    if th.is_alive():
        counts = proxy.counts()
        proxy.heal()
        th.join(120)
        after = "it is still running" if th.is_alive() else \
            f"after healing the proxy it ended in {box['seconds']:.0f} s with {box.get('error')!r}"
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not end within {limit_s:.0f} s under the faults "
                    f"({counts}); {after}")
    return Outcome(box.get("value"), box.get("error"), box["seconds"])


def save(path: str, k: int, engine: str, rows: int = 64, **kw) -> None:
    ckpt.save(path, tree(k, rows), options=options(engine, **kw))


def fired(proxy: FaultProxy, action: str) -> int:
    return proxy.count(action=action)


# ---- 1. a lost answer to the manifest PUT ---------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("action", ["reset_after", "error_after"], ids=["reset-after-forward", "500-after-forward"])
@pytest.mark.parametrize("engine", ENGINES)
def test_lost_answer_to_the_manifest_put(s3, faults, root, engine, action, seed):
    """The server stores the manifest; its answer is lost (the first time always, later
    attempts on the seed's draw). The save commits a checkpoint that restores bit-exact, or
    raises saying the outcome is unknown and leaves its data; never "another save committed
    first" with the data deleted under a committed manifest."""
    path = f"{root}/ck"
    faults.add(action, method="PUT", key=MANIFEST, count=1)
    faults.add(action, method="PUT", key=MANIFEST, p=0.5, count=2)
    out = bounded(faults, LIMIT_S, save, path, 1, engine)
    assert fired(faults, action) >= 1, faults.counts()
    keys = listing(s3, path)
    committed = "manifest.msgpack" in keys
    if out.error is None:
        assert committed, f"the save returned, but no manifest is on the server: {keys}"
    else:
        assert not isinstance(out.error, FileExistsError), \
            f"its own manifest taken for another save's (issue 28, item 1): {out.error!r}"
        assert says_unknown(out.error), f"the save raised without saying the outcome is unknown: {out.error!r}"
        assert any(k.startswith("gen-") for k in keys), f"an unknown outcome, and its data was removed: {keys}"
    check_committed(s3, root, {path: (1, 64)}, engine)


# ---- 2. a lost answer to the owner record's and the lease's PUT -------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_lost_answer_to_the_owner_record_put(s3, faults, root, engine, seed):
    """A save to an empty location whose owner-record PUT landed but whose answer was lost
    (reset after forwarding; on the seed's draw the retry's too) succeeds: its own record is not
    "already exists"."""
    path = f"{root}/ck"
    faults.add("reset_after", method="PUT", key=OWNER, count=1)
    faults.add("error_after", method="PUT", key=OWNER, p=0.5, count=1)
    out = bounded(faults, LIMIT_S, save, path, 2, engine)
    assert fired(faults, "reset_after") == 1, faults.counts()
    assert out.error is None, f"a save to an empty location failed on its own owner record: {out.error!r}"
    assert_tree(restore_direct(s3, path, engine), 2)
    check_committed(s3, root, {path: (2, 64)}, engine)


def _manager_saves(run: str, engine: str, steps: list[int]) -> None:
    manager = ckpt.CheckpointManager(run, async_save=False, options=options(engine))
    try:
        for step in steps:
            manager.save(step, tree(step))
    finally:
        manager.close()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_lost_answer_to_the_lease_put(s3, faults, root, engine, seed):
    """The only manager of a directory, its lease PUT stored but answered by a reset (or a 500
    on the seed's draw): it saves, rather than refusing itself as "another CheckpointManager
    (pid <its own pid>)"."""
    run = f"{root}/run"
    action = ["reset_after", "error_after"][seed % 2]
    faults.add(action, method="PUT", key=LEASE, count=1)
    out = bounded(faults, LIMIT_S, _manager_saves, run, engine, [1, 2])
    assert fired(faults, action) == 1, faults.counts()
    assert out.error is None, f"the only manager refused itself: {out.error!r}"
    for step in (1, 2):
        assert_tree(restore_direct(s3, f"{run}/step_{step:08d}", engine), step)
    check_committed(s3, root, {f"{run}/step_{s:08d}": (s, 64) for s in (1, 2)}, engine)


# ---- 3. two managers taking over a dead holder's lease at once --------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_racing_takeover_of_a_dead_lease_has_one_winner(s3, faults, root, engine, seed):
    """A lease left by a dead process (its pid gone, renewed an hour ago), written directly on
    the server; two managers (threads) save to the directory at once, each reading the stale
    lease (held back by the proxy so that both have read it before either replaces it). Exactly
    one saves; the other gets a CheckpointError naming the winner."""
    run = f"{root}/run"
    stale = {**json.loads(dead_owner()), "time": time.time() - 3600, "token": "0123456789abcdef"}
    s3.client().put_object(Bucket=BUCKET, Key=f"{key_of(run)}/.jax-ckpt-saver", Body=json.dumps(stale).encode())
    hold = random.Random(seed).uniform(0.5, 1.0)
    faults.add("delay", method="GET|HEAD", key=LEASE, count=4, delay_s=hold)
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]

    def one(i: int) -> None:
        manager = ckpt.CheckpointManager(run, async_save=False, options=options(engine))
        try:
            barrier.wait(30)
            manager.save(i + 1, tree(i + 1))
            results[i] = "saved"
        except BaseException as e:  # noqa: BLE001 - judged below
            results[i] = e
        finally:
            manager.close()

    def race() -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    out = bounded(faults, LIMIT_S, race)
    assert out.error is None, out.error
    assert fired(faults, "delay") >= 2, f"the two did not both read the stale lease: {faults.counts()}"
    winners = [i for i in (0, 1) if results[i] == "saved"]
    assert len(winners) == 1, f"both took over the lease and saved (issue 28, item 3): {results}" \
        if len(winners) == 2 else f"neither saved: {results}"
    (winner,) = winners
    error = results[1 - winner]
    assert isinstance(error, ckpt.CheckpointError), repr(error)
    assert "another CheckpointManager" in str(error) and f"pid {os.getpid()}" in str(error), str(error)
    keys = listing(s3, run)
    assert f"step_{winner + 1:08d}/manifest.msgpack" in keys, keys
    assert f"step_{2 - winner:08d}/manifest.msgpack" not in keys, keys
    check_committed(s3, root, {f"{run}/step_{winner + 1:08d}": (winner + 1, 64)}, engine)


# ---- 4. a black-hole server ------------------------------------------------------------------------


def _bound_option() -> str | None:
    """The Options field that bounds a storage operation's time (``request_timeout_s``, issue 28),
    or another one named for a timeout or deadline, if the library has one."""
    names = [f.name for f in dataclasses.fields(ckpt.Options)]
    if "request_timeout_s" in names:
        return "request_timeout_s"
    return next((n for n in names if re.search(r"timeout|deadline", n)), None)


# The bound set here: request_timeout_s. docs/storage.md ("Timeouts"): a save or restore against a
# server that never answers raises within twice it. Asserted with half as much again of slack
# (2 busy cores), and the call cut off (a failure) at 2.5x the documented bound.
REQUEST_TIMEOUT_S = 8
DOCUMENTED_BOUND_S = 2 * REQUEST_TIMEOUT_S
# The operation that got no answer, as the caller's (save, restore) or the storage request's name.
OPERATION = re.compile(r"(?i)\b(sav\w*|restor\w*|writ\w*|put\w*|commit\w*|stag\w*|list\w*|ls|get\w*|read\w*|"
                       r"exists?|stat\w*|delet\w*|creat\w*|head|open\w*|cat\w*|pipe\w*)\b")
TIMED_OUT = re.compile(r"(?i)time|no answer|deadline|within")


@pytest.mark.parametrize("engine", ENGINES)
def test_black_hole_server_fails_within_the_bound(s3, faults, root, engine):
    """Every request accepted, none answered: a save, and a restore of a committed checkpoint,
    each fail within the documented bound (2 x request_timeout_s, set to 8 s here), with an error
    naming the location and the operation."""
    field = _bound_option()
    assert field, f"ckpt.Options has no field bounding a request's time (issue 28, item 4); fields: " \
                  f"{[f.name for f in dataclasses.fields(ckpt.Options)]}"
    limit = 2.5 * DOCUMENTED_BOUND_S
    good = f"{root}/good"
    save(good, 3, engine)
    faults.add("blackhole")
    path = f"{root}/ck"
    out = bounded(faults, limit, save, path, 4, engine, **{field: REQUEST_TIMEOUT_S})
    assert out.error is not None, "a save against a black hole succeeded"
    msg = f"{out.error} {getattr(out.error, 'filename', '') or ''}"
    assert path in msg, f"the error does not name the location: {out.error!r}"
    assert OPERATION.search(msg) and TIMED_OUT.search(msg), f"the error does not name the operation: {out.error!r}"
    assert out.seconds < 1.5 * DOCUMENTED_BOUND_S, (out.seconds, repr(out.error))
    out = bounded(faults, limit, ckpt.restore, good, options=options(engine, **{field: REQUEST_TIMEOUT_S}))
    assert out.error is not None, "a restore from a black hole succeeded"
    msg = f"{out.error} {getattr(out.error, 'filename', '') or ''}"
    assert good in msg, f"the error does not name the location: {out.error!r}"
    assert OPERATION.search(msg) and TIMED_OUT.search(msg), f"the error does not name the operation: {out.error!r}"
    assert out.seconds < 1.5 * DOCUMENTED_BOUND_S, (out.seconds, repr(out.error))
    faults.heal()
    check_committed(s3, root, {good: (3, 64)}, engine)


# ---- 5. SlowDown on every chunk PUT ------------------------------------------------------------------

# Attempts per request each engine makes by default: TensorStore 1 + 6 retries (the library's
# s3_request_retries); s3fs up to 5 calls of botocore's up to 5 attempts each (issue 28: 1,600 PUTs
# for 64 chunks).
ATTEMPTS = {"tensorstore": 7, "fsspec": 25}
IN_FLIGHT = 4


@pytest.mark.parametrize("engine", ENGINES)
def test_slowdown_on_every_chunk_put_stops_the_save_early(s3, faults, root, engine):
    """66 chunks, every chunk PUT answered 503 SlowDown: the save fails, commits nothing, and
    stops issuing chunk writes once one has given up: the chunk PUTs the proxy saw stay within
    two rounds of the writes in flight (io_concurrency 4) x the attempts per write, and at most
    16 distinct chunks are tried, far below 66 x attempts; it fails within twice the default
    request_timeout_s."""
    path = f"{root}/ck"
    faults.add("error", method="PUT", key=CHUNK, status=503)
    # 128 rows x 512 float32 in chunks of 4 KiB: 64 chunks of "w" (and 2 of "e").
    # Fails fast: within twice the default bound of one storage operation (request_timeout_s,
    # 60 s), retries included: a save that went on after its first failed chunk took 33-320 s.
    fast = 2 * ckpt.Options().resolved().request_timeout_s if _bound_option() else 120.0
    out = bounded(faults, fast + 30, save, path, 5, engine, 128, max_chunk_bytes=4096, io_concurrency=IN_FLIGHT)
    puts = faults.count(method="PUT", key=CHUNK)
    recs = faults.records(method="PUT", key=CHUNK)
    t0 = recs[0].time if recs else 0.0
    per_key = {r.path: sum(1 for q in recs if q.path == r.path) for r in recs}
    shape = (f"{len(per_key)} chunks tried, up to {max(per_key.values(), default=0)} PUTs each, the last new "
             f"chunk {max((min(q.time for q in recs if q.path == k) - t0 for k in per_key), default=0):.1f} s "
             f"after the first PUT")
    print(f"{engine}: {puts} chunk PUTs refused ({shape}), the save failed in {out.seconds:.1f} s: {out.error!r}")
    assert out.error is not None, "a save whose every chunk PUT was refused succeeded"
    assert "manifest.msgpack" not in listing(s3, path)
    # Two rounds of the writes in flight, each with all its attempts: the ones in flight when the
    # first gave up, and at most as many started before the save saw it. Far below 66 x attempts.
    bound = 2 * IN_FLIGHT * ATTEMPTS[engine]
    assert puts <= bound, f"{puts} chunk PUTs (bound {bound}: the save went on after a chunk gave up; {shape}), " \
                          f"{out.seconds:.0f} s; {out.error!r}"
    assert len(per_key) <= 4 * IN_FLIGHT, f"{len(per_key)} of 66 chunks tried (bound {4 * IN_FLIGHT}): the save " \
                                          f"went on after a chunk gave up; {shape}"
    assert out.seconds < fast, f"{out.seconds:.0f} s to fail ({puts} chunk PUTs)"
    check_committed(s3, root, {}, engine)


# ---- 6. a failed manifest write whose outcome is known --------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_refused_manifest_write_removes_its_generation(s3, faults, root, engine):
    """Every manifest PUT answered 503 before it reaches the server (the outcome known: not
    written): the save raises and its generation is removed: nothing is left below the path
    (nothing for `ckpt ls` to show as an uncommitted leftover)."""
    path = f"{root}/ck"
    faults.add("error", method="PUT", key=MANIFEST, status=503)
    out = bounded(faults, LIMIT_S, save, path, 6, engine)
    assert fired(faults, "error") >= 1, faults.counts()
    assert out.error is not None, "the save succeeded without its manifest"
    faults.heal()
    assert listing(s3, path) == [], f"the failed save left (issue 28, item 6): {listing(s3, path)}"
    check_committed(s3, root, {}, engine)


# ---- 7. a chunk PUT body altered in transit ----------------------------------------------------------


def _documented_checksum_limit(engine: str) -> str | None:
    """The sentence of docs/storage.md saying that `engine` cannot send a content checksum."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        with open(os.path.join(here, "..", "docs", "storage.md")) as f:
            text = f.read()
    except OSError:
        return None
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        flat = " ".join(sentence.split())
        if re.search(engine, flat, re.IGNORECASE) and re.search(r"(?i)checksum|content-md5|crc", flat) \
                and re.search(r"(?i)cannot|can't|does not|doesn't|no way|not sen[dt]|unable", flat) \
                and re.search(r"(?i)transit|upload|in flight|on the wire|altered|corrupt", flat):
            return flat
    return None


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_chunk_body_altered_in_transit(s3, faults, root, engine, seed):
    """One bit of one chunk PUT's body flipped on the way (which chunk: the seed's). The save
    fails (and commits nothing), or the server rejected the altered body (a content checksum)
    and the retry landed: never a committed checkpoint that fails its checksum on restore."""
    path = f"{root}/ck"
    faults.add("flip", method="PUT", key=CHUNK, after=seed * 3, count=1)
    out = bounded(faults, LIMIT_S, save, path, 7, engine)
    assert fired(faults, "flip") == 1, faults.counts()
    committed = "manifest.msgpack" in listing(s3, path)
    if out.error is not None:
        assert not committed or says_unknown(out.error), f"raised, yet committed: {out.error!r}"
    else:
        assert committed
    if committed:
        try:
            assert_tree(restore_direct(s3, path, engine), 7)
        except ckpt.CheckpointError as e:
            limit = _documented_checksum_limit(engine)
            if limit is not None:
                pytest.xfail(f"the {engine} engine sends no content checksum (docs/storage.md: {limit!r}); "
                             f"the altered chunk was committed: {e}")
            raise AssertionError(f"a committed checkpoint fails on restore after a chunk was altered in transit "
                                 f"(issue 28, item 7): {e}") from None
    check_committed(s3, root, {path: (7, 64)} if committed else {}, engine)


# ---- what must keep passing ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_transient_faults_on_restore_gets(s3, faults, root, engine, seed):
    """503 SlowDown, 429, resets before forwarding and truncated answers on the chunk GETs (and a
    503 on the manifest's) of a restore, each a few times: the restore retries and every leaf is
    bit-exact."""
    path = f"{root}/ck"
    save(path, 8, engine)
    faults.clear(seed=seed)
    faults.add("error", method="GET", key=CHUNK, status=503, count=1)
    faults.add("error", method="GET", key=MANIFEST, status=503, count=1)
    faults.add("error", method="GET", key=CHUNK, status=429, p=0.3, count=2)
    faults.add("reset", method="GET", key=CHUNK, p=0.3, count=2)
    faults.add("truncate", method="GET", key=CHUNK, p=0.2, count=1)
    faults.add("error", method="GET", key=CHUNK, status=503, p=0.2, count=2)
    out = bounded(faults, LIMIT_S, ckpt.restore, path, options=options(engine))
    assert fired(faults, "error") >= 1, faults.counts()
    assert out.error is None, f"{out.error!r} ({faults.counts()})"
    assert_tree(out.value, 8)
    check_committed(s3, root, {path: (8, 64)}, engine)


@pytest.mark.parametrize("seed", SEEDS[:1])
@pytest.mark.parametrize("engine", ENGINES)
def test_slow_server(s3, faults, root, engine, seed):
    """Some requests held 2-3 s before they reach the server (the seed's choice): a save and a
    restore through it work, every leaf bit-exact."""
    path = f"{root}/ck"
    delay = random.Random(seed).uniform(2.0, 3.0)
    faults.add("delay", method="PUT", key=CHUNK, p=0.3, count=2, delay_s=delay)
    faults.add("delay", method="PUT", key=MANIFEST, count=1, delay_s=delay)
    faults.add("delay", method="GET", p=0.3, count=2, delay_s=delay)
    out = bounded(faults, LIMIT_S, save, path, 9, engine)
    assert out.error is None, repr(out.error)
    out = bounded(faults, LIMIT_S, ckpt.restore, path, options=options(engine))
    assert out.error is None, repr(out.error)
    assert fired(faults, "delay") >= 1, faults.counts()
    assert_tree(out.value, 9)
    check_committed(s3, root, {path: (9, 64)}, engine)


# ---- the proxy itself (no S3 server) ---------------------------------------------------------------


class _Store(__import__("http.server").server.BaseHTTPRequestHandler):
    """A plain HTTP/1.1 key-value server (PUT stores, GET/HEAD read), keep-alive, chunked
    uploads understood: what the proxy is checked against."""

    protocol_version = "HTTP/1.1"
    store: dict = {}

    def do_PUT(self):
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            data = b""
            while (n := int(self.rfile.readline().split(b";")[0], 16)) != 0:
                data += self.rfile.read(n)
                self.rfile.readline()
            self.rfile.readline()
        else:
            data = self.rfile.read(int(self.headers["Content-Length"]))
        self.store[self.path] = data
        self._reply(200, b"")

    def do_GET(self):
        data = self.store.get(self.path)
        self._reply(404 if data is None else 200, data or b"")

    def do_HEAD(self):
        self._reply(200, b"", length=len(self.store.get(self.path, b"")))

    def _reply(self, status, body, length=None):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_proxy_itself():
    """Each action against a plain HTTP server, on kept-alive connections: what reaches the
    server, what the client sees, and the counts; chunked and 100-continue uploads relayed."""
    import http.client
    import http.server
    import socket

    from faultproxy import ProxyError

    with pytest.raises(ProxyError):
        FaultProxy("http://192.0.2.1:80")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store = _Store.store
    store.clear()
    data = bytes(range(256)) * 100

    def call(conn, method, path, body=None, **kw):
        conn.request(method, path, body=body, **kw)
        r = conn.getresponse()
        return r.status, r.read()

    lost = (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError)
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_port}", seed=1) as px:
            c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=5)
            assert call(c, "PUT", "/b/k1", data)[0] == 200 and call(c, "GET", "/b/k1") == (200, data)
            assert call(c, "HEAD", "/b/k1") == (200, b"")
            call(c, "PUT", "/b/k2", iter([b"abc", b"defg"]), encode_chunked=True)
            assert store["/b/k2"] == b"abcdefg"
            c.putrequest("PUT", "/b/k3")
            c.putheader("Content-Length", "3")
            c.putheader("Expect", "100-continue")
            c.endheaders()
            c.send(b"xyz")
            assert c.getresponse().read() == b"" and store["/b/k3"] == b"xyz"
            px.add("error", method="GET", key=r"k1$", count=1, status=503)
            status, body = call(c, "GET", "/b/k1")
            assert status == 503 and b"<Code>SlowDown</Code>" in body
            assert call(c, "GET", "/b/k1") == (200, data)  # count spent; the connection kept
            px.add("error", method="HEAD", count=1, status=429)
            assert call(c, "HEAD", "/b/k1")[0] == 429
            px.add("reset_after", method="PUT", key=r"k4$", count=1)
            with pytest.raises(lost):
                call(c, "PUT", "/b/k4", b"v4")
            assert store["/b/k4"] == b"v4"  # stored; the answer lost
            c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=5)
            px.add("reset", method="PUT", key=r"k5$", count=1)
            with pytest.raises(lost):
                call(c, "PUT", "/b/k5", b"v5")
            assert "/b/k5" not in store
            c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=5)
            px.add("error_after", method="PUT", key=r"k6$", count=1)
            assert call(c, "PUT", "/b/k6", b"v6")[0] == 500 and store["/b/k6"] == b"v6"
            px.add("truncate", method="GET", key=r"k1$", count=1)
            with pytest.raises((http.client.IncompleteRead, *lost)):
                call(c, "GET", "/b/k1")
            c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=5)
            px.add("flip", method="PUT", key=r"k7$", count=1)
            call(c, "PUT", "/b/k7", data)
            diff = [i for i in range(len(data)) if data[i] != store["/b/k7"][i]]
            assert len(diff) == 1 and bin(data[diff[0]] ^ store["/b/k7"][diff[0]]).count("1") == 1, diff
            px.add("delay", method="GET", key=r"k7$", count=1, delay_s=0.5)
            t = time.monotonic()
            call(c, "GET", "/b/k7")
            assert time.monotonic() - t >= 0.5
            px.add("blackhole", method="GET", key=r"k1$", count=1)
            held = http.client.HTTPConnection("127.0.0.1", px.port, timeout=1)
            with pytest.raises(socket.timeout):
                call(held, "GET", "/b/k1")
            held = http.client.HTTPConnection("127.0.0.1", px.port, timeout=5)
            px.add("blackhole", method="GET", key=r"k2$", count=1)
            threading.Timer(0.5, px.heal).start()
            with pytest.raises(lost):
                call(held, "GET", "/b/k2")  # held until heal() resets it
            counts = px.counts()
            for action in ("error", "reset", "reset_after", "error_after", "truncate", "flip", "delay", "blackhole"):
                assert sum(n for (_, a), n in counts.items() if a == action) >= 1, (action, counts)
            assert counts[("PUT", "forward")] == 3 and px.count(method="PUT") == 7, counts
            # the same seed, the same draws
            draws = []
            for _ in range(2):
                px.clear(seed=5)
                px.add("error", method="GET", key=r"k2$", p=0.5, status=500)
                c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=5)
                draws.append([call(c, "GET", "/b/k2")[0] for _ in range(16)])
            assert draws[0] == draws[1] and set(draws[0]) == {200, 500}, draws
    finally:
        server.shutdown()
