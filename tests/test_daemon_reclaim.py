"""A second application's request against the policy's forecast grant, as users meet it: a real
`vgpu serve` on the simulated GPU, the first application's signatures from `vgpu profiler --replay`
(so the policy holds most of the GPU for it), the second application linking the client stub. Its
declared job and an explicit amount are granted out of the forecast grant's slack, which is cut no
lower than the first application's use."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from daemon_fixtures import ROOT, Env, Serve, metric_samples

from vgpu.traces import AppTrace, write_trace

# An application that links the client stub: it declares its job (argv[4] "job") or asks for an
# amount of MiB ("MIB" or "MIB:SM", with an SM share in %), and prints the daemon's answer.
APP = """
import json, sys
import grpc
from vgpu.client import VgpuClient
from vgpu.jobs import JobConfig

sock, app_id, inapp, ask = sys.argv[1:5]
job = JobConfig(model_type="resnet50", batch_size=64, input_size=224) if ask == "job" else None
client = VgpuClient(app_id, socket=sock, inapp_dir=inapp, job=job, watch=False, report=False)
try:
    mib, _, sm = ask.partition(":")
    g = client.request(memory_mib=0.0) if job else client.request(memory_mib=float(mib), sm_pct=float(sm or 0))
    print(json.dumps({"memory_mib": g.memory_mib, "sm_pct": g.sm_pct, "source": g.source}))
except grpc.RpcError as exc:
    print(json.dumps({"refused": exc.code().name, "details": exc.details()}))
finally:
    client.close(release=False)
