"""Cyclic garbage collection paused while a save or restore builds its per-leaf objects.

A tree of thousands of leaves makes tens of thousands of short-lived containers (records, plans,
boxes, futures), which trigger the collector's full collections; each walks every object of the
process, about 0.1 s in a process that has imported JAX, and a 4,000-leaf save or restore paid
one or two of them (docs/benchmarks.md, "Many small leaves"). Reference counting frees these
objects anyway; the collector runs again, as usual, once the call returns.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """Disable the cyclic collector for the block (or decorated call), if it was enabled."""
    if not gc.isenabled():  # the caller turned it off: leave that alone
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
