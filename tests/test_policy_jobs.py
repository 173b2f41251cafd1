"""A job keeps its cold-start size while it loads. A new job declared under an application id already
in use starts a new start-up window: the daemon's Allocator and ForecastPolicy on a simulated H100,
with a sizer that sizes a job at 100 MiB per sample of its batch, and the manager's first use of the
GPU on every recommendation. And a full device does not take the size back as headroom (`plan`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from vgpu.allocator.core import AllocationRequest, Allocator
from vgpu.allocator.ledger import Grant
from vgpu.allocator.policy.base import Recommendation, Sizing
from vgpu.allocator.policy.forecast import (
    PREDICTIVE_CONFIG,
    AppState,
    DeviceState,
    ForecastPolicy,
    UsageHistory,
    plan,
)
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.jobs import JobConfig

CFG = replace(PREDICTIVE_CONFIG, confidence_multiplier=0.0)
MARGIN = 1.0 + CFG.mem_margin_frac


class PerSample:
    """100 MiB per sample of the batch."""

    def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
        return Sizing(100.0 * job.batch_size, 10.0, "per sample")


def job(batch_size: int) -> JobConfig:
    return JobConfig(model_type="mlp", batch_size=batch_size)


@dataclass
class Node:
    clock: ManualClock
    allocator: Allocator
    device_id: str
    first_use_s: float
    seq: int = 0

    def seconds(self, n: int, used_mib: float) -> None:
        """`n` seconds of one recommendation a second for "a" at `used_mib` (its forecast too)."""
        for _ in range(n):
            self.seq += 1
            self.allocator.apply_recommendations([Recommendation(
                "a", self.device_id, used_mib, 20, mem_p90_peak_mib=used_mib, sm_p90_peak_pct=20,
                mem_used_mib=used_mib, sm_util_pct=20, for_seq=self.seq, first_use_s=self.first_use_s)])
            self.clock.advance(1.0)

    def grant(self, grant_id: str) -> Grant:
        return self.allocator.ledger.get(grant_id)


def node(clock: ManualClock, backend: SimBackend, **kw: object) -> Node:
    alloc = Allocator(backend, clock=clock, dry_run=False, policy=ForecastPolicy(CFG), sizer=PerSample(),
                      **kw)  # type: ignore[arg-type]
    return Node(clock, alloc, backend.devices()[0].uuid, first_use_s=clock())


def first_job_run_past_its_window() -> tuple[Node, Grant]:
    """Job 1 (2,000 MiB) registers and uses 1,500 MiB from then on, for 40 s: past its windows,
    its grant sized to its use."""
    clock = ManualClock(1000.0)
    n = node(clock, SimBackend(["h100-80gb"], clock=clock))
    first = n.allocator.request_allocation(AllocationRequest("a", job=job(20)))
    assert (first.source, first.memory_mib) == ("cold_start", 2_000)
    n.seconds(40, 1_500.0)
    assert n.grant(first.grant_id).memory_mib < 2_000
    return n, first


def test_a_new_job_keeps_its_cold_start_size_through_its_own_start_up_window() -> None:
    n, first = first_job_run_past_its_window()
    # the same application runs its next job, with a bigger batch: a new cold-start grant while it
    # loads (1,000 MiB in use), 40 s after the application's first use of the GPU
    n.allocator.release(first.grant_id)
    second = n.allocator.request_allocation(AllocationRequest("a", job=job(40)))
    assert second.memory_mib == 4_000
    n.seconds(1, 1_000.0)
    assert n.grant(second.grant_id).memory_mib == pytest.approx(4_000 * MARGIN)
    n.seconds(int(CFG.start_window_s) - 2, 1_000.0)  # still in the window its first use since the grant began
    assert n.grant(second.grant_id).memory_mib == pytest.approx(4_000 * MARGIN)
    # and the window ends: the grant follows the use again
    n.seconds(20, 1_000.0)
    assert n.grant(second.grant_id).memory_mib < 4_000


def test_a_new_job_s_window_starts_at_its_first_use_not_at_its_registration() -> None:
    n, first = first_job_run_past_its_window()
    n.allocator.release(first.grant_id)
    second = n.allocator.request_allocation(AllocationRequest("a", job=job(40)))
    # the new job loads its data for longer than the window, using nothing on the GPU ...
    n.seconds(int(CFG.start_window_s) + 5, 0.0)
    assert n.grant(second.grant_id).memory_mib == pytest.approx(4_000 * MARGIN)
    # ... then starts (its first 100 MiB: a rise too small for the ramp rules to matter): its
    # window runs from here
    n.seconds(int(CFG.start_window_s) - 1, 100.0)
    assert n.grant(second.grant_id).memory_mib == pytest.approx(4_000 * MARGIN)
    n.seconds(20, 100.0)
    assert n.grant(second.grant_id).memory_mib < 4_000


def test_an_explicit_request_is_no_new_job() -> None:
    n, first = first_job_run_past_its_window()
    was_mib = n.grant(first.grant_id).memory_mib
    asked = n.allocator.request_allocation(AllocationRequest("a", memory_mib=500.0))
    assert asked.source == "request"
    n.seconds(5, 1_500.0)
    # the cold-start grant stays sized to the use; its job's size (2,000 MiB) is not granted again
    assert n.grant(first.grant_id).memory_mib <= was_mib
    assert n.grant(asked.grant_id).memory_mib == 500.0


def test_a_restart_does_not_start_a_running_job_s_window_again() -> None:
    n, first = first_job_run_past_its_window()
    n.allocator.release(first.grant_id)
    second = n.allocator.request_allocation(AllocationRequest("a", job=job(40)))
    n.seconds(int(CFG.start_window_s) + 10, 1_000.0)  # the new job's window is over
    before_mib = n.grant(second.grant_id).memory_mib
    assert before_mib < 4_000
    # a restarted daemon: its allocator over the ledger kept, a new policy that has seen nothing
    n.allocator.stop()
    restarted = node(n.clock, SimBackend(["h100-80gb"], clock=n.clock), ledger=n.allocator.ledger)
    restarted.first_use_s, restarted.seq = n.first_use_s, n.seq
    restarted.seconds(3, 1_000.0)
    assert restarted.grant(second.grant_id).memory_mib <= before_mib


def test_the_history_finds_the_first_use_since_a_job_s_start() -> None:
    h = UsageHistory()
    for t, used in [(0.0, 500.0), (1.0, 500.0), (2.0, 10.0), (3.0, 10.0), (4.0, 900.0)]:
        h.observe("a", t, used)
    assert h.first_use_s("a") == 0.0 and math.isnan(h.first_use_s("b"))
    assert h.use_since_s("a", 2.0) == 4.0
    assert h.use_since_s("a", 4.5) == math.inf  # not since
    h.observe("a", 5.0, 30.0)
    h.observe("a", 6.0, 700.0)
    assert h.use_since_s("a", 4.5) == 6.0
    # a job that started before this history began: taken as in use from its start
    assert h.use_since_s("a", -10.0) == -10.0 and h.use_since_s("b", 3.0) == 3.0


def test_a_full_device_does_not_cut_a_loading_job_under_its_cold_start_size() -> None:
    # "big" ramps at 10 GB/s: its ramp's end, capped at the device, is headroom over its claim
    # (40,800 MiB); "new" loads (1,000 MiB of its 4,000 MiB cold-start size), 1 s into its window
    dev = DeviceState("gpu0", mem_total_mib=80_000)
    big = AppState("big", "gpu0", granted_mem_mib=40_800, used_mem_mib=40_000, forecast_mem_p90_mib=40_000,
                   mem_ramp_s=2.0, mem_ramp_rate_mib_s=10_000.0, mem_ramp_last_mib_s=10_000.0, active_s=600.0,
                   history_s=600.0)
    new = AppState("new", "gpu0", granted_mem_mib=4_000, used_mem_mib=1_000, forecast_mem_p90_mib=1_000,
                   expected_mem_mib=4_000, active_s=1.0, history_s=600.0, last_mem_change_s=99.0)
    result = plan([big, new], [dev], 100.0, CFG)
    assert result.devices[0].contended_mem
    assert result.target("new").mem_mib == pytest.approx(4_000 * MARGIN)
    assert result.target("big").mem_mib + result.target("new").mem_mib <= 80_000 + 1e-6
    # past its window the size is headroom like any other, cut in proportion with the ramp's
    later = plan([big, replace(new, active_s=CFG.start_window_s + 1)], [dev], 100.0, CFG)
    assert later.target("new").mem_mib < 4_000


@pytest.mark.parametrize("to_size", [1.0, 0.0])
def test_a_ramp_under_the_job_s_size_is_granted_to_the_size_and_not_past_it(to_size: float) -> None:
    """A job of 4,000 MiB past its cold-start window jumps from 100 to 3,000 MiB: the start-up ramp
    rule would grant its use x (1 + start_ramp_frac), 9,000 MiB; the job said where its memory ends,
    so it is granted its size (`ramp_to_cold_start`). Past the size, the rules apply as without it."""
    clock = ManualClock(1000.0)
    n = node(clock, SimBackend(["h100-80gb"], clock=clock))
    n.allocator.policy = ForecastPolicy(replace(CFG, ramp_to_cold_start=to_size))
    grant = n.allocator.request_allocation(AllocationRequest("a", job=job(40)))
    assert grant.memory_mib == 4_000
    n.seconds(int(CFG.start_window_s) + 2, 100.0)  # loaded, using little: past the cold-start window
    n.seconds(2, 3_000.0)  # a jump under the job's size, in the start-up ramp's window
    ramped = n.grant(grant.grant_id).memory_mib
    if to_size:
        assert 3_000 <= ramped <= 4_000 * MARGIN + 1e-6, ramped
    else:
        assert ramped > 2 * 4_000, ramped  # the use x 3, past what the job said
    n.seconds(2, 5_000.0)  # past its size: the ramp rules as before
    assert n.grant(grant.grant_id).memory_mib > 5_000 * 2


def test_a_resize_and_the_apps_listing_say_which_rule_the_plan_used() -> None:
    """Each RESIZED event of a planned grant ends with the plan's rules, and `list_apps` carries the
    latest plan's size and rules while the application is planned."""
    n, first = first_job_run_past_its_window()
    sub = n.allocator.watch("a")
    n.seconds(3, 6_000.0)  # use jumps past the grant: grown at once
    resized = [e for e in sub.drain_nowait() if e.kind.value == "resized"]
    assert resized and resized[0].detail.endswith(")") and "(memory: " in resized[0].detail, resized
    (info,) = n.allocator.list_apps()
    assert info.plan is not None and info.plan.mem_rule in resized[-1].detail
    assert info.plan.memory_mib == pytest.approx(n.grant(first.grant_id).memory_mib)
    n.allocator.forget_app("a")
    assert all(a.plan is None for a in n.allocator.list_apps())
