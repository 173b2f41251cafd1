"""Pictures of a replay (bench/replay.py --plot DIR): per application, one panel per policy, side by
side, drawn like `vgpu report` (vgpu/plots.py): memory used, the policy's P50/P90 forecast where it
has one (predictive: the forecaster; vpa: its percentile estimator), the grant in force at each
second, OOM events (use above that grant) and grant changes.

    plot_replay(timeline, out_dir, max_apps=6, title=...) -> the PNG paths written, one per application
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vgpu import plots

Point = tuple[float, float, float, float, float]  # t, used, P50, P90, grant in force (MiB)
COLUMNS = 3  # panels per row


def timeline(policy: str, points: Sequence[Point]) -> plots.Timeline:
    arr = np.asarray(points, dtype=np.float64).reshape(-1, 5)
    t, used, p50, p90, grant = (arr[:, i] for i in range(5))
    return plots.Timeline(policy, t, used, p50, p90, grant, plots.marks_from_series(t, used, grant))


def _file_name(app_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", app_id)[:100] or "app"


def plot_replay(data: dict[tuple[str, str], list[Point]], out_dir: Path, *, max_apps: int = 6,
                title: str = "replay") -> list[Path]:
    """One PNG per application (the first `max_apps` by name), its policies in the replay's order."""
    policies = list(dict.fromkeys(p for p, _ in data))
    apps = sorted({a for _, a in data})[: max(0, max_apps)]
    written = []
    for app in apps:
        panels: list[plots.Timeline | None] = [timeline(p, data[(p, app)]) if (p, app) in data else None
                                               for p in policies]
        grid = [panels[i: i + COLUMNS] for i in range(0, len(panels), COLUMNS)]
        fig = plots.figure(grid, title=f"{app}: {title}", xlabel="replay time (s)")
        written.append(plots.save(fig, out_dir / f"{_file_name(app)}.png", title=f"{app}: {title}"))
    return written


__all__ = ["plot_replay", "timeline"]
