"""What the commands work on: a location opened through ``ckpt.storage`` (``open_location``), a
committed checkpoint with its manifest (``Opened``), and one row of a listing (``StepRow``)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from ckpt._errors import CheckpointError
from ckpt._format import Manifest
from ckpt._host import Options, resolve
from ckpt._restore import chunk_source
from ckpt.storage import Storage, name_of, open_storage


@dataclass(frozen=True)
class Opened:
    """A committed checkpoint, its manifest read and checked."""

    storage: Storage
    manifest: Manifest
    note: str | None = None  # set when a step was picked out of a manager directory
    format: str = "jax-ckpt"  # or 'orbax', 'safetensors' (ckpt.cli._foreign: a manifest of their tree)
    what: str | None = None  # for another format, what it is ("Orbax CheckpointManager step (...)")
    created: float | None = None  # for another format, when it was written, where it says
    source: Any = None  # for another format, what reads its arrays (ckpt.cli._foreign.leaf_reader)

    def __post_init__(self) -> None:
        if self.format == "jax-ckpt":  # a packed checkpoint's chunks are read through its index
            object.__setattr__(self, "storage", chunk_source(self.storage, self.manifest))

    @property
    def root(self) -> str:
        """The checkpoint's location, as shown to the user."""
        return self.storage.url


def _is_file(storage: Storage) -> bool:
    """Whether the location itself is a file (object), not a directory (prefix). Lists the
    parent, so it is asked only to explain an error."""
    try:
        return bool(name_of(storage)) and name_of(storage) in storage.parent().list_dir("")[0]
    except (OSError, CheckpointError):
        return False


def _not_a_directory(storage: Storage) -> CheckpointError:
    return CheckpointError(f"{storage.url} is not a directory (it is a file)")


def open_location(location: Any, options: Options | None) -> Storage:
    """The storage of `location`, which must hold something."""
    storage = open_storage(location, resolve(options))
    if not storage.exists(""):
        if _is_file(storage):
            raise _not_a_directory(storage)
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", storage.url)
    return storage


@dataclass(frozen=True)
class StepRow:
    """One line of `ckpt ls`. Sizes are None where the storage cannot tell them."""

    step: int | None
    path: str
    state: str  # 'committed', 'uncommitted' or 'corrupt'
    size: int | None
    files: int | None
    written: float | None  # seconds since the epoch: the manifest's 'created', else the newest file's time
    problem: str | None = None
    sized_by: str | None = None  # 'storage' (everything there), 'manifest' (chunks + manifest), None


# ---- object stores on the command line ---------------------------------------------------------

# Retries of one request on an object store for the CLI: a person waiting at a terminal wants an
# unreachable endpoint reported in about a second, not after the library's ~7 s of retries
# (ckpt.storage OBJECT_STORE_RETRIES, sized for saves riding out a server restart). Measured: a
# closed port on 127.0.0.1, Python's start included, on a busy 2-core machine: `ckpt ls s3://...`
# 9.3 s with the library's retries, 1.7-3.1 s with these; `ckpt inspect s3://...` 34 s -> 3.3 s.
CLI_RETRIES = {"max_retries": 2, "initial_delay": "100ms", "max_delay": "1s"}
_RETRY_KEYS = {"s3": "s3_request_retries", "gs": "gcs_request_retries"}


def cli_options(engine: Any, locations: list[Any]) -> Options:
    """The Options of a command: its --engine, and short retries where it reads an object store
    through TensorStore."""
    import dataclasses

    options = Options(engine=engine).resolved()
    schemes = {str(loc).split("://", 1)[0] for loc in locations if "://" in str(loc)}
    if len(schemes) != 1 or len(locations) != sum("://" in str(loc) for loc in locations):
        return options  # options for one object store would not fit another location
    scheme = schemes.pop()
    if options.engine in (None, "tensorstore") and scheme in _RETRY_KEYS:  # None: tensorstore for s3:// and gs://
        extra: dict = {_RETRY_KEYS[scheme]: dict(CLI_RETRIES)}
    elif options.engine == "fsspec" and scheme in ("s3", "s3a"):
        # botocore's attempts (s3fs retries twice around them): 2 x 5 attempts with the
        # library's settings, 2 x 2 here (measured, `ckpt inspect` of a closed port on 127.0.0.1,
        # Python's start included, busy machine: 29.5-85 s -> 4.8-7.3 s).
        extra = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "legacy"}}}
    else:
        return options
    return dataclasses.replace(options, storage_options={**options.storage_options, **extra})


# A log line of absl (TensorStore, and the AWS SDK inside it): 'E1126 03:26:14.790393  27436 file:5] ...'
_NATIVE_LOG = re.compile(rb"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^\]]*\] ")


@contextlib.contextmanager
def quiet_native_logs() -> Iterator[None]:
    """Drop the log lines native libraries write to file descriptor 2 while a command runs (the
    AWS SDK inside TensorStore logs every missing ~/.aws file and failed attempt): the command's
    own error is the one line the user sees. Python's output (sys.stderr: errors, progress bars)
    goes to the real stderr untouched, as do native lines that are not absl log lines, and fatal
    ones. CKPT_NATIVE_LOGS=1 keeps everything."""
    try:
        ours = sys.stderr.fileno() == 2  # not when sys.stderr is replaced (pytest's capture...)
    except (AttributeError, OSError, ValueError):
        ours = False
    if not ours or os.environ.get("CKPT_NATIVE_LOGS"):
        yield
        return
    sys.stderr.flush()
    real = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)
    saved = sys.stderr
    sys.stderr = os.fdopen(os.dup(real), "w", buffering=1, encoding=saved.encoding, errors="backslashreplace")

    def pump() -> None:
        with os.fdopen(r, "rb") as pipe:
            for line in pipe:
                if not _NATIVE_LOG.match(line):
                    os.write(real, line)

    thread = threading.Thread(target=pump, name="ckpt-native-logs", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last writer (unless a child process holds it)
        thread.join(timeout=1.0)
        sys.stderr.close()
        sys.stderr = saved
        os.close(real)
