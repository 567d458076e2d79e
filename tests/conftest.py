"""Every test process gets 8 simulated CPU devices; this must run before jax is imported.

Fixtures: ``location`` / ``module_location`` run a test (or a module's shared checkpoints) once
on local disk and once on ``memory://`` (support.Location)."""

import os
import signal

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from support import Location  # noqa: E402

LOCATION_KINDS = ["local", "memory"]


@pytest.fixture(params=LOCATION_KINDS)
def location(request, tmp_path):
    """A fresh place for this test's checkpoints: tmp_path, or a unique memory:// prefix."""
    loc = Location.make(request.param, tmp_path)
    yield loc
    loc.cleanup()


@pytest.fixture(scope="module", params=LOCATION_KINDS)
def module_location(request, tmp_path_factory):
    """As `location`, shared by a module's tests (one setup per kind)."""
    loc = Location.make(request.param, tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]))
    yield loc
    loc.cleanup()


@pytest.fixture
def sigterm_recorder():
    """(received, recorder): a Python SIGTERM handler standing in for the default, recording
    the signals it gets; the handler before it is put back afterwards."""
    received = []

    def recorder(signum, frame):
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, recorder)
    try:
        yield received, recorder
    finally:
        signal.signal(signal.SIGTERM, previous)
