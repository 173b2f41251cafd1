"""Synthetic traces for the forecaster's tests : small, deterministic, seconds to train on."""

from __future__ import annotations

import numpy as np

from vgpu.offline import splits
from vgpu.traces import AppTrace


def ramp_app(
    app: str,
    *,
    seconds: int = 60,
    dt_s: float = 1.0,
    mem_total_mib: float | None = 10240.0,
    seed: int = 0,
    t0_s: float = 1000.0,
) -> AppTrace:
    """A load-then-steady application: memory ramps to a plateau, compute follows with noise."""
    rng = np.random.default_rng(seed)
    t = t0_s + np.arange(0, seconds, dt_s)
    frac = np.clip((t - t0_s) / 10.0, 0, 1)
    plateau = 2000.0 + 500.0 * (seed % 7)
    mem = plateau * frac + rng.normal(0, 5, len(t)).clip(-5, 5)
    sm = np.clip(20 + 60 * frac + rng.normal(0, 3, len(t)), 0, 100)
    columns = {"mem_used_mib": np.maximum(mem, 0), "sm_util_pct": sm}
    if mem_total_mib is not None:
        columns["mem_total_mib"] = np.full(len(t), mem_total_mib)
    return AppTrace(app=app, t_s=t, columns=columns, gpu="sim0")


def ids_in(split: str, count: int, prefix: str = "synthetic/app") -> list[str]:
    """`count` application ids that `vgpu.offline.splits` puts in `split`."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        name = f"{prefix}{i}"
        if splits.split_of(name) == split:
            out.append(name)
        i += 1
    return out


def population(train: int = 6, val: int = 3, test: int = 2, seconds: int = 40) -> list[AppTrace]:
    apps = []
    for split, count in (("train", train), ("val", val), ("test", test)):
        for j, name in enumerate(ids_in(split, count)):
            apps.append(ramp_app(name, seconds=seconds, seed=j + 10 * len(apps)))
    return apps
