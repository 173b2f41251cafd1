"""In-app reports left by processes killed without closing are removed by the daemon; the reports of
processes that run, fresh files, and anything that is not a stub's are left."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from daemon_fixtures import sim_daemon

from vgpu.client import InAppCounters, InAppReport, make_inapp_dir, write_inapp
from vgpu.daemon.inapp_sweep import InAppSweeper

OLD_S = 120.0  # older than the sweeper's age


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    return child.pid  # (not reused within the test: pids cycle through the whole range first)


def _written_at(path: Path, t: float) -> Path:
    os.utime(path, (t, t), follow_symlinks=False)
    return path


def _aged(path: Path, age_s: float) -> Path:
    return _written_at(path, time.time() - age_s)


def _report(directory: Path, pid: int, path: Path | None = None) -> Path:
    return write_inapp(directory, InAppReport("job", pid, 0.0, time.time(), InAppCounters()), path=path)


def test_reports_of_gone_processes_go_and_the_rest_stays(tmp_path: Path) -> None:
    d = tmp_path / "inapp"
    make_inapp_dir(d)
    dead = _dead_pid()
    runs = subprocess.Popen(["sleep", "60"])
    try:
        started = psutil.Process(runs.pid).create_time()
        now = time.time() + 10 * OLD_S  # the sweep's clock: every file written before it by more than OLD_S
        temp = d / f".{dead}.json.x1y2z3ab"  # a write cut short
        temp.touch()
        target = tmp_path / "not-in-the-directory"
        target.write_text("kept")
        link = d / f"{dead}.{'ef' * 16}.json"
        link.symlink_to(target)
        gone = [
            _report(d, dead),  # its process exited
            _report(d, dead, d / f"{dead}.{'ab' * 16}.json"),  # the same under a claimed name
            temp,
            link,
            # written before the process now at its pid began: a reused pid's
            _written_at(_report(d, runs.pid, d / f"{runs.pid}.{'cd' * 16}.json"), started - OLD_S),
        ]
        kept = [
            _written_at(_report(d, dead, d / f"{dead}.{'01' * 16}.json"), now - 1),  # fresh: its writer may be starting
            _written_at(_report(d, runs.pid), started + 2),  # by a process that still runs (stopped, say)
        ]
        other = d / "notes.txt"
        other.write_text("not a report")
        folder = d / f"{dead}.json.d"
        folder.mkdir()
        squat_dir = d / f"{_dead_pid()}.json"
        squat_dir.mkdir()

        result = InAppSweeper(d).sweep(now)
    finally:
        runs.kill()
        runs.wait(10)
    assert result.removed == len(gone)
    assert result.kept_running == 1 and result.not_removable == 0
    assert not [p for p in gone if os.path.lexists(p)]
    assert all(p.exists() for p in kept) and other.exists() and folder.is_dir() and squat_dir.is_dir()
    assert target.read_text() == "kept"  # the link went, not what it named


def test_a_sweep_reads_a_bounded_number_of_entries_and_goes_on_where_it_stopped(tmp_path: Path) -> None:
    d = tmp_path / "inapp"
    make_inapp_dir(d)
    dead = _dead_pid()
    for k in range(10):
        _aged(_report(d, dead, d / f"{dead}.{k:032x}.json"), OLD_S)
    for k in range(15):
        (d / f"filler-{k}").touch()
    sweeper = InAppSweeper(d, scan_entries=8)
    steps = [sweeper.sweep(time.time()) for _ in range(4)]
    assert all(s.entries <= 8 for s in steps)
    assert sum(s.removed for s in steps) == 10
    assert not list(d.glob("*.json"))


def test_a_missing_directory_is_nothing_to_sweep(tmp_path: Path) -> None:
    assert InAppSweeper(tmp_path / "absent").sweep(time.time()).entries == 0


async def test_the_daemon_removes_the_report_of_a_job_killed_with_sigkill(tmp_path: Path) -> None:
    d = tmp_path / "inapp"
    # a client stub that writes its report and is then killed: nothing of it removes the file
    program = ("import sys, time\nfrom vgpu.client import VgpuClient\n"
               "c = VgpuClient('killed', socket=sys.argv[1], inapp_dir=sys.argv[2], watch=False)\n"
               "c.report_now()\nprint('ready', flush=True)\ntime.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", program, str(tmp_path / "none.sock"), str(d)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    report = d / f"{child.pid}.json"
    assert report.exists()
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert report.exists()
    _aged(report, OLD_S)
    daemon = sim_daemon(tmp_path, **{"server.inapp_dir": str(d)})
    daemon.inapp_sweep_every_s = 0.1
    await daemon.start()
    try:
        deadline = time.monotonic() + 30
        while report.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not report.exists()
    finally:
        await daemon.stop("test")
