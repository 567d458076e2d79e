"""From a location the user gives (a path, a URL, a pathlib or etils.epath object) to a Storage.

Default engine per scheme: a local path or ``file://`` -> ``local``; ``memory://``, ``s3://``,
``gs://`` -> ``tensorstore``; any other scheme fsspec knows -> ``fsspec``.

Object stores take their endpoint, region and credentials from the places their own tools read
(docs/storage.md, "S3 and GCS"): ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, the AWS credential chain (``AWS_ACCESS_KEY_ID``..., ``~/.aws``), and for GCS
application-default credentials or an emulator named by ``STORAGE_EMULATOR_HOST``. Requests are
retried a bounded number of times (``OBJECT_STORE_RETRIES``), so that a server that keeps failing
is an error within seconds instead of TensorStore's default of minutes. ``storage_options``
entries override all of it.

The environment is only read here, never written: every setting reaches its library explicitly
(a kvstore spec, fsspec storage options, the file-system class opened). The one setting that
has no explicit route, TensorStore's GCS endpoint, is the user's to set (``gcs_emulator_check``).

"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Any
from urllib.parse import unquote, urlparse

from ckpt._errors import CheckpointError
from ckpt._host import ENGINE_NAMES, REQUEST_TIMEOUT_S, Options
from ckpt.storage._base import Storage, Usage

TENSORSTORE_SCHEMES = ("memory", "s3", "gs")
ENGINES = ENGINE_NAMES


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


def scheme_of(text: str) -> str:
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
    scheme = scheme_of(text)
    if scheme == "file":
        return "local"
    if scheme in TENSORSTORE_SCHEMES:
        return "tensorstore"
    if scheme in _fsspec_protocols():
        return "fsspec"
    raise _unsupported(text)


# TensorStore's own default is 32 retries with delays up to 32 s: about 9 minutes before a server
# that answers every request with an error (or none at all) surfaces as one. Six retries, 0.1 s
# doubling to at most 5 s, ride out a restart of a few seconds and fail in about 7 s otherwise.
OBJECT_STORE_RETRIES = {"max_retries": 6, "initial_delay": "100ms", "max_delay": "5s"}
S3FS_RETRIES = 2


def _emulator_url(host: str) -> str:
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def gcs_emulator() -> str | None:
    """The GCS emulator Google's client libraries would use (``STORAGE_EMULATOR_HOST``), as a URL."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    return _emulator_url(host) if host and host != "default" else None


def gcs_emulator_check(text: str) -> None:
    """Refuse to send a ``gs://`` location to real GCS through TensorStore while
    ``STORAGE_EMULATOR_HOST`` names an emulator. TensorStore's gcs kvstore takes its endpoint
    only from the ``TENSORSTORE_GCS_HTTP_URL`` variable (its spec has no endpoint member), and
    the library never writes the environment: the user sets it (docs/storage.md, "S3 and GCS")."""
    url = gcs_emulator()
    if url is not None and not os.environ.get("TENSORSTORE_GCS_HTTP_URL", "").strip():
        raise CheckpointError(
            f"{text}: STORAGE_EMULATOR_HOST names a GCS emulator ({url}), but TensorStore takes its GCS endpoint "
            f"only from TENSORSTORE_GCS_HTTP_URL, which is not set: set TENSORSTORE_GCS_HTTP_URL={url} (and "
            "GOOGLE_AUTH_TOKEN_FOR_TESTING=emulator, so that TensorStore does not look for credentials) before "
            "opening it, or use engine='fsspec' (gcsfs honours STORAGE_EMULATOR_HOST itself)")


