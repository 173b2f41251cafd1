"""The fake pynvml fakes real functions: same names, same positional parameters in order; and it
covers every NVML function the NVML backend calls."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pynvml
import pytest

from vgpu.device import nvml as nvml_backend
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.sim import SimBackend

FAKED = FakePynvml.faked_functions()


def _positional(fn: object) -> list[str]:
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def test_there_is_something_to_check() -> None:
    assert len(FAKED) >= 30


@pytest.mark.parametrize("name", FAKED)
def test_faked_function_matches_pynvml(name: str) -> None:
    real = getattr(pynvml, name, None)
    assert real is not None, f"pynvml has no {name}"
    fake = getattr(FakePynvml(SimBackend()), name)
    assert _positional(fake) == _positional(real)
    real_defaults = {p.name for p in inspect.signature(real).parameters.values() if p.default is not p.empty}
    fake_defaults = {p.name for p in inspect.signature(fake).parameters.values() if p.default is not p.empty}
    assert fake_defaults == real_defaults


def test_the_backend_calls_only_faked_functions() -> None:
    source = Path(inspect.getfile(nvml_backend)).read_text()
    called = set(re.findall(r'"(nvml[A-Z]\w+)"', source))
    assert called, "no NVML call found in the backend"
    assert called <= set(FAKED), f"not faked: {sorted(called - set(FAKED))}"
    for name in called:
        assert hasattr(pynvml, name)


def test_unfaked_functions_are_missing_not_silently_real() -> None:
    fake = FakePynvml(SimBackend())
    with pytest.raises(AttributeError, match="not faked"):
        fake.nvmlDeviceGetFanSpeed  # noqa: B018
    assert fake.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert fake.c_nvmlGpuInstancePlacement_t is pynvml.c_nvmlGpuInstancePlacement_t
