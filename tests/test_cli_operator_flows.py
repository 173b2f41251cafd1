"""What an operator meets at the command line, run as the operator runs it (`vgpu ...` as a
subprocess, against a real `vgpu serve` on the simulated GPU where the daemon can be made to do it):
a daemon just started, the command line's own mistakes, and `vgpu doctor` on a simulated node."""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from daemon_fixtures import ROOT, Env, Serve, make_env, one_daemon_for_the_module
from test_client import NotReadyAllocator, serve

from vgpu.client import NOTHING_CHANGED_KEY
from vgpu.v1 import allocator_pb2


def vgpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def start(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "vgpu.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def connected(proc: subprocess.Popen[str]) -> bool:
    """The command has opened its connection to the daemon's socket (its only Unix socket)."""
    try:
        return bool(psutil.Process(proc.pid).net_connections(kind="unix"))
    except psutil.NoSuchProcess:
        return True


def test_request_right_after_the_daemon_starts_waits_for_the_cold_start_model(env: Env, serves: list[Serve]) -> None:
    daemon = Serve(env)
    serves.append(daemon)
    # Hold the daemon (SIGSTOP) while the commands connect, so the requests reach it before the
    # cold-start model, which loads in the second or so after it serves, has loaded.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        if any(e.get("event") == "coldstart_sizer_loaded" for e in daemon.events()):
            pytest.skip("the cold-start model loaded before the test could hold the daemon")
        job = ["--socket", str(env.sock), "--model-type", "resnet50", "--batch-size", "32", "--json"]
        waits = start("request", *job, "--app", "waits", env=env.env)
        at_once = start("request", *job, "--app", "at-once", "--wait-s", "0", env=env.env)
        deadline = time.monotonic() + 60
        while not (connected(waits) and connected(at_once)):
            assert time.monotonic() < deadline, "the commands never connected"
            time.sleep(0.05)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    out, err = waits.communicate(timeout=60)
    assert waits.returncode == 0, err
    said = [line for line in err.splitlines() if "not ready" in line]
    assert len(said) == 1 and said[0].startswith("vgpu request: ") and "cold-start model" in said[0], err
    assert "--wait-s" in said[0]
    grant = json.loads(out)
    assert grant["app_id"] == "waits" and grant["memory_mib"] > 0
    out, err = at_once.communicate(timeout=60)
    assert at_once.returncode == 1 and out == ""
    assert "UNAVAILABLE" in err and "cold-start model" in err and "nothing was changed" in err, err
    assert "--wait-s" in err
    daemon.wait_for("coldstart_sizer_loaded")
    apps = json.loads(vgpu("apps", "--socket", str(env.sock), "--json", env=env.env).stdout)
    assert [a["app_id"] for a in apps["apps"]] == ["waits"]  # the refused one left nothing behind


@pytest.mark.parametrize("socket_file", ["missing", "stale"])
def test_a_change_sent_before_the_daemon_listens_waits_for_it(env: Env, serves: list[Serve], socket_file: str) -> None:
    """`vgpu serve & vgpu request` typed together: the request finds no socket yet (or the one a
    killed daemon left, which refuses), waits within --wait-s, and is granted once the daemon serves."""
    env.sock.parent.mkdir(parents=True, exist_ok=True)
    if socket_file == "stale":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(env.sock))  # bound, never listening: what a kill -9 leaves behind
    waits = start("request", "--socket", str(env.sock), "--app", "early", "--memory-mib", "100", "--json",
                  "--wait-s", "60", env=env.env)
    assert waits.stderr is not None
    first = waits.stderr.readline()  # said once it has found nothing listening, before the daemon starts
    assert first.startswith("vgpu request: nothing listens on ") and str(env.sock) in first, first
    assert "--wait-s" in first and waits.poll() is None
    serves.append(Serve(env))
    out, err = waits.communicate(timeout=90)
    assert waits.returncode == 0, first + err
    assert "nothing listens" not in err  # said once
    assert json.loads(out)["app_id"] == "early"
    apps = json.loads(vgpu("apps", "--socket", str(env.sock), "--json", env=env.env).stdout)
    assert [a["app_id"] for a in apps["apps"]] == ["early"]


