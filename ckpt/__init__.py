"""jax-ckpt: sharded checkpoints for JAX as plain Zarr v3 arrays plus a msgpack manifest.

Public API:
    save(path, tree, *, overwrite=False, options=None)
    save_async(path, tree, *, overwrite=False, options=None) -> SaveHandle
    restore(path, target=None, *, mesh=None, partial=False, verify=True, options=None)
    metadata(path, *, options=None)
    convert(src, dest, *, overwrite=False, options=None)   (an Orbax checkpoint -> jax-ckpt)
    CheckpointManager(directory, ..., options=None)
    Options, ArrayMetadata, SaveHandle, CheckpointError, TreeMismatchError, ChecksumError

Locations are local paths or URLs (file://, memory://, s3://, gs://, any fsspec URL); the
storage engines behind them live in ckpt.storage (docs/storage.md).
"""

__version__ = "0.1.0"

from ckpt._convert import convert
from ckpt._errors import CheckpointError, ChecksumError, TreeMismatchError
from ckpt._manager import CheckpointManager
from ckpt._metadata import ArrayMetadata, metadata
from ckpt._options import Options
from ckpt._restore import restore
from ckpt._save import SaveHandle, save, save_async

__all__ = [
    "ArrayMetadata",
    "CheckpointError",
    "CheckpointManager",
    "ChecksumError",
    "Options",
    "SaveHandle",
    "TreeMismatchError",
    "convert",
    "metadata",
    "restore",
    "save",
    "save_async",
]
