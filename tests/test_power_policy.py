"""Power-limit choice on the Zeus curves, and applying it through the power-limit mechanism."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.replay import PowerController
from vgpu.allocator.mechanisms.power import PowerLimitMechanism
from vgpu.allocator.policy.power import (
    DEFAULT_CURVE,
    PowerCurve,
    PowerPolicyConfig,
    choose_power_limit_mw,
    load_zeus_curve,
    power_draw,
)
from vgpu.device.base import PowerConstraints
from vgpu.device.sim import ManualClock, SimBackend

H100 = PowerConstraints(min_mw=200_000, max_mw=700_000, default_mw=700_000)


def test_builtin_curve_matches_the_zeus_data(shared_data: Path) -> None:
    curve = load_zeus_curve(shared_data / "zeus-power-limit", "a40")
    assert curve.limit_frac == pytest.approx(DEFAULT_CURVE.limit_frac)
    assert curve.throughput_ratio == DEFAULT_CURVE.throughput_ratio
    assert curve.power_ratio == DEFAULT_CURVE.power_ratio
    assert curve.workloads == DEFAULT_CURVE.workloads


@pytest.mark.parametrize("gpu", ["a40", "v100", "rtx6000", "p100"])
def test_every_zeus_gpu_gives_a_monotone_curve(shared_data: Path, gpu: str) -> None:
    curve = load_zeus_curve(shared_data / "zeus-power-limit", gpu, quantile=0.1)
    assert curve.throughput_ratio[-1] == 1.0
    assert list(curve.throughput_ratio) == sorted(curve.throughput_ratio)
    choice = choose_power_limit_mw(100.0, H100, curve)
    assert curve.throughput_at(choice.limit_mw / H100.max_mw) >= 0.95


def test_idle_takes_the_minimum_and_no_forecast_the_default() -> None:
    assert choose_power_limit_mw(0.0, H100).limit_mw == 200_000
    assert choose_power_limit_mw(4.0, H100).reason == "idle"
    nf = choose_power_limit_mw(math.nan, H100)
    assert nf.limit_mw == 700_000 and nf.reason == "no forecast"


def test_busy_gpu_gets_the_lowest_limit_within_the_slowdown_bound() -> None:
    choice = choose_power_limit_mw(100.0, H100, DEFAULT_CURVE, PowerPolicyConfig(slowdown_bound=0.05))
    frac = choice.limit_mw / 700_000
    assert DEFAULT_CURVE.throughput_at(frac) >= 0.95
    # 5 W lower would break the bound
    assert DEFAULT_CURVE.throughput_at((choice.limit_mw - 5_000) / 700_000) < 0.95
    assert choice.reason == "busy"
    # a looser bound allows a lower limit
    loose = choose_power_limit_mw(100.0, H100, DEFAULT_CURVE, PowerPolicyConfig(slowdown_bound=0.2))
    assert loose.limit_mw < choice.limit_mw


def test_partly_busy_gpu_takes_the_energy_optimal_limit() -> None:
    choice = choose_power_limit_mw(30.0, H100)
    assert choice.reason == "energy-optimal"
    assert 200_000 < choice.limit_mw < 700_000
    # the chosen limit spends less energy on the same work than the maximum and the minimum
    e = power_draw(30.0, choice.limit_mw, H100, 70.0).power_w
    assert e < power_draw(30.0, 700_000, H100, 70.0).power_w
    assert e < power_draw(30.0, 200_000, H100, 70.0).power_w
    assert power_draw(30.0, choice.limit_mw, H100, 70.0).slowdown_frac == 0.0


def test_choice_stays_within_the_constraints() -> None:
    narrow = PowerConstraints(min_mw=300_000, max_mw=350_000, default_mw=350_000)
    for need in (0.0, 10.0, 50.0, 100.0):
        assert 300_000 <= choose_power_limit_mw(need, narrow).limit_mw <= 350_000
    with pytest.raises(ValueError, match="inverted"):
        choose_power_limit_mw(50.0, PowerConstraints(min_mw=2, max_mw=1, default_mw=1))


@pytest.mark.parametrize("constraints", [H100, PowerConstraints(min_mw=231_000, max_mw=450_123, default_mw=450_123)])
@pytest.mark.parametrize("step_mw", [1000, 5000, 7000])
def test_the_choice_is_the_least_energy_limit_that_is_fast_enough(constraints: PowerConstraints, step_mw: int) -> None:
    """The choice (made from a table cached per device) against its definition, limit by limit:
    of the grid's limits whose throughput reaches the required ratio, the least energy per unit of
    work, the lowest of equals."""
    from vgpu.allocator.policy.power import _energy_per_work, _grid

    lo, hi = constraints.min_mw, constraints.max_mw
    for bound, busy in ((0.05, 0.9), (0.0, 1.0), (0.3, 0.5)):
        config = PowerPolicyConfig(slowdown_bound=bound, max_busy_frac=busy, step_mw=step_mw)
        idle_w = config.idle_power_frac * hi / 1000.0
        for need in [5.5 + 1.5 * k for k in range(64)]:
            required = min(1 - bound, need / 100 / busy)
            fast = [x for x in _grid(lo, hi, step_mw) if DEFAULT_CURVE.throughput_at(x / hi) >= required - 1e-12]
            want = min(fast, key=lambda x: (round(_energy_per_work(x, hi, idle_w, DEFAULT_CURVE), 9), x)) if fast else hi
            assert choose_power_limit_mw(need, constraints, DEFAULT_CURVE, config).limit_mw == want, (need, bound, busy)


def test_bad_curves_and_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Zeus power summary"):
        load_zeus_curve(tmp_path, "a40")
    (tmp_path / "summary_power_x.csv").write_text(
        "dataset,network,batch_size,optimizer,power_limit,time_per_epoch,average_power\nd,n,1,o,abc,1,1\n"
    )
    with pytest.raises(ValueError, match="unusable row"):
        load_zeus_curve(tmp_path, "x")
    with pytest.raises(ValueError, match="ascending"):
        PowerCurve("g", (1.0, 0.5), (1.0, 1.0), (1.0, 1.0), 0.7, 1, "t")
    with pytest.raises(ValueError, match="must not fall"):
        PowerCurve("g", (0.5, 1.0), (1.0, 0.9), (1.0, 1.0), 0.7, 1, "t")


def test_controller_applies_verifies_and_restores_on_the_simulator() -> None:
    backend = SimBackend(["h100-80gb"], clock=ManualClock())
    dev = backend.devices()[0]
    ctl = PowerController(PowerLimitMechanism())
    [res] = ctl.step([dev], {dev.uuid: 0.0})
    assert res.changed and dev.power_limit_mw() == 200_000
    [again] = ctl.step([dev], {dev.uuid: 0.0})
    assert not again.changed and again.reason == "already at target"
    ctl.stop()
    assert dev.power_limit_mw() == 700_000


def test_controller_degrades_cleanly_without_permission() -> None:
    backend = SimBackend(["h100-80gb"], clock=ManualClock(), privileged=False)
    dev = backend.devices()[0]
    ctl = PowerController(PowerLimitMechanism())
    [res] = ctl.step([dev], {dev.uuid: 0.0})
    assert not res.changed and res.reason.startswith("refused")
    assert ctl.mechanism.disabled_reason(dev.uuid) is not None
    [later] = ctl.step([dev], {dev.uuid: 50.0})
    assert later.reason.startswith("disabled")
    assert dev.power_limit_mw() == 700_000


def test_controller_turns_off_for_a_device_without_power_management() -> None:
    from vgpu.device.errors import NotSupported

    backend = SimBackend(["h100-80gb"], clock=ManualClock())
    dev = backend.devices()[0]
    dev.inject("power_constraints", NotSupported, times=None)
    ctl = PowerController(PowerLimitMechanism())
    [res] = ctl.step([dev], {dev.uuid: 50.0})
    assert not res.changed and res.reason.startswith("disabled")
    assert ctl.mechanism.disabled_reason(dev.uuid) is not None
    assert ctl.step([dev], {}) == []  # no need given: left alone
    assert ctl.stop() == []
