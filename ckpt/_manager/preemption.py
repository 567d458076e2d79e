"""Preemption notices for the CheckpointManager: a notice is never swallowed.

Under ``jax.distributed`` JAX's preemption service takes SIGTERM (its notifier, in C++) and turns
it into a sync point, ``multihost_utils.reached_preemption_sync_point(step)``, True at the same
step on every process: the manager only asks it (``reached_preemption``), so a loop asking the
sync point itself (MaxText) and a loop asking the manager both get the notice. The manager
installs no handler of its own there: it would take the signal from JAX.

Without it (a single process, no ``jax.distributed``), the manager watches SIGTERM itself (what
schedulers send before they kill a job), from its first save, from the main thread. The handler
records the notice and decides who will act on it:

- The loop *listens* when it asked ``reached_preemption`` itself, or called the manager at two
  consecutive steps, most recently (it calls ``save`` at every step, as documented): the notice
  is held, and the next ``save`` saves that step whatever the interval and returns once it (and
  the manager's deletions) are committed. Then, if the loop asks ``reached_preemption``, it gets
  True and ends on its own (its exit status, its own cleanup): the notice is consumed (a Python
  handler installed before ours still gets it). If it never asks, the notice is handed on: the
  signal does what it would have done (by default the process ends, exit status 143).
- Otherwise nothing will save soon (the loop calls the manager only at the steps it saves): the
  notice is handed on at once, after any save in flight commits; holding it would only keep the
  job training past the scheduler's grace period.

The previous handler is put back when the notice is consumed or handed on, so a later SIGTERM
does what it did before. A second SIGTERM while one is held is handed on at once. A notice no
save consumed when the last watching manager closes is handed on then, unless the loop was told
(``reached_preemption`` said True). At interpreter exit nothing is handed on: the process is
ending.
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from typing import Any

_lock = threading.RLock()  # re-entrant: the signal handler runs on the main thread, maybe inside a `with _lock`
_watchers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # managers watching (a leaked one drops out when collected)
_previous: Any = None  # the handler before ours, restored when the last watcher leaves
_received = threading.Event()


def jax_service() -> bool:
    """Whether JAX's preemption service runs in this process (``jax.distributed`` is
    initialized): it then owns SIGTERM."""
    from jax._src.distributed import global_state

    return getattr(global_state, "preemption_sync_manager", None) is not None


def _on_sigterm(signum, frame) -> None:
    watchers = list(_watchers)
    if _received.is_set() or not watchers:
        # A second notice (the sender insists), or no manager left to save (all were collected
        # without close()): the signal does now what it did before.
        _received.set()
        hand_on()
        return
    _received.set()
    if not any(m._listens_for_preemption() for m in watchers):
        _hand_on_after(list(filter(None, (m._save_in_flight() for m in watchers))))


def _hand_on_after(saves: list[threading.Event]) -> None:
    """Hand the notice on once `saves` (the saves in flight) have finished: at once when there
    are none; else from a thread that sends the signal again then (the handler, seeing a notice
    already held, hands it on from the main thread, where signal handlers can be changed)."""
    if not saves:
        hand_on()
        return

    def resend() -> None:
        for finished in saves:
            finished.wait()
        with _lock:
            if _received.is_set():  # not consumed meanwhile by a save that answered it
                os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=resend, name="ckpt-preemption-hand-on", daemon=True).start()


def watch(manager: Any) -> bool:
    """Start watching SIGTERM for `manager`; False where signals cannot be handled here (not the
    main thread, or a platform without SIGTERM)."""
    global _previous
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        return False
    with _lock:
        # (Re)install when the handler is not ours: someone may have replaced it since.
        if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
            try:
                _previous = signal.signal(signal.SIGTERM, _on_sigterm)
            except (ValueError, OSError):
                return False
        _watchers.add(manager)
    return True


def received() -> bool:
    """Whether SIGTERM arrived and has not been handed on yet."""
    return _received.is_set()


_NO_NOTICE = object()


def _take_notice():
    """Stop holding a received SIGTERM (every manager stops watching, the previous handler is put
    back); the handler that was there before ours, or _NO_NOTICE when none was received."""
    with _lock:
        if not _received.is_set():
            return _NO_NOTICE
        _received.clear()
        _watchers.clear()
        previous = _previous
        _restore_previous()
    return previous


def hand_on() -> None:
    """Give a received SIGTERM to the handler that was there before ours (every manager stops
    watching)."""
    previous = _take_notice()
    if previous is _NO_NOTICE:
        return
    if callable(previous):
        previous(signal.SIGTERM, None)
    elif previous in (signal.SIG_DFL, None):
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends
    # SIG_IGN: the notice is dropped, as it would have been without us.


def consume() -> None:
    """A save answered the notice (the preemption step is committed): stop holding it. A Python
    handler installed before ours gets it now; the default action (the process ends) is left to
    the training loop, which sees ``reached_preemption``; SIG_IGN drops it. Every manager stops
    watching and the previous handler is put back."""
    previous = _take_notice()
    if previous is _NO_NOTICE:
        return
    if callable(previous):
        previous(signal.SIGTERM, None)


def unwatch(manager: Any, *, hand_on_notice: bool = True) -> None:
    """`manager` stops watching (close): the last one puts the previous handler back, and hands
    on a notice that no save consumed (unless `hand_on_notice` is False: at interpreter exit,
    where the process is ending anyway and a late kill would only change its exit status)."""
    with _lock:
        if manager not in _watchers:
            return
        _watchers.discard(manager)
        if len(_watchers):
            return
        pending = _received.is_set() and hand_on_notice
        if not pending:
            _received.clear()
            _restore_previous()
    if pending:
        hand_on()


def _restore_previous() -> None:
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
