"""Daemon memory over a simulated day: the resident set size (RSS) of the forecasting side of `vgpu
serve` while a day of 10 Hz samples of `--apps` applications, with applications leaving and new ones
arriving, passes through it in minutes.

    python bench/soak.py --apps 64 --hours 24 --json
    -> {"rss_start_mib": ..., "rss_end_mib": ..., "plateau": true, "rss_by_hour_mib": [...], ...}

What runs, in this process, wired as `vgpu serve` wires them (vgpu/daemon/serve.py): the manager's
`WindowStore` (1200 samples per application, 256 applications, a one-hour span), the served expert
mixture over the shipped model (`make_served(..., local=True)`, the model on `SERVING_THREADS`) and
the node history (`NodeHistory` in a temporary directory, the daemon's 7 days and 512 MiB, closed
segments compressed every simulated hour as the learner's housekeeping does). Time is simulated: every
`--step-s` seconds (30 by default) each application's samples of those seconds are added to its window
and one forecast round runs over every window; the mixture writes each complete second of every
application to the history, so the history holds every second of the day. Every `--churn-every-s`
(an hour) a quarter of the applications leave (their windows go idle and are evicted, the mixture
forgets them, as the manager does) and as many new ones start. Samples are a random walk of memory
with phase changes and noisy compute, seeded.

Printed: RSS (psutil) after the first simulated hour (`rss_start_mib`, everything allocated by then:
model, ONNX Runtime, full windows), at the end, its maximum and each simulated hour's; `plateau` says
whether the second half of the day grew by less than `--plateau-mib` (8 MiB); the history's size on
disk; applications seen; forecast rounds and the CPU seconds the day took. The node-local learner is
a child process of its own (manager/nodelearn.py) and not part of this RSS; bench/node_learn.py
measures its peak.

`--trees`: the mixture also serves node-local trees (manager/nodetrees.py) in its "trees" slot, as a
node whose learner promotes them does. A child process (as the learner is: LightGBM never enters the
daemon) fits them on an hour of the same kind of applications and saves `trees.json`; from the end of
the first simulated hour on, every hour the file is loaded again (`load_trees`, as the daemon's watcher
loads a promoted file) and the new trees replace the old in the slot.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.manager.experts import MixtureConfig, make_served  # noqa: E402
from vgpu.manager.history import NodeHistory  # noqa: E402
from vgpu.manager.predictor import DEFAULT_MODEL_PATH, SERVING_THREADS, load_forecaster  # noqa: E402
from vgpu.manager.window import WindowStore  # noqa: E402
from vgpu.traces import NUMERIC  # noqa: E402

HZ = 10
T0_S = 1.7e9
MAX_WINDOW_SPAN_S = 3600.0  # as vgpu/daemon/serve.py
_COL = {name: i for i, name in enumerate(NUMERIC)}


class Apps:
    """The node's applications: memory a random walk with a phase change now and then, compute noisy
    around a level per phase, capacity and power as a GPU reports them."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.next_id = 0
        self.names: list[str] = []
        self.mem_mib = np.zeros(0)
        self.sm_pct = np.zeros(0)
        self.seq = np.zeros(0, dtype=np.int64)
        self.start(n)

    def start(self, n: int) -> None:
        self.names += [f"soak/app{self.next_id + i}" for i in range(n)]
        self.next_id += n
        self.mem_mib = np.r_[self.mem_mib, self.rng.uniform(1000, 30000, n)]
        self.sm_pct = np.r_[self.sm_pct, self.rng.uniform(10, 90, n)]
        self.seq = np.r_[self.seq, np.zeros(n, dtype=np.int64)]

    def churn(self, n: int) -> list[str]:
        """The `n` oldest leave, `n` new ones start; returns those that left."""
        gone = self.names[:n]
        self.names = self.names[n:]
        self.mem_mib, self.sm_pct, self.seq = self.mem_mib[n:], self.sm_pct[n:], self.seq[n:]
        self.start(n)
        return gone

    def samples(self, i: int, t0_s: float, seconds: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seq, t_s, values (len(NUMERIC), m)) of application i over [t0_s, t0_s + seconds)."""
        m = int(seconds * HZ)
        t = t0_s + np.arange(m) / HZ
        if self.rng.random() < 0.05:  # a phase change: a new level of memory and compute
            self.mem_mib[i] = self.rng.uniform(1000, 30000)
            self.sm_pct[i] = self.rng.uniform(10, 90)
        mem = np.clip(self.mem_mib[i] + np.cumsum(self.rng.normal(0, 4, m)), 0, 40960)
        self.mem_mib[i] = mem[-1]
        values = np.full((len(NUMERIC), m), np.nan)
        values[_COL["mem_used_mib"]] = mem
        values[_COL["sm_util_pct"]] = np.clip(self.sm_pct[i] + self.rng.normal(0, 5, m), 0, 100)
        values[_COL["mem_total_mib"]] = 40960.0
        values[_COL["power_w"]] = self.rng.uniform(100, 300, m)
        values[_COL["power_limit_w"]] = 400.0
        seq = self.seq[i] + 1 + np.arange(m)
        self.seq[i] = seq[-1]
        return seq, t, values


def fit_trees(path: str, n_apps: int, seed: int) -> None:
    """Child process: node-local trees fitted on an hour of `n_apps` applications like the soak's
    (1 s samples), saved to `path`."""
    from vgpu.manager.nodetrees import NodeTrees, save_trees
    from vgpu.traces import AppTrace

    apps = Apps(n_apps, seed)
    traces = []
    for i, name in enumerate(apps.names):
        parts = [apps.samples(i, T0_S + k * 60.0, 60.0) for k in range(60)]
        t = np.concatenate([p[1] for p in parts])[::HZ]
        values = np.concatenate([p[2] for p in parts], axis=1)[:, ::HZ]
        traces.append(AppTrace(name, t, {c: values[_COL[c]] for c in ("mem_used_mib", "sm_util_pct", "mem_total_mib")}))
    save_trees(path, NodeTrees().fit(traces))


def rss_mib(proc: psutil.Process) -> float:
    return round(proc.memory_info().rss / 2**20, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--apps", type=int, default=64)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--step-s", type=float, default=30.0, help="simulated seconds per forecast round (default 30)")
    p.add_argument("--churn-every-s", type=float, default=3600.0)
    p.add_argument("--churn-frac", type=float, default=0.25)
    p.add_argument("--plateau-mib", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trees", action="store_true",
                   help="serve node-local trees in the mixture, fitted in a child process and reloaded every hour")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    # a round's newest second is one past the last it scored: a step longer than the mixture's largest gap
    # less one would read as a clock jump and nothing would be scored or written to the history
    max_step_s = MixtureConfig().max_gap_s - 1
    if args.apps < 1 or args.hours <= 0 or not 0 < args.step_s <= max_step_s or args.churn_every_s <= 0:
        p.error(f"--apps >= 1, --hours > 0, 0 < --step-s <= {max_step_s:g}, --churn-every-s > 0")
    torch.set_num_threads(SERVING_THREADS)
    proc = psutil.Process()
    tmp = tempfile.TemporaryDirectory(prefix="vgpu-soak-")
    history = NodeHistory(Path(tmp.name) / "history", horizon_s=7 * 86400.0, max_bytes=512 * 2**20)
    mixture = make_served(load_forecaster(DEFAULT_MODEL_PATH, "cpu", threads=SERVING_THREADS), local=True,
                          history=history)
    windows = WindowStore(max_samples=1200, max_apps=256, idle_evict_s=30.0, max_span_s=MAX_WINDOW_SPAN_S)
    trees_path = Path(tmp.name) / "trees.json"
    if args.trees:
        child = multiprocessing.get_context("spawn").Process(target=fit_trees,
                                                             args=(str(trees_path), args.apps, args.seed + 1))
        child.start()
        child.join()
        if child.exitcode != 0 or not trees_path.exists():
            p.error("--trees: fitting the trees in a child process failed")
    trees_loaded = 0
    apps = Apps(args.apps, args.seed)
    seen = args.apps
    steps = int(args.hours * 3600 / args.step_s)
    per_hour = max(1, int(3600 / args.step_s))
    churn_every = max(1, int(args.churn_every_s / args.step_s))
    rss_by_hour: list[float] = []
    rounds = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for k in range(steps):
        t0 = T0_S + k * args.step_s
        now = t0 + args.step_s
        if k and k % churn_every == 0:
            apps.churn(max(1, int(len(apps.names) * args.churn_frac)))
            seen += max(1, int(args.apps * args.churn_frac))
        for i, name in enumerate(apps.names):
            seq, t, values = apps.samples(i, t0, args.step_s)
            windows.add_rows(name, "GPU-soak", seq, t, values, now)
        for gone in windows.evict_idle(now):
            mixture.forget(gone)
        mixture.forecast_batch([windows.trace(a) for a in windows.apps()])
        rounds += 1
        if (k + 1) % per_hour == 0:
            history.compress_closed()
            if args.trees:  # a promotion each hour: the file read again, the new trees in the slot
                from vgpu.manager.nodetrees import load_trees  # noqa: PLC0415

                mixture.set_expert("trees", load_trees(trees_path))
                trees_loaded += 1
            rss_by_hour.append(rss_mib(proc))
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    history.close()
    disk_mib = round(history.size_bytes() / 2**20, 2)
    half = len(rss_by_hour) // 2
    growth_2nd_half = round(rss_by_hour[-1] - rss_by_hour[half], 1) if len(rss_by_hour) >= 2 else None
    result = {
        "apps": args.apps,
        "hours": args.hours,
        "step_s": args.step_s,
        "hz": HZ,
        "apps_seen": seen,
        "rounds": rounds,
        "rss_start_mib": rss_by_hour[0] if rss_by_hour else None,
        "rss_end_mib": rss_mib(proc),
        "rss_max_mib": max(rss_by_hour) if rss_by_hour else None,
        "rss_growth_second_half_mib": growth_2nd_half,
        "plateau": growth_2nd_half is not None and growth_2nd_half < args.plateau_mib,
        "rss_by_hour_mib": rss_by_hour,
        "history_disk_mib": disk_mib,
        "history_rows": history.rows_written,
        "mixture_scored": mixture.scored,
        "trees_loaded": trees_loaded,
        "cpu_s": round(cpu_s, 1),
        "wall_s": round(wall_s, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
    }
    tmp.cleanup()
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
