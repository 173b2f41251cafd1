"""Node-local trees (manager/nodetrees.py): learnt from the node's runs, promoted only when they beat the
last value on the held-back history, saved as JSON that is checked on load, rolled back, served in the
mixture's "trees" slot, and run by the learner's child process and by `vgpu eval --online`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.checkpoint_synth import write_tiny_checkpoint
from vgpu.manager import nodelearn as NL
from vgpu.manager import nodetrees as NT
from vgpu.manager.experts import make_served
from vgpu.manager.history import NodeHistory
from vgpu.traces import AppTrace, one_second_grid

ROOT = Path(__file__).resolve().parent.parent
HORIZONS = (1, 2, 3, 4, 5)
CFG = NT.TreesConfig(holdout_s=900, min_history_s=1200, n_estimators=30, max_rows=4000, max_held_origins=4000)


def _run(i: int, start_s: float, seconds: int = 180, step_s: int = 20) -> AppTrace:
    """One run of the node's job at 1 s: loads for `step_s` seconds, then its memory steps from 500 to
    6,000 MiB at that age (what the last value cannot see coming and a run seen before tells), then busy."""
    rng = np.random.default_rng(i)
    age = np.arange(0.0, seconds)
    mem = np.where(age < step_s, 500.0, 6000.0) + rng.normal(0, 5, seconds)
    sm = np.where(age < step_s, 2.0, 85.0) + rng.normal(0, 2, seconds)
    return AppTrace(f"run-{i}", start_s + age, {"mem_used_mib": np.maximum(mem, 0), "sm_util_pct": np.clip(sm, 0, 100),
                                                "mem_total_mib": np.full(seconds, 24576.0)}, gpu="GPU-0")


def _node(runs: int = 12) -> list[AppTrace]:
    return [_run(i, 200.0 * i) for i in range(runs)]  # one run after another on one clock


def test_trees_learn_a_step_at_a_fixed_age_and_are_promoted() -> None:
    trees, entry = NT.learn_trees(_node(), None, CFG)
    assert entry["event"] == "promoted" and trees is not None
    assert entry["candidate_error"] < 0.98, entry
    # a new run at second 15, 5 s before its step: the last value says 500 MiB; the trees say it steps
    run = _run(99, 0.0)
    prefix = run.t_s < 16
    (fc,) = trees.forecast_batch([AppTrace("new", run.t_s[prefix], {c: v[prefix] for c, v in run.columns.items()})])
    assert fc.mem_p50_mib[-1] > 3000.0, fc.mem_p50_mib  # horizon 5 s: second 20, after the step
    assert fc.mem_p50_mib[0] < 1000.0, fc.mem_p50_mib  # horizon 1 s: second 16, still loading


def test_no_promotion_without_a_gain_over_the_serving_trees_or_enough_history() -> None:
    node = _node()
    trees, _ = NT.learn_trees(node, None, CFG)
    # the same history again: the candidate equals the serving trees, so it is no better
    again, entry = NT.learn_trees(node, trees, CFG)
    assert again is None and entry["event"] == "rejected" and entry["reason"] == "no better on the held-back history"
    assert entry["candidate_error"] == pytest.approx(entry["serving_error"])
    short, entry = NT.learn_trees(node[:3], None, CFG)
    assert short is None and entry["event"] == "skipped" and "spans" in entry["reason"]
    none, entry = NT.learn_trees([], None, CFG)
    assert none is None and entry["event"] == "skipped"


def test_a_history_the_last_value_already_forecasts_exactly_promotes_nothing() -> None:
    flat = [AppTrace(f"idle-{i}", 200.0 * i + np.arange(0.0, 180), {"mem_used_mib": np.full(180, 300.0),
                                                                      "sm_util_pct": np.zeros(180)}) for i in range(12)]
    trees, entry = NT.learn_trees(flat, None, CFG)
    assert trees is None and entry["reason"] == "nothing on the held-back history to judge by"


def test_saved_trees_load_and_forecast_the_same(tmp_path: Path) -> None:
    trees, _ = NT.learn_trees(_node(), None, CFG)
    assert trees is not None
    NT.save_trees(tmp_path / "trees.json", trees)
    loaded = NT.load_trees(tmp_path / "trees.json")
    histories = [_run(50 + k, 0.0, seconds=12 + 3 * k) for k in range(4)]
    for a, b in zip(trees.forecast_batch(histories), loaded.forecast_batch(histories), strict=True):
        assert a.mem_p50_mib == b.mem_p50_mib and a.sm_p90_pct == b.sm_p90_pct
    assert loaded.info == trees.info and loaded.info["train_apps"] > 0


def _one(doc: dict[str, Any], change: Any) -> dict[str, Any]:
    """`doc` with its whole set of models, one of them changed by `change`."""
    models = dict(doc["models"])
    models["mem_used_mib/1/0.5"] = change(dict(models["mem_used_mib/1/0.5"]))
    return doc | {"models": models}


def _chain(doc: dict[str, Any], roots: int, depth: int) -> dict[str, Any]:
    """A model whose every root leads down one chain `depth` levels long: with many roots on one chain
    (shared nodes) or a deep one, each forecast walks far more than any fitted model would."""
    n = 2 * depth + 1
    chain = {"feature": [0] * depth + [-1] * (depth + 1), "threshold": [0.0] * n, "value": [0.0] * n,
             "missing": [0] * n, "default_left": [True] * n, "left": [], "right": []}
    for i in range(depth):  # inner node i: left to the next inner node, right to leaf depth + i
        chain["left"].append(i + 1 if i + 1 < depth else depth)
        chain["right"].append(depth + 1 + i)
    chain["left"] += list(range(depth, n))
    chain["right"] += list(range(depth, n))
    return _one(doc, lambda m: chain | {"roots": [0] * roots})


def _doc(tmp_path: Path) -> dict[str, object]:
    trees, _ = NT.learn_trees(_node(), None, CFG)
    assert trees is not None
    return trees.to_json()


@pytest.mark.parametrize(("damage", "said"), [
    (lambda d: "{not json", "not JSON"),
    (lambda d: json.dumps([1, 2]), "not a vgpu-node-trees document"),
    (lambda d: json.dumps(d | {"version": 99}), "version 99"),
    (lambda d: json.dumps(d | {"n_features": 3}), "feature count 3"),
    (lambda d: json.dumps(d | {"models": {"mem_used_mib/1/0.5": "tree\nnonsense"}}), "not an object of arrays"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"left": m["left"][:-1]})), "different lengths"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"feature": [99] * len(m["feature"])})), "feature index outside"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"left": [0] * len(m["left"])})), "not in pre-order"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"value": ["x"] * len(m["value"])})), "not arrays of numbers"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"value": ["1"] * len(m["value"])})), "value holds a value of another kind"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"default_left": ["false"] * len(m["value"])})), "of another kind"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"feature": [True] * len(m["value"])})), "of another kind"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"value": [1e300] * len(m["value"])})), "leaf value beyond"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"roots": m["roots"] * 40})), "over 1000 trees"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"roots": m["roots"][:1] * 2})), "roots that do not start"),
    (lambda d: json.dumps(_chain(d, 1, 40)), "deeper than 32"),
    (lambda d: json.dumps(_chain(d, 300, 30)), "roots that do not start"),  # 300 trees on one chain
    (lambda d: json.dumps(_one(d, lambda m: {  # node 2 is node 0's right child and node 1's left one
        "feature": [0, 0, -1, -1], "threshold": [0.0] * 4, "value": [0.0] * 4, "missing": [0] * 4,
        "default_left": [True] * 4, "left": [1, 2, 2, 3], "right": [2, 3, 2, 3], "roots": [0]})),
     "shared between branches or trees"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"roots": [10**9]})), "roots that do not start"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"threshold": [1e400] * len(m["threshold"])})), "not finite"),
    (lambda d: json.dumps(_one(d, lambda m: m | {"left": [10**30] * len(m["left"])})), "out of range"),
    (lambda d: json.dumps(d | {"models": {"mem_used_mib/1/0.5": d["models"]["mem_used_mib/1/0.5"]}}),
     "some horizons or quantiles missing"),
    (lambda d: json.dumps(d | {"models": {"../../etc/1/0.5": "x"}}), "keyed target/horizon/quantile"),
    (lambda d: "[" * 100000 + "]" * 100000, "not JSON"),
])
def test_a_damaged_trees_file_is_refused_with_one_line(tmp_path: Path, damage, said: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "trees.json"
    path.write_text(damage(_doc(tmp_path)))
    with pytest.raises(NT.TreesError) as err:
        NT.load_trees(path)
    assert said in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)[:400]


def test_a_trees_file_over_the_size_bound_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NT, "MAX_FILE_BYTES", 100)
    path = tmp_path / "trees.json"
    path.write_text("x" * 200)
    with pytest.raises(NT.TreesError, match="larger than 100 bytes"):
        NT.load_trees(path)
    with pytest.raises(NT.TreesError, match="No such file"):
        NT.load_trees(tmp_path / "absent.json")


def test_rounds_promote_log_and_roll_back(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = NT.learn_round(state, _node(), CFG)
    current, previous = NT.trees_paths(state)
    assert first["event"] == "trees_promoted" and current.exists() and not previous.exists()
    second = NT.learn_round(state, _node(), CFG)
    assert second["event"] == "trees_rejected"
    events = [e["event"] for e in NL.read_log(state)]
    assert events == ["trees_promoted", "trees_rejected"]
    # the network's summary is not disturbed by the trees' entries
    assert NL.status(state)["promotions"] == 0 and NL.status(state)["rejections"] == 0
    said = NT.trees_status(state, NL.read_log(state))
    assert said["trees_loads"] is True and said["trees_promotions"] == 1 and said["trees_rejections"] == 1
    rolled = NT.rollback_trees(state)
    assert rolled["serving"] is None and not current.exists()  # none were promoted before
    with pytest.raises(LookupError, match="no node-local trees serve"):
        NT.rollback_trees(state)


def test_a_rollback_to_trees_that_do_not_load_changes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    NT.learn_round(state, _node(), CFG)
    current, previous = NT.trees_paths(state)
    previous.write_text("{}")
    before = current.read_bytes()
    with pytest.raises(LookupError, match="previous ones do not load"):
        NT.rollback_trees(state)
    assert current.read_bytes() == before and previous.read_text() == "{}"


def test_the_watcher_serves_the_trees_in_the_mixture_and_empties_the_slot_on_a_bad_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    mixture = make_served(None, local=True)
    assert mixture.expert_names == ("last_value", "model", "local", "trees")
    watcher = NL.LocalModelWatcher(state, lambda m: mixture.set_expert("trees", m), NT.load_trees,
                                   filename=NT.TREES, what="node_trees")
    watcher.poll()
    assert watcher.state == "none" and mixture.expert("trees") is None
    NT.learn_round(state, _node(), CFG)
    watcher.poll()
    assert watcher.state == "serving" and isinstance(mixture.expert("trees"), NT.NodeTrees)
    NT.trees_paths(state)[0].write_text("{broken")
    watcher.poll()
    assert watcher.state == "unusable" and mixture.expert("trees") is None and watcher.failures == 1


def test_the_served_mixture_learns_to_lead_a_step_the_trees_know(tmp_path: Path) -> None:
    """A new run of the node's job, forecast second by second by the served mixture with the trees
    in their slot: before its step the served median 5 s ahead is well above the last value (500 MiB;
    the mixture weighs the trees by their error on the run so far, so it does not take all of it)."""
    trees, _ = NT.learn_trees(_node(), None, CFG)
    mixture = make_served(None, local=True)
    mixture.set_expert("trees", trees)
    lead = []
    for i in range(3):  # the mixture's weights learn over the node's runs, as in the daemon
        run = _run(200 + i, 0.0)
        for s in range(1, 60):
            keep = run.t_s < s
            (fc,) = mixture.forecast_batch([AppTrace(f"new-{i}", run.t_s[keep], {c: v[keep] for c, v in run.columns.items()})])
            if s == 17:  # origin second 16: the step comes at 20
                lead.append(fc.mem_p50_mib[-1])
    assert lead[-1] > 1000.0, lead


def test_the_learner_child_runs_a_trees_round_from_the_node_history(tmp_path: Path) -> None:
    state = tmp_path / "state"
    hist = NodeHistory(state / "history", segment_s=600)
    for run in _node(runs=20):  # 4,000 s: a round needs an hour of history
        values = np.stack([run.columns["mem_used_mib"], run.columns["sm_util_pct"]], axis=1)
        hist.add([run.app] * len(run), ["GPU-0"] * len(run), run.t_s, values, [24576.0] * len(run))
    hist.close()
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu.manager.nodelearn", "learn", "--state-dir", str(state), "--history-dir",
         str(state / "history"), "--global-model", str(write_tiny_checkpoint(tmp_path / "global.pt", seed=1))],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]  # log records go beside them
    assert [x["round"] for x in lines] == ["trees", "network"], proc.stderr
    assert lines[0]["event"] == "trees_promoted", lines[0]
    assert NT.load_trees(NT.trees_paths(state)[0]).info["train_apps"] > 0


def test_the_array_path_reads_the_protocol_grid_of_any_history() -> None:
    """The serving path builds every history's grid at once; its forecasts must equal those from each
    history's own protocol grid (samples at 100 ms and irregular, gaps, missing values, several a
    second, a target with no value, an empty history)."""
    trees, _ = NT.learn_trees(_node(), None, CFG)
    assert trees is not None
    rng = np.random.default_rng(7)
    histories = []
    for case in range(200):
        n = int(rng.integers(0, 400))
        t = np.sort(rng.uniform(0, rng.uniform(1, 200), n)) + 1000.0 * case
        mem = rng.normal(3000, 2000, n)
        sm = rng.uniform(0, 100, n)
        mem[rng.random(n) < rng.uniform(0, 0.9)] = np.nan
        sm[rng.random(n) < (1.0 if case % 7 == 0 else rng.uniform(0, 0.9))] = np.nan
        histories.append(AppTrace(f"a{case}", t, {"mem_used_mib": np.abs(mem), "sm_util_pct": sm}))
    arrays = trees.forecast_arrays(histories)
    for target, (k50, k90) in (("mem_used_mib", (0, 2)), ("sm_util_pct", (1, 3))):
        grids = [one_second_grid(h, target)[1] for h in histories]
        rows = [i for i, g in enumerate(grids) if len(g)]
        p50, p90 = trees.forecast_grids([grids[i] for i in rows], target)
        np.testing.assert_allclose(arrays[rows, k50], p50)
        np.testing.assert_allclose(arrays[rows, k90], p90)
        empty = [i for i, g in enumerate(grids) if not len(g)]
        assert np.isnan(arrays[empty, k50]).all() and (bool(empty) or target == "mem_used_mib")


def test_the_array_path_reads_only_the_recent_seconds_and_still_gives_the_whole_historys_forecast() -> None:
    """The serving path grids only each history's last seconds (a quarter of a 2-minute window):
    at 100 ms over 150 s, a target that starts late (its age counts from its first value), one that
    stops before its application does (its window reaches before the cut: the whole grid serves),
    a first kept sample without a value, and samples out of time order must all forecast as each
    history's own protocol grid does. The node's runs step at the age of 60 s, so the trees tell an
    age beyond the recent seconds from one within them."""
    trees, _ = NT.learn_trees([_run(i, 200.0 * i, step_s=60) for i in range(12)], None, CFG)
    assert trees is not None
    rng = np.random.default_rng(11)
    t = 5000.0 + np.arange(0.0, 150.0, 0.1)
    # the level of a run before its step, where only the age tells what comes next
    base = {"mem_used_mib": 500 + rng.normal(0, 5, len(t)), "sm_util_pct": 2 + rng.uniform(0, 2, len(t))}
    late, early, hole = ({k: v.copy() for k, v in base.items()} for _ in range(3))
    late["sm_util_pct"][t < 5100.0] = np.nan  # compute reported from its 100th second on
    early["sm_util_pct"] = np.where(t > 5130.0, np.nan, np.linspace(0.0, 100.0, len(t)))  # stops 20 s early
    hole["mem_used_mib"][t < 5110.0] = 6000.0  # high until a gap from before the cut into the window
    hole["mem_used_mib"][(t >= 5110.0) & (t < 5125.0)] = np.nan
    order = rng.permutation(len(t))
    histories = [AppTrace("whole", t, base), AppTrace("late", t, late), AppTrace("hole", t, hole)]
    early_stop = AppTrace("early", t, early)
    shuffled = AppTrace("shuffled", t[order], {k: v[order] for k, v in base.items()})
    # each of the last two alone: either keeps every history of its call whole
    arrays = np.concatenate([trees.forecast_arrays(h) for h in (histories, [early_stop], [shuffled])])
    for target, (k50, k90) in (("mem_used_mib", (0, 2)), ("sm_util_pct", (1, 3))):
        grids = [one_second_grid(h, target)[1] for h in [*histories, early_stop, shuffled]]
        p50, p90 = trees.forecast_grids(grids, target)
        np.testing.assert_allclose(arrays[:, k50], p50)
        np.testing.assert_allclose(arrays[:, k90], p90)


def test_the_array_path_equals_the_forecasts() -> None:
    trees, _ = NT.learn_trees(_node(), None, CFG)
    assert trees is not None
    histories = [_run(70 + k, 0.0, seconds=5 + 17 * k) for k in range(8)]
    histories.append(AppTrace("no-sm", np.arange(0.0, 40), {"mem_used_mib": np.full(40, 700.0)}))
    arrays = trees.forecast_arrays(histories)
    for i, fc in enumerate(trees.forecast_batch(histories)):
        np.testing.assert_allclose(arrays[i], [fc.mem_p50_mib, fc.sm_p50_pct, fc.mem_p90_mib, fc.sm_p90_pct])


def test_eval_online_runs_the_trees_rounds_as_the_daemon_does(tmp_path: Path) -> None:
    """`vgpu eval --online` as a user runs it, on a node whose job repeats: `served` runs a trees round
    every hour of node time on what it has seen, reports each, and with the trees promoted leads the
    step the last value cannot see; with `--node-learn-every-s 0` it runs none."""
    rows = ["t_s,app,gpu,mem_used_mib,sm_util_pct,mem_total_mib"]
    for run in _node(runs=30):
        for k in range(len(run)):
            rows.append(f"{run.t_s[k]:.1f},{run.app},GPU-0,{run.columns['mem_used_mib'][k]:.1f},"
                        f"{run.columns['sm_util_pct'][k]:.2f},24576")
    trace = tmp_path / "node.csv"
    trace.write_text('#meta {"clock": "shared"}\n' + "\n".join(rows) + "\n")

    model = write_tiny_checkpoint(tmp_path / "tiny.pt", seed=1)  # the mixture's model slot; a small one is quick

    def served_mae(every_s: int) -> tuple[dict[str, float], list[dict[str, object]]]:
        proc = subprocess.run([sys.executable, "-m", "vgpu.cli", "eval", "--trace", str(trace), "--split", "all",
                               "--online", "--methods", "served,last_value", "--node-learn-every-s", str(every_s),
                               "--model", str(model), "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)["online"]
        mae = {r["method"]: r["mae"] for r in report["second_half"]
               if r["target"] == "mem_used_mib" and r["horizon_s"] == 5}
        return mae, report.get("node_learning", {}).get("served", [])

    with_trees, rounds = served_mae(3600)
    assert [r["event"] for r in rounds][:1] == ["promoted"], rounds
    assert not any("fit_cpu_s" in r or "at" in r for r in rounds)  # times would make two runs differ
    without, none = served_mae(0)
    assert none == []
    assert with_trees["served"] < 0.95 * without["served"], (with_trees, without)  # a clear gain, not noise
    assert with_trees["served"] < with_trees["last_value"]


def test_model_status_and_rollback_of_the_trees_from_the_command_line(tmp_path: Path) -> None:
    state = tmp_path / "state"

    def vgpu(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "model", *args, "--state-dir", str(state)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)

    NT.learn_round(state, _node(), CFG)
    said = json.loads(vgpu("status").stdout)
    assert said["trees"] == str(NT.trees_paths(state)[0]) and said["trees_loads"] is True
    assert said["trees_promotions"] == 1 and said["trees_rollback_to"] is None and said["promotions"] == 0
    NT.trees_paths(state)[0].write_text("[]")
    damaged = vgpu("status")
    assert damaged.returncode == 0 and json.loads(damaged.stdout)["trees_loads"] is False
    # no earlier trees kept: the advice is to remove the file, not a rollback
    assert "not a vgpu-node-trees document" in damaged.stderr and "rollback --trees" not in damaged.stderr
    assert f"remove {NT.trees_paths(state)[0]}" in damaged.stderr
    back = vgpu("rollback", "--trees")
    assert back.returncode == 0 and json.loads(back.stdout)["serving"] is None
    assert not NT.trees_paths(state)[0].exists()
    again = vgpu("rollback", "--trees")
    assert again.returncode == 1 and "no node-local trees serve" in again.stderr
    assert [e["event"] for e in NL.read_log(state)] == ["trees_promoted", "trees_rollback"]


@pytest.mark.parametrize("missing", ["None", "NaN", "Zero"])
def test_flat_trees_predict_as_lightgbm_does(missing: str) -> None:
    """The daemon walks the flattened trees without LightGBM; their sums must be the booster's, for each
    way LightGBM routes a missing value (features with NaN and exact zeros, in training and after)."""
    import lightgbm as lgb

    rng = np.random.default_rng(3)
    x = rng.normal(size=(3000, NT.N_FEATURES))
    x[rng.random(x.shape) < 0.2] = 0.0
    y = x[:, 0] * 3 + np.sin(x[:, 1]) + (x[:, 2] > 0) + rng.normal(0, 0.1, len(x))
    if missing != "None":
        x[rng.random(x.shape) < 0.1] = np.nan
    booster = lgb.train({"objective": "quantile", "alpha": 0.9, "num_leaves": 15, "verbose": -1,
                         "zero_as_missing": missing == "Zero", "num_threads": 1},
                        lgb.Dataset(x, y), num_boost_round=30)
    flat = NT.FlatTrees.from_booster(booster)
    assert set(flat.missing[flat.feature >= 0].tolist()) == {NT._MISSING[missing]}
    probe = rng.normal(size=(500, NT.N_FEATURES))
    probe[rng.random(probe.shape) < 0.2] = 0.0
    probe[rng.random(probe.shape) < 0.1] = np.nan
    np.testing.assert_allclose(flat.predict(probe), booster.predict(probe), rtol=1e-12, atol=1e-12)
    again = NT.FlatTrees.checked(json.loads(json.dumps(flat.to_json())), flat.roots.tolist())
    np.testing.assert_array_equal(again.predict(probe), flat.predict(probe))


def test_serving_the_trees_never_imports_lightgbm(tmp_path: Path) -> None:
    """LightGBM brings SciPy, scikit-learn and pandas into the daemon's memory: loading and serving
    trees must not need it."""
    trees, _ = NT.learn_trees(_node(), None, CFG)
    assert trees is not None
    NT.save_trees(tmp_path / "trees.json", trees)
    code = ("import sys, numpy as np; from vgpu.manager import nodetrees as NT; from vgpu.traces import AppTrace; "
            f"t = NT.load_trees({str(tmp_path / 'trees.json')!r}); "
            "h = AppTrace('a', np.arange(0.0, 40), {'mem_used_mib': np.full(40, 500.0), 'sm_util_pct': np.full(40, 5.0)}); "
            "a = t.forecast_arrays([h]); assert np.isfinite(a).all(), a; "
            "print(sorted(m for m in ('lightgbm', 'sklearn', 'pandas', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _trees(seed_runs: int = 12) -> NT.NodeTrees:
    trees, _ = NT.learn_trees(_node(seed_runs), None, CFG)
    assert trees is not None
    return trees


def test_a_promotion_that_fails_midway_leaves_the_serving_trees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk (or a crash) while the new trees are written: the trees serving before still serve,
    the previous ones are as they were, nothing half-written is left, and nothing is logged."""
    state = tmp_path / "state"
    first, second = _trees(), _trees(14)
    NT.promote_trees(state, first, {"at": 1.0})
    current, previous = NT.trees_paths(state)
    before = current.read_bytes()

    def full(path: Path, doc: dict[str, Any]) -> None:
        path.write_text("{")  # part of it, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(NT, "_write_json", full)
    with pytest.raises(OSError, match="No space"):
        NT.promote_trees(state, second, {"at": 2.0})
    assert current.read_bytes() == before and not previous.exists()
    assert sorted(p.name for p in current.parent.iterdir()) == [".promotions.lock", "promotions.jsonl", "trees.json"]
    assert [e["event"] for e in NL.read_log(state)] == ["trees_promoted"]


