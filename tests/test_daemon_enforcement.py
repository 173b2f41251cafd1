"""Hard or cooperative memory limits, and the cold-start size at start-up, as users meet them: a real
`vgpu serve` on the simulated GPU, driven by the operator CLI, the client stub and `vgpu profiler
--replay`. The simulated device keeps its per-cgroup memory limits in the state directory, which is
how these tests see what the daemon wrote."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from daemon_fixtures import ROOT, SKU, Env, Serve, sim_daemon

from vgpu.allocator.core import AllocationRequest
from vgpu.allocator.mechanisms.limits import read_cgroup
from vgpu.allocator.policy.forecast import PREDICTIVE_CONFIG
from vgpu.traces import AppTrace, write_trace


def _limits(env: Env) -> dict[str, list[float]]:
    (dev,) = json.loads((env.state / "sim-devices.json").read_text())["devices"].values()
    return dict(dev.get("memory_limits_mib", {}))


def _apps(env: Env) -> dict[str, dict]:  # type: ignore[type-arg]
    return {a["app_id"]: a for a in env.json("apps").get("apps", [])}


@pytest.fixture
def sleeper() -> Iterator[tuple[int, str]]:
    """A process standing in for an application, with the cgroup the daemon would cap."""
    app = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        cgroup = read_cgroup(app.pid)
        if cgroup is None:
            pytest.skip("no readable /proc/<pid>/cgroup here")
        yield app.pid, cgroup
    finally:
        app.kill()
        app.wait(10)


def test_limits_are_cooperative_on_a_free_gpu_and_hard_while_it_is_contended(
        env: Env, serves: list[Serve], sleeper: tuple[int, str]) -> None:
    pid, cgroup = sleeper
    serves.append(Serve(env))
    env.json("request", "--app", "job1", "--memory-mib", "2048", "--pid", str(pid),
             "--state-dir", str(env.state))  # naming a pid needs the operator token
    assert _limits(env) == {}  # a free GPU: no cap; the application keeps to its grant itself
    job1 = _apps(env)["job1"]
    assert job1["mem_limit"] == "cooperative" and job1["mem_limit_reason"].startswith("uncontended")
    assert "cooperative" in env.vgpu("apps", "--socket", str(env.sock)).stdout

    # a second application takes the GPU to 95 % of its memory: contended, the cap goes on
    total = env.json("available")["devices"][0]["mem_total_mib"]
    big = env.json("request", "--app", "big", "--memory-mib", str(int(0.95 * total) - 2048))
    assert _limits(env)[cgroup] == [2048.0, 2048.0]
    job1 = _apps(env)["job1"]
    assert job1["mem_limit"] == "hard" and job1["mem_limit_reason"].startswith("contended")
    assert serves[-1].event("memory_limits_hard")["device"] == big["device_id"]

    # it leaves: the cap is lifted (the cgroup's original, no limit, written back)
    env.vgpu("release", "--socket", str(env.sock), "--grant", big["grant_id"])
    assert _limits(env) == {}
    assert _apps(env)["job1"]["mem_limit"] == "cooperative"
    assert serves[-1].event("memory_limits_cooperative")["device"] == big["device_id"]
    assert serves[-1].term() == 0


def test_hard_memory_limits_always_caps_a_free_gpu_too(env: Env, serves: list[Serve], sleeper: tuple[int, str]) -> None:
    """The operator's setting that turns the rule off: every known pid is capped at its grant."""
    pid, cgroup = sleeper
    env.env["VGPU_SERVER_HARD_MEMORY_LIMITS"] = "always"
    serves.append(Serve(env))
    env.json("request", "--app", "job1", "--memory-mib", "2048", "--pid", str(pid), "--state-dir", str(env.state))
    assert _limits(env)[cgroup] == [2048.0, 2048.0]
    assert _apps(env)["job1"]["mem_limit"] == "hard"
    assert serves[-1].term() == 0


# The program an application writes with the client stub: it asks for 2 GiB and prints how its limit
# is enforced each time that changes, for at most a minute (the test kills it sooner).
APP = """
import sys, time
from vgpu.client import VgpuClient

sock, inapp = sys.argv[1], sys.argv[2]
with VgpuClient("stub-app", socket=sock, inapp_dir=inapp) as client:
    client.request(memory_mib=2048)
    seen = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if client.memory_limit_kind != seen:
            seen = client.memory_limit_kind
            print("limit", seen, flush=True)
        time.sleep(0.05)
"""


def _next_limit(out: IO[str]) -> str:
    """The next kind the program prints (its stub logs to the same stream); "" when it exits."""
    for line in out:
        if line.startswith("limit "):
            return line.split()[1]
    return ""


