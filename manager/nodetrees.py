"""Node-local trees: gradient-boosted trees fitted on the node's own history, an expert of the served mixture.

The global model was trained elsewhere; a node runs the same few kinds of job again and again, and
what one of them does next (the memory step a start-up takes at its third second, the compute dip of
a checkpoint) is learnt from the runs the node has already seen. Fine-tuning the network on the
node's history (manager/nodelearn.py) is slow to learn such a thing from a few runs; trees on lag
features learn it from a few thousand origins, in seconds of CPU. The mixture (manager/experts.py)
weighs them by their recent error per application, like its other experts, so an application the
trees do not know keeps the last value's or the model's forecast.

What is fitted: `vgpu.manager.baselines.GbdtForecaster`'s model (LightGBM quantile regression, 0.5
and 0.9, of the change from the origin value, one model per target and horizon, on lags and 5 / 10 /
30 s statistics of the 1 s grid and the application's age in seconds), on every protocol origin of
the history's applications. A round (`learn_trees`) holds back the node's most recent `holdout_s`,
fits a candidate on the rest and scores it, the trees serving now and the last value on the held-back
origins: per target and horizon the mean absolute error of the median, as a multiple of the last
value's; the score is the mean of those multiples. The candidate is promoted only when its score is
below (1 - `min_gain`) and below (1 - `min_gain`) x the serving trees' score on the same origins:
trees that do not beat the last value on the node's latest history never serve.

File: `<state_dir>/models/trees.json`, one JSON document (never a pickle: a state directory's files
are not trusted to run code), `FORMAT` / `VERSION`, the horizons, the feature count and one LightGBM
model text per (target, horizon, quantile). `load_trees` checks all of it and raises `TreesError`
with one line saying what is wrong; a promotion keeps the file it replaces as `trees.prev.json`
(`vgpu model rollback --trees` puts it back, or removes the trees when there was none).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vgpu.log import get_logger
from vgpu.manager.baselines import (
    GBDT_WINDOW_S,
    GbdtForecaster,
    lag_features,
    origin_windows,
    window_features,
)
from vgpu.manager.features import AGE_CAP_S, build_grid
from vgpu.manager.forecast import HORIZONS_S
from vgpu.manager.nodelearn import _append_locked, _append_log, _log_lock, models_dir, split_recent
from vgpu.traces import TARGETS, AppTrace, one_second_grid

TREES = "trees.json"
PREVIOUS = "trees.prev.json"
FORMAT = "vgpu-node-trees"
VERSION = 1
QUANTILES = (0.5, 0.9)
# A file this large is not read: the trees of one round are a few hundred KiB (60 trees of at most
# 31 leaves per model, 20 models).
MAX_FILE_BYTES = 64 * 1024 * 1024
N_FEATURES = lag_features([np.zeros(1)]).shape[1]


class TreesError(Exception):
    """A trees file that cannot serve: missing, too large, not JSON, not this format, or a model
    LightGBM does not load."""


@dataclass(frozen=True)
class TreesConfig:
    holdout_s: float = 1800.0  # the most recent seconds held back to judge a candidate
    min_history_s: float = 3600.0  # no round before the history spans this much
    min_gain: float = 0.02
    max_rows: int = 20000  # training origins per target (subsampled, seeded)
    max_held_origins: int = 20000  # held-back origins scored per target (subsampled, seeded)
    # 30 trees of 15 leaves at a rate of 0.2: half the prediction time of the gbdt baseline's 60 of 31
    # at 0.1 (the daemon forecasts every application every second), with the same served error on the
    # development sets (docs/forecasting.md, "Node-local trees")
    n_estimators: int = 30
    num_leaves: int = 15
    learning_rate: float = 0.2
    seed: int = 0


class NodeTrees(GbdtForecaster):
    """`GbdtForecaster` whose models are LightGBM boosters, saved to and loaded from JSON text."""

    name = "trees"
    # the age the daemon can see: its window holds the last 120 s of an application, so an older one's
    # history is 120 s long there; trained with the same cap, the trees never learn from an age the
    # daemon cannot tell apart
    length_cap_s = AGE_CAP_S

    def __init__(self, cfg: TreesConfig | None = None) -> None:
        cfg = cfg or TreesConfig()
        super().__init__(n_estimators=cfg.n_estimators, num_leaves=cfg.num_leaves, learning_rate=cfg.learning_rate,
                         max_rows=cfg.max_rows, seed=cfg.seed)
        self.info: dict[str, Any] = {}

    def fit(self, traces: Sequence[AppTrace]) -> NodeTrees:  # type: ignore[override]
        super().fit(traces)
        # the booster alone: smaller to keep, faster to call, and what a loaded file gives
        self.models = {k: m.booster_ for k, m in self.models.items()}  # type: ignore[attr-defined]
        return self

    def forecast_arrays(self, histories: Sequence[AppTrace]) -> np.ndarray:
        """`forecast_batch`'s numbers without building `Forecast`s (what the expert mixture reads):
        (N, [mem P50, compute P50, mem P90, compute P90], horizons), NaN where a history has no value
        of a target. The grids of all histories are built at once (manager/features.py `build_grid`)
        and each one's last `GBDT_WINDOW_S` seconds taken from them: the daemon calls this for every
        application every second."""
        out = np.full((len(histories), 4, len(self.horizons_s)), np.nan)
        if not histories:
            return out
        grid = build_grid(histories, TARGETS)
        nonempty = np.flatnonzero(np.diff(grid.offsets) > 0)
        if not len(nonempty):
            return out
        starts = grid.offsets[:-1][nonempty]
        for ti, target in enumerate(TARGETS):
            if (target, self.horizons_s[0], 0.5) not in self.models:
                continue
            v = grid.values[target]
            bins = np.arange(len(v))
            finite = np.isfinite(v)
            # a column's protocol grid is its bins from its first value to its last (build_grid leaves
            # NaN before and after, and carries values forward in between)
            first = np.minimum.reduceat(np.where(finite, bins, len(v)), starts)
            last = np.maximum.reduceat(np.where(finite, bins, -1), starts)
            has = last >= 0
            if not has.any():
                continue
            first, last = first[has], last[has]
            window = np.maximum(last[:, None] - (GBDT_WINDOW_S - 1) + np.arange(GBDT_WINDOW_S)[None], first[:, None])
            lengths = np.minimum(last - first + 1, self.length_cap_s).astype(np.float64)
            p50, p90 = self.predict_features(window_features(v[window], lengths), target)
            rows = nonempty[has]
            out[rows, ti], out[rows, 2 + ti] = p50, p90
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "horizons_s": list(self.horizons_s),
            "n_features": N_FEATURES,
            "info": self.info,
            "models": {f"{t}/{h}/{q}": m.model_to_string() for (t, h, q), m in self.models.items()},  # type: ignore[attr-defined]
        }


def from_json(doc: object) -> NodeTrees:
    """The trees of a `to_json` document; TreesError naming what is wrong."""
    import lightgbm as lgb  # noqa: PLC0415

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TreesError(f"not a {FORMAT} document")
    if doc.get("version") != VERSION:
        raise TreesError(f"version {doc.get('version')!r}, this build reads {VERSION}")
    if doc.get("horizons_s") != list(HORIZONS_S) or doc.get("n_features") != N_FEATURES:
        raise TreesError(f"horizons {doc.get('horizons_s')!r} or feature count {doc.get('n_features')!r} "
                         f"differ from this build's ({list(HORIZONS_S)}, {N_FEATURES})")
    models = doc.get("models")
    wanted = {f"{t}/{h}/{q}" for t in TARGETS for h in HORIZONS_S for q in QUANTILES}
    if not isinstance(models, dict) or not models or not set(models) <= wanted:
        raise TreesError("models: expected a non-empty object keyed target/horizon/quantile")
    trees = NodeTrees()
    for key, text in models.items():
        target, h, q = key.split("/")
        if not isinstance(text, str):
            raise TreesError(f"model {key}: not a string")
        try:
            booster = lgb.Booster(model_str=text)
        except Exception as exc:  # noqa: BLE001 - LightGBM raises its own error types for bad text
            raise TreesError(f"model {key}: LightGBM cannot load it ({str(exc)[:200]})") from None
        if booster.num_feature() != N_FEATURES:
            raise TreesError(f"model {key}: {booster.num_feature()} features, expected {N_FEATURES}")
        trees.models[(target, int(h), float(q))] = booster
    for target in TARGETS:  # a target is served whole or not at all
        have = [(target, h, q) in trees.models for h in HORIZONS_S for q in QUANTILES]
        if any(have) and not all(have):
            raise TreesError(f"models of {target}: some horizons or quantiles missing")
    info = doc.get("info")
    trees.info = info if isinstance(info, dict) else {}
    return trees


def load_trees(path: str | Path) -> NodeTrees:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_FILE_BYTES:
                raise TreesError(f"{p}: larger than {MAX_FILE_BYTES} bytes")
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise TreesError(f"{p}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TreesError(f"{p}: not JSON ({str(exc)[:200]})") from None
    try:
        return from_json(doc)
    except TreesError as exc:
        raise TreesError(f"{p}: {exc}") from None


def save_trees(path: str | Path, trees: NodeTrees) -> None:
    """Write atomically (a reader sees the old file or the new one, never part of one)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(trees.to_json(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def held_origins(traces: Sequence[AppTrace], target: str, max_origins: int,
                 seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The protocol origins of `traces` (prefix grids, truths), subsampled to `max_origins`."""
    prefixes: list[np.ndarray] = []
    truths: list[np.ndarray] = []
    for t in traces:
        _, grid = one_second_grid(t, target)
        p, y = origin_windows(grid, HORIZONS_S)
        prefixes += p
        truths.append(y)
    if not prefixes:
        return [], np.zeros((0, len(HORIZONS_S)))
    y_all = np.concatenate(truths)
    if len(prefixes) > max_origins:
        keep = np.sort(np.random.default_rng(seed).choice(len(prefixes), max_origins, replace=False))
        prefixes = [prefixes[i] for i in keep]
        y_all = y_all[keep]
    return prefixes, y_all


def score_against_last(candidates: Sequence[GbdtForecaster | None], traces: Sequence[AppTrace],
                       cfg: TreesConfig) -> list[float]:
    """For each candidate (None: none), the mean over targets and horizons of its median's MAE as a
    multiple of the last value's on the protocol origins of `traces`; NaN where nothing could be
    judged (no origin, or the last value exact everywhere)."""
    ratios: list[list[float]] = [[] for _ in candidates]
    for target in TARGETS:
        prefixes, truth = held_origins(traces, target, cfg.max_held_origins, cfg.seed)
        if not prefixes:
            continue
        last = np.array([g[-1] for g in prefixes])
        base = np.abs(truth - last[:, None]).mean(axis=0)
        for i, fc in enumerate(candidates):
            if fc is None or (target, HORIZONS_S[0], 0.5) not in fc.models:
                continue
            p50, _ = fc.forecast_grids(prefixes, target)
            err = np.abs(truth - p50).mean(axis=0)
            ratios[i] += [float(e / b) for e, b in zip(err, base, strict=True) if b > 0]
    return [float(np.mean(r)) if r else math.nan for r in ratios]


def learn_trees(history: Sequence[AppTrace], serving: NodeTrees | None,
                cfg: TreesConfig | None = None) -> tuple[NodeTrees | None, dict[str, Any]]:
    """One round (module docstring): (the trees to promote or None, what was found)."""
    cfg = cfg or TreesConfig()
    live = [t for t in history if len(t)]
    if not live:
        return None, {"event": "skipped", "reason": "no history"}
    span = max(float(t.t_s[-1]) for t in live) - min(float(t.t_s[0]) for t in live)
    if span < cfg.min_history_s:
        return None, {"event": "skipped", "reason": f"history spans {span:.0f} s < {cfg.min_history_s:.0f} s"}
    before, held = split_recent(live, cfg.holdout_s)
    entry: dict[str, Any] = {"at": time.time(), "train_apps": len(before), "held_back_apps": len(held),
                             "holdout_s": cfg.holdout_s}
    started = time.process_time()
    try:
        candidate = NodeTrees(cfg).fit(before)
    except ValueError as exc:
        return None, entry | {"event": "rejected", "reason": f"nothing to fit: {exc}"}
    entry["fit_cpu_s"] = round(time.process_time() - started, 3)
    cand_score, serving_score = score_against_last([candidate, serving], held, cfg)
    entry |= {"candidate_error": cand_score, "serving_error": serving_score}
    if not math.isfinite(cand_score):
        return None, entry | {"event": "rejected", "reason": "nothing on the held-back history to judge by"}
    bound = 1 - cfg.min_gain
    if cand_score >= bound or (math.isfinite(serving_score) and cand_score >= bound * serving_score):
        return None, entry | {"event": "rejected", "reason": "no better on the held-back history"}
    candidate.info = {"trained_at": entry["at"], "train_apps": len(before), "held_back_error": cand_score}
    return candidate, entry | {"event": "promoted"}


# --- the node's files: promotion, rollback, status -------------------------------------------------
def trees_paths(state_dir: str | Path) -> tuple[Path, Path]:
    d = models_dir(state_dir)
    return d / TREES, d / PREVIOUS


def promote_trees(state_dir: str | Path, trees: NodeTrees, entry: dict[str, Any]) -> dict[str, Any]:
    """Serve `trees` (the file it replaces kept as the previous one) and log `entry` as
    `trees_promoted`, under the promotion log's lock (manager/nodelearn.py)."""
    current, previous = trees_paths(state_dir)
    current.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _log_lock(state_dir):
        if current.exists():
            os.replace(current, previous)
        else:
            previous.unlink(missing_ok=True)  # a rollback from these trees goes back to none
        save_trees(current, trees)
        entry = entry | {"event": "trees_promoted"}
        _append_locked(state_dir, entry)
    return entry


def rollback_trees(state_dir: str | Path, on_wait: Any = None) -> dict[str, Any]:
    """Put the trees promoted before the serving ones back (or none, when none were): LookupError with
    nothing changed when no trees serve or the previous ones do not load."""
    current, previous = trees_paths(state_dir)
    with _log_lock(state_dir, on_wait):
        if not current.exists():
            raise LookupError(f"nothing to roll back: no node-local trees serve ({current} does not exist)")
        entry: dict[str, Any] = {"at": time.time(), "event": "trees_rollback"}
        if previous.exists():
            try:
                load_trees(previous)
            except TreesError as exc:
                raise LookupError(f"cannot roll back the trees: the previous ones do not load ({exc}); nothing "
                                  f"changed. To serve without trees, remove {current}") from None
            os.replace(previous, current)
            entry["serving"] = str(current)
        else:
            current.unlink()
            entry["serving"] = None
        _append_locked(state_dir, entry)
    get_logger("vgpu.manager.nodetrees").info("node_trees_rolled_back", **{k: v for k, v in entry.items() if k != "event"})
    return entry


def trees_status(state_dir: str | Path, log: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What `vgpu model status` says of the trees: the file, whether it loads (and why not), what it
    was trained on, whether a rollback has trees to go back to, and the counts of the log's entries."""
    current, previous = trees_paths(state_dir)
    out: dict[str, Any] = {"trees": str(current) if current.exists() else None, "trees_loads": None,
                           "trees_rollback_to": str(previous) if previous.exists() else None}
    if current.exists():
        try:
            out["trees_info"] = load_trees(current).info
            out["trees_loads"] = True
        except TreesError as exc:
            out |= {"trees_loads": False, "trees_problem": str(exc)}
    events = [e.get("event") for e in log]
    out["trees_promotions"] = events.count("trees_promoted")
    out["trees_rejections"] = events.count("trees_rejected")
    out["trees_rollbacks"] = events.count("trees_rollback")
    return out


def learn_round(state_dir: str | Path, history: Sequence[AppTrace], cfg: TreesConfig | None = None, *,
                logger: Any = None) -> dict[str, Any]:
    """One trees round as the node's learner runs it: the serving trees (none where they do not
    load), `learn_trees`, then a promotion or a logged rejection. Returns the entry."""
    log = logger or get_logger("vgpu.manager.nodetrees")
    current, _ = trees_paths(state_dir)
    serving = None
    if current.exists():
        try:
            serving = load_trees(current)
        except TreesError as exc:
            log.warning("node_trees_unusable", path=str(current), error=str(exc))
    trees, entry = learn_trees(history, serving, cfg)
    fields = {k: v for k, v in entry.items() if k != "event"}
    if trees is not None:
        entry = promote_trees(state_dir, trees, entry)
        log.info("node_trees_promoted", **fields)
    elif entry["event"] == "rejected":
        entry = entry | {"event": "trees_rejected"}
        _append_log(state_dir, entry)
        log.info("node_trees_rejected", **fields)
    return entry
