"""What an operator sees: `vgpu available`, `vgpu apps` and `vgpu top` run as commands against a real
`vgpu serve`, with a replay profiler streaming, and the pieces they are built from (reads that
degrade field by field, the MIG table, the history behind the sparklines)."""

from __future__ import annotations

import dataclasses
import getpass
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import pytest

from tests.daemon_fixtures import ROOT, Env, Serve
from vgpu import auth, ctl
from vgpu.allocator.core import Allocator, AppInfo
from vgpu.allocator.history import History, HistoryPoint
from vgpu.allocator.ledger import AppLimits, Grant
from vgpu.allocator.service import ProfilerState, app_to_pb, device_to_pb, process_info
from vgpu.device.errors import GpuLost, NotSupported
from vgpu.device.sim import SimBackend
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc

TRACE = ROOT / "vgpu" / "data" / "demo_trace.csv.gz"


def cli(env: Env, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`vgpu ARGS --socket ... --state-dir ...` as a separate process, the way an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "vgpu.cli", *args, "--socket", str(env.sock), "--state-dir", str(env.state)],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def _device_uuid(env: Env) -> str:
    out = cli(env, "available", "--json")
    assert out.returncode == 0, out.stderr
    return str(json.loads(out.stdout)["devices"][0]["device_id"])