def test_the_client_stub_is_told_when_its_limit_turns_hard(env: Env, serves: list[Serve], tmp_path: Path) -> None:
    inapp = tmp_path / "inapp"
    env.env["VGPU_SERVER_INAPP_DIR"] = str(inapp)  # where the daemon reads the stub's proof of its pid
    serves.append(Serve(env))
    app = subprocess.Popen([sys.executable, "-u", "-c", APP, str(env.sock), str(inapp)], cwd=ROOT, env=env.env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert app.stdout is not None
        assert _next_limit(app.stdout) == "cooperative"
        total = env.json("available")["devices"][0]["mem_total_mib"]
        big = env.json("request", "--app", "big", "--memory-mib", str(int(0.95 * total) - 2048))
        assert _next_limit(app.stdout) == "hard"
        env.vgpu("release", "--socket", str(env.sock), "--grant", big["grant_id"])
        assert _next_limit(app.stdout) == "cooperative"
    finally:
        app.kill()
        app.wait(10)
    assert serves[-1].term() == 0


def _request_sized(env: Env, app_id: str, batch_size: int = 64) -> dict:  # type: ignore[type-arg]
    """`vgpu request` with the job's configuration and no memory: the cold-start model sizes it (it
    loads in the background for a few seconds after start: UNAVAILABLE until then)."""
    deadline = time.monotonic() + 120
    while True:
        r = env.vgpu("request", "--socket", str(env.sock), "--json", "--app", app_id, "--model-type", "resnet50",
                     "--batch-size", str(batch_size), "--input-size", "224", check=False)
        if r.returncode == 0:
            return json.loads(r.stdout)  # type: ignore[no-any-return]
        assert "UNAVAILABLE" in r.stderr and time.monotonic() < deadline, r.stderr
        time.sleep(0.5)


def _replay(env: Env, apps_by_device: dict[str, dict[str, float]], seconds: float) -> None:
    """`vgpu profiler --replay`, one per device at once: `seconds` of signatures of each application
    listed for that device, using the memory given (and no SM)."""
    t = np.arange(0.0, seconds, 0.5)
    runs = []
    for i, (device_id, mem_mib) in enumerate(apps_by_device.items()):
        trace = env.tmp / f"replay{i}.csv"
        write_trace(trace, [AppTrace(app_id, t, {"mem_used_mib": np.full(len(t), mib), "sm_util_pct": np.zeros(len(t))})
                            for app_id, mib in mem_mib.items()])
        runs.append(subprocess.Popen(
            [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{env.sock}", "--replay", str(trace),
             "--device-id", device_id, "--token-file", str(env.state / "tokens" / "profiler.token"),
             "--seconds", str(seconds)],
            cwd=ROOT, env=env.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        for run in runs:
            _, err = run.communicate(timeout=60)
            assert run.returncode == 0, err
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait(10)


def test_a_job_still_loading_keeps_its_cold_start_size_until_it_starts_across_a_daemon_restart_too(
        env: Env, serves: list[Serve]) -> None:
    """A job registers with its configuration, then idles (loading data: a profiler sees its process,
    with nothing on the GPU yet) for longer than the start-up window. The policy knows the cold-start
    size and counts the window from the first real use, so the grant stays at the size the job's ramp
    will need instead of shrinking away before the ramp.

    Two such jobs idle at once (the window is wall-clock time, so an idle costs its full length), on
    two GPUs (each job's SM share is over half of one): "before" was sized by a daemon that has since
    restarted, so the policy knows its size only from the grant's stored record (without it the job
    would fall back to the fixed headroom and shrink); "after" was sized by the running daemon."""
    two_gpus = ("--backend", f"sim:{SKU}*2")
    serves.append(Serve(env, *two_gpus))
    sized = {"before": _request_sized(env, "before")}
    assert serves[-1].term() == 0
    serves.append(Serve(env, *two_gpus))
    assert serves[-1].event("reconciled")["grants_restored"] == 1
    sized["after"] = _request_sized(env, "after")
    assert {g["source"] for g in sized.values()} == {"cold_start"}
    _replay(env, {g["device_id"]: {app_id: 0.0} for app_id, g in sized.items()}, PREDICTIVE_CONFIG.start_window_s + 2)
    apps = _apps(env)
    for app_id, grant in sized.items():
        cold_mib = grant["memory_mib"]
        job = apps[app_id]
        # the forecast saw the idle job
        assert job["forecast_mem_p90_mib"] == 0 or job["forecast_mem_p90_mib"] < 0.1 * cold_mib, app_id
        (held,) = job["grants"]
        assert held["grant_id"] == grant["grant_id"]
        assert cold_mib <= held["memory_mib"] <= cold_mib * (1 + PREDICTIVE_CONFIG.mem_margin_frac) + 1, (app_id, held)
    assert serves[-1].term() == 0


def test_a_new_job_under_the_same_application_gets_its_own_start_up_window(env: Env, serves: list[Serve]) -> None:
    """An application runs a job past its start-up window, ends it (releases its grant), and starts
    its next job under the same id with a bigger batch: a new cold-start grant while the new job
    loads. The new job's window counts from its own start, so the policy holds its grant at the new
    cold-start size plus the margin, as it did the first job's; counted from the application's first
    use, the window would be over and the grant left to follow the loading job's low usage."""
    serves.append(Serve(env))
    first = _request_sized(env, "runs", batch_size=64)
    device, used_mib = first["device_id"], 0.5 * first["memory_mib"]
    # its first sample is its first use: the second job's replay starts more than the window after it
    _replay(env, {device: {"runs": used_mib}}, PREDICTIVE_CONFIG.start_window_s + 2)
    env.vgpu("release", "--socket", str(env.sock), "--grant", first["grant_id"])
    second = _request_sized(env, "runs", batch_size=128)
    cold_mib = second["memory_mib"]
    assert second["source"] == "cold_start" and cold_mib > 2 * used_mib
    # loading: its model in memory, no batch yet; the usage as the last job left it (no rise, so
    # that no ramp rule, which also grants up to the cold-start size, has a say)
    _replay(env, {device: {"runs": used_mib}}, 5)
    held = {g["grant_id"]: g for g in _apps(env)["runs"]["grants"]}[second["grant_id"]]
    assert held["memory_mib"] == pytest.approx(cold_mib * (1 + PREDICTIVE_CONFIG.mem_margin_frac), rel=1e-3)
    assert serves[-1].term() == 0


# Damaged cold-start sizes as the state database might hold them: not a number, not > 0, not finite, a list.
BAD_COLD_START = ('"lots"', "-5.0", "NaN", "[4096]")


def test_a_bad_stored_cold_start_size_is_dropped_counted_and_its_grant_kept(env: Env, serves: list[Serve]) -> None:
    """A damaged cold-start size in the state database never stops a start: the grant is restored
    without it and the start counts it with the other bad records. Each kind of damage is in its own
    grant, all restored by one start; each grant's own reason is checked."""
    serves.append(Serve(env))
    grants = {bad: env.json("request", "--app", f"job{i}", "--memory-mib", "4096") for i, bad in enumerate(BAD_COLD_START)}
    assert serves[-1].term() == 0
    db = sqlite3.connect(env.state / "vgpu.sqlite3")
    for bad, grant in grants.items():
        (body,) = db.execute("SELECT record_json FROM grants WHERE grant_id=?", (grant["grant_id"],)).fetchone()
        assert '"cold_start_mib": null' in body  # a request, not sized
        db.execute("UPDATE grants SET record_json=? WHERE grant_id=?",
                   (body.replace('"cold_start_mib": null', f'"cold_start_mib": {bad}'), grant["grant_id"]))
    db.commit()
    db.close()
    serves.append(Serve(env))
    rec = serves[-1].event("reconciled")
    assert rec["grants_restored"] == len(BAD_COLD_START) and rec["bad_records"] == len(BAD_COLD_START)
    apps = _apps(env)
    for i, (bad, grant) in enumerate(grants.items()):
        (reason,) = [r for r in rec["bad_record_reasons"] if r.startswith(f"grant {grant['grant_id']!r}:")]
        assert "cold_start_mib" in reason and "kept without it" in reason, (bad, reason)
        (held,) = apps[f"job{i}"]["grants"]
        assert held["grant_id"] == grant["grant_id"] and held["memory_mib"] == 4096, (bad, held)
    assert serves[-1].term() == 0


def test_a_release_lifts_the_caps_of_a_plan_s_contention_at_once(
        env: Env, serves: list[Serve], sleeper: tuple[int, str]) -> None:
    """An application whose signatures the policy planned takes the GPU to more than 90 %: the plan
    makes the limits hard. It stops sending and its grant is released: the caps come off at once,
    with no further signature (no further plan) on the device."""
    pid, cgroup = sleeper
    serves.append(Serve(env))
    job1 = env.json("request", "--app", "job1", "--memory-mib", "2048", "--pid", str(pid),
                    "--state-dir", str(env.state))
    assert _limits(env) == {}
    total = env.json("available")["devices"][0]["mem_total_mib"]
    _replay(env, {job1["device_id"]: {"big": 0.9 * total}}, 2.5)  # the plan is made on the first signatures
    assert _limits(env)[cgroup] == [2048.0, 2048.0]
    assert serves[-1].event("memory_limits_hard")["device"] == job1["device_id"]
    (big,) = _apps(env)["big"]["grants"]
    env.vgpu("release", "--socket", str(env.sock), "--grant", big["grant_id"],
             "--state-dir", str(env.state))  # an operator releases it (big's token is the profiler's)
    assert _limits(env) == {}
    job1_now = _apps(env)["job1"]
    assert job1_now["mem_limit"] == "cooperative" and "once big left" in job1_now["mem_limit_reason"]
    assert serves[-1].event("memory_limits_cooperative")["device"] == job1["device_id"]
    assert serves[-1].term() == 0


async def test_the_metrics_say_when_a_gpu_s_limits_are_hard(tmp_path: Path) -> None:
    d = sim_daemon(tmp_path)
    await d.start()
    try:
        dev = d.allocator.ledger.devices()[0]

        def hard() -> float | None:
            return d.registry.get_sample_value("vgpu_device_memory_limits_hard", {"device": dev.device_id})

        assert hard() == 0
        d.allocator.request_allocation(AllocationRequest("big", memory_mib=0.95 * dev.mem_total_mib))
        assert hard() == 1
    finally:
        await d.stop("test")
