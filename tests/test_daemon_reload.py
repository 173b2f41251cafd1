"""Hot reload of the forecaster in a real `vgpu serve`: a checkpoint renamed over the configured one is
swapped in while a real `vgpu profiler` keeps streaming (no reconnect, forecasts go on); a corrupt file
put there afterwards is logged and the loaded model keeps serving."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from daemon_fixtures import ROOT, Env, Serve, make_env, metric_samples, wait_for

from tests.checkpoint_synth import write_tiny_checkpoint
from vgpu.traces import AppTrace, write_trace


def _until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    # generous: it ends as soon as `check()` holds, and a loaded machine can take seconds for it
    wait_for(what, check, timeout_s, poll_s=0.05)


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write aside, then rename over: what an operator (or `vgpu train --out`) should do."""
    tmp = path.with_name(path.name + ".new")
    write(tmp)
    os.replace(tmp, path)


@pytest.mark.parametrize("mixture", [True, False], ids=["mixture", "model-alone"])
def test_a_new_checkpoint_is_swapped_in_without_dropping_the_stream(tmp_path: Path, serves: list[Serve],
                                                                     mixture: bool) -> None:
    """With the expert mixture on (the default) the model is its expert and "mixture" serves; with
    `manager.mixture` off the model serves alone. The reload counts the same either way."""
    env: Env = make_env(tmp_path)
    env.env["VGPU_MANAGER_MODEL_CHECK_INTERVAL_S"] = "0.2"
    env.env["VGPU_MANAGER_MIXTURE"] = "true" if mixture else "false"
    serving = "mixture" if mixture else "model"
    model = write_tiny_checkpoint(tmp_path / "model.pt", seed=1)
    serves.append(Serve(env, "--model", str(model), "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    daemon = serves[-1]
    assert daemon.event("forecaster")["serving"] == serving  # as vgpu_forecaster_serving says, below

    t = np.arange(0.0, 200.0, 0.5)
    trace = tmp_path / "trace.csv"
    write_trace(trace, [
        AppTrace("train-a", t, {"mem_used_mib": 4000 + 10 * t, "sm_util_pct": np.full(len(t), 60.0)}),
        AppTrace("infer-b", t, {"mem_used_mib": np.full(len(t), 1500.0), "sm_util_pct": np.full(len(t), 20.0)}),
    ])
    device = env.json("available")["devices"][0]["device_id"]
    profiler_log = tmp_path / "profiler.log"
    with open(profiler_log, "w") as plog:
        profiler = subprocess.Popen(
            [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{env.sock}", "--replay", str(trace),
             # streams until stopped below once every check is done (looping, for up to 2 minutes), not
             # for a fixed 12 s: on a loaded machine the checks can outlast a short run, whose end
             # would stop the forecasts the last one waits for
             "--speed", "10", "--loop", "--seconds", "120", "--device-id", device,
             "--token-file", str(env.state / "tokens" / "profiler.token")],
            cwd=ROOT, env=env.env, stdout=subprocess.DEVNULL, stderr=plog,
        )
        try:
            def ticks() -> float:
                return metric_samples(port).get(("vgpu_forecast_batch_seconds_count", ()), 0.0)

            _until("the first forecasts", lambda: ticks() > 0)

            # 1. a new valid checkpoint, renamed over the configured one
            _replace(model, lambda p: write_tiny_checkpoint(p, seed=2, bias=0.1))
            daemon.wait_for("forecaster_reloaded", 60.0)
            reloaded = daemon.event("forecaster_reloaded")
            assert reloaded["path"] == str(model) and reloaded["model"] == "model" and "serving" not in reloaded and reloaded["reloads"] == 1
            after_swap = ticks()
            _until("forecasts after the swap", lambda: ticks() > after_swap)
            m = metric_samples(port)
            assert m[("vgpu_forecaster_reloads_total", (("result", "ok"),))] == 1
            assert m[("vgpu_forecaster_serving", (("forecaster", serving),))] == 1

            # 2. a corrupt file: logged, the loaded model keeps serving
            _replace(model, lambda p: p.write_bytes(b"\x00 not a checkpoint"))
            daemon.wait_for("forecaster_reload_failed", 60.0)
            failed = daemon.event("forecaster_reload_failed")
            assert failed["path"] == str(model) and failed["model"] == "model" and failed["error"]
            after_corrupt = ticks()
            _until("forecasts after the corrupt file", lambda: ticks() > after_corrupt)
            m = metric_samples(port)
            assert m[("vgpu_forecaster_reloads_total", (("result", "failed"),))] == 1
            assert m[("vgpu_forecaster_reloads_total", (("result", "ok"),))] == 1
            assert m[("vgpu_forecaster_serving", (("forecaster", serving),))] == 1
            assert m.get(("vgpu_forecast_failures_total", ()), 0.0) == 0
            apps = {a["app_id"]: a for a in env.json("apps")["apps"]}
            assert set(apps) == {"train-a", "infer-b"}
            assert all(a["forecast_mem_p90_mib"] > 0 and a["grants"] for a in apps.values())
        finally:
            profiler.terminate()
            rc = profiler.wait(30)
    # one connection for the whole run: the swaps dropped no stream
    text = profiler_log.read_text()
    assert rc in (0, -15), text
    assert text.count("connected to manager") == 1, text
    assert "reconnecting" not in text and "lost the manager stream" not in text, text
    assert daemon.term() == 0
