"""`vgpu record` and `vgpu profiler --record FILE`: what the profiler samples, as a canonical trace.

    vgpu record --out node.csv.gz [--backend nvml|sim:<sku>] [--seconds S] [--period-ms 100]
                [--inapp-dir DIR] [--sim-trace TRACE [--loop]]

Every signature becomes one row (the application's own counters are the trace's targets, the
device's beside them), so an operator can record a node's workloads and train or evaluate on them:

    t_s            signature timestamp_s (Unix seconds: one clock for the node)
    app, gpu       app_id, device_id
    mem_used_mib   process.gpu_mem_used_mib      sm_util_pct    process.sm_util_pct
    mem_total_mib, mem_util_pct (mem_bw_util_pct), power_w, power_limit_w (mW / 1000), sm_clock_mhz,
    pcie_tx_kbps, pcie_rx_kbps                   the device's counters
    dev_mem_used_mib, dev_sm_util_pct            the device's memory used and SM busy, all processes
    host_cpu_pct, host_rss_mib                   the process on the host
    inapp_torch_allocated_mib, inapp_torch_reserved_mib, inapp_torch_active_mib, inapp_alloc_retries,
    inapp_oom_count, inapp_step                  the application's own report (vgpu.client): PyTorch's
                                                 allocator and its steps
    inapp_requests_running, inapp_requests_waiting, inapp_kv_used_mib, inapp_kv_total_mib,
    inapp_tokens_in_flight                       a serving engine's, where it reports them
                                                 (VgpuClient.report_serving)
A field the signature does not carry is an empty cell. A signature with neither target (no
per-process memory nor SM reading) is not written (the format needs one) and is counted.

The `#meta` line says how the trace was made: `recorded: true`, the clock, the command line, the
backend, the devices (name, memory), the host and the start time; a recording of a trace played back
(`--sim-trace`, the profiler's `--replay`) names it (`replayed`) and keeps its provenance (`derived`,
`generator`, `inputs`). Rows are written as they come and flushed every `flush_every_s` (a `.csv.gz`
with a gzip sync flush), so a recorder killed without warning (SIGKILL, OOM) loses at most the rows
since the last flush; the reader keeps the rows before the unfinished end and reports the damaged tail.
`vgpu record --backend sim:<sku> --sim-trace TRACE` launches every application of TRACE on the
simulated GPU first, to try the recording without a GPU; the simulator gives their in-app counters
(TRACE's `inapp_*` columns), which are recorded as a stub's would be. A recording with no row is no
trace: `vgpu record` then exits 1 and says why on stderr (a sim backend without --sim-trace, which could
sample nothing, says so at once and writes no file).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vgpu.client import default_inapp_dir
from vgpu.profiler.source import SignatureSource
from vgpu.traces import ALL_NUMERIC, EXTRA_NUMERIC, HEADER, format_value, meta_line, open_for_writing
from vgpu.v1 import signature_pb2

# (column, signature part, field, scale)
_FIELDS: tuple[tuple[str, str, str, float], ...] = (
    ("mem_used_mib", "process", "gpu_mem_used_mib", 1.0),
    ("sm_util_pct", "process", "sm_util_pct", 1.0),
    ("mem_total_mib", "device", "mem_total_mib", 1.0),
    ("power_w", "device", "power_mw", 1e-3),
    ("power_limit_w", "device", "power_limit_mw", 1e-3),
    ("mem_util_pct", "device", "mem_bw_util_pct", 1.0),
    ("sm_clock_mhz", "device", "sm_clock_mhz", 1.0),
    ("pcie_tx_kbps", "device", "pcie_tx_kbps", 1.0),
    ("pcie_rx_kbps", "device", "pcie_rx_kbps", 1.0),
    ("dev_mem_used_mib", "device", "mem_used_mib", 1.0),
    ("dev_sm_util_pct", "device", "sm_util_pct", 1.0),
    ("host_cpu_pct", "host", "cpu_pct", 1.0),
    ("host_rss_mib", "host", "rss_mib", 1.0),
    ("inapp_torch_allocated_mib", "in_app", "torch_allocated_mib", 1.0),
    ("inapp_torch_reserved_mib", "in_app", "torch_reserved_mib", 1.0),
    ("inapp_torch_active_mib", "in_app", "torch_active_mib", 1.0),
    ("inapp_alloc_retries", "in_app", "alloc_retries", 1.0),
    ("inapp_oom_count", "in_app", "oom_count", 1.0),
    ("inapp_step", "in_app", "step", 1.0),
    ("inapp_requests_running", "in_app", "requests_running", 1.0),
    ("inapp_requests_waiting", "in_app", "requests_waiting", 1.0),
    ("inapp_kv_used_mib", "in_app", "kv_used_mib", 1.0),
    ("inapp_kv_total_mib", "in_app", "kv_total_mib", 1.0),
    ("inapp_tokens_in_flight", "in_app", "tokens_in_flight", 1.0),
)
# the format's header (its columns the signature has no field for stay empty), then the further ones
RECORD_HEADER = HEADER + tuple(c for c in EXTRA_NUMERIC if c in {f[0] for f in _FIELDS})
assert {f[0] for f in _FIELDS} <= set(RECORD_HEADER[3:]) and set(RECORD_HEADER) - {"t_s", "app", "gpu"} <= set(ALL_NUMERIC)


def signature_values(sig: signature_pb2.BehavioralSignature) -> dict[str, float]:
    """The trace columns a signature fills (only the fields it carries)."""
    out: dict[str, float] = {}
    for column, part, name, scale in _FIELDS:
        msg = getattr(sig, part)
        if sig.HasField(part) and msg.HasField(name):
            out[column] = float(getattr(msg, name)) * scale
    return out


class TraceRecorder:
    """Appends signatures to a canonical trace file as they come."""

    def __init__(
        self,
        path: str | Path,
        metadata: Mapping[str, Any] | None = None,
        *,
        flush_every_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._fh = open_for_writing(self.path)
        if metadata:
            self._fh.write(meta_line(metadata))
        self._writer = csv.writer(self._fh)
        self._writer.writerow(RECORD_HEADER)
        self._names = RECORD_HEADER[3:]
        self._monotonic = monotonic
        self._flush_every_s = flush_every_s
        self._flushed_at = monotonic()
        self.rows = 0
        self.skipped_no_target = 0
        self.closed = False

    def write(self, sigs: Sequence[signature_pb2.BehavioralSignature]) -> int:
        """Write one row per signature that has a target; returns the rows written."""
        n = 0
        for sig in sigs:
            values = signature_values(sig)
            if "mem_used_mib" not in values and "sm_util_pct" not in values:
                self.skipped_no_target += 1
                continue
            self._writer.writerow([format_value(sig.timestamp_s), sig.app_id, sig.device_id]
                                  + [format_value(values.get(c)) for c in self._names])
            n += 1
        self.rows += n
        now = self._monotonic()
        if now - self._flushed_at >= self._flush_every_s:
            self._fh.flush()
            self._flushed_at = now
        return n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._fh.close()


class RecordingSource:
    """A SignatureSource that writes what `inner` samples to `recorder` and passes it on unchanged."""

    def __init__(self, inner: SignatureSource, recorder: TraceRecorder) -> None:
        self.inner = inner
        self.recorder = recorder

    def sample(self) -> list[signature_pb2.BehavioralSignature]:
        sigs = self.inner.sample()
        self.recorder.write(sigs)
        return sigs

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.recorder.close()


# What a trace's `#meta` says of where its values came from: a recording of a trace carries it over.
PROVENANCE_KEYS = ("derived", "generator", "inputs")


def recording_metadata(argv: Sequence[str], prog: str, backend_spec: str, backend: Any,
                       source: tuple[Path, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The `#meta` of a recording. `source`: the trace (path, metadata) whose values the sampled
    applications play back (`--sim-trace`, the profiler's `--replay`); the recording then names it as
    `replayed` and keeps its provenance (`derived`, `generator`, `inputs` with their licences), so that a
    derived series recorded again is still derived to `vgpu eval`, `vgpu train` and `vgpu trace info`."""
    devices = []
    readers: tuple[tuple[str, Callable[[Any], Any]], ...] = (
        ("name", lambda d: d.name), ("uuid", lambda d: d.uuid), ("mem_total_mib", lambda d: d.memory().total_mib))
    for dev in getattr(backend, "devices", list)():
        entry: dict[str, Any] = {}
        for key, read in readers:
            try:
                entry[key] = read(dev)
            except Exception:  # noqa: BLE001 - a field the device cannot give is left out
                continue
        devices.append(entry)
    meta: dict[str, Any] = {
        "recorded": True,
        "derived": False,
        "clock": "shared",
        "command": " ".join([prog, *argv]),
        "backend": backend_spec,
        "driver": getattr(backend, "driver_version", None),
        "devices": devices,
        "host": socket.gethostname(),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if source is not None:
        path, source_meta = source
        meta["replayed"] = str(path)
        meta.update({k: source_meta[k] for k in PROVENANCE_KEYS if k in source_meta})
        # vgpu train counts a trace with a generator as derived, whatever its `derived` says
        meta["derived"] = bool(source_meta.get("derived")) or "generator" in source_meta
    return meta


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Record what the profiler samples to a canonical trace.")
    p.add_argument("--out", required=True, type=Path, help="trace to write (.csv or .csv.gz; flushed every second)")
    p.add_argument("--backend", default="nvml", help="nvml (default) or sim:<sku>, e.g. sim:h100-80gb")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this many seconds (default: until signalled)")
    p.add_argument("--period-ms", type=float, default=100.0, help="sampling period in ms (default 100)")
    p.add_argument("--inapp-dir", type=Path, default=None,
                   help="where client stubs write in-app counters (default: the node's server.inapp_dir, as "
                        "VGPU_SERVER_INAPP_DIR or /etc/vgpu/vgpu.toml give it, else /run/vgpu/inapp)")
    p.add_argument("--sim-trace", type=Path, default=None,
                   help="sim backend only: launch every application of this trace on GPU 0 first")
    p.add_argument("--loop", action="store_true", help="--sim-trace: repeat the trace")
    return p


def main(argv: Sequence[str], prog: str = "vgpu record") -> int:
    args = build_parser(prog).parse_args(list(argv))
    if not args.period_ms > 0 or args.seconds < 0:
        print(f"{prog}: --period-ms must be positive and --seconds not negative", file=sys.stderr)
        return 2
    if args.sim_trace is not None and not args.backend.startswith("sim"):
        print(f"{prog}: --sim-trace needs a sim backend", file=sys.stderr)
        return 2
    try:
        args.inapp_dir = default_inapp_dir() if args.inapp_dir is None else args.inapp_dir
    except ValueError as exc:  # a relative VGPU_SERVER_INAPP_DIR
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    from vgpu.device import open_backend
    from vgpu.device.errors import DeviceError
    from vgpu.profiler.sampler import Sampler
    from vgpu.traces import TraceFormatError, read_trace

    try:
        backend = open_backend(args.backend)
    except (DeviceError, ValueError) as exc:
        print(f"{prog}: cannot open backend {args.backend!r}: {exc}", file=sys.stderr)
        return 1
    if args.backend.startswith("sim") and args.sim_trace is None:
        # nothing could be sampled: the simulator runs no process but a trace's; said before any wait or file
        backend.close()
        print(f"{prog}: no GPU process can be sampled: the sim backend runs only the applications of --sim-trace, "
              "never host processes, so a client stub's in-app counters are recorded only with a real GPU; "
              "give --sim-trace TRACE to try the recording", file=sys.stderr)
        return 1
    try:
        app_ids: dict[int, str] = {}
        if args.sim_trace is not None:
            try:
                trace = read_trace(args.sim_trace)
            except TraceFormatError as exc:
                print(f"{prog}: {exc}", file=sys.stderr)
                return 1
            note = trace.skipped_rows_note()
            if note:
                print(f"{prog}: {note}", file=sys.stderr)
            for i, app in enumerate(trace.apps.values()):
                pid = 200_000 + i
                backend.launch(app.app, pid, app, loop=args.loop)  # type: ignore[attr-defined]
                app_ids[pid] = app.app
        simulated = args.backend.startswith("sim")
        # a simulated process is no host process: its in-app counters are its trace's (the simulator's)
        sampler = Sampler(backend, psutil_module=None if simulated else _psutil(), inapp_dir=args.inapp_dir,
                          app_id_of=app_ids.get if simulated else None,
                          inapp_of=backend.inapp_counters if simulated else None)  # type: ignore[attr-defined]
        try:
            recorder = TraceRecorder(args.out, recording_metadata(
                argv, prog, args.backend, backend,
                None if args.sim_trace is None else (args.sim_trace, trace.metadata)))
        except OSError as exc:
            print(f"{prog}: cannot write {args.out}: {exc}", file=sys.stderr)
            return 1
        source = RecordingSource(sampler, recorder)
        try:
            asyncio.run(_record(source, args.period_ms / 1000.0, args.seconds))
        finally:
            source.close()
        print(f"recorded {recorder.rows} rows -> {args.out}"
              + (f" ({recorder.skipped_no_target} signatures without a target left out)"
                 if recorder.skipped_no_target else ""))
        if recorder.rows == 0:
            # a trace needs a row (`vgpu trace info`, `vgpu eval` refuse one without): say why there is none
            print(f"{prog}: {_no_rows_reason(recorder, simulated=simulated)}",
                  file=sys.stderr)
            return 1
        return 0
    finally:
        backend.close()


def _no_rows_reason(recorder: TraceRecorder, *, simulated: bool) -> str:
    """Why a recording has no row, in one line."""
    if recorder.skipped_no_target:
        return (f"no usable row: none of the {recorder.skipped_no_target} signatures had the process's GPU memory "
                "or SM share, and a trace row needs one")
    if simulated:
        return "no GPU process was sampled: the recording ended before the first sample (--seconds too short?)"
    return "no GPU process was sampled: no process used this node's GPUs while recording"


async def _record(source: RecordingSource, period_s: float, seconds: float) -> None:
    from vgpu.profiler.stream import FixedRateLoop

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if seconds > 0:
        loop.call_later(seconds, stop.set)

    async def tick(_: int) -> None:
        source.sample()

    try:
        await FixedRateLoop(period_s).run(tick, stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass


def _psutil() -> object:
    import psutil

    return psutil
