"""Storage: everything that touches bytes, locations, listing and deletion (docs/storage.md).

``open_storage(location, options)`` picks the engine for a location: ``local`` (a POSIX
directory: direct I/O, rename commit), ``tensorstore`` (any TensorStore kvstore: memory, s3,
gcs, file) or ``fsspec`` (zarr-python's FsspecStore over any fsspec file system). All share the
``Storage`` interface (bytes only); the commit built on it is ``ckpt._commit``'s.
"""

from ckpt._format import GENERATION_MARK, MANIFEST_NAME, TEMP_MARK, ArraySpec, is_temp_name
from ckpt._host import aligned_empty
from ckpt._errors import NotDurableError, OutcomeUnknownError
from ckpt.storage._base import ChunkFiles, LocalDirectory, Storage, StoreCaps
from ckpt.storage._location import ENGINES, default_engine, location_text, make_dirs, name_of, open_storage, pinned, usage
from ckpt.storage._wrapper import WrapperStorage

# The door's internal side: what other layers of ckpt use besides the public names below.
from ckpt.storage._base import Done  # noqa: E402,F401
from ckpt.storage._local import fsync_path  # noqa: E402,F401
from ckpt.storage._location import scheme_of, tensorstore_spec  # noqa: E402,F401
from ckpt.storage._confine import check_local_key  # noqa: E402,F401  (ckpt verify: no data object behind a link)

__all__ = [
    "ENGINES", "GENERATION_MARK", "MANIFEST_NAME", "TEMP_MARK", "ArraySpec", "NotDurableError",
    "OutcomeUnknownError", "ChunkFiles", "LocalDirectory", "Storage", "StoreCaps", "WrapperStorage", "aligned_empty", "default_engine", "is_temp_name",
    "location_text", "make_dirs", "name_of", "open_storage", "pinned", "usage",
]
