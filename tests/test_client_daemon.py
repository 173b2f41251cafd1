"""The client stub as an application uses it: a short program against a real `vgpu serve` process.

It requests, releases, leaves a `with` block (which releases), starts again with the same app id, and
is refused for an id it does not own; the token file and the in-app directory are where the docs say.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_fixtures import ROOT, Env, Serve, make_env, one_daemon_for_the_module

from vgpu.client import app_token_path

# The program a user writes from the client stub's docstrings.
APP = """
import sys
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp) as client:
    first = client.request(memory_mib=1000)
    (released,) = client.release()
    assert released.grant_id == first.grant_id, (released, first)
    second = client.request(memory_mib=2000)
    print("granted", second.grant_id, "token file", client.token_file, flush=True)
print("closed", flush=True)
"""


def run_app(env: Env, app_id: str, inapp: Path, *, config_home: Path | None = None,
            program: str = APP) -> subprocess.CompletedProcess[str]:
    penv = dict(env.env)
    if config_home is not None:
        penv["XDG_CONFIG_HOME"] = str(config_home)
    return subprocess.run([sys.executable, "-c", program, str(env.sock), app_id, str(inapp)],
                          cwd=ROOT, env=penv, capture_output=True, text=True, timeout=60)


@dataclass(frozen=True)
class Shared:
    env: Env
    inapp: Path  # the daemon's in-app directory


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """One `vgpu serve` (its in-app directory set) for the tests whose applications only ask it for
    their own application ids' grants, each id a test's own: they need not start one each (2-3 s a
    start). The ids' tokens are kept in one configuration directory, each under its id."""
    tmp = tmp_path_factory.mktemp("shared")
    env = make_env(tmp)
    env.env["VGPU_SERVER_INAPP_DIR"] = str(tmp / "inapp")
    with one_daemon_for_the_module(env):
        yield Shared(env, tmp / "inapp")


def grants_of(env: Env, app_id: str) -> list[dict]:  # type: ignore[type-arg]
    apps = {a["app_id"]: a for a in env.json("apps").get("apps", [])}
    return apps[app_id].get("grants", []) if app_id in apps else []


def test_application_releases_its_grants_and_restarts(env: Env, serves: list[Serve], tmp_path: Path) -> None:
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)  # where the daemon reads the stub's proof of its pid
    serves.append(Serve(env))

    r = run_app(env, "train-a", inapp)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "closed" in r.stdout
    assert grants_of(env, "train-a") == []  # release() worked, and so did the `with` block's close

    token_file = app_token_path("train-a", str(env.sock), env.env)
    assert str(token_file) in r.stdout
    assert token_file.is_relative_to(tmp_path / "home-config" / "vgpu" / "tokens")
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert token_file.read_text().startswith("vgpu1.")

    # The same application started again finds its token and is served.
    r = run_app(env, "train-a", inapp)
    assert r.returncode == 0, r.stdout + r.stderr
    assert grants_of(env, "train-a") == []

    # The CLI shares the token: `vgpu request --app train-a` works for this user.
    env.vgpu("request", "--socket", str(env.sock), "--app", "train-a", "--memory-mib", "10")
    assert len(grants_of(env, "train-a")) == 1

    # Someone else (no token) is refused the id, and the stub says where it looked.
    r = run_app(env, "train-a", inapp, config_home=tmp_path / "other-user")
    assert r.returncode != 0
    assert "PERMISSION_DENIED" in r.stderr
    assert "application id taken and no token for it here" in r.stdout + r.stderr
    assert str(app_token_path("train-a", str(env.sock), {"XDG_CONFIG_HOME": str(tmp_path / "other-user")})) in (
        r.stdout + r.stderr
    )


def test_a_garbage_token_file_is_named(shared: Shared, tmp_path: Path) -> None:
    env = shared.env
    token_file = app_token_path("bad", str(env.sock), env.env)
    token_file.parent.mkdir(parents=True, exist_ok=True)  # the shared configuration directory may hold other ids
    token_file.write_text("not a token\n")
    r = run_app(env, "bad", tmp_path / "inapp")
    assert r.returncode != 0
    assert "TokenFileError" in r.stderr and str(token_file) in r.stderr
    assert "Invalid metadata" not in r.stderr


