"""Runs hostile checkpoints through every read path, in a process of its own, under guard.

    python worker.py [--long] [--shard K/N] [--examples E] [--seconds S] --out RESULT.json

Runs the hostile cases (``hostile.py``; shard K of N takes every N-th) and then E examples of
the hypothesis fuzz (seeded by the shard), so that N workers share the work.

The guards: an address-space limit (RLIMIT_AS: what the process holds once warmed up plus
2 GiB, so any allocation far beyond a checkpoint's size fails), tracemalloc bounding what each
case allocates, an alarm per case (a hang is a failure, not a stuck test), an audit hook and
inotify watching every open and read of the files and directories outside the checkpoint that
hostile links point to (a read there is a failure, whichever library makes it). Every read
path runs on each case: metadata, restore (verified, unverified, onto a mesh, through the other
engines), a CheckpointManager opened on the directory, and every CLI command. Each may only
succeed or raise CheckpointError / OSError (CLI: exit status 0, 1 or 2, errors in one line);
for damage that was not re-sealed, a success must return the pristine values.

The result (counts and failures) is written as JSON to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import math
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import tracemalloc
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import msgpack  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ckpt  # noqa: E402
from ckpt.cli._main import COMMANDS, main as cli_main

import hostile  # noqa: E402

CASE_TIMEOUT_S = int(os.environ.get("CKPT_ADVERSARIAL_TIMEOUT", 30))
# Read paths to leave out (comma-separated names), e.g. to measure an older jax-ckpt whose
# TensorStore engine aborts the whole process on a hostile checkpoint.
SKIP = set(filter(None, os.environ.get("CKPT_ADVERSARIAL_SKIP", "").split(",")))
SAMPLE = 40  # short runs: every read path on one in SAMPLE refused manifests (run_case)
ALLOC_LIMIT = 64 << 20  # traced allocation per case; the pristine checkpoint is ~2.3 MiB
EXTRA_ADDRESS_SPACE = 2 << 30
ALLOWED = (ckpt.CheckpointError, OSError)


class Hang(BaseException):
    """Raised by the per-case alarm (BaseException: no library code may swallow it)."""


# ---- the pristine checkpoint -------------------------------------------------------------------


def pristine_tree(mesh: Mesh) -> dict:
    from typing import NamedTuple

    class Point(NamedTuple):
        x: object
        y: object

    def put(a, *spec):
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))

    return {
        "w": put(np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512) / 7, "data", "model"),  # 8 chunks
        "emb": put((np.arange(64 * 64) % 61).astype(ml_dtypes.bfloat16).reshape(64, 64), None, "model"),
        "q": put(((np.arange(64 * 80) % 16) - 8).astype(ml_dtypes.int4).reshape(64, 80), "data"),
        "key": jax.random.key(3),
        "keys": jax.random.split(jax.random.key(4, impl="rbg"), 8),
        "scalar": np.float32(1.5),
        "small": np.arange(8, dtype=np.int8),
        "mask": put(np.eye(8, dtype=bool)),
        "opt": (jnp.int32(5), [np.float32(0.25), None]),
        "point": Point(np.arange(4.0), "tag"),
        "ints": {7: 1, 3: np.float64(2.5)},
        "step": 7, "big": 2**70, "lr": 0.125, "flag": True, "z": 1 + 2j, "name": "pristine", "blob": b"\x00\x01",
    }


def same(a, b) -> bool:
    """Equal values and structure (bytes of arrays, NaN equal to NaN)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (np.ndarray, np.generic)) or hasattr(a, "addressable_shards"):
        if jax.dtypes.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.prng_key):
            a = jax.random.key_data(a)
            if not jax.dtypes.issubdtype(getattr(b, "dtype", np.float32), jax.dtypes.prng_key):
                return False
            b = jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


# ---- guards ------------------------------------------------------------------------------------


