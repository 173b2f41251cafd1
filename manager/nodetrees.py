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
origins (each forecast from the whole history before it): per target and horizon the mean absolute
error of the median, as a multiple of the last value's; the score is the mean of those multiples. The candidate is promoted only when its score is
below (1 - `min_gain`) and below (1 - `min_gain`) x the serving trees' score on the same origins:
trees that do not beat the last value on the node's latest history never serve.

File: `<state_dir>/models/trees.json`, one JSON document (never a pickle: a state directory's files
are not trusted to run code), `FORMAT` / `VERSION`, the horizons, the feature count and one model per
(target, horizon, quantile) as flat arrays (`FlatTrees`). `load_trees` checks all of it and raises
`TreesError` with one line saying what is wrong; a promotion keeps the file it replaces as
`trees.prev.json` (`vgpu model rollback --trees` puts it back, or removes the trees when they were the
first promoted; `promote_trees` and `rollback_trees` say the rules).

The daemon never imports LightGBM: only the learner's child process fits with it. Its import brings
SciPy, scikit-learn and pandas along (110 MiB of resident memory in this environment), which the
daemon's stated memory bound has no room for. A fitted booster is flattened (`FlatTrees.from_booster`,
from LightGBM's own model dump) into arrays that NumPy walks for all rows and trees at once, with
LightGBM's numerical decision rule (x <= threshold, and its three ways of routing a missing value);
`tests/test_nodetrees.py` checks the predictions equal the booster's.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import numpy as np

from vgpu.log import get_logger
from vgpu.manager.baselines import (
    GBDT_WINDOW_S,
    GbdtForecaster,
    lag_features,
    sampled_origins,
    window_features,
)
from vgpu.manager.features import AGE_CAP_S, Grid, build_grid, build_recent_grid
from vgpu.manager.forecast import HORIZONS_S
from vgpu.manager.nodelearn import (
    _append_locked,
    _append_log,
    _log_lock,
    models_dir,
    read_log,
    split_recent,
    trees_counts,
)
from vgpu.traces import TARGETS, AppTrace

TREES = "trees.json"
PREVIOUS = "trees.prev.json"
FORMAT = "vgpu-node-trees"
VERSION = 2  # 1: LightGBM model text (read no more: it needs LightGBM in the daemon)
QUANTILES = (0.5, 0.9)
# A file larger than this is not read: the trees of one round are about 0.9 MiB of JSON (20 models of 30
# trees of at most 15 leaves), and the daemon parses it holding the interpreter lock.
MAX_FILE_BYTES = 8 * 1024 * 1024
# Bounds on one model, far above what a round fits (30 trees of at most 29 nodes and 14 levels) and low
# enough that no file within them makes a forecast call slow: rows x trees x levels a walk.
MAX_NODES = 100_000
MAX_TREES = 1_000
MAX_TREE_NODES = 1_023
MAX_DEPTH = 32
# A leaf is a change in MiB or percentage points: more than this (1 TiB) is no forecast
MAX_LEAF = float(2**20)
WALK_ROWS = 2_000
K_ZERO = 1e-35  # LightGBM's kZeroThreshold: a value this close to 0 counts as zero for missing_type Zero
N_FEATURES = lag_features([np.zeros(1)]).shape[1]


class TreesError(Exception):
    """A trees file that cannot serve: missing, not a regular file, too large, not JSON, not this
    format, or arrays a walk cannot trust."""


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


_MISSING = {"None": 0, "Zero": 1, "NaN": 2}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


