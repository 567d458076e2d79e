"""A process that saves to an object store in a loop until it is killed (test_s3.py's SIGKILL test).

    python objectstore_child.py        # a zygote: imports ckpt and jax once, then forks savers

Importing ckpt and jax takes a fresh interpreter about 1.5 s on 2 cores, so the test starts this
file once as a *zygote* and restarts the saver by forking it (nothing but the import has run in
the zygote: no JAX backend, no TensorStore context, no threads of its own). Commands on stdin,
answers on stdout, one line each:

    start ROOT FIRST ONCE  ->  started PID        (then, from the saver: ready PID, done PID I ...)
    reap PID               ->  reaped PID STATUS  (after the test has killed it)

The saver (``run``) saves, for i = FIRST, FIRST+1, ...: tree(i) to a new location
``ROOT/single/c<i>``, over ``ROOT/over`` (overwrite), and as step i of a CheckpointManager on
``ROOT/mgr`` (max_to_keep=2), printing ``done PID i`` after each round. With ONCE=1 it does one
round and exits 0 (the restart after the last kill: its manager removes what killed saves left
behind). The environment names the server (AWS_* variables).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

SHAPE = (288, 1024)  # 1.1 MiB of float32: written as 8 chunks (4x2 shards)


def tree_values(i: int) -> dict:
    """The host values of tree(i): every leaf depends on i, so a mix of two saves shows."""
    w = (np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * 0.5 + i).astype(np.float32)
    b = (np.arange(96, dtype=np.int32) * 7 + i).astype(np.int32)
    return {"w": w, "b": b, "step": i}


def _device_tree(i: int):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("x", "y"))
    v = tree_values(i)
    return {"w": jax.device_put(v["w"], NamedSharding(mesh, P("x", "y"))),
            "b": jax.device_put(v["b"], NamedSharding(mesh, P())), "step": i}


def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())  # unbuffered: nothing is left to be flushed twice after a fork


def run(root: str, first: int, once: bool) -> None:
    import ckpt

    manager = ckpt.CheckpointManager(f"{root}/mgr", max_to_keep=2, async_save=False)
    _device_tree(first)  # initialize the devices before saying ready
    _say(f"ready {os.getpid()}")
    i = first
    while True:
        tree = _device_tree(i)
        ckpt.save(f"{root}/single/c{i:06d}", tree)
        ckpt.save(f"{root}/over", tree, overwrite=True)
        manager.save(i, tree)
        _say(f"done {os.getpid()} {i}")
        i += 1
        if once:
            manager.close()
            return


def zygote() -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax  # noqa: F401
    import ckpt  # noqa: F401

    _say("zygote")
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "start":
            root, first, once = args[0], int(args[1]), args[2] == "1"
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    run(root, first, once)
                except BaseException:  # noqa: BLE001 - reported, and the exit status says so
                    _say("error " + traceback.format_exc().replace("\n", " | "))
                    code = 1
                os._exit(code)
            _say(f"started {pid}")
        elif cmd == "reap":
            pid = int(args[0])
            _, status = os.waitpid(pid, 0)
            _say(f"reaped {pid} {status}")


class Zygote:
    """The test's handle on a zygote started as a child process: start savers, wait for their
    lines, reap them (the test kills them by pid)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=os.path.dirname(os.path.abspath(__file__)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.lines: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("zygote", 120)

    def _read(self):
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()

    def expect(self, prefix, timeout_s):
        deadline = time.monotonic() + timeout_s
        with self._new:
            while True:
                found = [ln for ln in self.lines if ln.startswith(prefix)]
                if found:
                    return found[-1]
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"no {prefix!r} from the saver; output:\n{self.output()}")
                self._new.wait(0.2)

    def send(self, text):
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def start(self, root, first, once):
        before = len(self.lines)
        self.send(f"start {root} {first} {int(once)}")
        deadline = time.monotonic() + 60
        while True:
            with self._new:
                started = [ln for ln in self.lines[before:] if ln.startswith("started ")]
                if started:
                    return int(started[0].split()[1])
                if time.monotonic() > deadline:
                    raise AssertionError(f"the zygote did not fork; output:\n{self.output()}")
                self._new.wait(0.2)

    def reap(self, pid):
        self.send(f"reap {pid}")
        return int(self.expect(f"reaped {pid} ", 120).split()[2])

    def count(self, prefix):
        with self._new:
            return sum(ln.startswith(prefix) for ln in self.lines)

    def output(self):
        return "\n".join(self.lines[-60:])

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the zygote this test started
            self.proc.wait()


if __name__ == "__main__":
    zygote()
