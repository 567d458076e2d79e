"""The life of a save_async handle beyond the happy path (issue 25, items 1, 5 and 8):

- a script that exits without waiting: pending saves finish before the interpreter exits (with a
  note on stderr if that takes long), or fail loudly on stderr with a non-zero exit status;
- a handle dropped after its save failed, never waited on: a logged warning naming the path;
- ``SaveHandle.cancel()`` and Ctrl-C during ``wait()``: nothing committed, staged data removed;
- a failure of the commit keeps the storage's original exception as ``__cause__``.

Scripts that exit run in a subprocess (8 simulated CPU devices, as conftest gives this process).
"""

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import ckpt
from ckpt._format.records import MANIFEST_NAME
from support import PER_SHARD, Faults

HERE = os.path.dirname(os.path.abspath(__file__))


def _host():
    return np.arange(64 * 32, dtype=np.float32).reshape(64, 32)


def _arrays():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    return {"w": jax.device_put(_host(), NamedSharding(mesh, P("data", "model"))),
            "b": np.arange(4096, dtype=np.int32)}


def _check_restored(path):
    """Every restored shard of the sharded leaf, and the numpy leaf, equal what was saved."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=sharding),
              "b": np.zeros(4096, np.int32)}
    restored = ckpt.restore(path, target)
    host = _host()
    assert len(restored["w"].addressable_shards) == 8
    for shard in restored["w"].addressable_shards:
        assert np.array_equal(np.asarray(shard.data), host[shard.index]), shard.index
    assert np.array_equal(restored["b"], np.arange(4096, dtype=np.int32))


def _run_script(body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `body` (after a prelude that builds the tree the tests save) as a script."""
    prelude = f"""
        import os, sys, time
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        os.environ["JAX_PLATFORMS"] = "cpu"
        sys.path.insert(0, {HERE!r})
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import ckpt
        from support import Faults
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
        tree = {{"w": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
                                     NamedSharding(mesh, P("data", "model"))),
                "b": np.arange(4096, dtype=np.int32)}}
    """
    code = textwrap.dedent(prelude) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


# ---- item 1: exiting without wait() -------------------------------------------------------------


def test_script_exiting_without_wait_commits_the_checkpoint(tmp_path):
    path = str(tmp_path / "a")
    # The reproduction: save_async, then the script ends.
    out = _run_script(f"h = ckpt.save_async({path!r}, tree)\n")
    assert out.returncode == 0, out.stderr
    assert "jax-ckpt" not in out.stderr  # quick: no note
    _check_restored(path)


