"""Hostile version-3 checkpoints (``hostile_packed.py``) through every read path, under the
guards of ``worker.py`` (address-space limit, tracemalloc, an alarm per case, reads outside the
checkpoint watched), plus, for each case:

* peak RSS of every operation (VmHWM, reset before each through /proc/self/clear_refs) within
  the host budget (CKPT_HOST_BUDGET_BYTES, set by the test) + ALLOWANCE;
* ``ckpt verify`` and ``formats/reference_reader.py`` agree (both accept or both refuse);
* every process's restore route (``PackedChunks`` as process p, every chunk read and checked
  against its CRC-32C): if one refuses, verify refuses too;
* for damage the manifest does not seal, a restore that succeeds returns the pristine values.

    python worker_packed.py --pristine DIR --processes N [--long] [--shard K/M] [--examples E] --out R.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "formats"))

import crc32c  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import ckpt  # noqa: E402
import fuzz_packed  # noqa: E402
import hostile_packed  # noqa: E402
import reference_reader  # noqa: E402
import worker  # noqa: E402

ALLOWANCE = 384 << 20  # beyond the host budget: the interpreter's arenas, JAX's own, a few chunks
ALWAYS = ("metadata", "restore", "cli verify")
# What one operation may allocate (tracemalloc), as RSS: a manifest of 64 MiB of real bytes (a
# mesh table of 16 M devices, refused) is decoded before it is refused.
worker.ALLOC_LIMIT = int(os.environ["CKPT_HOST_BUDGET_BYTES"]) + ALLOWANCE
# The reference reader's CRC-32C is a pure-Python loop (~1 MB/s): the C one computes the same
# function, so that a manifest of many MiB is checked within the per-case alarm.
reference_reader.crc32c = lambda data, crc=0: crc32c.crc32c(bytes(data), crc)


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)


def route_refusal(path: str, process: int) -> str | None:
    """Why process `process`'s restore (its lookup route, every chunk read and checked) refuses
    the checkpoint, or None when it reads everything."""
    from ckpt._format.validate import read_manifest
    from ckpt._geometry import chunk_box, chunk_grid
    from ckpt._layout import PackedChunks
    try:
        from ckpt._restore.plan import check_plan_size, plan_budget
    except ImportError:  # a jax-ckpt from before issue 36 (to measure it): a fixed bound instead
        def plan_budget(_):
            return 256 << 20

        def check_plan_size(n, budget, what):
            if n * 1024 > budget:
                raise ckpt.CheckpointError(f"{what}: {n} chunks")
    from ckpt.storage import open_storage

    try:
        storage = open_storage(path, ckpt.Options().resolved())
        manifest = read_manifest(storage)
        chunks = PackedChunks(storage, manifest, process)
        arrays = [(l.zarr, l.shape) for l in manifest.leaves if l.zarr is not None]
        arrays += [(s.zarr, s.shape) for s in manifest.stacks]
        # (as a restore does: no more chunks than the host budget can plan)
        check_plan_size(sum(math.prod(chunk_grid(shape, st.chunk_shape)) for st, shape in arrays),
                        plan_budget(None), path)
        for st, shape in arrays:
            dtype = np.dtype(st.data_type).newbyteorder("<")
            nbytes = int(np.prod(st.chunk_shape)) * dtype.itemsize
            for index in np.ndindex(*chunk_grid(shape, st.chunk_shape)):
                raw = chunks.read_chunk(st.path, index, nbytes)
                box = chunk_box(index, st.chunk_shape, shape)
                part = raw.view(dtype).reshape(st.chunk_shape)[tuple(slice(0, b - a) for a, b in box)]
                if crc32c.crc32c(np.ascontiguousarray(part).reshape(-1).view(np.uint8)) != chunks.chunk_check(
                        st.path, index)[0]:
                    return f"chunk {list(index)} of {st.path}: CRC-32C mismatch"
    except (ckpt.CheckpointError, OSError) as e:
        return str(e)[:200]
    return None


class PackedRunner(worker.Runner):
    """worker.Runner on a given pristine packed checkpoint, with the checks above added."""

    def __init__(self, work: str, pristine: str, processes: int, long: bool):
        self.work, self.long, self.processes = work, long, processes
        self.mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
        self.pristine = os.path.join(work, "pristine")
        shutil.copytree(pristine, self.pristine)
        self.doc = hostile_packed.Packed(self.pristine).doc
        self.outside = os.path.join(work, "outside")
        os.makedirs(self.outside)
        self.cases_dir = os.path.join(work, "cases")
        os.makedirs(self.cases_dir)
        self.executions = self.cases = 0
        self.refused = False
        self.op_seconds: dict[str, float] = {}
        self.failures: list[dict] = []
        self.sites: set[str] = set()
        self.peak_rss = 0
        self.agreed = self.verify_refused = 0
        self.budget = int(os.environ["CKPT_HOST_BUDGET_BYTES"])
        self.expected = self._warm_up()
        self.watch = worker.Watch(self.outside)

    def ops(self, path: str, run: str, *, file_case: bool):
        # Every read path for every case (numpy and sharded restores, every CLI command); the
        # export drops the int4 leaves of both pristines (no safetensors equivalent).
        # Short runs (make test): every case restores (numpy) and is verified, and one more read
        # path in turn (the sharded restore every third case); long runs: every path.
        every = list(super().ops(path, run, file_case=False))
        others = [name for name, _ in every if name not in ALWAYS]
        turn = {others[self.cases % len(others)], "restore mesh" if self.cases % 3 == 0 else ""}
        for name, op in every:
            if not self.long and name not in ALWAYS and name not in turn:
                continue
            if name == "cli export":
                out = os.path.join(self.work, "export")
                op = lambda: self.cli(["export", path, out, "--overwrite", "--no-progress",  # noqa: E731
                                       "--rename", r"^(q|quant\.w_int4)$="])
            yield name, op

    def _one(self, case, kind, name, op, must_match) -> None:
        if name.startswith("cli verify"):
            op = self._recording(op)
        _reset_peak()
        base = _vm_rss()
        super()._one(case, kind, name, op, must_match)
        peak = _vm_hwm() - base
        self.peak_rss = max(self.peak_rss, peak)
        if peak > self.budget + ALLOWANCE:
            self.failures.append({"case": f"{kind}:{case.name}", "op": name,
                                  "problem": f"peak RSS {peak >> 20} MiB above the budget + allowance"})

    def _recording(self, op):
        def run():
            result = op()
            self._verify_rc = result[0]
            return result
        return run

    def check_case(self, case, path: str) -> None:
        """Verify against the reference reader and against every process's route."""
        label = f"{case.family}:{case.name}"
        verify_ok = getattr(self, "_verify_rc", None) == 0
        signal.setitimer(signal.ITIMER_REAL, worker.CASE_TIMEOUT_S, 2.0)
        try:
            try:
                reference_reader.read_checkpoint(path)
                ref_ok, ref_why = True, ""
            except Exception as e:  # noqa: BLE001 (any refusal of the reference counts as one)
                ref_ok, ref_why = False, f"{type(e).__name__}: {e}"[:200]
            routes = {p: route_refusal(path, p) for p in range(self.processes)}
        except worker.Hang as e:
            self.failures.append({"case": label, "op": "reference/routes", "problem": f"hang: {e}"})
            return
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if ref_ok != verify_ok:
            self.failures.append({"case": label, "op": "verify vs reference",
                                  "problem": f"verify {'accepts' if verify_ok else 'refuses'}, the reference "
                                             f"{'accepts' if ref_ok else 'refuses: ' + ref_why}"})
        else:
            self.agreed += 1
        self.verify_refused += not verify_ok
        refusing = {p: why for p, why in routes.items() if why is not None}
        if refusing and verify_ok:
            self.failures.append({"case": label, "op": "verify vs routes",
                                  "problem": f"verify accepts, the restore of process(es) {refusing} refuses"})


