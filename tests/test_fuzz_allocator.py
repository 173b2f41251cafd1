"""Property-based fuzzing of the allocator's API with hypothesis.

Invariants, whatever the sequence of calls and however wild the numbers (NaN, inf, negative, huge):
granted memory and SM share never exceed a device's capacity; a refused call changes nothing; the only
exceptions are the typed ones (InsufficientResources, InvalidRequest, NotFound, PermissionDenied); a
grant admitted under an application's limits stays within them; the manager's recommendations, however
malformed, never break these and never set a power limit outside the device's constraints."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from vgpu.allocator.core import Allocator
from vgpu.allocator.errors import InsufficientResources, InvalidRequest, NotFound, PermissionDenied
from vgpu.allocator.ledger import AppLimits, DeviceCapacity, Ledger
from vgpu.allocator.policy.base import Recommendation
from vgpu.allocator.service import request_from_pb
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.v1 import allocator_pb2 as pb

T = TypeVar("T")
TYPED = (InsufficientResources, InvalidRequest, NotFound, PermissionDenied)
DEVICES = (DeviceCapacity("GPU-0", 81559.0, name="H100"), DeviceCapacity("GPU-1", 40960.0, name="A100"))
EPS = 1e-6

wild = st.one_of(
    st.floats(min_value=0, max_value=90_000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, -1.0, 1e308, math.nan, math.inf, -math.inf, 100.0, 100.0000001]),
)
pct = st.one_of(st.floats(min_value=0, max_value=100), wild)
apps = st.sampled_from(["a", "b", "c", "", "  ", "x" * 300])
callers = st.sampled_from([None, None, "a", "b"])
device_ids = st.sampled_from([None, "GPU-0", "GPU-1", "GPU-nope", ""])


class LedgerMachine(RuleBasedStateMachine):
    grants = Bundle("grants")

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(100.0)
        self.ledger = Ledger(DEVICES, clock=self.clock)

    def _call(self, fn: Callable[..., T], *args: object, **kw: object) -> T | None:
        """Run a ledger call; a refusal must be typed and leave the ledger exactly as it was."""
        before = self.ledger.to_records()
        self.clock.advance(1.0)
        try:
            return fn(*args, **kw)
        except TYPED:
            assert self.ledger.to_records() == before
            return None

    @rule(target=grants, app=apps, mem=wild, sm=pct, device=device_ids, caller=callers)
    def grant(self, app: str, mem: float, sm: float, device: str | None, caller: str | None) -> str:
        g = self._call(self.ledger.grant, app, mem, sm, device_id=device, caller=caller)
        if g is None:
            return "no-such-grant"
        assert math.isfinite(g.memory_mib) and g.memory_mib >= 0 and 0 <= g.sm_pct <= 100
        lim = self.ledger.limits(app)
        if lim is not None:  # admitted under limits: within them
            held = self.ledger.grants(app_id=app)
            if lim.max_memory_mib is not None:
                assert sum(x.memory_mib for x in held) <= lim.max_memory_mib + EPS or g.memory_mib == 0
            if lim.max_sm_pct is not None:
                assert sum(x.sm_pct for x in held) <= lim.max_sm_pct + EPS or g.sm_pct == 0
        return g.grant_id

    @rule(grant_id=consumes(grants), caller=callers)
    def release(self, grant_id: str, caller: str | None) -> None:
        self._call(self.ledger.release, grant_id, caller=caller)

    @rule(grant_id=grants, mem=wild, sm=pct, clamp=st.booleans(), caller=callers)
    def resize(self, grant_id: str, mem: float, sm: float, clamp: bool, caller: str | None) -> None:
        self._call(self.ledger.resize, grant_id, mem, sm, clamp=clamp, caller=caller)

    @rule(app=apps, mem=st.one_of(st.none(), wild), sm=st.one_of(st.none(), pct),
          prio=st.one_of(st.none(), st.integers(-5, 5)), caller=callers)
    def set_limits(self, app: str, mem: float | None, sm: float | None, prio: int | None, caller: str | None) -> None:
        self._call(self.ledger.set_limits, AppLimits(app, mem, sm, prio), caller=caller)

    @rule(app=apps, mem=wild, sm=pct)
    def place(self, app: str, mem: float, sm: float) -> None:
        try:
            device = self.ledger.place(mem, sm, app)
        except TYPED:
            return
        except (TypeError, ValueError) as exc:  # pragma: no cover - shows the bug if it happens
            raise AssertionError(f"place raised an untyped {exc!r}") from exc
        assert device in {d.device_id for d in DEVICES}

    @invariant()
    def within_capacity(self) -> None:
        for cap in DEVICES:
            u = self.ledger.usage(cap.device_id)
            assert u.mem_granted_mib <= cap.mem_total_mib + EPS
            assert u.sm_granted_pct <= cap.sm_total_pct + EPS
            assert u.mem_available_mib >= 0 and u.sm_available_pct >= 0
        for g in self.ledger.grants():
            assert math.isfinite(g.memory_mib) and g.memory_mib >= 0
            assert math.isfinite(g.sm_pct) and 0 <= g.sm_pct <= 100

    @invariant()
    def records_round_trip(self) -> None:
        again = Ledger.from_records(self.ledger.to_records(), clock=self.clock)
        assert again.to_records() == self.ledger.to_records()


TestLedgerFuzz = LedgerMachine.TestCase
TestLedgerFuzz.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


recs = st.builds(
    Recommendation,
    app_id=st.sampled_from(["a", "b", "c", "d"]),
    device_id=st.sampled_from(["dev0", "dev1", "GPU-unknown"]),
    memory_mib=wild,
    sm_pct=pct,
    source=st.sampled_from(["model", "baseline"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds=st.lists(st.lists(recs, max_size=6), min_size=1, max_size=5))
def test_recommendations_never_break_the_ledger_or_the_power_range(rounds: list[list[Recommendation]]) -> None:
    clock = ManualClock(50.0)
    sim = SimBackend(["h100-80gb", "a100-40gb"], clock=clock)
    uuids = {f"dev{i}": d.uuid for i, d in enumerate(sim.devices())}
    alloc = Allocator(sim, clock=clock, dry_run=False)
    for batch in rounds:
        clock.advance(1.0)
        mapped = [Recommendation(r.app_id, uuids.get(r.device_id, r.device_id), r.memory_mib, r.sm_pct, r.source)
                  for r in batch]
        try:
            report = alloc.apply_recommendations(mapped)
        except TYPED:
            continue
        for r in mapped:
            if r.device_id not in uuids.values():
                assert any(r.app_id in s for s in report.skipped)
        for d in sim.devices():
            u = alloc.ledger.usage(d.uuid)
            assert u.mem_granted_mib <= u.mem_total_mib + EPS and u.sm_granted_pct <= 100 + EPS
            c = d.power_constraints()
            assert c.min_mw <= d.power_limit_mw() <= c.max_mw
    alloc.stop()
    for d in sim.devices():  # restored on stop
        assert d.power_limit_mw() == d.power_constraints().default_mw


@settings(max_examples=150, deadline=None)
@given(app=st.text(max_size=300), mem=wild, sm=pct, deadline=wild, prio=st.integers(-(2**31), 2**31 - 1),
       device=st.text(max_size=20))
def test_request_validation_admits_only_finite_in_range_values(
    app: str, mem: float, sm: float, deadline: float, prio: int, device: str
) -> None:
    msg = pb.ResourceRequest(app_id=app, memory_mib=mem, sm_pct=sm, deadline_s=deadline, priority=prio, device_id=device)
    try:
        req = request_from_pb(msg)
    except InvalidRequest as exc:
        assert str(exc)  # says what is wrong
        return
    assert app.strip() and len(app) <= 256
    assert math.isfinite(req.memory_mib) and req.memory_mib >= 0
    assert math.isfinite(req.sm_pct) and 0 <= req.sm_pct <= 100
    assert math.isfinite(req.deadline_s) and req.deadline_s >= 0
