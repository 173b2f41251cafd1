"""The evaluation protocol: grid, origins, horizons, what a forecaster may see, metrics, the CLI."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vgpu.manager.baselines import EwmaForecaster, LastValueForecaster, VpaPercentileForecaster
from vgpu.manager.forecast import HORIZONS_S, Forecast
from vgpu.offline import evaluate as ev
from vgpu.offline.splits import split_of
from vgpu.traces import AppTrace, read_trace

FIXTURE = Path(__file__).parent / "fixtures" / "migperf_runs.csv.gz"


def ramp(n_s: int = 30, app: str = "ramp", per_second: int = 1) -> AppTrace:
    """sm_util_pct = 2 k on second k (sampled `per_second` times, symmetric around 2k); memory 100."""
    t = np.array([k + i / per_second for k in range(n_s) for i in range(per_second)])
    offsets = np.tile(np.linspace(-0.5, 0.5, per_second) if per_second > 1 else [0.0], n_s)
    sm = 2 * np.floor(t) + offsets
    return AppTrace(app=app, t_s=t, columns={"sm_util_pct": sm, "mem_used_mib": np.full(len(t), 100.0)})


def rows(report: dict[str, Any], method: str, target: str = "sm_util_pct") -> dict[int, dict[str, Any]]:
    return {r["horizon_s"]: r for r in report["results"] if r["method"] == method and r["target"] == target}


@pytest.mark.parametrize("per_second", [1, 4])
def test_last_value_on_a_ramp_has_the_exact_known_error(per_second: int) -> None:
    report = ev.evaluate([ramp(per_second=per_second)], [LastValueForecaster()])
    assert report["apps"] == 1 and report["samples"] == 30 * per_second
    by_h = rows(report, "last_value")
    for h in HORIZONS_S:
        # origins are grid indices 9..28; horizon h is scored where origin + h <= 29
        origins = np.arange(9, 30 - h)
        truth = 2.0 * (origins + h)
        assert by_h[h]["n"] == len(origins)
        assert by_h[h]["mae"] == pytest.approx(2.0 * h)
        assert by_h[h]["rmse"] == pytest.approx(2.0 * h)
        assert by_h[h]["mape"] == pytest.approx(np.mean(2.0 * h / truth) * 100)
        assert by_h[h]["r2"] == pytest.approx(1 - 4.0 * h * h / np.var(truth))
        assert by_h[h]["coverage_p90"] is None
    mem = rows(report, "last_value", "mem_used_mib")
    assert mem[1]["mae"] == 0.0 and mem[1]["r2"] is None  # constant truth: no variance, no R2


def test_an_empty_second_carries_the_previous_value() -> None:
    full = ramp()
    keep = full.t_s != 15.0  # second 15 missing: the grid holds 28 (second 14's value) there
    gap = AppTrace(app="gap", t_s=full.t_s[keep], columns={k: v[keep] for k, v in full.columns.items()})
    by_h = rows(ev.evaluate([gap], [LastValueForecaster()]), "last_value")
    origins = np.arange(9, 29)
    grid = 2.0 * np.arange(30)
    grid[15] = 28.0
    expected = np.mean(np.abs(grid[origins] - grid[origins + 1]))
    assert by_h[1]["mae"] == pytest.approx(expected)


class Spy:
    """A history forecaster that records what it was shown and forecasts the last raw sample."""

    name = "spy"

    def __init__(self) -> None:
        self.seen: list[tuple[float, int]] = []
        self.calls = 0

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        self.calls += 1
        out = []
        for h in histories:
            self.seen.append((float(h.t_s[-1]), len(h)))
            sm = float(h.column("sm_util_pct")[-1])
            out.append(Forecast(HORIZONS_S, (math.nan,) * 5, (math.nan,) * 5, (sm,) * 5, (sm + 5,) * 5, "spy"))
        return out


def test_a_history_forecaster_sees_only_samples_up_to_its_origin() -> None:
    spy = Spy()
    report = ev.evaluate([ramp(per_second=4)], [spy], chunk=7)
    last_seen = sorted(t for t, _ in spy.seen)
    # origins are seconds 9..28; each history ends with the origin second's last sample (k + 0.75)
    assert last_seen == [k + 0.75 for k in range(9, 29)]
    assert sorted(n for _, n in spy.seen) == [4 * (k + 1) for k in range(9, 29)]
    assert spy.calls == 3  # 20 origins in chunks of 7
    by_h = rows(report, "spy")
    # the last raw sample is 2k + 0.5 and the grid truth 2(k + h): error 2h - 0.5
    assert by_h[1]["mae"] == pytest.approx(1.5)
    assert by_h[1]["coverage_p90"] == 1.0  # truth 2k + 2 <= 2k + 5.5
    assert rows(report, "spy", "mem_used_mib")[1]["n"] == 0  # NaN forecasts are not scored


def test_grid_path_and_history_path_agree() -> None:
    """The fast grid path must score exactly what forecast_batch on raw histories gives."""
    trace = read_trace(FIXTURE)
    apps = list(trace.apps.values())[:3]

    class HistoryOnly:
        def __init__(self, inner: VpaPercentileForecaster) -> None:
            self.inner = inner
            self.name = "history"

        def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
            return self.inner.forecast_batch(histories)

    report = ev.evaluate(apps, [VpaPercentileForecaster(), HistoryOnly(VpaPercentileForecaster())])
    for target in ("sm_util_pct", "mem_used_mib"):
        fast, slow = rows(report, "vpa_percentile", target), rows(report, "history", target)
        for h in HORIZONS_S:
            for key in ("mae", "rmse", "coverage_p90", "n"):
                assert fast[h][key] == pytest.approx(slow[h][key])


def test_pooled_metrics_formulas() -> None:
    m = ev.pooled_metrics(np.array([1.0, 2.0, 3.0, 0.5]), np.array([1.0, 2.0, 6.0, 1.0]), np.array([1.0, 3.0, 5.0, 0.0]))
    err = np.array([0.0, -1.0, -2.0, 0.5])
    truth = np.array([1.0, 3.0, 5.0, 0.0])
    assert m["n"] == 4
    assert m["mae"] == pytest.approx(np.mean(np.abs(err)))
    assert m["rmse"] == pytest.approx(math.sqrt(np.mean(err**2)))
    assert m["r2"] == pytest.approx(1 - np.mean(err**2) / np.var(truth))
    assert m["mape"] == pytest.approx(np.mean([0.0, 1 / 3, 2 / 5]) * 100)  # the zero truth is left out
    assert m["coverage_p90"] == pytest.approx(3 / 4)  # 5 <= 6, 1 > 1? no: 0 <= 1 yes, 3 > 2
    none = ev.pooled_metrics(np.array([np.nan]), np.array([np.nan]), np.array([1.0]))
    assert none["n"] == 0 and none["mae"] is None
    no_p90 = ev.pooled_metrics(np.array([1.0]), np.array([np.nan]), np.array([2.0]))
    assert no_p90["coverage_p90"] is None and no_p90["mape"] == pytest.approx(50.0)


def test_too_short_applications_have_no_origin() -> None:
    report = ev.evaluate([ramp(n_s=10)], [LastValueForecaster()])
    assert all(r["n"] == 0 for r in report["results"])


def test_cli_json_shape_on_the_fixture(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = ev.main(["--trace", str(FIXTURE), "--split", "test", "--json", "--model", str(tmp_path / "none.pt")])
    assert rc == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert set(report) == {"apps", "samples", "results"}
    test_apps = [a for a in read_trace(FIXTURE).apps if split_of(a) == "test"]
    assert report["apps"] == len(test_apps) == 3
    methods = {r["method"] for r in report["results"]}
    # the model did not load; the served mixture goes on without it, as the daemon does
    assert methods == {"served", "last_value", "ewma", "vpa_percentile", "gbdt"}
    assert "model rows absent" in captured.err
    assert len(report["results"]) == 2 * 5 * 5
    for r in report["results"]:
        assert set(r) == {"target", "horizon_s", "method", "mae", "rmse", "r2", "mape", "coverage_p90",
                          "coverage_p90_tol", "pinball_p90", "n"}
        assert r["n"] > 300
        if r["method"] == "ewma":
            assert r["coverage_p90"] is None and r["pinball_p90"] is None
        else:  # last_value has its margin, learned on the fixture's train split
            assert 0.0 <= r["coverage_p90"] <= 1.0 and r["pinball_p90"] >= 0.0


def test_cli_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert ev.main(["--trace", str(tmp_path / "missing.csv")]) == 1
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ev.main(["--trace", str(FIXTURE), "--methods", "oracle"])
    # evaluating on all apps with no training trace: gbdt is absent, said so, nothing crashes
    assert ev.main(["--trace", str(FIXTURE), "--split", "all", "--methods", "last_value,gbdt", "--json"]) == 0
    out = capsys.readouterr()
    assert {r["method"] for r in json.loads(out.out)["results"]} == {"last_value"}
    assert "gbdt rows absent" in out.err


def test_model_metadata_names_the_gbdt_training_traces() -> None:
    class Meta:
        training = {"traces": [{"path": "a.csv.gz"}, "b.csv.gz"]}

    class Model:
        metadata = Meta()

    assert ev.training_traces_of(Model()) == ["a.csv.gz", "b.csv.gz"]

    class Checkpoint:
        metadata = type("M", (), {"training": {"trace_files": [{"path": "c.csv.gz", "apps": 3}]}})()

    class Wrapped:  # ModelForecaster keeps its metadata on .checkpoint
        checkpoint = Checkpoint()

    assert ev.training_traces_of(Wrapped()) == ["c.csv.gz"]
    assert ev.training_traces_of(object()) == []


def test_ewma_and_last_value_text_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert ev.main(["--trace", str(FIXTURE), "--split", "test", "--methods", "last_value,ewma"]) == 0
    out = capsys.readouterr().out
    assert "last_value" in out and "ewma" in out and "MAE" in out
    assert EwmaForecaster().name == "ewma"


def test_pinball_p90_is_the_protocol_formula() -> None:
    truth = np.array([10.0, 10.0, 0.0])
    p90 = np.array([8.0, 12.0, 0.0])
    # d = 2 -> 0.9*2 = 1.8; d = -2 -> 0.1*2 = 0.2; d = 0 -> 0
    assert ev.pinball_p90(p90, truth) == pytest.approx((1.8 + 0.2) / 3)
    m = ev.pooled_metrics(truth, p90, truth)
    assert m["pinball_p90"] == pytest.approx((1.8 + 0.2) / 3) and m["coverage_p90"] == pytest.approx(2 / 3)


def test_a_p90_a_rounding_step_under_its_truth_is_a_miss_in_coverage_p90_but_not_in_coverage_p90_tol() -> None:
    # a flat value as a weighted mean of experts that all say it: one rounding step under it
    flat = np.full(4, 8192.0)
    mixed = 0.3 * flat + 0.7 * flat * (1 + 1e-16) - 1e-12
    truth = np.array([8192.0, 8192.0, 8192.0, 8300.0])
    m = ev.pooled_metrics(truth, mixed, truth)
    assert (mixed < truth).all()
    assert m["coverage_p90"] == 0.0  # the protocol's exact test: every truth is over its P90
    assert m["coverage_p90_tol"] == pytest.approx(3 / 4)  # the real miss (8300) stays a miss
    assert m["pinball_p90"] == pytest.approx(0.9 * (8300.0 - mixed[3]) / 4, rel=1e-9)
    # a truth of 0 is judged to 1e-9, not to the last bit of 0
    zero = ev.pooled_metrics(np.zeros(2), np.array([-1e-12, -1e-3]), np.zeros(2))
    assert zero["coverage_p90"] == 0.0 and zero["coverage_p90_tol"] == pytest.approx(1 / 2)


def test_last_value_margin_is_the_90th_percentile_of_the_change_in_capacity_units() -> None:
    """Training: memory rises by 10 MiB a second on a 1,000 MiB device; evaluated on a 2,000 MiB one,
    the margin for h seconds is 10 h / 1000 x 2000 = 20 h MiB."""
    t = np.arange(40.0)
    train = AppTrace("tr", t, {"mem_used_mib": 10 * t, "mem_total_mib": np.full(40, 1000.0),
                               "sm_util_pct": np.where(t % 2 == 0, 10.0, 30.0)})
    fc = ev.LastValueMarginForecaster().fit([train])
    evald = AppTrace("ev", t, {"mem_used_mib": np.full(40, 500.0), "mem_total_mib": np.full(40, 2000.0),
                               "sm_util_pct": np.full(40, 50.0)})
    scores = ev.score_origins([evald], [fc])["last_value"]
    np.testing.assert_allclose(scores["mem_used_mib"].p90[0], [500 + 20 * h for h in HORIZONS_S])
    np.testing.assert_allclose(scores["mem_used_mib"].p50[0], [500.0] * 5)
    # compute alternates by +-20: the 90th percentile of the change is +20 (odd h) or 0 (even h)
    np.testing.assert_allclose(scores["sm_util_pct"].p90[0], [70, 50, 70, 50, 70])
    # without a stated capacity the margin is in MiB as trained
    bare = AppTrace("bare", t, {"mem_used_mib": np.full(40, 500.0)})
    np.testing.assert_allclose(ev.score_origins([bare], [fc])["last_value"]["mem_used_mib"].p90[0],
                               [500 + 10 * h for h in HORIZONS_S])


def test_a_sample_far_from_the_others_is_a_bad_row_not_a_crash_or_a_huge_grid(tmp_path: Path) -> None:
    """`vgpu eval --trace` as a user runs it, on a trace with one sample of an application 1e300 s
    (past int64 seconds: OverflowError, a traceback) or 1e9 s (a grid of 1e9 seconds: gigabytes)
    after the others: the sample is a bad row, said with its line, and the rest is scored."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    head = "t_s,app,gpu,mem_used_mib,sm_util_pct,mem_total_mib\n"
    rows = "".join(f"{t},a,0,{100 + t},10,80000\n" for t in range(20))
    for far in ("1e300", "1e9"):
        trace = tmp_path / f"far-{far}.csv"
        trace.write_text(head + rows + f"{far},a,0,100,10,80000\n")
        r = subprocess.run([sys.executable, "-m", "vgpu.cli", "eval", "--trace", str(trace), "--methods", "last_value",
                            "--split", "all", "--json"], cwd=root, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"{trace.name}:22: t_s {float(far)} is" in r.stderr and "may span at most 10000000 s" in r.stderr
        assert json.loads(r.stdout)["results"]


def test_the_default_split_says_how_many_applications_it_scores(tmp_path: Path) -> None:
    """`vgpu eval --trace node.csv` on a node's own recording scores by default only the applications
    the project's split holds out for testing: it says so, with the count and `--split all`, instead of
    quietly reporting one application of five; with `--split` given it says nothing of it, and a trace
    with no application in the default split names the way out."""
    import subprocess
    import sys

    from vgpu.traces import write_trace

    root = Path(__file__).resolve().parent.parent
    names = ["resnet50-train", "bert-train", "vit-infer", "bert-infer", "vit-finetune"]
    assert [split_of(n) for n in names].count("test") == 1
    node = tmp_path / "node.csv"
    write_trace(node, [ramp(30, app=n) for n in names], metadata={"recorded": True, "clock": "shared"})

    def vgpu_eval(trace: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "eval", "--trace", str(trace), "--methods", "ewma",
                               "--json", *args], cwd=root, capture_output=True, text=True, timeout=120)

    r = vgpu_eval(node)
    assert r.returncode == 0 and json.loads(r.stdout)["apps"] == 1, r.stderr
    assert "vgpu eval: scoring the 'test' split: 1 of 5 applications" in r.stderr and "--split all" in r.stderr
    r = vgpu_eval(node, "--split", "all")
    assert r.returncode == 0 and json.loads(r.stdout)["apps"] == 5 and "scoring the" not in r.stderr
    r = vgpu_eval(node, "--split", "test")
    assert r.returncode == 0 and "scoring the" not in r.stderr
    trained = tmp_path / "trained.csv"
    write_trace(trained, [ramp(30, app=n) for n in names[:2]])
    r = vgpu_eval(trained)
    assert r.returncode == 1 and "falls in the 'test' split" in r.stderr and "--split all" in r.stderr, r.stderr


