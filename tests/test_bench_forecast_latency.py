"""bench/forecast_latency.py runs end to end in a short run and reports the fields it claims (no
speed is asserted here: the figures come from the command, docs/forecasting.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import forecast_latency  # noqa: E402


@pytest.mark.parametrize("mode", ["eager", "fused", "onnx"])
def test_forecast_latency_json_fields(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert forecast_latency.main(["--apps", "5", "--iterations", "3", "--history-s", "20", "--json", "--mode", mode]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["apps"] == 5 and out["tick_ms"] == 100 and out["mode"] == mode and out["threads"] == 1
    assert 0 < out["features_p50_ms"] and 0 < out["p50_ms"] <= out["p99_ms"]
    assert out["mode_serving"] in ("eager", "fused", "onnx")
    if mode != "onnx":
        assert out["mode_serving"] == mode


def test_forecast_latency_mixture_fields(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--apps", "4", "--iterations", "5", "--history-s", "20", "--json", "--mixture", "--mode", "fused"]
    assert forecast_latency.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["forecaster"] == "mixture" and out["experts"] == ["last_value", "model"]
    assert 0 < out["p50_ms"] <= out["p99_ms"] and out["model_p50_ms"] > 0 and out["scored"] > 0


def test_forecast_latency_mixture_with_trees(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--apps", "4", "--iterations", "5", "--history-s", "40", "--json", "--mixture", "--trees", "--mode", "fused"]
    assert forecast_latency.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["experts"] == ["last_value", "model", "local", "trees"] and out["trees_p50_ms"] > 0
    with pytest.raises(SystemExit):  # trees go in the mixture: alone they would be timed as nothing
        forecast_latency.main(["--apps", "4", "--iterations", "2", "--trees"])


def test_node_learn_bench_fields(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import node_learn

    fixture = Path(__file__).resolve().parent / "fixtures" / "migperf_runs.csv.gz"
    assert node_learn.main(["--trace", str(fixture), "--json", "--state-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["apps"] == 8 and out["event"] in ("skipped", "promoted", "rejected") and out["max_rss_mib"] > 0
    assert out["trees"]["event"] in ("skipped", "trees_promoted", "trees_rejected") and out["trees"]["cpu_s"] >= 0


def test_soak_bench_fields(capsys: pytest.CaptureFixture[str]) -> None:
    import soak

    argv = ["--apps", "4", "--hours", "2", "--step-s", "30", "--churn-every-s", "1800", "--json"]
    assert soak.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["rounds"] == 240 and len(out["rss_by_hour_mib"]) == 2 and out["rss_end_mib"] > 0
    assert out["apps_seen"] == 4 + 3 * 1  # a quarter (one) replaced at each half hour after the first
    assert out["history_rows"] > 0.9 * 4 * 2 * 3600 and out["mixture_scored"] > 0
    assert isinstance(out["plateau"], bool) and out["rss_growth_second_half_mib"] is not None
    assert out["trees_loaded"] == 0


def test_soak_bench_serves_trees_fitted_in_a_child_and_reloads_them_every_hour(
        capsys: pytest.CaptureFixture[str]) -> None:
    import soak

    assert soak.main(["--apps", "4", "--hours", "2", "--trees", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["trees_loaded"] == 2 and out["mixture_scored"] > 0


def test_soak_bench_refuses_a_step_the_mixture_reads_as_a_clock_jump() -> None:
    import soak

    with pytest.raises(SystemExit):
        soak.main(["--hours", "1", "--step-s", "60"])


def test_ingest_bench_with_the_served_mixture_and_learning_in_the_background() -> None:
    import ingest

    fixture = Path(__file__).resolve().parent / "fixtures" / "migperf_runs.csv.gz"
    r = ingest.run_ingest(apps=2, seconds=4.0, warmup_s=1.0, gpus=1, forecaster="served", learn_trace=str(fixture))
    assert r["forecaster"] == "mixture" and r["decisions"] > 0
    # a round started in the window (it may be cut at the window's end): its CPU is counted
    assert r["learn_cpu_s"] > 0 and 0 < r["learn_cpu_frac"] and r["learn_rounds"] == len(r["learn_round_wall_s"])


def test_ingest_bench_serves_the_mixture_with_node_local_trees_fitted_on_what_it_replays() -> None:
    import ingest

    from vgpu.manager.nodetrees import NodeTrees

    mixture = ingest.open_forecaster("served-trees")
    trees = mixture.expert("trees")
    assert isinstance(trees, NodeTrees) and trees.models
    out = trees.forecast_arrays(ingest.demo_apps())
    assert np.isfinite(out[:, 0]).all()  # every replayed application has a memory forecast
    assert ingest.open_forecaster("served").expert("trees") is None