@dataclass(frozen=True)
class FlatTrees:
    """One LightGBM model (a sum of regression trees) as flat arrays, every tree's nodes in pre-order
    one after another: a node's children come after it (so a walk always ends), a leaf's children are
    itself. Prediction is the sum over trees of the leaf a row reaches, as LightGBM's."""

    feature: np.ndarray  # int64, -1 at leaves
    threshold: np.ndarray  # float64: go left when x <= threshold
    left: np.ndarray  # int64, absolute node index
    right: np.ndarray  # int64
    value: np.ndarray  # float64, the leaf's output (0 at inner nodes)
    missing: np.ndarray  # int8: 0 None (a NaN compares as 0.0), 1 Zero (0 and NaN are missing), 2 NaN
    default_left: np.ndarray  # bool: where a missing value goes
    roots: np.ndarray  # int64
    depth: int  # the most steps from a root to a leaf

    @classmethod
    def from_booster(cls, booster: Any) -> FlatTrees:
        """Flatten a fitted `lightgbm.Booster` (numerical splits only)."""
        cols: dict[str, list[Any]] = {k: [] for k in ("feature", "threshold", "left", "right", "value", "missing",
                                                      "default_left")}
        roots = []
        for info in booster.dump_model()["tree_info"]:
            roots.append(len(cols["feature"]))
            stack = [info["tree_structure"]]
            parents: list[tuple[int, str]] = []  # (node index, which child) waiting for the next node
            while stack:
                node = stack.pop()
                i = len(cols["feature"])
                if parents:
                    at, side = parents.pop()
                    cols[side][at] = i
                if "leaf_value" in node:  # a leaf, or a tree of one leaf
                    for k, v in (("feature", -1), ("threshold", 0.0), ("left", i), ("right", i),
                                 ("value", float(node["leaf_value"])), ("missing", 0), ("default_left", True)):
                        cols[k].append(v)
                    continue
                if node["decision_type"] != "<=" or node["missing_type"] not in _MISSING:
                    raise ValueError(f"split {node['decision_type']!r} / missing {node['missing_type']!r}: "
                                     "only numerical splits are flattened")
                for k, v in (("feature", int(node["split_feature"])), ("threshold", float(node["threshold"])),
                             ("left", -1), ("right", -1), ("value", 0.0), ("missing", _MISSING[node["missing_type"]]),
                             ("default_left", bool(node["default_left"]))):
                    cols[k].append(v)
                # pre-order: the left subtree next, then the right one
                parents += [(i, "right"), (i, "left")]
                stack += [node["right_child"], node["left_child"]]
        return cls.checked(cols, roots)

    @classmethod
    def checked(cls, cols: dict[str, Any], roots: Any) -> FlatTrees:
        """Build from plain lists (a file's), checking what a walk relies on; ValueError says what is wrong.

        The arrays must be what `from_booster` writes: separate trees, each one's nodes a contiguous
        run in pre-order (an inner node's left child is the next node, its right child later in the
        same tree, every node but a root the child of exactly one node), at most `MAX_TREES` trees of at
        most `MAX_TREE_NODES` nodes and `MAX_DEPTH` levels, numbers of the right kind (no string or bool
        standing for one), leaf values within `MAX_LEAF`. So a file cannot make one walk longer or
        wider than a fitted model's bound, nor a forecast absurd."""
        ints = ("feature", "left", "right", "missing")
        try:
            lists = {k: cols[k] for k in (*ints, "threshold", "value", "default_left")}
        except (KeyError, TypeError):
            raise ValueError("not an object of the arrays feature, threshold, left, right, value, missing, "
                             "default_left and roots") from None
        if not all(isinstance(v, list) for v in lists.values()) or not isinstance(roots, list):
            raise ValueError("not arrays of numbers (a value that is not a list)")
        kinds = {"feature": _is_int, "left": _is_int, "right": _is_int, "missing": _is_int,
                 "threshold": _is_number, "value": _is_number, "default_left": _is_bool}
        for name, ok in kinds.items():
            if not all(ok(v) for v in lists[name]):
                raise ValueError(f"not arrays of numbers ({name} holds a value of another kind)")
        if not all(_is_int(v) for v in roots):
            raise ValueError("not arrays of numbers (roots holds a value of another kind)")
        n = len(lists["feature"])
        if not 0 < n <= MAX_NODES or any(len(v) != n for v in lists.values()) or not 0 < len(roots) <= MAX_TREES:
            raise ValueError(f"arrays of different lengths, none, over {MAX_NODES} nodes or over {MAX_TREES} trees")
        try:
            feature = np.array(lists["feature"], dtype=np.int64)
            arrays: dict[str, np.ndarray] = {
                "threshold": np.array(lists["threshold"], dtype=np.float64),
                "left": np.array(lists["left"], dtype=np.int64), "right": np.array(lists["right"], dtype=np.int64),
                "value": np.array(lists["value"], dtype=np.float64),
                "missing": np.array(lists["missing"], dtype=np.int64),
                "default_left": np.array(lists["default_left"], dtype=bool)}
            root = np.array(roots, dtype=np.int64)
        except OverflowError:
            raise ValueError("not arrays of numbers (an integer out of range)") from None
        left, right, idx = arrays["left"], arrays["right"], np.arange(n)
        inner = feature >= 0
        if (feature >= N_FEATURES).any() or (feature < -1).any():
            raise ValueError(f"a feature index outside 0..{N_FEATURES - 1}")
        if not (np.isfinite(arrays["threshold"]).all() and (np.abs(arrays["value"]) <= MAX_LEAF).all()):
            raise ValueError(f"a threshold that is not finite or a leaf value beyond +-{MAX_LEAF:g}")
        if not ((arrays["missing"] >= 0) & (arrays["missing"] <= 2)).all():
            raise ValueError("an unknown missing-value rule")
        arrays["missing"] = arrays["missing"].astype(np.int8)
        # separate trees in pre-order: roots in order from node 0, each tree a contiguous run
        if root[0] != 0 or (np.diff(root) <= 0).any() or root[-1] >= n:
            raise ValueError("roots that do not start at node 0 and rise through the nodes")
        ends = np.append(root[1:], n)
        if (ends - root > MAX_TREE_NODES).any():
            raise ValueError(f"a tree of over {MAX_TREE_NODES} nodes")
        tree_end = np.repeat(ends, ends - root)
        if ((inner & ((left != idx + 1) | (right <= left) | (right >= tree_end))).any()
                or (~inner & ((left != idx) | (right != idx))).any()):
            raise ValueError("a tree not in pre-order (a child that is not after its node within its tree, or a "
                             "leaf with children)")
        parents = np.bincount(np.concatenate([left[inner], right[inner]]), minlength=n)
        is_root = np.zeros(n, dtype=bool)
        is_root[root] = True
        if (parents != np.where(is_root, 0, 1)).any():
            raise ValueError("nodes shared between branches or trees (every node but a root has one parent)")
        depth = np.zeros(n, dtype=np.int64)
        for i in np.flatnonzero(inner):  # children come after their node: one pass finds every depth
            depth[left[i]] = depth[right[i]] = depth[i] + 1
        if depth.max() > MAX_DEPTH:
            raise ValueError(f"a tree deeper than {MAX_DEPTH} levels")
        return cls(feature=feature, roots=root, depth=int(depth.max()), **arrays)

    def to_json(self) -> dict[str, list[Any]]:
        return {"feature": self.feature.tolist(), "threshold": self.threshold.tolist(), "left": self.left.tolist(),
                "right": self.right.tolist(), "value": self.value.tolist(), "missing": self.missing.tolist(),
                "default_left": self.default_left.tolist(), "roots": self.roots.tolist()}

    @classmethod
    def joined(cls, parts: Sequence[FlatTrees]) -> FlatTrees:
        """Several models as one, their trees side by side (so one walk serves them all); `leaves` then
        gives every tree's leaf value, part after part, in `parts`' order."""
        offsets = np.cumsum([0] + [len(p.feature) for p in parts[:-1]])
        return cls(
            feature=np.concatenate([p.feature for p in parts]),
            threshold=np.concatenate([p.threshold for p in parts]),
            left=np.concatenate([p.left + o for p, o in zip(parts, offsets, strict=True)]),
            right=np.concatenate([p.right + o for p, o in zip(parts, offsets, strict=True)]),
            value=np.concatenate([p.value for p in parts]),
            missing=np.concatenate([p.missing for p in parts]),
            default_left=np.concatenate([p.default_left for p in parts]),
            roots=np.concatenate([p.roots + o for p, o in zip(parts, offsets, strict=True)]),
            depth=max(p.depth for p in parts),
        )

    @cached_property
    def _zero_missing(self) -> bool:
        """Whether a node counts an exact zero as missing (LightGBM's `zero_as_missing`)."""
        return bool((self.missing == 1).any())

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The sum over trees of each row's leaf."""
        return np.asarray(self.leaves(x).sum(axis=1), dtype=np.float64)

    def leaves(self, x: np.ndarray) -> np.ndarray:
        """(rows, trees): the value of the leaf each row reaches in each tree, `WALK_ROWS` rows at a time
        (a walk's arrays are rows x trees: a round scores 20,000 held-back rows)."""
        x = np.asarray(x, dtype=np.float64)
        if len(x) <= WALK_ROWS:
            return self._leaves(x)
        return np.concatenate([self._leaves(x[i:i + WALK_ROWS]) for i in range(0, len(x), WALK_ROWS)])

    def _leaves(self, x: np.ndarray) -> np.ndarray:
        """`leaves` of a few rows: every (row, tree) walk steps together, one level a step, and a walk that
        has reached its leaf drops out of the next."""
        n, n_trees = len(x), len(self.roots)
        node = np.tile(self.roots, n)
        at = np.repeat(np.arange(n) * x.shape[1], n_trees)  # each walk's row, as an offset into x
        flat_x = x.ravel()
        # without missing values and with no node that counts zero as missing, a split is x <= threshold
        plain = not self._zero_missing and not np.isnan(flat_x).any()
        active = np.flatnonzero(self.feature[node] >= 0)
        while len(active):
            here = node[active]
            v = flat_x[at[active] + self.feature[here]]
            if plain:
                go_left = v <= self.threshold[here]
            else:
                nan = np.isnan(v)
                miss = self.missing[here]
                absent = ((miss == 2) & nan) | ((miss == 1) & (nan | (np.abs(v) <= K_ZERO)))
                go_left = np.where(absent, self.default_left[here], np.where(nan, 0.0, v) <= self.threshold[here])
            step = np.where(go_left, self.left[here], self.right[here])
            node[active] = step
            active = active[self.feature[step] >= 0]
        return np.asarray(self.value[node].reshape(n, n_trees), dtype=np.float64)