def _says_how_long_it_waited_and_0_does_not_wait(env: Env, *args: str) -> None:
    """`vgpu ARGS` with no daemon: --wait-s 1 waits that long and says so; --wait-s 0 fails at once."""
    env.sock.parent.mkdir(parents=True, exist_ok=True)  # a directory a daemon could be starting in
    began = time.monotonic()
    r = vgpu(*args, "--wait-s", "1", env=env.env)
    assert r.returncode == 1 and time.monotonic() - began >= 0.8, r.stderr
    assert "cannot reach the vgpu daemon" in r.stderr and "nothing listened there within 1 s (--wait-s)" in r.stderr
    r = vgpu(*args, "--wait-s", "0", env=env.env)
    assert r.returncode == 1 and "cannot reach the vgpu daemon" in r.stderr
    assert "nothing listens" not in r.stderr and "within" not in r.stderr


def test_a_change_with_no_daemon_says_how_long_it_waited_and_0_does_not_wait(env: Env) -> None:
    _says_how_long_it_waited_and_0_does_not_wait(env, "request", "--socket", str(env.sock), "--app", "a",
                                                 "--memory-mib", "1")
    # the read-only commands wait the same way, and not at all with 0
    r = vgpu("apps", "--socket", str(env.sock), "--wait-s", "0", env=env.env)
    assert r.returncode == 1 and "nothing listens" not in r.stderr


@pytest.mark.parametrize("command", [["apps"], ["top", "--plain", "--iterations", "1"],
                                     ["request", "--app", "a", "--memory-mib", "1"]])
def test_a_socket_in_a_directory_that_does_not_exist_fails_at_once(env: Env, command: list[str]) -> None:
    """No daemon can be listening or starting where the socket's directory is missing (a mistyped
    --socket, or the default /run/vgpu/vgpu.sock on a node that runs none): the command says so
    without waiting out --wait-s, and says how to name another daemon's socket."""
    sock = env.tmp / "no-such-dir" / "vgpu.sock"
    began = time.monotonic()
    r = vgpu(*command, "--socket", str(sock), "--wait-s", "30", env=env.env)
    assert r.returncode == 1 and time.monotonic() - began < 20, r.stderr
    assert f"cannot reach the vgpu daemon at {sock}" in r.stderr, r.stderr
    assert f"its directory {sock.parent} does not exist" in r.stderr and "nothing listens" not in r.stderr
    assert "--socket PATH or set VGPU_SERVER_SOCKET" in r.stderr and "systemctl status vgpu-manager" in r.stderr
    # the environment variable the hint names is the one the commands read
    r = vgpu(command[0], *command[1:], "--wait-s", "30", env={**env.env, "VGPU_SERVER_SOCKET": str(sock)})
    assert r.returncode == 1 and f"cannot reach the vgpu daemon at {sock}" in r.stderr, r.stderr


def test_a_missing_socket_in_an_existing_directory_is_waited_for_and_names_the_flag(env: Env) -> None:
    """The socket's directory exists (a daemon may be starting there): the wait is kept, and the
    message says how to point the command at another daemon."""
    env.sock.parent.mkdir(parents=True)
    r = vgpu("apps", "--socket", str(env.sock), "--wait-s", "0.5", env=env.env)
    assert r.returncode == 1 and "nothing listened there within 0.5 s (--wait-s)" in r.stderr, r.stderr
    assert "--socket PATH or set VGPU_SERVER_SOCKET" in r.stderr


LOOKS = (["available", "--json"], ["apps", "--json"], ["top", "--plain", "--iterations", "1"],
         ["report", "--app", "nobody", "--out", "REPORT"])


