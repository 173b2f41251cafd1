"""bench/replay.py: the metric formulas on hand-computable numbers, and the JSON it prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import replay as R  # noqa: E402
from vgpu.device.skus import get_sku  # noqa: E402
from vgpu.traces import AppTrace, write_trace  # noqa: E402

SKU = get_sku("h100-80gb")


def app_trace(name: str, mem: list[float], sm: list[float]) -> AppTrace:
    n = len(mem)
    return AppTrace(name, np.arange(n, dtype=float) + 1000.0,
                    {"mem_used_mib": np.array(mem, dtype=float), "sm_util_pct": np.array(sm, dtype=float)})


def test_slack_and_violation_formulas() -> None:
    # slack: (10-5)/10 = 0.5, (10-10)/10 = 0, over-use counts 0 slack; violations: 1 of 3
    slack, viol = R.slack_and_violations(np.array([10.0, 10.0, 10.0]), np.array([5.0, 10.0, 12.0]))
    assert slack == pytest.approx(0.5 / 3)
    assert viol == pytest.approx(1 / 3)
    # a zero allocation holds no slack; use on it is a violation (an idle app granted 0 % SM)
    slack, viol = R.slack_and_violations(np.array([0.0, 0.0, 4.0]), np.array([0.0, 1.0, 2.0]))
    assert slack == pytest.approx(0.5 / 3)
    assert viol == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        R.slack_and_violations(np.array([-1.0]), np.array([1.0]))
    with pytest.raises(ValueError):
        R.slack_and_violations(np.array([]), np.array([]))


def test_tiny_trace_static_and_oracle_by_hand() -> None:
    # one app: memory 1000 for 4 s then 2000 for 4 s; SM 50 then 20
    mem = [1000.0] * 4 + [2000.0] * 4
    sm = [50.0] * 4 + [20.0] * 4
    apps, skipped = R.prepare([app_trace("a", mem, sm)])
    assert not skipped and apps[0].ticks == 8
    apps = R.pack(apps, SKU)
    from manager.baselines import LastValueForecaster

    out = {r["policy"]: r for r in R.replay(apps, SKU, LastValueForecaster())}
    # static: grants 2000 MiB / 50 % for ticks 1..7 (tick 0 is not scored)
    # mem slack: ticks 1-3 -> 0.5 each, ticks 4-7 -> 0 -> 1.5 / 7
    assert out["static"]["mem_slack_frac"] == pytest.approx(round(1.5 / 7, 4))
    # sm slack: ticks 1-3 -> 0, ticks 4-7 -> 0.6 each -> 2.4 / 7
    assert out["static"]["sm_slack_frac"] == pytest.approx(round(2.4 / 7, 4))
    assert out["static"]["mem_violation_rate"] == 0.0 and out["static"]["changes_per_hour"] == 0.0
    # oracle: the next 5 s peak with no margin never under-allocates
    assert out["oracle"]["mem_violation_rate"] == 0.0 and out["oracle"]["sm_violation_rate"] == 0.0
    # reactive: the last usage (+10 %) misses the step at tick 4 exactly once
    assert out["reactive"]["mem_violation_rate"] == pytest.approx(round(1 / 7, 4))
    for r in out.values():
        assert r["energy_j"] > 0


def test_vpa_bumps_memory_after_a_violation() -> None:
    mem = [1000.0] * 20 + [3000.0] * 20
    apps, _ = R.prepare([app_trace("a", mem, [10.0] * 40)])
    apps = R.pack(apps, SKU)
    from manager.baselines import LastValueForecaster

    runs: dict[str, R.PolicyRun] = {}
    R.replay(apps, SKU, LastValueForecaster(), policies=("vpa",), runs_out=runs)
    alloc = np.array(runs["vpa"].mem_alloc)
    # one violation at the step (tick 20), then at least max(1.2 x 3000, 3100) from the next tick on
    assert int(np.sum(np.array(runs["vpa"].mem_used) > alloc)) == 1
    assert alloc[20] >= 3600 - 1e-6


def test_pack_keeps_peaks_within_each_gpu() -> None:
    traces = [app_trace(f"a{i}", [30_000.0] * 3, [40.0] * 3) for i in range(5)]
    apps = R.pack(R.prepare(traces)[0], SKU)
    per_dev: dict[int, list[R.ReplayApp]] = {}
    for a in apps:
        per_dev.setdefault(a.device, []).append(a)
    assert len(per_dev) == 3  # 2 + 2 + 1 by SM (40 % each), memory 60 000 <= 81 559
    for group in per_dev.values():
        assert sum(a.sm.max() for a in group) <= 100
        assert sum(a.mem.max() for a in group) <= SKU.mem_total_mib
    with pytest.raises(ValueError, match="more than"):
        R.pack(R.prepare([app_trace("big", [90_000.0] * 3, [1.0] * 3)])[0], SKU)


def test_cli_prints_the_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, [app_trace("x", [1000.0 + 10 * i for i in range(12)], [30.0] * 12),
                       app_trace("y", [500.0] * 12, [5.0] * 6 + [60.0] * 6),
                       app_trace("z", [1.0], [1.0])])
    rc = R.main(["--trace", str(path), "--split", "all", "--forecaster", "vpa_percentile", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in out["policies"]] == list(R.POLICIES)
    keys = {"policy", "mem_slack_frac", "mem_violation_rate", "sm_slack_frac", "sm_violation_rate",
            "changes_per_hour", "energy_j"}
    for p in out["policies"]:
        assert keys <= set(p)
        assert 0 <= p["mem_slack_frac"] <= 1 and 0 <= p["mem_violation_rate"] <= 1
    assert out["forecaster"].startswith("vpa_percentile")
    assert out["apps"] == 2 and out["tick_s"] == 1.0
    assert any("z" in s for s in out["skipped"])


def test_cli_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert R.main(["--trace", str(tmp_path / "missing.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
    path = tmp_path / "t.csv"
    write_trace(path, [app_trace("x", [1.0] * 5, [1.0] * 5)])
    assert R.main(["--trace", str(path), "--gpu", "tpu-v9"]) == 2
    assert "unknown GPU SKU" in capsys.readouterr().err
    assert R.main(["--trace", str(path), "--split", "all", "--forecaster", "model",
                   "--checkpoint", str(tmp_path / "none.pt")]) == 2