class NodeTrees(GbdtForecaster):
    """`GbdtForecaster` fitted with LightGBM (in the learner's child process), whose models are then
    `FlatTrees`: saved to and loaded from JSON, walked with NumPy."""

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
        self._joined: dict[str, tuple[FlatTrees, np.ndarray]] = {}  # per target, built at the first forecast

    def fit(self, traces: Sequence[AppTrace]) -> NodeTrees:  # type: ignore[override]
        super().fit(traces)
        # flat arrays: what a loaded file gives, and what the daemon walks without LightGBM
        self.models = {k: FlatTrees.from_booster(m.booster_) for k, m in self.models.items()}  # type: ignore[attr-defined]
        return self

    def predict_changes(self, x: np.ndarray, target: str) -> tuple[np.ndarray, np.ndarray]:
        # a target's ten models (horizons x quantiles) walk as one: a tenth of the NumPy calls
        keys = [(target, h, q) for q in QUANTILES for h in self.horizons_s]
        joined = self._joined.get(target)
        if joined is None:
            parts = [cast(FlatTrees, self.models[k]) for k in keys]
            joined = self._joined[target] = (FlatTrees.joined(parts),
                                              np.cumsum(np.array([0] + [len(p.roots) for p in parts[:-1]])))
        forest, starts = joined
        sums = np.add.reduceat(forest.leaves(x), starts, axis=1)  # (rows, models)
        nh = len(self.horizons_s)
        return sums[:, :nh], sums[:, nh:]

    def forecast_arrays(self, histories: Sequence[AppTrace]) -> np.ndarray:
        """`forecast_batch`'s numbers without building `Forecast`s (what the expert mixture reads):
        (N, [mem P50, compute P50, mem P90, compute P90], horizons), NaN where a history has no value
        of a target. The grids of all histories are built at once, of only the last `GBDT_WINDOW_S`
        seconds that the features read (manager/features.py `build_recent_grid`; a quarter of a
        2-minute window's samples), with each target's age counted from its first value in the whole
        history: the daemon calls this for every application every second."""
        out = np.full((len(histories), 4, len(self.horizons_s)), np.nan)
        if not histories:
            return out
        grid = build_recent_grid(histories, TARGETS, GBDT_WINDOW_S)
        if not self._fill(out, histories, grid):
            self._fill(out, histories, build_grid(histories, TARGETS))
        return out

    def _fill(self, out: np.ndarray, histories: Sequence[AppTrace], grid: Grid) -> bool:
        """Writes the forecasts from `grid` into `out`; False (nothing written) where a target's
        window reaches before an application's cut, so only the whole grid can give it."""
        nonempty = np.flatnonzero(np.diff(grid.offsets) > 0)
        if not len(nonempty):
            return True
        starts = grid.offsets[:-1][nonempty]
        rows_out: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
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
            first, last, rows = first[has], last[has], nonempty[has]
            window = np.maximum(last[:, None] - (GBDT_WINDOW_S - 1) + np.arange(GBDT_WINDOW_S)[None], first[:, None])
            # the target's first second with a value: on the grid, unless the grid starts after the
            # application's first second, where the whole history tells
            first_s = grid.start_s[rows] + (first - grid.offsets[rows])
            cut = grid.start_s[rows] > grid.first_s[rows]
            if cut.any():
                if np.any(first[cut] > last[cut] - (GBDT_WINDOW_S - 1)):
                    return False
                first_s[cut] = [_first_value_s(histories[i], target) for i in rows[cut]]
            last_s = grid.start_s[rows] + (last - grid.offsets[rows])
            lengths = np.minimum(last_s - first_s + 1, self.length_cap_s).astype(np.float64)
            p50, p90 = self.predict_features(window_features(v[window], lengths), target)
            rows_out.append((ti, rows, p50, p90))
        for ti, rows, p50, p90 in rows_out:
            out[rows, ti], out[rows, 2 + ti] = p50, p90
        return True

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "horizons_s": list(self.horizons_s),
            "n_features": N_FEATURES,
            "info": self.info,
            "models": {f"{t}/{h}/{q}": m.to_json() for (t, h, q), m in self.models.items()},  # type: ignore[attr-defined]
        }


