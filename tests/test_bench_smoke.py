"""The benchmark scripts run end to end in short runs and report what they claim to measure; their
pieces (the fast batch encoder, the simulator meter) are checked against the plain way of doing it.
No speed target is asserted here: the figures come from the bench commands (docs/performance.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import ingest  # noqa: E402
import profiler_overhead  # noqa: E402

from vgpu.device.sim import SimBackend  # noqa: E402
from vgpu.v1 import ingest_pb2, signature_pb2  # noqa: E402


def test_batch_encoder_bytes_parse_as_the_signatures_they_stand_for() -> None:
    apps = ingest.demo_apps()
    enc = ingest.BatchEncoder(apps, ["x", "y"], ["GPU-a", "GPU-b"])
    data, n = enc.batch("p", 7, [0, 1], per_app=3)
    batch = ingest_pb2.SignatureBatch.FromString(data)
    assert n == 6 and len(batch.signatures) == 6 and batch.tick == 7 and batch.profiler_id == "p"
    by_app: dict[str, list[signature_pb2.BehavioralSignature]] = {}
    for s in batch.signatures:
        by_app.setdefault(s.app_id, []).append(s)
    assert [s.seq for s in by_app["x"]] == [1, 2, 3] and {s.device_id for s in by_app["y"]} == {"GPU-b"}
    ts = [s.timestamp_s for s in by_app["x"]]
    assert ts == sorted(ts) and len(set(ts)) == 3
    first = by_app["x"][0]
    assert first.process.gpu_mem_used_mib == apps[0].column("mem_used_mib")[1]  # seq 1 -> counter row 1
    assert first.device.mem_total_mib == 81559.0
    # equal to what protobuf itself would make of the same values
    again = signature_pb2.BehavioralSignature()
    again.CopyFrom(first)
    assert signature_pb2.BehavioralSignature.FromString(again.SerializeToString()) == first


def test_column_encoder_carries_the_same_signatures_as_the_row_encoder() -> None:
    from manager_fakes import EwmaMarginForecaster

    from vgpu.manager.core import Manager

    apps = ingest.demo_apps()
    rows, cols = (E(apps, ["x", "y"], ["GPU-a", "GPU-b"]) for E in (ingest.BatchEncoder, ingest.ColumnEncoder))
    windows = []
    for enc in (rows, cols):
        m = Manager(None, EwmaMarginForecaster(), min_samples=1)
        for k in range(3):
            data, n = enc.batch("p", k, [0, 1], per_app=4)
            assert n == 8 and m.accept(ingest_pb2.SignatureBatch.FromString(data)).accepted == 8
        windows.append({a: [(s.seq, s.get("mem_used_mib"), s.get("mem_total_mib")) for s in m.windows.window(a).samples]
                        for a in ("x", "y")})
    assert windows[0] == windows[1] and [s[0] for s in windows[1]["x"]] == list(range(1, 13))
    assert ingest_pb2.SignatureBatch.FromString(cols.batch("p", 9, [0], per_app=2)[0]).HasField("columns")


def test_varint_matches_protobuf() -> None:
    for n in (0, 1, 127, 128, 300, 2**32, 2**63):
        msg = signature_pb2.BehavioralSignature(seq=n).SerializeToString()
        assert msg == (b"\x28" + ingest.varint(n) if n else b"")


def test_sim_device_ids_are_the_managers() -> None:
    assert ingest.sim_device_ids(3) == [d.uuid for d in SimBackend(["h100-80gb"] * 3).devices()]


@pytest.mark.slow
def test_ingest_bench_short_run_reports_every_field() -> None:
    r = ingest.run_ingest(apps=4, seconds=1.5, warmup_s=1.5, gpus=2)
    assert set(r) >= {"apps", "signatures_per_s", "decision_p50_ms", "decision_p99_ms", "manager_cpu_frac"}
    assert r["apps"] == 4 and r["streams"] == 4
    assert 20 <= r["signatures_per_s"] <= 60  # 4 apps at 10 Hz
    assert r["rejected"] == 0 and r["disconnects"] == 0
    assert r["decisions"] >= 4  # at least one forecast tick in the window, one decision per app
    assert r["applies"] >= 1 and r["applies_deferred"] >= 0  # the allocator acted
    assert 0 <= r["decision_p50_ms"] <= r["decision_p99_ms"] < 2000
    assert 0 < r["manager_cpu_frac"] < 2
    json.dumps(r)


@pytest.mark.slow
def test_ingest_null_manager_measures_the_transport_alone() -> None:
    r = ingest.run_ingest(apps=4, seconds=1.0, warmup_s=1.0, gpus=1, null=True)
    assert r["null_manager"] is True and r["streams"] == 4
    assert r["signatures_per_s"] == 0 and r["decisions"] == 0  # nothing behind the transport
    assert r["decision_p99_ms"] is None and r["forecaster"] == "none"
    json.loads(json.dumps(r, allow_nan=False))  # strict JSON: no NaN
    assert 0 <= r["manager_cpu_frac"] < 2  # 4 streams for 1 s can cost less than psutil's 10 ms tick


@pytest.mark.slow
def test_ingest_max_mode_steps_up_until_the_budget() -> None:
    r = ingest.run_max(gpus=1, step_s=0.6, budget_s=3.0, streams=2, apps=20, rates=(1_000, 2_000, 500_000),
                       encoding="rows")
    steps = r["steps"]
    assert steps and steps[0]["offered_per_s"] == 1_000 and steps[0]["sustained"]
    assert r["max_sustained_signatures_per_s"] >= 1_000
    assert r["rejected"] == 0 and r["manager_out_of_order"] == 0
    # bounded by the budget: a step starts only when its planned length still fits, so the run ends
    # at most one step's overrun past it (a loaded machine took 4.1 s)
    assert r["seconds"] <= 3.0 + 2.0
    if len(steps) == 3:  # 500k/s as rows is far beyond this manager: not sustained
        assert not steps[2]["sustained"]


@pytest.mark.slow
def test_profiler_overhead_short_run_separates_the_simulator() -> None:
    r = profiler_overhead.run(gpus=2, apps=6, seconds=1.0, warmup_s=0.5)
    assert set(r) >= {"cpu_frac", "tick_p99_ms", "late_ticks", "sim_cpu_frac", "cpu_frac_with_sim"}
    assert r["signatures_per_tick"] == 6.0 and r["replies"] > 0 and r["disconnects"] == 0
    assert 0 < r["sim_cpu_frac"] < r["cpu_frac_with_sim"]
    assert math.isclose(r["cpu_frac"], r["cpu_frac_with_sim"] - r["sim_cpu_frac"], abs_tol=1e-3)
    assert r["ticks"] >= 8


def test_sim_meter_counts_only_time_inside_device_calls() -> None:
    meter = profiler_overhead.SimMeter()
    backend = profiler_overhead.MeteredBackend(SimBackend(["h100-80gb"]), meter)
    dev = backend.devices()[0]
    assert dev.uuid.startswith("GPU-") and meter.cpu_s == 0.0  # identity reads are free
    for _ in range(200):
        dev.memory()
    spent = meter.cpu_s
    assert spent > 0
    sum(range(200_000))  # work outside a device call is not counted
    assert meter.cpu_s == spent


def test_history_reply_bench_short_run_reports_every_field() -> None:
    import history_reply  # noqa: PLC0415

    out = history_reply.measure(3, 10)
    assert (out["apps"], out["points"]) == (3, 10) and out["reply_mib"] > 0
    assert all(out[k] >= 0 for k in ("series_s", "reply_s", "serialize_s", "total_s"))
