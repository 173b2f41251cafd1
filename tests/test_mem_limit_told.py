"""What an application is told about how its memory grant is enforced ("hard" or "cooperative") is
what is in force on its processes: the request's answer and every event agree, on a contended GPU
too, where the cap could not be written (no pid to cap, a driver without per-cgroup memory
limits) as much as where it was.

A real daemon (`Daemon`, what `vgpu serve` runs) on NVML over the fake pynvml, whose simulated GPU
has or lacks nvmlDeviceSetMemoryLimits_v1; an application written with the client stub, in its own
process; the operator's `vgpu request` makes the GPU contended."""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_fixtures import ROOT
from prometheus_client import CollectorRegistry

from vgpu import config
from vgpu import ctl as cli
from vgpu.allocator.mechanisms.limits import read_cgroup
from vgpu.daemon.serve import Daemon, SdNotifier
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import SimBackend

# The application: one request per line on stdin (MiB); after each it prints the kind the stub
# keeps (`memory_limit_kind`, the answer's), and every event its watch hears, with its kind.
APP = """
import sys, threading
from vgpu.client import VgpuClient
from vgpu.v1 import allocator_pb2 as pb

sock, inapp = sys.argv[1], sys.argv[2]
lock = threading.Lock()  # the watch thread prints too: one line at a time


def say(*words):
    with lock:
        print(*words, flush=True)


class Heard(VgpuClient):
    def handle_event(self, event):
        super().handle_event(event)
        say("event", pb.AllocationEvent.Kind.Name(event.kind), event.mem_limit or "-", int(event.grant.memory_mib))


with Heard("told", socket=sock, inapp_dir=inapp) as client:
    for line in sys.stdin:
        client.request(memory_mib=float(line))
        say("reply", client.memory_limit_kind, int(float(line)))
"""


@dataclass
class Node:
    daemon: Daemon
    sim: SimBackend
    inapp: Path
    env: dict[str, str]


@pytest.fixture
async def node(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Node]:
    # the driver's cgroup limits supported, and (when given) whether the socket's front reads callers' uids
    supported, front = (request.param, True) if isinstance(request.param, bool) else request.param
    cfg = config.load(None, env={}, overrides={
        "server.socket": str(tmp_path / "v.sock"), "server.state_dir": str(tmp_path / "state"),
        "server.inapp_dir": str(tmp_path / "inapp"), "server.backend": "nvml", "server.dry_run": False,
        "metrics.port": 0, "server.grace_s": 0.0, "server.peer_credentials": front,
    })
    sim = SimBackend(["h100-80gb"], memory_limits=supported)
    d = Daemon(cfg, notifier=SdNotifier(env={}), registry=CollectorRegistry(), backend=NvmlBackend(nvml=FakePynvml(sim)))
    await d.start()
    try:
        yield Node(d, sim, tmp_path / "inapp", {"XDG_CONFIG_HOME": str(tmp_path / "cfg")})
    finally:
        await d.stop("test")


