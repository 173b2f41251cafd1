"""Hostile pids against a real `vgpu serve`: out of range is refused at the edge, a pid from a caller
whose user the daemon cannot tell (the socket's front off, as over TCP) is refused unless the operator
or the process's own in-app report vouches for it, and one bad record in the store never stops a
start. A pid checked against the caller's uid (the front on): tests/test_hostile_peers.py."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from daemon_fixtures import Env, Serve, make_env
from hostile import Raw, operator_token

from vgpu import auth
from vgpu.client import InAppCounters, InAppReport, write_inapp


@pytest.fixture
def env(tmp_path: Path) -> Env:
    e = make_env(tmp_path)
    e.env["VGPU_SERVER_INAPP_DIR"] = str(tmp_path / "inapp")
    return e


def test_a_pid_out_of_range_is_refused_and_the_next_start_works(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env))
    for pid in (2**31, 2**32 - 1):  # one past the largest pid, and the largest uint32 the message carries
        with pytest.raises(grpc.RpcError) as err:
            client.request("job", 16, pid=pid, token=operator_token(env.state))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in str(err.value.details()), pid
    assert client.granted_mib() == 0
    assert serves[-1].term() == 0
    serves.append(Serve(env))  # before the fix: OverflowError in reconcile, exit 1
    assert serves[-1].term() == 0


def test_a_pid_needs_the_operator(env: Env, serves: list[Serve], client: Raw) -> None:
    env.env["VGPU_SERVER_PEER_CREDENTIALS"] = "false"  # the caller's uid unknown: only proofs count
    serves.append(Serve(env))
    # pid 1 (the cgroup "/") from an anonymous caller, and from an application with its own token.
    with pytest.raises(grpc.RpcError) as err:
        client.request("intruder", 1024, pid=1)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "operator token" in str(err.value.details())
    client.request("app", 16)
    app_token = auth.read_token_file(auth.app_token_file("app", env.state))
    with pytest.raises(grpc.RpcError) as err:
        client.request("app", 16, pid=1, token=app_token)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert client.granted_mib() == 16 and "intruder" not in [a.app_id for a in client.apps()]
    # The operator may name a process.
    grant = client.request("app", 32, pid=os.getpid(), token=operator_token(env.state))
    assert grant.memory_mib == 32
    assert serves[-1].term() == 0


def test_a_process_that_reports_itself_may_be_named_by_its_application(env: Env, serves: list[Serve],
                                                                      client: Raw) -> None:
    env.env["VGPU_SERVER_PEER_CREDENTIALS"] = "false"  # (with the front, this caller's uid would decide)
    serves.append(Serve(env))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        inapp = env.tmp / "inapp"
        # what the client stub's in-app reporter writes for its process
        path = write_inapp(inapp, InAppReport("mine", child.pid, psutil.Process(child.pid).create_time(), time.time(),
                                              InAppCounters()))
        # another application may not name it, nor may "mine" name a process that does not report
        for app, pid in (("other", child.pid), ("mine", 1)):
            with pytest.raises(grpc.RpcError) as err:
                client.request(app, 8, pid=pid)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (app, pid)
        if os.geteuid() == 0:  # a report not owned by the process's user proves nothing
            os.chown(path, 12345, 12345)
            with pytest.raises(grpc.RpcError) as err:
                client.request("mine", 8, pid=child.pid)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            os.chown(path, os.getuid(), os.getgid())
        grant = client.request("mine", 8, pid=child.pid)
        assert grant.app_id == "mine" and client.granted_mib() == 8
    finally:
        child.kill()
        child.wait(10)
    assert serves[-1].term() == 0


SQUATTED_STUB = """\
import sys
from vgpu.client import VgpuClient
sys.stdin.readline()  # the test takes this process's report name first
with VgpuClient("squatted", socket=sys.argv[1], inapp_dir=sys.argv[2], watch=False, report_period_s=0.1) as client:
    grant = client.request(memory_mib=8)
    print(grant.pid, grant.memory_mib, flush=True)
