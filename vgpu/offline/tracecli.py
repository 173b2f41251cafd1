"""`vgpu trace`: convert datasets into canonical traces, and describe a canonical trace.

    vgpu trace convert --format {migperf,nvidia-smi,alibaba} --src PATH --out OUT.csv.gz
                       [--gpus N] [--strict]
    vgpu trace info PATH [--json] [--strict]
    vgpu trace cut {demo,fixture} --src MIGPERF_DATA --out OUT.csv.gz
    vgpu trace synth --kind serving --service {azure-conv,azure-code,mooncake} --out OUT.csv.gz
                     [--data ../shared/data] [--replicas N] [--model llama2-70b] [--hardware a100-80gb]
                     [--tp 2] [--memory dynamic|pool] [--max-requests N] [--duration-s S]
                     [--segment-s S] [--time-scale X] [--seed N] [--json]
    vgpu trace synth --kind training --jobs N --out OUT.csv.gz [--data ../shared/data]
                     [--sources migperf,miso,gpumemnet] [--seed N] [--json]

`synth` writes derived series (vgpu/offline/synth_serving.py, synth_training.py) with their provenance
on the trace's `#meta` line.
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
from vgpu.traces import ALL_NUMERIC, Trace, TraceFormatError, read_trace, write_trace

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
        "log_starts": [str(i) for i in result.log_starts],
        "warnings": list(result.warnings),
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
    if result.log_starts:
        print(f"further logs in one file: {len(result.log_starts)} (row positions count from each)", file=stream)
        for start in result.log_starts[:_MAX_LISTED_ISSUES]:
            print(f"  {start}", file=stream)
    for warning in result.warnings:
        print(f"warning: {warning}", file=stream)


def trace_info(trace: Trace) -> dict[str, object]:
    durations = [a.duration_s for a in trace.apps.values()]
    columns = sorted({c for a in trace.apps.values() for c in ALL_NUMERIC if a.has(c)}, key=ALL_NUMERIC.index)
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
        "derived": bool(trace.metadata.get("derived", False)),
        "generator": trace.metadata.get("generator"),
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
    info.add_argument("--strict", action="store_true", help="fail on the first bad row (a damaged tail included)")
    cut = sub.add_parser("cut", help="cut the bundled demo trace or the test fixture from MIGPerf")
    cut.add_argument("what", choices=("demo", "fixture"))
    cut.add_argument("--src", required=True, help="the MIGPerf data folder (migperf-a100-mig/data)")
    cut.add_argument("--out", required=True)
    syn = sub.add_parser("synth", help="derive serving or training series from the permitted datasets")
    syn.add_argument("--kind", required=True, choices=("serving", "training"))
    syn.add_argument("--data", default="../shared/data", help="the shared data folder (default %(default)s)")
    syn.add_argument("--out", required=True, help="canonical trace to write (.csv or .csv.gz)")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--json", action="store_true", help="print the metadata written as JSON")
    syn.add_argument("--service", help="serving: which request trace")
    syn.add_argument("--replicas", type=int, default=None, help="serving: engines the requests are dealt to in turn")
    syn.add_argument("--model", default="llama2-70b", help="serving: llama2-70b or bloom-176b")
    syn.add_argument("--hardware", default="a100-80gb", help="serving: a100-80gb, h100-80gb or h100-80gb-pcap")
    syn.add_argument("--tp", type=int, default=2, help="serving: tensor parallelism (2, 4, 8 as measured)")
    syn.add_argument("--memory", default="dynamic", choices=("dynamic", "pool"),
                     help="serving: memory in use (dynamic) or a vLLM-style preallocated pool (pool)")
    syn.add_argument("--max-requests", type=int, default=None, help="serving: only the first N requests")
    syn.add_argument("--duration-s", type=float, default=None, help="serving: series length after start-up")
    syn.add_argument("--segment-s", type=float, default=0.0, help="serving: cut each engine's series into pieces")
    syn.add_argument("--time-scale", type=float, default=1.0, help="serving: multiply arrival times by X")
    syn.add_argument("--jobs", type=int, default=None, help="training: number of jobs")
    syn.add_argument("--sources", default="migperf,miso,gpumemnet", help="training: profile sources")
    args = parser.parse_args(argv)

    if args.command == "synth":
        return _synth(args, syn, prog)  # its own usage line in its errors

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
        trace = read_trace(args.path, strict=args.strict)
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
        if facts["derived"]:
            print(f"derived series: {facts['generator']} (provenance on the #meta line)")
    return 0


_SERVING_OPTIONS = ("kind", "service", "data", "seed", "replicas", "model", "hardware", "tp", "memory",
                    "max_requests", "duration_s", "segment_s", "time_scale")
_TRAINING_OPTIONS = ("kind", "data", "seed", "jobs", "sources")


def _synth(args: argparse.Namespace, parser: argparse.ArgumentParser, prog: str) -> int:
    from vgpu.offline import synth_serving, synth_training  # noqa: PLC0415 - only this command needs them

    try:
        if args.kind == "serving":
            if not args.service:
                parser.error(f"--kind serving needs --service ({', '.join(synth_serving.SERVICES)})")
            cfg = synth_serving.EngineConfig(model=args.model, hardware=args.hardware, tp=args.tp, memory=args.memory)
            apps, meta = synth_serving.synthesize(
                Path(args.data) / "llm-serving-requests", args.service, cfg, replicas=args.replicas, seed=args.seed,
                time_scale=args.time_scale, max_requests=args.max_requests, duration_s=args.duration_s,
                segment_s=args.segment_s,
            )
        else:
            if args.jobs is None:
                parser.error("--kind training needs --jobs")
            sources = [s.strip() for s in args.sources.split(",") if s.strip()]
            apps, meta = synth_training.synthesize(args.data, args.jobs, seed=args.seed, sources=sources)
    except (ValueError, OSError) as exc:
        print(f"{prog} synth: {exc}", file=sys.stderr)
        return 1
    wanted = _SERVING_OPTIONS if args.kind == "serving" else _TRAINING_OPTIONS
    meta["command"] = "vgpu trace synth " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k in wanted and v is not None
    )
    rows = write_trace(args.out, apps, metadata=meta)
    if args.json:
        print(json.dumps(meta))
    else:
        print(f"wrote {len(apps)} apps, {rows} rows -> {args.out}")
    return 0
