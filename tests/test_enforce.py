"""Power-limit enforcement: check -> change -> verify, original saved and restored, dry run, failures."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from allocator_fakes import FakeDevice

from vgpu.allocator.core import Allocator
from vgpu.allocator.errors import GpuLost, NoPermission, NotSupported, VerifyFailed
from vgpu.allocator.mechanisms.power import PowerLimitMechanism
from vgpu.allocator.policy.base import DeviceView, MigTarget, Plan, PowerTarget, Recommendation
from vgpu.device.sim import ManualClock, SimBackend


def test_change_is_verified_and_original_restored_on_stop() -> None:
    dev = FakeDevice(power_limit_mw=700_000)
    mech = PowerLimitMechanism()
    r = mech.apply(dev, 400_000)
    assert r.changed and (r.before_mw, r.after_mw, r.target_mw) == (700_000, 400_000, 400_000)
    assert dev.limit_mw == 400_000 and mech.original_mw(dev.uuid) == 700_000
    mech.apply(dev, 300_000)
    assert mech.original_mw(dev.uuid) == 700_000  # saved once, before the first write
    restored = mech.restore()
    assert [(x.before_mw, x.after_mw, x.changed) for x in restored] == [(300_000, 700_000, True)]
    assert dev.limit_mw == 700_000 and mech.original_mw(dev.uuid) is None
    assert mech.restore() == []


def test_idempotent_no_write_when_already_at_target() -> None:
    dev = FakeDevice(power_limit_mw=500_000)
    mech = PowerLimitMechanism()
    r = mech.apply(dev, 500_000)
    assert not r.changed and r.reason == "already at target"
    assert dev.writes == [] and mech.writes == 0
    mech.apply(dev, 450_000)
    mech.apply(dev, 450_000)
    assert dev.writes == [450_000]


@pytest.mark.parametrize(("asked", "written"), [(50_000, 200_000), (900_000, 700_000)])
def test_target_is_clamped_to_the_constraints(asked: int, written: int) -> None:
    dev = FakeDevice(power_limit_mw=400_000)
    r = PowerLimitMechanism().apply(dev, asked)
    assert r.requested_mw == asked and r.target_mw == written and dev.writes == [written]


def test_dry_run_plans_but_writes_nothing() -> None:
    dev = FakeDevice(power_limit_mw=700_000)
    mech = PowerLimitMechanism(dry_run=True)
    r = mech.apply(dev, 300_000)
    assert r.dry_run and r.planned and not r.changed and r.reason == "dry run"
    assert dev.writes == [] and dev.limit_mw == 700_000
    assert mech.restore() == [] and dev.writes == []


@pytest.mark.parametrize("error", [NoPermission, NotSupported])
def test_write_refusal_disables_the_mechanism_for_that_device(error: type[Exception]) -> None:
    bad = FakeDevice("GPU-bad", power_limit_mw=700_000, write_error=error)
    good = FakeDevice("GPU-good", power_limit_mw=700_000)
    mech = PowerLimitMechanism()
    r = mech.apply(bad, 300_000)
    assert not r.changed and r.reason.startswith("refused")
    assert mech.disabled_reason("GPU-bad") is not None
    # NotSupported on the first write: the device has no settable limit (no alert); NoPermission: a failure
    assert mech.unsupported("GPU-bad") is (error is NotSupported)
    r2 = mech.apply(bad, 250_000)
    assert r2.reason.startswith("disabled") and bad.writes == [300_000]  # no second attempt
    assert mech.apply(good, 300_000).changed  # other devices unaffected
    assert mech.original_mw("GPU-bad") is None  # nothing of ours to restore there


def test_unreadable_power_disables_without_writing() -> None:
    class NoPower(FakeDevice):
        def power_constraints(self):  # type: ignore[no-untyped-def]
            raise NotSupported("no power management")

    dev = NoPower()
    r = PowerLimitMechanism().apply(dev, 300_000)
    assert r.reason.startswith("disabled") and dev.writes == []


def test_readback_mismatch_fails_loudly_and_lost_gpu_propagates() -> None:
    with pytest.raises(VerifyFailed, match="reads 300001"):
        PowerLimitMechanism().apply(FakeDevice(readback_offset_mw=1), 300_000)
    with pytest.raises(GpuLost):
        PowerLimitMechanism().apply(FakeDevice(write_error=GpuLost), 300_000)


def test_restore_continues_past_a_failing_device() -> None:
    a, b = FakeDevice("GPU-a"), FakeDevice("GPU-b")
    mech = PowerLimitMechanism()
    mech.apply(a, 300_000)
    mech.apply(b, 300_000)
    a.write_error = GpuLost
    results = {r.device_id: r for r in mech.restore()}
    assert results["GPU-a"].reason.startswith("failed") and results["GPU-b"].changed
    assert b.limit_mw == 700_000


# --- failure counters, per device and mechanism, from the simulator's fault injection ----------------
class _Fixed:
    """A policy that always plans the same power limit and MIG layout."""

    def __init__(self, limit_mw: int | None = None, profiles: tuple[str, ...] = ()) -> None:
        self.limit_mw, self.profiles = limit_mw, profiles

    def plan(self, recommendations: Sequence[Recommendation], devices: Sequence[DeviceView], now_s: float) -> Plan:
        dev = devices[0].device_id
        return Plan(power=(PowerTarget(dev, self.limit_mw),) if self.limit_mw else (),
                    mig=(MigTarget(dev, self.profiles),) if self.profiles else ())


def _sim_allocator(policy: _Fixed, *, mig_enabled: bool = False) -> tuple[Allocator, SimBackend]:
    clock = ManualClock(100.0)
    backend = SimBackend(["h100-80gb"], clock=clock, mig_enabled=mig_enabled)
    return Allocator(backend, clock=clock, dry_run=False, policy=policy), backend


def _rec(device_id: str) -> Recommendation:
    return Recommendation("a", device_id, 1000.0, 30.0)


def test_power_failures_are_counted_per_device_and_reach_the_metric() -> None:
    from prometheus_client import CollectorRegistry

    from vgpu.daemon.metrics import DaemonMetrics
    from vgpu.daemon.serve import StateSource
    from vgpu.device.errors import GpuLost as DevGpuLost
    from vgpu.manager.core import Manager

    policy = _Fixed(limit_mw=400_000)
    alloc, backend = _sim_allocator(policy)
    dev = backend.devices()[0]
    registry = CollectorRegistry()
    DaemonMetrics(registry, StateSource(alloc, Manager(None)))

    def failures(mechanism: str) -> float | None:
        return registry.get_sample_value("vgpu_enforcement_failures_total", {"device": dev.uuid, "mechanism": mechanism})

    dev.inject("set_power_limit_mw", 999, times=2)  # NVML_ERROR_UNKNOWN, twice
    alloc.apply_recommendations([_rec(dev.uuid)])
    alloc.apply_recommendations([_rec(dev.uuid)])
    assert alloc.counters.failures == {(dev.uuid, "power_limit"): 2}
    assert failures("power_limit") == 2 and failures("mig") is None
    alloc.apply_recommendations([_rec(dev.uuid)])  # the fault is spent: the write goes through
    assert dev.power_limit_mw() == 400_000 and failures("power_limit") == 2
    # a GPU lost in the middle of the write counts too
    dev.inject("set_power_limit_mw", DevGpuLost, times=1)
    policy.limit_mw = 500_000
    alloc.apply_recommendations([_rec(dev.uuid)])
    assert failures("power_limit") == 3


def test_refused_power_writes_count_once_then_the_mechanism_is_off() -> None:
    from vgpu.device.errors import NoPermission as DevNoPermission

    alloc, backend = _sim_allocator(_Fixed(limit_mw=400_000))
    dev = backend.devices()[0]
    dev.inject("set_power_limit_mw", DevNoPermission, times=None)
    for _ in range(3):
        alloc.apply_recommendations([_rec(dev.uuid)])
    assert alloc.counters.failures == {(dev.uuid, "power_limit"): 1}
    assert alloc.power.disabled_reason(dev.uuid)


def test_mig_failures_are_counted_per_device() -> None:
    from vgpu.allocator.mechanisms.mig import MigLayoutMechanism
    from vgpu.device.errors import NoPermission as DevNoPermission

    policy = _Fixed(profiles=("3g.40gb", "4g.40gb"))
    alloc, backend = _sim_allocator(policy, mig_enabled=True)
    alloc.mig = MigLayoutMechanism()
    dev = backend.devices()[0]
    dev.inject("create_gpu_instance", 999, times=1)  # an unknown NVML error: the apply raises
    alloc.apply_recommendations([_rec(dev.uuid)])
    assert alloc.counters.failures == {(dev.uuid, "mig"): 1}
    alloc.apply_recommendations([_rec(dev.uuid)])  # now it goes through
    assert sorted(gi.profile_name for gi in dev.gpu_instances()) == ["3g.40gb", "4g.40gb"]
    assert alloc.counters.failures == {(dev.uuid, "mig"): 1} and alloc.counters.mig_changes == 1
    # a refusal disables MIG changes on the device: counted once
    policy.profiles = ("7g.80gb",)
    dev.inject("destroy_gpu_instance", DevNoPermission, times=None)
    for _ in range(2):
        alloc.apply_recommendations([_rec(dev.uuid)])
    assert alloc.counters.failures == {(dev.uuid, "mig"): 2}


def test_allocator_counts_mig_failures_from_the_outcome_alone() -> None:
    from vgpu.allocator.policy.base import MigOutcome

    class Outcomes:
        """A MIG mechanism with scripted outcomes and no attributes for the allocator to peek at."""

        def __init__(self, outcomes: list[MigOutcome]) -> None:
            self.outcomes = outcomes

        def apply(self, device: object, profiles: Sequence[str]) -> MigOutcome:
            return self.outcomes.pop(0)

        def restore(self) -> None:
            pass

    alloc, backend = _sim_allocator(_Fixed(profiles=("7g.80gb",)), mig_enabled=True)
    dev = backend.devices()[0]
    alloc.mig = Outcomes([MigOutcome(True, 2, "IN_USE"), MigOutcome(False, 0, ""), MigOutcome(True, 0, "")])
    for _ in range(3):
        alloc.apply_recommendations([_rec(dev.uuid)])
    assert alloc.counters.failures == {(dev.uuid, "mig"): 1}
    assert alloc.counters.mig_changes == 2
