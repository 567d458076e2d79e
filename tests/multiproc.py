"""Run a test function in N real JAX processes on 127.0.0.1, joined by jax.distributed.

    results = launch("tests/test_multihost.py:run_save_job", processes=2, devices_per_process=4,
                     args={"dir": str(tmp_path)})

Every process imports the file, initializes jax.distributed (free local port, short heartbeat
timeout), gives itself `devices_per_process` CPU devices with ``jax_num_cpu_devices`` and calls
the function with a ``Worker``. ``Worker.report(**fields)`` appends one JSON record to the
process's result file at once, so records written before a crash (or a SIGKILL) survive.
``launch`` returns one ``ProcessResult`` per process: exit code, records, and the output tail.

The same file is the worker's entry point: ``python multiproc.py '<json spec>'``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

HEARTBEAT_TIMEOUT_S = 15  # jax terminates survivors of a dead process after this


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ProcessResult:
    index: int
    returncode: int | None  # None: still running at the deadline (then killed)
    records: list[dict] = field(default_factory=list)
    output: str = ""

    def one(self, check: str) -> dict:
        """The record the process reported for `check`."""
        found = [r for r in self.records if r.get("check") == check]
        if len(found) != 1:
            raise AssertionError(f"process {self.index}: {len(found)} records for {check!r}\n{self.describe()}")
        return found[0]

    def describe(self) -> str:
        return (f"--- process {self.index}: exit code {self.returncode}, records {self.records}\n"
                f"{self.output[-4000:]}")


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # The test session forces 8 host devices through XLA_FLAGS; workers set their own count.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def launch(target: str, *, processes: int, devices_per_process: int, args: dict | None = None,
           env: dict[str, str] | None = None, timeout_s: float = 120,
           heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> list[ProcessResult]:
    """Run ``file.py:function`` in `processes` processes; wait for all (killing them at the
    deadline) and return their results, by process index."""
    path, _, function = target.rpartition(":")
    work = tempfile.mkdtemp(prefix="ckpt-multiproc-")
    port = free_port()
    children = []
    for i in range(processes):
        spec = {
            "file": os.path.abspath(path), "function": function, "args": args or {},
            "coordinator": f"127.0.0.1:{port}", "processes": processes, "index": i,
            "devices": devices_per_process, "heartbeat_s": heartbeat_timeout_s,
            "results": os.path.join(work, f"p{i}.jsonl"), "others_exited": os.path.join(work, "others-exited"),
        }
        log = open(os.path.join(work, f"p{i}.log"), "wb")
        children.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(spec)],
                                          stdout=log, stderr=subprocess.STDOUT, env=_child_env(env)), log))
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.poll() for proc, _ in children]
        if all(c is not None for c in codes[1:]) and not os.path.exists(spec["others_exited"]):
            open(spec["others_exited"], "w").close()  # process 0 may take the service down now
        if all(c is not None for c in codes) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for (proc, log), code in zip(children, codes):
        if code is None:
            proc.kill()  # only the processes started above, by their own handle
            proc.wait()
        log.close()
    results = []
    for i in range(processes):
        records = []
        if os.path.exists(os.path.join(work, f"p{i}.jsonl")):
            with open(os.path.join(work, f"p{i}.jsonl")) as f:
                records = [json.loads(line) for line in f if line.strip()]
        with open(os.path.join(work, f"p{i}.log"), errors="replace") as f:
            output = f.read()
        results.append(ProcessResult(i, codes[i], records, output))
    return results


def assert_all_succeeded(results: list[ProcessResult]) -> None:
    bad = [r for r in results if r.returncode != 0 or any("error" in rec for rec in r.records)]
    if bad:
        raise AssertionError("multi-process job failed:\n" + "\n".join(r.describe() for r in bad))


class Worker:
    """What a function run by ``launch`` gets: its place in the job and a way to report."""

    def __init__(self, spec: dict):
        self.index: int = spec["index"]
        self.count: int = spec["processes"]
        self.args: dict[str, Any] = spec["args"]
        self._results = open(spec["results"], "a", buffering=1)
        self.survivors: list[int] | None = None  # set when some process is meant to die

    def report(self, **fields) -> None:
        self._results.write(json.dumps(fields) + "\n")
        self._results.flush()

    def barrier(self, name: str, timeout_s: float = 60, processes: list[int] | None = None) -> None:
        from jax._src.distributed import global_state

        global_state.client.wait_at_barrier(name, int(timeout_s * 1000), processes)


def _run_worker(spec: dict) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", spec["devices"])
    jax.distributed.initialize(coordinator_address=spec["coordinator"], num_processes=spec["processes"],
                               process_id=spec["index"], heartbeat_timeout_seconds=spec["heartbeat_s"],
                               initialization_timeout=60, shutdown_timeout_seconds=30)
    sys.path.insert(0, os.path.dirname(spec["file"]))
    module_spec = importlib.util.spec_from_file_location("_multiproc_target", spec["file"])
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    worker = Worker(spec)
    try:
        getattr(module, spec["function"])(worker)
    except BaseException:
        worker.report(error=traceback.format_exc())
        os._exit(1)  # the others fail on their own timeouts; no shutdown barrier to hang in
    if worker.survivors is not None:
        # A peer is dead: the job-wide shutdown barrier would wait for it, so only the
        # survivors meet, and leave before jax's heartbeat timeout terminates them. Process 0
        # hosts the coordination service and leaves last: a client that sees the service go
        # away terminates itself.
        worker.barrier("survivors-done", 30, worker.survivors)
        if worker.index == 0:
            give_up = time.monotonic() + 30
            while not os.path.exists(spec["others_exited"]) and time.monotonic() < give_up:
                time.sleep(0.02)
        os._exit(0)
    jax.distributed.shutdown()


if __name__ == "__main__":
    _run_worker(json.loads(sys.argv[1]))