def test_rollback_goes_back_one_step_and_never_to_trees_that_do_not_load(tmp_path: Path) -> None:
    state = tmp_path / "state"
    current, previous = NT.trees_paths(state)
    a, b, c = _trees(), _trees(13), _trees(14)
    NT.promote_trees(state, a, {"at": 1.0})
    NT.promote_trees(state, b, {"at": 2.0})
    kept_a = previous.read_bytes()
    current.write_text("[]")  # b damaged while serving
    entry = NT.promote_trees(state, c, {"at": 3.0})
    assert entry["replaced"] == "unusable" and previous.read_bytes() == kept_a  # not the damaged b
    NT.rollback_trees(state)  # back to a
    assert current.read_bytes() == kept_a and not previous.exists()
    with pytest.raises(LookupError, match="not kept"):
        NT.rollback_trees(state)  # a was not the first promoted: refuse rather than serve none
    assert current.read_bytes() == kept_a
    # trees.json gone (removed by hand, or a crash before the promotion's rename): the previous ones come back
    NT.promote_trees(state, b, {"at": 4.0})
    current.unlink()
    assert NT.rollback_trees(state)["serving"] == str(current) and current.read_bytes() == kept_a


def test_a_fifo_or_a_link_where_the_trees_belong_is_refused_without_blocking(tmp_path: Path) -> None:
    import os
    import threading

    models = tmp_path / "state" / "models"
    models.mkdir(parents=True)
    fifo = models / NT.TREES
    os.mkfifo(fifo)
    with pytest.raises(NT.TreesError, match="not a regular file"):
        NT.load_trees(fifo)
    fifo.unlink()
    NT.save_trees(tmp_path / "elsewhere.json", _trees())
    fifo.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(NT.TreesError, match="a symbolic link"):
        NT.load_trees(fifo)
    # the network's file too: the watcher (the learner's thread) says unusable instead of waiting
    os.mkfifo(models / NL.LOCAL)
    served: list[object] = []
    watcher = NL.LocalModelWatcher(tmp_path / "state", served.append)
    polled = threading.Thread(target=watcher.poll, daemon=True)
    polled.start()
    polled.join(10)
    assert not polled.is_alive() and watcher.state == "unusable" and served == [None]
    assert "not a regular file" in (NL.load_problem(models / NL.LOCAL) or "")


