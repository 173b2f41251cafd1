"""In-app reports left by processes killed without closing are removed by the daemon; the reports of
processes that run, fresh files, and anything that is not a stub's are left. An in-app directory
another user controls (a symbolic link, theirs, writable without the sticky bit) stops the start, and
one swapped after the start is not followed: the daemon, as root, removes nothing elsewhere."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from daemon_fixtures import ROOT, SKU, make_env, sim_daemon
from structlog.testing import capture_logs

from vgpu.client import InAppCounters, InAppReport, make_inapp_dir, write_inapp
from vgpu.daemon.inapp_sweep import InAppSweeper
from vgpu.daemon.serve import StartupError, prepare_inapp_dir

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


# --- a directory another user controls --------------------------------------------------------------------
def _victim(tmp_path: Path, dead: int) -> list[Path]:
    """Report-named files, old, of a gone pid, in a root-only directory the sweep must never touch."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    return [_aged(_report(victim, dead, victim / name), OLD_S) for name in (f"{dead}.json", f"{dead}.{'ab' * 16}.json")]


def test_a_directory_swapped_for_a_link_after_the_first_sweep_is_not_followed(tmp_path: Path) -> None:
    d = tmp_path / "inapp"
    make_inapp_dir(d)
    dead = _dead_pid()
    victims = _victim(tmp_path, dead)
    sweeper = InAppSweeper(d)
    assert sweeper.sweep(time.time()).skipped is None  # the directory is held from here on
    d.rename(tmp_path / "inapp-moved")
    d.symlink_to(tmp_path / "victim")  # what a user who can write the parent could do
    first, second = sweeper.sweep(time.time()), sweeper.sweep(time.time())
    assert all(p.exists() for p in victims)
    assert (first.removed, first.entries, second.removed, second.entries) == (0, 0, 0, 0)
    assert first.skipped is not None and "no longer names the directory" in first.skipped, first
    assert second.skipped == f"{d}: it is a symbolic link", second
    sweeper.close()


def test_a_swap_during_a_sweep_removes_in_the_directory_held(tmp_path: Path) -> None:
    """The swap comes between the sweep's look at a report and its removal: the removal is relative
    to the directory opened, so it takes the held directory's file, not the same name elsewhere."""
    d = tmp_path / "inapp"
    make_inapp_dir(d)
    dead = _dead_pid()
    victims = _victim(tmp_path, dead)
    ours = _aged(_report(d, dead), OLD_S)

    def swap_then_say_gone(pid: int) -> float | None:
        if not d.is_symlink():
            d.rename(tmp_path / "inapp-moved")
            d.symlink_to(tmp_path / "victim")
        return None

    result = InAppSweeper(d, process_start=swap_then_say_gone).sweep(time.time())
    assert all(p.exists() for p in victims)
    assert not (tmp_path / "inapp-moved" / ours.name).exists()
    assert result.removed == 1, result


@pytest.mark.parametrize("make, why", [
    (lambda d: d.symlink_to(d.parent / "victim"), "it is a symbolic link"),
    (lambda d: (make_inapp_dir(d), os.chown(d, 65534, 65534)), "it is owned by uid 65534"),
    (lambda d: (d.mkdir(), os.chmod(d, 0o777)), "its mode is 0777: writable by other users without the sticky bit"),
], ids=["symlink", "another-users", "not-sticky"])
def test_a_directory_another_user_controls_is_not_swept(tmp_path: Path, make: Callable[[Path], object],
                                                         why: str) -> None:
    d = tmp_path / "inapp"
    dead = _dead_pid()
    victims = _victim(tmp_path, dead)
    make(d)
    if not d.is_symlink():  # reports of a gone process in the directory itself stay too
        victims.append(_aged(_report(d, dead), OLD_S))
    result = InAppSweeper(d).sweep(time.time())
    assert all(p.exists() for p in victims)
    assert (result.removed, result.entries) == (0, 0)
    assert result.skipped is not None and why in result.skipped, result


@pytest.mark.parametrize("make, why", [
    (lambda d: (d.parent.joinpath("victim").mkdir(), d.symlink_to(d.parent / "victim")), "it is a symbolic link"),
    (lambda d: (make_inapp_dir(d), os.chown(d, 65534, 65534)), "it is owned by uid 65534"),
    (lambda d: (d.mkdir(), os.chmod(d, 0o777)), "its mode is 0777"),
    (lambda d: d.write_text(""), "it is not a directory"),
], ids=["symlink", "another-users", "not-sticky", "a-file"])
def test_the_start_refuses_an_inapp_directory_another_user_controls(tmp_path: Path, make: Callable[[Path], object],
                                                                   why: str) -> None:
    d = tmp_path / "inapp"
    make(d)
    with pytest.raises(StartupError, match=rf"server.inapp_dir {d}: {why}.*--inapp-dir"):
        prepare_inapp_dir(d)


