"""Shared fixtures: where ../shared/data is, and skipping cleanly where it is absent."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog
from daemon_fixtures import Env, Serve, make_env, serves_killed_after, sim_daemon
from hostile import Raw, raw
from hypothesis import settings

from vgpu.daemon.serve import Daemon

# CI explores a fixed set of examples (a red run can be re-run and bisected); elsewhere hypothesis
# draws fresh ones every run, which is how the fuzz tests find new bugs.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# The device rigs (simulator, NVML over the fake pynvml, real NVML) as fixtures for every test module.
pytest_plugins = ("device_rigs",)

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("VGPU_SHARED", ROOT.parent / "shared"))
SHARED_DATA = SHARED / "data"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data; the test is skipped with a reason where it does not exist (a fresh clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"needs the real datasets at {SHARED_DATA} (absent on a bare clone)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """Each test starts with the logging configuration the one before it found: a test (or a bench
    it runs) that calls vgpu.log.configure(level="error") would otherwise filter warnings out of
    every later test's structlog.testing.capture_logs."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


# A real `vgpu serve` per test (tests/daemon_fixtures.py): `env` is its socket, state directory and
# environment; `serves` collects the daemons a test starts and kills any still running after it.
@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    yield from serves_killed_after()


@pytest.fixture
def client(env: Env) -> Iterator[Raw]:
    """A raw gRPC caller on `env`'s socket, as a hostile caller holds one (tests/hostile.py)."""
    yield from raw(env.sock)


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    """A daemon on the simulated GPU in the test's own event loop (no subprocess)."""
    d = sim_daemon(tmp_path)
    await d.start()
    try:
        yield d
    finally:
        await d.stop("test")
