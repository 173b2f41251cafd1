"""Pictures of forecast against use: one panel per application, memory over time.

Each panel draws the memory the application used, the P50 and P90 forecasts made at each tick (the
band between them shaded), and the memory granted (a step line); OOM events (the use crossed above
the grant) are red vertical lines, grant changes triangles on the grant line (up: granted or grown,
down: shrunk or released). A forecast is drawn at the time it was made: where its line rises before
the use does, the forecast led the use.

Used by `vgpu report` (the daemon's history), `vgpu demo --plot` and `bench/replay.py --plot`
(policy beside policy). matplotlib is imported only here, and only when a picture is drawn; the
Agg backend needs no display. A `.png` path gives a PNG, `.svg` an SVG, `.html` a page with the
picture inline (SVG) and a table of the events.
"""

from __future__ import annotations

import html
import io
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from vgpu.v1 import allocator_pb2 as pb

FloatArray = npt.NDArray[np.float64]
FORMATS = (".png", ".svg", ".html")
# Grant-change kinds drawn as triangles pointing up (more memory) or down (less).
_UP = ("granted", "grow")
COLOURS = {"used": "#1f2937", "p50": "#2563eb", "p90": "#7c3aed", "granted": "#16a34a", "oom": "#dc2626"}


@dataclass(frozen=True)
class Mark:
    """Something that happened at `t_s`: kind "oom", or a grant change ("granted", "grow", "shrink",
    "released"); `mib`: the grant after it (NaN: unknown)."""

    t_s: float
    kind: str
    detail: str = ""
    mib: float = math.nan


@dataclass(frozen=True)
class Timeline:
    """One application's memory over time (seconds on any common origin); NaN where unknown."""

    title: str
    t_s: FloatArray
    used_mib: FloatArray
    p50_mib: FloatArray
    p90_mib: FloatArray
    granted_mib: FloatArray
    marks: tuple[Mark, ...] = field(default=())

    def __post_init__(self) -> None:
        n = len(self.t_s)
        for name in ("used_mib", "p50_mib", "p90_mib", "granted_mib"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} values for {n} times")


_MEM_CHANGE = re.compile(r"(-?[\d.]+) -> (-?[\d.]+) MiB")


def _kind(e: pb.HistoryEvent) -> str:
    """A resize's direction in memory from its detail ("memory 4096 -> 2048 MiB", "SM 40 -> 23 %",
    or both); "sm" when only the SM share changed (not drawn on a memory picture)."""
    if e.kind != "resized":
        return e.kind
    m = _MEM_CHANGE.search(e.detail)
    if m is None:
        return "sm" if " %" in e.detail else "grow"
    try:
        before, after = float(m[1]), float(m[2])
    except ValueError:
        return "grow"
    return "grow" if after > before else "shrink" if after < before else "sm"


def from_history(h: pb.AppHistory, t0_s: float, title: str | None = None) -> Timeline:
    """A daemon history (GetAppHistory) on seconds since `t0_s`."""
    t = np.asarray(h.t_unix_s, dtype=np.float64) - t0_s
    marks = tuple(Mark(e.t_unix_s - t0_s, _kind(e), e.detail, e.mem_granted_mib) for e in h.events)
    return Timeline(title or h.app_id, t, np.asarray(h.mem_used_mib, dtype=np.float64),
                    np.asarray(h.mem_p50_mib, dtype=np.float64), np.asarray(h.mem_p90_mib, dtype=np.float64),
                    np.asarray(h.mem_granted_mib, dtype=np.float64), marks)


def marks_from_series(t_s: FloatArray, used_mib: FloatArray, granted_mib: FloatArray) -> tuple[Mark, ...]:
    """Grant changes and OOM events of a series whose `granted_mib[i]` is the grant in force at
    `t_s[i]`: an OOM event is the first tick of a run where the use exceeds it."""
    marks: list[Mark] = []
    over = False
    for i in range(len(t_s)):
        g, prev = float(granted_mib[i]), float(granted_mib[i - 1]) if i > 0 else math.nan
        if i > 0 and math.isfinite(g) and g != prev:
            kind = "granted" if not math.isfinite(prev) else ("grow" if g > prev else "shrink")
            marks.append(Mark(float(t_s[i]), kind, f"{prev:.0f} -> {g:.0f} MiB", g))
        now_over = bool(math.isfinite(g) and used_mib[i] > g + 1.0)
        if now_over and not over:
            marks.append(Mark(float(t_s[i]), "oom", f"use {used_mib[i]:.0f} MiB > granted {g:.0f} MiB", g))
        over = now_over
    return tuple(marks)


def grant_steps(tl: Timeline) -> tuple[FloatArray, FloatArray]:
    """The grant over time: the points' values, and each grant change where it happened (a change
    made while planning another application's tick falls between this one's points)."""
    changes = [(m.t_s, m.mib) for m in tl.marks if m.kind != "oom" and math.isfinite(m.mib)]
    if not changes:
        return tl.t_s, tl.granted_mib
    t = np.concatenate([tl.t_s, np.array([c[0] for c in changes])])
    v = np.concatenate([tl.granted_mib, np.array([c[1] for c in changes])])
    order = np.argsort(t, kind="stable")
    return t[order], v[order]


