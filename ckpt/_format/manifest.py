"""A manifest's bytes: decoded and validated (``decode_manifest``), and read from a location
(``read_manifest``: the commit point of a checkpoint, with the errors readers expect)."""

from __future__ import annotations

import errno
from typing import Protocol

import msgpack

from ckpt._errors import CheckpointError
from ckpt._format.records import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest, check_seal, is_temp_name
from ckpt._format.validate import manifest_from_doc

# A manifest holds one record per leaf plus arrays of at most INLINE_LIMIT bytes; nothing a
# real tree produces comes near this, and nothing larger is ever read.
MANIFEST_LIMIT_BYTES = 1 << 30


def unpack_map_keys(data: bytes) -> object:
    """msgpack `data` as Python values, maps in their stored order; a map key stored as an
    array (a tuple key of the user metadata) comes back as a tuple, where msgpack's default
    would make it an unhashable list and fail. The default decoder runs first: only data that
    holds such a key pays for the Python hook."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except TypeError:  # unhashable type: 'list' (an array as a map key)
        return msgpack.unpackb(data, raw=False, strict_map_key=False,
                               object_pairs_hook=lambda pairs: {_hashable(k): v for k, v in pairs})


def _hashable(key: object) -> object:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def decode_manifest(data: bytes, where: str) -> Manifest:
    """The validated manifest in `data` (the bytes of `where`, a manifest file); raises
    CheckpointError naming the file when it is damaged or breaks the format."""
    try:
        doc = unpack_map_keys(data)
    except Exception as e:  # any malformed input: msgpack raises several kinds
        raise CheckpointError(f"{where}: manifest is corrupted ({type(e).__name__}: {e})") from None
    # Format and version first: a newer version may protect itself differently.
    if isinstance(doc, dict) and doc.get("format") == FORMAT_NAME and isinstance(doc.get("format_version"), int) \
            and not isinstance(doc.get("format_version"), bool) and 1 <= doc["format_version"] <= FORMAT_VERSION:
        check_seal(data, doc, where)
    return manifest_from_doc(doc, where)


def check_manifest(manifest: Manifest, where: str) -> Manifest:
    """The manifest as a reader would get it back from its encoding (validated and typed)."""
    return decode_manifest(manifest.encode(), where)


class Location(Protocol):
    """What reading a manifest needs of a location (``ckpt.storage.Storage`` is one): this layer
    does no I/O of its own."""

    url: str
    name: str
    resolved_name: str

    def get(self, key: str, *, max_bytes: int) -> bytes: ...
    def where(self, key: str) -> str: ...
    def exists_any(self) -> bool: ...


def find_manifest(storage: Location) -> Manifest | None:
    """The manifest of the committed checkpoint at `storage` (checked against its own checksum and
    validated), or None where there is no manifest object (nothing there, a plain file, a
    directory without one): one GET, the first request of every restore. A ``.tmp-`` directory
    is refused whatever it holds (also when reached through a link)."""
    if is_temp_name(storage.name) or is_temp_name(storage.resolved_name):
        raise CheckpointError(
            f"{storage.url} is not a committed checkpoint: it is the temporary directory of a save that never committed"
        )
    try:
        data = storage.get(MANIFEST_NAME, max_bytes=MANIFEST_LIMIT_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise CheckpointError(f"{storage.where(MANIFEST_NAME)} is not a file") from None
    return decode_manifest(data, storage.where(MANIFEST_NAME))


def read_manifest(storage: Location) -> Manifest:
    """``find_manifest``, with the error readers expect where there is no manifest: nothing at
    the location (FileNotFoundError), a file, or a directory a save never committed."""
    manifest = find_manifest(storage)
    if manifest is not None:
        return manifest
    try:
        storage.get(MANIFEST_NAME, max_bytes=MANIFEST_LIMIT_BYTES)
    except NotADirectoryError:
        raise CheckpointError(f"{storage.url} is not a checkpoint directory") from None
    except FileNotFoundError:
        pass
    if not storage.exists_any():
        raise FileNotFoundError(errno.ENOENT, "no checkpoint at this path", storage.url)
    raise CheckpointError(
        f"{storage.url} is not a committed checkpoint: it has no {MANIFEST_NAME}; a save may not have committed"
    )
