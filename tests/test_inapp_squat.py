"""A process's in-app report name (`<pid>.json` in the sticky, world-writable in-app directory) taken
first by someone else: the client stub reports under a name nobody can guess, and the profiler's
sampler and the daemon's pid proof still find it, counting only files owned by the process's user.
The directory filled with many files costs each listing a bounded number of entries.

Two users are real here only when the tests run as root (the stub then runs as `nobody` and the
squatter's file is given to another uid); a directory under the process's name stands for a squat
that no user can write over, as any user."""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.profiler_fakes import FakeBackend, FakeDevice, ManualClock, RecordingLogger
from vgpu.client import MAX_INAPP_NAMES_PER_PID, InAppFinder, VgpuClient
from vgpu.daemon.serve import InAppPidProof
from vgpu.device.base import ProcessInfo
from vgpu.profiler.sampler import Sampler

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534  # the victim's user, where the tests run as root
SQUATTER = 65533  # another user's file, where the tests run as root
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the stub as another user and chown files")

# Started as root and made `nobody` once its modules are loaded: the interpreter lies under root's
# home, which another user cannot read.
VICTIM = textwrap.dedent("""\
    import os, sys
    import psutil, structlog
    import grpc._channel  # grpc loads it at the first channel, after the switch to nobody
    from vgpu.client import VgpuClient
    os.setgroups([])
    os.setgid(int(sys.argv[2]))
    os.setuid(int(sys.argv[2]))
    sys.stdin.readline()  # the test squats this process's name first
    with VgpuClient("victim-app", socket="unix:///nonexistent.sock", inapp_dir=sys.argv[1], watch=False,
                    report_period_s=0.1) as client:
        client.step(7)
        client.report_now()
        print("ready", flush=True)
        sys.stdin.readline()  # until the test says stop
    print("closed", flush=True)
    """)


def _sampler(pid: int, inapp: Path, clock: ManualClock | None = None) -> Sampler:
    """The profiler's sampler, with real psutil, over a fake GPU on which `pid` runs."""
    dev = FakeDevice(procs=[ProcessInfo(pid=pid, used_mib=1.0)])
    kw = {} if clock is None else {"monotonic": clock}
    return Sampler(FakeBackend([dev]), inapp_dir=inapp, logger=RecordingLogger(), **kw)  # type: ignore[arg-type]


def _forged(pid: int, app_id: str) -> str:
    """A well-formed, fresh report of `pid` (what a squatter would write to pass for the process)."""
    return json.dumps({"v": 1, "app_id": app_id, "pid": pid, "pid_start_s": psutil.Process(pid).create_time(),
                       "written_at_s": time.time() + 3600, "counters": {"step": 666}})


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A sticky directory every user can reach (pytest's tmp_path is root's own, mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="vgpu-squat-"))
    try:
        base.chmod(0o755)
        inapp = base / "inapp"
        inapp.mkdir()
        inapp.chmod(0o1777)
        yield inapp
    finally:
        shutil.rmtree(base, ignore_errors=True)