def test_a_look_sent_before_the_daemon_listens_waits_for_it(env: Env, serves: list[Serve], tmp_path: Path) -> None:
    """`vgpu serve & vgpu available` typed together (docs/install.md, "Trying it"): the read-only
    commands wait within --wait-s too, and answer once the daemon serves. All four wait for the
    one daemon (a start is 2-3 s of the suite); each is checked on its own."""
    waiting: dict[str, tuple[subprocess.Popen[str], str]] = {}
    env.sock.parent.mkdir(parents=True, exist_ok=True)  # as the unit's RuntimeDirectory makes it
    try:
        for look in LOOKS:
            command = [str(tmp_path / "report.png") if a == "REPORT" else a for a in look]
            waits = start(*command, "--socket", str(env.sock), "--wait-s", "60", env=env.env)
            waiting[command[0]] = (waits, "")
            assert waits.stderr is not None
            first = waits.stderr.readline()
            assert first.startswith(f"vgpu {command[0]}: nothing listens on ") and "--wait-s" in first, first
            assert waits.poll() is None
            waiting[command[0]] = (waits, first)
        serves.append(Serve(env))
        for name, (waits, first) in waiting.items():
            out, err = waits.communicate(timeout=90)
            assert "nothing listens" not in err, name
            if name == "report":  # the daemon answered (no history for an app it never saw), not "cannot reach"
                assert waits.returncode == 1 and "no history for application 'nobody'" in err, first + err
                continue
            assert waits.returncode == 0, name + ": " + first + err
            if name == "available":
                assert json.loads(out)["devices"][0]["name"]
            elif name == "apps":
                assert json.loads(out).get("apps", []) == []
            else:
                assert out.startswith("vgpu top") and "GRANTED MiB" in out, out
    finally:
        for waits, _ in waiting.values():
            if waits.poll() is None:
                waits.kill()
                waits.communicate(timeout=10)


def test_report_with_no_daemon_says_how_long_it_waited_and_0_does_not_wait(env: Env, tmp_path: Path) -> None:
    _says_how_long_it_waited_and_0_does_not_wait(env, "report", "--socket", str(env.sock), "--app", "a",
                                                 "--out", str(tmp_path / "a.png"))