def test_the_log_stays_strict_json_and_rotation_keeps_the_trees_counts(tmp_path: Path) -> None:
    state = tmp_path / "state"
    NT.learn_round(state, _node(), CFG)  # the first promotion: no serving trees judged
    text = (state / "models" / NL.LOG).read_text()

    def strict(name: str) -> None:
        raise ValueError(f"{name} in the log")

    (first,) = [json.loads(line, parse_constant=strict) for line in text.splitlines()]
    assert first["serving_error"] is None and first["event"] == "trees_promoted"
    for i in range(40):
        NL._append_log(state, {"at": float(i), "event": "trees_rejected" if i % 2 else "trees_rollback",
                               "pad": "x" * 200}, rotate_at_bytes=4000, keep_bytes=1000)
    log = NL.read_log(state)
    assert log[0]["event"] == "compacted"
    assert NT.trees_status(state, log)["trees_promotions"] == 1
    assert NL.trees_counts(log) == {"trees_promotions": 1, "trees_rejections": 20, "trees_rollbacks": 20}


def test_sampled_origins_keep_the_whole_history_before_each_origin() -> None:
    """Held-back origins are scored with the history the daemon had there: an application that started
    before the cut keeps its age and lags."""
    from vgpu.manager.baselines import sampled_origins

    run = _run(5, 1000.0, seconds=300)
    prefixes, truths = sampled_origins([run], "mem_used_mib", 10_000, np.random.default_rng(0), from_s=1200.0)
    assert len(prefixes) == 300 - 200 - 5  # seconds 200..294 of the run: every horizon known
    assert len(prefixes[0]) == 201 and len(prefixes[-1]) == 295
    np.testing.assert_array_equal(truths[0], run.columns["mem_used_mib"][201:206])
    few, _ = sampled_origins([run], "mem_used_mib", 7, np.random.default_rng(0))
    assert len(few) == 7 and all(len(p) >= 10 for p in few)


