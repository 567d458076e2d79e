"""Chunk checksums: CRC-32C (Castagnoli) of a chunk file's bytes.

Chosen by measurement (bench/, docs/design.md): hardware CRC-32C runs at ~15 GiB/s per
core here and releases the GIL, so checking every chunk costs a few percent of a disk-bound
restore. It is also the checksum S3, GCS and Zarr's own crc32c codec use, so anyone can check
a chunk file with stock tools. Computing it on the host copy at save time costs no extra read.
"""

from __future__ import annotations

import crc32c
import numpy as np

ALGORITHM = "crc32c"


def chunk_checksum(storage_array: np.ndarray) -> int:
    """CRC-32C of the bytes of a C-contiguous, little-endian storage array (= the chunk file)."""
    return crc32c.crc32c(np.ascontiguousarray(storage_array).reshape(-1).view(np.uint8))

