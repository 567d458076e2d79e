"""Options: the explicit configuration of a save, restore or manager, read when each starts.

Every field left at None takes its documented default, from the environment variable named
beside it when that is set (so a job can be tuned without code changes), else the built-in value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Union

EngineChoice = Union[str, Callable[[str, "Options"], Any], None]


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"environment variable {name}={text!r} must be at least 1")
    return value


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Options.{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Options:
    """How ckpt talks to storage and how much memory it uses.

    engine: ``"local"``, ``"tensorstore"`` or ``"fsspec"``, or a callable
        ``(location, options) -> Storage`` (e.g. a wrapping engine that injects faults).
        None: the default for the location's scheme (docs/storage.md).
    storage_options: passed to the engine: for ``fsspec``, keyword arguments of the file system
        (``endpoint_url``, ``key``, ...); for ``tensorstore``, entries merged into the kvstore spec.
    io_concurrency: storage operations in flight per process (``CKPT_IO_CONCURRENCY``;
        default max(8, 2 x cores)).
    max_inflight_bytes: bytes handed to storage and not yet durable, per process
        (``CKPT_MAX_INFLIGHT_BYTES``; default 256 MiB).
    host_budget_bytes: restore's host bytes of chunks read and regions assembled, not yet placed
        on devices (``CKPT_HOST_BUDGET_BYTES``; default 2 GiB).
    staging_pool: keep a save's host buffers for the next save (``CKPT_STAGING_POOL``, ``0``
        turns it off; default on).
    """

    engine: EngineChoice = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    io_concurrency: int | None = None
    max_inflight_bytes: int | None = None
    host_budget_bytes: int | None = None
    staging_pool: bool | None = None

    def resolved(self) -> "Options":
        """A copy with every default filled in (environment variables are read now)."""
        return replace(
            self,
            io_concurrency=_positive("io_concurrency", self.io_concurrency) if self.io_concurrency is not None
            else _env_int("CKPT_IO_CONCURRENCY", max(8, 2 * (os.cpu_count() or 1))),
            max_inflight_bytes=_positive("max_inflight_bytes", self.max_inflight_bytes)
            if self.max_inflight_bytes is not None else _env_int("CKPT_MAX_INFLIGHT_BYTES", 256 << 20),
            host_budget_bytes=_positive("host_budget_bytes", self.host_budget_bytes)
            if self.host_budget_bytes is not None else _env_int("CKPT_HOST_BUDGET_BYTES", 2 << 30),
            staging_pool=bool(self.staging_pool) if self.staging_pool is not None
            else os.environ.get("CKPT_STAGING_POOL", "1") != "0",
        )


def resolve(options: Options | None) -> Options:
    if options is None:
        return Options().resolved()
    if not isinstance(options, Options):
        raise TypeError(f"options must be a ckpt.Options, got {type(options).__name__}")
    return options.resolved()
