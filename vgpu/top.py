"""`vgpu top` on a terminal: a full-screen view drawn with rich, refreshed every interval.

The screen shows each GPU (the columns of `vgpu available`), its MIG instances, and each application
(the columns of `vgpu apps`) with sparklines of its last minute: memory use against the P90
forecast and the grant, on one scale, so a person sees whether the forecast led the use and the
grant kept above it (use is red where it went over the grant). Keys: `q` quits, `s` sorts by the
next column, `r` reverses the order. Off a terminal, `vgpu top` prints plain tables instead
(vgpu/ctl.py).

The data come from three read RPCs per refresh (GetAvailableResources, ListApplications,
GetAppHistory for the last `SPARK_WINDOW_S`); a failed refresh keeps the last screen and says why.
"""

from __future__ import annotations

import math
import os
import select
import termios
import time
import tty
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from vgpu.v1 import allocator_pb2 as pb

SPARK_WINDOW_S = 60.0
SPARK_WIDTH = 30
_BLOCKS = "▁▂▃▄▅▆▇█"
# Sort keys `s` cycles through, with the APP_COLUMNS entry each sorts by.
SORT_KEYS: tuple[tuple[str, str], ...] = (
    ("granted", "GRANTED MiB"), ("used", "USED MiB"), ("p90", "P90 MiB"), ("app", "APP"), ("gpu", "GPU"),
    ("last seen", "LAST SEEN"),
)


@dataclass(frozen=True)
class Snapshot:
    devices: pb.GetAvailableResourcesResponse
    apps: pb.ListApplicationsResponse
    history: pb.GetAppHistoryResponse
    at_s: float  # the daemon's clock (history.now_unix_s), else this host's
    error: str = ""  # why the latest refresh failed, if it did (the rest is the previous snapshot)


def bins(t_s: Sequence[float], values: Sequence[float], now_s: float, *, window_s: float = SPARK_WINDOW_S,
         width: int = SPARK_WIDTH) -> list[float]:
    """`values` over the last `window_s` before `now_s` in `width` bins (the largest value of each;
    NaN where a bin has none)."""
    out = [math.nan] * width
    start = now_s - window_s
    for t, v in zip(t_s, values, strict=True):
        if not math.isfinite(v) or t < start or t > now_s + 1e-6:
            continue
        k = min(width - 1, int((t - start) / window_s * width))
        out[k] = v if math.isnan(out[k]) else max(out[k], v)
    return out


def spark(levels: Sequence[float], top: float) -> str:
    """One block character per value, scaled so that `top` is a full block; a space where unknown."""
    if not top > 0:
        top = 1.0
    chars = []
    for v in levels:
        if math.isnan(v):
            chars.append(" ")
        else:
            chars.append(_BLOCKS[max(0, min(len(_BLOCKS) - 1, round(v / top * (len(_BLOCKS) - 1))))])
    return "".join(chars)


def app_sparks(h: pb.AppHistory, now_s: float) -> Text:
    """Three lines on one scale: use (red where above the grant), P90 forecast, grant."""
    use = bins(h.t_unix_s, h.mem_used_mib, now_s)
    p90 = bins(h.t_unix_s, h.mem_p90_mib, now_s)
    grant = bins(h.t_unix_s, h.mem_granted_mib, now_s)
    top = max([v for v in (*use, *p90, *grant) if math.isfinite(v)], default=0.0)
    text = Text()
    text.append("use   ", style="dim")
    for u, g, ch in zip(use, grant, spark(use, top), strict=True):
        text.append(ch, style="bold red" if math.isfinite(g) and u > g else "green")
    text.append("\n")
    text.append("p90   ", style="dim")
    text.append(spark(p90, top), style="cyan")
    text.append("\n")
    text.append("grant ", style="dim")
    text.append(spark(grant, top), style="yellow")
    text.append(f" {top:,.0f}" if top else "", style="dim")
    return text


def _sort_value(row: dict[str, str], column: str) -> tuple[int, float, str]:
    text = row[column]
    if column == "LAST SEEN":
        if text == "N/A":
            return (1, math.inf, "")
        num, unit = text.split()[0][:-1], text.split()[0][-1]
        return (0, float(num) * {"s": 1, "m": 60, "h": 3600}.get(unit, 1), "")
    try:
        return (0, -float(text.replace(",", "")), "")  # numbers: largest first
    except ValueError:
        return (0 if text != "N/A" else 1, 0.0, text)


