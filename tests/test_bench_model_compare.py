"""bench/eval_table.py and bench/val_compare.py: the tables relative to the last value, and the
validation comparison, on tiny inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_synth import population
from vgpu.manager.features import FeatureSpec
from vgpu.offline import train as T
from vgpu.traces import write_trace

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import eval_table  # noqa: E402


def _report(mae_model: float, mae_lv: float, pin_model: float | None, pin_lv: float) -> dict[str, object]:
    rows = []
    for method, mae, pin in (("model", mae_model, pin_model), ("last_value", mae_lv, pin_lv)):
        rows.append({"target": "sm_util_pct", "horizon_s": 5, "method": method, "mae": mae,
                     "pinball_p90": pin, "coverage_p90": 0.9 if pin is not None else None})
    return {"results": rows}


def test_eval_table_divides_by_the_first_reports_last_value() -> None:
    text = eval_table.table("set (real)", [("new", _report(1.0, 2.0, 0.5, 1.0)), ("old", _report(3.0, 9.0, None, 9.0))], [5])
    lines = text.splitlines()
    assert lines[0] == "**set (real)**"
    assert "| sm_util_pct | 5 | new/model | 1.000 | 0.500 | 0.500 | 0.900 |" in lines
    # the second report's model is divided by the first report's last value; its baselines are not repeated
    assert "| sm_util_pct | 5 | old/model | 3.000 | 1.500 |  |  |" in lines
    assert sum("last_value" in line for line in lines) == 1


def test_val_compare_reads_only_the_validation_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv.gz"
    write_trace(trace, population(train=3, val=2, test=2, seconds=30))
    model = tmp_path / "m.pt"
    assert T.main(["--trace", str(trace), "--out", str(model), "--epochs", "1", "--window", "8", "--quiet"]) == 0
    capsys.readouterr()
    out = subprocess.run(
        [sys.executable, str(BENCH / "val_compare.py"), "--by-file", "--trace", str(trace), f"a={model}"],
        capture_output=True, text=True, check=True, cwd=BENCH.parent,
    )
    report = json.loads(out.stdout)
    val = T.build_dataset([a for a in population(train=3, val=2, test=2, seconds=30)[3:5]],
                          FeatureSpec.for_version(8, 3))
    assert report["all"]["a"]["windows"] == len(val) == report[str(trace)]["a"]["windows"]
    assert "sm_util_pct/h5" in report["all"]["a"]["metrics"]
