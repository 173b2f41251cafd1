"""The simulator's SM contention model (vgpu.device.sim.contention_speeds), checked against measured
data: Gavel's space-sharing pair throughputs and MISO's per-MIG-slice iteration times."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from vgpu.device.sim import ManualClock, SimBackend, contention_speeds
from vgpu.traces import AppTrace


def test_alone_under_capacity_runs_at_full_speed() -> None:
    assert contention_speeds([40.0, 30.0]) == [1.0, 1.0]


def test_five_at_ninety_share_one_gpu_in_proportion() -> None:
    speeds = contention_speeds([90.0] * 5)
    assert speeds == pytest.approx([100 / 450] * 5)


def test_an_mps_share_caps_what_a_process_gets() -> None:
    assert contention_speeds([80.0, 10.0], share_pct=[40.0, math.inf]) == pytest.approx([0.5, 1.0])


def test_a_mig_instance_serves_its_slices() -> None:
    # 70 % of a whole GPU on a 2-of-7-slice instance (28.6 %) runs at 0.41 x
    assert contention_speeds([70.0], capacity_pct=100 * 2 / 7) == pytest.approx([(200 / 7) / 70])


def test_an_idle_process_is_not_slowed() -> None:
    assert contention_speeds([0.0, 200.0], capacity_pct=100.0) == [1.0, 0.5]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        contention_speeds([10.0], capacity_pct=-1)
    with pytest.raises(ValueError):
        contention_speeds([10.0], share_pct=[1.0, 2.0])


def _flat(app: str, sm: float) -> AppTrace:
    t = np.arange(0.0, 30.0)
    return AppTrace(app, t, {"mem_used_mib": np.full(30, 1000.0), "sm_util_pct": np.full(30, sm)})


def test_the_simulator_reports_each_process_speed() -> None:
    clock = ManualClock()
    backend = SimBackend(["h100-80gb"], clock=clock)
    for i in range(5):
        backend.launch(f"a{i}", 100 + i, _flat(f"a{i}", 90.0))
    dev = backend.devices()[0]
    clock.advance(1.0)
    assert [s.speed for s in dev.snapshot()] == pytest.approx([100 / 450] * 5)
    dev.set_sm_share(100, 10.0)
    speeds = {s.pid: s.speed for s in dev.snapshot()}
    assert speeds[100] == pytest.approx(10 / 90 * 100 / 370)
    backend.kill(100)
    assert [s.speed for s in dev.snapshot()] == pytest.approx([100 / 360] * 4)


def test_the_simulator_slows_a_process_on_a_small_mig_instance() -> None:
    clock = ManualClock()
    backend = SimBackend(["a100-40gb"], clock=clock, mig_enabled=True)
    dev = backend.devices()[0]
    one_g = next(p for p in dev.gpu_instance_profiles() if p.slice_count == 1)
    gi = dev.create_gpu_instance(one_g.profile_id, 0)
    clock.advance(10.0)
    backend.launch("a", 1, _flat("a", 70.0), gpu_instance_id=gi.instance_id)
    clock.advance(1.0)
    assert dev.snapshot()[0].speed == pytest.approx((100 / 7) / 70)


def _gavel_pairs(path: Path, gpu: str) -> np.ndarray:
    table = json.loads(path.read_text())[gpu]
    out = []
    for job in table.values():
        alone = job.get("null")
        for other, pair in job.items():
            if other == "null" or not isinstance(pair, list):
                continue
            other_alone = table.get(other, {}).get("null")
            if not alone or not other_alone or pair[0] <= 0 or pair[1] <= 0:
                continue  # zero pairs do not fit together; they are not throughput measurements
            out.append((pair[0] / alone, pair[1] / other_alone))
    return np.array(out)


@pytest.mark.parametrize("gpu", ["k80", "p100", "v100"])
def test_gavel_pairs_share_a_gpu_about_as_the_model_says(shared_data: Path, gpu: str) -> None:
    """Two training jobs that each keep a GPU busy, sharing it, each get half (the model): Gavel's
    measured pairs sum to a median 0.95 (K80), 1.01 (P100) and 1.09 (V100) of one GPU's work."""
    pairs = _gavel_pairs(shared_data / "dl-throughput-profiles-pollux-gavel" / "gavel" /
                         "physical_cluster_throughputs.json", gpu)
    assert len(pairs) > 500
    model = sum(contention_speeds([100.0, 100.0]))
    measured = float(np.median(pairs.sum(axis=1)))
    assert abs(model - measured) < 0.1, (model, measured)
    assert abs(0.5 - float(np.median(pairs))) < 0.12


def test_miso_slice_times_follow_the_model(shared_data: Path) -> None:
    """Per-iteration time on a MIG slice over the whole GPU's, against the model's 1 / speed with the
    job's whole-GPU utilization as its demand: median |log error| 0.15 (no contention model: 0.49)."""
    root = shared_data / "miso-a100-mig"
    with (root / "derived_mig_iteration_time_summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    with (root / "derived_full_a100_util_memory_power_by_model_batch.csv").open() as f:
        util = {(r["model"], r["batch_size"]): float(r["utilization_gpu_pct"]) for r in csv.DictReader(f)}
    whole = {(r["model"], r["batch_size"]): float(r["iter_time_median_s"]) for r in rows if r["mig_slice"] == "7g.40gb"}
    errors, naive = [], []
    for r in rows:
        key = (r["model"], r["batch_size"])
        if r["mig_slice"] == "7g.40gb" or key not in whole or key not in util:
            continue
        measured = float(r["iter_time_median_s"]) / whole[key]
        slices = int(r["mig_slice"][0])
        predicted = 1.0 / contention_speeds([util[key]], capacity_pct=100.0 * slices / 7)[0]
        errors.append(math.log(predicted / measured))
        naive.append(math.log(1.0 / measured))
    assert len(errors) > 100
    assert float(np.median(np.abs(errors))) < 0.2
    assert abs(float(np.median(errors))) < 0.1  # no bias either way
    assert float(np.median(np.abs(errors))) < 0.5 * float(np.median(np.abs(naive)))
