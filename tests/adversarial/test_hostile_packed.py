"""Hostile version-3 (packed) checkpoints, issue 36: the classes of ``hostile_packed.py`` and a
seeded fuzz over index objects, data objects and the manifest's v3 fields, on the golden v3
checkpoint (4 processes) and a fresh 1-process packed save, in guarded child processes
(``worker_packed.py``: RLIMIT_AS, peak RSS within the host budget + a stated allowance, no
read outside the checkpoint, verify and the reference reader agreeing, verify refusing what
any process's restore refuses).

Short by default; ``CKPT_ADVERSARIAL=long`` (make test-adversarial-long) adds a fresh
4-process packed save and fuzzes longer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from workers import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LONG = os.environ.get("CKPT_ADVERSARIAL") == "long"
EXAMPLES = int(os.environ.get("CKPT_FUZZ_EXAMPLES_V3", 600 if LONG else 8))
BUDGET = 256 << 20  # the host budget the workers run under (CKPT_HOST_BUDGET_BYTES)
GOLDEN = os.path.join(ROOT, "formats", "golden", "v3", "checkpoint")


def _env() -> dict:
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
                MALLOC_ARENA_MAX="2", CKPT_HOST_BUDGET_BYTES=str(BUDGET))


def _fresh_save(root: str) -> str:
    """A 1-process packed save of worker.pristine_tree (layout="packed")."""
    code = ("import sys, jax, numpy as np, ckpt; sys.path.insert(0, %r); import worker; "
            "from jax.sharding import Mesh; mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ('data', 'model')); "
            "ckpt.save(%r, worker.pristine_tree(mesh), options=ckpt.Options(layout='packed'))") % (HERE, root)
    subprocess.run([sys.executable, "-c", code], env=_env(), check=True, timeout=300)
    return root


def _fresh_save_4(root: str) -> str:
    """A 4-process (x 2 devices) packed save of worker.pristine_tree (tests/multiproc.py)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from multiproc import launch

    results = launch(os.path.join(HERE, "test_hostile_packed.py") + ":run_save_4", processes=4,
                     devices_per_process=2, args={"dir": root}, timeout_s=300)
    assert all(r.returncode == 0 for r in results), "\n".join(r.describe() for r in results)
    return root


def run_save_4(w) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import ckpt

    sys.path.insert(0, HERE)
    import worker

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

    def global_(x):  # every process passes the same value: one global array of it (make_golden.py)
        if not isinstance(x, jax.Array) or not x.is_fully_addressable:
            return x
        def put(a, *spec):
            return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(*spec)), lambda i: a[i])
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(np.asarray(jax.random.key_data(x))), impl=jax.random.key_impl(x))
        return put(np.asarray(x), *(x.sharding.spec if isinstance(x.sharding, NamedSharding) else ()))

    ckpt.save(w.args["dir"], jax.tree.map(global_, worker.pristine_tree(mesh)))
    w.report(check="saved")


def _run(tmp_path, jobs: list[tuple[str, int, str]]) -> list[dict]:
    """One worker per (pristine, processes, shard), all at once."""
    work = []
    for k, (pristine, processes, shard) in enumerate(jobs):
        out = tmp_path / f"w{k}.json"
        work.append(([sys.executable, os.path.join(HERE, "worker_packed.py"), "--pristine", pristine, "--processes",
                      str(processes), "--shard", shard, "--examples", str(EXAMPLES // len(jobs)),
                      "--out", str(out)] + (["--long"] if LONG else []), out))
    return run_workers(work, _env(), tmp_path, None if LONG else 600)


def test_hostile_packed_checkpoints_refuse_or_restore_within_the_budget(tmp_path, record_property):
    """Short: the cases shared between the golden checkpoint (even ones) and a fresh 1-process
    save (odd ones), two workers at once. Long: every case on each of the golden checkpoint, a
    fresh 1-process and a fresh 4-process save, two workers each."""
    fresh1 = _fresh_save(str(tmp_path / "fresh1"))
    if LONG:
        fresh4 = _fresh_save_4(str(tmp_path / "fresh4"))
        jobs = [(p, n, f"{k}/2") for p, n in ((GOLDEN, 4), (fresh1, 1), (fresh4, 4)) for k in range(2)]
    else:
        jobs = [(GOLDEN, 4, "0/2"), (fresh1, 1, "1/2")]
    results = _run(tmp_path, jobs)
    failures = [f for r in results for f in r["failures"]]
    summary = {k: sum(r[k] for r in results) for k in ("cases", "examples", "agreed", "verify_refused", "executions")}
    summary.update(peak_rss_mib=round(max(r["peak_rss_bytes"] for r in results) / 2**20, 1), budget_mib=BUDGET >> 20,
                   allowance_mib=results[0]["allowance"] >> 20, seconds=[r["seconds"] for r in results],
                   crash_sites=sorted({s for r in results for s in r["crash_sites"]}), failures=len(failures))
    record_property("adversarial_v3", json.dumps(summary))
    print("\nadversarial v3:", json.dumps(summary))
    assert not failures, "\n".join(f"{f['case']} / {f['op']}: {f['problem']}" for f in failures[:60])
    assert summary["cases"] >= 60 and summary["examples"] >= EXAMPLES // len(jobs) * len(jobs), summary
    assert summary["agreed"] == summary["cases"] + summary["examples"], summary