def tensorstore_spec(text: str, storage_options: dict) -> tuple[dict, str]:
    """(kvstore spec, context kind) for a location the tensorstore engine serves."""
    scheme = scheme_of(text)
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
        # Credentials: TensorStore's default AWS chain (the AWS_ACCESS_KEY_ID... variables, the
        # profile's entries in ~/.aws/credentials and ~/.aws/config or AWS_SHARED_CREDENTIALS_FILE /
        # AWS_CONFIG_FILE, web identity, then ECS / EC2 instance roles). Its profile must be
        # named: with none (TensorStore 0.1.86) the files are not read at all.
        profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
        spec["aws_credentials"] = {"type": "default", "profile": profile}
        spec["s3_request_retries"] = dict(OBJECT_STORE_RETRIES)
        return {**spec, **storage_options}, "s3"
    if scheme == "gs":
        gcs_emulator_check(text)
        spec["gcs_request_retries"] = dict(OBJECT_STORE_RETRIES)
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
    if scheme_of(text) == "file":
        _check_no_file_above(text)
    storage_options = dict(options.storage_options or {})
    concurrency = options.io_concurrency
    request_timeout = options.request_timeout_s or REQUEST_TIMEOUT_S
    if engine == "local":
        if scheme_of(text) != "file":
            raise CheckpointError(f"the local engine serves local paths and file:// URLs, not {text!r}")
        from ckpt.storage._local import LocalStorage

        return LocalStorage(text, concurrency)
    if engine == "tensorstore":
        from ckpt.storage._tensorstore import TensorStoreStorage, shared_context

        spec, kind = tensorstore_spec(text, storage_options)
        # fake-gcs-server and other emulators ignore ifGenerationMatch on the simple uploads
        # TensorStore sends: write-if-absent is not atomic there (real GCS honours it).
        atomic = not (kind == "gcs" and gcs_emulator() is not None)
        # Every request's wait is bounded, except on local files.
        timeout = None if kind in ("file", "local") else request_timeout
        return TensorStoreStorage(spec, text, shared_context(kind, concurrency), conditional_writes=atomic,
                                  timeout_s=timeout)
    import fsspec

    scheme = scheme_of(text)
    if scheme not in _fsspec_protocols():
        raise _unsupported(text)
    url = text if "://" in text else "file://" + text
    if scheme == "file":
        storage_options.setdefault("auto_mkdir", True)
    _object_store_defaults(scheme, storage_options, concurrency, request_timeout)
    try:
        fs_class = _fs_class(scheme)
        if getattr(fs_class, "async_impl", False):
            # zarr's FsspecStore runs the I/O on its own event loop; a file system made for
            # that loop (asynchronous=True) is what FsspecStorage drives its own calls through.
            storage_options.setdefault("asynchronous", True)
        if fs_class is fsspec.get_filesystem_class(scheme):
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
        else:
            fs, path = fs_class(**storage_options), fs_class._strip_protocol(url)
    except ImportError as e:
        raise CheckpointError(f"the fsspec engine needs a package for {scheme}:// locations: {e}") from None
    from ckpt.storage._fsspec import FsspecStorage

    if scheme in ("s3", "s3a") and getattr(fs, "retries", None) == 5:
        # s3fs's own retry loop around botocore's (5 by default: 25 attempts of a PUT that gets
        # SlowDown every time); 2 x botocore's 5 attempts here (issue 28, item 5).
        fs.retries = S3FS_RETRIES
    return FsspecStorage(fs, path, text, concurrency,
                         timeout_s=None if scheme in ("file", "local") else request_timeout)


def _check_no_file_above(text: str) -> None:
    """NotADirectoryError naming the file when a directory above the local location `text` is a
    file (``save("train.py/ckpt")``): what would otherwise fail later as a bare "[Errno 17] File
    exists" or "Not a directory"."""
    path = os.path.abspath(os.path.expanduser(unquote(urlparse(text).path) if "://" in text else text))
    parent = os.path.dirname(path)
    while parent and not os.path.isdir(parent):
        if os.path.lexists(parent):
            raise NotADirectoryError(errno.ENOTDIR, f"{parent} is a file, not a directory: nothing can be "
                                     f"stored or read under it", path)
        above = os.path.dirname(parent)
        if above == parent:
            return
        parent = above