def test_status_names_a_rollback_only_to_trees_that_load(tmp_path: Path) -> None:
    state = tmp_path / "state"
    NT.promote_trees(state, _trees(), {"at": 1.0})
    NT.promote_trees(state, _trees(13), {"at": 2.0})
    current, previous = NT.trees_paths(state)
    current.write_text("[]")
    proc = subprocess.run([sys.executable, "-m", "vgpu.cli", "model", "status", "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    said = json.loads(proc.stdout)
    assert said["trees_rollback_to_loads"] is True and f"rollback --trees --state-dir {state}" in proc.stderr
    previous.write_text('{"format": "vgpu-node-trees", "version": 1}')  # an older build's file
    proc = subprocess.run([sys.executable, "-m", "vgpu.cli", "model", "status", "--state-dir", str(state)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    said = json.loads(proc.stdout)
    assert said["trees_rollback_to_loads"] is False and "version 1" in said["trees_rollback_to_problem"]
    assert "rollback --trees" not in proc.stderr and f"remove {current}" in proc.stderr


def test_an_absurd_expert_cannot_push_the_served_forecast_or_its_scale_past_capacity() -> None:
    """Trees (or any expert) forecasting far beyond the device: the mixture holds them to the
    application's range, so the served forecast and the scale later streams start from stay sane."""
    from vgpu.manager.forecast import Forecast

    class Absurd:
        name = "trees"
        horizons_s = HORIZONS

        def forecast_batch(self, histories: list[AppTrace]) -> list[Forecast]:
            big = (1e300,) * len(HORIZONS)
            return [Forecast(HORIZONS, big, big, big, big, self.name) for _ in histories]

    mixture = make_served(None, local=True)
    mixture.set_expert("trees", Absurd())
    run = _run(1, 0.0)
    for s in range(2, 60):
        keep = run.t_s < s
        (fc,) = mixture.forecast_batch([AppTrace("a", run.t_s[keep], {c: v[keep] for c, v in run.columns.items()})])
    assert max(fc.mem_p90_mib) <= 24576.0 and max(fc.sm_p90_pct) <= 100.0
    assert np.nanmax(mixture._state.scale) <= 2 * 24576.0


def test_a_rollback_after_a_promotion_stopped_between_its_renames_changes_nothing(tmp_path: Path) -> None:
    import os

    state = tmp_path / "state"
    NT.promote_trees(state, _trees(), {"at": 1.0})
    NT.promote_trees(state, _trees(13), {"at": 2.0})
    current, previous = NT.trees_paths(state)
    serving = current.read_bytes()
    previous.unlink()
    os.link(current, previous)  # a third promotion linked the serving trees as previous, then stopped
    with pytest.raises(LookupError, match="not kept"):  # not a "rollback" to the very same trees
        NT.rollback_trees(state)
    assert current.read_bytes() == serving
    assert [e["event"] for e in NL.read_log(state)] == ["trees_promoted", "trees_promoted"]


def test_a_round_does_not_replace_trees_rolled_back_while_it_fitted(tmp_path: Path) -> None:
    """An operator's rollback during a round's fit: the candidate was judged against the trees before it,
    so it is not promoted over the ones the operator put back (a rejection is logged instead)."""
    state = tmp_path / "state"
    NT.promote_trees(state, _trees(), {"at": 1.0})
    NT.promote_trees(state, _trees(13), {"at": 2.0})
    current, _ = NT.trees_paths(state)
    judged = NT.file_signature(current)
    NT.rollback_trees(state)  # while the round fits
    restored = current.read_bytes()
    entry = NT.promote_trees(state, _trees(14), {"at": 3.0}, judged)
    assert entry["event"] == "trees_rejected" and "changed during the round" in entry["reason"]
    assert current.read_bytes() == restored
    # without a change in between, the judged signature lets the promotion through
    assert NT.promote_trees(state, _trees(14), {"at": 4.0}, NT.file_signature(current))["event"] == "trees_promoted"


def test_a_promotion_on_a_file_system_without_hard_links_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    state = tmp_path / "state"
    NT.promote_trees(state, _trees(), {"at": 1.0})
    current, previous = NT.trees_paths(state)
    first = current.read_bytes()

    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    assert NT.promote_trees(state, _trees(13), {"at": 2.0})["event"] == "trees_promoted"
    assert previous.read_bytes() == first and current.read_bytes() != first


def test_the_learner_child_fits_no_trees_when_told(tmp_path: Path) -> None:
    state = tmp_path / "state"
    hist = NodeHistory(state / "history", segment_s=600)
    for run in _node(runs=3):
        values = np.stack([run.columns["mem_used_mib"], run.columns["sm_util_pct"]], axis=1)
        hist.add([run.app] * len(run), ["GPU-0"] * len(run), run.t_s, values, [24576.0] * len(run))
    hist.close()
    model = write_tiny_checkpoint(tmp_path / "global.pt", seed=1)

    def rounds(*extra: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "vgpu.manager.nodelearn", "learn", "--state-dir", str(state),
                               "--history-dir", str(state / "history"), "--global-model", str(model), *extra],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(x)["round"] for x in proc.stdout.splitlines() if x.startswith("{")]

    assert rounds() == ["trees", "network"]
    assert rounds("--no-trees") == ["network"]


def test_the_doctor_says_whether_the_trees_load_and_what_to_do_when_they_do_not(tmp_path: Path) -> None:
    from vgpu.daemon.doctor import check_node_trees

    state = tmp_path / "state"
    current, previous = NT.trees_paths(state)
    check = check_node_trees(state)
    assert check.status == "OK" and check.detail.startswith(f"none at {current}")
    trees, _ = NT.learn_trees(_node(), None, CFG)
    assert trees is not None
    current.parent.mkdir(parents=True)
    NT.save_trees(current, trees)
    check = check_node_trees(state)
    assert (check.status, check.detail) == ("OK", f"{current} loads (fitted on {trees.info['train_apps']} applications)")
    current.write_text("{")
    check = check_node_trees(state)
    assert check.status == "WARN" and check.detail.startswith(f"{current}: not JSON")
    assert f"remove {current} (no earlier trees that load" in check.detail and "rollback" not in check.detail
    NT.save_trees(previous, trees)  # earlier trees that load: the advice names the rollback
    check = check_node_trees(state)
    assert check.status == "WARN" and f"rollback --trees --state-dir {state}` puts the previous ones back" in check.detail
    current.unlink()
    check = check_node_trees(state)
    assert check.status == "OK" and "earlier ones that load are kept" in check.detail
    assert check_node_trees(state, enabled=False).detail.startswith("off (manager.node_trees = false)")
