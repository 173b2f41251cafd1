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
import shutil
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest
from daemon_fixtures import ROOT, SKU, Env, Serve, make_env
from hostile import Raw, operator_token

from vgpu import auth, ctl
from vgpu.daemon.serve import Daemon
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc


class _FullDisk:
    """A SQLite connection whose writes fail as on a full disk while `full` is set."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.full = True

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if self.full and sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)




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
        disk = _FullDisk(daemon.store._db)
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
