"""Hostile checkpoints and a property-based fuzz of every read path, in guarded processes.

``worker.py`` does the work (see its docstring for the guards: an address-space limit,
tracemalloc, an alarm per case, an audit hook and inotify watching reads outside the
checkpoint). This test runs two workers at once (two shards of the cases, two fuzz seeds) and
fails listing every finding.

Short by default (``make test``). The long run covers every manifest field with every hostile
value, every byte of the manifest and zarr.json files, and fuzzes for longer:

    CKPT_ADVERSARIAL=long [CKPT_FUZZ_EXAMPLES=20000] .venv/bin/python -m pytest -q tests/adversarial -s
"""

from __future__ import annotations

import json
import os
import sys

from workers import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
LONG = os.environ.get("CKPT_ADVERSARIAL") == "long"
SHARDS = 2
EXAMPLES = int(os.environ.get("CKPT_FUZZ_EXAMPLES", 20000 if LONG else 60))


def _run_workers(tmp_path) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               MALLOC_ARENA_MAX="2")
    jobs = []
    for k in range(SHARDS):
        out = tmp_path / f"shard{k}.json"
        jobs.append(([sys.executable, os.path.join(HERE, "worker.py"), "--shard", f"{k}/{SHARDS}",
                      "--examples", str(EXAMPLES // SHARDS), "--out", str(out)] + (["--long"] if LONG else []), out))
    return run_workers(jobs, env, tmp_path, None if LONG else 600)


def test_hostile_checkpoints_and_fuzz_only_raise_checkpoint_or_os_errors(tmp_path, record_property):
    results = _run_workers(tmp_path)
    failures = [f for r in results for f in r["failures"]]
    summary = {
        "hostile_cases": sum(r["cases"] for r in results),
        "by_family": {k: sum(r["by_family"].get(k, 0) for r in results)
                      for k in ("field", "file", "flip", "bitflips")},
        "hostile_executions": sum(r["hostile_executions"] for r in results),
        "fuzz_examples": sum(r["examples"] for r in results),
        "decode_fuzz_examples": sum(r["decode_examples"] for r in results),
        "fuzz_executions": sum(r["fuzz_executions"] for r in results),
        "crash_sites": sorted({s for r in results for s in r["crash_sites"]}),
        "failures": len(failures),
        "worker_seconds": [r["seconds"] for r in results],
    }
    record_property("adversarial", json.dumps(summary))
    print("\nadversarial:", json.dumps(summary))
    # Everything was exercised: every family of case, and the fuzz.
    assert all(summary["by_family"][k] > 0 for k in ("field", "file", "flip", "bitflips")), summary
    assert summary["fuzz_examples"] >= EXAMPLES // SHARDS * SHARDS // 2, summary
    assert not failures, "\n".join(f"{f['case']} / {f['op']}: {f['problem']}" for f in failures[:50])
