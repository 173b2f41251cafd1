"""Learning on the node (manager/nodelearn.py): promotion only when the candidate beats the serving model
on the held-back history, a candidate that fails or scores worse is not promoted, an unusable local
model falls back to the global one, rollback, and `vgpu model status|rollback` as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoint_synth import write_tiny_checkpoint
from vgpu.manager import nodelearn as NL
from vgpu.manager.checkpoint import load_checkpoint
from vgpu.traces import AppTrace

ROOT = Path(__file__).resolve().parent.parent


def _node(seconds: int = 400, apps: int = 3) -> list[AppTrace]:
    """A node's history at 1 s: memory that steps every 50 s, compute that follows it."""
    out = []
    for i in range(apps):
        t = np.arange(0.0, seconds)
        mem = 2000.0 + 500.0 * ((t // 50 + i) % 3)
        out.append(AppTrace(f"job-{i}", t, {"mem_used_mib": mem, "sm_util_pct": 20 + mem / 100,
                                             "mem_total_mib": np.full(seconds, 40960.0)}, gpu="GPU-0"))
    return out


CFG = NL.LearnConfig(holdout_s=100, min_history_s=200, epochs=1, max_windows=300)


def _shifted(bias: float) -> Any:
    """A 'fine-tune' that returns the network with its P50 head biased: far off (worse) or unchanged."""
    def tune(ck: Any, traces: Sequence[AppTrace], cfg: NL.LearnConfig) -> Any:
        import copy

        model = copy.deepcopy(ck.model)
        with torch.no_grad():
            model.head_p50.bias.add_(bias)
        return model
    return tune


def test_a_candidate_that_scores_worse_is_not_promoted(tmp_path: Path) -> None:
    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1, bias=0.0)
    entry = NL.learn_once(tmp_path / "state", _node(), base, CFG, tune=_shifted(5.0))
    assert entry["event"] == "rejected" and entry["candidate_error"] > entry["serving_error"]
    assert not (tmp_path / "state" / "models" / "local.pt").exists()
    assert [e["event"] for e in NL.read_log(tmp_path / "state")] == ["rejected"]


def test_a_better_candidate_is_promoted_logged_and_rolled_back(tmp_path: Path) -> None:
    state = tmp_path / "state"
    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1, bias=3.0)  # a global model far off
    first = NL.learn_once(state, _node(), base, CFG, tune=_shifted(-3.0))
    assert first["event"] == "promoted" and first["reference"] == "global"
    assert first["candidate_error"] < first["serving_error"]
    local = state / "models" / "local.pt"
    load_checkpoint(local)
    # a second round starts from the local model; worse again is not promoted
    second = NL.learn_once(state, _node(), base, CFG, tune=_shifted(2.0))
    assert second["event"] == "rejected" and second["reference"] == "local"
    status = NL.status(state)
    assert (status["promotions"], status["rejections"], status["serving_archive"]) == (1, 1, "local-1.pt")
    back = NL.rollback(state)
    assert back["undone"] == "local-1.pt" and back["serving"] is None and not local.exists()
    with pytest.raises(LookupError):
        NL.rollback(state)


def test_rollback_restores_the_previous_promotion(tmp_path: Path) -> None:
    state = tmp_path / "state"
    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1, bias=3.0)
    NL.learn_once(state, _node(), base, CFG, tune=_shifted(-2.0))
    NL.learn_once(state, _node(), base, CFG, tune=_shifted(-1.0))
    assert NL.serving_archive(state) == ["local-1.pt", "local-2.pt"]
    NL.rollback(state)
    local = state / "models" / "local.pt"
    assert local.read_bytes() == (state / "models" / "archive" / "local-1.pt").read_bytes()


def test_an_unusable_local_model_falls_back_to_the_global_one(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    (state / "models" / "local.pt").write_bytes(b"\x00 truncated")
    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1, bias=0.0)
    entry = NL.learn_once(state, _node(), base, CFG, tune=_shifted(0.0))
    assert entry["reference"] == "global" and entry["event"] == "rejected"  # no gain: not promoted


def test_a_candidate_that_fails_is_rejected(tmp_path: Path) -> None:
    def broken(ck: Any, traces: Sequence[AppTrace], cfg: NL.LearnConfig) -> Any:
        raise ValueError("no training window in the history")

    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1)
    entry = NL.learn_once(tmp_path / "s", _node(), base, CFG, tune=broken)
    assert entry["event"] == "rejected" and "candidate failed" in entry["reason"]