def test_missing_inapp_directory_is_said_once(shared: Shared, tmp_path: Path) -> None:
    env = shared.env
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the directory cannot be created below a file
    program = APP.replace('print("closed", flush=True)', 'import time; time.sleep(0.5); print("closed", flush=True)')
    program = program.replace("VgpuClient(app_id, socket=sock, inapp_dir=inapp)",
                              "VgpuClient(app_id, socket=sock, inapp_dir=inapp, report_period_s=0.05)")
    r = run_app(env, "no-inapp", blocker / "inapp", program=program)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert out.count("in-app counter directory missing") == 1, out
    assert "cannot write in-app counters" not in out
    # without a report to prove its pid the stub names it on the Unix socket all the same (the daemon
    # checks the caller's uid), says so once over its two requests, and is served
    assert out.count("on the socket's word") == 1 and "requests name no pid" not in out, out
    assert str(blocker / "inapp") in out


def test_a_report_the_daemon_does_not_read_is_named_as_the_cause(env: Env, serves: list[Serve],
                                                                  tmp_path: Path) -> None:
    """The stub writes its in-app report where the daemon does not look (another inapp_dir) and the
    daemon cannot tell the caller's uid (its socket front is off, as over TCP): the request naming
    its pid is refused, and the stub says why, not that the id is taken. (With the front on, the
    stub's own uid runs the process, and the pid is taken: tests/test_hostile_peers.py.)"""
    env.env["VGPU_SERVER_INAPP_DIR"] = str(tmp_path / "daemons-inapp")
    env.env["VGPU_SERVER_PEER_CREDENTIALS"] = "false"
    serves.append(Serve(env))
    r = run_app(env, "elsewhere", tmp_path / "stubs-inapp")
    assert r.returncode != 0 and "PERMISSION_DENIED" in r.stderr
    out = r.stdout + r.stderr
    assert "the daemon could not verify this process's pid" in out and str(tmp_path / "stubs-inapp") in out
    assert "application id taken" not in out


# A program that prints data on stdout, as JSON, and reads the enforcement kind at once. No watch:
# the kind must come from the grant reply itself, not from an event that may come later.
KIND_APP = """
import json, sys
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp, watch=False) as client:
    client.request(memory_mib=1024)
    print(json.dumps({"kind": client.memory_limit_kind}), flush=True)
"""


def test_the_limit_kind_is_known_when_request_returns(shared: Shared) -> None:
    r = run_app(shared.env, "kind", shared.inapp, program=KIND_APP)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["kind"] == "cooperative"  # 1 GiB of 80: uncontended


def test_the_stub_logs_to_stderr_never_stdout(shared: Shared) -> None:
    """The application's stdout is its own output: only the line it prints is there; the stub's log
    lines (the token saved, no torch to apply the limit) go to stderr."""
    r = run_app(shared.env, "quiet", shared.inapp, program=KIND_APP)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [json.dumps({"kind": "cooperative"})], r.stdout
    assert "application token saved" in r.stderr


# One process of an application: it holds a grant until told to go on (a line on stdin), then says
# which grants it holds and leaves its `with` block.
TWIN = """
import json, sys, time
from vgpu.client import VgpuClient

sock, app_id, inapp, memory = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
with VgpuClient(app_id, socket=sock, inapp_dir=inapp) as client:
    grant = client.request(memory_mib=memory)
    print("granted", grant.grant_id, flush=True)
    sys.stdin.readline()
    time.sleep(0.5)  # the watch has had time to hear of the other process's grant
    print("holds", json.dumps(sorted(g.grant_id for g in client.grants)), client.granted_memory_mib, flush=True)
print("closed", flush=True)
"""


