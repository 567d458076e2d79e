"""The Coordinator of a multi-process job: the jax.distributed key-value store.

Every exchange of a save is a set of keys under ``jax_ckpt/<save id>/<phase>/``: a gather is
one key per process, read by process 0 alone (each value once); a broadcast is process 0's key,
read by every other process once. A save exchanges O(1) bytes per process (statuses name the
process's index object in storage; its chunk checksums never pass through the service), so the
service carries O(processes) per save, not O(processes^2). Processes poll for the keys they wait
on (blocking reads with a short deadline, so waiting costs no CPU and ends as soon as the key
appears); no device collectives are involved.

Telling a dead process from a slow one: while a process is inside a save it bumps its own
counter ``jax_ckpt/alive/<process>`` every few seconds. A waiter gives up on a peer when the
peer has neither posted the awaited key nor bumped its counter for ``CKPT_TIMEOUT_S`` seconds,
and raises a CheckpointError naming every such peer. So the timeout bounds silence, not the
length of a save: a process that writes for ten minutes is never declared missing, one that
was SIGKILLed is within the timeout (one stuck inside a save, in hung I/O say, still signals
life and is waited for like a slow one). Keep ``CKPT_TIMEOUT_S`` below the
``heartbeat_timeout_seconds`` given to ``jax.distributed.initialize``: after that jax itself
terminates every process of a job that lost one, before ckpt can report anything.

Keys are removed once every process has finished a save (the last to finish deletes the
save's directory), so the store does not grow with the number of saves. A save that failed
on a timeout leaves its few keys behind.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from ckpt._errors import CheckpointError

NAMESPACE = "jax_ckpt"
TIMEOUT_ENV = "CKPT_TIMEOUT_S"
# Below jax.distributed's default heartbeat timeout (100 s), so that ckpt reports a dead
# process before jax terminates the job; long saves are fine (see the module docstring).
DEFAULT_TIMEOUT_S = 60.0

_OK, _FAILED = b"\x00", b"\x01"

# Above this many processes missing, a waiter lists every life counter in one call instead of
# reading the missing ones one by one (either way O(processes) per slice, only while waiting).
LIFE_LISTING = 16


def coordination_timeout() -> float:
    """Seconds of silence after which a peer counts as missing (CKPT_TIMEOUT_S, default 60)."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise CheckpointError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise CheckpointError(f"{TIMEOUT_ENV}={text!r} must be a positive number of seconds")
    return value


def _status(e: Exception) -> str:
    return str(e).split(":", 1)[0].strip()