@as_root
def test_a_stub_whose_name_another_user_took_still_reports_and_proves_its_pid(shared_dir: Path) -> None:
    """The victim's stub runs as one user; another user created `<victim pid>.json` first (a forged,
    fresh report naming another app). Before: the sticky bit refused the stub's rename, every report
    failed, and the profiler ignored the squatter's file (not the process's user's), so the process
    had no in-app counters and no pid proof. Now the stub says so once and reports under another
    name, which the profiler and the daemon find."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(shared_dir.parent / "no-config")}
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(shared_dir), str(NOBODY)], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert victim.stdin is not None and victim.stdout is not None and victim.stderr is not None
        squat = shared_dir / f"{victim.pid}.json"
        squat.write_text(_forged(victim.pid, "evil"))
        os.chown(squat, SQUATTER, SQUATTER)
        victim.stdin.write("go\n")
        victim.stdin.flush()
        assert victim.stdout.readline().strip() == "ready", victim.stderr.read() if victim.poll() is not None else ""

        sampler = _sampler(victim.pid, shared_dir)
        (sig,) = sampler.sample()
        assert sig.app_id == "victim-app" and sig.in_app.step == 7  # before: pid:<pid>:python, no in_app
        assert sampler.stats.inapp_scans == 1
        proof = InAppPidProof(shared_dir)
        assert proof(victim.pid, "victim-app")  # before: False (the only file was the squatter's)
        assert not proof(victim.pid, "evil")  # the squatter's forged report proves nothing
        reports = [p for p in shared_dir.iterdir() if p != squat and not p.name.startswith(".")]
        (report,) = reports
        assert report.name.startswith(f"{victim.pid}.") and report.stat().st_uid == NOBODY
        assert squat.stat().st_uid == SQUATTER  # the squatter's file is left as it was

        victim.stdin.write("stop\n")
        victim.stdin.flush()
        out, err = victim.communicate(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
    assert victim.returncode == 0 and out.strip() == "closed", err
    assert err.count("usual file name is taken") == 1, err  # said once
    assert "cannot write in-app counters" not in err, err
    assert not report.exists() and squat.exists()  # close removes the stub's own report only


def test_a_name_taken_by_a_directory_costs_the_stub_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Any user can put something under a process's name that the stub cannot rename over: a
    directory. Before: every report failed (IsADirectoryError) and the profiler saw no counters."""
    pid = os.getpid()
    (tmp_path / f"{pid}.json").mkdir()
    client = VgpuClient("dir-squatted", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False,
                        report=False)
    try:
        client.step(5)
        path = client.report_now()
        client.step(1)
        assert client.report_now() == path  # the same name for the life of the process
        assert path.parent == tmp_path and path.name != f"{pid}.json"
        err = "".join(capsys.readouterr())
        assert err.count("usual file name is taken") == 1 and "a directory" in err, err
        sampler = _sampler(pid, tmp_path)
        (sig,) = sampler.sample()
        assert sig.app_id == "dir-squatted" and sig.in_app.step == 6
        assert InAppPidProof(tmp_path)(pid, "dir-squatted")
    finally:
        client.close()
    assert not path.exists() and (tmp_path / f"{pid}.json").is_dir()


