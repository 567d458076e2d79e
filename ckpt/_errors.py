"""Exceptions raised by ckpt. All derive from CheckpointError, except the standard
FileExistsError / FileNotFoundError for paths that exist or are missing."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every ckpt error: a checkpoint that is not one, is damaged, or does not
    fit what was asked (its message names the leaf, chunk, file or process at fault).

    Storage failures are ``OSError`` (``FileNotFoundError`` for a missing path,
    ``FileExistsError`` for a save onto an existing checkpoint), not subclasses of this.
    """


class TreeMismatchError(CheckpointError):
    """The target tree of a restore does not match the saved tree.

    Args:
        missing: saved key paths the target lacks.
        unexpected: target key paths that were never saved.

    Attributes:
        missing: saved key paths the target lacks (empty with ``partial=True``).
        unexpected: target key paths that were never saved.
    """

    def __init__(self, missing: list[str], unexpected: list[str]):
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        lines = ["target tree does not match the saved tree"]
        if self.missing:
            lines.append(f"  missing from target ({len(self.missing)}): " + ", ".join(self.missing))
        if self.unexpected:
            lines.append(f"  not in checkpoint ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        if self.missing and not self.unexpected:
            lines.append("  (pass partial=True to restore a subset)")
        super().__init__("\n".join(lines))


class ChecksumError(CheckpointError):
    """A chunk's bytes do not match the CRC-32C recorded when it was saved.

    Args:
        leaf: the leaf's key path.
        chunk: the chunk's index in the array's chunk grid.
        file: the chunk file's location.
        detail: what was found, for the message.

    Attributes:
        leaf: the leaf's key path.
        chunk: the chunk's index in the array's chunk grid.
        file: the chunk file's location.
    """

    def __init__(self, leaf: str, chunk: tuple[int, ...], file: str, detail: str):
        self.leaf, self.chunk, self.file = leaf, tuple(chunk), file
        super().__init__(f"leaf {leaf!r}, chunk {list(chunk)} ({file}): {detail}")


class NotDurableError(CheckpointError):
    """The checkpoint WAS committed (it is in place and readable), but making the commit durable
    failed (an fsync after the rename): a crash now could still lose it."""

    committed = True


class OutcomeUnknownError(CheckpointError):
    """A write whose outcome cannot be told: it failed in a way that may have landed (an answer
    lost, a timeout), and reading the object back failed too. For a manifest: the checkpoint may
    or may not be committed, and nothing the save wrote was deleted (docs/storage.md, "What a
    save's error means")."""

    committed = None
