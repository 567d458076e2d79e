"""Preemption notices for the CheckpointManager.

Multi-process jobs use JAX's preemption sync point (``multihost_utils.reached_preemption_sync_point``,
which needs ``jax.distributed``): it says True at the same step on every process. A single-process
job has no such service, so the manager watches SIGTERM itself (what schedulers send before they
kill a job): the handler only records the notice; the manager's next ``save`` saves that step
whatever the interval and returns once it (and the manager's deletions) are done, with
``reached_preemption(step)`` True: the training loop's own code decides to stop. The notice is
then consumed: a Python handler installed before ours gets it (it may end the process its own
way); the default action (ending the process) is not taken, since killing the process inside
``save`` would cut off the loop's own ending (and its exit status). The previous handler is put
back, so a later SIGTERM does what it did before. A notice no save consumed when the last watching
manager closes is handed on then (the default action included); a second SIGTERM while one is
held is handed on at once. At interpreter exit nothing is handed on: the process is ending.
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


def _on_sigterm(signum, frame) -> None:
    if _received.is_set() or not len(_watchers):
        # A second notice (the sender insists), or no manager left to save (all were collected
        # without close()): the signal does now what it did before.
        _received.set()
        hand_on()
        return
    _received.set()


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
