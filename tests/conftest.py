"""Shared fixtures: where ../shared/data is, and skipping cleanly where it is absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
