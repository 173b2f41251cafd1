"""One round of node-local learning (manager/nodelearn.py) on a canonical trace taken as the node's
history: its CPU time, wall time, peak memory and whether the candidate was promoted; first the
node-local trees' round (manager/nodetrees.py), as the learner's child runs it, under `trees`.

    python bench/node_learn.py --trace runs/migperf.csv.gz --split val --json
    -> {"cpu_s": ..., "wall_s": ..., "max_rss_mib": ..., "event": "promoted" | "rejected", ...,
        "trees": {"cpu_s": ..., "wall_s": ..., "max_rss_mib": ..., "event": "trees_promoted" | ...}}

The round runs in this process with one torch thread, as the daemon's child process does (without its
nice 19, so that the figure is the work itself); the state directory is a fresh temporary one unless
`--state-dir` is given. The model is the shipped one unless `--model` names another.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.manager import nodelearn as NL  # noqa: E402
from vgpu.manager import nodetrees as NT  # noqa: E402
from vgpu.manager.predictor import DEFAULT_MODEL_PATH  # noqa: E402
from vgpu.offline.splits import select  # noqa: E402
from vgpu.traces import read_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--split", default="all", choices=("train", "val", "test", "all"))
    p.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    p.add_argument("--holdout-s", type=float, default=NL.LearnConfig.holdout_s)
    p.add_argument("--state-dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    apps = list(select(read_trace(args.trace).apps, args.split).values())
    state = args.state_dir or tempfile.mkdtemp(prefix="vgpu-node-learn-")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    trees_entry = NT.learn_round(state, apps, NT.TreesConfig(holdout_s=args.holdout_s))
    trees = {
        "cpu_s": round(time.process_time() - cpu0, 1),
        "wall_s": round(time.perf_counter() - wall0, 1),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,  # the reading of the trace included
        **{k: v for k, v in trees_entry.items() if k != "at"},
    }
    cpu0, wall0 = time.process_time(), time.perf_counter()
    entry = NL.learn_once(state, apps, args.model, NL.LearnConfig(holdout_s=args.holdout_s))
    result = {
        "trace": args.trace,
        "split": args.split,
        "apps": len(apps),
        "cpu_s": round(time.process_time() - cpu0, 1),
        "wall_s": round(time.perf_counter() - wall0, 1),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        **{k: v for k, v in entry.items() if k != "at"},
        "trees": trees,
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
