"""`vgpu serve` as a real process: crash safety, graceful restore, refusals, systemd notification, and the
whole path under default auth (auth.open_ingest false) fed by a real `vgpu profiler --replay` with its token."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from daemon_fixtures import ROOT, SKU, Env, Serve, wait_for

from vgpu import auth
from vgpu.traces import AppTrace, write_trace


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_grant_survives_kill_9_and_restart(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    grant = env.json("request", "--app", "job1", "--memory-mib", "2048")
    assert grant["app_id"] == "job1" and grant["memory_mib"] == 2048 and grant["grant_id"]
    gone = env.json("request", "--app", "job2", "--memory-mib", "1024", "--pid", str(_dead_pid()),
                   "--state-dir", str(env.state))  # naming a pid needs the operator token
    serves[-1].kill9()

    serves.append(Serve(env))
    rec = serves[-1].event("reconciled")
    assert rec["grants_restored"] == 1 and rec["released_process_gone"] == [gone["grant_id"]]
    devices = env.json("available")["devices"]
    assert devices[0]["mem_granted_mib"] == 2048
    apps = {a["app_id"]: a for a in env.json("apps")["apps"]}
    assert [g["grant_id"] for g in apps["job1"]["grants"]] == [grant["grant_id"]]
    # job2's grant went with its process; its id stays claimed (its token still owns it), listed
    # with nothing granted
    assert not apps["job2"].get("grants") and apps["job2"]["claimed"]
    # The application's token outlived the crash too: its owner may release it; nobody else may.
    other = env.json("request", "--app", "job3", "--memory-mib", "1")
    assert other["app_id"] == "job3"
    denied = env.vgpu("release", "--socket", str(env.sock), "--grant", grant["grant_id"], "--token-file",
                      str(auth.app_token_file("job3", env.state)), check=False)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    env.vgpu("release", "--socket", str(env.sock), "--grant", grant["grant_id"])
    assert env.json("available")["devices"][0]["mem_granted_mib"] == 1
    assert serves[-1].term() == 0


def test_a_cgroup_limit_left_by_kill_9_gets_its_original_back(env: Env, serves: list[Serve]) -> None:
    """The grant of a process on a contended GPU caps its cgroup's GPU memory (the simulated device
    keeps the limit in the state dir, as a driver keeps it across a daemon crash). The daemon dies with
    kill -9, then the process ends; the next run finds no grant holding the cgroup and writes the
    recorded original back."""
    from vgpu.allocator.mechanisms.limits import read_cgroup

    sim_file = env.state / "sim-devices.json"

    def limits() -> dict[str, list[float]]:
        (dev,) = json.loads(sim_file.read_text())["devices"].values()
        return dict(dev.get("memory_limits_mib", {}))

    app = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        cgroup = read_cgroup(app.pid)
        if cgroup is None:
            pytest.skip("no readable /proc/<pid>/cgroup here")
        serves.append(Serve(env))
        assert limits() == {}
        # 95 % of the GPU: contended, so the limit is hard (docs/allocation.md)
        mib = int(0.95 * env.json("available")["devices"][0]["mem_total_mib"])
        env.json("request", "--app", "job1", "--memory-mib", str(mib), "--pid", str(app.pid),
                 "--state-dir", str(env.state))  # naming a pid needs the operator token
        assert limits()[cgroup][1] == mib  # the hard limit is the grant
        serves[-1].kill9()
        assert limits()[cgroup][1] == mib  # a crash leaves it in force
    finally:
        app.kill()
        app.wait(10)

    serves.append(Serve(env))
    rec = serves[-1].event("reconciled")
    assert len(rec["released_process_gone"]) == 1
    assert list(rec["cgroup_originals"].values()) == ["restored"] and next(iter(rec["cgroup_originals"])).endswith(f" {cgroup}")
    assert limits() == {}  # back to no limit, the original
    assert serves[-1].term() == 0
    serves.append(Serve(env))  # nothing is left to put back
    assert serves[-1].event("reconciled")["cgroup_originals"] == {}
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
    got: list[str] = []
    while not any("WATCHDOG=1" in m for m in got):
        got.append(listener.recv(4096).decode())
    assert got[0].startswith("READY=1")
    # start-up's objects are out of the garbage collector's full passes (vgpu/gc_freeze.py)
    assert serves[-1].event("serving")["heap_frozen_objects"] > 10_000
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


def _full_datagram_socket(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A datagram socket bound at `path` that nobody reads, its queue filled: a new sender's first
    message would wait. (The listener, the senders that filled it.)"""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    senders: list[socket.socket] = []
    for _ in range(64):  # each sender is bounded by its own send buffer too: as many as the queue takes
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.connect(str(path))
        senders.append(s)
        try:
            while True:
                s.send(b"x", socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
            probe.connect(str(path))
            try:
                probe.send(b"x", socket.MSG_DONTWAIT)
            except BlockingIOError:
                return listener, senders
    raise AssertionError("the datagram queue never filled")


def test_a_notify_socket_that_is_not_read_stalls_neither_the_loop_nor_the_stop(env: Env, serves: list[Serve]) -> None:
    """NOTIFY_SOCKET naming a socket whose queue is full (a process holds it and never reads): the
    daemon's messages are dropped and said, not waited on; it goes on answering and stops cleanly."""
    listener, senders = _full_datagram_socket(env.tmp / "full.sock")
    try:
        serves.append(Serve(env, notify=env.tmp / "full.sock"))
        serves[-1].wait_for("sd_notify_failed")
        assert "unavailable" in serves[-1].event("sd_notify_failed")["error"].lower()
        assert serves[-1].term() == 0
        assert serves[-1].events()[-1]["event"] == "stopped"
    finally:
        for s in [listener, *senders]:
            s.close()


def test_a_stale_notify_socket_neither_stops_the_start_nor_the_stop(env: Env, serves: list[Serve]) -> None:
    """NOTIFY_SOCKET naming a socket that is gone (inherited from a unit that ended): the daemon
    serves, and its stop, which notifies first, still restores, saves and unlocks ("stopped")."""
    for stale in (env.tmp / "gone.sock", env.tmp / "closed.sock"):
        if stale.name == "closed.sock":  # a socket file nobody reads any more: connect is refused
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.bind(str(stale))
            s.close()
        serves.append(Serve(env, notify=stale))
        serves[-1].wait_for("sd_notify_failed")  # logged just after "serving", when READY is sent
        assert str(stale) in serves[-1].event("sd_notify_failed")["error"]
        assert serves[-1].term() == 0
        assert serves[-1].event("stopped")["devices_restored"] == 0


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
    # the failed start removes the state directory it made (tokens, database, lock) and nothing else
    assert not (env.tmp / "s3").exists() and (env.state / "tokens" / "operator.token").exists()
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
                      "--token-file", str(auth.app_token_file("a", env.state)), check=False)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    anon = env.vgpu("set-limit", *sock, "--app", "a", "--max-memory-mib", "5", check=False)
    assert anon.returncode == 1 and "UNAUTHENTICATED" in anon.stderr
    ok = env.vgpu("set-limit", *sock, "--state-dir", str(env.state), "--app", "a", "--max-memory-mib", "5", "--json")
    assert json.loads(ok.stdout)["max_memory_mib"] == 5
    denials = [e for e in serves[-1].events() if e.get("event") == "access_denied"]
    assert {e["code"] for e in denials} == {"PERMISSION_DENIED", "UNAUTHENTICATED"}
    assert serves[-1].term() == 0


