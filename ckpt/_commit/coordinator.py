"""The processes of a job agreeing on one save: the ``Coordinator`` the save and commit steps
talk through (a local one for a single process; the jax.distributed key-value store in
``ckpt._distributed`` for many)."""

from __future__ import annotations

from typing import Callable, Protocol


class Coordinator(Protocol):
    """What the save and commit steps need from the processes of a job."""

    process_index: int
    process_count: int

    def new_save_id(self) -> str:
        """An id for the next save; every process gets the same one for the same save.
        Each call is matched by one ``end_save`` once this process is done with the save."""

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        """Every process's `value`, by process index. Raises naming processes that never sent.
        `key` is ``<save id>/<step>``, used once per save."""

    def gather(self, key: str, value: bytes) -> list[bytes] | None:
        """Every process's `value`, by process index, on the primary (process 0); None on the
        others, which do not wait. Raises on the primary naming processes that never sent."""

    def broadcast(self, key: str, make: Callable[[], bytes]) -> bytes:
        """The primary's `make()`, on every process (if it raises there, the others raise too)."""

    def end_save(self, save_id: str) -> None:
        """This process made its last exchange of `save_id` (or gave up on the save)."""


class LocalCoordinator:
    """The coordinator of a single-process job."""

    process_index = 0
    process_count = 1

    def __init__(self) -> None:
        self._count = 0

    def new_save_id(self) -> str:
        self._count += 1
        return str(self._count)

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        return [value]

    def gather(self, key: str, value: bytes) -> list[bytes] | None:
        return [value]

    def broadcast(self, key: str, make: Callable[[], bytes]) -> bytes:
        return make()

    def end_save(self, save_id: str) -> None:
        pass


_local = LocalCoordinator()


def current_coordinator() -> Coordinator:
    import jax

    if jax.process_count() == 1:
        return _local
    from ckpt._distributed import distributed_coordinator

    return distributed_coordinator()
