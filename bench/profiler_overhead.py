"""Profiler overhead on the simulated backend: sample every app of every GPU at 10 Hz and encode the batch.

    python bench/profiler_overhead.py --gpus 8 --apps 64 --seconds 10 --json

Prints {"gpus", "apps", "ticks", "signatures_per_tick", "cpu_frac", "tick_p50_ms", "tick_p99_ms",
"late_ticks"}: cpu_frac is this process's CPU time over wall time while the loop ran (1.0 = one core);
tick_ms the time to sample and serialise one tick's `SignatureBatch`. No manager is involved (the
network send is measured by the ingest benchmarks), so this is the profiler's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from profiler.sampler import Sampler  # noqa: E402
from profiler.stream import FixedRateLoop  # noqa: E402
from vgpu.device.sim import SimBackend  # noqa: E402
from vgpu.traces import AppTrace  # noqa: E402
from vgpu.v1 import ingest_pb2  # noqa: E402


def _trace(i: int, seconds: int) -> AppTrace:
    t = np.arange(0.0, float(seconds), 0.1)
    rng = np.random.default_rng(i)
    mem = 500.0 + 200.0 * np.abs(np.sin(t / 5.0 + i)) + rng.normal(0, 5, len(t)).clip(-5, 5)
    sm = (10.0 + 3.0 * np.abs(np.cos(t / 3.0 + i))).clip(0, 100)
    return AppTrace(app=f"app{i}", t_s=t, columns={"mem_used_mib": mem, "sm_util_pct": sm})


def run(gpus: int, apps: int, seconds: float, period_s: float) -> dict[str, float | int]:
    backend = SimBackend(["h100-80gb"] * gpus)
    for i in range(apps):
        backend.launch(f"app{i}", 10_000 + i, _trace(i, int(seconds) + 10), device_index=i % gpus, loop=True)
    names = {10_000 + i: f"app{i}" for i in range(apps)}
    sampler = Sampler(backend, psutil_module=None, inapp_dir=None, app_id_of=names.get)
    durations: list[float] = []
    sizes: list[int] = []

    async def tick(k: int) -> None:
        t0 = time.perf_counter()
        sigs = sampler.sample()
        batch = ingest_pb2.SignatureBatch(profiler_id="bench", tick=k, sent_at_s=time.time(), signatures=sigs)
        batch.SerializeToString()
        durations.append(time.perf_counter() - t0)
        sizes.append(len(sigs))

    loop = FixedRateLoop(period_s)
    stop = asyncio.Event()
    cpu0, wall0 = time.process_time(), time.monotonic()
    stats = asyncio.run(loop.run(tick, stop, max_ticks=int(round(seconds / period_s))))
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    ms = np.asarray(durations) * 1000.0
    return {
        "gpus": gpus,
        "apps": apps,
        "ticks": stats.ticks,
        "signatures_per_tick": float(np.mean(sizes)),
        "cpu_frac": round(cpu / wall, 4),
        "tick_p50_ms": round(float(np.percentile(ms, 50)), 3),
        "tick_p99_ms": round(float(np.percentile(ms, 99)), 3),
        "late_ticks": stats.late_ticks,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--apps", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--period-ms", type=float, default=100.0)
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args(argv)
    if args.gpus < 1 or args.apps < 0 or args.seconds <= 0 or args.period_ms <= 0:
        p.error("--gpus >= 1, --apps >= 0, --seconds > 0 and --period-ms > 0")
    result = run(args.gpus, args.apps, args.seconds, args.period_ms / 1000.0)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>20}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
