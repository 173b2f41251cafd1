"""`vgpu profiler --replay` against a real `vgpu serve`: signatures for a device the daemon does not have
are rejected with the reason and counted, and the profiler says so; an unknown `--device-id` stops it at
start; a profiler that never reaches the manager exits non-zero."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

from daemon_fixtures import ROOT, Env, Serve

DEMO = ROOT / "vgpu" / "data" / "demo_trace.csv.gz"


def profiler(env: Env, *extra: str, sock: Path | None = None, seconds: float = 2.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{sock or env.sock}", "--replay", str(DEMO),
         "--speed", "20", "--seconds", str(seconds), "--token-file", str(env.state / "tokens" / "profiler.token"),
         "--log-format", "console", *extra],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=90, check=False,
    )


def test_signatures_for_an_unknown_device_are_rejected_and_said(env: Env, serves: list[Serve]) -> None:
    serve = Serve(env, "--metrics-port", "auto")
    serves.append(serve)
    port = serve.metrics_port
    r = profiler(env)  # no --device-id: the trace's own gpu ids, which this daemon does not have
    assert r.returncode == 0, r.stderr
    assert "manager rejected signatures" in r.stderr and "unknown device" in r.stderr
    assert "the manager rejected" in r.stderr.splitlines()[-1]
    assert serve.event("signatures_rejected_unknown_device")["device"]
    assert env.json("apps")["apps"] == []
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith('vgpu_signatures_total{result="unknown_device"}')]
    assert float(line.split()[-1]) > 0


def test_a_device_id_the_daemon_lacks_stops_the_profiler_at_start(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    device = env.json("available")["devices"][0]["device_id"]
    r = profiler(env, "--device-id", "GPU-not-here")
    assert r.returncode == 2
    assert "--device-id 'GPU-not-here' is not a device of the daemon" in r.stderr and device in r.stderr
    ok = profiler(env, "--device-id", device)
    assert ok.returncode == 0, ok.stderr
    assert "manager rejected signatures" not in ok.stderr
    assert {a["app_id"] for a in env.json("apps")["apps"]}


def test_device_id_takes_the_gpu_index_as_every_device_flag_does(env: Env, serves: list[Serve]) -> None:
    """`--device-id 0` names the GPU `vgpu available` lists at IDX 0, as `vgpu request --device 0`
    does; an index the daemon has no GPU for stops the profiler at start, naming the GPUs it has."""
    serves.append(Serve(env))
    (gpu,) = env.json("available")["devices"]
    assert gpu["index"] == 0
    ok = profiler(env, "--device-id", "0")
    assert ok.returncode == 0, ok.stderr
    assert "manager rejected signatures" not in ok.stderr
    apps = env.json("apps")["apps"]
    assert apps and {a["device_id"] for a in apps} == {gpu["device_id"]}
    r = profiler(env, "--device-id", "7")
    assert r.returncode == 2
    assert f"--device-id 7: no GPU with index 7 on this daemon (its GPUs: 0 ({gpu['device_id']}))" in r.stderr, r.stderr


def test_a_profiler_that_never_reaches_the_manager_fails(env: Env) -> None:
    (env.state / "tokens").mkdir(parents=True)
    (env.state / "tokens" / "profiler.token").write_text("vgpu1.cHJvZmlsZXI.00\n")
    r = profiler(env, sock=env.tmp / "nobody-here.sock", seconds=1.5)
    assert r.returncode == 1
    assert "never reached the manager" in r.stderr
    # a GPU index needs the daemon to look it up: said at start, with the way round it
    r = profiler(env, "--device-id", "0", sock=env.tmp / "nobody-here.sock", seconds=1.5)
    assert r.returncode == 2 and "--device-id 0 is a GPU index, which only the daemon can look up" in r.stderr
    assert "give the GPU's UUID" in r.stderr