class App:
    """The application's process, its output lines read into a queue as they come."""

    def __init__(self, node: Node, inapp: Path, log: Path) -> None:
        env = {**os.environ, **node.env}  # its token kept beside the operator's, not in the user's home
        with log.open("w") as err:  # the stub logs to stderr
            self.proc = subprocess.Popen([sys.executable, "-u", "-c", APP, str(node.daemon.socket_path), str(inapp)],
                                         cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    async def request(self, mib: int, *, event: bool = True) -> list[str]:
        """Ask for `mib`; every line up to its answer and its own GRANTED event, which comes before
        or after the answer. Without `event` (the first request may come before the watch is live),
        the event is waited for only 5 s."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{mib}\n")
        self.proc.stdin.flush()
        out: list[str] = []

        def heard() -> bool:
            return any(x.startswith("event GRANTED") and x.endswith(f" {mib}") for x in out)

        while not (heard() and any(x.startswith("reply") for x in out)):
            answered = any(x.startswith("reply") for x in out)
            try:
                out.append(await asyncio.to_thread(self.lines.get, True, 5 if answered and not event else 30))
            except queue.Empty:
                if answered and not event:
                    break
                raise AssertionError(f"no answer or event for {mib} MiB in 30 s; heard {out}") from None
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _kinds(lines: list[str]) -> list[str]:
    """The kinds the application heard, in order: each answer's ("reply KIND MIB") and each event's
    ("event EVENT KIND MIB"; "-" for an event of no device, which says none)."""
    kinds = [x.split()[1] if x.startswith("reply") else x.split()[2] for x in lines]
    return [k for k in kinds if k != "-"]


async def _operator(node: Node, *argv: str) -> dict[str, object]:
    out = io.StringIO()
    rc = await asyncio.to_thread(cli.request_main, ["--socket", str(node.daemon.socket_path), "--json", *argv],
                                 "vgpu request", out=out, env=node.env)
    assert rc == 0
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


async def _apps(node: Node) -> dict[str, dict[str, str]]:
    out = io.StringIO()
    rc = await asyncio.to_thread(cli.apps_main, ["--socket", str(node.daemon.socket_path), "--json"], "vgpu apps",
                                 out=out, env=node.env)
    assert rc == 0
    return {a["app_id"]: a for a in json.loads(out.getvalue())["apps"]}


@pytest.mark.parametrize(("node", "pid_proven", "after"), [
    pytest.param(True, True, "hard", id="capped"),
    pytest.param(False, True, "cooperative", id="driver-without-cgroup-limits"),
    # the stub cannot write the report that proves its pid, and the daemon cannot tell its uid (the
    # front off, as over TCP): its requests name no process to cap
    pytest.param((True, False), False, "cooperative", id="no-pid-to-cap"),
], indirect=["node"])
async def test_the_answer_and_every_event_say_what_is_in_force(node: Node, tmp_path: Path, pid_proven: bool,
                                                               after: str) -> None:
    if read_cgroup(os.getpid()) is None:
        pytest.skip("no readable /proc/<pid>/cgroup here")
    (tmp_path / "blocker").write_text("a file where the stub's in-app directory would be")
    app = App(node, node.inapp if pid_proven else tmp_path / "blocker" / "inapp", tmp_path / "app.log")
    try:
        first = await app.request(1024, event=False)
        assert set(_kinds(first)) == {"cooperative"}, first  # 1 GiB of 80: uncontended

        total = node.daemon.allocator.ledger.devices()[0].mem_total_mib
        await _operator(node, "--app", "big", "--memory-mib", str(int(0.95 * total) - 2048))
        # what it hears from here: the change, if any, then its second request's answer and event
        second = await app.request(512)
        assert set(_kinds(second)) == {after}, second
        told = (await _apps(node))["told"]
        assert told["mem_limit"] == after, told
        assert told["mem_limit_reason"].startswith("contended"), told
        caps = node.sim.devices()[0].memory_limits()
        assert (any(h == 1536.0 for _, h in caps.values())) == (after == "hard"), caps  # 1024 + 512 MiB
    finally:
        app.close()


@pytest.mark.parametrize("node", [True], indirect=True)
async def test_a_cgroup_already_at_the_grant_s_cap_is_hard_without_a_write(node: Node, tmp_path: Path) -> None:
    """The application's cgroup already holds exactly the cap its grants come to (an operator's
    limit): that limit is in force, so it is told "hard", not that writing the cap failed, and
    nothing is written."""
    cgroup = read_cgroup(os.getpid())
    if cgroup is None:
        pytest.skip("no readable /proc/<pid>/cgroup here")
    dev = node.sim.devices()[0]
    dev.set_memory_limit_mib(cgroup, 1536, 1536)  # set before the daemon's grants
    app = App(node, node.inapp, tmp_path / "app.log")
    try:
        first = await app.request(1536, event=False)
        assert set(_kinds(first)) == {"cooperative"}, first  # uncontended
        writes = dev.writes
        total = node.daemon.allocator.ledger.devices()[0].mem_total_mib
        await _operator(node, "--app", "big", "--memory-mib", str(int(0.95 * total) - 2048))  # contended now
        told = (await _apps(node))["told"]
        assert told["mem_limit"] == "hard" and "writing it failed" not in told["mem_limit_reason"], told
        assert dev.writes == writes and dev.memory_limits()[cgroup] == (1536, 1536)
    finally:
        app.close()