def start_profiler(env: Env, device: str, seconds: float = 60) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", str(env.sock), "--replay", str(TRACE),
         "--device-id", device, "--token-file", str(env.state / "tokens" / "profiler.token"), "--loop",
         "--seconds", str(seconds)],
        cwd=ROOT, env=env.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _wait_for(pred: Callable[[], object], timeout_s: float = 30.0, show: Callable[[], str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError("condition not met in time" + (f":\n{show()}" if show else ""))


def _row(table: str, first: str, header: str = "") -> dict[str, str]:
    """The row of a plain table whose first cell is `first`, by column (columns are split at runs of
    two or more spaces, as printed). `header`: the first column's name (default IDX or APP)."""
    lines = table.splitlines()
    header_at = next(i for i, line in enumerate(lines) if line.startswith((header,) if header else ("IDX", "APP")))
    header = lines[header_at]
    starts = [m.start() for m in re.finditer(r"(?:(?<=  )|^)\S", header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    for line in lines[header_at + 1:]:
        if line.split("  ")[0].strip() == first:
            cells = re.split(r"\s{2,}", line.strip())
            assert len(cells) == len(names), (names, cells)
            return dict(zip(names, cells, strict=True))
    raise AssertionError(f"no row {first!r} in\n{table}")


# --- against a real daemon ------------------------------------------------------------------------------
def test_available_and_apps_show_what_nvidia_smi_shows(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    device = _device_uuid(env)
    out = cli(env, "request", "--app", "mine", "--memory-mib", "2048", "--pid", str(os.getpid()))
    assert out.returncode == 0, out.stderr

    avail = cli(env, "available")
    assert avail.returncode == 0, avail.stderr
    row = _row(avail.stdout, "0")
    assert row["NAME"] == "NVIDIA H100 80GB HBM3"
    assert row["BUS ID"] == "00000000:17:00.0"
    assert row["GRANTED MiB"] == "2,048"
    assert row["TOTAL MiB"] == "81,559"
    assert re.fullmatch(r"\d+ / 700", row["PWR W"]), row["PWR W"]  # draw / limit
    assert re.fullmatch(r"\d+C", row["TEMP"]) and row["SM MHz"] == "1,980" and row["UTIL"].endswith("%")
    assert row["MODE"] == "live"
    assert row["UUID"] == device
    assert row["PROFILERS"] == "0 (no signature)"

    apps = cli(env, "apps")
    assert apps.returncode == 0, apps.stderr
    mine = _row(apps.stdout, "mine")
    assert mine["PID"] == str(os.getpid())
    assert mine["USER"] == getpass.getuser()
    assert "python" in mine["COMMAND"] or "pytest" in mine["COMMAND"]
    assert mine["GPU"] == "0"
    assert mine["GRANTED MiB"] == "2,048"
    assert mine["USED MiB"] == "N/A"  # no signature yet: unknown, not 0
    assert re.fullmatch(r"\d+s ago", mine["LAST SEEN"])
    # --json, for scripts, says the same: null where the table says N/A, not the message's 0
    listed = {a["app_id"]: a for a in json.loads(cli(env, "apps", "--json").stdout)["apps"]}
    unknown = ("mem_used_mib", "sm_util_pct", "forecast_mem_p50_mib", "forecast_mem_p90_mib", "forecast_sm_p50_pct",
               "forecast_sm_p90_pct")
    assert {f: listed["mine"][f] for f in unknown} == dict.fromkeys(unknown), listed["mine"]
    assert listed["mine"]["grants"][0]["memory_mib"] == 2048


def test_a_claimed_id_with_no_grant_is_listed_as_claimed(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    channel = grpc.insecure_channel(f"unix:{env.sock}")
    stub = allocator_pb2_grpc.AllocatorStub(channel)
    try:
        reply, call = stub.RequestResourceAllocation.with_call(pb.RequestResourceAllocationRequest(
            request=pb.ResourceRequest(app_id="owner-1", memory_mib=64)), timeout=10)
        token = str(dict(call.trailing_metadata() or ())[auth.APP_TOKEN_TRAILER])  # the first request claims the id
        stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=reply.grant.grant_id), metadata=auth.bearer(token),
                              timeout=10)
        stub.RequestResourceAllocation(pb.RequestResourceAllocationRequest(
            request=pb.ResourceRequest(app_id="holder", memory_mib=32)), timeout=10)
    finally:
        channel.close()
    listed = {a["app_id"]: a for a in json.loads(cli(env, "apps", "--json").stdout)["apps"]}
    assert listed["owner-1"]["claimed"] is True and listed["owner-1"]["grants"] == []
    assert time.time() - 60 < listed["owner-1"]["claimed_at_s"] <= time.time()
    assert listed["holder"]["claimed"] is True and len(listed["holder"]["grants"]) == 1
    # The table lists what holds resources: the id that released its grant is left out, and counted.
    table = cli(env, "apps").stdout
    assert [line.split()[0] for line in table.splitlines()[1:3]] == ["holder", "1"], table
    assert _row(table, "holder")["CLAIMED"] == "yes" and _row(table, "holder")["GRANTED MiB"] == "32"
    assert table.splitlines()[-1].startswith("1 application holding nothing not listed (no grant"), table
    assert table.rstrip().endswith("vgpu apps --all lists them"), table
    # --all lists it too, its GRANTED MiB "none" (no grant, not a grant of 0 MiB), with when it was seen.
    table = cli(env, "apps", "--all").stdout
    row = _row(table, "owner-1")
    assert row["CLAIMED"] == "yes" and row["GRANTED MiB"] == "none" and row["LAST SEEN"].endswith("ago"), table
    assert row["GRANT SM %"] == "none", table  # no grant: no SM share either, not a share of 0 %
    assert _row(table, "holder")["GRANTED MiB"] == "32" and "not listed" not in table
    assert serves[-1].term() == 0
    serves.append(Serve(env))  # the claim is stored: listed after a restart too
    assert _row(cli(env, "apps", "-a").stdout, "owner-1")["CLAIMED"] == "yes"


def test_dry_run_is_shown(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env, "--dry-run"))
    assert _row(cli(env, "available").stdout, "0")["MODE"] == "dry run"


def test_streamed_apps_show_usage_forecast_history_and_profiler(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    device = _device_uuid(env)
    prof = start_profiler(env, device)
    try:
        def forecast_made() -> bool:
            apps = json.loads(cli(env, "apps", "--json").stdout)["apps"]
            return any(a["forecast_mem_p90_mib"] is not None for a in apps)  # null until a forecast

        _wait_for(forecast_made, 60)

        def planned_with_history() -> bool:
            # what the checks below read is made tick by tick after the first forecast (a plan that
            # grants, two points of history): wait for it rather than for a fixed time, which a
            # loaded machine can outlast
            apps = {a["app_id"]: a for a in json.loads(cli(env, "apps", "--json").stdout)["apps"]}
            app = apps.get("bert-train")
            if app is None or not app["grants"] or not app["plan_mem_rule"] or app["forecast_mem_p50_mib"] is None:
                return False
            with grpc.insecure_channel(f"unix:{env.sock}") as ch:
                hist = allocator_pb2_grpc.AllocatorStub(ch).GetAppHistory(
                    pb.GetAppHistoryRequest(app_id="bert-train", since_s=60), timeout=10)
            return len(hist.apps) == 1 and len(hist.apps[0].t_unix_s) >= 2

        _wait_for(planned_with_history, 60, show=lambda: cli(env, "apps").stdout)
        apps = cli(env, "apps").stdout
        row = _row(apps, "bert-train")
        assert float(row["USED MiB"].replace(",", "")) > 1000
        assert float(row["P90 MiB"].replace(",", "")) >= float(row["P50 MiB"].replace(",", "")) > 0
        assert float(row["GRANTED MiB"].replace(",", "")) > 0
        assert row["PID"].isdigit()  # the pid the signatures name (a trace's: no such process here)
        assert row["USER"] == "N/A" and row["COMMAND"] == "N/A"
        assert row["GPU"] == "0" and re.fullmatch(r"\d+s ago", row["LAST SEEN"])
        assert row["CLAIMED"] == "no"  # an id seen only in signatures has no owner
        assert row["WHY"] in RULES, row  # the rule the latest plan sized its memory by
        planned = {a["app_id"]: a for a in json.loads(cli(env, "apps", "--json").stdout)["apps"]}["bert-train"]
        assert planned["plan_mem_rule"] in RULES and planned["plan_sm_rule"] in RULES, planned
        assert planned["plan_memory_mib"] > 0, planned
        # known use and forecast are numbers in --json, as the table shows them
        assert planned["mem_used_mib"] > 1000 and planned["forecast_mem_p90_mib"] >= planned["forecast_mem_p50_mib"] > 0
        dev = _row(cli(env, "available").stdout, "0")
        assert re.fullmatch(r"1 \(\d+s ago\)", dev["PROFILERS"]), dev["PROFILERS"]

        with grpc.insecure_channel(f"unix:{env.sock}") as ch:
            stub = allocator_pb2_grpc.AllocatorStub(ch)
            hist = stub.GetAppHistory(pb.GetAppHistoryRequest(app_id="bert-train", since_s=60), timeout=10)
            for bad in (-1.0, math.nan):
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetAppHistory(pb.GetAppHistoryRequest(since_s=bad), timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "since_s" in str(err.value.details())
            gpu = stub.GetAppHistory(pb.GetAppHistoryRequest(device_id=device), timeout=10)
            assert {h.app_id for h in gpu.apps} >= {"bert-train", "vit-infer"} and {h.device_id for h in gpu.apps} == {device}
        assert len(hist.apps) == 1
        h = hist.apps[0]
        assert h.device_id == device and len(h.t_unix_s) >= 2
        assert len(h.mem_used_mib) == len(h.mem_p90_mib) == len(h.mem_granted_mib) == len(h.t_unix_s)
        assert any(e.kind == "granted" for e in h.events)
        assert abs(hist.now_unix_s - time.time()) < 5
    finally:
        prof.terminate()
        prof.wait(10)


def test_top_prints_plain_tables_off_a_terminal(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    cli(env, "request", "--app", "mine", "--memory-mib", "1024")
    gone = json.loads(cli(env, "request", "--app", "gone", "--memory-mib", "10", "--json").stdout)["grant_id"]
    assert cli(env, "release", "--grant", gone).returncode == 0
    out = cli(env, "top", "--iterations", "2", "--interval-s", "0.2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("vgpu top") == 2
    assert "\x1b" not in out.stdout  # no escape codes into a pipe
    assert _row(out.stdout, "mine", "APP")["GRANTED MiB"] == "1,024"
    # as `vgpu apps`: the application that released its grant is counted, not listed, unless --all
    assert "gone" not in [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    assert "1 application holding nothing not listed" in out.stdout
    every = cli(env, "top", "--iterations", "1", "--all").stdout
    assert _row(every, "gone", "APP")["GRANTED MiB"] == "none"


# A tmux server of this test's own (not the user's default one, whose sessions may set the window size).
TMUX = ["tmux", "-L", f"vgpu-test-{os.getpid()}", "-f", "/dev/null"]


def _tmux(*args: str) -> str:
    return subprocess.run([*TMUX, *args], capture_output=True, text=True, check=False, timeout=10).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_top_on_a_terminal_draws_sparklines_sorts_and_quits_on_q(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    device = _device_uuid(env)
    prof = start_profiler(env, device)
    session = f"vgpu-top-{os.getpid()}"
    done = env.tmp / "top.exit"
    env_args = " ".join(f"{k}={v!r}" for k, v in env.env.items() if k in ("PYTHONPATH", "XDG_CONFIG_HOME", "HOME", "PATH"))
    # (pytest exports COLUMNS=80 and LINES=24, which rich would take over the pane's real size)
    command = (f"cd {ROOT} && env -u COLUMNS -u LINES {env_args} {sys.executable} -m vgpu.cli top --socket {env.sock} "
               f"--state-dir {env.state} --interval-s 0.5; echo $? > {done}; sleep 60")
    try:
        _wait_for(lambda: json.loads(cli(env, "apps", "--json").stdout)["apps"], 60)
        subprocess.run([*TMUX, "new-session", "-d", "-s", session, "-x", "200", "-y", "60", command], check=True)
        # (the first frame may be drawn before tmux gives the pane its size: wait for a full one)
        _wait_for(lambda: all(x in _tmux("capture-pane", "-p", "-t", session)
                              for x in ("Applications", "grant ", "00000000:17:00.0")), 30,
                  lambda: _tmux("capture-pane", "-p", "-t", session))
        screen = _tmux("capture-pane", "-p", "-t", session)
        assert "GPUs" in screen and "00000000:17:00.0" in screen
        assert "sorted by granted" in screen
        # the columns of `vgpu apps` less its SM ones (docs/operations.md, "vgpu top")
        assert "GRANTED MiB" in screen and "LAST SEEN" in screen
        assert "GRANT SM %" not in screen and "P90 SM %" not in screen, screen
        assert re.search(r"use +[▁▂▃▄▅▆▇█]", screen), screen
        assert re.search(r"p90 +[▁▂▃▄▅▆▇█ ]", screen)
        subprocess.run([*TMUX, "send-keys", "-t", session, "s"], check=True)
        _wait_for(lambda: "sorted by used" in _tmux("capture-pane", "-p", "-t", session), 30)
        prof.terminate()
        serves[0].term()  # the daemon goes away: the screen says so and keeps the last figures
        _wait_for(lambda: "refresh failed" in _tmux("capture-pane", "-p", "-t", session), 30,
                  lambda: _tmux("capture-pane", "-p", "-t", session))
        assert "bert-train" in _tmux("capture-pane", "-p", "-t", session)
        subprocess.run([*TMUX, "send-keys", "-t", session, "q"], check=True)
        _wait_for(done.exists, 30)
        assert done.read_text().strip() == "0"
        # the terminal is given back: the shell's next output is on the normal screen
        assert "Applications" not in _tmux("capture-pane", "-p", "-t", session)
    finally:
        subprocess.run([*TMUX, "kill-server"], check=False, capture_output=True)
        prof.terminate()
        prof.wait(10)


def test_top_on_a_terminal_when_the_daemon_is_down_says_so(env: Env) -> None:
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: vgpu top on a terminal, against a socket nobody listens on
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "vgpu.cli", "top", "--socket", str(env.sock), "--wait-s", "1"],
                  env.env)
    out = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    assert b"cannot reach the vgpu daemon" in out


# --- the pieces -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", [NotSupported, GpuLost])
def test_device_reads_degrade_field_by_field(fault: type[Exception]) -> None:
    sim = SimBackend(["h100-80gb"])
    dev = sim.devices()[0]
    dev.inject("temperature_c", fault, times=None)  # type: ignore[arg-type]
    dev.inject("pci_bus_id", fault, times=None)  # type: ignore[arg-type]
    alloc = Allocator(sim)
    resp = pb.GetAvailableResourcesResponse(devices=[device_to_pb(d) for d in alloc.available()])
    msg = resp.devices[0]
    assert not msg.HasField("temperature_c") and not msg.HasField("pci_bus_id")
    assert msg.HasField("power_draw_mw") and msg.HasField("sm_clock_mhz")  # the rest still read
    row = _row(ctl.devices_table(resp), "0")
    assert row["TEMP"] == "N/A" and row["BUS ID"] == "N/A"
    assert row["SM MHz"] == "1,980"


def test_a_lost_gpu_shows_every_device_field_as_na() -> None:
    sim = SimBackend(["h100-80gb"])
    alloc = Allocator(sim)
    sim.devices()[0].lose()
    resp = pb.GetAvailableResourcesResponse(devices=[device_to_pb(d) for d in alloc.available()])
    row = _row(ctl.devices_table(resp), "0")
    assert {row[c] for c in ("BUS ID", "USED MiB", "TEMP", "SM MHz", "UTIL")} == {"N/A"}
    assert row["PWR W"] == "N/A / N/A"
    assert row["TOTAL MiB"] == "81,559"  # the ledger's account stands


def test_mig_instances_are_a_table() -> None:
    sim = SimBackend(["a100-40gb"])
    dev = sim.devices()[0]
    dev.set_mig_mode(True)
    prof = {p.name: p for p in dev.gpu_instance_profiles()}
    dev.create_gpu_instance(prof["3g.20gb"].profile_id, 0)
    dev.create_gpu_instance(prof["1g.5gb"].profile_id, 6)
    text = ctl.devices_table(pb.GetAvailableResourcesResponse(devices=[device_to_pb(d) for d in Allocator(sim).available()]))
    assert "MIG instances" in text
    mig = text.split("MIG instances")[1]
    lines = [line.split() for line in mig.strip().splitlines()]
    assert lines[0][:6] == ["GPU", "GI", "ID", "PROFILE", "START", "SIZE"]
    assert [(cells[2], cells[3], cells[4]) for cells in lines[1:]] == [("3g.20gb", "0", "4"), ("1g.5gb", "6", "1")]
    assert all(cells[-1].startswith("MIG-") for cells in lines[1:])


def test_profiler_state_and_last_seen_reach_the_messages() -> None:
    sim = SimBackend(["h100-80gb"])
    d = Allocator(sim).available()[0]
    msg = device_to_pb(d, ProfilerState(2, 100.0), now_s=103.5)
    assert msg.profiler_streams == 2 and msg.newest_signature_age_s == pytest.approx(3.5)
    assert _row(ctl.devices_table(pb.GetAvailableResourcesResponse(devices=[msg])), "0")["PROFILERS"] == "2 (4s ago)"
    silent = device_to_pb(d, ProfilerState(0, None), now_s=103.5)
    assert silent.profiler_streams == 0 and not silent.HasField("newest_signature_age_s")
    assert not device_to_pb(d).HasField("profiler_streams")  # no manager: unknown, not 0


def test_process_info_degrades_for_a_process_that_is_gone() -> None:
    user, command = process_info(os.getpid())
    assert user == getpass.getuser() and "python" in command.lower() or "pytest" in command
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert process_info(gone.pid) == ("", "")


def test_apps_table_marks_unknowns() -> None:
    msg = app_to_pb(AppInfo("a", (), None, pids=(4242,)), process_info=lambda pid: ("", ""))
    row = _row(ctl.apps_table(pb.ListApplicationsResponse(apps=[msg])), "a")
    assert row["PID"] == "4242" and row["USER"] == "N/A" and row["COMMAND"] == "N/A"
    assert row["USED MiB"] == row["P90 MiB"] == row["LAST SEEN"] == row["WHY"] == "N/A"
    assert not msg.HasField("plan_memory_mib") and msg.plan_mem_rule == ""


# The rules the policy names in a plan (allocator/policy/forecast.py), as docs/operations.md lists them.
RULES = {"forecast", "usage", "reclaim-grow", "guarantee", "minimum", "lead", "ramp", "start", "burst", "bump",
         "jump-ended", "overrun", "dwell", "below-threshold", "hold", "contention", "contention-held"}


def test_every_rule_a_plan_names_is_documented_for_the_operator() -> None:
    """The WHY column's words are the policy's own: each one the policy can write is in the list that
    docs/operations.md explains (and this test's), so a new rule cannot reach the table unexplained."""
    source = (ROOT / "allocator" / "policy" / "forecast.py").read_text()
    written = set(re.findall(r'reason(?:\[res\])? = "([a-z-]+)"', source))
    written |= set(re.findall(r'return (?:desired|current|max\(desired, app.request\(res\)\)), "([a-z-]+)"', source))
    written |= set(re.findall(r'value, reason = .*, "([a-z-]+)"$', source, re.M))
    written |= set(re.findall(r'\("([a-z]+)", _[a-z_]+\)', source))  # the leading rules' names
    assert written and written <= RULES, written - RULES
    doc = (ROOT / "docs" / "operations.md").read_text()
    assert all(f"`{rule}`" in doc for rule in RULES), [r for r in RULES if f"`{r}`" not in doc]


def test_a_planned_application_shows_the_plans_size_and_rules() -> None:
    from vgpu.allocator.policy.base import PlanReason

    why = PlanReason("a", "GPU-0", 12000.0, 40.0, "ramp", "forecast")
    msg = app_to_pb(AppInfo("a", (), None, plan=why), process_info=lambda pid: ("", ""))
    assert (msg.plan_memory_mib, msg.plan_sm_pct, msg.plan_mem_rule, msg.plan_sm_rule) == (12000.0, 40.0, "ramp",
                                                                                         "forecast")
    assert _row(ctl.apps_table(pb.ListApplicationsResponse(apps=[msg])), "a")["WHY"] == "ramp"


def test_apps_table_leaves_out_what_holds_nothing_unless_all() -> None:
    """An id with no grant, no process, no forecast and no limits is left out by default and counted;
    one with no grant that still runs a process, or has the operator's limits, is listed, its GRANTED
    MiB and GRANT SM % "none"; a grant of 0 MiB (an SM share alone) reads 0."""
    sm_only = Grant("g1", "sm-only", "GPU-0", 0.0, 30.0, 0, 1.0, 1.0)
    apps = pb.ListApplicationsResponse(apps=[
        app_to_pb(AppInfo("gone", (), None), process_info=lambda pid: ("", "")),
        app_to_pb(AppInfo("gone-too", (), None), process_info=lambda pid: ("", "")),
        app_to_pb(AppInfo("running", (), None, pids=(4242,)), process_info=lambda pid: ("", "")),
        app_to_pb(AppInfo("limited", (), AppLimits("limited", max_memory_mib=1024.0)), process_info=lambda pid: ("", "")),
        app_to_pb(AppInfo("sm-only", (sm_only,), None)),
    ])
    table = ctl.apps_table(apps, show_all=False)
    listed = [line.split()[0] for line in table.splitlines()[1:]]
    assert listed[:3] == ["running", "limited", "sm-only"] and "gone" not in listed and "gone-too" not in listed
    assert "2 applications holding nothing not listed" in table
    assert _row(table, "running")["GRANTED MiB"] == _row(table, "limited")["GRANTED MiB"] == "none"
    assert _row(table, "running")["GRANT SM %"] == _row(table, "limited")["GRANT SM %"] == "none"
    assert _row(table, "sm-only")["GRANTED MiB"] == "0" and _row(table, "sm-only")["GRANT SM %"] != "none"
    every = ctl.apps_table(apps, show_all=True)
    assert _row(every, "gone")["GRANTED MiB"] == _row(every, "gone")["GRANT SM %"] == "none" and "not listed" not in every
    only_gone = ctl.apps_table(pb.ListApplicationsResponse(apps=apps.apps[:1]), show_all=False)
    assert "(no application holds a grant or runs on a GPU)" in only_gone
    assert only_gone.splitlines()[-1].startswith("1 application holding nothing not listed")
    assert "(no applications)" in ctl.apps_table(pb.ListApplicationsResponse(), show_all=False)


def test_apps_table_says_sm_shares_are_not_enforced_where_one_is_granted() -> None:
    """The daemon sets no MPS limit: `vgpu apps` says so under the table wherever it shows an SM share."""
    grant = Grant("g1", "a", "GPU-0", 2048.0, 30.0, 0, 1.0, 1.0)
    with_sm = ctl.apps_table(pb.ListApplicationsResponse(apps=[app_to_pb(AppInfo("a", (grant,), None))]))
    assert with_sm.splitlines()[-1] == ctl.SM_NOT_ENFORCED and "not enforced" in ctl.SM_NOT_ENFORCED
    assert _row(with_sm, "a")["GRANT SM %"] == "30"
    no_sm = dataclasses.replace(grant, sm_pct=0.0)
    memory_only = ctl.apps_table(pb.ListApplicationsResponse(apps=[app_to_pb(AppInfo("a", (no_sm,), None))]))
    assert ctl.SM_NOT_ENFORCED not in memory_only
    assert _row(memory_only, "a")["GRANT SM %"] == "0"  # a grant with no SM share, not "none" (no grant)


# --- the history behind sparklines and reports ----------------------------------------------------------
def test_history_marks_oom_at_the_start_of_each_overrun_run() -> None:
    h = History(max_points=10)
    uses = [100, 300, 310, 150, 400]  # granted 200 throughout: over at 1, 2 and 4
    started = [h.record("a", "g", HistoryPoint(float(t), mem_used_mib=u, mem_granted_mib=200), granted_before_mib=200)
               for t, u in enumerate(uses)]
    assert started == [False, True, False, False, True]
    (s,) = h.series("a")
    assert (s.overruns, s.ooms) == (3, 2)
    assert [p.mem_used_mib for p in s.points] == uses and {p.mem_granted_mib for p in s.points} == {200}
    assert math.isnan(s.points[0].mem_p90_mib) and math.isnan(s.points[0].sm_granted_pct)
    assert [e.t_s for e in s.events if e.kind == "oom"] == [1.0, 4.0]
    assert [p.t_s for p in h.series("a", since_t_s=3.0)[0].points] == [3.0, 4.0]


def test_history_is_bounded() -> None:
    h = History(max_points=5, max_series=2)
    for t in range(20):
        h.record("a", "g", HistoryPoint(float(t)), granted_before_mib=0)
    h.record("b", "g", HistoryPoint(0.0), granted_before_mib=0)
    h.record("c", "g", HistoryPoint(0.0), granted_before_mib=0)  # pushes out "a", the least recent
    assert [s.app_id for s in h.series()] == ["b", "c"]
    h2 = History(max_points=5)
    for t in range(20):
        h2.record("a", "g", HistoryPoint(float(t)), granted_before_mib=0)
    assert [p.t_s for p in h2.series()[0].points] == [15.0, 16.0, 17.0, 18.0, 19.0]


def test_sparkline_bins_and_scale() -> None:
    from vgpu.top import bins, spark

    now = 100.0
    levels = bins([40.0, 41.0, 70.0, 99.0], [1.0, 3.0, 2.0, 4.0], now, window_s=60, width=6)
    assert levels[0] == 3.0 and levels[3] == 2.0 and levels[5] == 4.0 and math.isnan(levels[1])
    assert spark(levels, 4.0) == "▆  ▅ █"


def test_every_process_on_the_gpu_is_listed_with_its_application() -> None:
    from vgpu.traces import read_trace

    trace = read_trace(TRACE)
    sim = SimBackend(["h100-80gb"])
    alloc = Allocator(sim)
    first = sorted(trace.apps)[0]
    sim.launch(first, os.getpid(), trace.apps[first])  # a vgpu application (it names this pid)
    sim.launch("other", 999_999, trace.apps[first])  # a process vgpu does not manage
    resp = pb.GetAvailableResourcesResponse(devices=[device_to_pb(d) for d in alloc.available()])
    apps = pb.ListApplicationsResponse(apps=[app_to_pb(AppInfo(first, (), None, pids=(os.getpid(),)))])
    text = ctl.devices_table(resp, apps)
    assert "Processes" in text
    procs = text.split("Processes\n")[1].splitlines()
    header = re.split(r"\s{2,}", procs[0].strip())
    assert header == ["GPU", "GI", "PID", "APP", "USER", "USED MiB", "COMMAND"]
    rows = {r["PID"]: r for r in (dict(zip(header, re.split(r"\s{2,}", line.strip()), strict=True)) for line in procs[1:])}
    assert set(rows) == {str(os.getpid()), "999999"}
    mine, other = rows[str(os.getpid())], rows["999999"]
    assert mine["APP"] == first and mine["USER"] == getpass.getuser() and mine["GPU"] == "0" and mine["GI"] == "-"
    assert float(mine["USED MiB"].replace(",", "")) > 0
    assert other["APP"] == "-" and other["USER"] == "N/A" and other["COMMAND"] == "N/A"  # not vgpu's; no such process


def test_another_users_command_line_cannot_write_to_the_operators_terminal(env: Env, serves: list[Serve]) -> None:
    """A process's command line is whatever its user wrote: escape sequences that set the terminal's
    title, clear the screen or forge a line reach `vgpu apps` and `vgpu top` as visible escapes."""
    import io

    from rich.console import Console

    from vgpu.top import Snapshot, render
    from vgpu.v1 import allocator_pb2 as pb

    serves.append(Serve(env))
    evil = "[b]X\x1b]0;OWNED\x07\x1b[2J\x1b[31mFAKE\x1b[0m\r\x9b"
    sleeper = subprocess.Popen([evil, "60"], executable="/bin/sleep")
    try:
        out = cli(env, "request", "--app", "evil", "--memory-mib", "5", "--pid", str(sleeper.pid))
        assert out.returncode == 0, out.stderr
        apps = cli(env, "apps")
        assert apps.returncode == 0, apps.stderr
        assert not any(ch in apps.stdout for ch in "\x1b\x07\r\x9b")
        assert "\\x1b]0;OWNED\\x07" in _row(apps.stdout, "evil")["COMMAND"]
        snap = Snapshot(pb.GetAvailableResourcesResponse(), pb.ListApplicationsResponse.FromString(
            _list_apps(env)), pb.GetAppHistoryResponse(), 0.0)
        screen = io.StringIO()
        Console(file=screen, width=300, color_system=None, force_terminal=False).print(render(snap))
        # escaped, and "[b]" not read as markup (the COMMAND column shows its first 24 characters)
        assert "[b]X\\x1b]0;OWNED\\x07" in screen.getvalue()
        assert not any(ch in screen.getvalue() for ch in "\x1b\x07\r\x9b")
    finally:
        sleeper.kill()
        sleeper.wait()


def _list_apps(env: Env) -> bytes:
    """ListApplications as the daemon answers it, serialised."""
    import grpc

    from vgpu.v1 import allocator_pb2 as pb
    from vgpu.v1 import allocator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix://{env.sock}") as channel:
        return pb_grpc.AllocatorStub(channel).ListApplications(pb.ListApplicationsRequest()).SerializeToString()


def test_vgpu_profiler_without_manager_streams_to_the_socket_the_node_configures(env: Env,
                                                                               serves: list[Serve]) -> None:
    """`vgpu profiler` run by hand on a node whose socket is moved (VGPU_SERVER_SOCKET, as `vgpu apps`
    reads it) finds the daemon without --manager."""
    serves.append(Serve(env))
    device = _device_uuid(env)
    prof_env = {**env.env, "VGPU_SERVER_SOCKET": str(env.sock)}
    prof = subprocess.Popen(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--replay", str(TRACE), "--device-id", device,
         "--token-file", str(env.state / "tokens" / "profiler.token"), "--loop", "--seconds", "30"],
        cwd=ROOT, env=prof_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: any(a.get("mem_used_mib") for a in env.json("apps").get("apps", [])), 30.0)
    finally:
        prof.terminate()
        _, err = prof.communicate(timeout=30)
    assert "unix:///run/vgpu/vgpu.sock" not in err


def test_a_request_taken_on_the_operators_authority_after_a_refusal_says_so(env: Env, serves: list[Serve]) -> None:
    """`vgpu request --pid` of a process that does not run here, by a user who holds the application's
    token and can read the operator's: the daemon refuses the application's token for that pid, the
    operator token is sent next and taken, and the user is told."""
    serves.append(Serve(env))
    r = cli(env, "request", "--app", "by-hand", "--memory-mib", "100")  # the application's token, cached
    assert r.returncode == 0 and "operator token" not in r.stderr, r.stderr
    gone = 4_194_303  # above any pid this machine hands out (pid_max's ceiling)
    r = cli(env, "request", "--app", "by-hand", "--memory-mib", "100", "--pid", str(gone))
    assert r.returncode == 0, r.stderr
    assert "sent with the operator token after the daemon refused this user's own (" in r.stderr, r.stderr
    assert str(gone) in r.stderr
