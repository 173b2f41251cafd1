"""A full state directory and damaged state.

Full disk: the daemon (in this process, on the simulated GPU) gets a store whose writes fail the way
SQLite fails on a full disk; every change is then answered UNAVAILABLE, undone in memory, and reads
keep working; after the disk frees, what is on disk is exactly what was acknowledged.

Damage: `vgpu serve` (a real process) refuses to start on a truncated database or a ledger missing a
row, with one line naming the file and `--reset-state`; a deleted or garbage WAL loses nothing (the
WAL is checkpointed after every change); `--reset-state` starts empty and keeps the old file."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import resource
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon_fixtures import (
    ROOT,
    SKU,
    Env,
    FullDisk,
    Serve,
    bound_port,
    make_env,
    sim_daemon,
    start_logging_serving,
    wait_for,
)
from hostile import Raw, operator_token
from structlog.testing import capture_logs

from vgpu import auth, ctl
from vgpu.allocator.store import Store
from vgpu.daemon.serve import Daemon
from vgpu.device import parse_sim_spec
from vgpu.device.errors import GpuLost
from vgpu.device.simstate import PersistentSimBackend
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc


async def test_a_full_disk_changes_nothing_and_reads_keep_working(daemon: Daemon, tmp_path: Path) -> None:
    op = auth.bearer(operator_token(daemon.state_dir))
    async with grpc.aio.insecure_channel(f"unix:{daemon.socket_path}") as ch:
        stub = pb_grpc.AllocatorStub(ch)

        async def request(app: str, mib: float, md: Any = op) -> pb.Grant:
            reply = await stub.RequestResourceAllocation(
                pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app, memory_mib=mib)),
                metadata=md, timeout=10)
            return reply.grant

        async def granted() -> float:
            devs = (await stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10)).devices
            return sum(d.mem_granted_mib for d in devs)

        kept = await request("a", 1000)
        disk = FullDisk(daemon.store._db)
        daemon.store._db = disk  # type: ignore[assignment]
        # A grant, a claim by a new anonymous application, a release and limits: all UNAVAILABLE.
        calls: list[Awaitable[Any]] = [
            request("a", 500),
            request("new-app", 500, ()),
            stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=kept.grant_id), metadata=op, timeout=10),
            stub.SetResourceLimits(pb.SetResourceLimitsRequest(limits=pb.AppLimits(app_id="a", max_memory_mib=1)),
                                   metadata=op, timeout=10),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "full" in str(err.value.details())
        # The CLI says what the daemon said (not "cannot reach the daemon").
        err_text = io.StringIO()
        with contextlib.redirect_stderr(err_text):
            rc = await asyncio.to_thread(
                ctl.request_main, ["--socket", str(daemon.socket_path), "--app", "cli-app", "--memory-mib", "1"],
                "vgpu request", out=io.StringIO(), env={"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "HOME": str(tmp_path)})
        assert rc == 1 and "UNAVAILABLE" in err_text.getvalue() and "full" in err_text.getvalue(), err_text.getvalue()
        assert "cannot reach" not in err_text.getvalue()
        # Reads work and show exactly what was acknowledged.
        assert await granted() == 1000
        apps = (await stub.ListApplications(pb.ListApplicationsRequest(), timeout=10)).apps
        assert [(a.app_id, len(a.grants), a.HasField("limits")) for a in apps] == [("a", 1, False)]
        assert not daemon.store.app_claimed("new-app")
        assert not auth.app_token_file("new-app", daemon.state_dir).exists()
        # The disk frees: the same calls succeed.
        disk.full = False
        await request("a", 500)
        await request("new-app", 500, ())
        assert await granted() == 2000
    daemon.store._db = disk.db
    stored = daemon.store.load_ledger()
    assert stored is not None and sorted(g["memory_mib"] for g in stored["grants"]) == [500, 500, 1000]


# --- stopping on a full disk ---------------------------------------------------------------------------------
TWO = "sim:h100-80gb*2"


def _off_original(d: Daemon) -> list[str]:
    """Both simulated devices at a lower power limit, as an enforcement in force leaves them; their uuids."""
    devices = d.backend.devices()
    for dev, mw in zip(devices, (400_000, 450_000), strict=True):
        dev.set_power_limit_mw(mw)
    return [dev.uuid for dev in devices]


def _sim_power_mw(state_dir: Path) -> dict[str, int]:
    """What the simulated devices hold, from the state file they keep it in (as a GPU keeps it)."""
    return {u: dev["power_limit_mw"] for u, dev in json.loads((state_dir / "sim-devices.json").read_text())["devices"].items()}


async def test_a_stop_on_a_full_disk_restores_every_device_and_finishes(tmp_path: Path) -> None:
    d = sim_daemon(tmp_path, **{"server.backend": TWO, "metrics.port": "auto"})
    metrics_port = bound_port(await start_logging_serving(d), "metrics")
    uuids = _off_original(d)
    disk = FullDisk(d.store._db)
    d.store._db = disk  # type: ignore[assignment]
    with capture_logs() as logs:
        await d.stop("test")
    events = [r["event"] for r in logs]
    assert _sim_power_mw(d.state_dir) == dict.fromkeys(uuids, 700_000)
    assert [r["device"] for r in logs if r["event"] == "device_restored"] == uuids
    assert events.count("device_originals_not_forgotten") == 1
    # every later step ran: the store, the backend and the metrics endpoint are closed, `stopped` logged
    assert d.stop_failures == [] and "stop_step_failed" not in events
    stopped = next(r for r in logs if r["event"] == "stopped")
    assert stopped["devices_restored"] == 2 and stopped["failed_steps"] == [] and d.stopped.is_set()
    with pytest.raises(sqlite3.ProgrammingError):
        disk.db.execute("SELECT 1")
    assert d.backend.sim.closed  # type: ignore[attr-defined]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", metrics_port), timeout=1).close()
    # The disk frees. The next start (the lock was let go) finds the devices at the originals it still
    # holds, reports nothing, and its stop forgets them.
    again = sim_daemon(tmp_path, **{"server.backend": TWO})
    with capture_logs() as logs:
        await again.start()
        assert sorted(again.store.originals()) == sorted(uuids)
        await again.stop("test")
    assert next(r for r in logs if r["event"] == "reconciled")["devices_not_original"] == {}
    assert "device_restored" not in [r["event"] for r in logs]
    with Store(again.state_dir) as store:
        assert store.originals() == {}


async def test_a_device_left_off_its_original_makes_the_stop_fail(tmp_path: Path) -> None:
    """A GPU the stop could not put back keeps the daemon's power limit: the stop did not do what it is
    for, so `stopped` names it among the failed steps (and `run` returns 1, the unit shows it failed);
    the other device is restored, and its original kept for the next stop."""
    d = sim_daemon(tmp_path, **{"server.backend": TWO})
    await d.start()
    uuids = _off_original(d)
    d.backend.devices()[0].inner.inject("set_power_limit_mw", GpuLost, times=1)  # type: ignore[attr-defined]
    with capture_logs() as logs:
        await d.stop("test")
    (failure,) = d.stop_failures
    assert failure.startswith(f"restore_devices: {uuids[0]} not back at the original settings")
    assert [r["device"] for r in logs if r["event"] == "device_restored"] == [uuids[1]]
    assert _sim_power_mw(d.state_dir) == {uuids[0]: 400_000, uuids[1]: 700_000}
    with Store(d.state_dir) as store:
        assert list(store.originals()) == [uuids[0]]


class _CloseFails(PersistentSimBackend):
    """A backend whose shutdown fails (NVML's nvmlShutdown on a GPU that fell off the bus, say)."""

    def close(self) -> None:
        super().close()
        raise OSError(5, "Input/output error")


async def test_a_failed_stop_step_is_logged_and_the_rest_of_the_stop_runs(tmp_path: Path) -> None:
    """`run` (what `vgpu serve` runs) stops on SIGTERM; a step that fails is logged, every later step
    runs, and the exit status is 1 (the unit shows it failed)."""
    backend = _CloseFails(parse_sim_spec(TWO), tmp_path / "sim.json")
    d = sim_daemon(tmp_path, backend=backend, **{"server.backend": TWO})
    with capture_logs() as logs:
        running = asyncio.create_task(d.run())
        while "serving" not in [r["event"] for r in logs] and not running.done():
            await asyncio.sleep(0.02)
        uuids = _off_original(d)
        d.store._db = FullDisk(d.store._db)  # type: ignore[assignment]
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(running, 60) == 1
    assert [dev.power_limit_mw() for dev in backend.devices()] == [700_000, 700_000]
    assert d.stop_failures == ["backend: OSError: [Errno 5] Input/output error"]
    failed = next(r for r in logs if r["event"] == "stop_step_failed")
    assert (failed["step"], failed["log_level"]) == ("backend", "error")
    stopped = next(r for r in logs if r["event"] == "stopped")
    assert stopped["failed_steps"] == d.stop_failures and stopped["devices_restored"] == 2
    assert [r["device"] for r in logs if r["event"] == "device_restored"] == uuids
    # the steps after it ran: the store is closed and the state directory unlocked
    again = sim_daemon(tmp_path, **{"server.backend": TWO})
    await again.start()
    await again.stop("test")


def test_vgpu_serve_stopped_on_a_full_disk_restores_both_devices_and_exits_0(env: Env, serves: list[Serve]) -> None:
    """SIGTERM to `vgpu serve` on two simulated GPUs whose state directory cannot grow: the soft file
    size limit (RLIMIT_FSIZE) is set below one page of SQLite's write-ahead log, so forgetting an
    original fails as on a full disk (the 350-byte device state file still fits). Its log goes to a
    pipe, which the limit does not bound."""
    serves.append(Serve(env, "--backend", TWO))
    serves[-1].kill9()
    sim_file = env.state / "sim-devices.json"
    state = json.loads(sim_file.read_text())
    for dev, mw in zip(state["devices"].values(), (400_000, 450_000), strict=True):
        dev["power_limit_mw"] = mw  # an enforcement in force when it was killed
    sim_file.write_text(json.dumps(state))
    proc = subprocess.Popen(
        [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(env.sock), "--state-dir", str(env.state),
         "--backend", TWO, "--metrics-port", "0"],
        cwd=ROOT, env=env.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    try:
        wait_for("serving", lambda: any('"event": "serving"' in line for line in list(lines)), 60)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)
    text = "".join(lines)
    events = {e["event"]: e for e in (json.loads(line) for line in lines if line.startswith("{"))}
    assert rc == 0, text
    assert _sim_power_mw(env.state) == dict.fromkeys(state["devices"], 700_000)
    assert "disk I/O error" in events["device_originals_not_forgotten"]["error"], text
    assert events["stopped"]["devices_restored"] == 2 and events["stopped"]["failed_steps"] == []
    assert "startup_failed" not in events and "cannot start" not in text


# --- damaged state, against `vgpu serve` -------------------------------------------------------------------
def _serve_fails(env: Env, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(env.sock), "--state-dir", str(env.state),
         "--backend", f"sim:{SKU}", "--metrics-port", "0", *extra],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.fixture(scope="module")
def crashed_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state directory `vgpu serve` leaves when it is killed (-9) holding twenty grants: a crash,
    nothing tidied on the way out. Made once by a real daemon; each test damages its own copy
    (`_crashed_copy`)."""
    env = make_env(tmp_path_factory.mktemp("crashed"))
    serve = Serve(env)
    client = Raw(env.sock)
    try:
        token = operator_token(env.state)
        for i in range(20):
            client.request(f"app{i % 4}", 100, token=token)
        serve.kill9()
    finally:
        client.close()
        serve.stop_now()
    return env.state


def _crashed_copy(crashed_state: Path, env: Env) -> None:
    """The crashed state directory as `env`'s own. The sockets the dead daemon left in its front
    directory cannot be copied (a socket is no file to read): the copy's front directory is left
    without them, which the next start handles as it handles stale ones."""
    def sockets(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if stat.S_ISSOCK(os.lstat(os.path.join(folder, n)).st_mode)]

    shutil.copytree(crashed_state, env.state, ignore=sockets)


@pytest.fixture(scope="module")
def stopped_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state directory `vgpu serve` leaves when it stops cleanly, with the simulated GPUs' saved
    settings (`sim-devices.json`). Made once by a real daemon; each test damages its own copy."""
    env = make_env(tmp_path_factory.mktemp("stopped"))
    serve = Serve(env)
    try:
        assert serve.term() == 0
    finally:
        serve.stop_now()
    return env.state


def _truncate(db: Path) -> None:
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2])


