"""Power-limit enforcement: check -> change -> verify, original saved and restored, dry run, failures."""

from __future__ import annotations

import pytest
from allocator_fakes import FakeDevice

from allocator.enforce import PowerLimitMechanism
from allocator.errors import GpuLost, NoPermission, NotSupported, VerifyFailed


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