class Watch:
    """Opens and reads of anything below `outside` (inotify: whoever makes them, C++ included)
    and, through the audit hook, Python-level opens of those files or of devices."""

    IN_ACCESS, IN_OPEN = 0x1, 0x20

    def __init__(self, outside: str):
        self.outside = os.path.realpath(outside)
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.recording = False
        self.audit: list[str] = []
        sys.addaudithook(self._hook)

    def watch_tree(self) -> None:
        for d, _, _ in os.walk(self.outside):
            self.libc.inotify_add_watch(self.fd, os.fsencode(d), self.IN_ACCESS | self.IN_OPEN)

    def drain(self) -> list[str]:
        events = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return events
            pos = 0
            while pos < len(data):
                wd, mask, _, length = struct.unpack_from("iIII", data, pos)
                name = data[pos + 16:pos + 16 + length].rstrip(b"\0").decode(errors="replace")
                events.append(f"wd{wd}:{'open' if mask & self.IN_OPEN else 'read'}:{name}")
                pos += 16 + length

    def _hook(self, event: str, args) -> None:
        if not self.recording or event not in ("open", "os.listdir", "os.scandir"):
            return
        path = args[0] if args else None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str) or not os.path.isabs(path):
            return  # relative to a directory descriptor: the library's confined walk
        real = os.path.realpath(path)
        if real.startswith(self.outside + "/") or real == self.outside:
            self.audit.append(f"{event} {path} -> {real}")
        elif real.startswith("/dev/") and real not in ("/dev/null", "/dev/urandom") and event == "open" \
                and not (isinstance(args[2], int) and args[2] & os.O_DIRECTORY):
            # (an open with O_DIRECTORY fails before any device is opened)
            self.audit.append(f"{event} {path} -> {real}")


def limit_address_space() -> int:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    limit = vm + EXTRA_ADDRESS_SPACE
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit


def _untrack_failed_numpy_allocation() -> int:
    """numpy tells tracemalloc about an allocation even when malloc failed (address 0), so a
    refused allocation (a MemoryError, under the address-space limit) would count as made. Drop
    that record; return its size."""
    before = tracemalloc.get_traced_memory()[0]
    ctypes.pythonapi.PyTraceMalloc_Untrack(ctypes.c_uint(389047), ctypes.c_size_t(0))  # numpy's domain
    return before - tracemalloc.get_traced_memory()[0]


def _alarm(signum, frame):
    raise Hang(f"no answer within {CASE_TIMEOUT_S} s")


# ---- one case ----------------------------------------------------------------------------------