def _delete_a_row(db: Path) -> None:
    con = sqlite3.connect(db)
    con.execute("DELETE FROM grants WHERE rowid = (SELECT min(rowid) FROM grants)")
    con.commit()
    con.close()


@pytest.mark.parametrize("damage", [_truncate, _delete_a_row], ids=["truncated", "row-deleted"])
def test_damaged_state_is_refused_until_reset(env: Env, serves: list[Serve], client: Raw, damage: Any,
                                              crashed_state: Path) -> None:
    _crashed_copy(crashed_state, env)
    damage(env.state / "vgpu.sqlite3")
    failed = _serve_fails(env)
    assert failed.returncode == 2  # every start would fail alike: the unit does not restart it
    lines = [line for line in failed.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert len(lines) == 1 and "damaged" in lines[0] and str(env.state / "vgpu.sqlite3") in lines[0], failed.stderr
    assert "--reset-state" in lines[0] and "Traceback" not in failed.stderr
    serves.append(Serve(env, "--reset-state"))
    assert serves[-1].event("state_reset")["moved_to"].startswith(str(env.state / "vgpu.sqlite3.damaged-"))
    assert client.granted_mib() == 0
    assert serves[-1].term() == 0


@pytest.mark.parametrize("wal", ["deleted", "garbage"])
def test_a_lost_or_garbage_wal_loses_nothing(env: Env, serves: list[Serve], client: Raw, wal: str,
                                             crashed_state: Path) -> None:
    _crashed_copy(crashed_state, env)
    path = env.state / "vgpu.sqlite3-wal"
    if wal == "deleted":
        path.unlink(missing_ok=True)
    else:
        path.write_bytes(bytes(range(256)) * 16)
    serves.append(Serve(env))
    assert serves[-1].event("reconciled")["grants_restored"] == 20
    assert client.granted_mib() == 2000
    assert serves[-1].term() == 0


def test_removing_daemon_lock_does_not_let_a_second_daemon_in(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    (env.state / "daemon.lock").unlink()
    second = Env(env.tmp, env.tmp / "run2" / "vgpu.sock", env.state, env.env)  # same state, another socket
    failed = _serve_fails(second)
    assert failed.returncode == 1 and "another vgpu daemon is using the state directory" in failed.stderr
    assert serves[-1].term() == 0


@pytest.mark.parametrize("body", ["[]", '{"version": 1}', '{"version": 1, "devices": {"%s": {"power_limit_mw": "abc"}}}',
                                  '{"version": 1, "devices": {"%s": {}}}', "[" * 200_000 + "]" * 200_000,
                                  '{"version": 1' + "0" * 5000 + "}"],
                         ids=["list", "no-devices", "bad-power", "no-power", "nested-deep", "5001-digits"])
def test_damaged_simulated_device_settings_are_named_with_what_to_do(env: Env, serves: list[Serve], body: str,
                                                                    stopped_state: Path) -> None:
    """The simulated GPUs' saved settings (`sim-devices.json`) damaged by hand: the start said
    "AttributeError: 'list' object has no attribute 'get'" or "--backend: 'devices'"."""
    _crashed_copy(stopped_state, env)  # a clean stop leaves no socket, so this copies everything
    uuid = json.loads((env.state / "sim-devices.json").read_text())["devices"].popitem()[0]
    saved = env.state / "sim-devices.json"
    saved.write_text(body.replace("%s", uuid))
    failed = _serve_fails(env)
    assert failed.returncode == 2  # until the file is removed, as the line says
    (line,) = [line for line in failed.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert line.startswith(f"vgpu serve: {saved}: the simulated GPUs' saved settings cannot be used (")
    assert line.endswith("remove the file to start them with their defaults") and "--backend" not in line
    saved.unlink()
    serves.append(Serve(env))  # as the message says
