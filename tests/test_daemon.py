"""`vgpu serve` as a real process: crash safety, graceful restore, refusals, systemd notification."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKU = "h100-80gb"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Env:
    tmp: Path
    sock: Path
    state: Path
    env: dict[str, str]

    def vgpu(self, *args: str, check: bool = True) -> Result:
        """An operator command, run in this process (the daemon is the real subprocess)."""
        from allocator import cli

        if args[0] == "serve":
            from contextlib import redirect_stderr

            from manager import daemon

            err = io.StringIO()
            with redirect_stderr(err):
                rc = daemon.main(list(args[1:]), "vgpu serve")
            return Result(rc, "", err.getvalue())
        fn = getattr(cli, args[0].replace("-", "_") + "_main")
        out, err = io.StringIO(), io.StringIO()
        from contextlib import redirect_stderr

        with redirect_stderr(err):
            rc = fn(list(args[1:]), f"vgpu {args[0]}", out=out, env=self.env)
        if check and rc != 0:
            raise AssertionError(f"vgpu {' '.join(args)} -> {rc}\n{out.getvalue()}\n{err.getvalue()}")
        return Result(rc, out.getvalue(), err.getvalue())

    def json(self, *args: str) -> dict:  # type: ignore[type-arg]
        return json.loads(self.vgpu(*args, "--socket", str(self.sock), "--json").stdout)  # type: ignore[no-any-return]


@pytest.fixture
def env(tmp_path: Path) -> Env:
    e = dict(os.environ)
    e.update({"XDG_CONFIG_HOME": str(tmp_path / "home-config"), "PYTHONPATH": str(ROOT)})
    for k in list(e):
        if k.startswith(("VGPU_SERVER_", "VGPU_TOKEN", "NOTIFY_SOCKET", "WATCHDOG_")):
            del e[k]
    return Env(tmp_path, tmp_path / "run" / "vgpu.sock", tmp_path / "state", e)


class Serve:
    def __init__(self, env: Env, *extra: str, notify: Path | None = None) -> None:
        self.log_path = env.tmp / f"serve-{time.monotonic_ns()}.log"
        penv = dict(env.env)
        if notify is not None:
            penv.update({"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "300000"})
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(env.sock), "--state-dir", str(env.state),
             "--backend", f"sim:{SKU}", "--metrics-port", "0", *extra],
            cwd=ROOT, env=penv, stdout=subprocess.DEVNULL, stderr=self.log,
        )
        self.wait_for("serving")

    def events(self) -> list[dict]:  # type: ignore[type-arg]
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return out

    def event(self, name: str) -> dict:  # type: ignore[type-arg]
        found = [e for e in self.events() if e.get("event") == name]
        assert found, f"no {name!r} event in {self.log_path.read_text()}"
        return found[-1]

    def wait_for(self, name: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(e.get("event") == name for e in self.events()):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        raise AssertionError(f"no {name!r} within {timeout_s} s:\n{self.log_path.read_text()}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def term(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(30)
        self.log.close()
        return rc


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_grant_survives_kill_9_and_restart(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    grant = env.json("request", "--app", "job1", "--memory-mib", "2048")
    assert grant["app_id"] == "job1" and grant["memory_mib"] == 2048 and grant["grant_id"]
    gone = env.json("request", "--app", "job2", "--memory-mib", "1024", "--pid", str(_dead_pid()))
    serves[-1].kill9()

    serves.append(Serve(env))
    rec = serves[-1].event("reconciled")
    assert rec["grants_restored"] == 1 and rec["released_process_gone"] == [gone["grant_id"]]
    devices = env.json("available")["devices"]
    assert devices[0]["mem_granted_mib"] == 2048
    apps = {a["app_id"]: a for a in env.json("apps")["apps"]}
    assert [g["grant_id"] for g in apps["job1"]["grants"]] == [grant["grant_id"]]
    assert "job2" not in apps
    # The application's token outlived the crash too: its owner may release it; nobody else may.
    other = env.json("request", "--app", "job3", "--memory-mib", "1")
    assert other["app_id"] == "job3"
    denied = env.vgpu("release", "--socket", str(env.sock), "--grant", grant["grant_id"], "--token-file",
                      str(env.state / "tokens" / "apps" / "job3.token"), check=False)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    env.vgpu("release", "--socket", str(env.sock), "--grant", grant["grant_id"])
    assert env.json("available")["devices"][0]["mem_granted_mib"] == 1
    assert serves[-1].term() == 0


def test_graceful_stop_restores_the_power_limit(env: Env, serves: list[Serve]) -> None:
    """The simulated GPU keeps its settings in the state dir, as a real GPU keeps them across a daemon
    crash. The first run records the original limit; we then put the device at 450 W, as an
    enforcement in force at a crash would leave it; the next run must report it and put 700 W back."""
    serves.append(Serve(env))
    serves[-1].kill9()
    sim_file = env.state / "sim-devices.json"
    state = json.loads(sim_file.read_text())
    (uuid, dev), = state["devices"].items()
    original = dev["power_limit_mw"]
    dev["power_limit_mw"] = 450_000
    sim_file.write_text(json.dumps(state))

    serves.append(Serve(env))
    assert "power limit 450000 mW, original 700000 mW" in serves[-1].event("reconciled")["devices_not_original"][uuid]
    assert env.json("available")["devices"][0]["power_limit_mw"] == 450_000
    assert serves[-1].term() == 0
    restored = serves[-1].event("device_restored")
    assert (restored["before_mw"], restored["after_mw"], restored["original_mw"]) == (450_000, original, original)
    assert json.loads(sim_file.read_text())["devices"][uuid]["power_limit_mw"] == original == 700_000
    # A clean start afterwards finds nothing to reconcile.
    serves.append(Serve(env))
    assert serves[-1].event("reconciled")["devices_not_original"] == {}
    assert serves[-1].term() == 0
    assert not any(e.get("event") == "device_restored" for e in serves[-1].events())


def test_readiness_and_watchdog_over_notify_socket(env: Env, serves: list[Serve]) -> None:
    path = env.tmp / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(5)
    serves.append(Serve(env, notify=path))
    got = []
    while not any("WATCHDOG=1" in m for m in got):
        got.append(listener.recv(4096).decode())
    assert got[0].startswith("READY=1")
    assert serves[-1].term() == 0
    rest = []
    listener.settimeout(2)
    try:
        while True:
            rest.append(listener.recv(4096).decode())
    except TimeoutError:
        pass
    assert any(m.startswith("STOPPING=1") for m in rest)
    listener.close()


def test_socket_is_created_with_the_configured_mode(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env, "--socket-mode", "0600"))
    assert env.sock.stat().st_mode & 0o777 == 0o600
    assert (env.state / "tokens" / "operator.token").stat().st_mode & 0o777 == 0o600
    # A second daemon on the same state directory or socket is refused, and the first keeps serving.
    second = env.vgpu("serve", "--socket", str(env.tmp / "other.sock"), "--state-dir", str(env.state),
                      "--backend", f"sim:{SKU}", "--metrics-port", "0", check=False)
    assert second.returncode == 1 and "another vgpu daemon is using the state directory" in second.stderr
    third = env.vgpu("serve", "--socket", str(env.sock), "--state-dir", str(env.tmp / "s3"),
                     "--backend", f"sim:{SKU}", "--metrics-port", "0", check=False)
    assert third.returncode == 1 and "another daemon is listening" in third.stderr
    assert env.json("available")["devices"]
    assert serves[-1].term() == 0


def test_plaintext_tcp_is_refused_at_start(env: Env) -> None:
    proc = env.vgpu("serve", "--socket", str(env.sock), "--state-dir", str(env.state), "--backend", f"sim:{SKU}",
                    "--tcp", "0.0.0.0:50051", check=False)
    assert proc.returncode == 2
    assert "plaintext TCP is refused" in proc.stderr
    assert not env.state.exists()  # refused before anything was touched


def test_operator_cli_calls_need_the_operator_token(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    env.json("request", "--app", "a", "--memory-mib", "10")
    sock = ["--socket", str(env.sock)]
    denied = env.vgpu("set-limit", *sock, "--app", "a", "--max-memory-mib", "5",
                      "--token-file", str(env.state / "tokens" / "apps" / "a.token"), check=False)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    anon = env.vgpu("set-limit", *sock, "--app", "a", "--max-memory-mib", "5", check=False)
    assert anon.returncode == 1 and "UNAUTHENTICATED" in anon.stderr
    ok = env.vgpu("set-limit", *sock, "--state-dir", str(env.state), "--app", "a", "--max-memory-mib", "5", "--json")
    assert json.loads(ok.stdout)["max_memory_mib"] == 5
    denials = [e for e in serves[-1].events() if e.get("event") == "access_denied"]
    assert {e["code"] for e in denials} == {"PERMISSION_DENIED", "UNAUTHENTICATED"}
    assert serves[-1].term() == 0
