"""Forecast latency: one batched forecast for N applications on one CPU thread, feature building
included (what the manager pays per forecast tick).

    python bench/forecast_latency.py --apps 64 --json
    -> {"apps": 64, "p50_ms": ..., "p99_ms": ..., "tick_ms": 100, ...}

Each application's history is `--history-s` seconds of 100 ms samples (the profiler's rate) with
memory, compute, capacity and power, as the manager's window holds them. `--model` picks a
checkpoint (default: the shipped one; an untrained model of the default configuration where none
is shipped, which costs the same). `--mode` picks how the network runs (vgpu.manager.predictor.MODES:
eager, fused, onnx; default: the daemon's, onnx); `torchscript` traces the eager network with
TorchScript, for comparison. `mode_serving` says what ran (onnx falls back to fused without ONNX
Runtime).

`--mixture` times the served forecaster instead: the per-application expert mixture
(manager/experts.py) over the last value, the EWMA and the model, weighting included. Each
iteration advances every history by one second (the daemon forecasts each application once a
second), so every call also scores the forecasts whose truth arrived; `mixture_only_p50_ms` is the
mixture's own share (its time less the model's call on the same histories). With `--trees` the
mixture also has node-local trees in its "trees" slot (manager/nodetrees.py, fitted first on the
bench's own histories, as a node's learner would on its history); `trees_p50_ms` is their own call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.manager.checkpoint import Checkpoint, Metadata, load_checkpoint  # noqa: E402
from vgpu.manager.experts import make_served  # noqa: E402
from vgpu.manager.features import N_FEATURES, FeatureSpec  # noqa: E402
from vgpu.manager.model import ModelConfig, TransformerBiGRU  # noqa: E402
from vgpu.manager.predictor import DEFAULT_MODE, DEFAULT_MODEL_PATH, MODES, ModelForecaster  # noqa: E402
from vgpu.offline.train import DEFAULT_WINDOW_S  # noqa: E402
from vgpu.traces import AppTrace  # noqa: E402

TICK_MS = 100


def histories(n_apps: int, history_s: float, seed: int = 0) -> list[AppTrace]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_apps):
        t = 1000.0 + np.arange(0, history_s, 0.1)
        n = len(t)
        out.append(
            AppTrace(
                app=f"bench/{i}",
                t_s=t,
                columns={
                    "mem_used_mib": np.full(n, 2000.0 + 100 * i) + rng.normal(0, 5, n),
                    "sm_util_pct": np.clip(rng.normal(60, 10, n), 0, 100),
                    "mem_total_mib": np.full(n, 40960.0),
                    "power_w": rng.uniform(100, 300, n),
                    "power_limit_w": np.full(n, 400.0),
                },
            )
        )
    return out


def _checkpoint(path: str | None) -> Checkpoint:
    if path is None and DEFAULT_MODEL_PATH.exists():
        path = str(DEFAULT_MODEL_PATH)
    if path is not None:
        return load_checkpoint(path)
    cfg = ModelConfig(n_features=N_FEATURES)
    return Checkpoint(
        TransformerBiGRU(cfg).eval(),
        Metadata(config=cfg, features=FeatureSpec(DEFAULT_WINDOW_S)),
        "untrained",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apps", type=int, default=64)
    p.add_argument("--history-s", type=float, default=60.0)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None)
    p.add_argument("--mode", choices=(*MODES, "torchscript"), default=DEFAULT_MODE)
    p.add_argument("--mixture", action="store_true", help="time the served expert mixture (model included)")
    p.add_argument("--trees", action="store_true", help="--mixture: with node-local trees in their slot")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.trees and not args.mixture:
        p.error("--trees puts trees in the mixture: give --mixture too")
    torch.set_num_threads(args.threads)
    ck = _checkpoint(args.model)
    mode = "eager" if args.mode == "torchscript" else args.mode
    forecaster = ModelForecaster(ck, device="cpu", mode=mode, threads=args.threads)
    if args.mode == "torchscript":
        example = torch.zeros(args.apps, ck.metadata.features.window_s, forecaster.n_features)
        with torch.inference_mode():
            # torch.jit.trace is unannotated
            traced = torch.jit.trace(forecaster.model, example)  # type: ignore[no-untyped-call]
            forecaster._net = torch.jit.freeze(traced)  # noqa: SLF001
    hist = histories(args.apps, args.history_s + (args.iterations + 11 if args.mixture else 0))
    if args.mixture:
        return _mixture(args, forecaster, hist)
    for _ in range(10):
        forecaster.forecast_batch(hist)
    times = []
    feat_times = []
    from vgpu.manager.features import encode_latest  # noqa: PLC0415

    for _ in range(args.iterations):
        t0 = time.perf_counter()
        forecaster.forecast_batch(hist)
        times.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        encode_latest(hist, forecaster.window_s, forecaster.feature_version)
        feat_times.append((time.perf_counter() - t0) * 1000)
    result = {
        "apps": args.apps,
        "p50_ms": round(float(np.percentile(times, 50)), 3),
        "p99_ms": round(float(np.percentile(times, 99)), 3),
        "tick_ms": TICK_MS,
        "features_p50_ms": round(float(np.percentile(feat_times, 50)), 3),
        "mode": args.mode,
        "mode_serving": "torchscript" if args.mode == "torchscript" else forecaster.mode_serving,
        "threads": args.threads,
        "window_s": forecaster.window_s,
        "order": ck.metadata.config.order,
        "history_s": args.history_s,
        "model": ck.path,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}",
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0


def _upto(hist: list[AppTrace], end_s: float, span_s: float) -> list[AppTrace]:
    """Each history's last `span_s` seconds before `end_s` (the daemon's window one second later
    each time, as long as the plain run's)."""
    out = []
    for h in hist:
        lo, n = int(np.searchsorted(h.t_s, end_s - span_s)), int(np.searchsorted(h.t_s, end_s))
        out.append(AppTrace(h.app, h.t_s[lo:n], {k: v[lo:n] for k, v in h.columns.items()}))
    return out


