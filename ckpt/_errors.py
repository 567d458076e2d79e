"""Exceptions raised by ckpt. All derive from CheckpointError, except the standard
FileExistsError / FileNotFoundError for paths that exist or are missing."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every ckpt error."""


class TreeMismatchError(CheckpointError):
    """The target tree does not match the saved tree.

    ``missing`` lists saved key paths the target lacks; ``unexpected`` lists target key paths
    that were never saved.
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
    """A chunk's bytes do not match the checksum recorded when it was saved."""

    def __init__(self, leaf: str, chunk: tuple[int, ...], file: str, detail: str):
        self.leaf, self.chunk, self.file = leaf, tuple(chunk), file
        super().__init__(f"leaf {leaf!r}, chunk {list(chunk)} ({file}): {detail}")
