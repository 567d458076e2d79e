"""A trainer's SIGTERM is never swallowed (issue 37): the notice reaches the loop through what it
asks (``manager.reached_preemption``, or JAX's own preemption sync point under jax.distributed),
or, when the loop asks neither, the signal does what it would have done (the process ends) once
the preemption checkpoint is committed. Each loop is a real Python process that sends itself
SIGTERM at step 40, saving every 300 of 700 steps."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ckpt
from multiproc import free_port

REPO = Path(__file__).resolve().parent.parent

LOOP = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np, ckpt
    kind, directory = sys.argv[1], sys.argv[2]
    if kind == "jax-sync-point":
        import jax
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[3]}", num_processes=1,
                                   process_id=0, heartbeat_timeout_seconds=5)
        from jax.experimental import multihost_utils
    manager = ckpt.CheckpointManager(directory, save_interval_steps=300)
    for step in range(700):
        if step == 40:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
        tree = {"w": np.full((16,), step, dtype=np.float32), "step": step}
        if kind == "own-steps":  # MaxText's way: the manager is called only at the loop's own saves
            if step % 300 == 0:
                manager.save(step, tree)
                manager.wait()  # committed before the notice comes: this test is about the notice alone
        else:
            manager.save(step, tree)  # every step; the manager decides
        print(step, flush=True)
        if kind == "asks-manager" and manager.reached_preemption(step):
            print("told", flush=True)
            break
        if kind == "jax-sync-point":
            if multihost_utils.reached_preemption_sync_point(step):
                print("told", flush=True)
                break
            time.sleep(0.01)  # a training step: JAX's notice takes a few hundred ms to reach the sync point
    manager.close()
    print("ended by the loop", flush=True)
""")


def _run(kind: str, directory: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)  # one device is enough here
    args = [sys.executable, "-c", LOOP, kind, str(directory)]
    if kind == "jax-sync-point":
        args.append(str(free_port()))
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)


def _tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}; stdout ...{proc.stdout[-80:]!r}; stderr ...{proc.stderr[-2000:]}"


def _steps_run(proc: subprocess.CompletedProcess) -> list[int]:
    return [int(line) for line in proc.stdout.split() if line.isdigit()]


def _check_step(directory: Path, step: int) -> None:
    restored = ckpt.restore(directory / f"step_{step:08d}")
    assert restored["step"] == step
    assert np.array_equal(restored["w"], np.full((16,), step, dtype=np.float32))


@pytest.mark.parametrize("kind", ["asks-manager", "jax-sync-point"])
def test_a_loop_that_asks_gets_the_notice_and_ends_itself(tmp_path, kind):
    directory = tmp_path / "run"
    proc = _run(kind, directory)
    assert proc.returncode == 0, _tail(proc)
    steps = _steps_run(proc)
    assert proc.stdout.endswith("told\nended by the loop\n")
    last = steps[-1]
    if kind == "asks-manager":
        assert last == 40  # the step saved first after the notice
    else:
        assert last >= 40  # JAX's sync point: the step at which the notice reached every process
    with ckpt.CheckpointManager(directory, read_only=True) as manager:
        assert manager.all_steps() == [0, last]  # the manager saved the step the loop stopped at
    _check_step(directory, last)


def test_a_loop_that_never_asks_ends_as_sigterm_would_after_the_preemption_save(tmp_path):
    directory = tmp_path / "run"
    proc = _run("never-asks", directory)
    assert proc.returncode == -signal.SIGTERM, _tail(proc)
    assert _steps_run(proc) == list(range(40))  # ended inside save(40), once step 40 was committed
    with ckpt.CheckpointManager(directory, read_only=True) as manager:
        assert manager.all_steps() == [0, 40]
    _check_step(directory, 40)


def test_a_loop_calling_the_manager_only_at_its_saves_ends_at_the_notice(tmp_path):
    """Nothing will save before step 300: holding the notice would only keep the job running
    past the scheduler's grace period; the signal ends the process at once (step 0 committed)."""
    directory = tmp_path / "run"
    proc = _run("own-steps", directory)
    assert proc.returncode == -signal.SIGTERM, _tail(proc)
    assert _steps_run(proc) == list(range(40))
    with ckpt.CheckpointManager(directory, read_only=True) as manager:
        assert manager.all_steps() == [0]
    _check_step(directory, 0)


def test_a_notice_nobody_listens_for_waits_for_the_save_in_flight(tmp_path, sigterm_recorder, monkeypatch):
    """The loop called the manager at step 0 only: the notice goes on once the save in flight
    has committed (from a thread that sends the signal again, handed on by the main thread)."""
    recorder, record = sigterm_recorder
    manager = ckpt.CheckpointManager(tmp_path / "run", save_interval_steps=300)
    manager.save(0, {"w": np.arange(4.0)})
    manager.wait()
    in_flight = threading.Event()  # a save still being written, as the handler sees it
    monkeypatch.setattr(manager, "_save_in_flight", lambda: in_flight)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    assert recorder == []  # not while the save is in flight
    in_flight.set()
    deadline = time.monotonic() + 10
    while not recorder and time.monotonic() < deadline:
        time.sleep(0.01)  # (the handler runs on the main thread, between these calls)
    assert recorder == [signal.SIGTERM]  # then handed on, once
    assert signal.getsignal(signal.SIGTERM) is record and not manager.should_save(1)
    manager.close()
    time.sleep(0.1)
    assert recorder == [signal.SIGTERM]
