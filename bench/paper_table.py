"""Reproduce the research's model comparison on real job profiles.

    python bench/paper_table.py --json [--data ../shared/data] [--seed 0] [--subset N] [--models A,B]

Trains, on ONE seeded 70/30 split of the permitted job profiles (MIGPerf + MISO + GPUMemNet, see
manager/jobprofiles.py), the Transformer-BiGRU and ExtraTrees, CatBoost, XGBoost, LightGBM, a decision
tree, a random forest and AdaBoost, and prints for each model and target (peak GPU memory in MiB,
utilization in %) MSE, RMSE, MAE, MAPE (%) and R2 on the 30 % test part. Same inputs, same numbers.

`--lucid-check` (development only: Lucid is non-commercial) adds the error of each model, trained as
above, on Lucid's 66 single-job profiles: jobs of other model types on another GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vgpu.manager import jobprofiles  # noqa: E402
from vgpu.manager.regressors import ALL_MODELS, BiGRUSettings, fit_predict, regression_metrics, split_indices  # noqa: E402

TARGETS: tuple[str, ...] = ("peak_mem_mib", "sm_util_pct")
PAPER = {  # the paper's own 517-row private set: (MSE, R2); its units are not stated
    "Transformer-BiGRU": (2.208, 0.855),
    "LightGBM": (2.942, 0.803),
    "XGBoost": (4.464, 0.69),
    "ExtraTrees": (4.414, 0.68),
    "CatBoost": (6.71, 0.568),
}


def compare(
    data_root: Path,
    seed: int = 0,
    subset: int | None = None,
    models: Sequence[str] = ALL_MODELS,
    bigru: BiGRUSettings | None = None,
    lucid_check: bool = False,
) -> dict[str, Any]:
    profiles = jobprofiles.load_permitted(data_root)
    if subset is not None:
        keep = np.sort(np.random.default_rng(seed).permutation(len(profiles))[:subset])
        profiles = [profiles[i] for i in keep]
    x, mem, util = jobprofiles.encode_profiles(profiles)
    y = np.stack([mem, util], axis=1)
    train, test = split_indices(len(profiles), 0.7, seed)
    lucid = jobprofiles.load_lucid(data_root) if lucid_check else []
    lucid_xy = jobprofiles.encode_profiles(lucid) if lucid else None  # (x, mem, util)
    rows: list[dict[str, Any]] = []
    lucid_rows: list[dict[str, Any]] = []
    timings: dict[str, float] = {}
    for name in models:
        t0 = time.perf_counter()
        x_eval = x[test] if lucid_xy is None else np.concatenate([x[test], lucid_xy[0]])
        pred = fit_predict(name, x[train], y[train], x_eval, seed=seed, bigru=bigru)
        timings[name] = round(time.perf_counter() - t0, 2)
        for j, target in enumerate(TARGETS):
            m = regression_metrics(y[test, j], pred[: len(test), j])
            rows.append({"model": name, "target": target, **{k: round(v, 4) for k, v in m.items()}})
            if lucid_xy is not None:
                _, mem_l, util_l = lucid_xy
                truth = (mem_l, util_l)[j]
                ml = regression_metrics(truth, pred[len(test) :, j])
                lucid_rows.append({"model": name, "target": target, **{k: round(v, 4) for k, v in ml.items()}})
    best = {t: min((r for r in rows if r["target"] == t), key=lambda r: r["mse"])["model"] for t in TARGETS}
    out: dict[str, Any] = {
        "split": "70/30",
        "n_train": int(len(train)),
        "n_test": int(len(test)),
        "rows": rows,
        "best_by_mse": best,
        "seed": seed,
        "data": jobprofiles.profiles_summary(profiles),
        "units": {"peak_mem_mib": "MiB (mse in MiB^2)", "sm_util_pct": "% (mse in %^2)", "mape": "%"},
        "fit_s": timings,
        "paper_517_rows_mse_r2": PAPER,
    }
    if lucid_check:
        out["lucid_check_dev_only"] = lucid_rows
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paper_table.py", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default is a table)")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--subset", type=int, default=None, help="use this many rows (seeded sample)")
    parser.add_argument("--models", default=",".join(ALL_MODELS), help="comma-separated subset of models")
    parser.add_argument("--epochs", type=int, default=BiGRUSettings().epochs, help="Transformer-BiGRU epochs")
    parser.add_argument("--lucid-check", action="store_true", help="also score on Lucid (development only)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in ALL_MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; expected some of {', '.join(ALL_MODELS)}")
    if not args.data.is_dir():
        print(f"paper_table.py: data directory {args.data} not found (pass --data)", file=sys.stderr)
        return 2
    if args.epochs < 1:
        parser.error("--epochs must be >= 1")
    result = compare(
        args.data, args.seed, args.subset, models, BiGRUSettings(epochs=args.epochs), lucid_check=args.lucid_check
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"split {result['split']}: {result['n_train']} train / {result['n_test']} test rows {result['data']}")
    print(f"{'model':<18} {'target':<13} {'mse':>12} {'rmse':>9} {'mae':>9} {'mape%':>7} {'r2':>7}")
    for r in result["rows"]:
        print(
            f"{r['model']:<18} {r['target']:<13} {r['mse']:>12.2f} {r['rmse']:>9.2f} {r['mae']:>9.2f} {r['mape']:>7.2f} {r['r2']:>7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
