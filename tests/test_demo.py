"""`vgpu demo`: the summary's numbers from a short in-process run, and the --json output."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from manager_fakes import EwmaMarginForecaster

from vgpu.allocator.policy.base import Sizing
from vgpu.daemon.demo import (
    DEMO_RUNS,
    DemoResult,
    DemoSummary,
    Overruns,
    SizerUnavailable,
    count_overruns,
    default_sizer,
    describe,
    launch_offsets_s,
    launch_order,
    main,
    run_demo,
)
from vgpu.data import demo_trace_path
from vgpu.jobs import JobConfig
from vgpu.traces import read_trace

ROOT = Path(__file__).resolve().parent.parent


class RecordingSizer:
    """A cold-start sizer that records every job it is asked to size and answers 1000 MiB plus the
    batch size, no SM (so every declaration fits), making each grant tell which job it was sized for;
    a job of a model in `too_big` is sized beyond any GPU (the allocator refuses it)."""

    def __init__(self, too_big: frozenset[str] = frozenset()) -> None:
        self.jobs: list[JobConfig] = []
        self.too_big = too_big

    def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
        assert mem_total_mib > 0
        self.jobs.append(job)
        if job.model_type in self.too_big:
            return Sizing(memory_mib=10 * mem_total_mib, sm_pct=0.0, reason="too big")
        return Sizing(memory_mib=1000.0 + job.batch_size, sm_pct=0.0, reason="recorded")


async def test_demo_summary_numbers() -> None:
    trace = read_trace(demo_trace_path())
    # the recording sizer stands in for the shipped one (no torch to load; the jobs' path has its own test)
    result = await run_demo(seconds=3, trace=trace, forecaster=EwmaMarginForecaster(), forecaster_label="ewma",
                            sizer=RecordingSizer(), sizer_label="recording")
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
    # the per-application counts add up to the total, and name only applications that had events
    assert sum(n for _, n in s.oom_events_by_app) == s.oom_events
    assert all(n > 0 and app in trace.apps for app, n in s.oom_events_by_app)


NAN = math.nan


@pytest.mark.parametrize(
    ("used", "granted", "expected"),
    [
        ([], [], Overruns(0, 0)),
        # no grant yet (NaN) is never an overrun, however much is used
        ([5000, 9000], [NAN, NAN], Overruns(0, 0)),
        # at the grant is not over it; one run of three samples over is one event
        ([100, 101, 150, 120, 100], [100, 100, 100, 100, 100], Overruns(1, 3)),
        # two runs with a sample under between them: two events
        ([200, 50, 200, 200], [100, 100, 100, 100], Overruns(2, 3)),
        # a grant raised past the use ends the run; a later rise past it starts another
        ([200, 200, 300], [100, 250, 250], Overruns(2, 2)),
    ],
)
def test_count_overruns(used: list[float], granted: list[float], expected: Overruns) -> None:
    assert count_overruns(used, granted) == expected


def test_count_overruns_needs_one_grant_per_sample() -> None:
    with pytest.raises(ValueError):
        count_overruns([1.0, 2.0], [1.0])


def _result(summary: DemoSummary) -> DemoResult:
    return DemoResult(summary=summary, forecaster="ewma", apps_present_total=0, signatures_sent=0, rejected=0,
                      power_limit_start_mw=700_000, power_limit_end_mw=700_000, power_limit_min_seen_mw=700_000,
                      seconds=1.0)


def test_the_oom_line_names_each_application_with_its_events() -> None:
    """The summary says who had the OOM events, most first; with none it names nobody."""
    s = DemoSummary(apps=5, ticks=10, signatures=10, decisions=1, power_limit_changes=0, mig_changes=0,
                    oom_events=3, oom_events_by_app=(("resnet50-train", 2), ("bert-train", 1)), overrun_samples=13)
    (line,) = [ln for ln in describe(_result(s)).splitlines() if "OOM events" in ln]
    assert line == ("  OOM events          3 (resnet50-train 2, bert-train 1; runs of samples asking more memory "
                    "than granted; 13 samples over)")
    assert json.loads(s.to_json())["oom_events_by_app"] == {"resnet50-train": 2, "bert-train": 1}
    none = DemoSummary(apps=5, ticks=10, signatures=10, decisions=1, power_limit_changes=0, mig_changes=0)
    (line,) = [ln for ln in describe(_result(none)).splitlines() if "OOM events" in ln]
    assert line == "  OOM events          0 (runs of samples asking more memory than granted; 0 samples over)"
    assert json.loads(none.to_json())["oom_events_by_app"] == {}


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
                            "oom_events", "oom_events_by_app", "overrun_samples", "rises", "lead_time_median_s",
                            "lead_time_median_visible_s", "job_configs", "cold_start_grants",
                            "registrations_refused", "reclaims"}
    assert summary["oom_events"] >= 0 and summary["rises"] >= 0
    assert summary["overrun_samples"] >= summary["oom_events"]
    by_app = summary["oom_events_by_app"]
    assert sum(by_app.values()) == summary["oom_events"] and all(n > 0 for n in by_app.values())
    assert summary["apps"] == 5 and 16 <= summary["ticks"] <= 21 and summary["signatures"] >= summary["ticks"]
    # the shipped cold-start sizer sized at least the first application's job (alone on the GPU, it fits)
    assert summary["job_configs"] is True and summary["cold_start_grants"] >= 1


def test_a_sizer_that_does_not_load_is_said(tmp_path: Path) -> None:
    """No cold-start model where the sizer is looked for: the demo says so and names --no-job-config."""
    with pytest.raises(SizerUnavailable, match="--no-job-config"):
        default_sizer(tmp_path / "absent.pt")


def test_no_job_config_declares_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """`vgpu demo --no-job-config --json`: the demo as it ran before the applications declared jobs."""
    assert main(["--seconds", "2", "--json", "--baseline", "--no-job-config"], "vgpu demo") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["job_configs"] is False
    assert summary["cold_start_grants"] == 0 and summary["registrations_refused"] == 0 and summary["reclaims"] == 0
    assert summary["apps"] == 5 and summary["signatures"] >= summary["ticks"] > 0


async def test_each_run_declares_its_job_and_the_sizer_sizes_its_grant() -> None:
    """The applications declare their runs' jobs through the client stub and the allocator's sizer
    sizes each grant: every job the sizer saw is one declared, in order, and each registration was
    granted the sizer's size for its own job (as `vgpu serve` grants a request with a job and no
    memory). A job the allocator refuses (sized beyond the GPU) is said, with the daemon's error, and the
    application runs on. At 40x, runs after the first register within the 3 s."""
    sizer = RecordingSizer(too_big=frozenset({"vision_transformer"}))
    result = await run_demo(seconds=3, speed=40, forecaster=EwmaMarginForecaster(), forecaster_label="ewma",
                            sizer=sizer, sizer_label="recording")
    regs = result.registrations
    assert [r.job for r in regs] == sizer.jobs
    refused = [r for r in regs if r.job.model_type == "vision_transformer"]
    for r in regs:
        if r in refused:
            assert r.refused.startswith("RESOURCE_EXHAUSTED: ") and r.source == "", r
            assert math.isnan(r.granted_mib), r  # nothing granted
        else:
            assert r.source == "cold_start" and r.refused == "", r
            assert r.granted_mib == 1000.0 + r.job.batch_size, r
    assert refused and result.summary.registrations_refused == len(refused)
    assert result.summary.cold_start_grants == len(regs) - len(refused)
    # the refused applications ran on: the allocator planned them from their forecasts instead
    assert {h.app_id for h in result.history} >= {"vit-infer", "vit-finetune"}
    # each application declared its runs in their order (at launch the first, then the later ones)
    by_app: dict[str, list[JobConfig]] = {}
    for r in regs:
        by_app.setdefault(r.app_id, []).append(r.job)
    assert set(by_app) == set(DEMO_RUNS)
    for app_id, jobs in by_app.items():
        runs = [run.job for run in DEMO_RUNS[app_id]]
        assert jobs == [runs[i % len(runs)] for i in range(len(jobs))], app_id
    assert Counter(len(jobs) > 1 for jobs in by_app.values())[True] >= 2  # later runs did register


# The last sample of a stretch at which the slice held no CUDA context (a process that registers
# starts before its first allocation): under this many MiB.
NO_CONTEXT_MIB = 64


def test_demo_runs_register_before_their_memory_rises() -> None:
    """Each later run registers at the last sample at or before its start_timestamp at which the
    slice held no CUDA context, that is before its memory rises (the bundled trace)."""
    trace = read_trace(demo_trace_path())
    assert set(DEMO_RUNS) == set(trace.apps)
    for app_id, runs in DEMO_RUNS.items():
        t = trace.apps[app_id].t_s
        mem = trace.apps[app_id].column("mem_used_mib")
        assert runs[0].register_at_s == 0 and runs[0].run_start_s < 0, app_id
        for run in runs[1:]:
            idle = [ts for ts, m in zip(t, mem, strict=True) if ts <= run.run_start_s and m < NO_CONTEXT_MIB]
            assert idle and run.register_at_s == idle[-1], (app_id, run)
            after = mem[t > run.register_at_s]
            assert after[after >= NO_CONTEXT_MIB].size > 0  # its memory rises after it registered


def test_demo_runs_are_migperfs_runs(shared_data: Path) -> None:
    """Each declared job is the MIGPerf run at that place of the stretch: model, batch size and
    sequence length from the result tables, and the run's start_timestamp."""
    from vgpu.offline.convert import DEMO_STRETCHES, _Issues, migperf_runs

    root = shared_data / "migperf-a100-mig" / "data"
    for stretch in DEMO_STRETCHES:
        runs = migperf_runs(root / stretch.folder, _Issues(strict=False), Counter())
        declared = DEMO_RUNS[stretch.app]
        for run in declared:
            (table,) = [r for r in runs if r.start_s - stretch.start_s == run.run_start_s]
            assert table.model == run.job.model_type and table.batch_size == run.job.batch_size, (stretch.app, run)
            assert table.mig_profile == stretch.mig_profile
            if table.seq_length is not None:
                assert table.seq_length == run.job.input_size
        # every run that starts inside the stretch is declared
        inside = [r for r in runs if 0 < r.start_s - stretch.start_s <= stretch.end_s - stretch.start_s]
        assert len(inside) == len(declared) - 1, stretch.app