def test_a_name_taken_between_two_reports_is_claimed_again(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The stub's usual name was free and its own; then it was taken (here: the file removed and a
    directory put there, as when the directory is made anew and someone is first). The next report
    moves to another name instead of failing from then on."""
    pid = os.getpid()
    client = VgpuClient("moved", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        first = client.report_now()
        assert first == tmp_path / f"{pid}.json"
        first.unlink()
        first.mkdir()
        client.step(3)
        second = client.report_now()
        assert second != first and second.is_file()
        assert "usual file name is taken" in "".join(capsys.readouterr())
        (sig,) = _sampler(pid, tmp_path).sample()
        assert sig.app_id == "moved" and sig.in_app.step == 3
    finally:
        client.close()


def test_reports_that_fail_to_write_under_a_taken_name_claim_one_name_not_one_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full file system (an empty file still takes only an inode: any user can fill the shared
    tmpfs, and squat the name too) fails each report's write after its name was claimed. Every
    report goes on with the one name claimed, rather than leaving an empty file behind per report,
    which nothing would remove and which every listing of the directory would read."""
    pid = os.getpid()
    (tmp_path / f"{pid}.json").mkdir()
    full = OSError(28, "No space left on device")

    def no_space(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = False) -> None:
        raise full

    client = VgpuClient("full", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        with monkeypatch.context() as m:
            m.setattr("vgpu.client.write_atomically", no_space)
            for _ in range(5):
                with pytest.raises(OSError, match="No space"):
                    client.report_now()
        claimed = [p for p in tmp_path.iterdir() if p.name != f"{pid}.json"]
        assert len(claimed) == 1 and claimed[0].stat().st_size == 0, claimed
        client.step(2)
        assert client.report_now() == claimed[0]  # the space back: the name claimed is written
        (sig,) = _sampler(pid, tmp_path).sample()
        assert sig.app_id == "full" and sig.in_app.step == 2
    finally:
        client.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{pid}.json"]


def test_the_process_users_own_stale_reports_of_the_pid_do_not_hide_the_live_one(tmp_path: Path) -> None:
    """Names of this pid from an earlier process (pid reuse: another start time), and one claimed but
    never written (empty), beside the live report: the live one is read, nothing is counted bad."""
    pid = os.getpid()
    (tmp_path / f"{pid}.json").mkdir()
    start = psutil.Process(pid).create_time()
    for i in range(3):
        (tmp_path / f"{pid}.{secrets.token_hex(16)}.json").write_text(json.dumps(
            {"v": 1, "app_id": f"earlier-{i}", "pid": pid, "pid_start_s": start - 3600, "written_at_s": time.time(),
             "counters": {"step": 1}}))
    (tmp_path / f"{pid}.{secrets.token_hex(16)}.json").touch()
    client = VgpuClient("live", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        client.step(9)
        client.report_now()
        sampler = _sampler(pid, tmp_path)
        (sig,) = sampler.sample()
        assert sig.app_id == "live" and sig.in_app.step == 9
        assert sampler.stats.inapp_bad == 1  # the directory under the usual name, nothing else
    finally:
        client.close()


@as_root
def test_another_users_files_under_the_pid_cannot_push_the_process_report_out(tmp_path: Path) -> None:
    """A squatter fills the directory with well-formed names of the victim's pid, all newer than the
    victim's report: they are passed over when listed (owned by another uid), so the per-pid bound
    keeps the victim's own."""
    pid = os.getpid()
    squat = tmp_path / f"{pid}.json"
    squat.write_text(_forged(pid, "evil"))
    os.chown(squat, SQUATTER, SQUATTER)
    client = VgpuClient("victim", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        client.step(4)
        client.report_now()
        for _ in range(200):
            decoy = tmp_path / f"{pid}.{secrets.token_hex(16)}.json"
            decoy.write_text(_forged(pid, "evil"))
            os.chown(decoy, SQUATTER, SQUATTER)
            os.utime(decoy, (time.time() + 60, time.time() + 60))
        (sig,) = _sampler(pid, tmp_path).sample()
        assert sig.app_id == "victim" and sig.in_app.step == 4
        assert InAppPidProof(tmp_path)(pid, "victim") and not InAppPidProof(tmp_path)(pid, "evil")
    finally:
        client.close()


@as_root
def test_names_kept_for_an_earlier_owner_of_the_pid_cannot_push_the_new_owners_report_out(tmp_path: Path) -> None:
    """Pid reuse: while the pid was another user's process, that user's names under it were found
    (the daemon's proof lists for every pid asked about, and any user may ask about its own), dated in
    the future. Once the pid is a process of another user, a listing for it keeps that user's report:
    the earlier owner's names no longer count against the bound, so they cannot push it out."""
    finder = InAppFinder(tmp_path)
    pid = 4_000_001
    for _ in range(MAX_INAPP_NAMES_PER_PID):
        decoy = tmp_path / f"{pid}.{secrets.token_hex(16)}.json"
        decoy.write_text("{}")  # what they hold is read later, by owner; the listing looks at names
        os.chown(decoy, SQUATTER, SQUATTER)
        os.utime(decoy, (time.time() + 3600, time.time() + 3600))
    finder.scan({pid: (SQUATTER,)})  # the pid is the squatter's process: its names are its own
    assert len(finder.paths(pid)) == 1 + MAX_INAPP_NAMES_PER_PID
    report = tmp_path / f"{pid}.{secrets.token_hex(16)}.json"
    report.write_text("{}")
    os.chown(report, NOBODY, NOBODY)
    finder.scan({pid: (NOBODY,)})  # the pid now runs a process of NOBODY's
    assert report in finder.paths(pid)


def test_a_listing_that_ended_on_the_directorys_last_entry_starts_the_next_pass_at_once(tmp_path: Path) -> None:
    """A directory of exactly as many entries as one listing reads: that listing reads them all
    without seeing the end. The next one starts over (a report made since is found there), instead
    of reading nothing but the end and leaving the report to the listing after, one more second for
    the sampler (or a refused request for the daemon's proof) beyond the bound the docs give."""
    for i in range(4):
        (tmp_path / f"other-{i}").touch()
    finder = InAppFinder(tmp_path, scan_entries=4)
    pid = os.getpid()
    finder.scan({pid: None})
    assert finder.entries_read == 4 and len(finder.paths(pid)) == 1
    report = tmp_path / f"{pid}.{secrets.token_hex(16)}.json"
    report.write_text("{}")
    finder.scan({pid: None})
    assert finder.entries_read > 4  # it read entries, not the end alone: the next pass began at once
    # that pass reads 4 of the 5 entries now there, in the directory's own order: the report is in
    # them or in the next listing, the bound the docs give (entries / scan_entries listings)
    if report not in finder.paths(pid):
        finder.scan({pid: None})
    assert report in finder.paths(pid)


def test_a_directory_of_many_files_is_listed_in_bounded_steps_and_the_report_still_found(tmp_path: Path) -> None:
    """10,000 other files in the in-app directory: each listing reads at most MAX_INAPP_SCAN_ENTRIES
    (4096) entries, at most once per second however often the profiler samples, going on where the
    last stopped, so the stub's report under its other name is found within three listings."""
    from vgpu.client import MAX_INAPP_SCAN_ENTRIES

    pid = os.getpid()
    (tmp_path / f"{pid}.json").mkdir()
    other = [f"{n}.json" for n in range(5000)] + [f"{n}.{secrets.token_hex(16)}.json" for n in range(5000)]
    for name in other:
        (tmp_path / name).touch()
    client = VgpuClient("crowded", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        client.step(2)
        client.report_now()
        entries = len(os.listdir(tmp_path))
        clock = ManualClock(0.0)
        sampler = _sampler(pid, tmp_path, clock)
        found_at = None
        for tick in range(60):
            before = sampler.stats.inapp_scan_entries
            (sig,) = sampler.sample()
            assert sampler.stats.inapp_scan_entries - before <= MAX_INAPP_SCAN_ENTRIES
            if sig.HasField("in_app"):
                found_at = tick
                break
            clock.advance(0.1)  # the profiler's period: a listing at most every 10th sample
        assert found_at is not None and sig.in_app.step == 2 and sig.app_id == "crowded"
        assert sampler.stats.inapp_scans == 1 + found_at // 10  # one listing per second of samples
        assert sampler.stats.inapp_scans <= math.ceil(entries / MAX_INAPP_SCAN_ENTRIES)
        # once found, the name is read directly: no more listings while the report stays fresh
        scans = sampler.stats.inapp_scans
        for _ in range(20):
            clock.advance(0.1)
            (sig,) = sampler.sample()
            assert sig.in_app.step == 2
        assert sampler.stats.inapp_scans == scans
    finally:
        client.close()


def test_the_daemons_pid_proof_lists_at_most_one_step_per_quarter_second_whoever_asks(tmp_path: Path) -> None:
    """The daemon checks a pid's report on its event loop, and any local user may send requests naming
    pids: a flood of checks lists the directory at most once per INAPP_PROOF_SCAN_EVERY_S, and each
    listing looks for every pid asked about lately, so the flood's listings find the stub's name too."""
    from vgpu.daemon.serve import INAPP_PROOF_SCAN_EVERY_S

    pid = os.getpid()
    (tmp_path / f"{pid}.json").mkdir()
    client = VgpuClient("proven", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        client.report_now()
        clock = ManualClock(0.0)
        proof = InAppPidProof(tmp_path, monotonic=clock)
        assert not proof(1, "flood")  # pid 1 runs and has no report: one listing
        assert proof.scans == 1
        assert not proof(pid, "proven")  # no listing left in this quarter second: not found yet
        for _ in range(100):
            assert not proof(1, "flood")
        assert proof.scans == 1
        clock.advance(INAPP_PROOF_SCAN_EVERY_S)
        assert not proof(1, "flood")  # the flood's next listing looks for the stub's pid as well ...
        assert proof.scans == 2
        assert proof(pid, "proven") and proof.scans == 2  # ... so its name is known without another
        assert not proof(pid, "another-app")
    finally:
        client.close()
