"""Storage: everything that touches bytes, locations, listing and deletion (docs/storage.md).

``open_storage(location, options)`` picks the engine for a location: ``local`` (a POSIX
directory: direct I/O, rename commit), ``tensorstore`` (any TensorStore kvstore: memory, s3,
gcs, file) or ``fsspec`` (zarr-python's FsspecStore over any fsspec file system). All share the
``Storage`` interface and the commit defined in ``_base``.
"""

from ckpt._format import GENERATION_MARK, MANIFEST_NAME, TEMP_MARK, ArraySpec, is_temp_name
from ckpt._memory import aligned_empty
from ckpt.storage._base import NotDurableError, OutcomeUnknownError, Staged, Storage
from ckpt.storage._location import ENGINES, default_engine, location_text, open_storage
from ckpt.storage._owners import Leftover
from ckpt.storage._packed import PackWriter
from ckpt.storage._wrapper import WrapperStorage

# The door's internal side: what other layers of ckpt use besides the public names below.
from ckpt.storage._base import Done  # noqa: E402,F401
from ckpt.storage._chunk_files import fsync_path  # noqa: E402,F401
from ckpt.storage._location import scheme_of, tensorstore_spec  # noqa: E402,F401
from ckpt.storage._owners import OWNER_LIMIT_BYTES, OWNER_NAME, SaveLock, owner_gone, parse_owner  # noqa: E402,F401

__all__ = [
    "ENGINES", "GENERATION_MARK", "MANIFEST_NAME", "TEMP_MARK", "ArraySpec", "Leftover", "NotDurableError",
    "OutcomeUnknownError", "PackWriter", "Staged", "Storage", "WrapperStorage", "aligned_empty", "default_engine", "is_temp_name",
    "location_text", "open_storage",
]
