"""A process that declares its job again (a retry, a call per epoch, a helper called twice) holds one
cold-start grant for it, not one per call: the request is answered with the grant it holds
(`Allocator.allocate`, `Allocated.held`), as it stands, and nothing changes; a job of its own gets
a grant of its own; a new process, or one that took the pid over, gets a new one. The grant's job
(`Grant.job_digest`) is stored, so a restarted daemon answers the same way. A refusal of a
cold-start size names the job and says the figure is its size (peak + margin)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_fixtures import ROOT, Env, Serve, metric_samples
from structlog.testing import capture_logs

from vgpu.allocator.core import AllocationRequest, Allocator, EventKind
from vgpu.allocator.errors import InsufficientResources, PermissionDenied
from vgpu.allocator.ledger import Ledger
from vgpu.allocator.policy.base import Sizing
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.jobs import JobConfig

JOB = JobConfig(model_type="resnet50", batch_size=64, optimizer="sgd")
ME = os.getpid()  # a process that runs: the grant's process is checked as the daemon checks it


class _Sizer:
    """Sizes every job at `mib` and 30 % SM."""

    def __init__(self, mib: float = 12_000.0) -> None:
        self.mib = mib

    def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
        return Sizing(self.mib, 30.0, "test")


def _rig(gpus: int = 1, *, mib: float = 12_000.0, ledger: Ledger | None = None) -> Allocator:
    clock = ManualClock(time.time())  # the grants' times and the processes' start times on one clock
    return Allocator(SimBackend(["h100-80gb"] * gpus, clock=clock), clock=clock, sizer=_Sizer(mib), ledger=ledger)


def test_the_same_job_from_the_same_process_is_answered_with_the_grant_it_holds() -> None:
    allocator = _rig()
    everyone = allocator.watch()
    with capture_logs() as logs:
        first = allocator.allocate(AllocationRequest("a", job=JOB, pid=ME), caller="a")
        again = [allocator.allocate(AllocationRequest("a", job=j, pid=ME), caller="a")
                 for j in (JOB, JOB, JobConfig(model_type="resnet50", batch_size=64, optimizer="sgd", precision=" FP32"),
                           # the model's name as the sizer reads it: case and spaces aside
                           JobConfig(model_type=" ResNet50", batch_size=64, optimizer="SGD"))]
    assert not first.held and all(a.held and a.grant == first.grant for a in again)
    assert allocator.ledger.grants(app_id="a") == [first.grant]
    assert allocator.counters.cold_start_reused == 4 and allocator.counters.granted == 1
    assert [e.kind for e in everyone.drain_nowait()] == [EventKind.GRANTED]  # nothing changed since
    reused = [r for r in logs if r["event"] == "cold_start_reused"]
    assert len(reused) == 1 and reused[0]["grant"] == first.grant.grant_id, reused  # once per grant
    assert reused[0]["job"] == "resnet50, batch 64"
    assert [r["event"] for r in logs].count("cold_start_sized") == 1  # the held grant is not sized again


@pytest.mark.parametrize("other", [
    AllocationRequest("a", job=JobConfig(model_type="resnet50", batch_size=32, optimizer="sgd"), pid=ME),
    AllocationRequest("a", job=JobConfig(model_type="resnet50", batch_size=64, optimizer="adam"), pid=ME),
    AllocationRequest("a", job=JOB, pid=0),  # no process named: nothing says it is the same one
    AllocationRequest("a", job=JOB, pid=ME + 1),  # another process of the application
    AllocationRequest("a", job=JOB, pid=ME, uid=4242),  # another uid's share
    AllocationRequest("b", job=JOB, pid=ME),  # another application
    AllocationRequest("a", memory_mib=500, job=JOB, pid=ME),  # asks for a size of its own: a request grant
], ids=["other-batch", "other-optimizer", "no-pid", "other-pid", "other-uid", "other-app", "sized-by-the-app"])
def test_anything_but_the_same_job_of_the_same_process_is_a_new_grant(other: AllocationRequest) -> None:
    allocator = _rig()
    first = allocator.request_allocation(AllocationRequest("a", job=JOB, pid=ME), caller="a")
    got = allocator.allocate(other, caller=other.app_id)
    assert not got.held and got.grant.grant_id != first.grant_id
    assert len(allocator.ledger.grants()) == 2 and allocator.counters.cold_start_reused == 0


def test_a_process_that_took_the_pid_over_or_another_device_gets_a_grant_of_its_own() -> None:
    allocator = _rig(gpus=2)
    first = allocator.request_allocation(AllocationRequest("a", job=JOB, pid=ME), caller="a")
    other_gpu = next(d.device_id for d in allocator.ledger.devices() if d.device_id != first.device_id)
    assert not allocator.allocate(AllocationRequest("a", job=JOB, pid=ME, device_id=other_gpu), caller="a").held
    assert allocator.allocate(AllocationRequest("a", job=JOB, pid=ME, device_id=first.device_id), caller="a").held
    started = allocator.process_start(ME)
    assert started is not None
    allocator.process_start = lambda _pid: started + 3600.0  # the pid's process now started after the grant
    assert not allocator.allocate(AllocationRequest("a", job=JOB, pid=ME), caller="a").held
    assert len(allocator.ledger.grants(app_id="a")) == 3


def test_another_applications_caller_is_refused_not_answered_with_the_grant() -> None:
    allocator = _rig()
    allocator.request_allocation(AllocationRequest("a", job=JOB, pid=ME), caller="a")
    with pytest.raises(PermissionDenied):
        allocator.allocate(AllocationRequest("a", job=JOB, pid=ME), caller="intruder")
    assert allocator.counters.cold_start_reused == 0


def test_a_restored_ledger_answers_with_the_grant_as_before() -> None:
    before = _rig()
    first = before.request_allocation(AllocationRequest("a", job=JOB, pid=ME), caller="a")
    assert first.job_digest is not None
    records = json.loads(json.dumps(before.ledger.to_records()))  # as stored: through JSON
    restored = Ledger.from_records(records, devices=before.ledger.devices())
    after = _rig(ledger=restored)
    got = after.allocate(AllocationRequest("a", job=JOB, pid=ME), caller="a")
    assert got.held and got.grant == first


def test_a_refused_cold_start_size_names_the_job_and_its_size() -> None:
    allocator = _rig(mib=149_384_551_978.0)
    job = JobConfig(model_type="resnet50", batch_size=10**9)
    with pytest.raises(InsufficientResources) as refused:
        allocator.request_allocation(AllocationRequest("a", job=job, pid=ME), caller="a")
    said = str(refused.value)
    assert said.startswith("the job (resnet50, batch 1000000000) was sized at 149,384,551,978 MiB (peak + margin): "
                           "does not fit on GPU-"), said
    assert "e+" not in said, said
    assert allocator.ledger.grants() == []


# An application that declares its job, again and again, holds across a restart of the daemon, and
# is refused a job that cannot fit; one JSON line per step.
APP = """
import json, sys
import grpc
from vgpu.client import VgpuClient
from vgpu.jobs import JobConfig

