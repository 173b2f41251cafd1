"""Grants go within seconds of the exit of the process they name (`server.exit_release_s`,
`Allocator.release_exited`), not `server.idle_release_s` later: a client-stub application killed with
SIGKILL against a real `vgpu serve`, and the allocator's rules (pid reuse, a pid the daemon never saw,
several processes of one application, the grace, a store that fails, a stopping daemon) with a fake
`process_start`."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from daemon_fixtures import ROOT, Env, Serve

from vgpu.allocator.core import AllocationRequest, Allocator
from vgpu.allocator.errors import StateNotSaved
from vgpu.allocator.ledger import Ledger
from vgpu.device.sim import SimBackend
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

# An application as its user writes it: it requests a grant, says so, and trains until it is killed.
HOLD = """
import sys, time
from vgpu.client import VgpuClient

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]
client = VgpuClient(app_id, socket=sock, inapp_dir=inapp)
grant = client.request(memory_mib=float(sys.argv[4]))
print("granted", grant.grant_id, flush=True)
while True:
    time.sleep(1)
"""


def start_app(env: Env, app_id: str, inapp: Path, memory_mib: int) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(env.sock), app_id, str(inapp), str(memory_mib)],
                         cwd=ROOT, env=env.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith("granted"):
        p.kill()
        raise AssertionError(line + (p.stderr.read() if p.stderr else ""))
    return p, line.split()[1]


def grants_of(env: Env, app_id: str) -> list[dict]:  # type: ignore[type-arg]
    listed = {a["app_id"]: a for a in env.json("apps", "--all").get("apps", [])}
    return listed.get(app_id, {}).get("grants", [])  # type: ignore[no-any-return]


def wait_until(pred, timeout_s: float = 30.0) -> float:  # type: ignore[no-untyped-def]
    """Seconds until `pred()` held."""
    started = time.monotonic()
    while not pred():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.2)
    return time.monotonic() - started


class Watcher:
    """Every allocation event of the node, as an operator's `WatchAllocations` hears them."""

    def __init__(self, env: Env) -> None:
        self.events: list[pb.AllocationEvent] = []
        self._channel = grpc.insecure_channel(f"unix:{env.sock}")
        self._watch = pb_grpc.AllocatorStub(self._channel).WatchAllocations(pb.WatchAllocationsRequest(), timeout=120)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for e in self._watch:
                self.events.append(e)
        except grpc.RpcError:
            pass

    def released(self, app_id: str) -> list[pb.AllocationEvent]:
        return [e for e in self.events if e.kind == pb.AllocationEvent.RELEASED and e.grant.app_id == app_id]

    def close(self) -> None:
        self._watch.cancel()
        self._channel.close()