class NotReadyRelease(NotReadyAllocator):
    """As NotReadyAllocator, for ReleaseResources."""

    def ReleaseResources(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        if self.calls <= self.not_ready:
            if self.marked:
                context.set_trailing_metadata(((NOTHING_CHANGED_KEY, "1"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "the state directory is full")
        return super().ReleaseResources(request, context)


@pytest.mark.parametrize("marked", [True, False])
@pytest.mark.parametrize("command", ["request", "release"])
def test_a_change_is_sent_again_only_when_the_daemon_says_it_changed_nothing(
        tmp_path: Path, env: Env, command: str, marked: bool) -> None:
    """A daemon that answers UNAVAILABLE twice (a daemon of this build cannot be made to drop a
    connection after acting on a call at will, so a gRPC server in the test plays it)."""
    sock = tmp_path / "fake.sock"
    servicer = NotReadyRelease(2, marked=marked) if command == "release" else NotReadyAllocator(2, marked=marked)
    if command == "release":
        servicer.grants["g1"] = _grant("g1")
    server = serve(sock, servicer)
    try:
        args = ["--app", "a", "--memory-mib", "10"] if command == "request" else ["--grant", "g1", "--app", "a"]
        r = vgpu(command, "--socket", str(sock), *args, env=env.env)
    finally:
        server.stop(grace=None)
    if marked:
        assert r.returncode == 0, r.stderr
        assert servicer.calls == 3  # two "not ready" answers, then done
        assert sum("not ready" in line for line in r.stderr.splitlines()) == 1, r.stderr
    else:
        # an UNAVAILABLE the daemon did not mark may follow a change: never sent again
        assert r.returncode == 1 and servicer.calls == 1, r.stderr
        assert "UNAVAILABLE" in r.stderr and "not ready" not in r.stderr


def _grant(grant_id: str) -> allocator_pb2.Grant:
    return allocator_pb2.Grant(grant_id=grant_id, app_id="a", device_id="GPU-0", memory_mib=10)


@pytest.fixture(scope="module")
def looked_at(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One `vgpu serve` for the tests that only look at it (doctor, top, and command lines refused
    before they reach it): none of them changes it, so they need not start one each (2-3 s a start)."""
    with one_daemon_for_the_module(make_env(tmp_path_factory.mktemp("looked-at"))) as env:
        yield env


def doctor_lines(env: Env, *args: str) -> dict[str, list[dict[str, str]]]:
    r = vgpu("doctor", "--state-dir", str(env.state), "--json", *args, env=env.env)
    by_name: dict[str, list[dict[str, str]]] = {}
    for check in json.loads(r.stdout):
        by_name.setdefault(check["name"], []).append(check)
    return by_name


def test_doctor_checks_the_backend_the_daemon_runs_on_and_says_so(looked_at: Env, tmp_path: Path) -> None:
    env = looked_at
    checks = doctor_lines(env, "--socket", str(env.sock))  # no --backend: the configuration says nvml
    (backend,) = checks["backend"]
    assert backend["status"] == "OK" and backend["detail"].startswith("sim:h100-80gb, the daemon's at "), backend
    assert str(env.sock) in backend["detail"]
    for name in ("driver", "nvml"):
        (check,) = checks[name]
        assert check["status"] == "OK", check
    assert "1 device(s): NVIDIA H100" in checks["nvml"][0]["detail"]
    # --backend still wins, and a daemon on another backend is said
    checks = doctor_lines(env, "--socket", str(env.sock), "--backend", "nvml")
    (backend,) = checks["backend"]
    assert backend["status"] == "WARN" and "runs on sim:h100-80gb" in backend["detail"], backend
    # no daemon: the configured backend, as before, and the line says why
    none = tmp_path / "none.sock"
    checks = doctor_lines(env, "--socket", str(none))
    (backend,) = checks["backend"]
    assert backend["detail"].startswith("nvml (checked as configured: no daemon answers at "), backend
    assert checks["nvml"][0]["status"] in ("OK", "FAIL")  # the NVML of this machine, as before
    assert "nvmlInit" in checks["nvml"][0]["detail"]


def test_doctor_does_not_promise_a_state_directory_to_a_daemon_that_runs_with_another(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    """`vgpu doctor --socket S` with a state directory that is not the daemon's (the default
    /var/lib/vgpu while the daemon was given another): the line said the daemon "will create it",
    which a running daemon never does; it now says a daemon answers, so its state is elsewhere."""
    serves.append(Serve(env))
    elsewhere = tmp_path / "not-the-daemons"
    (state,) = doctor_lines(env, "--socket", str(env.sock), "--state-dir", str(elsewhere))["state dir"]
    assert state["status"] == "WARN" and "will create it" not in state["detail"], state
    assert state["detail"] == (f"{elsewhere} does not exist, yet a daemon answers on {env.sock}: it keeps its "
                               "state in another directory; give its server.state_dir with --state-dir (or its "
                               "--config)"), state
    (state,) = doctor_lines(env, "--socket", str(env.sock))["state dir"]  # its own: fine
    assert state["status"] == "OK" and str(env.state) in state["detail"], state
    # with no daemon, a missing directory is still one the daemon will create
    (state,) = doctor_lines(env, "--socket", str(tmp_path / "none.sock"), "--state-dir", str(elsewhere))["state dir"]
    assert state["status"] == "WARN" and "the daemon will create it" in state["detail"], state


def test_numbers_out_of_range_and_other_usage_mistakes_exit_2_naming_the_flag(looked_at: Env) -> None:
    env = looked_at
    sock = ["--socket", str(env.sock)]
    job = ["--model-type", "resnet50", "--batch-size", "8"]
    cases = [  # (command line, the flag the message names)
        (["request", *sock, "--app", "a", "--model-type", "resnet50", "--batch-size", "-3"], "--batch-size"),
        (["request", *sock, "--app", "a", *job, "--param-count", "-1"], "--param-count"),
        (["request", *sock, "--app", "a", *job, "--num-layers", "5000000000"], "--num-layers"),
        (["request", *sock, "--app", "a", "--memory-mib", "10", "--pid", "-1"], "--pid"),
        (["request", *sock, "--app", "a", "--memory-mib", "10", "--priority", "99999999999"], "--priority"),
        (["request", *sock, "--app", "a"], "--memory-mib"),
        (["request", *sock, "--app", "a", "--memory-mib", "10", "--wait-s", "-1"], "--wait-s"),
        (["set-limit", *sock, "--state-dir", str(env.state), "--app", "a", "--priority", "99999999999"], "--priority"),
        (["available", *sock, "--timeout-s", "0"], "--timeout-s"),
        (["apps", *sock, "--timeout-s", "nan"], "--timeout-s"),
        (["top", *sock, "--interval-s", "0", "--iterations", "1"], "--interval-s"),
        (["top", *sock, "--iterations", "-1"], "--iterations"),
        (["apps", *sock, "--token-file", str(env.tmp / "no-such.token")], "no-such.token"),
    ]
    for args, flag in cases:
        r = vgpu(*args, env=env.env)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and flag in r.stderr.splitlines()[-1], (args, r.stderr)
        assert r.stdout == "", (args, r.stdout)
    apps = json.loads(vgpu("apps", *sock, "--json", env=env.env).stdout)
    assert apps["apps"] == []  # none of them reached the daemon as a change


def test_vgpu_without_a_command_is_a_usage_error() -> None:
    r = vgpu()
    assert r.returncode == 2 and r.stdout == "" and "usage: vgpu COMMAND" in r.stderr
    assert vgpu("--help").returncode == 0


def test_doctor_with_a_bad_backend_still_checks_the_socket_and_state_dir_given(looked_at: Env) -> None:
    env = looked_at
    checks = doctor_lines(env, "--socket", str(env.sock), "--backend", "sim:nope")
    assert checks["config"][0]["status"] == "FAIL" and "sim:nope" in checks["config"][0]["detail"]
    assert checks["socket"][0]["status"] == "OK" and str(env.sock) in checks["socket"][0]["detail"]
    assert str(env.state) in checks["state dir"][0]["detail"]
    # the bad --backend is not taken: the daemon's is checked
    assert checks["backend"][0]["detail"].startswith("sim:h100-80gb, the daemon's at ")


def test_a_socket_that_cannot_be_bound_is_said_once(env: Env) -> None:
    r = vgpu("serve", "--socket", "/proc/vgpu.sock", "--state-dir", str(env.state), "--backend", "sim:h100-80gb",
             "--metrics-port", "0", env=env.env)
    assert r.returncode == 1
    (said,) = [line for line in r.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert said.count("cannot listen on") == 1, said


def test_a_socket_whose_directory_cannot_be_made_is_said_with_the_directory(env: Env) -> None:
    r = vgpu("serve", "--socket", "/proc/no-such/vgpu.sock", "--state-dir", str(env.state), "--backend",
             "sim:h100-80gb", "--metrics-port", "0", env=env.env)
    assert r.returncode == 1
    (said,) = [line for line in r.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert said == ("vgpu serve: cannot listen on /proc/no-such/vgpu.sock: cannot create its directory /proc/no-such "
                    "(No such file or directory); choose another --socket (server.socket)"), said


def test_releasing_a_grant_without_its_token_says_where_the_token_was_looked_for(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    serves.append(Serve(env))
    sock = ["--socket", str(env.sock)]
    r = vgpu("request", *sock, "--app", "owner", "--memory-mib", "10", "--json", env=env.env)
    grant_id = json.loads(r.stdout)["grant_id"]
    other = dict(env.env, XDG_CONFIG_HOME=str(tmp_path / "another-user"))  # its token cache is empty
    r = vgpu("release", *sock, "--grant", grant_id, env=other)
    assert r.returncode == 1 and "belongs to 'owner'" in r.stderr, r.stderr
    assert str(tmp_path / "another-user" / "vgpu" / "tokens") in r.stderr, r.stderr  # the cache it read
    assert "--token-file" in r.stderr and "--state-dir" in r.stderr and "another --app" not in r.stderr
    ok = vgpu("release", *sock, "--state-dir", str(env.state), "--grant", grant_id, env=other)
    assert ok.returncode == 0, ok.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly(looked_at: Env) -> None:
    env = looked_at
    top = start("top", "--socket", str(env.sock), "--plain", "--interval-s", "0.1", "--iterations", "200", env=env.env)
    assert top.stdout is not None and top.stdout.readline().startswith("vgpu top")
    top.stdout.close()  # as `vgpu top --plain | head -1` does once it has its line
    _, err = top.communicate(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert top.returncode == 128 + signal.SIGPIPE


def test_a_state_dir_that_is_a_file_is_said_so(env: Env, tmp_path: Path) -> None:
    afile = tmp_path / "state-file"
    afile.write_text("")
    r = vgpu("serve", "--socket", str(env.sock), "--state-dir", str(afile), "--backend", "sim:h100-80gb",
             "--metrics-port", "0", env=env.env)
    assert r.returncode == 1
    (said,) = [line for line in r.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert said == (f"vgpu serve: state directory {afile} is not usable: it is a file, not a directory; give a "
                    "directory as --state-dir (server.state_dir)"), said  # not "(File exists)"


def test_doctor_says_when_the_socket_s_directories_shut_its_group_out(env: Env, serves: list[Serve]) -> None:
    """A socket 0660 with its own group below a 0700 directory: the group's users get EACCES on
    connect, so doctor warns and names the directory and the fix; a directory the group may pass
    (o+x, or g+x with the socket's group) is OK."""
    group = grp.getgrgid(1).gr_name  # any group but root's own
    base = Path(tempfile.mkdtemp(prefix="vgpu-doctor-"))  # not under pytest's 0700 base directory
    try:
        base.chmod(0o755)
        here = Env(env.tmp, base / "run" / "vgpu.sock", env.state, {**env.env, "VGPU_SERVER_SOCKET_GROUP": group})
        serves.append(Serve(here))
        assert here.sock.stat().st_gid == 1 and here.sock.stat().st_mode & 0o777 == 0o660
        ok = doctor_lines(here, "--socket", str(here.sock))["socket"][0]
        assert ok["status"] == "OK" and f"group {group}" in ok["detail"], ok
        (base / "run").chmod(0o700)  # made by hand, or a strict umask on a parent an operator created
        (shut,) = doctor_lines(here, "--socket", str(here.sock))["socket"]
        assert shut["status"] == "WARN", shut
        assert f"{base / 'run'} (mode 0700, group root)" in shut["detail"] and "chmod o+x" in shut["detail"], shut
        os.chown(base / "run", -1, 1)
        (base / "run").chmod(0o750)  # the socket's group may pass; others may not, and need not
        assert doctor_lines(here, "--socket", str(here.sock))["socket"][0]["status"] == "OK"
    finally:
        for s in serves:
            s.stop_now()
        shutil.rmtree(base, ignore_errors=True)


def test_the_state_directory_for_tokens_comes_from_the_configuration_as_the_help_says(
        env: Env, serves: list[Serve]) -> None:
    """`vgpu set-limit --help` says the state directory (where the operator token is read) defaults to
    the configuration's server.state_dir, not a fixed /var/lib/vgpu; and so it does: with
    VGPU_SERVER_STATE_DIR naming the daemon's, set-limit finds the operator token without --state-dir."""
    help_text = " ".join(vgpu("set-limit", "--help", env=env.env).stdout.split())
    assert "(default: server.state_dir of the configuration, /var/lib/vgpu)" in help_text, help_text
    serves.append(Serve(env))
    args = ("set-limit", "--socket", str(env.sock), "--app", "later", "--create", "--max-memory-mib", "1000",
            "--wait-s", "0")
    r = vgpu(*args, env={**env.env, "VGPU_SERVER_STATE_DIR": str(env.state)})
    assert r.returncode == 0, r.stderr
    r = vgpu(*args, env={**env.env, "VGPU_SERVER_STATE_DIR": str(env.tmp / "elsewhere")})
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr and str(env.tmp / "elsewhere") in r.stderr, r.stderr