sock, app_id, inapp = sys.argv[1], sys.argv[2], sys.argv[3]

def show(tag, grant):
    print(json.dumps({"tag": tag, "grant_id": grant.grant_id, "source": grant.source,
                      "created_at_s": grant.created_at_s, "held": sorted(g.grant_id for g in client.grants)}),
          flush=True)

job = JobConfig(model_type="resnet50", batch_size=64, optimizer="sgd")
with VgpuClient(app_id, socket=sock, inapp_dir=inapp, job=job) as client:
    for i in range(3):
        show(f"same-{i}", client.request())
    show("other", client.request(job=JobConfig(model_type="resnet50", batch_size=32, optimizer="sgd")))
    sys.stdin.readline()  # the daemon was restarted
    show("after-restart", client.request())
    try:
        client.request(job=JobConfig(model_type="resnet50", batch_size=10**9))
    except grpc.RpcError as exc:
        print(json.dumps({"tag": "refused", "code": exc.code().name, "details": exc.details()}), flush=True)
print(json.dumps({"tag": "closed"}), flush=True)
"""


def _line(app: subprocess.Popen[str]) -> dict:  # type: ignore[type-arg]
    assert app.stdout is not None
    line = app.stdout.readline()
    assert line, app.stderr.read() if app.stderr is not None else "no output"
    return json.loads(line)  # type: ignore[no-any-return]


def _grants(env: Env, app_id: str) -> list[str]:
    apps = {a["app_id"]: a for a in env.json("apps").get("apps", [])}
    return sorted(g["grant_id"] for g in apps.get(app_id, {}).get("grants", []))


def test_the_stub_declaring_its_job_again_holds_one_grant_across_a_restart(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)
    serves.append(Serve(env, "--metrics-port", "auto"))
    app = subprocess.Popen([sys.executable, "-c", APP, str(env.sock), "twice", str(inapp)], cwd=ROOT, env=env.env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        same = [_line(app) for _ in range(3)]
        mine = same[0]["grant_id"]
        assert {s["grant_id"] for s in same} == {mine} and {s["created_at_s"] for s in same} == {same[0]["created_at_s"]}
        assert all(s["source"] == "cold_start" and s["held"] == [mine] for s in same), same
        other = _line(app)
        assert other["grant_id"] != mine and other["held"] == sorted([mine, other["grant_id"]])
        assert _grants(env, "twice") == other["held"]  # two jobs, two grants; not four
        daemon = serves[-1]
        reused = [e for e in daemon.events() if e.get("event") == "cold_start_reused"]
        assert [e["grant"] for e in reused] == [mine], reused  # logged once for two answers
        assert metric_samples(daemon.metrics_port)[("vgpu_cold_start_reused_total", ())] == 2
        assert daemon.term() == 0
        serves.append(Serve(env))  # the same state directory: the grants and their jobs are restored
        assert app.stdin is not None
        app.stdin.write("go\n")
        app.stdin.flush()
        after = _line(app)
        assert after["grant_id"] == mine and after["created_at_s"] == same[0]["created_at_s"], after
        assert _grants(env, "twice") == other["held"]
        refused = _line(app)
        assert refused["code"] == "RESOURCE_EXHAUSTED", refused
        assert re.match(r"the job \(resnet50, batch 1000000000\) was sized at \d{1,3}(,\d{3})+ MiB "
                        r"\(peak \+ margin\): does not fit on GPU-", refused["details"]), refused
        assert _line(app)["tag"] == "closed"
        assert app.wait(30) == 0
        assert _grants(env, "twice") == []  # leaving the block released both
        assert app.stderr is not None
        said = app.stderr.read()
        # the stub says so, once for its grant however often the daemon answered with it
        assert said.count("this process already holds a cold-start grant for this job") == 1, said
        assert mine in said
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)


def test_vgpu_request_for_a_process_that_holds_its_jobs_grant_says_it_is_held(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    worker = subprocess.Popen(["sleep", "60"])  # the application's process, named with --pid
    try:
        def request(*job: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "vgpu.cli", "request", "--socket", str(env.sock), "--app",
                                   "cli-twice", "--pid", str(worker.pid), "--model-type", "resnet50", *job],
                                  cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=60)

        first, again = request("--batch-size", "64"), request("--batch-size", "64")
        assert first.returncode == again.returncode == 0, first.stderr + again.stderr
        grant_id = first.stdout.split()[1].rstrip(":")
        assert first.stdout.startswith(f"granted {grant_id}: ") and "already held" not in first.stdout
        assert again.stdout.startswith(f"held {grant_id}: "), again.stdout
        assert again.stdout.rstrip().endswith("(already held by this process for this job: no second grant)")
        other = request("--batch-size", "32")
        assert other.stdout.startswith("granted ") and grant_id not in other.stdout, other.stdout
        assert len(_grants(env, "cli-twice")) == 2
        refused = request("--batch-size", str(10**9))
        assert refused.returncode == 1 and "RESOURCE_EXHAUSTED: the job (resnet50, batch 1000000000) was sized at " in \
            refused.stderr, refused.stderr
    finally:
        worker.kill()
        worker.wait(10)