def test_a_trace_too_short_for_any_origin_fails_and_says_how_long_it_must_be(tmp_path: Path) -> None:
    """`vgpu eval` on a recording shorter than the protocol's first origin: offline and `--online` both
    exit 1 with one line saying how many seconds an application must cover (from the code's constants),
    and one second more is enough for the 1 s horizon."""
    import subprocess
    import sys

    from vgpu.manager.baselines import MIN_ORIGIN_INDEX
    from vgpu.traces import write_trace

    root = Path(__file__).resolve().parent.parent
    need = MIN_ORIGIN_INDEX + 1 + min(HORIZONS_S)  # the first origin's second, then its 1 s truth
    meta = {"recorded": True, "clock": "shared"}
    short, enough = tmp_path / "short.csv", tmp_path / "enough.csv"
    write_trace(short, [ramp(need - 1, app=n) for n in ("a", "b")], metadata=meta)
    write_trace(enough, [ramp(need, app="a"), ramp(need - 1, app="b")], metadata=meta)

    def vgpu_eval(trace: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "eval", "--trace", str(trace), "--methods", "ewma",
                               *args], cwd=root, capture_output=True, text=True, timeout=120)

    for args in (("--split", "all"), ("--split", "all", "--json"), ("--online",), ("--online", "--json")):
        r = vgpu_eval(short, *args)
        assert r.returncode == 1 and r.stdout == "", (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("vgpu eval: no application is long enough"), (args, r.stderr)
        assert f"must cover {need} seconds" in lines[0] and f"({MIN_ORIGIN_INDEX + 1 + max(HORIZONS_S)} for every" \
            in lines[0] and f"the longest here covers {need - 1}" in lines[0], lines[0]
    r = vgpu_eval(enough, "--split", "all", "--json")
    assert r.returncode == 0, r.stderr
    n = {x["horizon_s"]: x["n"] for x in json.loads(r.stdout)["results"] if x["target"] == "sm_util_pct"}
    assert n[min(HORIZONS_S)] == 1 and n[max(HORIZONS_S)] == 0