def test_a_short_history_is_skipped_and_a_real_finetune_runs(tmp_path: Path) -> None:
    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1)
    assert NL.learn_once(tmp_path / "s", _node(seconds=100), base, CFG)["event"] == "skipped"
    entry = NL.learn_once(tmp_path / "s", _node(), base, CFG)  # the real fine-tune, one epoch
    assert entry["event"] in ("promoted", "rejected") and entry["candidate_error"] >= 0


def test_the_watcher_serves_local_pt_and_empties_the_slot_on_a_bad_file(tmp_path: Path) -> None:
    slot: list[object] = []
    watcher = NL.LocalModelWatcher(tmp_path, slot.append, loader=lambda p: "model@" + p.read_text())  # type: ignore[arg-type,return-value]
    watcher.poll()
    assert slot == [] and watcher.state == "none"  # no file, nothing changed
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "local.pt").write_text("v1")
    watcher.poll()
    watcher.poll()
    assert slot == ["model@v1"] and watcher.state == "serving"

    def bad(p: Path) -> object:
        raise RuntimeError("corrupt")
    watcher._loader = bad  # type: ignore[assignment]  # noqa: SLF001
    (tmp_path / "models" / "local.pt").write_text("v2 longer")
    watcher.poll()
    assert slot == ["model@v1", None] and watcher.failures == 1 and watcher.state == "unusable"
    (tmp_path / "models" / "local.pt").unlink()
    watcher.poll()
    assert slot == ["model@v1", None, None] and watcher.state == "none"


def test_cli_status_and_rollback(tmp_path: Path) -> None:
    state = tmp_path / "state"
    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1, bias=3.0)
    NL.learn_once(state, _node(), base, CFG, tune=_shifted(-3.0))

    def vgpu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "model", *args, "--state-dir", str(state)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    out = vgpu("status")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["serving_archive"] == "local-1.pt"
    out = vgpu("rollback")
    # stdout is the entry alone, one JSON document; the rollback's log event is on stderr
    assert out.returncode == 0 and json.loads(out.stdout)["undone"] == "local-1.pt", out.stderr
    assert len(out.stdout.splitlines()) == 1
    [event] = out.stderr.splitlines()
    assert "local_model_rolled_back" in event and "undone=local-1.pt" in event and "serving=None" in event
    out = vgpu("rollback")
    assert out.returncode == 1 and "nothing to roll back" in out.stderr
    assert "local_model_rolled_back" not in out.stderr and out.stdout == ""
    final = json.loads(vgpu("status").stdout)
    assert final["rollbacks"] == 1 and final["history"] == {"segment_files": 0, "bytes": 0}


def test_the_background_learner_runs_a_round_in_a_child_process(tmp_path: Path) -> None:
    from vgpu.manager.history import NodeHistory

    hist = NodeHistory(tmp_path / "history")
    for app in _node(seconds=3700, apps=2):
        n = len(app)
        hist.add([app.app] * n, ["GPU-0"] * n, app.t_s,
                 np.stack([app.columns["mem_used_mib"], app.columns["sm_util_pct"]], axis=1), [40960.0] * n)
    hist.close()
    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1)
    served: list[object] = []
    watcher = NL.LocalModelWatcher(tmp_path / "state", served.append)
    learner = NL.BackgroundLearner(tmp_path / "state", tmp_path / "history", base, watcher, interval_s=0.2,
                                   poll_s=0.1)
    learner.start()
    try:
        deadline = time.monotonic() + 180
        def network() -> list[dict[str, Any]]:  # the round's trees (manager/nodetrees.py) log their own entries first
            return [e for e in NL.read_log(tmp_path / "state") if not str(e["event"]).startswith("trees_")]

        while not network() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        learner.stop(timeout_s=60)
    (entry, *_) = network()
    assert entry["event"] in ("promoted", "rejected") and entry["train_apps"] == 2 and entry["held_back_apps"] == 2
    assert learner.rounds >= 1
    if entry["event"] == "promoted":
        assert served and served[-1] is not None  # the watcher picked local.pt up


