"""jax-ckpt: sharded checkpoints for JAX as plain Zarr v3 arrays plus a msgpack manifest.

Public API:
    save(path, tree, *, overwrite=False)
    save_async(path, tree, *, overwrite=False) -> SaveHandle
    restore(path, target=None, *, mesh=None, partial=False, verify=True)
    metadata(path)
    CheckpointManager(directory, ...)
    ArrayMetadata, SaveHandle, CheckpointError, TreeMismatchError, ChecksumError
"""

__version__ = "0.1.0"

from ckpt._errors import CheckpointError, ChecksumError, TreeMismatchError
from ckpt._manager import CheckpointManager
from ckpt._metadata import ArrayMetadata, metadata
from ckpt._restore import restore
from ckpt._save import SaveHandle, save, save_async

__all__ = [
    "ArrayMetadata",
    "CheckpointError",
    "CheckpointManager",
    "ChecksumError",
    "SaveHandle",
    "TreeMismatchError",
    "metadata",
    "restore",
    "save",
    "save_async",
]