def run(r: PackedRunner, cases: list) -> None:
    """Each case through every read path (unsealed damage: values must be the pristine ones),
    then, on a fresh copy (run_case removes its own), the cross-checks."""
    for case in cases:
        r._verify_rc = None

        def write(d, c=case):
            return hostile_packed.apply(c, r.pristine, os.path.join(d, "run", "step_00000001"), r.outside)

        r.run_case(case, "field" if case.sealed else "file", write)
        d = tempfile.mkdtemp(dir=r.cases_dir)
        try:
            r.check_case(case, write(d))
        finally:
            shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pristine", required=True)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--long", action="store_true")
    p.add_argument("--shard", default="0/1")
    p.add_argument("--examples", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    started = time.monotonic()
    shard, shards = map(int, args.shard.split("/"))
    with tempfile.TemporaryDirectory(prefix="ckpt-adversarial-v3-") as work:
        r = PackedRunner(work, args.pristine, args.processes, args.long)
        signal.signal(signal.SIGALRM, worker._alarm)
        limit = worker.limit_address_space()
        tracemalloc.start()
        pk = hostile_packed.Packed(r.pristine)
        cases = hostile_packed.all_cases(pk)[shard::shards]
        fuzz = fuzz_packed.fuzz_cases(args.examples, 20261128 + shard + 100 * args.processes)
        if os.environ.get("CKPT_ADVERSARIAL_ONLY"):
            cases = [c for c in cases if os.environ["CKPT_ADVERSARIAL_ONLY"] in f"{c.family}:{c.name}"]
            fuzz = []
        run(r, cases)
        run(r, fuzz)
        tracemalloc.stop()
        summary = {"cases": len(cases), "examples": len(fuzz), "failures": r.failures, "agreed": r.agreed,
                   "verify_refused": r.verify_refused, "executions": r.executions,
                   "peak_rss_bytes": r.peak_rss, "budget": r.budget, "allowance": ALLOWANCE,
                   "address_space_limit": limit, "crash_sites": sorted(r.sites),
                   "op_seconds": {k: round(v, 1) for k, v in r.op_seconds.items()},
                   "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "seconds": round(time.monotonic() - started, 1)}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