class Runner:
    def __init__(self, work: str, long: bool):
        self.work, self.long = work, long
        self.mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        self.pristine = os.path.join(work, "pristine")
        ckpt.save(self.pristine, pristine_tree(self.mesh))
        with open(os.path.join(self.pristine, "manifest.msgpack"), "rb") as f:
            self.doc = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
        self.outside = os.path.join(work, "outside")
        os.makedirs(self.outside)
        self.cases_dir = os.path.join(work, "cases")
        os.makedirs(self.cases_dir)
        self.executions = 0
        self.cases = 0
        self.refused = False
        self.op_seconds: dict[str, float] = {}
        self.failures: list[dict] = []
        self.sites: set[str] = set()
        self.expected = self._warm_up()
        self.watch = Watch(self.outside)

    def _warm_up(self):
        """Every path once on the pristine checkpoint (lazy imports, caches), and its values."""
        run = os.path.join(self.work, "warm", "run")
        shutil.copytree(self.pristine, os.path.join(run, "step_00000001"))
        path = os.path.join(run, "step_00000001")
        for name, op in self.ops(path, run, file_case=True):
            result = op()
            if name.startswith("cli ") and result[0] not in (0,):
                raise RuntimeError(f"pristine checkpoint fails {name}: {result}")
        return ckpt.restore(self.pristine)

    def ops(self, path: str, run: str, *, file_case: bool):
        """Every read path, metadata first (it reads only the manifest: see run_case)."""
        opts = ckpt.Options(io_concurrency=4)
        full = self.long or not file_case  # file cases in short runs: the paths that read other files
        yield "metadata", lambda: ckpt.metadata(path)
        yield "restore", lambda: ckpt.restore(path, options=opts)
        yield "restore verify=False", lambda: ckpt.restore(path, verify=False, options=opts)
        if full:
            yield "restore mesh", lambda: ckpt.restore(path, mesh=self.mesh, options=opts)
            # Onto the pristine checkpoint's own values as the target (its structure, its dtypes).
            yield "restore target", lambda: ckpt.restore(path, getattr(self, "expected", None), options=opts)

        def manager():
            m = ckpt.CheckpointManager(run, options=opts)
            m.all_steps()
            m.latest_step()
            try:
                return m.restore()
            finally:
                m.metadata()

        yield "manager", manager
        if file_case or self.long:
            for engine in ("tensorstore", "fsspec"):
                yield f"restore engine={engine}", lambda e=engine: ckpt.restore(path, options=ckpt.Options(engine=e))
        out = os.path.join(self.work, "export")
        commands = [["ls", run], ["inspect", path], ["inspect", path, "--json"], ["verify", path, "--no-progress"],
                    ["diff", self.pristine, path], ["plan", path, "--mesh", "data=2,model=4"], ["du", path],
                    ["export", path, out, "--overwrite", "--no-progress", "--rename", "^q$="], ["clean", run, "--dry-run"]]
        commands = [c for c in commands if c[0] in COMMANDS]  # (an older jax-ckpt, when measuring one)
        if not full:
            commands = [c for c in commands if c[0] in ("ls", "verify", "diff", "export", "clean")]
        for argv in commands:
            yield "cli " + argv[0] + (" --json" if "--json" in argv else ""), lambda a=argv: self.cli(a)

    def cli(self, argv: list[str]) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli_main([str(a) for a in argv])
            except SystemExit as e:  # argparse --help and the like
                rc = e.code if isinstance(e.code, int) else 2
        return rc, out.getvalue(), err.getvalue()

    def run_case(self, case, kind: str, checkpoint_writer, *, gate: bool = False) -> None:
        """`checkpoint_writer(case_dir) -> path` writes the case; then every read path runs.

        With `gate` (damage only the manifest can hold) in a short run, a case whose manifest
        is refused (metadata raises) stops there, but for one case in SAMPLE: every read path
        reads the manifest first through the same validation, so the others would refuse it
        the same way; the sample checks that they do. What validation accepts runs everywhere."""
        self.cases += 1
        case_dir = tempfile.mkdtemp(dir=self.cases_dir)
        run = os.path.join(case_dir, "run")
        try:
            path = checkpoint_writer(case_dir)
            self.watch.watch_tree()
            self.watch.drain()
            self.watch.audit.clear()
            must_match = kind in ("flip", "file")
            for name, op in self.ops(path, run, file_case=kind == "file"):
                if name in SKIP:
                    continue
                if name != "metadata" and gate and not self.long and self.refused and self.cases % SAMPLE:
                    break
                self.executions += 1
                if os.environ.get("CKPT_ADVERSARIAL_TRACE"):
                    print(f"{kind}:{case.name} {name}", file=sys.stderr, flush=True)
                self._one(case, kind, name, op, must_match)
        finally:
            self.watch.recording = False
            shutil.rmtree(case_dir, ignore_errors=True)

    def _one(self, case, kind: str, name: str, op, must_match: bool) -> None:
        problem = None
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        self.watch.recording = True
        # Repeating: a hang in a pool thread would also hold the pool's shutdown; every few
        # seconds a new Hang interrupts the main thread until it gets out.
        signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S, 2.0)
        result, raised = None, False
        self.refused = False
        started = time.perf_counter()
        try:
            result = op()
        except ALLOWED:
            raised = self.refused = True
        except Hang as e:
            problem = f"hang: {e}"
        except BaseException as e:  # noqa: BLE001 - the point: anything else is a finding
            tb = traceback.extract_tb(e.__traceback__)
            site = next((f"{os.path.relpath(f.filename, os.path.dirname(os.path.dirname(ckpt.__file__)))}:"
                         f"{f.lineno} {f.name}" for f in reversed(tb) if "/ckpt/" in f.filename), "outside ckpt")
            self.sites.add(f"{type(e).__name__} at {site}")
            problem = f"{type(e).__name__}: {str(e)[:300]} (at {site})"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.watch.recording = False
            self.op_seconds[name] = self.op_seconds.get(name, 0.0) + time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1] - base - _untrack_failed_numpy_allocation()
        if problem is None and peak > ALLOC_LIMIT:
            problem = f"allocated {peak} bytes"
        outside = self.watch.drain() + self.watch.audit
        self.watch.audit.clear()
        if problem is None and outside:
            problem = f"read outside the checkpoint: {outside[:5]}"
        if problem is None and name.startswith("cli ") and result is not None:
            rc, out, err = result
            if rc not in (0, 1, 2):
                problem = f"exit status {rc}"
            elif "Traceback" in err or (rc == 2 and len(err.strip().splitlines()) != 1):
                problem = f"error output is not one line: {err[:300]!r}"
            elif name == "cli verify" and kind == "flip" and rc == 0:
                problem = "verify called a damaged checkpoint intact"
        if problem is None and must_match and result is not None and name == "restore":
            if not same(self.expected, result):
                problem = "returned values that differ from the pristine checkpoint's"
        if problem is None and not raised and kind == "flip" and name == "metadata" and case.args[0] == "manifest":
            problem = "a flipped manifest byte was not detected"
        if problem is not None:
            self.failures.append({"case": f"{kind}:{case.name}", "op": name, "problem": problem})