# --- the profiler -> manager -> allocator path under auth ------------------------------------------------
def _small_trace(path: Path) -> Path:
    t = np.arange(0.0, 30.0, 0.5)
    write_trace(
        path,
        [
            AppTrace("train-a", t, {"mem_used_mib": 4000 + 10 * t, "sm_util_pct": np.full(len(t), 60.0)}),
            AppTrace("infer-b", t, {"mem_used_mib": np.full(len(t), 1500.0), "sm_util_pct": np.full(len(t), 20.0)}),
        ],
    )
    return path


def _profiler(env: Env, trace: Path, *extra: str, seconds: float = 2.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{env.sock}", "--replay", str(trace),
         "--speed", "10", "--seconds", str(seconds), *extra],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=60, check=False,
    )


def test_profiler_streams_with_its_token_and_the_apps_show_up(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    device = env.json("available")["devices"][0]["device_id"]
    trace = _small_trace(env.tmp / "trace.csv")

    # Without the token the daemon refuses the stream; the profiler says why and nothing reaches the ledger.
    wrong = env.tmp / "wrong.token"
    wrong.write_text("vgpu1.cHJvZmlsZXI.0000\n")
    refused = _profiler(env, trace, "--device-id", device, "--token-file", str(wrong), seconds=1.5)
    assert refused.returncode == 1, refused.stderr  # refused every stream: a failure, said at exit
    assert "the manager refused every stream" in refused.stderr
    assert "manager refused the profiler" in refused.stderr and "UNAUTHENTICATED" in refused.stderr
    assert any(e.get("event") == "access_denied" and e.get("method") == "/vgpu.v1.Ingest/StreamSignatures"
               for e in serves[-1].events())
    assert env.json("apps")["apps"] == []

    token = env.state / "tokens" / "profiler.token"
    done = _profiler(env, trace, "--device-id", device, "--token-file", str(token))
    assert done.returncode == 0, done.stderr
    assert "manager refused" not in done.stderr
    # start-up's objects are out of the garbage collector's full passes (vgpu/gc_freeze.py)
    starting = [json.loads(line) for line in done.stderr.splitlines() if '"profiler starting"' in line]
    assert starting and starting[0]["heap_frozen_objects"] > 10_000
    apps = {a["app_id"]: a for a in env.json("apps")["apps"]}
    assert set(apps) == {"train-a", "infer-b"}
    for app in apps.values():
        assert app["mem_used_mib"] is not None and app["mem_used_mib"] > 0  # null while unknown
        assert app["forecast_mem_p90_mib"] is not None and app["forecast_mem_p90_mib"] > 0
        assert [g["device_id"] for g in app["grants"]] == [device]
        assert app["grants"][0]["source"] == "forecast"
    # the grants follow usage: the trainer uses more than twice the memory of the inference job
    assert apps["train-a"]["grants"][0]["memory_mib"] > 2 * apps["infer-b"]["grants"][0]["memory_mib"]
    assert apps["infer-b"]["grants"][0]["memory_mib"] >= 1500
    assert serves[-1].term() == 0


def test_profiler_without_a_token_file_stops_at_once(env: Env) -> None:
    trace = _small_trace(env.tmp / "trace.csv")
    missing = env.tmp / "nope" / "profiler.token"
    result = _profiler(env, trace, "--token-file", str(missing), seconds=1.0)
    assert result.returncode == 2
    assert f"cannot read the token file {missing}" in result.stderr and "--token-file" in result.stderr


@pytest.mark.parametrize(("spec", "names"), [
    ("sim", ["NVIDIA H100 80GB HBM3"]),
    ("sim:h100-80gb*2", ["NVIDIA H100 80GB HBM3"] * 2),
    ("sim:a100-40gb,h100-80gb", ["NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"]),
])
def test_serve_takes_the_backend_grammar_the_profiler_takes(env: Env, serves: list[Serve], spec: str,
                                                            names: list[str]) -> None:
    serves.append(Serve(env, "--backend", spec))
    assert [d["name"] for d in env.json("available")["devices"]] == names
    assert serves[-1].term() == 0


def test_a_bad_backend_spec_is_refused_by_serve_and_profiler_alike(env: Env) -> None:
    outs = []
    for cmd in (["serve", "--socket", str(env.sock), "--state-dir", str(env.state)],
                ["profiler", "--manager", f"unix://{env.sock}", "--no-token"]):
        r = subprocess.run([sys.executable, "-m", "vgpu.cli", *cmd, "--backend", "sim:h100-80gb*0"],
                           cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        outs.append(r.stderr)
    for err in outs:
        assert "GPU count 0 is outside 1..64" in err, outs


def test_a_replay_s_applications_are_released_soon_after_it_ends(env: Env, serves: list[Serve]) -> None:
    """docs/install.md's "Trying it": after a short replay, the replayed applications' grants stay to
    be looked at, then go about server.stream_end_grace_s after the replay ends (their made-up
    processes run on no GPU), not after server.idle_release_s, so a request finds the GPU free. An
    application of the replay that requested a grant itself keeps it. The grace is set to 4 s (10 s
    by default), still far longer than the profiler takes to exit once its stream has ended."""
    grace_s = 4.0
    env.env["VGPU_SERVER_STREAM_END_GRACE_S"] = str(grace_s)
    serves.append(Serve(env))
    device = env.json("available")["devices"][0]["device_id"]
    trace = _small_trace(env.tmp / "trace.csv")
    env.vgpu("request", "--socket", str(env.sock), "--app", "train-a", "--memory-mib", "1000")
    done = _profiler(env, trace, "--device-id", device, "--token-file", str(env.state / "tokens" / "profiler.token"))
    assert done.returncode == 0, done.stderr
    ended = time.monotonic()
    apps = {a["app_id"]: a for a in env.json("apps")["apps"]}
    assert [g["source"] for g in apps["infer-b"]["grants"]] == ["forecast"]  # still there to be looked at
    train_a = [g["source"] for g in apps["train-a"]["grants"]]
    assert "request" in train_a, train_a  # and a forecast grant may have joined it

    def granted() -> dict[str, list[str]]:
        return {a["app_id"]: [g["source"] for g in a.get("grants", [])] for a in env.json("apps")["apps"]}

    wait_for("the replayed application's release", lambda: not granted().get("infer-b"), timeout_s=grace_s + 20)
    assert time.monotonic() - ended < 60  # far sooner than the 120 s idle release
    assert granted()["train-a"] == train_a  # it requested: its grants are its own to release
    (released,) = [e for e in serves[-1].events() if e.get("event") == "app_released_stream_ended"]
    assert released["app"] == "infer-b" and released["devices"] == [device]
    env.vgpu("request", "--socket", str(env.sock), "--app", "after", "--memory-mib", "2048")
    assert serves[-1].term() == 0


async def test_a_replayed_application_whose_process_runs_on_the_gpu_keeps_its_grants(tmp_path: Path) -> None:
    """The release after a stream ends never frees a grant whose process still runs: the replay's
    first application (pid 100000, as the replay numbers them) is made to run on the simulated GPU,
    and keeps its forecast grant; the other one's process runs nowhere, and its grant goes. With
    server.idle_release_s 0 (keep grants until released) both stay. The two settings run side by
    side, each on a daemon of its own: each waits out the grace after the stream's end, and one wait
    does for both: server.stream_end_grace_s, set to 4 s (10 s by default), still far longer than the
    profiler takes to exit once its stream has ended."""
    import asyncio

    from daemon_fixtures import sim_daemon

    grace_s = 4.0

    async def one(idle_release_s: float) -> None:
        where = tmp_path / f"idle-{idle_release_s:g}"
        where.mkdir()
        trace = _small_trace(where / "trace.csv")
        overrides: dict[str, object] = {"server.idle_release_s": idle_release_s, "server.stream_end_grace_s": grace_s}
        d = sim_daemon(where, **overrides)
        await d.start()
        try:
            device = d.backend.devices()[0]
            t = np.arange(0.0, 600.0, 1.0)
            sim = d.backend.sim  # type: ignore[attr-defined]  # the simulator under its saved settings
            sim.launch("infer-b", 100_000, AppTrace("infer-b", t, {"mem_used_mib": np.full(len(t), 1500.0)}))
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{d.socket_path}", "--replay",
                str(trace), "--speed", "10", "--seconds", "2", "--device-id", device.uuid,
                "--token-file", str(where / "state" / "tokens" / "profiler.token"),
                cwd=ROOT, env=env, stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()

            def sources() -> dict[str, list[str]]:
                return {app: [g.source for g in d.allocator.ledger.grants(app_id=app)] for app in ("infer-b", "train-a")}

            assert sources() == {"infer-b": ["forecast"], "train-a": ["forecast"]}, idle_release_s
            if not idle_release_s:
                await asyncio.sleep(grace_s + 3)  # the release would have come at grace_s
                assert sources() == {"infer-b": ["forecast"], "train-a": ["forecast"]}, idle_release_s
                return
            deadline = time.monotonic() + grace_s + 20
            while sources()["train-a"] and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert sources() == {"infer-b": ["forecast"], "train-a": []}, idle_release_s
        finally:
            await d.stop("test")

    # both run to the end (each stops its daemon) before either's failure is raised
    outcomes = await asyncio.gather(one(120.0), one(0.0), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
