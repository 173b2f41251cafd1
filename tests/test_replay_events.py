"""bench/replay_events.py: the seconds before each OOM event of a replayed policy, as a function and
as the command an engineer runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import replay_events as E  # noqa: E402
from vgpu.device.skus import get_sku  # noqa: E402
from vgpu.manager.baselines import LastValueForecaster  # noqa: E402
from vgpu.traces import AppTrace, write_trace  # noqa: E402

R = E.R  # the replay module the tool itself uses

SKU = get_sku("h100-80gb")
# 60 s flat at 20 GB, then a 10 GB jump the last value cannot foresee, held for 20 s
MEM = [20_000.0] * 60 + [30_000.0] * 20


def _trace(name: str = "a") -> AppTrace:
    return AppTrace(name, np.arange(len(MEM), dtype=float) + 1000.0,
                    {"mem_used_mib": np.array(MEM), "sm_util_pct": np.full(len(MEM), 10.0)})


def test_each_oom_event_comes_with_the_seconds_before_it_and_the_rule_in_force() -> None:
    apps = R.pack(R.prepare([_trace()])[0], SKU)
    result, events = E.oom_events(apps, SKU, LastValueForecaster(), kill_on_oom=False, before_s=3)
    assert result["oom_events"] == len(events) == 1
    (e,) = events
    assert (e["app"], e["t_s"], e["used_mib"]) == ("a", 60, 30_000.0)
    assert e["over_mib"] == pytest.approx(30_000.0 - e["grant_mib"])
    assert [row["t_s"] for row in e["seconds"]] == [57, 58, 59, 60]
    before = e["seconds"][-2]
    assert before["used_mib"] == 20_000.0 and before["grant_mib"] == e["grant_mib"]
    assert before["rule"] in ("dwell", "below-threshold", "usage", "forecast")
    assert e["seconds"][-1]["target_mib"] > 30_000.0  # the policy's answer to the event, planned at it


def test_only_dynamic_policies_are_explained() -> None:
    apps = R.pack(R.prepare([_trace()])[0], SKU)
    with pytest.raises(ValueError, match="policy must be one of"):
        E.oom_events(apps, SKU, LastValueForecaster(), policy="static")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "replay_events.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_command_prints_the_events_as_json_and_as_a_table(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, [_trace()])
    common = ["--trace", str(path), "--split", "all", "--forecaster", "last_value", "--cooperative"]
    out = _run(*common, "--json", "--before-s", "2")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["oom_events"] == 1 and doc["policy"] == "predictive"
    assert [row["t_s"] for row in doc["events"][0]["seconds"]] == [58, 59, 60]
    table = _run(*common)
    assert table.returncode == 0, table.stderr
    assert "1 OOM events" in table.stdout and "a (GPU 0) at 60 s: 30,000 MiB used" in table.stdout


@pytest.mark.parametrize("bad", [["--before-s", "-1"], ["--policy", "vpa", "--set", "mem_burst_window_s=0"],
                                 ["--set", "no_such_setting=1"]])
def test_the_command_refuses_what_it_cannot_do(tmp_path: Path, bad: list[str]) -> None:
    path = tmp_path / "t.csv"
    write_trace(path, [_trace()])
    out = _run("--trace", str(path), "--split", "all", "--forecaster", "last_value", *bad)
    assert out.returncode == 2 and out.stderr.startswith("replay_events: ")
