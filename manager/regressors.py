"""Regressors for job-configuration -> (peak memory, utilization), shared by the research comparison
(bench/paper_table.py) and the cold-start sizer (manager/coldstart.py).

Every model here is seeded and single-threaded where it matters, so the same data gives the same
numbers twice. XGBoost and CatBoost are the `bench` extras of pyproject.toml and are imported only
when asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from vgpu.manager.jobprofiles import FEATURE_NAMES, encode_tokens

TREE_MODELS: tuple[str, ...] = (
    "ExtraTrees",
    "CatBoost",
    "XGBoost",
    "LightGBM",
    "DecisionTree",
    "RandomForest",
    "AdaBoost",
)
ALL_MODELS: tuple[str, ...] = ("Transformer-BiGRU",) + TREE_MODELS


class Regressor(Protocol):
    def fit(self, x: np.ndarray, y: np.ndarray) -> Any: ...

    def predict(self, x: np.ndarray) -> np.ndarray: ...


def split_indices(n: int, train_frac: float = 0.7, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random split of range(n) into (train, test) index arrays."""
    if n < 2:
        raise ValueError(f"need at least 2 rows to split, got {n}")
    perm = np.random.default_rng(seed).permutation(n)
    n_train = min(n - 1, max(1, int(round(train_frac * n))))
    return np.sort(perm[:n_train]), np.sort(perm[n_train:])


def regression_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """MSE, RMSE, MAE, MAPE (%; rows with |y| < 1e-9 left out) and R2."""
    y = np.asarray(y_true, dtype=np.float64)
    p = np.asarray(y_pred, dtype=np.float64)
    err = p - y
    mse = float(np.mean(err**2))
    nz = np.abs(y) > 1e-9
    mape = float(np.mean(np.abs(err[nz]) / np.abs(y[nz])) * 100.0) if nz.any() else math.nan
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(err**2)) / ss_tot if ss_tot > 0 else math.nan
    return {"mse": mse, "rmse": math.sqrt(mse), "mae": float(np.mean(np.abs(err))), "mape": mape, "r2": r2}


def make_tree(name: str, seed: int = 0) -> Regressor:
    """One single-target tree model by its name in TREE_MODELS."""
    if name == "ExtraTrees":
        from sklearn.ensemble import ExtraTreesRegressor

        extra: Regressor = ExtraTreesRegressor(n_estimators=300, random_state=seed, n_jobs=1)
        return extra
    if name == "RandomForest":
        from sklearn.ensemble import RandomForestRegressor

        forest: Regressor = RandomForestRegressor(n_estimators=300, random_state=seed, n_jobs=1)
        return forest
    if name == "DecisionTree":
        from sklearn.tree import DecisionTreeRegressor

        tree: Regressor = DecisionTreeRegressor(random_state=seed)
        return tree
    if name == "AdaBoost":
        from sklearn.ensemble import AdaBoostRegressor
        from sklearn.tree import DecisionTreeRegressor

        ada: Regressor = AdaBoostRegressor(
            DecisionTreeRegressor(max_depth=6, random_state=seed), n_estimators=200, random_state=seed
        )
        return ada
    if name == "LightGBM":
        import lightgbm

        return lightgbm.LGBMRegressor(
            n_estimators=500,
            learning_rate=0.05,
            num_leaves=31,
            min_child_samples=5,
            random_state=seed,
            n_jobs=1,
            deterministic=True,
            force_row_wise=True,
            verbose=-1,
        )
    if name == "XGBoost":
        import xgboost

        return xgboost.XGBRegressor(
            n_estimators=500, learning_rate=0.05, max_depth=6, random_state=seed, n_jobs=1, tree_method="hist"
        )
    if name == "CatBoost":
        import catboost

        cat: Regressor = catboost.CatBoostRegressor(
            iterations=500, learning_rate=0.1, depth=6, random_seed=seed, thread_count=1, verbose=False, allow_writing_files=False
        )
        return cat
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(ALL_MODELS)}")


@dataclass(frozen=True)
class BiGRUSettings:
    epochs: int = 150
    batch_size: int = 64
    lr: float = 2e-3
    key_channels: int = 16
    attn_heads: int = 4
    attn_layers: int = 2