def _mixture(args: argparse.Namespace, model: ModelForecaster, hist: list[AppTrace]) -> int:
    mixture = make_served(model, local=args.trees)
    trees = None
    if args.trees:
        from vgpu.manager.nodetrees import NodeTrees  # noqa: PLC0415

        trees = NodeTrees().fit(hist)
        mixture.set_expert("trees", trees)
    t0_s = float(hist[0].t_s[0]) + args.history_s
    steps = [_upto(hist, t0_s + k, args.history_s) for k in range(args.iterations + 10)]
    times, model_times, cpu, model_cpu, trees_times = [], [], [], [], []
    for k, batch in enumerate(steps):
        if trees is not None:
            t0 = time.perf_counter()
            trees.forecast_arrays(batch)  # what the mixture calls
            if k >= 10:
                trees_times.append((time.perf_counter() - t0) * 1000)
        t0, c0 = time.perf_counter(), time.thread_time()
        mixture.forecast_batch(batch)
        took, took_cpu = (time.perf_counter() - t0) * 1000, (time.thread_time() - c0) * 1000
        t0, c0 = time.perf_counter(), time.thread_time()
        model.forecast_batch(batch)
        model_took, model_took_cpu = (time.perf_counter() - t0) * 1000, (time.thread_time() - c0) * 1000
        if k >= 10:
            times.append(took)
            model_times.append(model_took)
            cpu.append(took_cpu)
            model_cpu.append(model_took_cpu)
    own = np.asarray(times) - np.asarray(model_times)
    own_cpu = np.asarray(cpu) - np.asarray(model_cpu)
    result = {
        "apps": args.apps,
        "forecaster": "mixture",
        "experts": list(mixture.expert_names),
        "p50_ms": round(float(np.percentile(times, 50)), 3),
        "p99_ms": round(float(np.percentile(times, 99)), 3),
        "model_p50_ms": round(float(np.percentile(model_times, 50)), 3),
        "mixture_only_p50_ms": round(float(np.percentile(own, 50)), 3),
        # the calling thread's CPU time: what a shared, loaded machine's wall time overstates
        "cpu_p50_ms": round(float(np.percentile(cpu, 50)), 3),
        "model_cpu_p50_ms": round(float(np.percentile(model_cpu, 50)), 3),
        "mixture_only_cpu_p50_ms": round(float(np.percentile(own_cpu, 50)), 3),
        **({"trees_p50_ms": round(float(np.percentile(trees_times, 50)), 3)} if trees_times else {}),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "scored": mixture.scored,
        "mode_serving": model.mode_serving,
        "threads": args.threads,
        "history_s": args.history_s,
        "model": model.checkpoint.path,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}",
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, v in result.items():
            print(f"{key}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
