"""A real `vgpu serve` on a state directory an older vgpu left, with a node-local model that does not
load: the upgrade's copy of the database is named in the log, and the unusable model shows in the
metrics, `vgpu model status` and `vgpu doctor` (subprocesses, as an operator runs them) until a model
that loads replaces it."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from daemon_fixtures import ROOT, Env, Serve, make_env, metric_samples, wait_for

from tests.checkpoint_synth import write_tiny_checkpoint
from vgpu.allocator.store import SCHEMA_VERSION, Store


def _cli(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", *args], cwd=ROOT, env=env.env, capture_output=True,
                          text=True, timeout=120)


def test_an_upgrade_names_its_copy_and_an_unusable_local_model_shows_everywhere(tmp_path: Path,
                                                                                 serves: list[Serve]) -> None:
    env = make_env(tmp_path)
    env.env["VGPU_MANAGER_MODEL_CHECK_INTERVAL_S"] = "0.2"  # the node-local model's poll, too
    # what the vgpu of schema 5 left: schema 6 added only a field a grant's record may hold (none here)
    Store(env.state).close()
    old = 5
    assert SCHEMA_VERSION == 6, "a newer schema: make this database as the one before it left it"
    db = sqlite3.connect(env.state / "vgpu.sqlite3")
    db.execute(f"UPDATE meta SET value='{old}' WHERE key='schema_version'")
    db.commit()
    db.close()
    models = env.state / "models"
    models.mkdir()
    local = models / "local.pt"
    sound = write_tiny_checkpoint(tmp_path / "sound.pt", seed=3)
    local.write_bytes(sound.read_bytes()[:1000])  # a copy cut short
    trees = models / "trees.json"
    trees.write_text('{"format": "vgpu-node-trees", "version": 1, "models": {')  # node-local trees cut short

    serves.append(Serve(env, "--metrics-port", "auto"))
    daemon = serves[-1]
    upgraded = daemon.event("state_upgraded")
    copy = env.state / f"vgpu.sqlite3.pre-schema-{old}"
    assert (upgraded["copy"], upgraded["from_schema"], upgraded["to_schema"]) == (str(copy), old, SCHEMA_VERSION)
    db = sqlite3.connect(copy)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(old)
    db.close()

    port = daemon.metrics_port

    def local_state() -> dict[str, float]:
        m = metric_samples(port)
        return {s: m[("vgpu_local_model_state", (("state", s),))] for s in ("serving", "unusable", "none")}

    wait_for("the local model's state", lambda: local_state()["unusable"] == 1, 60.0)
    assert local_state() == {"serving": 0, "unusable": 1, "none": 0}
    m = metric_samples(port)
    assert m[("vgpu_local_model_loads_total", (("result", "failed"),))] == 1
    assert m[("vgpu_local_model_loads_total", (("result", "ok"),))] == 0
    assert "local_model_unusable" in [e.get("event") for e in daemon.events()]
    wait_for("the trees' state", lambda: metric_samples(port).get(("vgpu_node_trees_state", (("state", "unusable"),))) == 1,
             60.0)
    assert metric_samples(port)[("vgpu_node_trees_loads_total", (("result", "failed"),))] == 1
    assert "node_trees_unusable" in [e.get("event") for e in daemon.events()]

    status = _cli(env, "model", "status", "--state-dir", str(env.state))
    assert status.returncode == 0, status.stderr
    said = json.loads(status.stdout)
    assert said["local_model"] == str(local) and said["local_model_loads"] is False
    assert "truncated or corrupt" in said["local_model_problem"]
    # no promotion is logged: the advice is the doctor's, to remove it, not a rollback that would refuse
    assert f"{local} does not load" in status.stderr and f"remove {local}" in status.stderr
    assert "model rollback" not in status.stderr
    assert "weights_only" not in said["local_model_problem"]  # torch's advice, not for a file of unknown origin
    assert said["trees"] == str(trees) and said["trees_loads"] is False and "not JSON" in said["trees_problem"]

    doctor = _cli(env, "doctor", "--socket", str(env.sock), "--state-dir", str(env.state), "--json")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["local model"]["status"] == "WARN", doctor.stdout
    assert f"{local} does not load" in checks["local model"]["detail"]
    assert f"remove {local}" in checks["local model"]["detail"]  # no promotion logged: nothing to roll back to
    assert checks["node trees"]["status"] == "WARN", doctor.stdout
    assert checks["node trees"]["detail"].startswith(f"{trees}: not JSON")
    assert f"remove {trees} (no earlier trees that load" in checks["node trees"]["detail"]

    tmp = models / ".local.pt.new"
    tmp.write_bytes(sound.read_bytes())
    os.replace(tmp, local)
    wait_for("the sound local model to serve", lambda: local_state()["serving"] == 1, 60.0)
    assert local_state() == {"serving": 1, "unusable": 0, "none": 0}
    assert metric_samples(port)[("vgpu_local_model_loads_total", (("result", "ok"),))] == 1
    assert json.loads(_cli(env, "model", "status", "--state-dir", str(env.state)).stdout)["local_model_loads"] is True
    doctor = _cli(env, "doctor", "--socket", str(env.sock), "--state-dir", str(env.state), "--json")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["local model"] == {"name": "local model", "status": "OK", "detail": f"{local} loads"}
    assert daemon.term() == 0
