"""`vgpu demo`: the summary's numbers from a short in-process run, and the --json output."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from manager_fakes import EwmaMarginForecaster

from vgpu.daemon.demo import launch_offsets_s, launch_order, main, run_demo
from vgpu.data import demo_trace_path
from vgpu.traces import read_trace

ROOT = Path(__file__).resolve().parent.parent


async def test_demo_summary_numbers() -> None:
    trace = read_trace(demo_trace_path())
    result = await run_demo(seconds=3, trace=trace, forecaster=EwmaMarginForecaster(), forecaster_label="ewma")
    s = result.summary
    assert s.apps == len(trace.apps) == 5
    assert 25 <= s.ticks <= 31  # 10 ticks a second; late ticks are skipped, never bunched
    # every tick, one signature per application the simulator was running (counted from the simulator)
    assert s.signatures == result.apps_present_total == result.signatures_sent
    assert s.signatures >= s.ticks  # the first application runs from the first tick
    assert s.decisions > 0 and result.rejected == 0
    assert s.mig_changes == 0
    assert result.power_limit_start_mw == 700_000
    # every change counted is one listed, and the lowest is the lowest of them
    assert len(result.power_limits_applied_mw) == s.power_limit_changes
    assert result.power_limit_min_seen_mw == min(result.power_limit_start_mw, *result.power_limits_applied_mw)
    # OOM events and lead times of the run (a median only where there were rises)
    assert s.oom_events >= 0 and (s.lead_time_median_s is None) == (s.rises == 0)


def test_launch_schedule_starts_the_lightest_first_and_alone() -> None:
    trace = read_trace(demo_trace_path())
    order = [name for name, _ in launch_order(trace)]
    assert sorted(order) == sorted(trace.apps) and order[0] == "bert-infer"
    offsets = launch_offsets_s(5, 20)
    assert offsets == pytest.approx([0, 5, 7.333333, 9.666667, 12])
    assert launch_offsets_s(1, 20) == [0.0]


def test_json_output_is_only_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seconds", "2", "--json", "--baseline"], "vgpu demo") == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    summary = json.loads(out[0])
    assert set(summary) == {"apps", "ticks", "signatures", "decisions", "power_limit_changes", "mig_changes",
                            "oom_events", "overrun_samples", "rises", "lead_time_median_s",
                            "lead_time_median_visible_s"}
    assert summary["oom_events"] >= 0 and summary["rises"] >= 0
    assert summary["overrun_samples"] >= summary["oom_events"]
    assert summary["apps"] == 5 and 16 <= summary["ticks"] <= 21 and summary["signatures"] >= summary["ticks"]


@pytest.mark.parametrize("args", [["--seconds", "-1"], ["--speed", "0"], ["--gpu", "rtx4090"]])
def test_bad_arguments_exit_with_usage(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args, "vgpu demo")
    assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_the_power_line_counts_the_changes_it_lists() -> None:
    """`vgpu demo` as a user runs it: the power line's count is the number of changes it lists, and
    its lowest is the lowest of them, even for a limit lowered and raised between two table lines."""
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "demo", "--seconds", "3", "--baseline"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("power limit ")]
    m = re.search(r"(\d+) W at start, lowest (\d+) W, (\d+) W at the end; (.*)", line)
    assert m is not None, line
    start, lowest, end = int(m[1]), int(m[2]), int(m[3])
    changes = re.match(r"(\d+) power-limit changes? applied during the run: ([\d >-]+) W", m[4])
    if changes is None:
        assert m[4].startswith("no power-limit change applied"), line
        assert lowest == start == end
        return
    path = [int(w) for w in changes[2].split(" -> ")]
    assert int(changes[1]) == len(path) - 1, line
    assert path[0] == start and path[-1] == end and min(path) == lowest, line


def test_ctrl_c_ends_the_run_early_with_its_summary_and_picture(tmp_path: Path) -> None:
    """`vgpu demo` interrupted as a user does it (SIGINT once the tables run): it stops at once and
    still prints the summary of what ran, and draws the picture it was asked for."""
    picture = tmp_path / "demo.svg"
    proc = subprocess.Popen([sys.executable, "-m", "vgpu.cli", "demo", "--seconds", "120", "--baseline",
                             "--plot", str(picture)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # the first table line: the run is under way
            seen.append(line)
            if line.startswith("t=  2.0 s"):
                break
        assert seen and seen[-1].startswith("t=  2.0 s"), "".join(seen)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    m = re.search(r"^summary after (\d+\.\d) s", out, re.MULTILINE)
    assert m is not None, out
    assert 2.0 <= float(m[1]) < 10.0, out  # ended where it was interrupted, not after 120 s
    assert re.search(r"^  profiler ticks\s+\d+", out, re.MULTILINE), out
    assert f"picture: {picture}" in out and picture.stat().st_size > 0


def test_json_with_a_picture_keeps_stdout_one_json_document(tmp_path: Path) -> None:
    """`vgpu demo --json --plot FILE | jq .` as a user pipes it: the picture's path goes to stderr."""
    picture = tmp_path / "demo.svg"
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "demo", "--seconds", "2", "--json", "--baseline",
                        "--plot", str(picture)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)  # the whole of stdout, nothing after the summary
    assert summary["apps"] == 5
    assert f"picture: {picture}" in r.stderr and picture.stat().st_size > 0
