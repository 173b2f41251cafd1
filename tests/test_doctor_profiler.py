"""`vgpu doctor` checks that a profiler streams to the daemon and how old each GPU's newest signature
is: against a real `vgpu serve` (without, then with a replay profiler), and each verdict against a
server that answers with chosen figures."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon_fixtures import ROOT, Env, Serve, wait_for
from tests.test_operator_views import cli, start_profiler
from vgpu.allocator.service import build_server
from vgpu.daemon import doctor
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc


def run_doctor(env: Env, *extra: str) -> tuple[int, list[dict[str, str]]]:
    out = subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "doctor", "--socket", str(env.sock), "--state-dir", str(env.state),
         "--backend", "sim:h100-80gb", "--json", *extra],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=120, check=False,
    )
    return out.returncode, [c for c in json.loads(out.stdout) if c["name"] == "profiler"]


def test_doctor_against_a_daemon_without_then_with_a_profiler(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    rc, checks = run_doctor(env)
    assert rc == 1
    assert [c["status"] for c in checks] == ["FAIL"] and "no profiler is streaming" in checks[0]["detail"]
    # the hint names the service and, for a daemon started by hand, the command line with this
    # daemon's socket, profiler token and backend; that command line, run as given, opens a stream
    detail = checks[0]["detail"]
    assert "systemctl start vgpu-profiler" in detail and "or without systemd: vgpu profiler " in detail, detail
    hinted = shlex.split(detail.split("or without systemd: ", 1)[1])
    token = env.state / "tokens" / "profiler.token"
    assert hinted == ["vgpu", "profiler", "--manager", str(env.sock), "--token-file", str(token),
                      "--backend", "sim:h100-80gb"], detail
    by_hand = subprocess.Popen([sys.executable, "-m", "vgpu.cli", *hinted[1:], "--seconds", "60"], cwd=ROOT,
                               env=env.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for("the hinted profiler's stream", lambda: env.json("available").get("profiler_streams_open", 0) > 0,
                 timeout_s=60)
    finally:
        by_hand.terminate()
        assert by_hand.wait(10) == 0
    wait_for("the hinted profiler's stream to close",
             lambda: env.json("available").get("profiler_streams_open", 0) == 0, timeout_s=30)

    device = json.loads(cli(env, "available", "--json").stdout)["devices"][0]["device_id"]
    prof = start_profiler(env, device)
    try:
        # Each doctor run is a process that loads the forecaster (seconds): ask the daemon in this
        # process until the stream is open and a signature has arrived, then let doctor say so.
        def streamed() -> bool:
            (dev,) = env.json("available")["devices"]
            return bool(dev.get("profiler_streams")) and dev.get("newest_signature_age_s") is not None

        wait_for("the profiler's first signature", streamed, timeout_s=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _, checks = run_doctor(env)
            if checks and checks[0]["status"] == "OK" and "newest signature" in checks[0]["detail"]:
                break
            time.sleep(0.5)
        assert checks[0]["status"] == "OK", checks
        assert checks[0]["detail"].startswith(f"GPU 0 ({device}): 1 stream, newest signature ")
    finally:
        prof.terminate()
        prof.wait(10)


class _Answers(pb_grpc.AllocatorServicer):
    def __init__(self, resp: pb.GetAvailableResourcesResponse) -> None:
        self.resp = resp

    async def GetAvailableResources(self, request: pb.GetAvailableResourcesRequest, context: object  # noqa: N802
                                    ) -> pb.GetAvailableResourcesResponse:
        return self.resp


def _dev(index: int, granted: float, age: float | None, streams: int = 1) -> pb.DeviceResources:
    d = pb.DeviceResources(device_id=f"GPU-{index}", index=index, mem_granted_mib=granted, profiler_streams=streams)
    if age is not None:
        d.newest_signature_age_s = age
    return d


@pytest.mark.parametrize(("devices", "streams_open", "want"), [
    ([_dev(0, 100, 0.5)], 1, [("OK", "newest signature 0.5 s ago")]),
    ([_dev(0, 100, 42.0)], 1, [("FAIL", "forecasts are stale")]),
    ([_dev(0, 0, 42.0, 0)], 1, [("WARN", "no grants on it")]),
    ([_dev(0, 0, None, 0)], 1, [("OK", "idle")]),
    ([_dev(0, 100, None, 0)], 1, [("FAIL", "no signature has arrived")]),
    ([_dev(0, 100, 0.2), _dev(1, 100, None, 0)], 1, [("OK", "GPU 0"), ("FAIL", "GPU 1")]),
    ([_dev(0, 100, 0.2)], 0, [("FAIL", "no profiler is streaming")]),
    ([_dev(0, 100, 0.2)], None, [("WARN", "does not report")]),
])
async def test_profiler_verdicts(tmp_path: Path, devices: list[pb.DeviceResources], streams_open: int | None,
                                 want: list[tuple[str, str]]) -> None:
    import asyncio

    resp = pb.GetAvailableResourcesResponse(devices=devices)
    if streams_open is not None:
        resp.profiler_streams_open = streams_open
    sock = tmp_path / "s.sock"
    server = build_server(f"unix:{sock}", allocator_servicer=_Answers(resp))
    await server.start()
    try:
        checks = await asyncio.to_thread(doctor.check_profilers, sock, tmp_path, max_age_s=10)
    finally:
        await server.stop(0)
    assert [(c.status, c.name) for c in checks] == [(s, "profiler") for s, _ in want]
    for check, (_, text) in zip(checks, want, strict=True):
        assert text in check.detail


def test_an_unreachable_daemon_is_not_checked(tmp_path: Path) -> None:
    (check,) = doctor.check_profilers(tmp_path / "none.sock", tmp_path, max_age_s=10, timeout_s=0.5)
    assert check.status == "WARN" and "did not answer" in check.detail