def _first_value_s(history: AppTrace, target: str) -> int:
    """The second of `history`'s first sample with a value of `target` (it has one)."""
    col = history.columns[target]
    if math.isfinite(float(col[0])):  # the usual case: the target reported from the first sample on
        return math.floor(float(history.t_s[0]))
    return math.floor(float(history.t_s[int(np.flatnonzero(np.isfinite(col))[0])]))


def from_json(doc: object) -> NodeTrees:
    """The trees of a `to_json` document; TreesError naming what is wrong."""
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
    for key, arrays in models.items():
        target, h, q = key.split("/")
        if not isinstance(arrays, dict):
            raise TreesError(f"model {key}: not an object of arrays")
        try:
            trees.models[(target, int(h), float(q))] = FlatTrees.checked(arrays, arrays.get("roots"))
        except ValueError as exc:
            raise TreesError(f"model {key}: {exc}") from None
    for target in TARGETS:  # a target is served whole or not at all
        have = [(target, h, q) in trees.models for h in HORIZONS_S for q in QUANTILES]
        if any(have) and not all(have):
            raise TreesError(f"models of {target}: some horizons or quantiles missing")
    info = doc.get("info")
    try:  # what `vgpu model status` prints must stay strict JSON
        json.dumps(info, allow_nan=False)
    except (TypeError, ValueError):
        info = None
    trees.info = info if isinstance(info, dict) else {}
    return trees