def test_the_learners_training_traces_carry_the_in_app_counters_from_the_history(tmp_path: Path) -> None:
    from vgpu.manager.experts import make_served
    from vgpu.manager.features import INAPP_FEATURES
    from vgpu.manager.history import NodeHistory

    hist = NodeHistory(tmp_path / "history", segment_s=100)
    served = make_served(None, history=hist)
    t = np.arange(0.0, 400.0, 0.5)
    k = np.floor(t)
    cols = {"mem_used_mib": 30000.0 + 50.0 * (k % 9), "sm_util_pct": np.full(len(t), 60.0),
            "mem_total_mib": np.full(len(t), 81559.0), "inapp_requests_running": 2.0 + k % 5,
            "inapp_requests_waiting": k % 3, "inapp_kv_used_mib": 1000.0 + 50.0 * (k % 9),
            "inapp_kv_total_mib": np.full(len(t), 20000.0)}
    for s in range(10, 400, 7):  # the daemon forecasts as samples come; every few seconds is enough here
        keep = t < s + 1
        served.forecast_batch([AppTrace("svc", t[keep], {c: v[keep] for c, v in cols.items()}, gpu="GPU-0")])
    hist.close()
    history = NodeHistory(tmp_path / "history", segment_s=100).read()  # what `nodelearn learn` reads
    seen: list[Sequence[AppTrace]] = []
    features: list[np.ndarray] = []

    def spy(ck: Any, traces: Sequence[AppTrace], cfg: NL.LearnConfig) -> Any:
        seen.append(traces)
        x, _, _ = NL._dataset(traces, ck.metadata.features, cfg.max_windows, cfg.seed)
        features.append(x)
        return _shifted(0.0)(ck, traces, cfg)

    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1, version=4)
    NL.learn_once(tmp_path / "state", history, base, CFG, tune=spy)
    (traces,) = seen
    (svc,) = traces
    for c in ("inapp_requests_running", "inapp_requests_waiting", "inapp_kv_used_mib", "inapp_kv_total_mib"):
        assert np.isfinite(svc.columns[c]).all(), c
    np.testing.assert_allclose(svc.columns["inapp_requests_running"], 2.0 + svc.t_s % 5)
    # the model's in-app inputs see them: the presence flags are set in the windows it trains on
    spec = load_checkpoint(base).metadata.features
    x = features[0]
    for flag in ("requests_present", "kv_present"):
        assert flag in INAPP_FEATURES
        assert (x[:, -1, spec.features.index(flag)] == 1.0).all(), flag