class TransformerBiGRURegressor:
    """The paper's Transformer-BiGRU as a point regressor over the job's features.

    Input: the job's features as a sequence, one token per feature (`encode_tokens`). Output: the
    P50 head of `vgpu.manager.model.TransformerBiGRU` (n_horizons=1, one output per target), trained with
    MSE on standardized targets (peak memory in log space, utilization linear); the P90 head is
    unused. Trained single-threaded with a fixed seed and deterministic algorithms.
    """

    def __init__(self, seed: int = 0, settings: BiGRUSettings | None = None, log_targets: tuple[bool, ...] = (True, False)) -> None:
        self.seed = seed
        self.settings = settings or BiGRUSettings()
        self.log_targets = log_targets
        self._net: Any = None

    def _targets(self, y: np.ndarray) -> np.ndarray:
        y = np.array(y, dtype=np.float64).reshape(len(y), -1)
        for j, use_log in enumerate(self.log_targets[: y.shape[1]]):
            if use_log:
                y[:, j] = np.log(np.maximum(y[:, j], 1e-6))
        return y

    def fit(self, x: np.ndarray, y: np.ndarray) -> TransformerBiGRURegressor:
        import torch

        from vgpu.manager.model import ModelConfig, TransformerBiGRU

        x = np.asarray(x, dtype=np.float64)
        yt = self._targets(y)
        self._x_mean, self._x_std = x.mean(axis=0), x.std(axis=0)
        self._y_mean, self._y_std = yt.mean(axis=0), np.where(yt.std(axis=0) > 0, yt.std(axis=0), 1.0)
        tokens = torch.from_numpy(encode_tokens(x, self._x_mean, self._x_std))
        target = torch.from_numpy(((yt - self._y_mean) / self._y_std).astype(np.float32))
        s = self.settings
        prev_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.manual_seed(self.seed)
            cfg = ModelConfig(
                n_features=tokens.shape[2],
                n_targets=target.shape[1],
                n_horizons=1,
                max_len=len(FEATURE_NAMES),
                attn_layers=s.attn_layers,
                attn_heads=s.attn_heads,
                key_channels=s.key_channels,
                dropout=0.0,
            )
            net = TransformerBiGRU(cfg)
            opt = torch.optim.Adam(net.parameters(), lr=s.lr)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, s.epochs))
            gen = torch.Generator().manual_seed(self.seed)
            n = tokens.shape[0]
            net.train()
            for _ in range(s.epochs):
                order = torch.randperm(n, generator=gen)
                for i in range(0, n, s.batch_size):
                    idx = order[i : i + s.batch_size]
                    pred = net(tokens[idx])[:, :, 0, 0]
                    loss = torch.nn.functional.mse_loss(pred, target[idx])
                    opt.zero_grad()
                    loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
                    opt.step()
                sched.step()
            net.eval()
            self._net = net
        finally:
            torch.set_num_threads(prev_threads)
        return self

    def predict(self, x: np.ndarray) -> np.ndarray:
        """(N, n_targets) in the targets' own units."""
        import torch

        if self._net is None:
            raise RuntimeError("fit() first")
        tokens = torch.from_numpy(encode_tokens(np.asarray(x, dtype=np.float64), self._x_mean, self._x_std))
        with torch.no_grad():
            z = self._net(tokens)[:, :, 0, 0].numpy().astype(np.float64)
        y: np.ndarray = z * self._y_std + self._y_mean
        for j, use_log in enumerate(self.log_targets[: y.shape[1]]):
            if use_log:
                y[:, j] = np.exp(y[:, j])
        return y


def fit_predict(
    name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, seed: int = 0, bigru: BiGRUSettings | None = None
) -> np.ndarray:
    """Train model `name` on (x_train, y_train (N, T)) and predict x_test -> (M, T). Trees get one
    model per target; the Transformer-BiGRU one model for all targets."""
    if name == "Transformer-BiGRU":
        return TransformerBiGRURegressor(seed=seed, settings=bigru).fit(x_train, y_train).predict(x_test)
    y_train = np.asarray(y_train, dtype=np.float64).reshape(len(y_train), -1)
    cols: list[np.ndarray] = []
    for j in range(y_train.shape[1]):
        model = make_tree(name, seed)
        model.fit(x_train, y_train[:, j])
        cols.append(np.asarray(model.predict(x_test), dtype=np.float64))
    return np.stack(cols, axis=1)

