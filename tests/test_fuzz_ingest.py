"""Property-based fuzzing of the manager's ingest validation with hypothesis.

Whatever a batch holds (any strings, NaN/inf/negative/huge counters, any seq and time, duplicates and
reordering), `Manager.accept` never raises; every signature is accounted for exactly once (accepted,
rejected with a reason, rejected as out of order, or dropped as a duplicate of a sample the window
holds); the windows only ever hold finite, non-negative
values; forecast ticks on what got in give finite, in-range recommendations; and bytes off the wire
either parse as a SignatureBatch or raise protobuf's DecodeError."""

from __future__ import annotations

import math

import hypothesis.strategies as st
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from manager_fakes import EwmaMarginForecaster

from vgpu.manager.core import Manager
from vgpu.manager.window import WindowStore
from vgpu.traces import INAPP_NUMERIC, NUMERIC
from vgpu.v1 import ingest_pb2
from vgpu.v1 import signature_pb2 as spb
from vgpu.wire import parse_signature

floats = st.one_of(
    st.floats(min_value=0, max_value=1e5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 100.0, 100.5, 1e308]),
)
uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)


def _maybe(strategy: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.one_of(st.none(), strategy)


@st.composite
def signatures(draw: st.DrawFn) -> spb.BehavioralSignature:
    s = spb.BehavioralSignature(
        app_id=draw(st.one_of(st.sampled_from(["a", "b", "c"]), st.text(max_size=300))),
        pid=draw(uint32),
        device_id=draw(st.one_of(st.just("GPU-0"), st.text(max_size=40))),
        timestamp_s=draw(st.one_of(st.floats(1.7e9, 1.7e9 + 100), floats)),
        seq=draw(st.one_of(st.integers(0, 50), uint64)),
    )
    for part, message in (("device", spb.DeviceCounters), ("process", spb.ProcessCounters),
                          ("host", spb.HostCounters), ("in_app", spb.InAppCounters)):
        for fd in message.DESCRIPTOR.fields:
            if fd.type == fd.TYPE_DOUBLE:
                value = draw(_maybe(floats))
            elif fd.type == fd.TYPE_UINT32:
                value = draw(_maybe(uint32))
            else:
                value = draw(_maybe(uint64))
            if value is not None:
                setattr(getattr(s, part), fd.name, value)
    return s


def _window_values_are_clean(m: Manager) -> None:
    for app in m.windows.apps():
        for s in m.windows.window(app).samples:
            assert math.isfinite(s.t_s) and s.t_s > 0 and s.seq > 0
            # a window stores the format's columns, and the in-app ones after them once an app reports any
            columns = NUMERIC + INAPP_NUMERIC if len(s.values) > len(NUMERIC) else NUMERIC
            for col, v in zip(columns, s.values, strict=True):
                assert math.isnan(v) or (math.isfinite(v) and v >= 0), (col, v)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(signatures(), max_size=8), min_size=1, max_size=3),
       dropped=st.integers(0, 2**64 - 1), resend=st.booleans())
def test_every_signature_is_accounted_for_and_windows_stay_clean(
    batches: list[list[spb.BehavioralSignature]], dropped: int, resend: bool
) -> None:
    m = Manager(None, EwmaMarginForecaster(), windows=WindowStore(max_samples=8, max_apps=4), clock=lambda: 1000.0)
    total = 0
    # a profiler resends the first batch after a reconnect: what the windows hold of it are duplicates
    for k, sigs in enumerate(batches + batches[:1] if resend else batches):
        ooo, dup = m.stats.out_of_order, m.stats.duplicates
        reply = m.accept(ingest_pb2.SignatureBatch(tick=k, signatures=sigs, dropped_since_last=dropped))
        total += len(sigs)
        assert reply.tick == k
        assert reply.accepted + len(reply.rejected) + (m.stats.duplicates - dup) == len(sigs)
        assert sum(r.reason.startswith("out of order") for r in reply.rejected) == m.stats.out_of_order - ooo
        for r in reply.rejected:
            assert 0 <= r.index < len(sigs) and r.reason
            assert parse_signature(sigs[r.index])[0] == (None if r.reason.startswith("out of order") else r.reason)
            assert len(r.app_id) <= 256
    accounted = m.stats.accepted + m.stats.rejected + m.stats.out_of_order + m.stats.duplicates
    assert accounted == total == m.stats.signatures
    assert len(m.windows) <= 4
    _window_values_are_clean(m)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(st.sampled_from(["a", "b"]), floats, floats), min_size=3, max_size=40))
def test_forecast_ticks_on_fuzzed_input_give_finite_in_range_decisions(rows: list[tuple[str, float, float]]) -> None:
    now = [1.7e9]
    m = Manager(None, EwmaMarginForecaster(), clock=lambda: now[0], forecast_interval_s=0.0, min_samples=1)
    seq = {"a": 0, "b": 0}
    for app, mem, sm in rows:
        seq[app] += 1
        now[0] += 0.1
        s = spb.BehavioralSignature(app_id=app, device_id="GPU-0", timestamp_s=now[0], seq=seq[app])
        s.process.gpu_mem_used_mib = mem
        s.process.sm_util_pct = sm
        reply = m.ingest(ingest_pb2.SignatureBatch(tick=seq[app], signatures=[s]))
        for d in reply.decisions:
            assert math.isfinite(d.recommended_mem_mib) and d.recommended_mem_mib >= 0
            assert math.isfinite(d.recommended_sm_pct) and 0 <= d.recommended_sm_pct <= 100
            for f in d.forecasts:
                assert all(math.isfinite(x) for x in (f.mem_p50_mib, f.mem_p90_mib, f.sm_p50_pct, f.sm_p90_pct))
    assert m.stats.forecast_failures == 0


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400))
def test_bytes_off_the_wire_parse_or_raise_decode_error_and_never_crash_accept(data: bytes) -> None:
    try:
        batch = ingest_pb2.SignatureBatch.FromString(data)
    except DecodeError:
        return
    m = Manager(None, EwmaMarginForecaster(), clock=lambda: 1000.0)
    reply = m.accept(batch)
    # out-of-order signatures are among the rejections; duplicates are dropped without one
    assert reply.accepted + len(reply.rejected) + m.stats.duplicates == len(batch.signatures)