def load_trees(path: str | Path) -> NodeTrees:
    p = Path(path)
    try:
        # a FIFO or device put there must not block the learner's thread (nor `vgpu model status`)
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise TreesError(f"{p}: {what}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise TreesError(f"{p}: not a regular file")
            if st.st_size > MAX_FILE_BYTES:
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
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        _write_json(tmp, trees.to_json())
        os.replace(tmp, p)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def score_against_last(candidates: Sequence[GbdtForecaster | None], traces: Sequence[AppTrace],
                       cfg: TreesConfig, from_s: float = -math.inf) -> list[float | None]:
    """For each candidate (None: none), the mean over targets and horizons of its median's MAE as a
    multiple of the last value's on the protocol origins of `traces` from second `from_s` on (each
    origin with the whole history before it, as the daemon would forecast there); None where nothing
    could be judged (no origin, or the last value exact everywhere)."""
    ratios: list[list[float]] = [[] for _ in candidates]
    for target in TARGETS:
        prefixes, truth = sampled_origins(traces, target, cfg.max_held_origins, np.random.default_rng(cfg.seed),
                                          from_s=from_s)
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
    return [float(np.mean(r)) if r else None for r in ratios]


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
    cut_s = max(float(t.t_s[-1]) for t in live) - cfg.holdout_s  # split_recent's
    entry: dict[str, Any] = {"at": time.time(), "train_apps": len(before), "held_back_apps": len(held),
                             "holdout_s": cfg.holdout_s}
    started = time.process_time()
    try:
        candidate = NodeTrees(cfg).fit(before)
    except ValueError as exc:
        return None, entry | {"event": "rejected", "reason": f"nothing to fit: {exc}"}
    entry["fit_cpu_s"] = round(time.process_time() - started, 3)
    try:
        serving_score = score_against_last([serving], live, cfg, cut_s)[0]
    except Exception as exc:  # noqa: BLE001 - trees that cannot forecast are no reference: judged against none
        serving_score = None
        entry["serving_failed"] = repr(exc)[:200]
    cand_score = score_against_last([candidate], live, cfg, cut_s)[0]
    # None, not NaN, where nothing was judged: the log and the reports are strict JSON
    entry |= {"candidate_error": cand_score, "serving_error": serving_score}
    if cand_score is None:
        return None, entry | {"event": "rejected", "reason": "nothing on the held-back history to judge by"}
    bound = 1 - cfg.min_gain
    if cand_score >= bound or (serving_score is not None and cand_score >= bound * serving_score):
        return None, entry | {"event": "rejected", "reason": "no better on the held-back history"}
    candidate.info = {"trained_at": entry["at"], "train_apps": len(before), "held_back_error": cand_score}
    return candidate, entry | {"event": "promoted"}


# --- the node's files: promotion, rollback, status -------------------------------------------------
def trees_paths(state_dir: str | Path) -> tuple[Path, Path]:
    d = models_dir(state_dir)
    return d / TREES, d / PREVIOUS


def file_signature(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime_ns, size) of `path`, None where there is no file: which trees a round judged against."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def promote_trees(state_dir: str | Path, trees: NodeTrees, entry: dict[str, Any],
                  judged: tuple[int, int, int] | None | str = "any") -> dict[str, Any]:
    """Serve `trees` and log `entry` as `trees_promoted`, under the promotion log's lock
    (manager/nodelearn.py). The new file is written in full before anything is renamed, and the trees
    it replaces become the previous ones by a hard link: at every moment (a crash, a full disk) a
    sound `trees.json` serves. Trees that do not load are never kept as previous (the previous ones
    stay); with no trees serving, none are kept, and the entry says so (`replaced` null), so that a
    rollback knows to remove the trees. With `judged` (the `file_signature` of the serving trees the
    candidate was scored against), trees that changed since (a rollback during the round's fit) are
    not replaced: the entry is a rejection, logged, and nothing else changes."""
    current, previous = trees_paths(state_dir)
    current.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _log_lock(state_dir):
        if judged != "any" and file_signature(current) != judged:
            entry = entry | {"event": "trees_rejected", "reason": "the serving trees changed during the round "
                             "(a rollback or a file put there): the candidate was not judged against them"}
            _append_locked(state_dir, entry)
            return entry
        replaced: str | None = None
        if current.exists():
            try:
                load_trees(current)
                replaced = "serving"
            except TreesError:
                replaced = "unusable"
        tmp = current.with_name(f".{TREES}.tmp")
        link = previous.with_name(f".{PREVIOUS}.tmp")
        try:
            _write_json(tmp, trees.to_json())
            if replaced == "serving":
                link.unlink(missing_ok=True)
                try:
                    os.link(current, link)
                except OSError as exc:  # a file system without hard links: a copy does as well, more slowly
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                        raise
                    shutil.copyfile(current, link)
                os.replace(link, previous)
            elif replaced is None:
                previous.unlink(missing_ok=True)  # a rollback from these trees goes back to none
            os.replace(tmp, current)
            _fsync_dir(current.parent)
        except OSError:
            tmp.unlink(missing_ok=True)
            link.unlink(missing_ok=True)
            raise
        entry = entry | {"event": "trees_promoted", "replaced": replaced}
        _append_locked(state_dir, entry)
    return entry