def _fs_class(scheme: str) -> type:
    """The fsspec file-system class for `scheme`: the registered one, except for gs:// with an
    emulator (``STORAGE_EMULATOR_HOST``). gcsfs registers its experimental ``ExtendedGcsFileSystem``
    (unless ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` was set before its import), whose bucket
    probe emulators do not answer (each bucket operation would wait 60 s): its core
    ``GCSFileSystem`` is opened instead, chosen here rather than through the environment."""
    import fsspec

    if scheme in ("gs", "gcs") and gcs_emulator() is not None:
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem
    return fsspec.get_filesystem_class(scheme)


def _object_store_defaults(scheme: str, storage_options: dict, concurrency: int,
                           timeout_s: float | None = None) -> None:
    """Defaults for s3fs and gcsfs, under what the caller passed.

    Both cache directory listings per file-system instance, which would hide objects other
    processes write (a racing save's manifest, another process's chunks): listings are always
    fresh here. s3fs reads the endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL), keys and
    ~/.aws files through botocore itself; botocore's region variable is AWS_DEFAULT_REGION, so
    AWS_REGION is passed on where that is unset. gcsfs reads STORAGE_EMULATOR_HOST itself; with
    an emulator it needs no credentials (token 'anon', instead of probing the GCE metadata
    server), and its core class is opened (``_fs_class``).
    """
    if scheme in ("s3", "s3a"):
        storage_options.setdefault("use_listings_cache", False)
        # botocore keeps at most 10 connections by default: as many as requests in flight.
        config = dict(storage_options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", concurrency)
        if timeout_s is not None:
            # Bounded time (issue 28): botocore's per-request timeouts, and retries bounded in
            # count (legacy mode, botocore's default: unlike "standard" it retries a 429
            # TooManyRequests, which SeaweedFS answers under load; tests/test_s3_faults.py
            # injects it); s3fs retries SlowDown and a
            # few errors itself on top (its class attribute `retries`, 5: 2 here, set on the
            # instance in open_storage). Every operation is also bounded as a whole by the engine
            # (FsspecStorage: request_timeout_s).
            config.setdefault("connect_timeout", min(timeout_s, 10.0))
            config.setdefault("read_timeout", timeout_s)
            config.setdefault("retries", {"max_attempts": 5, "mode": "legacy"})
        storage_options["config_kwargs"] = config
        region = os.environ.get("AWS_REGION")
        if region and not os.environ.get("AWS_DEFAULT_REGION") and "client_kwargs" not in storage_options:
            storage_options["client_kwargs"] = {"region_name": region}
    elif scheme in ("gs", "gcs"):
        storage_options.setdefault("use_listings_cache", False)
        if gcs_emulator() is not None:
            storage_options.setdefault("token", "anon")


# ---- what a location offers beyond bytes (the optional protocols, declared by its engine) ----


def name_of(store: Storage) -> str:
    """The last component of the location."""
    return store.url.rstrip("/").rsplit("/", 1)[-1]


def pinned(store: Storage) -> contextlib.AbstractContextManager[Storage]:
    """A context whose storage keeps reading what is at `store`'s location now, even if it is
    replaced meanwhile: a local directory read through the descriptor it was opened by; elsewhere
    the store itself (generations are never rewritten)."""
    return store.pin() if store.caps.renames else contextlib.nullcontext(store)


def usage(store: Storage) -> Usage | None:
    """Bytes, objects and newest modification time at or below the location, or None where the
    engine cannot tell without reading every object (``ckpt ls`` then sizes committed
    checkpoints from their manifests)."""
    return store.du() if store.caps.renames else None


def make_dirs(store: Storage) -> None:
    """Create the location where the backend has directories (a no-op on object stores)."""
    if store.caps.renames:
        store.make_dirs()
