"""`vgpu trace`: convert datasets into canonical traces, and describe a canonical trace.

    vgpu trace convert --format {migperf,nvidia-smi,alibaba} --src PATH --out OUT.csv.gz
                       [--gpus N] [--strict]
    vgpu trace info PATH [--json]
    vgpu trace cut {demo,fixture} --src MIGPERF_DATA --out OUT.csv.gz
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from vgpu.offline import convert
from vgpu.traces import NUMERIC, Trace, TraceFormatError, read_trace, write_trace

FORMATS = ("migperf", "nvidia-smi", "alibaba")
_MAX_LISTED_ISSUES = 20


def _converter(fmt: str, args: argparse.Namespace) -> Callable[[], convert.Conversion]:
    src = Path(args.src)
    if fmt == "migperf":
        return lambda: convert.convert_migperf(src, strict=args.strict)
    if fmt == "nvidia-smi":
        return lambda: convert.convert_nvidia_smi_paths(
            _expand(src, "*.csv*"), gpus=args.gpus, strict=args.strict, skip_foreign=src.is_dir()
        )
    if fmt == "alibaba":
        return lambda: convert.convert_alibaba(src, strict=args.strict)
    raise ValueError(fmt)


def _expand(src: Path, pattern: str) -> list[Path]:
    """A file, or every file matching `pattern` in a folder (sorted)."""
    if src.is_dir():
        files = sorted(p for p in src.glob(pattern) if p.is_file())
        if not files:
            raise TraceFormatError(f"{src}: no file matching {pattern}")
        return files
    return [src]


def conversion_summary(result: convert.Conversion, out: Path, fmt: str) -> dict[str, object]:
    return {
        "format": fmt,
        "out": str(out),
        "apps": len(result.apps),
        "rows_read": result.rows_read,
        "rows_written": result.samples,
        "skipped_rows": len(result.issues),
        "skipped_by_reason": dict(result.issue_reasons()),
        "left_out": dict(result.left_out),
    }


def _print_summary(summary: dict[str, object], result: convert.Conversion, stream: TextIO) -> None:
    print(
        f"converted {summary['format']}: {summary['apps']} apps, {summary['rows_written']} rows written "
        f"({summary['rows_read']} read) -> {summary['out']}",
        file=stream,
    )
    print(f"skipped rows: {summary['skipped_rows']}", file=stream)
    for reason, n in result.issue_reasons().most_common():
        print(f"  {n:6d}  {reason}", file=stream)
    for issue in result.issues[:_MAX_LISTED_ISSUES]:
        print(f"  {issue}", file=stream)
    if len(result.issues) > _MAX_LISTED_ISSUES:
        print(f"  ... and {len(result.issues) - _MAX_LISTED_ISSUES} more", file=stream)
    for what, n in result.left_out.most_common():
        print(f"left out: {n} {what}", file=stream)


def trace_info(trace: Trace) -> dict[str, object]:
    durations = [a.duration_s for a in trace.apps.values()]
    columns = sorted({c for a in trace.apps.values() for c in NUMERIC if a.has(c)}, key=NUMERIC.index)
    return {
        "path": trace.source,
        "apps": len(trace.apps),
        "samples": trace.samples,
        "duration_s": {
            "total": round(sum(durations), 3),
            "min": round(min(durations), 3),
            "max": round(max(durations), 3),
        },
        "columns": columns,
        "gpus": sorted({a.gpu for a in trace.apps.values() if a.gpu}),
        "skipped_rows": len(trace.issues),
        "skipped_by_reason": dict(Counter(i.reason.split(" (")[0] for i in trace.issues)),
        "skipped_first": [str(i) for i in trace.issues[:_MAX_LISTED_ISSUES]],
    }


def main(argv: Sequence[str] | None = None, prog: str = "vgpu trace") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert a dataset into the canonical trace format")
    conv.add_argument("--format", required=True, choices=FORMATS)
    conv.add_argument("--src", required=True, help="the dataset: a folder or a file")
    conv.add_argument("--out", required=True, help="canonical trace to write (.csv or .csv.gz)")
    conv.add_argument(
        "--gpus", type=int, default=None, help="nvidia-smi: GPUs per sample when there is no index column"
    )
    conv.add_argument("--strict", action="store_true", help="fail on the first bad row instead of skipping")
    conv.add_argument("--json", action="store_true", help="print the summary as JSON")
    info = sub.add_parser("info", help="describe a canonical trace")
    info.add_argument("path")
    info.add_argument("--json", action="store_true")
    cut = sub.add_parser("cut", help="cut the bundled demo trace or the test fixture from MIGPerf")
    cut.add_argument("what", choices=("demo", "fixture"))
    cut.add_argument("--src", required=True, help="the MIGPerf data folder (migperf-a100-mig/data)")
    cut.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    if args.command == "cut":
        try:
            apps = convert.cut_demo(args.src) if args.what == "demo" else convert.cut_fixture(args.src)
        except TraceFormatError as exc:
            print(f"{prog} cut: {exc}", file=sys.stderr)
            return 1
        rows = write_trace(args.out, apps)
        print(f"wrote {len(apps)} apps, {rows} rows -> {args.out}")
        return 0

    if args.command == "convert":
        if args.gpus is not None and args.gpus < 1:
            parser.error("--gpus must be at least 1")
        out = Path(args.out)
        try:
            result = _converter(args.format, args)()
        except TraceFormatError as exc:
            print(f"{prog} convert: {exc}", file=sys.stderr)
            return 1
        write_trace(out, result.apps)
        summary = conversion_summary(result, out, args.format)
        if args.json:
            print(json.dumps(summary))
            _print_summary(summary, result, sys.stderr)
        else:
            _print_summary(summary, result, sys.stdout)
        return 0

    try:
        trace = read_trace(args.path)
    except TraceFormatError as exc:
        print(f"{prog} info: {exc}", file=sys.stderr)
        return 1
    facts = trace_info(trace)
    if args.json:
        print(json.dumps(facts))
    else:
        d = facts["duration_s"]
        assert isinstance(d, dict)
        print(f"{facts['path']}: {facts['apps']} apps, {facts['samples']} samples")
        print(f"duration per app: total {d['total']} s, min {d['min']} s, max {d['max']} s")
        print(f"columns: {', '.join(facts['columns'])}")  # type: ignore[arg-type]
        if facts["gpus"]:
            print(f"gpus: {', '.join(facts['gpus'])}")  # type: ignore[arg-type]
        if trace.issues:
            print(f"skipped rows: {len(trace.issues)}")
            reasons = facts["skipped_by_reason"]
            assert isinstance(reasons, dict)
            for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
                print(f"  {n:6d}  {reason}")
            for issue in trace.issues[:_MAX_LISTED_ISSUES]:
                print(f"  {issue}")
            if len(trace.issues) > _MAX_LISTED_ISSUES:
                print(f"  ... and {len(trace.issues) - _MAX_LISTED_ISSUES} more")
    return 0