def kill(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def test_a_killed_application_s_grant_goes_within_seconds_and_a_live_one_stays(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)  # where the daemon reads the stub's proof of its pid
    env.env["VGPU_SERVER_EXIT_RELEASE_S"] = "2"  # idle_release_s stays 120 s
    serve = Serve(env)
    serves.append(serve)
    watcher = Watcher(env)
    crashed, crashed_grant = start_app(env, "train-crash", inapp, 3000)
    alive, alive_grant = start_app(env, "train-alive", inapp, 1000)
    try:
        pid = crashed.pid
        time.sleep(1.0)  # the stubs' watches are open
        crashed.send_signal(signal.SIGKILL)  # no close(), no release
        crashed.wait(10)
        took_s = wait_until(lambda: not grants_of(env, "train-crash"))
        assert took_s < 20.0  # far below idle_release_s (120 s)
        wait_until(lambda: bool(watcher.released("train-crash")))
        (event,) = watcher.released("train-crash")
        assert event.grant.grant_id == crashed_grant and event.detail == f"its process {pid} exited"
        logged = serve.event("app_released_exited")
        assert logged["app"] == "train-crash" and logged["pids"] == [pid] and logged["memory_mib"] == 3000
        assert logged["grants"] == [crashed_grant]
        # the other application's process still runs: its grant is untouched, and the GPU counts it alone
        assert [g["grant_id"] for g in grants_of(env, "train-alive")] == [alive_grant]
        assert not watcher.released("train-alive")
        assert env.json("available")["devices"][0]["mem_granted_mib"] == 1000
        assert alive.poll() is None
    finally:
        watcher.close()
        kill(crashed, alive)


def test_with_exit_release_off_a_killed_application_s_grant_waits_for_the_idle_release(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    env.env["VGPU_SERVER_EXIT_RELEASE_S"] = "0"
    serve = Serve(env)
    serves.append(serve)
    crashed, grant_id = start_app(env, "train-kept", inapp, 2000)
    try:
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(10)
        # two sweeps (every 5 s at most) that come more than the default grace (5 s) after the kill: a
        # 0 read as the default would release it by then
        time.sleep(10.5)
        assert [g["grant_id"] for g in grants_of(env, "train-kept")] == [grant_id]
        assert not [e for e in serve.events() if e.get("event") == "app_released_exited"]
    finally:
        kill(crashed)


# --- the allocator's rules, with a fake clock and a fake process table ----------------------------------
class Procs:
    """pid -> when its process started (Unix seconds); a pid not listed has no process here."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.looked: list[int] = []

    def __call__(self, pid: int) -> float | None:
        self.looked.append(pid)
        return self.started.get(pid)


def make(now: list[float]) -> tuple[Allocator, Procs]:
    alloc = Allocator(SimBackend(["h100-80gb"]), clock=lambda: now[0], dry_run=False)
    procs = Procs()
    alloc.process_start = procs
    return alloc, procs


def request(alloc: Allocator, app_id: str, pid: int, memory_mib: float = 100.0) -> str:
    return alloc.request_allocation(AllocationRequest(app_id=app_id, memory_mib=memory_mib, pid=pid)).grant_id


def held(alloc: Allocator, app_id: str | None = None) -> list[str]:
    return sorted(g.grant_id for g in alloc.ledger.grants(app_id=app_id))


def test_an_exited_process_s_grants_go_after_the_grace_and_a_grant_without_a_pid_stays() -> None:
    now = [1000.0]
    alloc, procs = make(now)
    procs.started[4242] = 990.0
    gone = [request(alloc, "train", 4242, 100.0), request(alloc, "train", 4242, 200.0)]
    lease = request(alloc, "train", 0)  # no pid: the idle release alone is for it
    del procs.started[4242]
    now[0] = 1001.0  # a request 1 s ago: within the grace, something of it may still talk
    assert alloc.release_exited(5.0) == []
    now[0] = 1006.0
    procs.looked.clear()
    assert sorted(alloc.release_exited(5.0)) == sorted(gone)
    assert procs.looked == [4242]  # one look per distinct pid, however many grants name it
    assert held(alloc) == [lease]
    assert alloc.counters.grant_changes[("released", "exited")] == 2
    assert alloc.counters.released == 2


def test_a_pid_taken_over_by_a_newer_process_counts_as_exited() -> None:
    now = [1000.0]
    alloc, procs = make(now)
    procs.started[4242] = 990.0
    grant_id = request(alloc, "train", 4242)
    now[0] = 1100.0
    assert alloc.release_exited(5.0) == []  # still the grant's process
    events: list[str] = []

    async def run() -> list[str]:
        sub = alloc.watch()
        try:
            procs.started[4242] = 1050.0  # it exited, and a process started after the grant took its pid
            out = alloc.release_exited(5.0)
            events.extend(e.detail for e in sub.drain_nowait())
            return out
        finally:
            sub.close()

    assert asyncio.run(run()) == [grant_id]
    assert events == ["its process 4242 exited (pid 4242 is now another process's, started after the grant)"]


def test_a_step_of_the_wall_clock_does_not_pass_a_live_process_for_a_new_one() -> None:
    """The wall clock stepped back 30 s (NTP) between a process's start and its request: the grant was
    made at a time before the process's start as the kernel reports it. The process proved itself by
    its request, so it is the grant's, and it keeps its grant while it runs; it is released once it
    exits, and a later process at its pid is still told apart."""
    now = [1000.0]
    alloc, procs = make(now)
    procs.started[4242] = 1010.0  # started 10 s "after" the grant's time: the clock went back after it
    grant_id = request(alloc, "train", 4242)
    now[0] = 1100.0
    assert alloc.release_exited(5.0) == [] and held(alloc) == [grant_id]
    assert alloc.last_seen_s("train") == 1100.0  # its running process is its sign of life
    procs.started[4242] = 1090.0  # another process took the pid over
    assert alloc.release_exited(5.0) == [grant_id]


def test_a_process_the_daemon_never_saw_is_left_to_the_idle_release() -> None:
    # a process in another pid namespace: its pid means nothing here, so "no such process" proves nothing
    now = [1000.0]
    alloc, procs = make(now)
    grant_id = request(alloc, "contained", 77)
    now[0] = 1050.0
    assert alloc.release_exited(5.0) == []
    assert held(alloc) == [grant_id]
    now[0] = 1200.0
    assert alloc.release_vanished(120.0) == ["contained"]  # the idle release still applies


def test_a_process_seen_at_a_sweep_counts_too() -> None:
    # a grant restored after a restart, or one whose process was not yet readable at its making
    now = [1000.0]
    alloc, procs = make(now)
    grant_id = request(alloc, "late", 88)
    procs.started[88] = 995.0
    assert alloc.release_exited(5.0) == []
    del procs.started[88]
    now[0] = 1010.0
    assert alloc.release_exited(5.0) == [grant_id]


def test_of_several_processes_only_the_exited_one_s_grants_go_and_the_last_waits_for_its_watch() -> None:
    now = [1000.0]
    alloc, procs = make(now)
    procs.started.update({11: 990.0, 12: 990.0})
    rank0, rank1 = request(alloc, "ranks", 11), request(alloc, "ranks", 12)
    now[0] = 1001.0

    async def run() -> None:
        sub = alloc.watch("ranks")  # rank 0's stub watches its application's grants
        del procs.started[12]
        # rank 0 still runs: rank 1's grant is nobody's now, so it goes at once, the watch notwithstanding
        assert alloc.release_exited(5.0) == [rank1]
        del procs.started[11]
        now[0] = 1100.0
        # no process of it left in sight, yet a watch of its own is open: something of it lives
        assert alloc.release_exited(5.0) == []
        sub.close()
        assert alloc.release_exited(5.0) == [rank0]

    asyncio.run(run())
    assert held(alloc) == []


def test_a_signature_within_the_grace_keeps_the_grants() -> None:
    now = [1000.0]
    alloc, procs = make(now)
    signed = {"streamed": 1000.0}
    alloc.signature_seen = signed.get
    procs.started[5] = 990.0
    grant_id = request(alloc, "streamed", 5)
    del procs.started[5]
    now[0] = 1010.0
    signed["streamed"] = 1008.0  # a sample still on its way
    assert alloc.release_exited(5.0) == []
    now[0] = 1014.0
    assert alloc.release_exited(5.0) == [grant_id]


def test_a_release_that_cannot_be_stored_keeps_its_grant_until_the_next_sweep() -> None:
    now = [1000.0]
    alloc, procs = make(now)
    procs.started.update({1: 990.0, 2: 990.0})
    first, second = request(alloc, "a-full-disk", 1), request(alloc, "b-after", 2)
    disk_full = [True]

    def store(ledger: Ledger) -> None:
        if disk_full[0] and first in ledger.changes().grants_removed:
            raise StateNotSaved("database or disk is full")
        ledger.commit_changes()

    alloc.on_change = store
    procs.started.clear()
    now[0] = 1010.0
    assert alloc.release_exited(5.0) == [second]
    assert held(alloc) == [first]
    disk_full[0] = False
    assert alloc.release_exited(5.0) == [first]


@pytest.mark.parametrize("how", ["stopping", "off"])
def test_nothing_goes_once_stopping_or_with_the_rule_off(how: str) -> None:
    now = [1000.0]
    alloc, procs = make(now)
    procs.started[3] = 990.0
    grant_id = request(alloc, "train", 3)
    procs.started.clear()
    now[0] = 1100.0
    if how == "stopping":
        alloc.refuse_changes()
    assert alloc.release_exited(0.0 if how == "off" else 5.0) == []
    assert held(alloc) == [grant_id]


def test_the_real_process_table_knows_this_process_and_not_a_free_pid() -> None:
    from vgpu.allocator.core import _process_start

    started = _process_start(os.getpid())
    assert started is not None and started <= time.time()
    assert _process_start(2**22 + 1) is None  # above the kernel's pid_max: never a process


def test_a_change_the_daemon_makes_to_the_grant_after_the_exit_does_not_hold_it() -> None:
    # the idle release counts any change to a grant as a sign of life (a cut to an operator's limit, a
    # plan's resize of a cold-start grant when another application's plan runs on its GPU); the exit
    # release asks only whether the process runs
    from vgpu.allocator.ledger import AppLimits

    now = [1000.0]
    alloc, procs = make(now)
    procs.started[9] = 990.0
    grant_id = request(alloc, "cut", 9, 1000.0)
    del procs.started[9]
    now[0] = 1010.0
    alloc.set_limits(AppLimits(app_id="cut", max_memory_mib=500.0))
    assert alloc.ledger.grants(app_id="cut")[0].updated_at_s == 1010.0
    assert alloc.release_exited(5.0) == [grant_id]