# ---- modes -------------------------------------------------------------------------------------


def manifest_flips(r: Runner) -> dict:
    """Every byte of the pristine manifest with one bit flipped (short: 3 of the 8 bits), through
    the decoder every read path uses: each must be refused (CheckpointError), never decode."""
    from ckpt._format.validate import decode_manifest

    with open(os.path.join(r.pristine, "manifest.msgpack"), "rb") as f:
        data = f.read()
    bits = range(8) if r.long else (0, 5, 7)
    for i in range(len(data)):
        for bit in bits:
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            r.executions += 1
            try:
                decode_manifest(bytes(flipped), "manifest.msgpack")
            except ckpt.CheckpointError:
                continue
            except BaseException as e:  # noqa: BLE001
                r.failures.append({"case": f"bitflip:manifest@{i}.{bit}", "op": "decode",
                                   "problem": f"{type(e).__name__}: {e}"[:300]})
                continue
            r.failures.append({"case": f"bitflip:manifest@{i}.{bit}", "op": "decode", "problem": "not detected"})
    return {"bitflips": len(data) * len(bits)}


def hostile_mode(r: Runner) -> dict:
    cases = hostile.field_cases(r.doc, short=not r.long)
    cases += hostile.file_cases()
    sizes = {role: hostile.file_size(p) for role, p in hostile.roles(r.pristine, r.doc).items() if role in
             ("manifest", "array_json", "group_json", "chunk")}
    cases += hostile.flip_cases(sizes, short=not r.long)
    cases = cases[r.shard::r.shards]
    if os.environ.get("CKPT_ADVERSARIAL_ONLY"):
        cases = [c for c in cases if os.environ["CKPT_ADVERSARIAL_ONLY"] in f"{c.family}:{c.name}"]
    counts: dict[str, int] = {}
    for case in cases:
        counts[case.family] = counts.get(case.family, 0) + 1
        gate = case.family == "field" or (case.family == "flip" and case.args[0] == "manifest")
        r.run_case(case, case.family, lambda d, c=case: hostile.apply(c, r.pristine, d, r.outside, r.doc), gate=gate)
    if r.shard == 0:
        counts.update(manifest_flips(r))
    return {"cases": len(cases), "by_family": counts}