@pytest.mark.parametrize("args", [["--seconds", "-1"], ["--speed", "0"], ["--gpu", "rtx4090"]])
def test_bad_arguments_exit_with_usage(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args, "vgpu demo")
    assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_the_power_line_counts_the_changes_it_lists() -> None:
    """`vgpu demo` as a user runs it: the power line's count is the number of changes it lists, and
    its lowest is the lowest of them, even for a limit lowered and raised between two table lines."""
    # --no-job-config: no cold-start sizer to load for a test of the power line
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "demo", "--seconds", "3", "--baseline", "--no-job-config"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # 3 s end before the first rise of memory: the lead-time line says so rather than "- over 0 rises"
    assert re.search(r"^  lead time +none: no rise of memory beyond its grant in this run", r.stdout, re.MULTILINE), r.stdout
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
        for line in proc.stdout:  # a line of its third second or later: the run is under way
            seen.append(line)
            # a loaded machine may print the second's table at 2.1 s rather than 2.0 s
            at = re.match(r"t=\s*(\d+\.\d) s", line)
            if at is not None and float(at[1]) >= 2.0:
                break
        assert seen and re.match(r"t=\s*\d+\.\d s", seen[-1]), "".join(seen)
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
    # the first application declared its job as it started, before any table shows its memory in use,
    # and the shipped sizer sized it; the second on its line is not pinned (about 0.x s on a quiet
    # machine, a second or more on a loaded one, whose gRPC call to the demo's allocator is slower)
    text = "".join(seen) + out
    declared = re.search(r"^t=\s*\d+\.\d s  bert-infer \(pid \d+\) declares its job: bert-base infer, batch 1, fp32; "
                         r"cold-start grant \d+ MiB$", text, re.MULTILINE)
    assert declared is not None, text
    in_use = re.search(r"^bert-infer +\d+ MiB", text, re.MULTILINE)
    assert in_use is None or declared.start() < in_use.start(), text
    assert re.search(r"^  job configs +\d+ declared through the client stub, [1-9]\d* granted at the size "
                     r"cold-start sizer .* gave \(\d+ of them by taking room from other applications' forecast "
                     r"grants\), \d+ refused", out, re.MULTILINE), out
    assert f"picture: {picture}" in out and picture.stat().st_size > 0


def test_json_with_a_picture_keeps_stdout_one_json_document(tmp_path: Path) -> None:
    """`vgpu demo --json --plot FILE | jq .` as a user pipes it: the picture's path goes to stderr."""
    picture = tmp_path / "demo.svg"
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "demo", "--seconds", "2", "--json", "--baseline",
                        "--no-job-config", "--plot", str(picture)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)  # the whole of stdout, nothing after the summary
    assert summary["apps"] == 5
    assert f"picture: {picture}" in r.stderr and picture.stat().st_size > 0
