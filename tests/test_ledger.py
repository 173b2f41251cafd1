"""The ledger: grants, admission control (refusals change nothing), release, resize, limits, records."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu.allocator.errors import InsufficientResources, InvalidRequest, NotFound, PermissionDenied
from vgpu.allocator.ledger import AppLimits, DeviceCapacity, Ledger

GPU0 = DeviceCapacity("GPU-0", 80_000.0, name="H100")
GPU1 = DeviceCapacity("GPU-1", 40_000.0, name="A100")


def make(*caps: DeviceCapacity) -> Ledger:
    return Ledger(caps or (GPU0,), clock=lambda: 100.0)


def test_grant_is_recorded_with_an_id_and_counts_against_the_device() -> None:
    led = make()
    g = led.grant("app-a", 30_000, 40, device_id="GPU-0")
    assert len(g.grant_id) == 32 and g.app_id == "app-a" and g.source == "request"
    assert g.created_at_s == g.updated_at_s == 100.0
    assert led.get(g.grant_id) == g
    u = led.usage("GPU-0")
    assert (u.mem_granted_mib, u.mem_available_mib, u.sm_granted_pct, u.sm_available_pct) == (30_000, 50_000, 40, 60)


@pytest.mark.parametrize(
    ("memory_mib", "sm_pct", "what"),
    [(60_000, 10, "MiB"), (10_000, 70, "% SM")],
)
def test_refusal_over_capacity_changes_nothing(memory_mib: float, sm_pct: float, what: str) -> None:
    led = make()
    led.grant("app-a", 30_000, 40, device_id="GPU-0")
    before = led.to_records()
    with pytest.raises(InsufficientResources, match=what):
        led.grant("app-b", memory_mib, sm_pct, device_id="GPU-0")
    assert led.to_records() == before


def test_exactly_full_fits() -> None:
    led = make()
    led.grant("a", 50_000, 60)
    led.grant("b", 30_000, 40)
    assert led.usage("GPU-0").mem_available_mib == 0


def test_release_frees_and_unknown_release_is_not_found() -> None:
    led = make()
    g = led.grant("a", 80_000, 100)
    assert led.release(g.grant_id) == g
    assert led.usage("GPU-0").mem_granted_mib == 0
    with pytest.raises(NotFound):
        led.release(g.grant_id)
    with pytest.raises(NotFound):
        led.release("no-such-grant")


def test_place_picks_the_device_with_most_room_and_refuses_when_nothing_fits() -> None:
    led = make(GPU0, GPU1)
    assert led.grant("a", 10_000).device_id == "GPU-0"
    led.grant("b", 65_000, device_id="GPU-0")
    assert led.grant("c", 20_000).device_id == "GPU-1"
    before = led.to_records()
    with pytest.raises(InsufficientResources):
        led.grant("d", 30_000)
    assert led.to_records() == before


def test_unknown_device_is_not_found() -> None:
    with pytest.raises(NotFound, match="GPU-9"):
        make().grant("a", 1, device_id="GPU-9")


@pytest.mark.parametrize(
    ("app", "mem", "sm", "match"),
    [
        ("", 1, 0, "app_id is empty"),
        ("a", -1, 0, "memory_mib must be >= 0"),
        ("a", math.nan, 0, "finite"),
        ("a", math.inf, 0, "finite"),
        ("a", 1, 101, "sm_pct must be <= 100"),
        ("a", 1, -5, "sm_pct must be >= 0"),
    ],
)
def test_bad_arguments_are_invalid_requests(app: str, mem: float, sm: float, match: str) -> None:
    led = make()
    with pytest.raises(InvalidRequest, match=match):
        led.grant(app, mem, sm)
    assert led.grants() == []


def test_limits_cap_an_app_across_its_grants() -> None:
    led = make()
    led.set_limits(AppLimits("a", max_memory_mib=20_000, max_sm_pct=50))
    led.grant("a", 15_000, 30)
    with pytest.raises(InsufficientResources, match="limit of 20000 MiB"):
        led.grant("a", 6_000, 0)
    with pytest.raises(InsufficientResources, match="limit of 50 %"):
        led.grant("a", 1_000, 25)
    led.grant("b", 6_000, 25)  # other apps are not capped
    assert led.headroom("a", "GPU-0") == (5_000, 20)


def test_limits_keep_priority_when_not_given_and_apply_to_new_grants() -> None:
    led = make()
    led.set_limits(AppLimits("a", priority=5))
    led.set_limits(AppLimits("a", max_memory_mib=1000))
    assert led.limits("a") == AppLimits("a", 1000, None, 5)
    assert led.grant("a", 10).priority == 5


def test_resize_within_capacity_and_refused_beyond() -> None:
    led = make()
    g = led.grant("a", 10_000, 10)
    led.grant("b", 60_000, 10)
    g2 = led.resize(g.grant_id, 20_000, 20, source="forecast")
    assert (g2.memory_mib, g2.sm_pct, g2.source, g2.grant_id) == (20_000, 20, "forecast", g.grant_id)
    before = led.to_records()
    with pytest.raises(InsufficientResources):
        led.resize(g.grant_id, 25_000, 20)
    assert led.to_records() == before
    g3 = led.resize(g.grant_id, 25_000, 95, clamp=True)
    assert (g3.memory_mib, g3.sm_pct) == (20_000, 90)
    assert led.resize(g.grant_id, 5_000, 5).memory_mib == 5_000  # shrinking always fits


def test_callers_act_only_on_their_own_grants() -> None:
    led = make()
    g = led.grant("a", 100, caller="a")
    with pytest.raises(PermissionDenied):
        led.grant("b", 100, caller="a")
    with pytest.raises(PermissionDenied):
        led.release(g.grant_id, caller="b")
    with pytest.raises(PermissionDenied):
        led.resize(g.grant_id, 200, 0, caller="b")
    with pytest.raises(PermissionDenied):
        led.set_limits(AppLimits("a", max_memory_mib=1), caller="a")
    assert led.get(g.grant_id) == g
    assert led.release(g.grant_id, caller="a") == g


def test_records_round_trip_through_json_and_drop_grants_of_vanished_devices() -> None:
    led = make(GPU0, GPU1)
    a = led.grant("a", 100, 5, device_id="GPU-0", pid=42)
    led.grant("b", 200, 5, device_id="GPU-1")
    led.set_limits(AppLimits("a", max_memory_mib=500, priority=2))
    records = json.loads(json.dumps(led.to_records()))
    back = Ledger.from_records(records)
    assert back.to_records() == led.to_records()
    only0 = Ledger.from_records(records, devices=[GPU0])
    assert [g.grant_id for g in only0.grants()] == [a.grant_id]
    assert [g.app_id for g in only0.dropped_on_restore] == ["b"]
    with pytest.raises(ValueError, match="version"):
        Ledger.from_records({**records, "version": 99})
    with pytest.raises(ValueError, match="malformed"):
        Ledger.from_records({**records, "grants": [{"grant_id": "x"}]})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 50_000), st.floats(0, 60), st.booleans()), max_size=30))
def test_granted_never_exceeds_capacity(ops: list[tuple[str, float, float, bool]]) -> None:
    led = make()
    for app, mem, sm, release in ops:
        try:
            g = led.grant(app, mem, sm)
        except InsufficientResources:
            continue
        if release:
            led.release(g.grant_id)
        u = led.usage("GPU-0")
        assert u.mem_granted_mib <= GPU0.mem_total_mib + 1e-6
        assert u.sm_granted_pct <= 100 + 1e-6


# --- the indices and running totals give what a scan over every grant gives ------------------------
def _scan_totals(led: Ledger, *, device_id: str | None = None, app_id: str | None = None) -> tuple[float, float]:
    grants = [g for g in led.grants() if (device_id is None or g.device_id == device_id)
              and (app_id is None or g.app_id == app_id)]
    return math.fsum(g.memory_mib for g in grants), math.fsum(g.sm_pct for g in grants)


def _check_indices(led: Ledger) -> None:
    everything = led.grants()
    for app in {g.app_id for g in everything} | {"nobody"}:
        assert led.grants(app_id=app) == [g for g in everything if g.app_id == app]
        assert led.grant_count(app) == len(led.grants(app_id=app))
        for dev in ("GPU-0", "GPU-1"):
            assert led.grants(app_id=app, device_id=dev) == [g for g in everything if (g.app_id, g.device_id) == (app, dev)]
        assert led._app_total(app) == _scan_totals(led, app_id=app)
    for dev in ("GPU-0", "GPU-1"):
        assert led.grants(device_id=dev) == [g for g in everything if g.device_id == dev]
        assert led.grants_with_pid(dev) == [g for g in everything if g.device_id == dev and g.pid > 0]
        u = led.usage(dev)
        assert (u.mem_granted_mib, u.sm_granted_pct) == _scan_totals(led, device_id=dev)
    assert led.grant_count() == len(everything)
    assert led.apps() == sorted({g.app_id for g in everything} | {a for a in ("a", "b", "c") if led.limits(a)})


_op = st.one_of(
    st.tuples(st.just("grant"), st.sampled_from("abc"), st.floats(0, 30_000), st.floats(0, 40), st.sampled_from([0, 7])),
    st.tuples(st.just("release"), st.integers(0, 20), st.just(0.0), st.just(0.0), st.just(0)),
    st.tuples(st.just("resize"), st.integers(0, 20), st.floats(0, 30_000), st.floats(0, 40), st.just(0)),
    st.tuples(st.just("commit"), st.just(0), st.just(0.0), st.just(0.0), st.just(0)),
    st.tuples(st.just("rollback"), st.just(0), st.just(0.0), st.just(0.0), st.just(0)),
    st.tuples(st.just("limits"), st.sampled_from("abc"), st.floats(0, 60_000), st.just(0.0), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_op, max_size=40))
def test_indices_and_totals_match_a_scan_after_any_changes(ops: list[tuple[str, object, float, float, int]]) -> None:
    led = make(GPU0, GPU1)
    for kind, who, mem, sm, pid in ops:
        ids = [g.grant_id for g in led.grants()]
        try:
            if kind == "grant":
                led.grant(str(who), mem, sm, pid=pid)
            elif kind == "release" and ids:
                led.release(ids[int(str(who)) % len(ids)])
            elif kind == "resize" and ids:
                led.resize(ids[int(str(who)) % len(ids)], mem, sm, clamp=mem > 20_000)
            elif kind == "commit":
                led.commit_changes()
            elif kind == "rollback":
                led.rollback_changes()
            elif kind == "limits":
                led.set_limits(AppLimits(str(who), max_memory_mib=mem))
        except InsufficientResources:
            pass
        _check_indices(led)
    restored = Ledger.from_records(json.loads(json.dumps(led.to_records())))
    _check_indices(restored)
    assert restored.grants() == led.grants()


def test_a_released_grant_leaves_the_totals_exactly_as_before() -> None:
    led = make()
    led.grant("a", 0.1, 0.3)
    before = led.usage("GPU-0")
    for _ in range(1000):
        led.release(led.grant("b", 0.2, 0.7).grant_id)
    assert led.usage("GPU-0") == before
    assert led.usage("GPU-0").mem_granted_mib == 0.1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 80_000) | st.sampled_from([5e-324, 2.2250738585072014e-308, 1e-300, 0.1]),
                          st.floats(0, 100) | st.just(5e-324), st.booleans()), max_size=30))
def test_totals_are_exact_for_any_floats_down_to_the_smallest(ops: list[tuple[float, float, bool]]) -> None:
    """The running totals count whole units of the smallest float, so subnormal and tiny grants
    beside large ones still sum exactly: the total is the correctly rounded sum of what is held."""
    led = Ledger([DeviceCapacity("GPU-0", 1e9, 1e9), GPU1], clock=lambda: 100.0)
    for mem, sm, release in ops:
        g = led.grant("a", mem, sm, device_id="GPU-0")
        if release:
            led.release(g.grant_id)
        assert led.headroom("a", "GPU-0") == (1e9 - math.fsum(x.memory_mib for x in led.grants()),
                                              1e9 - math.fsum(x.sm_pct for x in led.grants()))
    _check_indices(led)


def test_a_resize_keeps_every_other_field_of_the_grant() -> None:
    """A resize changes the size and its times only: every other field of the grant (all of
    them, as the dataclass lists them) is kept."""
    import dataclasses

    times = iter([100.0, 200.0, 300.0])
    led = Ledger([GPU0], clock=lambda: next(times))
    g = led.grant("app-a", 1_000, 10, device_id="GPU-0", priority=3, source="cold_start", pid=42, cold_start_mib=2_000,
                  sm_estimated=True, job_digest="0f" * 32)
    resized = led.resize(g.grant_id, 1_500, 10)
    assert resized == dataclasses.replace(g, memory_mib=1_500.0, updated_at_s=200.0, mem_updated_at_s=200.0)
    sm_only = led.resize(g.grant_id, 1_500, 20, source="forecast")
    assert sm_only == dataclasses.replace(resized, sm_pct=20.0, updated_at_s=300.0, source="forecast")
    assert {f.name for f in dataclasses.fields(g)} == {
        "grant_id", "app_id", "device_id", "memory_mib", "sm_pct", "priority", "created_at_s", "updated_at_s",
        "source", "pid", "mem_updated_at_s", "cold_start_mib", "sm_estimated", "uid",
        "job_digest"}, "a new Grant field: name it in Ledger.resize"


def test_a_uids_share_of_grants_is_counted_through_resizes_releases_and_a_restore() -> None:
    """Grants made for a uid count against its share (`max_grants_per_uid`), 0-MiB ones too; a resize
    keeps the count, a release frees a place, the operator's grants (no uid) count against none, and
    the stored records bring the counts back."""
    led = Ledger([GPU0])
    led.max_grants_per_uid = 2
    a = led.grant("a", 0, uid=1000)
    led.grant("b", 10, uid=1000)
    with pytest.raises(InsufficientResources, match=r"uid 1000 holds 2 grants .*server.max_grants_per_uid = 2"):
        led.grant("c", 0, uid=1000)
    led.grant("c", 0, uid=1001)
    led.grant("c", 0)  # no uid: bounded by the node's quota only
    led.resize(a.grant_id, 20, 0)
    assert led.uid_grant_count(1000) == 2 and led.uid_grant_count(1001) == 1
    led.release(a.grant_id)
    led.grant("d", 0, uid=1000)
    back = Ledger.from_records(led.to_records())
    assert (back.uid_grant_count(1000), back.uid_grant_count(1001)) == (2, 1)
    assert {g.uid for g in back.grants()} == {1000, 1001, None}
