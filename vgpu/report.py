"""`vgpu report`: a picture of forecast against use from the daemon's history.

    vgpu report (--app ID | --device INDEX|UUID) [--since 10m] --out FILE.png|.svg|.html [--socket PATH] [--wait-s S]

One panel per application (one application, or every application of a GPU): memory used, the P50
and P90 forecasts, the grant, OOM events and grant changes (vgpu/plots.py), over the last `--since`
(the daemon keeps about an hour per application; `GetAppHistory`). Prints the path it wrote.
Like the other commands that talk to the daemon (vgpu/ctl.py, "Not ready"), it asks again for up to
`--wait-s` (default 10 s; 0: never) while nothing listens on the socket yet.

Exit status: 0 written, 1 the daemon refused, could not be reached or has no history for it, 2 usage.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from vgpu.ctl import Client, CliError, UsageError, _run, _wait_option
from vgpu.v1 import allocator_pb2 as pb

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration_s(text: str) -> float:
    """"90", "90s", "10m", "1h" -> seconds (> 0)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*", text)
    if m is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"a duration like 90s, 10m or 1h, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def main(argv: Sequence[str] | None = None, prog: str = "vgpu report", *, out: TextIO | None = None,
         env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.description = (
            "Draw an application's GPU memory use against its P50/P90 forecast and its grant over time, with its "
            "grant changes and OOM events marked, from the daemon's node history; with --device, every "
            "application of that GPU, one panel each. Writes a PNG, SVG or interactive HTML picture and "
            "prints its path. The daemon keeps the last hour (docs/operations.md, `vgpu report`).")
        who = p.add_mutually_exclusive_group(required=True)
        who.add_argument("--app", help="one application")
        who.add_argument("--device", help="every application of this GPU (its index or UUID)")
        p.add_argument("--since", type=parse_duration_s, default=600.0, help="how far back: 90s, 10m, 1h (default 10m)")
        p.add_argument("--out", type=Path, required=True, help="picture to write: .png, .svg or .html")
        _wait_option(p)

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        from vgpu import plots

        problem = plots.destination_problem(ns.out)
        if problem is not None:
            raise UsageError(f"--out {ns.out}: {problem}")
        devices, _ = c.call("GetAvailableResources", pb.GetAvailableResourcesRequest(), token=False)
        names = {d.device_id: f"GPU {d.index}" for d in devices.devices}
        device_id = ""
        if ns.device is not None:
            match = [d.device_id for d in devices.devices if ns.device in (d.device_id, str(d.index))]
            if not match:
                raise CliError(f"no device {ns.device!r}; `vgpu available` lists them")
            device_id = match[0]
        hist, _ = c.call("GetAppHistory", pb.GetAppHistoryRequest(app_id=ns.app or "", device_id=device_id,
                                                                   since_s=ns.since), token=False)
        series = [h for h in hist.apps if len(h.t_unix_s) or len(h.events)]
        if not series:
            what = f"application {ns.app!r}" if ns.app else f"device {ns.device!r}"
            raise CliError(f"no history for {what} in the last {ns.since:g} s (the daemon records an application "
                           "once it forecasts for it; `vgpu apps` lists them)")
        now = hist.now_unix_s or time.time()
        timelines = [plots.from_history(h, now, f"{h.app_id} on {names.get(h.device_id, h.device_id)}") for h in series]
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        subject = f"application {ns.app}" if ns.app else f"every application of {names.get(device_id, device_id)}"
        title = f"vgpu report: {subject}, last {ns.since:g} s before {stamp}"
        fig = plots.figure([[tl] for tl in timelines], title=title, xlabel=f"time (s) relative to {stamp}")
        try:
            path = plots.save(fig, ns.out, title=title, timelines=timelines)
        except OSError as exc:
            raise CliError(f"cannot write {ns.out}: {exc}") from None
        points = sum(len(tl.t_s) for tl in timelines)
        o.write(f"{path}\n")
        o.write(f"{len(timelines)} application{'s' if len(timelines) != 1 else ''}, {points} points, "
                f"{sum(len(tl.marks) for tl in timelines)} events\n")
        return 0

    return _run(prog, argv, build, body, out, env)


__all__ = ["main", "parse_duration_s"]
