"""Running the adversarial workers (``worker.py``, ``worker_packed.py``) as child processes,
several at once, each writing its results to a JSON file; shared by the v1/v2 and v3 suites."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def run_workers(jobs: list[tuple[list[str], Path]], env: dict, tmp_path: Path, timeout_s: float | None) -> list[dict]:
    """Start every (argv, results file) of `jobs` at once, wait for each (killed past
    `timeout_s`), and return their results; a worker that crashed fails the test with the end
    of its output."""
    procs = []
    for k, (args, out) in enumerate(jobs):
        log = open(tmp_path / f"worker{k}.log", "wb")
        procs.append((subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT), out, log))
    results = []
    for proc, out, log in procs:
        try:
            rc = proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        text = open(log.name, errors="replace").read()
        assert rc == 0 and out.exists(), f"worker crashed (rc {rc}):\n{text[-4000:]}"
        results.append(json.loads(out.read_text()))
    return results
