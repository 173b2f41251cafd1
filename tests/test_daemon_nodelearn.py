"""The served mixture in a real `vgpu serve`: it writes the node's history to the state directory while a
real `vgpu profiler` streams, serves a node-local model dropped in `models/local.pt` and node-local trees
in `models/trees.json`, and goes on without either when its file is corrupt."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from daemon_fixtures import ROOT, Env, Serve, make_env, wait_for

from tests.checkpoint_synth import write_tiny_checkpoint
from tests.test_nodetrees import CFG as TREES_CFG
from tests.test_nodetrees import _node as node_runs
from vgpu.manager import nodetrees as NT
from vgpu.manager.history import NodeHistory
from vgpu.traces import AppTrace, write_trace


def _until(what: str, check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    wait_for(what, check, timeout_s, poll_s=0.1)


def test_history_is_written_and_a_local_model_is_served_or_skipped(tmp_path: Path, serves: list[Serve]) -> None:
    env: Env = make_env(tmp_path)
    # the daemon looks at models/local.pt every half second, not every 5 s: the waits below for each
    # new file are that much shorter
    env.env["VGPU_MANAGER_MODEL_CHECK_INTERVAL_S"] = "0.5"
    model = write_tiny_checkpoint(tmp_path / "model.pt", seed=1)
    serves.append(Serve(env, "--model", str(model)))
    daemon = serves[-1]
    t = np.arange(0.0, 200.0, 0.5)
    trace = tmp_path / "trace.csv"
    write_trace(trace, [
        AppTrace("train-a", t, {"mem_used_mib": 4000 + 10 * t, "sm_util_pct": np.full(len(t), 60.0)}),
        AppTrace("infer-b", t, {"mem_used_mib": np.full(len(t), 1500.0), "sm_util_pct": np.full(len(t), 20.0)}),
    ])
    device = env.json("available")["devices"][0]["device_id"]
    profiler = subprocess.Popen(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{env.sock}", "--replay", str(trace),
         "--speed", "5", "--seconds", "30", "--device-id", device,
         "--token-file", str(env.state / "tokens" / "profiler.token")],
        cwd=ROOT, env=env.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        history = NodeHistory(env.state / "history")
        _until("history rows of both applications",
               lambda: {a.app for a in history.read() if len(a) >= 3} == {"train-a", "infer-b"})
        # a promoted node-local model appears: the daemon serves it as the mixture's local expert
        models = env.state / "models"
        models.mkdir(exist_ok=True)
        write_tiny_checkpoint(models / ".local.pt.tmp", seed=3)
        os.replace(models / ".local.pt.tmp", models / "local.pt")
        daemon.wait_for("local_model", 20.0)
        assert daemon.event("local_model")["serving"] == str(models / "local.pt")
        # node-local trees promoted beside it: served in the mixture's trees slot; damaged ones are not
        trees, _ = NT.learn_trees(node_runs(), None, TREES_CFG)
        assert trees is not None
        NT.save_trees(models / NT.TREES, trees)
        daemon.wait_for("node_trees", 20.0)
        assert daemon.event("node_trees")["serving"] == str(models / NT.TREES)
        (models / ".bad-trees").write_text('{"format": "vgpu-node-trees", "version": 1')
        os.replace(models / ".bad-trees", models / NT.TREES)
        daemon.wait_for("node_trees_unusable", 20.0)
        assert "remove the file" in daemon.event("node_trees_unusable")["to_act"]
        # a corrupt one: logged, the slot emptied, forecasts go on
        (models / ".bad").write_bytes(b"\x00 not a checkpoint")
        os.replace(models / ".bad", models / "local.pt")
        daemon.wait_for("local_model_unusable", 20.0)
        before = len(history.read()[0])
        _until("more history after the corrupt local model", lambda: len(history.read()[0]) > before)
        apps = {a["app_id"]: a for a in env.json("apps")["apps"]}
        assert all((a["forecast_mem_p90_mib"] or 0) > 0 for a in apps.values()), apps  # null: no forecast
    finally:
        profiler.terminate()
        profiler.wait(30)
    assert daemon.term() == 0


def test_with_node_trees_off_the_daemon_serves_none(tmp_path: Path, serves: list[Serve]) -> None:
    """`manager.node_trees = false`: a trees.json in the state directory is not served (no event, no
    metric), while the network's file is still watched; the learner child is told to fit none."""
    from daemon_fixtures import metric_samples

    env: Env = make_env(tmp_path)
    env.env["VGPU_MANAGER_NODE_TREES"] = "false"
    env.env["VGPU_MANAGER_MODEL_CHECK_INTERVAL_S"] = "0.5"
    models = env.state / "models"
    models.mkdir(parents=True)
    trees, _ = NT.learn_trees(node_runs(), None, TREES_CFG)
    assert trees is not None
    NT.save_trees(models / NT.TREES, trees)
    (models / "local.pt").write_bytes(b"not a checkpoint")  # the watcher's sign that it has looked
    serves.append(Serve(env, "--metrics-port", "auto"))
    daemon = serves[-1]
    daemon.wait_for("local_model_unusable", 30.0)
    events = [e.get("event") for e in daemon.events()]
    assert "node_trees" not in events and "node_trees_unusable" not in events
    assert not any(name.startswith("vgpu_node_trees") for name, _ in metric_samples(daemon.metrics_port))
    assert daemon.term() == 0