"""


def test_a_stub_whose_report_name_was_taken_still_proves_its_pid(env: Env, serves: list[Serve]) -> None:
    """Someone put something the stub cannot write over under its process's report name (a directory
    here; another user's file does the same in the sticky directory) before it started. Before: the
    stub could write no report, so its request named no pid (and the profiler saw no counters). Now
    it reports under another name and the daemon, which cannot tell the caller's uid, finds that
    report by listing the directory and takes the pid."""
    env.env["VGPU_SERVER_PEER_CREDENTIALS"] = "false"  # only the in-app report can vouch for the pid
    serves.append(Serve(env))
    inapp = env.tmp / "inapp"
    child = subprocess.Popen([sys.executable, "-c", SQUATTED_STUB, f"unix://{env.sock}", str(inapp)],
                             cwd=Path(__file__).resolve().parents[1], env=env.env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        (inapp / f"{child.pid}.json").mkdir(parents=True)
        out, err = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 0, err
    assert out.split() == [str(child.pid), "8.0"], (out, err)  # before: "0 8.0", the pid left out
    assert "usual file name is taken" in err and "could not verify" not in err, err
    assert serves[-1].term() == 0


def test_a_fifo_in_the_in_app_directory_does_not_stall_the_daemon(env: Env, serves: list[Serve], client: Raw) -> None:
    """The in-app directory is writable by every user (mode 1777: each application's stub writes its
    own report there). A FIFO named after a pid that has no report (`1.json`), then a request naming
    that pid: checking the report opened the FIFO, and the open waited for a writer on the event
    loop, so the daemon answered nobody until someone opened it for writing. Now a FIFO is no
    report: the request is refused at once and the daemon goes on serving."""
    env.env["VGPU_SERVER_PEER_CREDENTIALS"] = "false"  # (with the front, root's own pid 1 would be taken)
    serves.append(Serve(env))
    inapp = env.tmp / "inapp"
    inapp.mkdir(exist_ok=True)
    os.mkfifo(inapp / "1.json")
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.request("squatter", 8, pid=1, timeout_s=5.0)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
        assert client.granted_mib() == 0
    finally:  # a writer lets an open that waits (the bug) return, so the daemon can stop
        with contextlib.suppress(OSError):
            os.close(os.open(inapp / "1.json", os.O_WRONLY | os.O_NONBLOCK))
    assert serves[-1].term() == 0


def test_bad_records_in_the_store_are_skipped_counted_and_logged(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env))
    ids = [client.request(f"app{i}", 100).grant_id for i in range(3)]
    assert serves[-1].term() == 0
    db = sqlite3.connect(env.state / "vgpu.sqlite3")
    db.execute("UPDATE grants SET record_json='{not json' WHERE grant_id=?", (ids[0],))
    (body,) = db.execute("SELECT record_json FROM grants WHERE grant_id=?", (ids[1],)).fetchone()
    db.execute("UPDATE grants SET record_json=? WHERE grant_id=?", (json.dumps({**json.loads(body), "pid": 2**40}), ids[1]))
    db.commit()
    db.close()
    serves.append(Serve(env))
    rec = serves[-1].event("reconciled")
    assert rec["grants_restored"] == 1 and rec["bad_records"] == 2
    assert any("out of range" in r for r in rec["bad_record_reasons"])
    assert client.granted_mib() == 100
    assert serves[-1].term() == 0


# (other damaged limits fields, a priority beyond int32, a cap of 10**400: tests/test_hostile_stored.py)
# application -> the damage to its stored limits
LIMITS_DAMAGE: dict[str, dict[str, object]] = {"capped-word": {"max_memory_mib": "x"},
                                               "capped-nan": {"max_memory_mib": float("nan")}}


def test_a_damaged_stored_limit_is_skipped_and_logged_and_its_application_served(
        env: Env, serves: list[Serve], client: Raw) -> None:
    """A limits row whose cap is not a number once stopped every later request of its application
    with a TypeError; now it is left out at start (the application uncapped, as before its
    operator capped it), counted and named in the start's log. Each damage is an application of its
    own, restored by one start (a start is 2-3 s of the suite), and each is checked by its id."""
    serves.append(Serve(env))
    for app in LIMITS_DAMAGE:
        env.vgpu("set-limit", "--socket", str(env.sock), "--state-dir", str(env.state), "--app", app,
                 "--max-memory-mib", "4096", "--create")
    assert serves[-1].term() == 0
    db = sqlite3.connect(env.state / "vgpu.sqlite3")
    for app, damage in LIMITS_DAMAGE.items():
        (body,) = db.execute("SELECT record_json FROM app_limits WHERE app_id=?", (app,)).fetchone()
        db.execute("UPDATE app_limits SET record_json=? WHERE app_id=?", (json.dumps({**json.loads(body), **damage}), app))
    db.commit()
    db.close()
    serves.append(Serve(env))
    rec = serves[-1].event("reconciled")
    assert rec["bad_records"] == len(LIMITS_DAMAGE), rec
    for app in LIMITS_DAMAGE:
        assert [r for r in rec["bad_record_reasons"] if r.startswith(f"limits {app!r}: ")], (app, rec)
        assert client.request(app, 8192).memory_mib == 8192, app  # served, and no longer capped
    assert serves[-1].term() == 0


@pytest.mark.parametrize("damage", [{"max_memory_mib": "x"}, {"max_memory_mib": float("nan")}, {"max_sm_pct": 250},
                                    {"max_sm_pct": -1}, {"priority": "high"}, {"priority": True}, {"app_id": ""}])
def test_each_damaged_limits_field_is_left_out_at_restore(damage: dict[str, object]) -> None:
    """The same check in process, field by field: the limits entry is left out and named, nothing else."""
    from vgpu.allocator.ledger import DeviceCapacity, Ledger

    good = {"app_id": "capped", "max_memory_mib": 4096.0, "max_sm_pct": None, "priority": None}
    records = {"version": 1, "devices": [], "grants": [], "limits": [good, {**good, "app_id": "other"} | damage]}
    ledger = Ledger.from_records(records, devices=[DeviceCapacity("GPU-0", 81_559.0)], skip_bad=True)
    (why,) = ledger.bad_on_restore
    assert why.startswith("limits ")
    assert ledger.limits("capped") is not None and ledger.limits("other") is None  # the good entry kept
    with pytest.raises(ValueError, match="malformed ledger records"):
        Ledger.from_records(records, devices=[DeviceCapacity("GPU-0", 81_559.0)])
