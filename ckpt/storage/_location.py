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


def _emulator_url(host: str) -> str:
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def gcs_emulator() -> str | None:
    """The GCS emulator Google's client libraries would use (``STORAGE_EMULATOR_HOST``), as a URL."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    return _emulator_url(host) if host and host != "default" else None


def _use_gcs_emulator_in_tensorstore() -> bool:
    """Point TensorStore's gcs kvstore at the emulator that ``STORAGE_EMULATOR_HOST`` names, as
    Google's client libraries do. TensorStore reads ``TENSORSTORE_GCS_HTTP_URL`` when a store is
    opened; an emulator takes no credentials, and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` keeps
    TensorStore from looking for real ones (it would ask the GCE metadata server). Values the
    user set win. Returns whether an emulator is in use."""
    url = gcs_emulator()
    if url is None:
        return False
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    return True


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
        _use_gcs_emulator_in_tensorstore()
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
    storage_options = dict(options.storage_options or {})
    concurrency = options.io_concurrency
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
        return TensorStoreStorage(spec, text, shared_context(kind, concurrency), conditional_writes=atomic)
    import fsspec

    scheme = scheme_of(text)
    if scheme not in _fsspec_protocols():
        raise _unsupported(text)
    url = text if "://" in text else "file://" + text
    if scheme == "file":
        storage_options.setdefault("auto_mkdir", True)
    _object_store_defaults(scheme, storage_options, concurrency)
    try:
        if getattr(fsspec.get_filesystem_class(scheme), "async_impl", False):
            # zarr's FsspecStore runs the I/O on its own event loop; a file system made for
            # that loop (asynchronous=True) is what FsspecStorage drives its own calls through.
            storage_options.setdefault("asynchronous", True)
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as e:
        raise CheckpointError(f"the fsspec engine needs a package for {scheme}:// locations: {e}") from None
    from ckpt.storage._fsspec import FsspecStorage

    return FsspecStorage(fs, path, text, concurrency)


def _object_store_defaults(scheme: str, storage_options: dict, concurrency: int) -> None:
    """Defaults for s3fs and gcsfs, under what the caller passed.

    Both cache directory listings per file-system instance, which would hide objects other
    processes write (a racing save's manifest, another process's chunks): listings are always
    fresh here. s3fs reads the endpoint (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL), keys and
    ~/.aws files through botocore itself; botocore's region variable is AWS_DEFAULT_REGION, so
    AWS_REGION is passed on where that is unset. gcsfs reads STORAGE_EMULATOR_HOST itself; with
    an emulator it needs no credentials (token 'anon', instead of probing the GCE metadata
    server) and its hierarchical-namespace probe, which emulators do not answer (each bucket
    operation would wait 60 s), must be off before gcsfs is imported.
    """
    if scheme in ("s3", "s3a"):
        storage_options.setdefault("use_listings_cache", False)
        # botocore keeps at most 10 connections by default: as many as requests in flight.
        config = dict(storage_options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", concurrency)
        storage_options["config_kwargs"] = config
        region = os.environ.get("AWS_REGION")
        if region and not os.environ.get("AWS_DEFAULT_REGION") and "client_kwargs" not in storage_options:
            storage_options["client_kwargs"] = {"region_name": region}
    elif scheme in ("gs", "gcs"):
        storage_options.setdefault("use_listings_cache", False)
        if gcs_emulator() is not None:
            storage_options.setdefault("token", "anon")
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
