"""A manifest's bytes: decoded and validated (``decode_manifest``), and read from a location
(``read_manifest``: the commit point of a checkpoint, with the errors readers expect)."""

from __future__ import annotations

import errno
import re
from typing import Protocol

import msgpack

from ckpt._errors import CheckpointError
from ckpt._format.records import (FORMAT_NAME, FORMAT_VERSION, GENERATION_MARK, MANIFEST_NAME, Manifest, check_seal,
                                  is_temp_name)
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
    resolved_name: str

    def get(self, key: str, *, max_bytes: int) -> bytes: ...
    def where(self, key: str) -> str: ...
    def exists(self, key: str) -> bool: ...


def find_manifest(storage: Location) -> Manifest | None:
    """The manifest of the committed checkpoint at `storage` (checked against its own checksum and
    validated), or None where there is no manifest object (nothing there, a plain file, a
    directory without one): one GET, the first request of every restore. A ``.tmp-`` directory
    is refused whatever it holds (also when reached through a link)."""
    if is_temp_name(storage.url.rstrip("/").rsplit("/", 1)[-1]) or is_temp_name(storage.resolved_name):
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
    if not storage.exists(""):
        raise FileNotFoundError(errno.ENOENT, "no checkpoint at this path", storage.url)
    if not _holds_save_files(storage):
        # A folder of other files (the wording of `ckpt ls`): nothing suggests a save was here.
        raise CheckpointError(f"{storage.url} is neither a checkpoint (no {MANIFEST_NAME}) nor a manager directory "
                              "(no step entries: step_<n>, <n>, <prefix>_<n>)")
    raise CheckpointError(
        f"{storage.url} is not a committed checkpoint: it has no {MANIFEST_NAME}; a save may not have committed"
    )


def _holds_save_files(storage: Location) -> bool:
    """Whether `storage` may hold a save that did not commit: generation prefixes (object
    stores), the root group's zarr.json, the library's '~' directories (~data, ~index, ~stacks),
    hidden records (owner, lease), entries named as steps, or nothing at all. True where it
    cannot be listed (the message then stays the cautious one)."""
    list_dir = getattr(storage, "list_dir", None)
    if list_dir is None:
        return True
    try:
        files, dirs = list_dir("")
    except Exception:  # noqa: BLE001 (any failure: keep the cautious message)
        return True
    return (not (files or dirs) or any(d.startswith((GENERATION_MARK, ".", "~")) or _STEP_LIKE.match(d) for d in dirs)
            or any(f == "zarr.json" or f.startswith(".") for f in files))


# Names of step entries (jax-ckpt's and Orbax's, committed or being written): step_00000100, 100,
# checkpoint_100, with a temporary suffix.
_STEP_LIKE = re.compile(r"^(?:.+_)?\d+(?:\..*)?$")