def rollback_trees(state_dir: str | Path, on_wait: Any = None) -> dict[str, Any]:
    """Put the trees promoted before the serving ones back, or remove the trees when none served before
    them; put the previous ones back when `trees.json` is missing. LookupError with nothing changed
    when there is nothing to go back to or the previous trees do not load."""
    current, previous = trees_paths(state_dir)
    with _log_lock(state_dir, on_wait):
        entry: dict[str, Any] = {"at": time.time(), "event": "trees_rollback"}
        if previous.exists() and current.exists() and os.path.samefile(previous, current):
            previous.unlink()  # a promotion that stopped between its renames: the same trees, not earlier ones
        if previous.exists():
            try:
                load_trees(previous)
            except TreesError as exc:
                raise LookupError(f"cannot roll back the trees: the previous ones do not load ({exc}); nothing "
                                  f"changed. To serve without trees, remove {current}") from None
            os.replace(previous, current)
            entry["serving"] = str(current)
        elif not current.exists():
            raise LookupError(f"nothing to roll back: no node-local trees serve ({current} does not exist)")
        elif _last_promotion_replaced(state_dir) is None:
            current.unlink()  # the serving trees were the first promoted: none served before them
            entry["serving"] = None
        else:
            raise LookupError(f"cannot roll back the trees: the ones before them are not kept (one step of "
                              f"rollback); nothing changed. To serve without trees, remove {current}")
        _append_locked(state_dir, entry)
    get_logger("vgpu.manager.nodetrees").info("node_trees_rolled_back", **{k: v for k, v in entry.items() if k != "event"})
    return entry


