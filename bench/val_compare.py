"""Checkpoints compared on the validation split of a corpus, the way `vgpu train` scores its own
validation (every origin from the 4th second, the checkpoint's dead band and P90 shift applied, clamped
as served): MAE against the last value's, and P90 coverage, per target and horizon. Only the
validation split is read, so a choice made here never looks at the test split.

    python bench/val_compare.py --trace runs/migperf.csv.gz [--trace ...] old=manager/models/default.pt new=runs/x.pt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.manager.checkpoint import load_checkpoint  # noqa: E402
from vgpu.manager.predictor import apply_deadband  # noqa: E402
from vgpu.offline import splits  # noqa: E402
from vgpu.offline import train as T  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", action="append", required=True)
    p.add_argument("--by-file", action="store_true", help="also score each trace file's validation apps alone")
    p.add_argument("models", nargs="+", help="NAME=PATH")
    args = p.parse_args()
    torch.set_num_threads(1)
    apps, files = T.load_apps(args.trace)
    groups = {"all": splits.split_ids(apps)["val"]}
    if args.by_file:
        for f in files:
            groups[f["path"]] = [a for a in f["app_ids"] if splits.split_of(a) == "val"]
    out: dict[str, dict[str, object]] = {}
    for item in args.models:
        name, _, path = item.partition("=")
        ck = load_checkpoint(path, map_location="cpu")
        spec = ck.metadata.features
        shift = np.array(ck.metadata.p90_shift)
        band = np.array(ck.metadata.p50_deadband)
        for group, ids in groups.items():
            if not ids:
                continue
            val = T.build_dataset([apps[a] for a in ids], spec)
            raw = T._predict(ck.model, val.x, torch.device("cpu"))
            pred = apply_deadband(raw, band)
            m = T.metrics(pred, shift, val, spec.horizons_s)
            loss = T._masked_pinball(raw, val)
            out.setdefault(group, {})[name] = {"pinball_loss_raw": loss, "windows": len(val), "metrics": m}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
