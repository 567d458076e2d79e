"""jax-ckpt: sharded checkpoints for JAX as plain Zarr v3 arrays plus a msgpack manifest.

Public API:
    save(path, tree, *, overwrite=False, options=None, host_budget_bytes=None, max_chunk_bytes=None)
    save_async(path, tree, *, overwrite=False, options=None, host_budget_bytes=None,
               max_chunk_bytes=None) -> SaveHandle   (.wait(timeout=None), .done(), .cancel();
               a save not waited for finishes before the interpreter exits)
    restore(path, target=None, *, mesh=None, partial=False, verify=True, options=None,
            host_budget_bytes=None, allow_lossy_cast=False, axis_names=None, rename=None)
            (ckpt.surgery: stack, unstack, transpose, concat, split: the parts rename= takes)
    metadata(path, *, options=None)
    convert(src, dest, *, overwrite=False, options=None)   (an Orbax checkpoint -> jax-ckpt)
    CheckpointManager(directory, ..., options=None)
    release_host_memory()   (free the staging buffers kept between saves)
    Options, ArrayMetadata, SaveHandle, CheckpointError, TreeMismatchError, ChecksumError

Locations are local paths or URLs (file://, memory://, s3://, gs://, any fsspec URL); the
storage engines behind them live in ckpt.storage (docs/storage.md).
"""

from ckpt._convert import convert
from ckpt._errors import CheckpointError, ChecksumError, TreeMismatchError
from ckpt._manager import CheckpointManager
from ckpt._host import Options
from ckpt._restore import ArrayMetadata, metadata, restore
from ckpt._save import SaveHandle, release_host_memory, save, save_async
from ckpt._version import __version__

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
    "release_host_memory",
    "restore",
    "save",
    "save_async",
]
