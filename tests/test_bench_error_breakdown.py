"""bench/error_breakdown.py: the protocol's error split into an application's final seconds and its
body, on traces whose answer is known by construction, and vgpu.offline.evaluate.score_origins behind it."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from vgpu.manager.baselines import EwmaForecaster, LastValueForecaster
from vgpu.manager.forecast import HORIZONS_S
from vgpu.offline import evaluate as ev
from vgpu.traces import AppTrace

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import error_breakdown  # noqa: E402


def run(app: str, n_s: int, mem_at: dict[int, float], sm_at: dict[int, float]) -> AppTrace:
    """One sample a second; memory and compute hold their value until the second named in the map."""
    t = np.arange(n_s, dtype=np.float64)

    def steps(at: dict[int, float], start: float) -> np.ndarray:
        out = np.full(n_s, start)
        for k, v in sorted(at.items()):
            out[k:] = v
        return out

    return AppTrace(app=app, t_s=t, columns={"mem_used_mib": steps(mem_at, 1000.0), "sm_util_pct": steps(sm_at, 50.0)})


def test_score_origins_says_where_each_row_comes_from_and_matches_evaluate() -> None:
    apps = [run("a", 30, {29: 500.0}, {15: 80.0}), run("b", 20, {}, {12: 10.0})]
    fcs = [LastValueForecaster(), EwmaForecaster()]
    scores = ev.score_origins(apps, fcs)
    sc = scores["last_value"]["mem_used_mib"]
    # origins 9 .. len - 2 of each grid, applications in the order given
    assert sc.app == ("a",) * 20 + ("b",) * 10
    assert list(sc.origin) == list(range(9, 29)) + list(range(9, 19))
    assert set(sc.grid_len[:20]) == {30} and set(sc.grid_len[20:]) == {20}
    assert sc.p50.shape == sc.truth.shape == (30, len(HORIZONS_S))
    assert np.isnan(sc.truth[19, 1]) and sc.truth[19, 0] == 500.0  # origin 28 of a: only h=1 is in the grid
    # evaluate() is these scores pooled: same MAE for every row
    report = ev.evaluate(apps, fcs)
    for row in report["results"]:
        s = scores[row["method"]][row["target"]]
        j = HORIZONS_S.index(row["horizon_s"])
        ok = np.isfinite(s.truth[:, j])
        assert row["mae"] == pytest.approx(float(np.abs(s.p50[ok, j] - s.truth[ok, j]).mean()))


def test_change_only_at_teardown_is_all_in_the_final_seconds() -> None:
    # memory drops in each run's last second; compute steps mid-run
    apps = [run(f"r{i}", 40, {39: 200.0}, {20 + i: 90.0}) for i in range(3)]
    scores = ev.score_origins(apps, [LastValueForecaster(), EwmaForecaster()])
    by_target = {t["target"]: t for t in error_breakdown.breakdown(scores, horizon_s=5, final_s=1)}
    mem, sm = by_target["mem_used_mib"], by_target["sm_util_pct"]
    # 40 s runs: origins 9..34 score h=5; only origin 34's truth (second 39) is final
    assert mem["n"] == 3 * 26 and mem["n_final"] == 3
    assert mem["change_share_final"] == 1.0 and mem["change_mae"] == pytest.approx(3 * 800.0 / (3 * 26))
    assert sm["change_share_final"] == 0.0
    for m in mem["methods"]:
        assert m["mae"] == pytest.approx(m["mae_final_part"] + m["mae_body_part"])
    last = {m["method"]: m for m in mem["methods"]}["last_value"]
    assert last["mae_body"] == 0.0 and last["mae_final_part"] == pytest.approx(mem["change_mae"])
    assert last["coverage_p90"] is None  # last_value has no P90


def test_a_wider_final_window_takes_in_more_origins() -> None:
    apps = [run("r", 40, {37: 200.0}, {})]  # the drop is in the third-last second
    scores = ev.score_origins(apps, [LastValueForecaster()])
    narrow, wide = (error_breakdown.breakdown(scores, 5, f)[0] for f in (1, 3))
    # origins 32, 33 and 34 see the drop 5 s ahead (truths at seconds 37, 38, 39); only 34's is the last
    assert narrow["n_final"] == 1 and narrow["change_share_final"] == pytest.approx(1 / 3)
    assert wide["n_final"] == 3 and wide["change_share_final"] == 1.0


def write_trace(path: Path, apps: list[AppTrace]) -> None:
    lines = ["t_s,app,mem_used_mib,sm_util_pct"]
    for a in apps:
        lines += [f"{t},{a.app},{m},{s}" for t, m, s in zip(a.t_s, a.columns["mem_used_mib"], a.columns["sm_util_pct"], strict=True)]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")


def test_the_command_prints_json_for_every_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv.gz"
    write_trace(path, [run(f"app{i}", 30, {29: 10.0}, {}) for i in range(6)])
    # no checkpoint at this path: the model rows are left out with a warning, the rest runs
    assert error_breakdown.main(["--trace", str(path), "--split", "all", "--json",
                                 "--model", str(tmp_path / "none.pt")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["apps"] == 6 and [t["target"] for t in report["targets"]] == ["mem_used_mib", "sm_util_pct"]
    assert [m["method"] for m in report["targets"][0]["methods"]] == ["last_value"]
    assert report["targets"][0]["change_share_final"] == 1.0


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert error_breakdown.main(["--trace", str(tmp_path / "missing.csv")]) == 1
    assert "missing.csv" in capsys.readouterr().err
    path = tmp_path / "t.csv.gz"
    write_trace(path, [run("only", 30, {}, {})])
    with pytest.raises(SystemExit):
        error_breakdown.main(["--trace", str(path), "--final-s", "0"])