def fuzz_mode(r: Runner, examples: int, seconds: float | None) -> dict:
    from hypothesis import HealthCheck, given, seed, settings, strategies as st

    paths = hostile._paths(r.doc)
    paths = [p for p in paths if p[-1] != "manifest_crc32c"]
    scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
               | st.text(max_size=12) | st.binary(max_size=12) | st.sampled_from(["..", "/", "a//b", "leaf", "dict",
                                                                                  "zarr", "inline", "float32", "gen-0"]))
    values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4)
                          | st.dictionaries(st.text(max_size=6) | st.integers(-3, 3), ch, max_size=4), max_leaves=10)
    edit = st.tuples(st.sampled_from(paths), st.sampled_from(["replace", "delete", "copy"]), values,
                     st.sampled_from(paths))
    deadline = None if seconds is None else time.monotonic() + seconds
    state = {"examples": 0}

    def write_edits(case_dir, edits, reseal, raw_flips):
        doc = msgpack.unpackb(msgpack.packb(r.doc, use_bin_type=True), raw=False, strict_map_key=False)
        for path, how, value, other in edits:
            try:
                parent = doc
                for k in path[:-1]:
                    parent = parent[k]
                if how == "delete":
                    del parent[path[-1]]
                elif how == "copy":  # another field's value here (types that pass a first glance)
                    src = doc
                    for k in other:
                        src = src[k]
                    parent[path[-1]] = msgpack.unpackb(msgpack.packb(src, use_bin_type=True), raw=False,
                                                       strict_map_key=False)
                else:
                    parent[path[-1]] = value
            except (KeyError, IndexError, TypeError):
                continue  # an earlier edit removed the way there
        data = hostile.pack_sealed(doc) if reseal else msgpack.packb(doc, use_bin_type=True)
        data = bytearray(data)
        for pos, bit in raw_flips:
            data[pos % len(data)] ^= 1 << bit
        run = os.path.join(case_dir, "run")
        target = os.path.join(run, "step_00000001")
        shutil.copytree(r.pristine, target, copy_function=os.link)
        hostile._write(os.path.join(target, "manifest.msgpack"), bytes(data))  # replaced, not written into
        return target

    @seed(20261123 + r.shard)  # reproducible; each shard explores its own examples
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(edits=st.lists(edit, min_size=1, max_size=3), reseal=st.booleans() | st.just(True),
           raw_flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)), max_size=2))
    def fuzz(edits, reseal, raw_flips):
        if deadline is not None and time.monotonic() > deadline:
            return
        state["examples"] += 1
        case = hostile.Case("fuzz", f"#{state['examples']}", (edits, reseal, raw_flips))
        r.run_case(case, "fuzz" if reseal and not raw_flips else "fuzz-raw",
                   lambda d: write_edits(d, edits, reseal, raw_flips), gate=True)

    fuzz()

    # The decoder alone, on bytes: random ones, and the real manifest cut, spliced and flipped.
    from ckpt._format.validate import decode_manifest

    with open(os.path.join(r.pristine, "manifest.msgpack"), "rb") as f:
        real = f.read()
    decoded = {"examples": 0}

    @seed(20261124 + r.shard)
    @settings(max_examples=examples * 10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=256) | st.tuples(st.integers(0, len(real)), st.integers(0, len(real)), st.binary(max_size=8))
           .map(lambda t: real[:min(t[:2])] + t[2] + real[max(t[:2]):]))
    def decode(data):
        decoded["examples"] += 1
        r.executions += 1
        try:
            decode_manifest(data, "manifest.msgpack")
        except ckpt.CheckpointError:
            pass
        except BaseException as e:  # noqa: BLE001
            r.failures.append({"case": f"decode:{data[:40]!r}", "op": "decode", "problem": f"{type(e).__name__}: {e}"[:300]})

    decode()
    return {"examples": state["examples"], "decode_examples": decoded["examples"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--long", action="store_true")
    p.add_argument("--shard", default="0/1")
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--seconds", type=float)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ckpt-adversarial-") as work:
        runner = Runner(work, args.long)
        runner.shard, runner.shards = map(int, args.shard.split("/"))
        signal.signal(signal.SIGALRM, _alarm)
        limit = limit_address_space()
        tracemalloc.start()
        summary = hostile_mode(runner)
        hostile_executions = runner.executions
        summary.update(fuzz_mode(runner, args.examples, args.seconds))
        tracemalloc.stop()
        summary.update(shard=args.shard, hostile_executions=hostile_executions,
                       fuzz_executions=runner.executions - hostile_executions,
                       executions=runner.executions, failures=runner.failures,
                       crash_sites=sorted(runner.sites), address_space_limit=limit,
                       op_seconds={k: round(v, 2) for k, v in runner.op_seconds.items()},
                       seconds=round(time.monotonic() - started, 1))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
