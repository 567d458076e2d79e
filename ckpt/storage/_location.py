"""From a location the user gives (a path, a URL, a pathlib or etils.epath object) to a Storage.

Default engine per scheme: a local path or ``file://`` -> ``local``; ``memory://``, ``s3://``,
``gs://`` -> ``tensorstore``; any other scheme fsspec knows -> ``fsspec``.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlparse

from ckpt._errors import CheckpointError
from ckpt._options import Options
from ckpt.storage._base import Storage

TENSORSTORE_SCHEMES = ("memory", "s3", "gs")
ENGINES = ("local", "tensorstore", "fsspec")


def location_text(location: Any) -> str:
    """The location as text: local paths made absolute (``~`` expanded), URLs kept."""
    if isinstance(location, Storage):
        return location.url
    if isinstance(location, bytes):
        location = os.fsdecode(location)
    if not isinstance(location, str):
        if hasattr(location, "__fspath__"):
            try:
                location = os.fspath(location)
            except Exception:  # e.g. an epath object for a remote path
                location = str(location)
        elif hasattr(location, "as_uri") or type(location).__name__.endswith("Path"):
            location = str(location)
        else:
            raise TypeError(f"a checkpoint location is a path or URL string, got {type(location).__name__}")
    text = location.strip()
    if not text:
        raise CheckpointError("empty checkpoint location")
    if "://" not in text:
        return os.path.abspath(os.path.expanduser(text))
    scheme, rest = text.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        url = urlparse(text)
        if url.netloc not in ("", "localhost"):
            raise CheckpointError(
                f"file:// URL {text!r} names host {url.netloc!r}; only file:///path or file://localhost/path "
                "are local files"
            )
        return os.path.abspath(os.path.expanduser(unquote(url.path)))
    return f"{scheme}://{rest.rstrip('/')}"


def _scheme(text: str) -> str:
    return text.split("://", 1)[0] if "://" in text else "file"


def _fsspec_protocols() -> list[str]:
    import fsspec

    return sorted(set(fsspec.available_protocols()))


def _unsupported(text: str) -> CheckpointError:
    return CheckpointError(
        f"unsupported checkpoint location {text!r}: use a local path, file://, memory://, s3://, gs://, "
        f"or another fsspec protocol ({', '.join(p for p in _fsspec_protocols() if p not in ('file', 'memory'))})"
    )


def default_engine(text: str) -> str:
    scheme = _scheme(text)
    if scheme == "file":
        return "local"
    if scheme in TENSORSTORE_SCHEMES:
        return "tensorstore"
    if scheme in _fsspec_protocols():
        return "fsspec"
    raise _unsupported(text)


def _tensorstore_spec(text: str, storage_options: dict) -> tuple[dict, str]:
    """(kvstore spec, context kind) for a location the tensorstore engine serves."""
    scheme = _scheme(text)
    if scheme == "file":
        return {"driver": "file", "path": text.rstrip("/") + "/", **storage_options}, "file"
    rest = text.split("://", 1)[1]
    if scheme == "memory":
        path = rest.strip("/")
        return {"driver": "memory", "path": path + "/" if path else "", **storage_options}, "memory"
    bucket, _, path = rest.partition("/")
    path = path.strip("/")
    spec = {"bucket": bucket, "path": path + "/" if path else ""}
    if scheme == "s3":
        spec["driver"] = "s3"
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
        return {**spec, **storage_options}, "s3"
    if scheme == "gs":
        return {**spec, "driver": "gcs", **storage_options}, "gcs"
    import tensorstore as ts

    try:  # any other kvstore URL TensorStore understands
        other = ts.KvStore.Spec(text.rstrip("/") + "/").to_json()
    except Exception:
        raise CheckpointError(f"the tensorstore engine does not serve {scheme}:// locations (use engine='fsspec')") from None
    return {**other, **storage_options}, str(other.get("driver", scheme))


def open_storage(location: Any, options: Options) -> Storage:
    """The Storage of `location` with the engine `options` choose (options already resolved)."""
    if isinstance(location, Storage):
        return location
    text = location_text(location)
    engine = options.engine
    if callable(engine):
        storage = engine(text, options)
        if not isinstance(storage, Storage):
            raise TypeError(f"engine factory returned {type(storage).__name__}, not a ckpt Storage")
        return storage
    engine = engine or default_engine(text)
    if engine not in ENGINES:
        raise ValueError(f"unknown storage engine {engine!r}; engines: {', '.join(ENGINES)}")
    storage_options = dict(options.storage_options or {})
    concurrency = options.io_concurrency
    if engine == "local":
        if _scheme(text) != "file":
            raise CheckpointError(f"the local engine serves local paths and file:// URLs, not {text!r}")
        from ckpt.storage._local import LocalStorage

        return LocalStorage(text, concurrency)
    if engine == "tensorstore":
        from ckpt.storage._tensorstore import TensorStoreStorage, shared_context

        spec, kind = _tensorstore_spec(text, storage_options)
        return TensorStoreStorage(spec, text, shared_context(kind, concurrency))
    import fsspec

    scheme = _scheme(text)
    if scheme not in _fsspec_protocols():
        raise _unsupported(text)
    url = text if "://" in text else "file://" + text
    if scheme == "file":
        storage_options.setdefault("auto_mkdir", True)
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as e:
        raise CheckpointError(f"the fsspec engine needs a package for {scheme}:// locations: {e}") from None
    from ckpt.storage._fsspec import FsspecStorage

    return FsspecStorage(fs, path, text, concurrency)
