"""Helpers shared by several test modules."""

import threading

from ckpt._storage import TensorStoreEngine


class WriteGate:
    """Holds every chunk write of the storage engine until the test releases it."""

    def __init__(self, monkeypatch):
        self.entered = threading.Event()
        self.release = threading.Event()
        real_write = TensorStoreEngine.write

        def gated_write(engine, handle, box, data):
            self.entered.set()
            if not self.release.wait(60):
                raise TimeoutError("the test never released the write gate")
            return real_write(engine, handle, box, data)

        monkeypatch.setattr(TensorStoreEngine, "write", gated_write)