def _last_promotion_replaced(state_dir: str | Path) -> str | None:
    """What the newest trees promotion in the log replaced ("serving", "unusable", None: nothing);
    "unknown" when the log holds no promotion of trees (rotated away, or written by hand)."""
    for e in reversed(read_log(state_dir)):
        if e.get("event") == "trees_promoted":
            if "replaced" not in e:
                return "unknown"  # an entry that does not say: never read as "none before"
            value = e["replaced"]
            return value if isinstance(value, str) else None
    return "unknown"


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def trees_status(state_dir: str | Path, log: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What `vgpu model status` says of the trees: the file, whether it loads (and why not), what it
    was trained on, whether a rollback has trees to go back to, and the counts of the log's entries."""
    current, previous = trees_paths(state_dir)
    out: dict[str, Any] = {"trees": str(current) if current.exists() else None, "trees_loads": None,
                           "trees_rollback_to": str(previous) if previous.exists() else None,
                           "trees_rollback_to_loads": None}
    if current.exists():
        try:
            out["trees_info"] = load_trees(current).info
            out["trees_loads"] = True
        except TreesError as exc:
            out |= {"trees_loads": False, "trees_problem": str(exc)}
    if previous.exists():
        try:
            load_trees(previous)
            out["trees_rollback_to_loads"] = True
        except TreesError as exc:
            out |= {"trees_rollback_to_loads": False, "trees_rollback_to_problem": str(exc)}
    return out | trees_counts(log)


def unusable_trees_advice(state: dict[str, Any], state_dir: str | Path, prog: str = "vgpu model") -> str:
    """What an operator does about a `trees.json` that does not load, from `trees_status`: a rollback
    only where the trees before it load, else remove the file."""
    if state["trees_rollback_to_loads"]:
        return (f"`{prog} rollback --trees --state-dir {state_dir}` puts the previous ones back "
                f"({state['trees_rollback_to']}), or remove {state['trees']}")
    return (f"remove {state['trees']} (no earlier trees that load are kept to roll back to); the next learning "
            "round fits new ones")


def learn_round(state_dir: str | Path, history: Sequence[AppTrace], cfg: TreesConfig | None = None, *,
                logger: Any = None) -> dict[str, Any]:
    """One trees round as the node's learner runs it: the serving trees (none where they do not
    load), `learn_trees`, then a promotion or a logged rejection. Returns the entry."""
    log = logger or get_logger("vgpu.manager.nodetrees")
    current, _ = trees_paths(state_dir)
    judged = file_signature(current)
    serving = None
    if current.exists():
        try:
            serving = load_trees(current)
        except TreesError as exc:
            log.warning("node_trees_unusable", path=str(current), error=str(exc))
    trees, entry = learn_trees(history, serving, cfg)
    fields = {k: v for k, v in entry.items() if k != "event"}
    if trees is not None:
        entry = promote_trees(state_dir, trees, entry, judged)
        log.info("node_trees_promoted" if entry["event"] == "trees_promoted" else "node_trees_rejected",
                 **{k: v for k, v in entry.items() if k != "event"})
    elif entry["event"] == "rejected":
        entry = entry | {"event": "trees_rejected"}
        _append_log(state_dir, entry)
        log.info("node_trees_rejected", **fields)
    return entry
