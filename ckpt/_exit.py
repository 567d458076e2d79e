"""One exit hook for the whole library: what must finish when the program's main thread ends
(managers never closed: their save in flight and deletions; then saves nobody waited for), run
before concurrent.futures stops accepting work and before the interpreter joins its threads.
``atexit`` would run too late: the I/O pools are shut down by then and a save fails.

Registered once, when this module is imported: threading runs its exit hooks last registered
first, and concurrent.futures' own hook (which stops the pools) is imported first so that it runs
after ours. Hooks run in the order of their `rank` (managers 0, saves 1): a manager's pending
save is one of the saves, and the manager finishes its deletions after it.
"""

from __future__ import annotations

# Imported before our hook is registered, so that its hook (which stops the shared I/O pools)
# runs after ours.
import concurrent.futures.thread  # noqa: F401
import sys
import threading
from typing import Callable

# Seconds the exit waits for work still running before it says so on stderr (a manager's save,
# a save nobody waited for): long enough that a save about to commit is not announced.
EXIT_NOTICE_S = 2.0

_hooks: list[tuple[int, Callable[[], None]]] = []
_lock = threading.Lock()


def on_exit(hook: Callable[[], None], rank: int) -> None:
    """Run `hook` when the main thread ends (see the module docstring), after the hooks of lower
    `rank`. A hook should not raise; if it does, its error is printed and the others still run."""
    with _lock:
        _hooks.append((rank, hook))
        _hooks.sort(key=lambda h: h[0])


def _run() -> None:
    with _lock:
        hooks = [hook for _, hook in _hooks]
    for hook in hooks:
        try:
            hook()
        except BaseException as e:  # noqa: BLE001 (the other hooks must still run)
            try:
                print(f"jax-ckpt: at exit: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            except BaseException:  # noqa: BLE001
                pass


try:
    threading._register_atexit(_run)
except (AttributeError, RuntimeError):  # another Python; or imported while the interpreter exits
    pass
