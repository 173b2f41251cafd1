"""The replay source: pacing against an injected clock, what each row fills, copies, loops, alignment."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.profiler_fakes import ManualClock
from vgpu.profiler.replay import DEFAULT_DEVICE_ID, ReplaySource
from vgpu.profiler.source import SignatureSource
from vgpu.traces import AppTrace, Trace, TraceFormatError, read_trace, write_trace


def _trace() -> Trace:
    t = np.array([0.0, 1.0, 2.0, 3.0])
    a = AppTrace(
        "a",
        t,
        {
            "mem_used_mib": np.array([100.0, 110.0, np.nan, 130.0]),
            "sm_util_pct": np.array([10.0, 20.0, 30.0, 40.0]),
            "power_w": np.array([250.5, 260.0, 270.0, 280.0]),
            "power_limit_w": np.full(4, 700.0),
            "mem_total_mib": np.full(4, 81559.0),
        },
        gpu="GPU-abc",
    )
    b = AppTrace("b", t[:2] + 2.0, {"mem_used_mib": np.array([5.0, 6.0])})  # starts 2 s later
    return Trace(apps={"a": a, "b": b})


def test_rows_come_at_the_traces_pace() -> None:
    clock = ManualClock(50.0)
    src = ReplaySource(_trace(), clock=clock, wall_clock=lambda: 1000.0)
    assert isinstance(src, SignatureSource)
    first = src.sample()
    assert [(s.app_id, s.seq) for s in first] == [("a", 1)]
    clock.advance(0.5)
    assert src.sample() == []
    clock.advance(0.5)
    assert [(s.app_id, s.seq) for s in src.sample()] == [("a", 2)]
    clock.advance(1.0)  # t = 2: a's third row and b's first (b starts 2 s into the trace)
    got = src.sample()
    assert sorted((s.app_id, s.seq) for s in got) == [("a", 3), ("b", 1)]
    assert {s.app_id: s.timestamp_s for s in got} == {"a": 1002.0, "b": 1002.0}
    clock.advance(10.0)
    assert sorted((s.app_id, s.seq) for s in src.sample()) == [("a", 4), ("b", 2)]
    assert src.done and src.sample() == [] and src.emitted == 6


def test_row_content() -> None:
    clock = ManualClock()
    src = ReplaySource(_trace(), clock=clock, wall_clock=lambda: 0.0)
    first = src.sample()  # the first call starts the replay
    clock.advance(3.0)
    rows = {(s.app_id, s.seq): s for s in first + src.sample()}
    a1, a3 = rows[("a", 1)], rows[("a", 3)]
    assert a1.device_id == "GPU-abc" and rows[("b", 1)].device_id == DEFAULT_DEVICE_ID
    assert a1.process.gpu_mem_used_mib == 100.0 and a1.process.sm_util_pct == 10.0
    assert a1.device.mem_used_mib == 100.0 and a1.device.sm_util_pct == 10.0
    assert a1.device.power_mw == 250_500 and a1.device.power_limit_mw == 700_000
    assert a1.device.mem_total_mib == 81559.0
    assert not a1.device.HasField("sm_clock_mhz")  # absent column: unset, not zero
    assert not a3.process.HasField("gpu_mem_used_mib")  # empty cell: unset
    assert not rows[("b", 1)].process.HasField("sm_util_pct")
    assert rows[("a", 1)].pid != rows[("b", 1)].pid


def test_speed_factor() -> None:
    clock = ManualClock()
    src = ReplaySource(_trace(), speed=10.0, clock=clock, wall_clock=lambda: 500.0)
    src.sample()
    clock.advance(0.2)  # 2 s of trace
    got = src.sample()
    assert sorted((s.app_id, s.seq) for s in got) == [("a", 2), ("a", 3), ("b", 1)]
    assert max(s.timestamp_s for s in got) == pytest.approx(500.2)


def test_per_app_alignment_and_copies() -> None:
    clock = ManualClock()
    src = ReplaySource(_trace(), align="per_app", copies=3, clock=clock)
    got = src.sample()
    assert sorted(s.app_id for s in got) == ["a#0", "a#1", "a#2", "b#0", "b#1", "b#2"]
    assert len({s.pid for s in got}) == 6
    assert src.app_ids == ["a#0", "a#1", "a#2", "b#0", "b#1", "b#2"]


def test_loop_starts_over_with_seq_still_growing() -> None:
    clock = ManualClock()
    one = AppTrace("x", np.array([0.0, 1.0]), {"sm_util_pct": np.array([1.0, 2.0])})
    src = ReplaySource(Trace(apps={"x": one}), loop=True, clock=clock, wall_clock=lambda: 0.0)
    seen = []
    for _ in range(6):
        seen += [(s.seq, s.process.sm_util_pct, s.timestamp_s) for s in src.sample()]
        clock.advance(1.0)
    # lap = 1 s of trace + one sample period
    assert seen == [(1, 1.0, 0.0), (2, 2.0, 1.0), (3, 1.0, 2.0), (4, 2.0, 3.0), (5, 1.0, 4.0), (6, 2.0, 5.0)]
    assert not src.done
    src.close()
    assert src.sample() == []


def test_reads_a_trace_file_and_rejects_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "t.csv.gz"
    write_trace(path, _trace().apps.values())
    src = ReplaySource(path, speed=1000.0)
    assert sorted(src.app_ids) == ["a", "b"]
    with pytest.raises(ValueError, match="speed"):
        ReplaySource(path, speed=0.0)
    with pytest.raises(ValueError, match="copies"):
        ReplaySource(path, copies=0)
    with pytest.raises(TraceFormatError):
        ReplaySource(tmp_path / "missing.csv")


def test_replays_the_bundled_demo_trace_if_present() -> None:
    root = Path(__file__).resolve().parent.parent / "vgpu" / "data"
    traces = sorted(root.glob("*.csv*")) if root.is_dir() else []
    if not traces:
        pytest.skip("no bundled demo trace yet")
    trace = read_trace(traces[0])
    clock = ManualClock()
    src = ReplaySource(trace, speed=1e6, clock=clock)
    src.sample()
    clock.advance(1.0)
    src.sample()
    assert src.emitted == trace.samples and src.done
    assert all(math.isfinite(a.duration_s) for a in trace.apps.values())