def render(snap: Snapshot, *, sort: int = 0, reverse: bool = False, socket: str = "") -> RenderableType:
    """The whole screen for one snapshot."""
    from vgpu.ctl import (
        APP_COLUMNS,
        DEVICE_COLUMNS,
        MIG_COLUMNS,
        PROCESS_COLUMNS,
        app_rows,
        device_rows,
        mig_rows,
        printable,
        process_rows,
    )

    def cells(row: dict[str, str], columns: Sequence[str]) -> list[Text]:
        # Text, not str: rich would read "[...]" in a user's command line as markup
        return [Text(printable(row[c])) for c in columns]

    modes = sorted({"dry run" if d.dry_run else "live" for d in snap.devices.devices}) or ["no devices"]
    head = Text()
    head.append("vgpu top", style="bold")
    head.append(f"  {time.strftime('%H:%M:%S', time.localtime(snap.at_s))}  {socket}  ")
    head.append(" / ".join(modes), style="bold yellow" if "dry run" in modes else "bold green")
    if snap.error:
        head.append(f"  refresh failed: {printable(snap.error)}", style="bold red")

    devices = Table(title="GPUs", title_justify="left", expand=False, pad_edge=False)
    # The mode is in the header; UUIDs are for `vgpu available`, where a person copies them.
    dev_cols = [c for c in DEVICE_COLUMNS if c not in ("MODE", "UUID")]
    for col in dev_cols:
        devices.add_column(col, justify="right" if col.endswith(("MiB", "W", "FREE", "MHz", "TEMP", "UTIL")) else "left",
                           no_wrap=True)
    for row in device_rows(snap.devices):
        devices.add_row(*cells(row, dev_cols))
    parts: list[RenderableType] = [head, devices]
    mig = mig_rows(snap.devices)
    if mig:
        mig_table = Table(title="MIG instances", title_justify="left", pad_edge=False)
        for col in MIG_COLUMNS:
            mig_table.add_column(col, no_wrap=True)
        for row in mig:
            mig_table.add_row(*cells(row, MIG_COLUMNS))
        parts.append(mig_table)

    procs = process_rows(snap.devices, snap.apps)
    if procs:
        proc_table = Table(title="Processes", title_justify="left", pad_edge=False)
        for col in PROCESS_COLUMNS:
            proc_table.add_column(col, justify="right" if col in ("PID", "USED MiB") else "left", no_wrap=True,
                                  max_width=40 if col == "COMMAND" else None)
        for row in procs:
            proc_table.add_row(*cells(row, PROCESS_COLUMNS))
        parts.append(proc_table)

    key, column = SORT_KEYS[sort % len(SORT_KEYS)]
    hist = {(h.app_id, h.device_id): h for h in snap.history.apps}
    rows = list(zip(app_rows(snap.apps, snap.devices, snap.at_s), snap.apps.apps, strict=True))
    rows.sort(key=lambda pair: _sort_value(pair[0], column), reverse=reverse)
    shown = [c for c in APP_COLUMNS if c not in SM_COLUMNS]
    apps = Table(title=f"Applications (sorted by {key}{', reversed' if reverse else ''})", title_justify="left",
                 pad_edge=False)
    for col in shown:
        apps.add_column(col, justify="right" if col.endswith(("MiB", "%")) else "left", no_wrap=col != "COMMAND",
                        max_width=24 if col == "COMMAND" else None)
    apps.add_column(f"MEMORY, LAST {SPARK_WINDOW_S:.0f} s", no_wrap=True)
    for row, app in rows:
        h = hist.get((app.app_id, app.device_id))
        apps.add_row(*cells(row, shown), app_sparks(h, snap.at_s) if h is not None else Text("no history", style="dim"))
    parts.append(apps)
    parts.append(Text("q quit   s sort by next column   r reverse", style="dim"))
    return Group(*parts)


# Left out of the applications table on screen: SM shares are recorded, not enforced (no MPS limit),
# and the width goes to the memory sparklines. `vgpu apps` and `vgpu top --plain` show them.
SM_COLUMNS = ("SM %", "P90 SM %", "GRANT SM %")


def run(fetch: Callable[[], Snapshot], *, interval_s: float, socket: str = "", console: Console | None = None,
        stdin_fd: int | None = None, iterations: int = 0) -> int:
    """Draw until `q` (or `iterations` refreshes). The terminal is put in cbreak mode to read single
    keys and restored on the way out, whatever happens."""
    console = console or Console()
    fd = stdin_fd if stdin_fd is not None else os.open("/dev/tty", os.O_RDONLY)
    own_fd = stdin_fd is None
    old = termios.tcgetattr(fd)
    sort, reverse = 0, False
    try:
        tty.setcbreak(fd)
        snap = fetch()
        with Live(render(snap, sort=sort, reverse=reverse, socket=socket), console=console, screen=True,
                  auto_refresh=False) as live:
            n = 1
            deadline = time.monotonic()
            while True:
                deadline += interval_s
                while (wait := deadline - time.monotonic()) > 0:
                    ready, _, _ = select.select([fd], [], [], wait)
                    if not ready:
                        break
                    for ch in os.read(fd, 64).decode(errors="ignore"):
                        if ch in ("q", "Q"):
                            return 0
                        if ch == "s":
                            sort += 1
                        elif ch == "r":
                            reverse = not reverse
                    live.update(render(snap, sort=sort, reverse=reverse, socket=socket), refresh=True)
                if iterations and n >= iterations:
                    return 0
                snap = fetch()
                n += 1
                live.update(render(snap, sort=sort, reverse=reverse, socket=socket), refresh=True)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)
        if own_fd:
            os.close(fd)


__all__ = ["SORT_KEYS", "SPARK_WINDOW_S", "Snapshot", "app_sparks", "bins", "render", "run", "spark"]
