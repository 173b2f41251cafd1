"""The hard-limit rule, pinned once (`limits_are_hard`, allocator/policy/base.py): memory limits are
hard where a device is contended or what is counted on it reaches `hard_limit_at_frac` of it,
cooperative elsewhere, and hard everywhere with `server.hard_memory_limits = "always"`. Every
place that decides it (the forecast policy's plan and its enforcement, `Enforcement.recounted`,
`Allocator.memory_enforcement`) is checked here to give the rule's answer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vgpu.allocator.core import AllocationRequest, Allocator
from vgpu.allocator.policy.base import (
    DeviceView,
    Enforcement,
    Recommendation,
    hard_limit_at_frac_for,
    limits_are_hard,
)
from vgpu.allocator.policy.forecast import PREDICTIVE_CONFIG, ForecastPolicy
from vgpu.device.sim import ManualClock, SimBackend

CONTENDED_AT = PREDICTIVE_CONFIG.hard_limit_at_frac  # the daemon's threshold for "contended"


@pytest.mark.parametrize(("counted", "hard_at", "contended", "hard"), [
    (40.0, 90.0, None, False),   # uncontended: below the threshold
    (90.0, 90.0, None, True),    # reaches the threshold
    (120.0, 200.0, None, True),  # over the device: contended, whatever the threshold
    (100.0, 200.0, None, False),  # the whole device, not over it, below a threshold above it
    (40.0, 90.0, True, True),    # the caller's contention rule says contended
    (95.0, 90.0, False, True),   # not contended, at the threshold
    (0.0, 0.0, None, True),      # "always": hard with nothing counted
])
def test_the_rule(counted: float, hard_at: float, contended: bool | None, hard: bool) -> None:
    assert limits_are_hard(counted, 100.0, hard_at, contended=contended) is hard


def test_the_setting_names_the_threshold() -> None:
    assert hard_limit_at_frac_for("contended", CONTENDED_AT) == CONTENDED_AT
    assert hard_limit_at_frac_for("always", CONTENDED_AT) == 0.0
    with pytest.raises(ValueError, match="'contended' or 'always'"):
        hard_limit_at_frac_for("never", CONTENDED_AT)


# Two applications with the same need, as a fraction of the device, under a setting; the answer.
SCENARIOS = [
    pytest.param(0.2, "contended", False, id="uncontended-cooperative"),
    pytest.param(0.46, "contended", True, id="at-the-threshold-hard"),
    pytest.param(0.6, "contended", True, id="contended-hard"),
    pytest.param(0.2, "always", True, id="always-hard"),
    pytest.param(0.0, "always", True, id="always-hard-with-nothing"),
]


def _allocator(setting: str) -> tuple[Allocator, str, float]:
    clock = ManualClock(1000.0)
    allocator = Allocator(SimBackend(["h100-80gb"], clock=clock), clock=clock, dry_run=False,
                          hard_limit_at_frac=hard_limit_at_frac_for(setting, CONTENDED_AT))
    dev = allocator.ledger.devices()[0]
    return allocator, dev.device_id, dev.mem_total_mib


@pytest.mark.parametrize(("each_frac", "setting", "hard"), SCENARIOS)
def test_every_place_that_decides_gives_the_rules_answer(each_frac: float, setting: str, hard: bool) -> None:
    allocator, dev, total = _allocator(setting)
    frac = allocator.hard_limit_at_frac
    need = each_frac * total
    assert limits_are_hard(2 * need, total, frac * total) is hard

    # the forecast policy's plan, with the daemon's threshold for the setting
    policy = ForecastPolicy(config=replace(PREDICTIVE_CONFIG, hard_limit_at_frac=frac))
    view = DeviceView(dev, "H100", total, 100.0, ())
    recs = [Recommendation(a, dev, need, 10.0, mem_p90_peak_mib=need, mem_used_mib=need) for a in ("a", "b")]
    (planned,) = policy.plan(recs, [view], 0.0).enforcement
    assert planned.hard_mem is hard, planned.reason

    # the decision judged again with what it counted
    judged = Enforcement(dev, not hard, "", (("a", need),), total, frac * total).recounted("b", need)
    assert judged.hard_mem is hard, judged.reason

    # the allocator on its grants alone (they fit the device in every scenario but the contended one)
    if 2 * need <= total:
        for app in ("a", "b"):
            if need > 0:
                allocator.request_allocation(AllocationRequest(app, memory_mib=need))
        assert allocator.memory_enforcement(dev).hard_mem is hard


def test_the_allocators_decision_follows_every_ledger_change() -> None:
    """Made once per change, the decision is still made again at each one: a grant that takes the
    device to the threshold makes it hard, its release makes it cooperative again."""
    allocator, dev, total = _allocator("contended")
    allocator.request_allocation(AllocationRequest("a", memory_mib=0.2 * total))
    assert not allocator.memory_enforcement(dev).hard_mem
    assert allocator.memory_enforcement(dev) is allocator.memory_enforcement(dev)  # asked again: the same one
    b = allocator.request_allocation(AllocationRequest("b", memory_mib=0.75 * total))
    assert allocator.memory_enforcement(dev).hard_mem
    allocator.release(b.grant_id)
    assert not allocator.memory_enforcement(dev).hard_mem
    allocator.hard_limit_at_frac = 0.0
    assert allocator.memory_enforcement(dev).hard_mem
