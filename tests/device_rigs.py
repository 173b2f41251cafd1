"""Backends under test for the device layer, as one parametrized fixture.

Each hardware test is written once against `rig` and runs on: the simulator ("sim"), the NVML backend
over the fake pynvml that shares the simulator's state ("fake"), and real NVML ("nvml", skipped with the
reason when nvmlInit fails). On real NVML only reads run: a test that writes calls `rig.need_writes()`,
one that drives the simulator (launching applications, losing the GPU) calls `rig.need_sim()`.

Its fixtures `rig` and `rig_factory` are registered for every test module by tests/conftest.py (pytest_plugins).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from vgpu.device.base import Backend, Device
from vgpu.device.errors import DeviceError
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import ManualClock, SimBackend, SimDevice
from vgpu.device.skus import Sku
from vgpu.traces import AppTrace

KINDS = ("sim", "fake", "nvml")


@dataclass
class Rig:
    kind: str
    backend: Backend
    sim: SimBackend | None = None
    clock: ManualClock | None = None
    fake: FakePynvml | None = None

    def need_writes(self) -> None:
        if self.kind == "nvml":
            pytest.skip("writes never run on a real GPU")

    def need_sim(self) -> SimBackend:
        if self.sim is None:
            pytest.skip("drives the simulator (launches applications, injects faults)")
        return self.sim

    def device(self, index: int = 0) -> Device:
        return self.backend.devices()[index]

    def sim_device(self, index: int = 0) -> SimDevice:
        return self.need_sim().devices()[index]

    def advance(self, dt_s: float) -> None:
        assert self.clock is not None
        self.clock.advance(dt_s)


def make_rig(kind: str, gpus: Sequence[str | Sku] = ("h100-80gb",), **sim_kw: object) -> Rig:
    if kind == "nvml":
        try:
            backend = NvmlBackend()
        except DeviceError as exc:
            pytest.skip(f"no real NVML here: {exc}")
        return Rig(kind, backend)
    clock = ManualClock(1000.0)
    sim = SimBackend(gpus, clock=clock, **sim_kw)  # type: ignore[arg-type]
    if kind == "sim":
        return Rig(kind, sim, sim=sim, clock=clock)
    fake = FakePynvml(sim)
    reconfig = sim_kw.get("mig_reconfig_s", 6.0)
    return Rig(kind, NvmlBackend(nvml=fake, mig_reconfig_s=float(reconfig)), sim=sim, clock=clock, fake=fake)  # type: ignore[arg-type]


@pytest.fixture(params=KINDS)
def rig_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., Rig]]:
    """Builds rigs of this test's backend kind: `rig_factory(gpus=["a100-40gb"], mig_enabled=True)`."""
    made: list[Rig] = []

    def factory(gpus: Sequence[str | Sku] = ("h100-80gb",), **sim_kw: object) -> Rig:
        r = make_rig(request.param, gpus, **sim_kw)
        made.append(r)
        return r

    yield factory
    for r in made:
        try:
            r.backend.close()
        except DeviceError:
            pass


@pytest.fixture
def rig(rig_factory: Callable[..., Rig]) -> Rig:
    return rig_factory()


def trace(app: str, mem_mib: Sequence[float], sm_pct: Sequence[float] | float, period_s: float = 1.0, **cols: Sequence[float]) -> AppTrace:
    """A small canonical trace with samples every `period_s` from t=500 s (any origin works)."""
    n = len(mem_mib)
    sm = np.full(n, float(sm_pct)) if isinstance(sm_pct, (int, float)) else np.asarray(sm_pct, dtype=float)
    columns = {"mem_used_mib": np.asarray(mem_mib, dtype=float), "sm_util_pct": sm}
    columns.update({k: np.asarray(v, dtype=float) for k, v in cols.items()})
    return AppTrace(app=app, t_s=500.0 + period_s * np.arange(n), columns=columns)