"""


def _app(env: Env, app_id: str, ask: str) -> dict:  # type: ignore[type-arg]
    r = subprocess.run([sys.executable, "-c", APP, str(env.sock), app_id, str(env.tmp / "inapp"), ask],
                       cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])  # type: ignore[no-any-return]


# Seconds of signatures each replay sends: the policy's forecast grant has settled well within them (its
# memory and SM share after 2.5 s were within 0.1 % of those after 4 s, for every use and SM share
# replayed here).
REPLAY_S = 2.5


def _replay(env: Env, device_id: str, app_id: str, mem_mib: float, sm_pct: float, seconds: float) -> None:
    t = np.arange(0.0, seconds, 0.5)
    trace = env.tmp / "replay.csv"
    write_trace(trace, [AppTrace(app_id, t, {"mem_used_mib": np.full(len(t), mem_mib),
                                            "sm_util_pct": np.full(len(t), sm_pct)})])
    run = subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{env.sock}", "--replay", str(trace),
         "--device-id", device_id, "--token-file", str(env.state / "tokens" / "profiler.token"),
         "--seconds", str(seconds)], cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def _held(env: Env, app_id: str) -> dict:  # type: ignore[type-arg]
    (app,) = [a for a in env.json("apps")["apps"] if a["app_id"] == app_id]
    (grant,) = app["grants"]
    return grant  # type: ignore[no-any-return]


def test_a_second_application_is_granted_out_of_the_forecast_grants_slack(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    (dev,) = env.json("available")["devices"]
    total, gpu = dev["mem_total_mib"], dev["device_id"]
    used = 0.5 * total
    _replay(env, gpu, "big", used, 95.0, REPLAY_S)
    big = _held(env, "big")
    assert big["source"] == "forecast" and big["sm_pct"] > 95  # the policy's share: no SM is free

    job = _app(env, "job", "job")  # its declared job, sized by the daemon's cold-start sizer
    assert job.get("source") == "cold_start", job
    after_job = _held(env, "big")
    assert after_job["memory_mib"] >= used and after_job["sm_pct"] >= 95  # never below its use

    free = env.json("available")["devices"][0]["mem_available_mib"]
    slack = after_job["memory_mib"] - used * 1.1
    assert slack > 1000, after_job  # the policy held more than its use + 10 %: some can be taken
    ask = free + slack / 2
    explicit = _app(env, "explicit", f"{ask:.0f}")
    assert explicit.get("source") == "request" and explicit["memory_mib"] == round(ask), explicit
    after = _held(env, "big")
    assert used * 1.1 - 1 <= after["memory_mib"] < after_job["memory_mib"]

    # more than the slack left: refused as before, saying what is committed and what could be taken
    too_much = _app(env, "greedy", f"{env.json('available')['devices'][0]['mem_available_mib'] + slack:.0f}")
    assert too_much["refused"] == "RESOURCE_EXHAUSTED" and "reclaimable" in too_much["details"], too_much
    assert _held(env, "big") == after

    reclaimed = [e for e in serves[-1].events() if e.get("event") == "reclaimed"]
    assert {e["for_app"] for e in reclaimed} >= {"explicit"} and all(e["app"] == "big" for e in reclaimed)
    assert serves[-1].term() == 0


def test_an_sm_share_is_granted_out_of_declared_jobs_estimates_before_their_use_is_known(
        env: Env, serves: list[Serve]) -> None:
    """Two declared jobs still loading hold the SM shares the cold-start sizer estimated for them,
    between them the whole GPU. A third application asking for an SM share of its own, with memory
    free, is granted it out of those estimates (nothing limits a job to its share, and the policy
    sizes each job's share from its use once known), where before it was refused for SM alone;
    asking for more than the estimates and what is free hold is refused, nothing changed."""
    serves.append(Serve(env))
    for app_id in ("job-1", "job-2"):
        assert _app(env, app_id, "job").get("source") == "cold_start"
    jobs_sm = sum(_held(env, a)["sm_pct"] for a in ("job-1", "job-2"))
    (dev,) = env.json("available")["devices"]
    assert dev["mem_available_mib"] > 10_000 and dev["sm_available_pct"] < 50, dev
    explicit = _app(env, "explicit", "1000:50")
    assert (explicit.get("source"), explicit.get("sm_pct")) == ("request", 50.0), explicit
    after = sum(_held(env, a)["sm_pct"] for a in ("job-1", "job-2"))
    assert after == pytest.approx(min(jobs_sm, 100.0 - 50.0), abs=0.01)
    assert all(_held(env, a)["memory_mib"] > 0 for a in ("job-1", "job-2"))  # their memory is theirs
    before = env.json("apps")
    too_much = _app(env, "greedy", f"1000:{after + 1:.0f}")
    assert too_much["refused"] == "RESOURCE_EXHAUSTED" and "% SM" in too_much["details"], too_much
    assert env.json("apps")["apps"] == before["apps"]
    reclaimed = [e for e in serves[-1].events() if e.get("event") == "reclaimed"]
    assert {e["app"] for e in reclaimed} <= {"job-1", "job-2"} and {e["for_app"] for e in reclaimed} == {"explicit"}
    assert serves[-1].term() == 0


# The first application, linking the client stub: it declares its job, then prints each allocation
# event the stub hands its `on_event` until told to stop (a line on stdin).
HOLDER = """
import json, sys, threading
from vgpu.client import VgpuClient
from vgpu.jobs import JobConfig
from vgpu.v1 import allocator_pb2

sock, app_id, inapp = sys.argv[1:4]
out = threading.Lock()  # the watch thread and this one print whole lines
released = threading.Event()

def say(obj):
    with out:
        sys.stdout.write(json.dumps(obj) + "\\n")
        sys.stdout.flush()

def show(event):
    kind = allocator_pb2.AllocationEvent.Kind.Name(event.kind)
    say({"kind": kind, "app": event.grant.app_id, "sm_pct": event.grant.sm_pct, "detail": event.detail})
    if kind == "RELEASED":
        released.set()

with VgpuClient(app_id, socket=sock, inapp_dir=inapp, report=False, on_event=show,
                job=JobConfig(model_type="resnet50", batch_size=64, input_size=224)) as client:
    client.request()
    say({"kind": "ready"})
    sys.stdin.readline()
    client.release()
    say({"kind": "heard RELEASED" if released.wait(10) else "no RELEASED"})
"""


def test_the_application_whose_grant_is_cut_hears_why(env: Env, serves: list[Serve]) -> None:
    """A job that declared itself and is then managed by the policy (its signatures replayed) hears,
    through the stub's `on_event`, the RESIZED event that takes room from it for a second declared job,
    with the reason; its own grant and the release are events too."""
    serves.append(Serve(env))
    (dev,) = env.json("available")["devices"]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(env.sock), "held", str(env.tmp / "inapp")],
                              cwd=ROOT, env=env.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        while json.loads(holder.stdout.readline())["kind"] != "ready":
            pass
        _replay(env, dev["device_id"], "held", 0.3 * dev["mem_total_mib"], 50.0, REPLAY_S)
        assert _held(env, "held")["sm_pct"] > 55  # the policy's share, more than half the SM

        job = _app(env, "second", "job")
        assert job.get("source") == "cold_start", job
        holder.stdin.write("go\n")
        holder.stdin.flush()
        out, err = holder.communicate(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    events = [json.loads(line) for line in out.splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[-1] == "heard RELEASED", (kinds, err)
    cuts = [e for e in events if e["kind"] == "RESIZED" and e["detail"].startswith("reclaimed for second's")]
    assert cuts and all(e["app"] == "held" for e in cuts), (events, err)
    # each share as one reads it: at most a tenth of a point ("SM 85.8 -> 55 %", not 85.8079)
    shares = [v for e in events if e["kind"] == "RESIZED" for pair in re.findall(r"SM (\S+) -> (\S+) %", e["detail"])
              for v in pair]
    assert shares and all(re.fullmatch(r"\d+(\.\d)?", v) for v in shares), events
    assert serves[-1].term() == 0


def test_a_resize_reads_each_share_to_a_tenth() -> None:
    from vgpu.allocator.core import _resize_text
    from vgpu.allocator.ledger import Grant

    old = Grant("g", "a", "GPU-0", 36000.0, 85.80794, 0, 0.0, 0.0)
    new = Grant("g", "a", "GPU-0", 30693.4, 55.0, 0, 0.0, 1.0)
    assert _resize_text(old, new) == "memory 36000 -> 30693 MiB, SM 85.8 -> 55 %"


def test_the_operator_sets_how_much_reclaim_may_take_or_turns_it_off(env: Env, serves: list[Serve]) -> None:
    """`server.reclaim_margin_frac` sets the room left above a cut application's use; with
    `server.reclaim = false` the same request is refused while the policy's grant holds the room."""
    conf = env.tmp / "vgpu.toml"
    conf.write_text("[server]\nreclaim_margin_frac = 0.2\n")
    serves.append(Serve(env, "--config", str(conf)))
    (dev,) = env.json("available")["devices"]
    used = 0.4 * dev["mem_total_mib"]
    _replay(env, dev["device_id"], "big", used, 95.0, REPLAY_S)
    before = _held(env, "big")["memory_mib"]
    assert before > used * 1.2 + 1000, before  # room above use x 1.2 that a cut could take
    free = env.json("available")["devices"][0]["mem_available_mib"]
    asked = _app(env, "greedy", f"{free + before - used * 1.1:.0f}")  # would need a cut to use x 1.1
    assert asked["refused"] == "RESOURCE_EXHAUSTED" and "reclaimable" in asked["details"], asked
    fits = _app(env, "modest", f"{free + (before - used * 1.2) / 2:.0f}")
    assert fits.get("source") == "request", fits
    assert _held(env, "big")["memory_mib"] >= used * 1.2 - 1
    assert serves[-1].term() == 0

    conf.write_text("[server]\nreclaim = false\n")
    serves.append(Serve(env, "--config", str(conf)))
    _replay(env, dev["device_id"], "big", used, 95.0, REPLAY_S)
    held = _held(env, "big")["memory_mib"]
    free = env.json("available")["devices"][0]["mem_available_mib"]
    refused = _app(env, "later", f"{free + (held - used * 1.2) / 2:.0f}")
    assert refused["refused"] == "RESOURCE_EXHAUSTED" and "reclaimable" not in refused["details"], refused
    assert _held(env, "big")["memory_mib"] == held


# An application the profiler saw first, linking the client stub: once its watch has caught up with
# the forecast grant the policy holds for it, it declares its job, waits to hear the job's GRANTED and
# prints every event its `on_event` got, the daemon's answer and what the stub holds; then it runs
# until told to stop (a line on stdin).
DECLARER = """
import json, sys, threading, time
from vgpu.client import VgpuClient
from vgpu.jobs import JobConfig
from vgpu.v1 import allocator_pb2

sock, app_id, inapp = sys.argv[1:4]
heard, granted = [], threading.Event()

def show(event):
    kind = allocator_pb2.AllocationEvent.Kind.Name(event.kind)
    heard.append({"kind": kind, "grant": event.grant.grant_id, "source": event.grant.source,
                  "memory_mib": event.grant.memory_mib, "detail": event.detail})
    if kind == "GRANTED" and event.grant.source == "cold_start":
        granted.set()

client = VgpuClient(app_id, socket=sock, inapp_dir=inapp, report=False, on_event=show,
                    job=JobConfig(model_type="resnet50", batch_size=64, input_size=224))
deadline = time.monotonic() + 20
while not client.grants and time.monotonic() < deadline:  # caught up: the watch is live
    time.sleep(0.05)
before = [g.grant_id for g in client.grants]
g = client.request()
granted.wait(10)
print(json.dumps({"before": before, "answer": {"grant": g.grant_id, "memory_mib": g.memory_mib,
                  "source": g.source},
                  "heard": heard, "holds": [x.grant_id for x in client.grants],
                  "granted_memory_mib": client.granted_memory_mib}), flush=True)
sys.stdin.readline()  # alive until told: a restarted daemon keeps the grants of live processes
client.close(release=False)
"""


def _grants_of(env: Env, app_id: str) -> list[dict]:  # type: ignore[type-arg]
    return [g for a in env.json("apps")["apps"] if a["app_id"] == app_id for g in a["grants"]]


def test_an_app_the_policy_manages_that_declares_its_job_holds_one_grant(env: Env, serves: list[Serve]) -> None:
    """The profiler saw the application first (the policy holds a forecast grant for it); it then
    declares its job through the client stub. It holds one grant, the job's, which the policy resizes
    from then on and which a restarted daemon still lists alone; it heard the forecast grant released
    as superseded, then its job granted; the metrics count the release by that reason."""
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    (dev,) = env.json("available")["devices"]
    gpu, total = dev["device_id"], dev["mem_total_mib"]
    used = 0.5 * total
    _replay(env, gpu, "big", used, 60.0, REPLAY_S)
    (forecast,) = _grants_of(env, "big")
    assert forecast["source"] == "forecast" and forecast["memory_mib"] >= used, forecast

    app = subprocess.Popen([sys.executable, "-c", DECLARER, str(env.sock), "big", str(env.tmp / "inapp")],
                           cwd=ROOT, env=env.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        _declared_job_holds_one_grant(env, serves, app, port, forecast)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()


def _declared_job_holds_one_grant(env: Env, serves: list[Serve], app: subprocess.Popen,  # type: ignore[type-arg]
                                  port: int, forecast: dict) -> None:  # type: ignore[type-arg]
    assert app.stdout is not None and app.stdin is not None
    (dev,) = env.json("available")["devices"]
    gpu, total = dev["device_id"], dev["mem_total_mib"]
    said = json.loads(app.stdout.readline())
    answer = said["answer"]
    assert said["before"] == [forecast["grant_id"]], said  # the stub had caught up with the forecast grant
    assert answer["source"] == "cold_start" and answer["memory_mib"] >= forecast["memory_mib"], said
    # the job is granted what the forecast grant held, more than the sizer's size
    assert serves[-1].event("cold_start_sized")["memory_mib"] < answer["memory_mib"]
    # one grant: in `vgpu apps`, in the ledger's totals (GetAvailableResources) and in the stub
    (held,) = _grants_of(env, "big")
    assert held["grant_id"] == answer["grant"] and held["memory_mib"] == answer["memory_mib"], held
    (now,) = env.json("available")["devices"]
    assert now["mem_granted_mib"] == pytest.approx(held["memory_mib"])
    assert said["holds"] == [answer["grant"]] and said["granted_memory_mib"] == answer["memory_mib"], said
    # heard: the forecast grant released as superseded, then the job's grant
    story = [(e["kind"], e["grant"]) for e in said["heard"] if e["kind"] in ("GRANTED", "RELEASED")]
    assert story[-2:] == [("RELEASED", forecast["grant_id"]), ("GRANTED", answer["grant"])], said["heard"]
    released = [e for e in said["heard"] if e["kind"] == "RELEASED"][-1]
    assert released["detail"].startswith(f"superseded by its cold_start grant {answer['grant']}"), released
    counted = metric_samples(port)
    assert counted[("vgpu_grant_changes_total", (("kind", "released"), ("reason", "superseded")))] == 1
    assert counted[("vgpu_grant_changes_total", (("kind", "released"), ("reason", "released")))] == 0

    # the policy resizes that one grant: the application's use grows past it and the grant follows
    assert held["memory_mib"] < 0.8 * total
    _replay(env, gpu, "big", 0.8 * total, 60.0, REPLAY_S)
    (resized,) = _grants_of(env, "big")
    assert resized["grant_id"] == answer["grant"] and resized["memory_mib"] >= 0.8 * total, resized
    (now,) = env.json("available")["devices"]
    assert now["mem_granted_mib"] == pytest.approx(resized["memory_mib"])

    # and a restarted daemon lists that one grant, from its store
    assert serves[-1].term() == 0
    serves.append(Serve(env))
    (restored,) = _grants_of(env, "big")
    assert restored["grant_id"] == answer["grant"] and restored["source"] == "cold_start", restored
    (after,) = env.json("available")["devices"]
    assert after["mem_granted_mib"] == pytest.approx(restored["memory_mib"])
    app.communicate("stop\n", timeout=30)
    assert app.returncode == 0
    assert serves[-1].term() == 0