def draw_panel(ax: object, tl: Timeline, *, legend: bool = True) -> None:
    """One application on one matplotlib Axes."""
    from matplotlib.axes import Axes

    assert isinstance(ax, Axes)
    t = tl.t_s
    # The use underneath, wide and light, so that forecasts that match it stay visible on top.
    ax.plot(t, tl.used_mib, color=COLOURS["used"], linewidth=3.0, alpha=0.35, label="used")
    ax.fill_between(t, tl.p50_mib, tl.p90_mib, color=COLOURS["p90"], alpha=0.15, linewidth=0,
                    label="forecast P50-P90 band")
    grant_t, grant_v = grant_steps(tl)
    ax.step(grant_t, grant_v, where="post", color=COLOURS["granted"], linewidth=1.8, label="granted")
    ax.plot(t, tl.p50_mib, color=COLOURS["p50"], linewidth=1.0, linestyle="--", label="forecast P50")
    ax.plot(t, tl.p90_mib, color=COLOURS["p90"], linewidth=1.0, label="forecast P90")
    ooms = [m for m in tl.marks if m.kind == "oom"]
    for i, m in enumerate(ooms):
        ax.axvline(m.t_s, color=COLOURS["oom"], linewidth=1.0, alpha=0.8, label="OOM event" if i == 0 else None)
    changes = [m for m in tl.marks if m.kind not in ("oom", "sm") and math.isfinite(m.mib)]
    up = [m for m in changes if m.kind in _UP]
    down = [m for m in changes if m.kind not in _UP]
    if up:
        ax.scatter([m.t_s for m in up], [m.mib for m in up], marker="^", color=COLOURS["granted"], s=28, zorder=5,
                   label="grant up")
    if down:
        ax.scatter([m.t_s for m in down], [m.mib for m in down], marker="v", color=COLOURS["granted"], s=28,
                   zorder=5, edgecolors="black", linewidths=0.4, label="grant down")
    ax.set_title(f"{tl.title}: {len(ooms)} OOM event{'s' if len(ooms) != 1 else ''}, "
                 f"{len(changes)} memory grant change{'s' if len(changes) != 1 else ''}", fontsize=10, loc="left")
    ax.set_ylabel("memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(loc="upper left", fontsize=7, ncol=4, framealpha=0.8)


_LEGEND: tuple[tuple[str, Literal["-", "--", "none"], str], ...] = (
    ("used", "-", ""), ("forecast P50", "--", ""), ("forecast P90", "-", ""), ("granted", "-", ""),
    ("OOM event", "-", ""), ("grant up", "none", "^"), ("grant down", "none", "v"))
_LEGEND_COLOUR = {"used": "used", "forecast P50": "p50", "forecast P90": "p90", "granted": "granted",
                  "OOM event": "oom", "grant up": "granted", "grant down": "granted"}


def _figure_legend(fig: Figure, cols: int) -> None:
    """One legend for every panel, above them (a panel's own would hide its data)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[object] = [
        Line2D([], [], color=COLOURS[_LEGEND_COLOUR[name]], linestyle=style, marker=marker,
               linewidth=3.0 if name == "used" else 1.5, alpha=0.35 if name == "used" else 1.0, label=name)
        for name, style, marker in _LEGEND
    ]
    handles.insert(3, Patch(color=COLOURS["p90"], alpha=0.15, label="P50-P90 band"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4 * cols, fontsize=8, frameon=False)


def figure(grid: Sequence[Sequence[Timeline | None]], *, title: str, xlabel: str = "time (s)") -> Figure:
    """Rows of panels (one row per application, one column per policy or source); None: an empty cell."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    rows = max(1, len(grid))
    cols = max(1, max((len(r) for r in grid), default=1))
    fig = Figure(figsize=(5.5 * cols + 1.5, 2.9 * rows + 0.8), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharex="col")
    for i in range(rows):
        for j in range(cols):
            ax = axes[i][j]
            tl = grid[i][j] if i < len(grid) and j < len(grid[i]) else None
            if tl is None:
                ax.set_axis_off()
                continue
            draw_panel(ax, tl, legend=False)
            if i == rows - 1:
                ax.set_xlabel(xlabel)
    fig.suptitle(title, fontsize=12)
    _figure_legend(fig, cols)
    return fig


def destination_problem(path: Path) -> str | None:
    """Why a picture cannot be written to `path`, said before the work that draws it (a demo run, a
    call to the daemon); None when it can. The picture goes into a directory that exists: none is
    created, so a mistyped path is an error rather than a new directory with this process's owner
    and umask."""
    if path.suffix.lower() not in FORMATS:
        return f"the picture must end in {', '.join(FORMATS[:-1])} or {FORMATS[-1]}"
    directory = path.parent
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist (create it first)"
        return f"the directory {directory} {what}"
    if path.is_dir():
        return f"{path} is a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"no permission to write in {directory}"
    return None


def save(fig: Figure, path: Path, *, title: str, timelines: Sequence[Timeline] = ()) -> Path:
    """Write `fig` to `path` (.png, .svg or .html: a page with the SVG inline and the events), into a
    directory that exists (`destination_problem`)."""
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: the picture must be one of {', '.join(FORMATS)}")
    if suffix != ".html":
        fig.savefig(path, dpi=110)
        return path
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # inline: no XML declaration or doctype
    rows = "".join(
        f"<tr><td>{html.escape(tl.title)}</td><td>{m.t_s:.1f}</td><td>{html.escape(m.kind)}</td>"
        f"<td>{html.escape(m.detail)}</td></tr>"
        for tl in timelines for m in tl.marks
    )
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><div id=\"figure\">{svg}</div>"
        f"<h2>Events</h2><table id=\"events\"><tr><th>application</th><th>t (s)</th><th>kind</th><th>detail</th></tr>"
        f"{rows}</table></body></html>\n"
    )
    path.write_text(page)
    return path


__all__ = ["FORMATS", "Mark", "Timeline", "destination_problem", "draw_panel", "figure", "from_history", "grant_steps", "marks_from_series",
           "save"]