def test_two_processes_of_one_app_id_keep_to_their_own_grants(env: Env, serves: list[Serve], tmp_path: Path) -> None:
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    serves.append(Serve(env))

    def start(memory_mib: int) -> tuple[subprocess.Popen[str], str]:
        p = subprocess.Popen([sys.executable, "-c", TWIN, str(env.sock), "twin", str(inapp), str(memory_mib)],
                             cwd=ROOT, env=env.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("granted"), line + (p.stderr.read() if p.stderr else "")
        return p, line.split()[1]

    first, first_grant = start(1000)
    second, second_grant = start(2000)  # the same id and token (one user): a second process of the app
    try:
        out, err = first.communicate("go\n", timeout=60)
        assert first.returncode == 0, out + err
        holds = next(line for line in out.splitlines() if line.startswith("holds")).split(maxsplit=2)
        assert json.loads(holds[1]) == [first_grant] and float(holds[2]) == 1000.0, out
        # the first process's close released its own grant, and not the second's
        assert [g["grant_id"] for g in grants_of(env, "twin")] == [second_grant]
        out, err = second.communicate("go\n", timeout=60)
        assert second.returncode == 0, out + err
        assert f'["{second_grant}"] 2000.0' in out
        assert grants_of(env, "twin") == []
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.kill()
                p.wait(10)


# An application that holds a grant across a restart of the daemon, then leaves its `with` block.
HOLD = """
import sys
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp) as client:
    grant = client.request(memory_mib=1000)
    print("granted", grant.grant_id, client.token, flush=True)
    sys.stdin.readline()
    print("holds", [g.grant_id for g in client.grants], client.token, flush=True)
print("closed", flush=True)
"""


def _hold(env: Env, app_id: str, inapp: Path, program: str = HOLD) -> subprocess.Popen[str]:
    """A client-stub application against the test's daemon: it requests a grant for `app_id`,
    prints it, and holds it until a line on stdin tells it to leave its `with` block (`program`: one
    of the same shape)."""
    return subprocess.Popen([sys.executable, "-c", program, str(env.sock), app_id, str(inapp)], cwd=ROOT,
                            env=env.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_an_application_outlives_a_daemon_restart_and_releases_at_once(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    serves.append(Serve(env))
    app = _hold(env, "survivor", inapp)
    try:
        assert app.stdout is not None
        _, grant_id, token = app.stdout.readline().split()
        assert serves[-1].term() == 0
        time.sleep(8.0)  # down long enough for gRPC's default reconnect backoff to grow past seconds
        serves.append(Serve(env))  # the same socket and state directory: the grant is restored
        assert [g["grant_id"] for g in grants_of(env, "survivor")] == [grant_id]
        out, err = app.communicate("go\n", timeout=60)
        assert app.returncode == 0, out + err
        assert f"holds ['{grant_id}'] {token}" in out  # the same grant and token, no new claim
        # leaving the block released the grant on the restarted daemon at once, not after idle_release_s
        assert "release on close failed" not in err, err
        assert grants_of(env, "survivor") == []
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)


def test_a_watching_application_does_not_hold_up_the_daemons_stop(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    # grace_s is for calls in flight; a stub's watch stream never ends by itself, so a stop that
    # waited for it would always take the whole grace (here 30 s) whenever an application runs.
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    env.env["VGPU_SERVER_GRACE_S"] = "30"
    serves.append(Serve(env))
    app = _hold(env, "watcher", inapp)
    try:
        assert app.stdout is not None
        assert app.stdout.readline().startswith("granted")
        time.sleep(1.0)  # the stub's watch thread has opened its stream
        started = time.monotonic()
        assert serves[-1].term() == 0
        assert time.monotonic() - started < 15.0
        assert serves[-1].event("stopped")
    finally:
        app.kill()
        app.wait(10)


CATCH_UP = """
import sys, time
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp) as client:
    grant = client.request(memory_mib=1000)
    print("granted", grant.grant_id, client.token, flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 15
    while client.grants and time.monotonic() < deadline:
        time.sleep(0.05)
    print("holds", [g.grant_id for g in client.grants], flush=True)
"""


def test_a_release_made_while_the_daemon_restarted_reaches_the_application(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    # The operator releases the application's grant the moment the restarted daemon serves, before
    # the stub's watch is back: no event of it will come, so the stub lists its grants once its
    # watch is live again, and drops the one it no longer holds.
    from hostile import Raw, operator_token

    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    serves.append(Serve(env))
    app = subprocess.Popen([sys.executable, "-c", CATCH_UP, str(env.sock), "gap", str(inapp)], cwd=ROOT,
                           env=env.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        assert app.stdout is not None
        _, grant_id, _token = app.stdout.readline().split()
        assert serves[-1].term() == 0
        time.sleep(2.0)  # the stub's watch is failing and backing off
        serves.append(Serve(env))
        op = Raw(env.sock)
        try:
            assert op.release(grant_id, token=operator_token(env.state)).grant_id == grant_id
        finally:
            op.close()
        out, err = app.communicate("go\n", timeout=60)
        assert app.returncode == 0, out + err
        assert "holds []" in out, out + err
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)


# An application run by root under a strict umask, as a service with UMask=0077 is: the in-app
# directory's parent (the daemon's runtime directory) is missing at first, then appears, and later
# its in-app directory is removed (a daemon restart under RuntimeDirectory= removes it).
INAPP_DIR_APP = """
import os, shutil, stat, sys, time
from pathlib import Path
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], Path(sys.argv[3])
os.umask(0o077)

def mode_when_there():
    deadline = time.monotonic() + 20
    while not inapp.is_dir():
        assert time.monotonic() < deadline, "the in-app directory never appeared"
        time.sleep(0.05)
    return oct(stat.S_IMODE(inapp.stat().st_mode))

with VgpuClient(app_id, socket=sock, inapp_dir=inapp, report_period_s=0.05) as client:
    client.request(memory_mib=10)
    time.sleep(0.3)
    print("parent made by the stub:", inapp.parent.exists(), flush=True)
    inapp.parent.mkdir(mode=0o755)
    os.chmod(inapp.parent, 0o755)
    print("in-app directory:", mode_when_there(), flush=True)
    shutil.rmtree(inapp)
    print("made again:", mode_when_there(), flush=True)
"""


def test_the_stub_makes_only_a_shared_in_app_directory_never_its_parents(shared: Shared, tmp_path: Path) -> None:
    inapp = tmp_path / "rt" / "vgpu" / "inapp"  # not the daemon's: it sees no report there
    (tmp_path / "rt").mkdir()
    r = run_app(shared.env, "dirs", inapp, program=INAPP_DIR_APP)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    # a root-owned runtime directory under the application's umask (0700) would shut every other
    # user's application out; the stub says the parent is missing instead
    assert "parent made by the stub: False" in lines, r.stdout
    assert f"its parent {inapp.parent} does not exist" in r.stderr
    # shared by every application (sticky), whatever the umask, when made at start or again later
    assert "in-app directory: 0o1777" in lines and "made again: 0o1777" in lines, r.stdout


def test_the_daemon_makes_its_in_app_directory_at_each_start(env: Env, serves: list[Serve], tmp_path: Path) -> None:
    """Under systemd the in-app directory lies in the runtime directory, which is removed whenever the
    daemon stops, and an application that is not root cannot make it there again: the daemon does."""
    runtime = tmp_path / "rt"
    runtime.mkdir()
    inapp = runtime / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    for start in range(2):
        serves.append(Serve(env))
        serving = serves[-1].event("serving")
        assert serving["inapp_dir"] == str(inapp) and serving["inapp_dir_state"] == "created", serving
        assert inapp.stat().st_mode & 0o7777 == 0o1777
        if start == 0:
            assert serves[-1].term() == 0
            shutil.rmtree(inapp)  # what systemd does to /run/vgpu on stop
    assert serves[-1].term() == 0
    # the parent is not the daemon's to make: said in the record, nothing created
    env.env["VGPU_SERVER_INAPP_DIR"] = str(tmp_path / "gone" / "inapp")
    serves.append(Serve(env))
    serving = serves[-1].event("serving")
    assert serving["inapp_dir_state"] == f"missing: its parent {tmp_path / 'gone'} does not exist", serving
    assert not (tmp_path / "gone").exists()


# An application started before the daemon listens (at boot, before vgpu-manager): it says when it is
# about to request, then requests with the wait it is given.
EARLY = """
import sys
from vgpu.client import VgpuClient

sock, app_id, inapp, wait_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
with VgpuClient(app_id, socket=sock, inapp_dir=inapp, ready_wait_s=wait_s) as client:
    print("requesting", flush=True)
    grant = client.request(memory_mib=1000)
    print("granted", grant.app_id, grant.memory_mib, flush=True)
"""


@pytest.mark.parametrize("socket_file", ["missing", "stale"])
def test_a_request_made_before_the_daemon_listens_waits_for_it(env: Env, serves: list[Serve], tmp_path: Path,
                                                                socket_file: str) -> None:
    """The stub's first request finds no socket (or the one a killed daemon left, which refuses), says
    once that it waits, and is granted once the daemon serves."""
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    env.sock.parent.mkdir(parents=True, exist_ok=True)
    if socket_file == "stale":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(env.sock))  # bound, never listening: what a kill -9 leaves behind
    app = subprocess.Popen([sys.executable, "-c", EARLY, str(env.sock), "early", str(inapp), "60"],
                           cwd=ROOT, env=env.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert app.stdout is not None and app.stderr is not None
        assert app.stdout.readline() == "requesting\n"
        said = ""
        while "does not listen yet" not in said:  # said once it has found nothing listening
            line = app.stderr.readline()
            assert line, "the stub ended before saying it waits: " + said + app.stdout.read()
            said += line
        assert app.poll() is None
        serves.append(Serve(env))
        out, err = app.communicate(timeout=90)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
    assert app.returncode == 0, said + out + err
    assert "granted early 1000.0" in out
    assert "does not listen yet" not in err  # said once


NO_DAEMON = """
import sys, time
import grpc
from vgpu.client import VgpuClient

sock, inapp = sys.argv[1], sys.argv[2]
for wait_s in (0.0, 1.0):
    with VgpuClient("alone", socket=sock, inapp_dir=inapp, ready_wait_s=wait_s, watch=False) as client:
        t = time.monotonic()
        try:
            client.request(memory_mib=10)
        except grpc.RpcError as exc:
            print(wait_s, round(time.monotonic() - t, 2), exc.code().name, exc.details(), flush=True)
"""


def test_a_request_with_no_daemon_fails_after_its_wait_with_the_reason(env: Env, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", NO_DAEMON, str(env.sock), str(tmp_path / "inapp")],
                       cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    at_once, waited = (line.split(maxsplit=3) for line in r.stdout.splitlines())
    assert at_once[0] == "0.0" and float(at_once[1]) < 0.5 and at_once[2] == "UNAVAILABLE", r.stdout
    assert waited[0] == "1.0" and 1.0 <= float(waited[1]) < 3.0 and waited[2] == "UNAVAILABLE", r.stdout
    assert "No such file" in waited[3]  # the reason, not a bare deadline
    assert r.stderr.count("does not listen yet") == 1  # only the stub that waits says so
    # and each failure says, besides gRPC's text, what to check
    assert r.stderr.count("cannot reach the vgpu daemon") == 2 and "is vgpu-manager running" in r.stderr, r.stderr


DEADLINES = """
import sys
import grpc
from vgpu.client import VgpuClient

sock, inapp = sys.argv[1], sys.argv[2]
with VgpuClient("due", socket=sock, inapp_dir=inapp, watch=False) as client:
    for deadline_s in (float("inf"), float("-inf"), float("nan"), -1.0, 1_900_000_000.0):
        try:
            grant = client.request(memory_mib=10, deadline_s=deadline_s)
        except grpc.RpcError as exc:
            print(deadline_s, exc.code().name, exc.details(), flush=True)
        else:
            print(deadline_s, "granted", grant.memory_mib, flush=True)
"""


def test_a_deadline_that_is_not_a_finite_unix_time_is_refused(shared: Shared) -> None:
    """`deadline_s` is Unix seconds: infinity, NaN or a negative time is INVALID_ARGUMENT naming the
    field, and nothing is granted for it."""
    env = shared.env
    r = subprocess.run([sys.executable, "-c", DEADLINES, str(env.sock), str(shared.inapp)],
                       cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line.split(maxsplit=2) for line in r.stdout.splitlines()]
    assert [line[0] for line in lines] == ["inf", "-inf", "nan", "-1.0", "1900000000.0"], r.stdout
    for value, code, details in lines[:4]:
        assert code == "INVALID_ARGUMENT" and "request.deadline_s" in details, (value, code, details)
    assert lines[4][1:] == ["granted", "10.0"], r.stdout


# A user's first mistakes: a job whose model type has a typo, and a request that asks for nothing.
MISTAKES_APP = """
import json, sys
from vgpu.client import VgpuClient
from vgpu.jobs import JobConfig

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp, watch=False, report=False) as client:
    try:
        client.request()
    except ValueError as exc:
        print(json.dumps({"nothing": str(exc)}), flush=True)
    grant = client.request(job=JobConfig(model_type="resnett50", batch_size=64))
    print(json.dumps({"source": grant.source, "memory_mib": grant.memory_mib}), flush=True)
    client.release()
    # a model of one's own, named and counted: sized from its parameter count, nothing to warn of
    own = client.request(job=JobConfig(model_type="my_segmenter", param_count=31_000_000, batch_size=16))
    print(json.dumps({"source": own.source, "memory_mib": own.memory_mib}), flush=True)
"""


def test_a_request_for_nothing_and_a_model_type_typo_are_named(shared: Shared) -> None:
    """`request()` with no memory, SM or job is refused before it reaches the daemon (it would be a
    0 MiB grant) and says what to give; a job whose model type is not a known one is still sized (a
    model of one's own) but the stub warns with the nearest known names, as `vgpu size` does."""
    r = run_app(shared.env, "mistakes", shared.inapp, program=MISTAKES_APP)
    assert r.returncode == 0, r.stdout + r.stderr
    nothing, granted, own = (json.loads(line) for line in r.stdout.splitlines())
    assert "asks for nothing" in nothing["nothing"] and "memory_mib" in nothing["nothing"]
    assert "job=JobConfig" in nothing["nothing"]
    assert granted["source"] == "cold_start" and granted["memory_mib"] > 0, granted
    assert "unknown model type 'resnett50'" in r.stderr and "did you mean resnet50" in r.stderr, r.stderr
    assert "JobConfig(param_count=...)" in r.stderr
    assert own["source"] == "cold_start" and own["memory_mib"] > 0, own
    assert "my_segmenter" not in r.stderr, r.stderr  # its parameter count says it is the application's own
    assert [g["memory_mib"] for g in grants_of(shared.env, "mistakes")] == []  # released on leaving


def test_vgpu_request_warns_of_an_unknown_model_type(shared: Shared) -> None:
    def request(app_id: str, model_type: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "request", "--socket", str(shared.env.sock),
                               "--app", app_id, "--model-type", model_type, "--batch-size", "64", *extra, "--json"],
                              cwd=ROOT, env=shared.env.env, capture_output=True, text=True, timeout=60)

    r = request("typo-cli", "resnett50")
    assert r.returncode == 0 and json.loads(r.stdout)["source"] == "cold_start", r.stdout + r.stderr
    assert "warning: unknown model type 'resnett50'" in r.stderr and "did you mean resnet50" in r.stderr
    known = request("known-cli", "resnet50")
    assert known.returncode == 0 and "unknown model type" not in known.stderr, known.stderr
    own = request("own-cli", "my_segmenter", "--param-count", "31000000")
    assert own.returncode == 0 and "unknown model type" not in own.stderr, own.stderr


# An application that goes on using its client after leaving the `with` block: every call that would
# write the in-app report or reach the daemon says the client is closed; the in-memory ones still answer.
AFTER_CLOSE_APP = """
import json, os, sys, time
from vgpu.client import ClientClosedError, ServingCounters, VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
mine = lambda: sorted(n for n in os.listdir(inapp) if n.split(".")[0] == str(os.getpid()))
with VgpuClient(app_id, socket=sock, inapp_dir=inapp, report_period_s=0.05) as client:
    client.request(memory_mib=100)
    print(json.dumps({"open": mine()}), flush=True)
errors = {}
for name, call in (("report_now", client.report_now), ("request", lambda: client.request(memory_mib=100)),
                   ("release", client.release)):
    try:
        call()
    except ClientClosedError as exc:
        errors[name] = str(exc)
step = client.step()
client.report_serving(ServingCounters(requests_running=1))
time.sleep(0.3)  # six report periods: a reporter still running would have written the file again
print(json.dumps({"closed": client.closed, "after": mine(), "errors": errors, "step": step,
                  "granted_memory_mib": client.granted_memory_mib}), flush=True)
"""


def test_nothing_is_reported_after_close_and_the_calls_say_why(shared: Shared) -> None:
    r = run_app(shared.env, "after-close", shared.inapp, program=AFTER_CLOSE_APP)
    assert r.returncode == 0, r.stdout + r.stderr
    opened, closed = (json.loads(line) for line in r.stdout.splitlines())
    assert len(opened["open"]) == 1, opened  # the report that proved the pid, while open
    assert closed["after"] == [], closed  # report_now() after close wrote nothing, nor did the reporter
    assert set(closed["errors"]) == {"report_now", "request", "release"}, closed
    for name, message in closed["errors"].items():
        assert f"VgpuClient('after-close') is closed: {name}()" in message, message
    assert closed["closed"] is True and closed["step"] == 1 and closed["granted_memory_mib"] == 0
    assert grants_of(shared.env, "after-close") == []  # the failed request after close sent nothing


# An application that never closes its client: it requests, reports, and exits.
NEVER_CLOSED_APP = """
import json, os, sys, time
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
fork = len(sys.argv) > 4
# forking: no reporter thread, which would write the file again at once were the child to remove it;
# the request writes the report that proves the pid
client = VgpuClient(app_id, socket=sock, inapp_dir=inapp, report_period_s=0.05, report=not fork)
client.request(memory_mib=100)
time.sleep(0.2)
print(json.dumps({"pid": os.getpid(), "files": sorted(n for n in os.listdir(inapp) if n.split(".")[0] == str(os.getpid()))}),
      flush=True)
if fork:  # a child forked from it exits (and runs its exit hooks) first
    child = os.fork()
    if child == 0:
        sys.exit(0)
    os.waitpid(child, 0)
    print(json.dumps({"after_child": sorted(os.listdir(inapp))}), flush=True)
"""


@pytest.mark.parametrize("fork", [False, True], ids=["exit", "fork-then-exit"])
def test_an_application_that_exits_without_close_leaves_no_report(shared: Shared, fork: bool) -> None:
    """The in-app file goes when the interpreter exits, even without close(); a child forked from the
    application exiting before it does not remove the parent's file."""
    program = NEVER_CLOSED_APP
    args = [sys.executable, "-c", program, str(shared.env.sock), f"no-close-{fork}", str(shared.inapp)]
    r = subprocess.run([*args, "fork"] if fork else args, cwd=ROOT, env=shared.env.env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    pid, files = lines[0]["pid"], lines[0]["files"]
    assert len(files) == 1, lines  # it reported while it ran
    if fork:
        assert files[0] in lines[1]["after_child"], lines  # the child's exit left the parent's report
    assert not (shared.inapp / files[0]).exists(), f"{files[0]} of pid {pid} left behind"


# An application reading its grants both ways: the property, and the call of the time it was a method.
GRANTS_APP = """
import json, sys, warnings
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp) as client:
    grant = client.request(memory_mib=300)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        now = client.grants
        called = client.grants()
    print(json.dumps({"granted": grant.grant_id, "property": [g.grant_id for g in now],
                      "called": [g.grant_id for g in called], "sum": client.granted_memory_mib,
                      "is_list": isinstance(now, list) and type(called) is list,
                      "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught]}), flush=True)
"""


def test_grants_is_a_property_and_the_old_call_still_works_with_a_warning(shared: Shared) -> None:
    r = run_app(shared.env, "grants-both-ways", shared.inapp, program=GRANTS_APP)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["property"] == out["called"] == [out["granted"]] and out["sum"] == 300.0, out
    assert out["is_list"] is True
    # only the call warns, and the warning points at the application's line, not the stub
    assert out["warnings"] == [["DeprecationWarning", "VgpuClient.grants is a property now, like "
                                "granted_memory_mib: write client.grants, not client.grants()", "<string>"]], out


# A stub whose in-app directory cannot be made (its parent missing, as /run/vgpu on a machine with no
# daemon unit): it prints the pid its grant names and its own.
NO_REPORT = """
import os, sys
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp, watch=False) as client:
    grant = client.request(memory_mib=100)
    print("pids", grant.pid, os.getpid(), flush=True)
"""


def test_a_stub_that_cannot_write_its_report_still_names_its_pid_on_the_unix_socket(
        shared: Shared, tmp_path: Path) -> None:
    """The socket's front proves the pid by the caller's uid; before, the stub named none without its
    report, so the grant followed no process (no cgroup cap, no release when the process exited)."""
    r = run_app(shared.env, "no-report", tmp_path / "missing" / "inapp", program=NO_REPORT)
    assert r.returncode == 0, r.stdout + r.stderr
    granted, own = (int(x) for x in r.stdout.split()[1:3])
    assert granted == own
    assert "cannot write the in-app report" in r.stderr and "socket's word" in r.stderr


def test_without_the_front_a_pid_no_report_proves_is_left_out_and_the_grant_still_made(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    env.env["VGPU_SERVER_PEER_CREDENTIALS"] = "false"  # the caller's uid unknown, as over TCP
    env.env["VGPU_SERVER_INAPP_DIR"] = str(tmp_path / "inapp")
    serves.append(Serve(env))
    r = run_app(env, "no-report", tmp_path / "missing" / "inapp", program=NO_REPORT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split()[1] == "0"  # sent again without the pid the daemon refused
    assert "did not take this process's pid" in r.stderr


# An application that names no socket: it reaches the daemon the node's environment names, as the CLI does.
ENV_SOCKET_APP = """
import sys
from vgpu.client import VgpuClient

app_id, inapp = sys.argv[2], sys.argv[3]
with VgpuClient(app_id, inapp_dir=inapp, watch=False) as client:
    print("granted", client.request(memory_mib=500).memory_mib, client.token_file, flush=True)
"""


def test_an_application_without_socket_finds_the_daemon_the_environment_names(shared: Shared) -> None:
    env = dict(shared.env.env, VGPU_SERVER_SOCKET=str(shared.env.sock))
    r = subprocess.run([sys.executable, "-c", ENV_SOCKET_APP, "-", "env-socket", str(shared.inapp)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "granted 500.0" in r.stdout, r.stdout + r.stderr
    # its token is where `vgpu request --app env-socket` looks for that socket's
    assert r.stdout.split()[2] == str(app_token_path("env-socket", str(shared.env.sock), env))


OPTIMIZER_APP = """
import json, sys
from vgpu.client import VgpuClient
from vgpu.jobs import JobConfig

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp, watch=False) as client:
    for optimizer in ("adamw-typo", ""):
        grant = client.request(job=JobConfig(model_type="resnet50", batch_size=64, optimizer=optimizer))
        print(json.dumps({"source": grant.source, "memory_mib": grant.memory_mib}), flush=True)
        client.release()
"""


def test_an_unknown_optimizer_is_said_as_unknown_and_sized_as_none_given(shared: Shared) -> None:
    note = "unknown optimizer 'adamw-typo' (known: none, sgd, adam, adamw, rmsprop, adagrad, adadelta): assumed Adam"
    r = run_app(shared.env, "optimizer-typo", shared.inapp, program=OPTIMIZER_APP)
    assert r.returncode == 0, r.stdout + r.stderr
    typo, none_given = (json.loads(line) for line in r.stdout.splitlines())
    assert typo["source"] == "cold_start" and typo["memory_mib"] == none_given["memory_mib"] > 0, r.stdout
    assert r.stderr.count(note) == 1, r.stderr

    def request(app_id: str, optimizer: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "request", "--socket", str(shared.env.sock),
                               "--app", app_id, "--model-type", "resnet50", "--batch-size", "64",
                               "--optimizer", optimizer, "--json"],
                              cwd=ROOT, env=shared.env.env, capture_output=True, text=True, timeout=60)

    r = request("optimizer-typo-cli", "adamw-typo")
    assert r.returncode == 0 and json.loads(r.stdout)["source"] == "cold_start", r.stdout + r.stderr
    assert f"warning: {note}" in r.stderr, r.stderr
    known = request("optimizer-known-cli", "AdamW")
    assert known.returncode == 0 and "unknown optimizer" not in known.stderr, known.stderr


# An application whose daemon stops under it (SIGTERM, not started again): it releases, then leaves
# its `with` block, timing each.
GONE_APP = """
import sys, time
import grpc
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
with VgpuClient(app_id, socket=sock, inapp_dir=inapp) as client:
    client.request(memory_mib=1000)
    print("granted", flush=True)
    sys.stdin.readline()
    t = time.monotonic()
    try:
        client.release()
    except grpc.RpcError as exc:
        print("release", exc.code().name, round(time.monotonic() - t, 2), flush=True)
    t = time.monotonic()
print("closed", round(time.monotonic() - t, 2), flush=True)
"""


def test_a_release_with_the_daemon_gone_is_one_warning_and_a_quick_exit(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    serves.append(Serve(env))
    app = _hold(env, "gone", inapp, program=GONE_APP)
    try:
        assert app.stdout is not None and app.stdout.readline().startswith("granted")
        assert serves[-1].term() == 0
        assert not env.sock.exists()  # a stopped daemon takes its socket with it
        out, err = app.communicate("go\n", timeout=60)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
    assert app.returncode == 0, out + err
    release, closed = out.splitlines()
    _, code, release_s = release.split()
    assert code == "UNAVAILABLE" and float(release_s) < 4.0, out  # not ready_wait_s (10 s)
    assert closed.startswith("closed") and float(closed.split()[1]) < 4.0, out  # nor CLOSE_RELEASE_WAIT_S more
    assert err.count("cannot reach the vgpu daemon to release the grants") == 1, err
    assert "sees this process gone" in err and "at its next start at the latest" in err
    assert "release on close failed" not in err and "Traceback" not in err, err