def test_slow_save_at_exit_says_it_waits(tmp_path):
    path = str(tmp_path / "a")
    # Every chunk write takes 0.5 s: the save outlasts the 2 s after which the exit says so.
    out = _run_script(f"""
        faults = Faults()
        faults.before("write_chunk", lambda *a: time.sleep(0.5))
        ckpt.save_async({path!r}, tree, options=faults.options(pack_limit_bytes=0))
        print("script done", flush=True)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "script done"
    assert f"jax-ckpt: waiting for 1 save in progress to {path} before exiting" in out.stderr, out.stderr
    _check_restored(path)


def test_save_failing_at_exit_is_loud_and_exit_status_nonzero(tmp_path):
    path = str(tmp_path / "a")
    # The first chunk write is held for 1 s and then fails (support.Gate's timeout): the save is
    # still in progress when the script ends, and fails during the exit.
    out = _run_script(f"""
        faults = Faults()
        faults.hold("write_chunk", timeout_s=1)
        ckpt.save_async({path!r}, tree, options=faults.options())
    """)
    assert out.returncode != 0, out.stderr
    assert f"jax-ckpt: the save to {path} failed while the interpreter was exiting" in out.stderr, out.stderr
    assert "never released the gate" in out.stderr  # the error itself
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []  # nothing committed, nothing staged left


def test_dropped_handle_of_a_failed_save_warns(location, caplog):
    faults = Faults()
    faults.fail("write_chunk")
    handle = ckpt.save_async(location("ck"), _arrays(), options=faults.options())
    deadline = time.monotonic() + 60
    while not handle.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle._thread.join(60)  # (the thread's last reference to the handle is gone)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        del handle
        gc.collect()
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ckpt")]
    assert len(messages) == 1, messages
    assert location("ck") in messages[0] and "never waited" in messages[0] and "injected" in messages[0]


def test_dropped_handle_of_a_waited_or_committed_save_is_quiet(location, caplog):
    faults = Faults()
    faults.fail("write_chunk")
    failed = ckpt.save_async(location("bad"), _arrays(), options=faults.options())
    with pytest.raises(OSError, match="injected"):
        failed.wait(60)
    ok = ckpt.save_async(location("ok"), _arrays())
    while not ok.done():
        time.sleep(0.01)
    ok._thread.join(60)
    failed._thread.join(60)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        del failed, ok
        gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("ckpt")] == []
    _check_restored(location("ok"))


# ---- item 5: cancel() and Ctrl-C during wait() --------------------------------------------------


def _assert_nothing_left(location):
    # No checkpoint and no staged data (local: no .tmp- sibling; memory://: no gen- prefix).
    assert location.names() == []


def test_cancel_stops_a_save_mid_write(location):
    faults = Faults()
    gate = faults.hold("write_chunk", times=1)
    handle = ckpt.save_async(location("ck"), _arrays(), options=faults.options(pack_limit_bytes=0))
    assert gate.entered.wait(30)
    assert handle.cancel() is True
    assert handle.cancel() is True  # (again: still cancelled)
    gate.release.set()
    with pytest.raises(ckpt.CheckpointError, match="cancelled") as info:
        handle.wait(60)
    assert location("ck") in str(info.value)
    assert handle.done()
    # It stopped issuing writes: the 8 shards of w and the one chunk of b are not all written.
    assert faults.calls["write_chunk"] < 9
    assert faults.calls["commit"] == 0
    _assert_nothing_left(location)
    assert handle.cancel() is True  # a cancelled save stays cancelled

    # A save after that works, at the same path.
    ckpt.save(location("ck"), _arrays())
    _check_restored(location("ck"))


def test_cancel_after_commit_is_refused(location):
    handle = ckpt.save_async(location("ck"), _arrays())
    handle.wait(60)
    assert handle.cancel() is False
    handle.wait()  # still a success
    _check_restored(location("ck"))


def test_cancel_while_the_commit_runs_is_refused(location):
    faults = Faults()
    gate = faults.hold("commit")
    handle = ckpt.save_async(location("ck"), _arrays(), options=faults.options())
    assert gate.entered.wait(30)
    assert handle.cancel() is False  # past the point of no return: it commits
    gate.release.set()
    handle.wait(60)
    _check_restored(location("ck"))


def _main_thread_in_wait() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith(os.path.join("_save", "__init__.py")):
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C as a terminal delivers it: SIGINT raises KeyboardInterrupt. A process started in the
    background by a non-interactive shell (as CI may start the suite) inherits SIGINT ignored,
    and Python then installs no handler: set the default one for the test, put the old one back."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_wait_cancels_the_save(location, ctrl_c_raises):
    faults = Faults()
    gate = faults.hold("write_chunk", times=1)
    handle = ckpt.save_async(location("ck"), _arrays(), options=faults.options(pack_limit_bytes=0))

    def interrupt():
        assert gate.entered.wait(30)
        deadline = time.monotonic() + 30
        while not _main_thread_in_wait() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # (blocked inside wait)
        os.kill(os.getpid(), signal.SIGINT)  # Linux delivers it to the main thread
        time.sleep(0.2)
        gate.release.set()  # the held write ends; the cancelled save stops and cleans up

    helper = threading.Thread(target=interrupt)
    helper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            handle.wait(60)
    finally:
        gate.release.set()
        helper.join(60)
    # wait() re-raised the interrupt once the save had stopped and removed its staged data.
    assert handle.done()
    with pytest.raises(ckpt.CheckpointError, match="cancelled"):
        handle.wait()
    assert faults.calls["commit"] == 0
    _assert_nothing_left(location)

    ckpt.save(location("ck"), _arrays())
    _check_restored(location("ck"))


def test_cancelled_save_is_not_waited_for_at_exit(tmp_path):
    path = str(tmp_path / "a")
    out = _run_script(f"""
        faults = Faults()
        gate = faults.hold("write_chunk", times=1)
        h = ckpt.save_async({path!r}, tree, options=faults.options())
        assert gate.entered.wait(30)
        assert h.cancel()
        gate.release.set()
    """)
    assert out.returncode == 0, out.stderr
    assert "jax-ckpt" not in out.stderr, out.stderr
    assert os.listdir(tmp_path) == []


# ---- item 8: the original exception of a failed commit -------------------------------------------


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_commit_failure_keeps_the_original_exception(location, how):
    faults = Faults()
    injected = []

    def error(where):
        injected.append(SystemError("manifest write refused (injected)"))
        return injected[-1]

    faults.fail("commit", error)
    with pytest.raises(ckpt.CheckpointError, match="commit failed") as info:
        if how == "save":
            ckpt.save(location("ck"), _arrays(), options=faults.options())
        else:
            ckpt.save_async(location("ck"), _arrays(), options=faults.options()).wait(60)
    assert len(injected) == 1
    assert info.value.__cause__ is injected[0]
    assert "SystemError: manifest write refused (injected)" in str(info.value)
    assert location("ck") in str(info.value)
    assert not location.storage("ck").exists(MANIFEST_NAME)


def test_commit_failure_without_text_names_the_type(location):
    faults = Faults()
    faults.fail("commit", lambda where: SystemError())
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save_async(location("ck"), _arrays(), options=faults.options()).wait(60)
    assert isinstance(info.value.__cause__, SystemError)
    assert str(info.value).endswith("commit failed: SystemError")


def test_ctrl_c_while_the_exit_waits_cancels_the_save(tmp_path):
    path = str(tmp_path / "a")
    prelude_and_body = f"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # (as at a terminal, whatever was inherited)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, {HERE!r})
import numpy as np
import ckpt
from support import Faults
faults = Faults()
faults.before("write_chunk", lambda *a: time.sleep(0.5))  # 8 chunks: 4 s
ckpt.save_async({path!r}, {{"w": np.arange(4096, dtype=np.float32)}},
                options=faults.options(pack_limit_bytes=0, max_chunk_bytes=2048))
"""
    proc = subprocess.Popen([sys.executable, "-c", prelude_and_body], stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while not (seen and ("jax-ckpt:" in seen[-1] or not seen[-1])):  # (other lines, or EOF)
            seen.append(proc.stderr.readline())
        assert "jax-ckpt: waiting for 1 save in progress" in seen[-1], seen
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"jax-ckpt: interrupted while exiting: cancelled 1 save in progress to {path}" in rest, rest
    assert "Traceback" not in rest, rest
    assert rc != 0
    assert os.listdir(tmp_path) == []  # nothing committed, the staged data removed


# ---- cancel in a 2-process job ------------------------------------------------------------------


def run_cancel_job(w):
    """Process 1 cancels the save while one of its writes is held; every process's wait() says
    cancelled, nothing is committed or left staged, and the next save restores exactly."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    host = _host()
    tree = {"w": jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx]),
            "b": np.arange(4096, dtype=np.int32)}
    path = os.path.join(w.args["dir"], "ck")
    faults = Faults()
    # (a multi-process save writes the packed layout: its chunk writes go into data objects)
    gate = faults.hold("write_at", times=1) if w.index == 1 else None
    handle = ckpt.save_async(path, tree, options=faults.options(pack_limit_bytes=0))
    if gate is not None:
        assert gate.entered.wait(60)
        w.report(check="cancel", accepted=handle.cancel())
        gate.release.set()
    try:
        handle.wait(60)
        w.report(check="wait", error=None)
    except ckpt.CheckpointError as e:
        w.report(check="wait", message=str(e))
    w.barrier("after-cancel")
    w.report(check="left", entries=sorted(os.listdir(w.args["dir"])))
    w.barrier("listed")
    ckpt.save(path, tree)
    target = {"w": jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding), "b": np.zeros(4096, np.int32)}
    restored = ckpt.restore(path, target)
    bad = [str(s.index) for s in restored["w"].addressable_shards if not np.array_equal(np.asarray(s.data), host[s.index])]
    w.report(check="restored", bad=bad, shards=len(restored["w"].addressable_shards),
             b=bool(np.array_equal(restored["b"], tree["b"])))


def test_cancel_on_one_process_cancels_the_job(tmp_path):
    from multiproc import launch

    results = launch(f"{os.path.abspath(__file__)}:run_cancel_job", processes=2, devices_per_process=4,
                     args={"dir": str(tmp_path)})
    for r in results:
        assert r.returncode == 0, r.describe()
        assert "message" in r.one("wait") and "cancelled" in r.one("wait")["message"], r.describe()
        assert r.one("left")["entries"] == [], r.describe()
        restored = r.one("restored")
        assert restored == {"check": "restored", "bad": [], "shards": 4, "b": True}, r.describe()
    assert results[1].one("cancel")["accepted"] is True
    assert "process 1" in results[0].one("wait")["message"]