def test_cli_rollback_to_a_model_missing_from_the_archive_changes_nothing(tmp_path: Path) -> None:
    """`vgpu model rollback` where the model to go back to was deleted (an archive cleaned by hand) or
    a log line names a file outside the archive (a damaged log): a message and exit 1, or the line
    left out, never a traceback or a file copied from elsewhere."""
    models = tmp_path / "state" / "models"
    (models / "archive").mkdir(parents=True)
    (models / "archive" / "local-2.pt").write_bytes(b"two")
    (models / "local.pt").write_bytes(b"two")
    (tmp_path / "outside.pt").write_bytes(b"outside")
    lines = [{"event": "promoted", "archived": "local-1.pt", "at": 1.0},
             {"event": "promoted", "archived": "../../outside.pt", "at": 1.5},
             {"event": "promoted", "archived": "local-2.pt", "at": 2.0}]
    (models / "promotions.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))

    def vgpu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "model", *args, "--state-dir", str(tmp_path / "state")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    out = vgpu("rollback")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (f"vgpu model: cannot roll back local-2.pt: the model before it, "
                                  f"{models / 'archive' / 'local-1.pt'}, is missing from the archive")
    assert (models / "local.pt").read_bytes() == b"two"
    status = json.loads(vgpu("status").stdout)
    assert status["rollbacks"] == 0 and status["serving_archive"] == "local-2.pt"


def test_cli_finds_the_state_directory_the_daemon_is_configured_with(tmp_path: Path) -> None:
    """Without --state-dir, `vgpu model` reads the daemon's configuration (the file, then
    VGPU_SERVER_STATE_DIR), as `vgpu serve` does, not the built-in /var/lib/vgpu; a configuration that
    does not load is said with the key, exit 2."""
    state = tmp_path / "configured-state"
    base = write_tiny_checkpoint(tmp_path / "global.pt", seed=1, bias=3.0)
    NL.learn_once(state, _node(), base, CFG, tune=_shifted(-3.0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}

    def vgpu(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "model", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**env, **extra})

    toml = tmp_path / "vgpu.toml"
    toml.write_text(f'[server]\nstate_dir = "{state}"\n')
    out = vgpu("status", "--config", str(toml))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["serving_archive"] == "local-1.pt"
    out = vgpu("status", VGPU_SERVER_STATE_DIR=str(state))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["promotions"] == 1
    out = vgpu("rollback", VGPU_SERVER_STATE_DIR=str(state))
    assert out.returncode == 0 and json.loads(out.stdout)["undone"] == "local-1.pt", out.stderr
    assert not (state / "models" / "local.pt").exists()
    # --state-dir still wins over the configuration
    out = vgpu("status", "--state-dir", str(tmp_path / "nowhere"), "--config", str(toml))
    assert out.returncode == 2 and f"no state directory at {tmp_path / 'nowhere'}" in out.stderr
    toml.write_text('[server]\nstate_dri = "/x"\n')
    out = vgpu("status", "--config", str(toml))
    assert out.returncode == 2 and "unknown key server.state_dri" in out.stderr and "Traceback" not in out.stderr


def test_the_promotion_log_is_rotated_and_status_and_rollback_read_the_same_after_it(tmp_path: Path) -> None:
    """A log past NL.ROTATE_AT_BYTES is rewritten at the next append as one `compacted` entry and the
    newest NL.KEEP_BYTES of entries; the promotions it summed up still count, and `vgpu model
    rollback` still goes back through them to models promoted long before."""
    models = tmp_path / "state" / "models"
    (models / "archive").mkdir(parents=True)
    one, two, three = _checkpoints(tmp_path, 3)
    for n, body in ((1, one), (2, two), (3, three)):
        (models / "archive" / f"local-{n}.pt").write_bytes(body)
    (models / "local.pt").write_bytes(three)
    lines = [{"event": "promoted", "archived": f"local-{n}.pt", "at": float(n)} for n in (1, 2, 3)]
    rejected = {"event": "rejected", "reason": "no better on the held-back history", "serving_error": 0.25,
                "candidate_error": 0.26, "train_apps": 12, "held_back_apps": 12, "holdout_s": 1800.0}
    lines += [{**rejected, "at": 10.0 + i} for i in range(NL.ROTATE_AT_BYTES // 150)]
    log = models / "promotions.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert log.stat().st_size > NL.ROTATE_AT_BYTES

    def vgpu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "model", *args, "--state-dir", str(tmp_path / "state")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    out = vgpu("rollback")  # its log entry is the append that rotates
    assert out.returncode == 0 and json.loads(out.stdout)["undone"] == "local-3.pt", out.stderr
    assert (models / "local.pt").read_bytes() == two
    assert log.stat().st_size <= NL.KEEP_BYTES + 1024
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries[0]["event"] == "compacted" and entries[0]["serving_archive"] == ["local-1.pt", "local-2.pt",
                                                                                    "local-3.pt"]
    assert entries[-1]["event"] == "rollback" and len(entries) < len(lines)
    status = json.loads(vgpu("status").stdout)
    assert status["promotions"] == 3 and status["rejections"] == len(lines) - 3 and status["rollbacks"] == 1
    assert status["serving_archive"] == "local-2.pt" and status["last"]["event"] == "rollback"
    out = vgpu("rollback")
    assert out.returncode == 0 and (models / "local.pt").read_bytes() == one
    out = vgpu("rollback")
    assert out.returncode == 0 and not (models / "local.pt").exists()  # none before local-1: the global model


def test_a_rotation_keeps_the_newest_entry_and_a_small_log_whole(tmp_path: Path) -> None:
    state = tmp_path / "state"
    NL._append_log(state, {"event": "rejected", "at": 1.0, "reason": "x" * 500}, rotate_at_bytes=100, keep_bytes=10)
    NL._append_log(state, {"event": "rejected", "at": 2.0}, rotate_at_bytes=100, keep_bytes=10)
    entries = NL.read_log(state)
    assert [e["event"] for e in entries] == ["compacted", "rejected"] and entries[1]["at"] == 2.0
    assert entries[0]["rejections"] == 1 and NL.status(state)["rejections"] == 2
    NL._append_log(state, {"event": "rejected", "at": 3.0})  # under the default bound: appended
    assert [e["at"] for e in NL.read_log(state)][1:] == [2.0, 3.0]


def test_model_status_prints_only_json_on_stdout_when_it_logs(tmp_path: Path) -> None:
    """A promotion log over NL.MAX_LOG_BYTES is read from its newest part with a
    `promotion_log_skipped` record: that record goes to stderr, so `vgpu model status | jq` still reads
    one JSON document (the record used to be printed on stdout before it)."""
    models = tmp_path / "state" / "models"
    models.mkdir(parents=True)
    entry = json.dumps({"event": "rejected", "at": 1.0, "reason": "no better on the held-back history"}) + "\n"
    (models / "promotions.jsonl").write_text(entry * (NL.MAX_LOG_BYTES // len(entry) + 100))
    out = subprocess.run([sys.executable, "-m", "vgpu.cli", "model", "status", "--state-dir", str(tmp_path / "state")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rejections"] > 0
    assert "promotion_log_skipped" in out.stderr


def _checkpoints(tmp_path: Path, n: int) -> list[bytes]:
    """`n` distinct tiny checkpoints that load (a rollback loads the model it puts back), as bytes."""
    return [write_tiny_checkpoint(tmp_path / f"body-{i}.pt", seed=i).read_bytes() for i in range(n)]


def _loads_anything(path: Path) -> object:
    """A loader for rollbacks over placeholder bodies, where what is under test is the archive's bookkeeping."""
    return path


def _promote_bodies(state: Path, bodies: Sequence[bytes]) -> None:
    """Promotions as a learning round makes them (the candidate file copied into the archive and
    `local.pt`), with small files for bodies."""
    for body in bodies:
        models_dir = NL.models_dir(state)
        models_dir.mkdir(parents=True, exist_ok=True)
        candidate = models_dir / "candidate.pt"
        candidate.write_bytes(body)
        NL.promote(state, candidate, {"at": time.time()})


def test_the_archive_keeps_the_newest_models_and_rollback_past_them_says_they_were_pruned(tmp_path: Path) -> None:
    """Every promotion past NL.KEEP_ARCHIVED deletes the oldest archived model and logs a `pruned`
    entry; `vgpu model rollback` walks back through the kept ones, and past the oldest kept one serves
    the global model and says the older ones were pruned; a kept model deleted by hand is still the
    `missing from the archive` error (exit 1, nothing changed)."""
    state = tmp_path / "state"
    models = state / "models"
    n = NL.KEEP_ARCHIVED + 3
    from structlog.testing import capture_logs

    bodies = dict(enumerate(_checkpoints(tmp_path, n), start=1))  # promotion i -> its model
    with capture_logs() as logs:
        _promote_bodies(state, [bodies[i] for i in range(1, n + 1)])
    assert [e["pruned"] for e in logs if e["event"] == "archived_models_pruned"] == [["local-1.pt"], ["local-2.pt"],
                                                                                     ["local-3.pt"]]
    kept = [f"local-{i}.pt" for i in range(4, n + 1)]
    assert sorted(p.name for p in (models / "archive").iterdir()) == sorted(kept)
    pruned = [e for e in NL.read_log(state) if e["event"] == "pruned"]
    assert [e["pruned"] for e in pruned] == [["local-1.pt"], ["local-2.pt"], ["local-3.pt"]]
    assert (models / "local.pt").read_bytes() == bodies[n]

    def vgpu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "model", *args, "--state-dir", str(state)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    status = json.loads(vgpu("status").stdout)
    assert (status["promotions"], status["pruned"], status["rollback_depth"]) == (n, 3, NL.KEEP_ARCHIVED)
    # a kept model deleted by hand is not a pruned one: the error, and local.pt unchanged
    hand_deleted = (models / "archive" / f"local-{n - 1}.pt").read_bytes()
    (models / "archive" / f"local-{n - 1}.pt").unlink()
    out = vgpu("rollback")
    assert out.returncode == 1 and "is missing from the archive" in out.stderr and "pruned" not in out.stderr
    assert (models / "local.pt").read_bytes() == bodies[n]
    (models / "archive" / f"local-{n - 1}.pt").write_bytes(hand_deleted)
    for i in range(n - 1, 3, -1):  # back through every kept model, newest first
        out = vgpu("rollback")
        assert out.returncode == 0 and len(out.stderr.splitlines()) == 1, out.stderr
        assert "local_model_rolled_back" in out.stderr and "note=" not in out.stderr
        assert (models / "local.pt").read_bytes() == bodies[i]
    out = vgpu("rollback")  # past the oldest kept one: the global model, and why
    assert out.returncode == 0 and json.loads(out.stdout)["serving"] is None, out.stderr
    event, said = out.stderr.splitlines()
    assert "local_model_rolled_back" in event and "undone=local-4.pt" in event
    assert said == ("vgpu model: the models promoted before local-4.pt were pruned from the archive "
                    f"(only the newest {NL.KEEP_ARCHIVED} are kept): the global model serves")
    assert not (models / "local.pt").exists()
    out = vgpu("rollback")
    assert out.returncode == 1 and "nothing to roll back" in out.stderr
    assert json.loads(vgpu("status").stdout)["rollback_depth"] == 0


def test_models_rolled_back_past_are_pruned_too_and_the_archive_stays_bounded(tmp_path: Path) -> None:
    """Promote, roll back, promote again, many times: the archive never holds more than
    2 x NL.KEEP_ARCHIVED files, the serving model and the one before it are always there, and a
    rollback after a pruning rotation of the log still says the older models were pruned."""
    state = tmp_path / "state"
    archive = state / "models" / "archive"
    for round_ in range(8):
        _promote_bodies(state, [f"r{round_}-{i}".encode() for i in range(4)])
        NL.rollback(state, load=_loads_anything)
        NL.rollback(state, load=_loads_anything)
        stack = NL.serving_archive(state)
        files = {p.name for p in archive.iterdir()}
        assert len(files) <= 2 * NL.KEEP_ARCHIVED and set(stack[-2:]) <= files
        assert (state / "models" / "local.pt").read_bytes() == (archive / stack[-1]).read_bytes()
    depth = len(NL.serving_archive(state))
    assert depth == NL.KEEP_ARCHIVED - 2  # pruned at the last promotion, then two rollbacks
    # a rotation that summarises the pruned entries keeps what they meant
    NL._append_log(state, {"event": "rejected", "at": 1.0, "reason": "x" * 500}, rotate_at_bytes=100, keep_bytes=10)
    entries = NL.read_log(state)
    assert entries[0]["event"] == "compacted" and entries[0]["pruned_below"] is True and len(entries) == 2
    for _ in range(depth - 1):
        assert "note" not in NL.rollback(state, load=_loads_anything)
    last = NL.rollback(state, load=_loads_anything)
    assert last["serving"] is None and "were pruned from the archive" in last["note"]
    with pytest.raises(LookupError, match="nothing to roll back"):
        NL.rollback(state, load=_loads_anything)


def test_cli_rollback_waits_for_the_promotion_logs_lock(tmp_path: Path) -> None:
    """A promotion holds the promotion log's lock for its whole work: `vgpu model rollback` started
    meanwhile says it waits, changes nothing until the lock is released, then rolls back."""
    import fcntl
    import selectors

    state = tmp_path / "state"
    model_1, model_2 = _checkpoints(tmp_path, 2)
    _promote_bodies(state, [model_1, model_2])
    models = state / "models"
    log_before = (models / NL.LOG).read_bytes()
    holder = os.open(models / NL._LOCK, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # as a promotion in another process holds it
    proc = subprocess.Popen([sys.executable, "-m", "vgpu.cli", "model", "rollback", "--state-dir", str(state)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stderr, selectors.EVENT_READ)
        assert sel.select(timeout=60), "the rollback never said it waits"
        said = proc.stderr.readline()
        assert said.startswith("vgpu model: a promotion or rollback is under way") and "waiting" in said, said
        time.sleep(0.3)  # still waiting, and nothing changed
        assert proc.poll() is None
        assert (models / "local.pt").read_bytes() == model_2
        assert (models / NL.LOG).read_bytes() == log_before
    finally:
        os.close(holder)  # releases the lock
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(out)["undone"] == "local-2.pt" and "local_model_rolled_back" in err
    assert (models / "local.pt").read_bytes() == model_1


def test_a_promotion_waits_for_a_rollback_under_way(tmp_path: Path) -> None:
    """The lock covers the promotion from its first file: with the log locked, nothing is archived nor
    copied over local.pt until it is released."""
    import fcntl
    import threading

    state = tmp_path / "state"
    _promote_bodies(state, [b"model-1"])
    models = state / "models"
    holder = os.open(models / NL._LOCK, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    candidate = tmp_path / "candidate.pt"
    candidate.write_bytes(b"model-2")
    worker = threading.Thread(target=NL.promote, args=(state, candidate, {"at": 1.0}))
    try:
        worker.start()
        time.sleep(0.3)
        assert worker.is_alive() and not (models / "archive" / "local-2.pt").exists()
        assert (models / "local.pt").read_bytes() == b"model-1"
    finally:
        os.close(holder)
    worker.join(timeout=30)
    assert not worker.is_alive() and (models / "local.pt").read_bytes() == b"model-2"


def test_cli_status_doctor_and_rollback_with_models_that_do_not_load(tmp_path: Path) -> None:
    """`local.pt` cut short, the archived copy it should be sound, the model before it damaged (100
    bytes of noise): `vgpu model status` says which load, `vgpu doctor` warns with what to do, and
    `vgpu model rollback` refuses to install the damaged model (exit 1, nothing changed: no file, no
    log entry); once that model is sound again the rollback installs it."""
    state = tmp_path / "state"
    models = state / "models"
    (models / "archive").mkdir(parents=True)
    one, two = _checkpoints(tmp_path, 2)
    noise = bytes(np.random.default_rng(0).integers(0, 256, 100, dtype=np.uint8))
    (models / "archive" / "local-1.pt").write_bytes(noise)
    (models / "archive" / "local-2.pt").write_bytes(two)
    (models / "local.pt").write_bytes(two[:1000])
    lines = [{"event": "promoted", "archived": f"local-{n}.pt", "at": float(n)} for n in (1, 2)]
    (models / NL.LOG).write_text("".join(json.dumps(e) + "\n" for e in lines))
    log_before = (models / NL.LOG).read_bytes()

    def vgpu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", *args, "--state-dir", str(state)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    out = vgpu("model", "status")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert (status["local_model_loads"], status["serving_archive"], status["serving_archive_loads"]) == (
        False, "local-2.pt", True)
    assert (status["rollback_to"], status["rollback_to_loads"]) == ("local-1.pt", False)
    assert "truncated or corrupt" in status["local_model_problem"] and status["rollback_to_problem"]
    assert "serving_archive_problem" not in status
    local = models / "local.pt"
    assert out.stderr.startswith(f"vgpu model: {local} does not load (") and "rollback" in out.stderr

    doctor = vgpu("doctor", "--socket", str(tmp_path / "none.sock"), "--backend", "sim:h100-80gb", "--json")
    (check,) = [c for c in json.loads(doctor.stdout) if c["name"] == "local model"]
    assert check["status"] == "WARN" and check["detail"].startswith(f"{local} does not load (")
    assert f"its archived copy {models / 'archive' / 'local-2.pt'} loads" in check["detail"]

    (models / "archive" / "local-2.pt").write_bytes(noise)  # the archived copy damaged too
    doctor = vgpu("doctor", "--socket", str(tmp_path / "none.sock"), "--backend", "sim:h100-80gb", "--json")
    (check,) = [c for c in json.loads(doctor.stdout) if c["name"] == "local model"]
    assert "would refuse (local-1.pt, the model before it, does not load either)" in check["detail"]
    assert f"remove {local}" in check["detail"] and check["status"] == "WARN"
    (models / "archive" / "local-2.pt").write_bytes(two)

    out = vgpu("model", "rollback")
    assert out.returncode == 1 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"vgpu model: cannot roll back local-2.pt: the model before it, "
                                 f"{models / 'archive' / 'local-1.pt'}, does not load (")
    assert "nothing changed" in out.stderr and "local_model_rolled_back" not in out.stderr
    assert local.read_bytes() == two[:1000] and (models / NL.LOG).read_bytes() == log_before
    assert sorted(p.name for p in models.iterdir()) == [NL._LOCK, "archive", "local.pt", NL.LOG]

    (models / "archive" / "local-1.pt").write_bytes(one)
    out = vgpu("model", "rollback")
    assert out.returncode == 0 and json.loads(out.stdout)["serving"] == "local-1.pt", out.stderr
    assert local.read_bytes() == one
    status = json.loads(vgpu("model", "status").stdout)
    assert (status["local_model_loads"], status["serving_archive_loads"], status["rollback_to"]) == (True, True, None)