@pytest.mark.parametrize("make, state", [
    (lambda d: None, "created"),
    (make_inapp_dir, "present"),
    # nobody else may write there: safe, but of no use to other users' applications, which the record says
    (lambda d: (d.mkdir(), os.chmod(d, 0o755)), f"present, but its mode is 0755: only applications of uid "
                                                f"{os.geteuid()} can write their in-app reports there (1777 lets "
                                                "every user's)"),
    (lambda d: (d.mkdir(), os.chmod(d, 0o1770)), f"present, but its mode is 1770: only applications of uid "
                                                 f"{os.geteuid()} and its group can write their in-app reports there "
                                                 "(1777 lets every user's)"),  # a group's, sticky
], ids=["missing", "made-by-a-stub", "root-only", "sticky-group"])
def test_the_start_takes_an_inapp_directory_of_its_own(tmp_path: Path, make: Callable[[Path], object],
                                                       state: str) -> None:
    d = tmp_path / "inapp"
    make(d)
    assert prepare_inapp_dir(d) == state


@pytest.mark.parametrize("make, status, said", [
    (lambda d: None, "WARN", "does not exist: the daemon makes it at start"),
    (make_inapp_dir, "OK", "(mode 1777): every user's applications can report"),
    (lambda d: (d.mkdir(), os.chmod(d, 0o755)), "WARN", f"only applications of uid {os.geteuid()} can write"),
    (lambda d: (d.mkdir(), os.chmod(d, 0o777)), "FAIL", "its mode is 0777: writable by other users without the "
                                                        "sticky bit"),
    (lambda d: (make_inapp_dir(d), os.chown(d, 65534, 65534)), "FAIL", "owned by uid 65534"),
], ids=["missing", "sound", "root-only", "not-sticky", "another-users"])
def test_the_doctor_says_whether_every_users_applications_can_report(tmp_path: Path, make: Callable[[Path], object],
                                                                    status: str, said: str) -> None:
    from vgpu.daemon.doctor import check_inapp_dir

    d = tmp_path / "inapp"
    make(d)
    check = check_inapp_dir(d)
    assert (check.name, check.status) == ("inapp dir", status) and said in check.detail, check


def test_vgpu_serve_refuses_a_symlinked_inapp_directory(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "inapp").symlink_to(tmp_path / "elsewhere")
    r = subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(env.sock), "--state-dir", str(env.state),
         "--backend", f"sim:{SKU}", "--metrics-port", "0", "--inapp-dir", str(tmp_path / "inapp")],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2  # as a configuration error: every later start would meet it too
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"vgpu serve: server.inapp_dir {tmp_path / 'inapp'}: it is a symbolic link; remove it and let "
                    "the daemon make it (a directory of root's, mode 1777), or choose another --inapp-dir"), r.stderr
    assert '"serving"' not in r.stderr and not env.sock.exists()


async def test_the_daemon_stops_sweeping_a_directory_swapped_for_a_link(tmp_path: Path) -> None:
    d = tmp_path / "inapp"
    dead = _dead_pid()
    victims = _victim(tmp_path, dead)
    daemon = sim_daemon(tmp_path, **{"server.inapp_dir": str(d)})
    daemon.inapp_sweep_every_s = 0.05
    with capture_logs() as logs:
        await daemon.start()
        try:
            ours = _aged(_report(d, dead), OLD_S)
            deadline = time.monotonic() + 30
            while ours.exists() and time.monotonic() < deadline:  # swept while it is the daemon's
                await asyncio.sleep(0.05)
            assert not ours.exists()
            d.rename(tmp_path / "inapp-moved")
            d.symlink_to(tmp_path / "victim")
            await asyncio.sleep(1.0)  # some 20 sweeps
        finally:
            await daemon.stop("test")
    assert all(p.exists() for p in victims)
    skipped = [r["reason"] for r in logs if r["event"] == "inapp_sweep_skipped"]
    assert [r["log_level"] for r in logs if r["event"] == "inapp_sweep_skipped"] == ["warning", "warning"]
    assert "no longer names the directory" in skipped[0] and skipped[1] == f"{d}: it is a symbolic link", skipped


def test_vgpu_doctor_checks_the_inapp_directory_it_is_given(tmp_path: Path) -> None:
    """A daemon started with its own --inapp-dir: doctor checks that one when told the same."""
    d = tmp_path / "inapp"
    make_inapp_dir(d)
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "doctor", "--socket", str(tmp_path / "none.sock"),
                        "--state-dir", str(tmp_path / "state"), "--backend", "sim:h100-80gb", "--inapp-dir", str(d),
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    (check,) = [c for c in json.loads(r.stdout) if c["name"] == "inapp dir"]
    assert check["status"] == "OK" and check["detail"].startswith(f"{d} (mode 1777)"), check