class _SignsOfLife:
    """Bumps this process's counter in the store while at least one save is in progress."""

    def __init__(self, client, key: str):
        self._client, self._key = client, key
        self._active = 0
        self._count = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def enter(self) -> None:
        with self._cond:
            self._active += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckpt-alive", daemon=True)
                self._thread.start()

    def exit(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            timeout = coordination_timeout()
        except CheckpointError:  # a bad setting is reported by the exchange that reads it
            timeout = DEFAULT_TIMEOUT_S
        # Six signs per timeout: a waiter sees one well within it. Each costs the service one
        # small write per process: at most one per 10 s, so a long wait stays cheap (issue 23).
        interval = min(10.0, max(0.05, timeout / 6))
        while True:
            with self._cond:
                if self._active == 0:
                    self._thread = None
                    return
                self._count += 1
                count = self._count
            try:  # outside the lock: a slow store must not hold up enter() or exit()
                self._client.key_value_set(self._key, str(count), allow_overwrite=True)
            except Exception:  # the waiters report a lost service; nothing to add here
                pass
            with self._cond:
                if self._active > 0:
                    self._cond.wait(interval)


def _silent(lives: dict, seen: dict, last: dict, now: float, timeout: float) -> list[int]:
    """The processes among `lives` (process -> its sign of life now) whose sign has not changed
    for more than `timeout` s; `seen` and `last` (the sign and when it last changed) updated."""
    for p, sign in lives.items():
        if sign != seen[p]:
            seen[p], last[p] = sign, now
    return [p for p in lives if now - last[p] > timeout]


class DistributedCoordinator:
    """Coordinator over the jax.distributed client of this process."""

    def __init__(self, client, process_index: int, process_count: int):
        self._client = client
        self.process_index, self.process_count = process_index, process_count
        self._saves = 0
        self._broken: set[str] = set()  # saves whose exchanges did not all complete here
        self._lock = threading.Lock()
        self._life = _SignsOfLife(client, self._alive_key(process_index))

    # -- the Coordinator protocol ------------------------------------------------------------

    def new_save_id(self) -> str:
        # Every process calls this once per save, in the same order, so counters agree.
        with self._lock:
            self._saves += 1
            save_id = str(self._saves)
        self._life.enter()
        return save_id

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        self._post(key, value)
        got = self._collect(key, range(self.process_count))
        return [got[p] for p in range(self.process_count)]

    def gather(self, key: str, value: bytes) -> list[bytes] | None:
        if self.process_index != 0:
            self._post(key, value)
            return None
        got = self._collect(key, range(1, self.process_count))
        return [value] + [got[p] for p in range(1, self.process_count)]

    def broadcast(self, key: str, make: Callable[[], bytes]) -> bytes:
        if self.process_index == 0:
            try:
                value = make()
            except Exception as e:
                # Tell the others at once instead of leaving them to time out.
                self._post(key, _FAILED + f"{type(e).__name__}: {e}".encode())
                raise
            self._post(key, _OK + value)
            return value
        got = self._collect(key, [0])[0]
        if got[:1] == _FAILED:
            raise CheckpointError(f"process 0 failed at {self._phase(key)}: {got[1:].decode(errors='replace')}")
        return got[1:]

    def end_save(self, save_id: str) -> None:
        self._life.exit()
        with self._lock:
            broken = save_id in self._broken
            self._broken.discard(save_id)
        if broken:
            return
        try:
            finished = self._client.key_value_increment(f"{NAMESPACE}/{save_id}/finished", 1)
            if finished == self.process_count:  # everyone has read everything of this save
                self._client.key_value_delete(f"{NAMESPACE}/{save_id}")
        except Exception:  # cleanup only; a lost service is reported by the next exchange
            pass

    def watch(self, done: Callable[[], bool], key: str) -> None:
        """Wait until `done()` (a collective every process entered) while watching the others:
        one that shows no sign of life for ``CKPT_TIMEOUT_S`` (killed or stopped inside it) is
        named in a CheckpointError instead of a hang."""
        timeout = coordination_timeout()
        start = time.monotonic()
        others = [p for p in range(self.process_count) if p != self.process_index]
        now = start
        seen = {p: None for p in others}
        last = {p: start for p in others}
        pause = 0.0005
        failed: Exception | None = None  # the collective failed (a peer's connection closed, say)
        while True:
            if failed is None:
                try:
                    if done():
                        return
                except Exception as e:  # noqa: BLE001 (reported naming the peer that went away)
                    failed, pause = e, 0.05
            elif now - start > 2 * timeout:
                raise CheckpointError(f"{self._phase(key)} failed on process {self.process_index}: {failed}")
            time.sleep(pause)
            pause = min(0.05, 2 * pause)
            now = time.monotonic()
            if failed is None and (now - start < min(1.0, timeout / 5) or pause < 0.05):
                continue
            try:
                life = dict(self._client.key_value_dir_get(f"{NAMESPACE}/alive/"))
            except Exception as e:
                raise self._lost(key, e) from None
            silent = _silent({p: life.get(self._alive_key(p)) for p in others}, seen, last, now, timeout)
            if silent:
                self._mark_broken(key)
                raise CheckpointError(
                    f"process(es) {silent} showed no sign of life for {timeout:g} s ({TIMEOUT_ENV}) during "
                    f"{self._phase(key)}: crashed or hung (process {self.process_index} waited {now - start:.1f} s)"
                )

    # -- waiting -------------------------------------------------------------------------------

    @staticmethod
    def _alive_key(process: int) -> str:
        return f"{NAMESPACE}/alive/{process}"

    @staticmethod
    def _phase(key: str) -> str:
        save_id, _, phase = key.partition("/")
        what = "restore" if phase.startswith("restore") else "save"  # (restores of replicated leaves)
        return f"the {phase!r} phase of {what} {save_id}"

    def _post(self, key: str, value: bytes) -> None:
        try:
            self._client.key_value_set_bytes(f"{NAMESPACE}/{key}/{self.process_index}", value)
        except Exception as e:
            raise self._lost(key, e) from None

    def _lost(self, key: str, e: Exception) -> CheckpointError:
        self._mark_broken(key)
        return CheckpointError(
            f"process {self.process_index} lost the jax.distributed coordination service (hosted by "
            f"process 0) at {self._phase(key)}: {e}"
        )

    def _mark_broken(self, key: str) -> None:
        with self._lock:
            self._broken.add(key.split("/", 1)[0])

    def _collect(self, key: str, processes) -> dict[int, bytes]:
        """The values processes posted under `key`, waiting for them while they show signs of life.

        Each value is fetched once: one listing of the key's directory first (what is posted by
        then), then a blocking read of each value still missing, in turn. While waiting, only the
        counters of the processes still missing are read (one listing of them all while more
        than LIFE_LISTING are missing): a waiter costs the service O(1) per missing process and
        per slice, never the whole directory again (issue 23: at 1,024 processes the old loop
        re-read every status every second)."""
        timeout = coordination_timeout()
        directory = f"{NAMESPACE}/{key}/"
        wanted = set(processes)
        got: dict[int, bytes] = {}
        start = time.monotonic()
        seen_life: dict[int, str | None] = {p: None for p in wanted}
        last_life = {p: start for p in wanted}
        # A blocking read returns as soon as its key appears; the slice only sets how often the
        # missing processes' signs of life are looked at (a silence is seen within timeout/5).
        slice_ms = int(1000 * min(12.0, max(0.01, timeout / 5)))
        try:
            if len(wanted) > 1:
                for name, value in self._client.key_value_dir_get_bytes(directory):
                    p = int(name.rsplit("/", 1)[1])
                    if p in wanted:
                        got[p] = value
            while True:
                missing = sorted(wanted - got.keys())
                if not missing:
                    return got
                try:
                    got[missing[0]] = self._client.blocking_key_value_get_bytes(
                        f"{directory}{missing[0]}", slice_ms
                    )
                    continue
                except Exception as e:
                    if _status(e) != "DEADLINE_EXCEEDED":
                        raise
                now = time.monotonic()
                silent = _silent(self._life_of(missing), seen_life, last_life, now, timeout)
                if silent:
                    self._mark_broken(key)
                    raise CheckpointError(
                        f"process(es) {silent} did not reach {self._phase(key)} and showed no sign of "
                        f"life for {timeout:g} s ({TIMEOUT_ENV}): crashed or hung "
                        f"(process {self.process_index} waited {now - start:.1f} s)"
                    )
        except CheckpointError:
            raise
        except Exception as e:
            raise self._lost(key, e) from None

    def _life_of(self, missing: list[int]) -> dict[int, str | None]:
        """The life counters of the `missing` processes (None: never posted)."""
        if len(missing) > LIFE_LISTING:
            life = dict(self._client.key_value_dir_get(f"{NAMESPACE}/alive/"))
            return {p: life.get(self._alive_key(p)) for p in missing}
        out: dict[int, str | None] = {}
        for p in missing:
            try:
                out[p] = self._client.key_value_try_get(self._alive_key(p))
            except Exception as e:
                if _status(e) != "NOT_FOUND":
                    raise
                out[p] = None
        return out


_coordinator: DistributedCoordinator | None = None
_coordinator_client = None


def distributed_coordinator() -> DistributedCoordinator:
    """The coordinator of this process's jax.distributed job (one per client)."""
    global _coordinator, _coordinator_client
    import jax
    from jax._src.distributed import global_state

    client = global_state.client
    if client is None:
        raise CheckpointError(
            f"jax reports {jax.process_count()} processes but jax.distributed is not initialized in "
            "this process; ckpt coordinates multi-process saves through jax.distributed.initialize()"
        )
    if _coordinator is None or _coordinator_client is not client:
        _coordinator = DistributedCoordinator(client, jax.process_index(), jax.process_count())
        _coordinator_client = client
    return _coordinator
