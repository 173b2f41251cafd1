"""`vgpu demo`: the whole pipeline on a simulated GPU, in one process, with no GPU needed.

    vgpu demo [--seconds N] [--json] [--gpu h100-80gb] [--speed X] [--baseline] [--no-job-config] [--plot FILE.png]

What runs: a simulated GPU (vgpu.device.sim) whose processes follow the applications of the bundled
trace (vgpu/data/demo_trace.csv.gz, looping, at X times the trace's pace; the lightest starts first
and runs alone for a quarter of the run, the others join one by one until 60 % of it);
the profiler's sampler reading that GPU every 100 ms and streaming one batch per tick over gRPC on a
Unix socket in a temporary directory; the manager forecasting every second (the trained model from
manager/models when one loads, else the baseline; the demo says which) and handing recommendations
to the allocator, which grants memory/SM shares and sets the GPU's power limit (restored at the end).

Each application declares its job as an application linking the client stub does (vgpu/client.py
`VgpuClient(app_id, job=JobConfig(...)).request()`: RequestResourceAllocation with the job and no
memory, over the demo's gRPC socket), so the allocator grants it the cold-start sizer's size for that
job (manager/coldstart.py, loaded as `vgpu serve` loads it) before its memory rises, out of the slack of
the policy's grants where they hold the GPU (docs/allocation.md), or refuses it as the daemon would. The jobs are the
MIGPerf runs each application's stretch of the trace holds (`DEMO_RUNS`): each run was its own process,
so at each run's start the previous run's grant is released and the new run registers its job.
`--no-job-config` runs the applications as before, declaring nothing: their grants come from the
forecasts alone.

Every second a plain-text table shows each application's usage, forecast and allocation and the
GPU's power limit; at the end a summary. `--json` prints only the summary as one JSON object:
{"apps", "ticks", "signatures", "decisions", "power_limit_changes", "mig_changes", "oom_events",
"oom_events_by_app", "overrun_samples", "rises", "lead_time_median_s", "lead_time_median_visible_s", "job_configs",
"cold_start_grants", "registrations_refused", "reclaims"}: `job_configs` is false under `--no-job-config`;
`cold_start_grants` counts the grants the allocator sized from a declared job (its own count, by source
"cold_start"), `registrations_refused` the declarations it refused, `reclaims` the requests it admitted
by cutting the policy's forecast-managed grants down toward their use (docs/allocation.md). `power_limit_changes`
counts the limits the allocator applied during the run (the restore at the end not included); the text
summary lists them in watts, while the table shows the limit only at each second. An overrun sample is
one (every 100 ms) at which an application asked the simulator for more memory than its grant; an OOM
event is the first of a run of them (the demo enforces no limit: each is where a hard limit would
have ended the job), as the daemon's history and metrics count them; `oom_events_by_app` maps each
application that had any to its count (the text summary names them beside the total); lead times are in seconds of the
run, over the rises of each application's memory (vgpu.allocator.policy.lead: how long before a
rise its grant had already grown to cover it; negative: after). `--plot FILE` also draws each
application's memory use against its forecast and grant over the run (vgpu/plots.py; its OOM marks
are the allocator's, one per forecast tick at which the use crossed above the grant) and prints the path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc
import numpy as np

from vgpu import log
from vgpu.allocator.core import Allocator, EventKind, Sizer, Subscription
from vgpu.allocator.history import AppSeries
from vgpu.allocator.policy import lead
from vgpu.allocator.policy.forecast import ForecastPolicy
from vgpu.allocator.service import AllocatorServicer, build_server
from vgpu.client import VgpuClient
from vgpu.config import ManagerConfig
from vgpu.device.sim import SimBackend, SimLaunch
from vgpu.jobs import JobConfig
from vgpu.manager.core import Manager, default_baseline
from vgpu.manager.forecast import Forecaster
from vgpu.manager.modelpath import ModelChoice, describe_serving, open_forecaster, resolve_model
from vgpu.manager.service import IngestServicer
from vgpu.profiler.sampler import Sampler
from vgpu.profiler.stream import SignatureStreamer
from vgpu.traces import AppTrace, Trace, read_trace
from vgpu.v1 import signature_pb2

_FIRST_PID = 4000


@dataclass(frozen=True)
class DemoRun:
    """One MIGPerf run inside an application's stretch of the bundled trace: the job its process
    declares, and when it declares it, in trace seconds since the stretch's start."""

    # 0: the run is under way when the stretch starts, so it registers at the application's launch
    # (and again where the looping trace starts over). Else the last sample at or before the run's
    # start_timestamp at which the slice held no CUDA context (under 64 MiB): a process registers when
    # it starts, before its first allocation, and the result tables' start_timestamp is taken after
    # 20 warm-up iterations (100 for the fine-tuning), well after the memory has risen.
    register_at_s: float
    # The run's start_timestamp in its result table, less the stretch's start (negative: before it).
    run_start_s: float
    job: JobConfig


# The job each run declares, from MIGPerf's result tables (model_name, batch_size, seq_length; the
# folders and DEMO_STRETCHES in vgpu/offline/convert.py) and its benchmark scripts (HuaizhengZhang/
# MIGProfiler: A100-cv-train_test.py, A100-nlp-train_test.py, A100-cv-infer_test.py,
# A100-finetune_test.py): fp32 throughout (no autocast, no half()); torchvision resnet50 and vit_b_16
# at 224 px (their parameter counts, 25,557,032 and 86,567,656); bert-base is
# bert-base-multilingual-cased (utils/common.py; 177,853,440 parameters as MIGPerf's own 40 GB tables
# list it, 12 layers); training with SGD (CV) or AdamW (NLP), fine-tuning with SGD. The model names
# are the tables' own. tests/test_demo.py checks each run against the tables and each register_at_s
# against the bundled trace.
def _resnet50_train(batch: int) -> JobConfig:
    return JobConfig(model_type="resnet50", param_count=25_557_032, batch_size=batch, input_size=224, num_layers=50,
                     precision="fp32", optimizer="sgd", mode="train")


def _bert(batch: int, mode: str) -> JobConfig:
    return JobConfig(model_type="bert-base", param_count=177_853_440, batch_size=batch, input_size=64, num_layers=12,
                     precision="fp32", optimizer="adamw" if mode == "train" else "none", mode=mode)


def _vit(batch: int, mode: str) -> JobConfig:
    return JobConfig(model_type="vision_transformer", param_count=86_567_656, batch_size=batch, input_size=224,
                     num_layers=12, precision="fp32", optimizer="sgd" if mode == "train" else "none", mode=mode)


DEMO_RUNS: dict[str, tuple[DemoRun, ...]] = {
    "resnet50-train": (DemoRun(0, -87, _resnet50_train(64)), DemoRun(40, 48, _resnet50_train(128)),
                       DemoRun(175, 187, _resnet50_train(256))),
    "bert-train": (DemoRun(0, -84, _bert(128, "train")), DemoRun(55, 70, _bert(256, "train"))),
    "vit-infer": (DemoRun(0, -97, _vit(8, "infer")), DemoRun(30, 35, _vit(16, "infer")),
                  DemoRun(163, 168, _vit(32, "infer"))),
    "bert-infer": (DemoRun(0, -81, _bert(1, "infer")), DemoRun(58, 60, _bert(2, "infer"))),
    "vit-finetune": (DemoRun(0, -83, _vit(8, "train")), DemoRun(116, 137, _vit(16, "train"))),
}


def describe_job(job: JobConfig) -> str:
    """A job in a few words: `resnet50 train, batch 64, fp32, sgd`."""
    opt = f", {job.optimizer}" if job.optimizer_norm != "none" else ""
    return f"{job.model_type} {job.mode_norm}, batch {job.batch_size}, {job.precision_norm}{opt}"


@dataclass(frozen=True)
class DemoSummary:
    apps: int
    ticks: int
    signatures: int
    decisions: int
    power_limit_changes: int
    mig_changes: int
    oom_events: int = 0
    # (application, OOM events) for each application that had any: most first, then by name
    oom_events_by_app: tuple[tuple[str, int], ...] = ()
    overrun_samples: int = 0
    rises: int = 0
    lead_time_median_s: float | None = None
    lead_time_median_visible_s: float | None = None
    job_configs: bool = False  # the applications declared their jobs (off with --no-job-config)
    cold_start_grants: int = 0  # grants the allocator sized from a declared job
    registrations_refused: int = 0
    reclaims: int = 0  # requests admitted out of the policy's grants' slack (Counters.reclaims)

    def to_json(self) -> str:
        return json.dumps(
            {
                "apps": self.apps,
                "ticks": self.ticks,
                "signatures": self.signatures,
                "decisions": self.decisions,
                "power_limit_changes": self.power_limit_changes,
                "mig_changes": self.mig_changes,
                "oom_events": self.oom_events,
                "oom_events_by_app": dict(self.oom_events_by_app),
                "overrun_samples": self.overrun_samples,
                "rises": self.rises,
                "lead_time_median_s": self.lead_time_median_s,
                "lead_time_median_visible_s": self.lead_time_median_visible_s,
                "job_configs": self.job_configs,
                "cold_start_grants": self.cold_start_grants,
                "registrations_refused": self.registrations_refused,
                "reclaims": self.reclaims,
            }
        )


@dataclass(frozen=True)
class DemoResult:
    summary: DemoSummary
    forecaster: str  # what served, in words
    # Sum over ticks of the applications the simulator had running, counted from the simulator itself.
    apps_present_total: int
    signatures_sent: int
    rejected: int
    power_limit_start_mw: int
    power_limit_end_mw: int
    power_limit_min_seen_mw: int
    seconds: float
    # Each power limit the allocator applied to the GPU during the run, in order (the restore at the
    # end not included): as many as summary.power_limit_changes.
    power_limits_applied_mw: tuple[int, ...] = ()
    # Each application's history on the GPU (use, forecast, grant, events), for `--plot`.
    history: tuple[AppSeries, ...] = ()
    # Each job an application declared, in order, with what the allocator answered.
    registrations: tuple[Registration, ...] = ()
    sizer: str = ""  # the cold-start sizer, in words ("" without job configs)


@dataclass(frozen=True)
class Registration:
    """One job declared by a demo application, as its client stub sent it, and the answer."""

    app_id: str
    pid: int
    at_s: float  # seconds since the run started
    job: JobConfig
    granted_mib: float  # the grant the request came back with (NaN when refused)
    source: str  # the grant's source ("cold_start": the sizer sized it); "" when refused
    refused: str = ""  # the daemon's error, "CODE: details", when it refused the request


def default_forecaster() -> tuple[Forecaster, str]:
    """The shipped model served as the daemon serves it (manager/modelpath.py: the same resolve
    and the same fallback to the baseline; no hot reload in a demo) and a line saying which."""
    baseline = default_baseline()
    path = resolve_model(None).path
    if not path.is_file():  # no torch import for nothing
        return baseline, f"baseline ({getattr(baseline, 'name', 'baseline')}): no trained forecaster at {path}"
    forecaster = open_forecaster(ModelChoice(path, False), baseline, device="cpu")
    return forecaster, describe_serving(forecaster)


class SizerUnavailable(RuntimeError):
    """The cold-start sizer does not load, so the applications' jobs cannot be sized."""


def default_sizer(path: Path | None = None) -> tuple[Sizer, str]:
    """The cold-start sizer as `vgpu serve` loads it (`path`, default its shipped artefact,
    manager/coldstart.py) and a line saying which; SizerUnavailable naming why when it does not load."""
    from vgpu.manager.coldstart import DEFAULT_ARTEFACT, AllocatorSizer, ColdStartSizer  # noqa: PLC0415 - torch

    path = Path(DEFAULT_ARTEFACT) if path is None else path
    try:
        sizer = ColdStartSizer.load(path)
    except (OSError, ValueError, ImportError) as exc:
        raise SizerUnavailable(f"the cold-start sizer does not load ({exc}); --no-job-config runs the demo "
                               "without it") from exc
    return AllocatorSizer(sizer), f"cold-start sizer {sizer.model} ({path.name})"


class _SimulatedAppClient(VgpuClient):
    """The client stub of a simulated application: it has no torch to apply its grant in (the
    simulator enforces no limit either; the demo counts where a hard limit would have ended a job),
    so applying a limit is a no-op instead of the stub's warning that torch is missing."""

    def _apply_limit(self, limit_mib: float | None) -> bool:
        return True


class _JobStubs:
    """The demo's applications as they link the client stub: each run of an application is a
    `VgpuClient` with its job that requests no memory, so the allocator sizes the grant from the job
    (RequestResourceAllocation over the demo's socket, the servicer and `Allocator.request_allocation`,
    as under `vgpu serve`). The previous run's client closes first: its process has exited, and closing
    releases its grants. The stub's calls block, so `register` runs in a worker thread, never on the
    loop that serves the socket; `close` waits for a registration under way."""

    def __init__(self, socket: str, workdir: Path) -> None:
        self.socket = socket
        self.workdir = workdir
        self.registrations: list[Registration] = []
        self._clients: dict[str, VgpuClient] = {}
        self._lock = threading.Lock()
        self._closed = False

    def register(self, app_id: str, pid: int, job: JobConfig, at_s: float) -> Registration | None:
        """Declare `job` for `app_id`'s new run (process `pid`); None once closed."""
        with self._lock:
            if self._closed:
                return None
            old = self._clients.pop(app_id, None)
            if old is not None:
                old.close()
            client = _SimulatedAppClient(app_id, socket=self.socket, job=job, inapp_dir=self.workdir / "inapp",
                                         token_file=self.workdir / "tokens" / f"{pid}.token", watch=False,
                                         report=False, pid=pid, pid_start_s=time.time())
            try:
                grant = client.request()  # memory 0: the daemon sizes it from the job
            except grpc.RpcError as exc:
                client.close(release=False)
                reg = Registration(app_id, pid, at_s, job, math.nan, "", f"{exc.code().name}: {exc.details()}")
            else:
                self._clients[app_id] = client
                reg = Registration(app_id, pid, at_s, job, grant.memory_mib, grant.source)
            self.registrations.append(reg)
            return reg

    def close(self) -> None:
        """Close every client without releasing (the run is over); no registration after this."""
        with self._lock:
            self._closed = True
            for client in self._clients.values():
                client.close(release=False)
            self._clients.clear()


def launch_order(trace: Trace) -> list[tuple[str, AppTrace]]:
    """Applications by mean SM use, lightest first (ties by name)."""

    def mean_sm(a: AppTrace) -> float:
        sm = a.column("sm_util_pct")
        return float(np.nanmean(sm)) if np.isfinite(sm).any() else 0.0

    return sorted(trace.apps.items(), key=lambda kv: (mean_sm(kv[1]), kv[0]))


def launch_offsets_s(n: int, seconds: float) -> list[float]:
    """When each application starts: the first at once and alone for the first quarter of the run (so
    the power limit can follow a light load down), the others evenly until 60 % of the run (so it
    follows the load back up and the forecasts see every application for a while)."""
    if n <= 1:
        return [0.0] * n
    first, last = 0.25 * seconds, 0.6 * seconds
    return [0.0] + [first + (last - first) * i / max(1, n - 2) for i in range(n - 1)]


@dataclass(frozen=True)
class Overruns:
    events: int  # OOM events: runs of overrun samples
    samples: int  # overrun samples


def count_overruns(used_mib: Sequence[float], granted_mib: Sequence[float]) -> Overruns:
    """One application's samples in order: a sample asking more memory than the grant in force is an
    overrun (a NaN grant, none yet, is never overrun), and the first of each run of them an OOM event."""
    events = samples = 0
    over_before = False
    for used, granted in zip(used_mib, granted_mib, strict=True):
        over = used > granted  # NaN compares False
        if over:
            samples += 1
            if not over_before:
                events += 1
        over_before = over
    return Overruns(events, samples)


class _GrantWatch:
    """Per application, at each sample: the memory it asks of the simulator and the grant in force
    (NaN before its first), for OOM events and lead times. As in the daemon's history
    (`vgpu.allocator.history`), a sample asking more than the grant is an overrun, and an OOM event
    is the first sample of a run of overruns: under a hard limit that is where the job would die."""

    def __init__(self, backend: SimBackend, allocator: Allocator) -> None:
        self.backend = backend
        self.allocator = allocator
        self.used: dict[str, list[float]] = {}
        self.granted: dict[str, list[float]] = {}

    def sample(self) -> None:
        grants: dict[str, float] = {}
        for g in self.allocator.ledger.grants():
            grants[g.app_id] = grants.get(g.app_id, 0.0) + g.memory_mib
        for dev in self.backend.devices():
            for p in dev.snapshot():
                grant = grants.get(p.app_id, math.nan)
                self.used.setdefault(p.app_id, []).append(p.demand_mib)
                self.granted.setdefault(p.app_id, []).append(grant)

    def overruns(self) -> dict[str, Overruns]:
        """Each application's overruns over its samples so far (a sample it was absent from, between
        two runs, neither starts nor ends a run of overruns)."""
        return {app: count_overruns(used, self.granted[app]) for app, used in self.used.items()}

    def leads(self, period_s: float) -> lead.LeadSummary:
        found = [lt for app, used in self.used.items() for lt in lead.lead_times(used, self.granted[app])]
        s = lead.summarize(found)

        def secs(v: float | None) -> float | None:
            return None if v is None else round(v * period_s, 2)

        return lead.LeadSummary(s.rises, secs(s.median), s.rises_visible, secs(s.median_visible), s.ahead_frac_visible)


class _CountingSource:
    """The sampler, plus an independent count of the processes the simulator runs at each tick."""

    def __init__(self, sampler: Sampler, backend: SimBackend, watch: _GrantWatch | None = None) -> None:
        self.sampler = sampler
        self.backend = backend
        self.watch = watch
        self.apps_present_total = 0

    def sample(self) -> list[signature_pb2.BehavioralSignature]:
        self.apps_present_total += sum(len(d.processes()) for d in self.backend.devices())
        if self.watch is not None:
            self.watch.sample()
        return self.sampler.sample()

    def close(self) -> None:
        self.sampler.close()


def _fmt(x: float, unit: str, width: int = 9) -> str:
    return f"{'-':>{width}}" if not math.isfinite(x) else f"{x:>{width - len(unit) - 1}.0f} {unit}"


def render_table(allocator: Allocator, manager: Manager, backend: SimBackend, elapsed_s: float) -> str:
    dev = backend.devices()[0]
    limit_w = dev.power_limit_mw() / 1000
    draw_w = dev.power_usage_mw() / 1000
    lines = [
        f"t={elapsed_s:5.1f} s  {dev.name}: power limit {limit_w:.0f} W, drawing {draw_w:.0f} W  "
        f"| signatures {manager.stats.signatures}  decisions {manager.stats.decisions}",
        f"{'application':<18}{'mem used':>11}{'mem p90':>11}{'granted':>11}{'SM used':>9}{'SM p90':>8}{'SM grant':>9}",
    ]
    for app in allocator.list_apps():
        mem_granted = sum(g.memory_mib for g in app.grants) if app.grants else math.nan
        sm_granted = sum(g.sm_pct for g in app.grants) if app.grants else math.nan
        lines.append(
            f"{app.app_id[:17]:<18}{_fmt(app.mem_used_mib, 'MiB', 11)}{_fmt(app.forecast_mem_p90_mib, 'MiB', 11)}"
            f"{_fmt(mem_granted, 'MiB', 11)}{_fmt(app.sm_util_pct, '%', 9)}{_fmt(app.forecast_sm_p90_pct, '%', 8)}"
            f"{_fmt(sm_granted, '%', 9)}"
        )
    return "\n".join(lines)


async def run_demo(
    *,
    seconds: float = 20.0,
    gpu: str = "h100-80gb",
    speed: float = 10.0,
    trace: Trace | None = None,
    forecaster: Forecaster | None = None,
    forecaster_label: str | None = None,
    live: TextIO | None = None,
    refresh_s: float = 1.0,
    period_s: float = 0.1,
    end_on_sigint: bool = False,
    job_configs: bool = True,
    sizer: Sizer | None = None,
    sizer_label: str | None = None,
) -> DemoResult:
    """Run the pipeline for `seconds` of wall time; `live` receives the table every `refresh_s`.
    With `end_on_sigint`, SIGINT (Ctrl-C) ends the run there and the result covers what ran.
    With `job_configs`, each application of `DEMO_RUNS` declares its runs' jobs through the client
    stub and the allocator sizes them with `sizer` (default: the shipped cold-start sizer,
    `default_sizer`); without, they declare nothing and the allocator has no sizer, as before."""
    if job_configs and sizer is None:
        sizer, sizer_label = default_sizer()
    if trace is None:
        from vgpu.data import demo_trace_path  # noqa: PLC0415

        trace = read_trace(demo_trace_path())
    if forecaster is None:
        forecaster, label = default_forecaster()
        forecaster_label = forecaster_label or label
    label = forecaster_label or forecaster.name

    backend = SimBackend([gpu], clock=time.monotonic)
    apps = launch_order(trace)
    names = {_FIRST_PID + i: app_id for i, (app_id, _) in enumerate(apps)}
    offsets = launch_offsets_s(len(apps), seconds)
    first_up = asyncio.Event()

    async def run_app(i: int, app_id: str, app_trace: AppTrace, t0: float, stubs: _JobStubs) -> None:
        """Start one application at its offset, declaring its job first (with job configs); then, as
        its trace plays, declare each later run's job at its registration second, and the first
        run's again where the looping trace starts over."""
        pid = _FIRST_PID + i
        runs = DEMO_RUNS.get(app_id, ()) if job_configs else ()

        async def register(job: JobConfig) -> None:
            reg = await asyncio.to_thread(stubs.register, app_id, pid, job, time.monotonic() - t0)
            if reg is not None and live is not None:
                said = (f"refused ({reg.refused})" if reg.refused
                        else f"cold-start grant {reg.granted_mib:.0f} MiB" if reg.source == "cold_start"
                        else f"granted {reg.granted_mib:.0f} MiB ({reg.source})")
                print(f"t={reg.at_s:5.1f} s  {app_id} (pid {pid}) declares its job: {describe_job(job)}; {said}\n",
                      file=live, flush=True)

        async def at_trace_s(launched: SimLaunch, loop_index: int, tau_s: float) -> None:
            when = launched.start_s + (loop_index * launched.length_s + tau_s) / speed
            await asyncio.sleep(max(0.0, when - time.monotonic()))

        try:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.monotonic()))
            if runs:
                await register(runs[0].job)  # as it starts, before its first allocation
            launched = backend.launch(app_id, pid, app_trace, speed=speed, loop=True)
        finally:
            if i == 0:
                first_up.set()
        if not runs:
            return
        for loop_index in itertools.count():
            for run in runs[1:]:
                await at_trace_s(launched, loop_index, run.register_at_s)
                await register(run.job)
            await at_trace_s(launched, loop_index + 1, 0.0)
            await register(runs[0].job)

    device = backend.devices()[0]
    start_limit = device.power_limit_mw()
    min_limit = start_limit

    allocator = Allocator(backend, dry_run=False, policy=ForecastPolicy(), sizer=sizer if job_configs else None)
    applied_mw: list[int] = []

    async def follow_power(events: Subscription) -> None:
        # every change, from the allocator's own events: a limit lowered and raised again between
        # two of the once-a-second lines still counts, and still sets the lowest
        async for e in events:
            m = _POWER_CHANGE.match(e.detail) if e.kind == EventKind.POWER_LIMIT_CHANGED else None
            if m is not None and e.device_id == device.uuid:
                applied_mw.append(int(m[2]))

    power_events = asyncio.create_task(follow_power(allocator.watch()))
    manager = Manager(allocator, forecaster)
    with tempfile.TemporaryDirectory(prefix="vgpu-demo-") as tmp:
        address = f"unix:{tmp}/vgpu.sock"
        server = build_server(address, allocator_servicer=AllocatorServicer(allocator, backend=f"sim:{gpu}"), ingest_servicer=IngestServicer(manager, ack_interval_s=ManagerConfig().ack_interval_ms / 1000.0))
        await server.start()
        # Enumerate processes every tick: the simulator is cheap to ask, and a new application then
        # shows from its first tick (the summary's signature count is exact).
        sampler = Sampler(backend, psutil_module=None, inapp_dir=None, app_id_of=names.get, enumerate_every_s=0.0)
        watch = _GrantWatch(backend, allocator)
        source = _CountingSource(sampler, backend, watch)
        streamer = SignatureStreamer(source, address, period_s=period_s, profiler_id="demo")
        stubs = _JobStubs(f"{tmp}/vgpu.sock", Path(tmp))
        if live is not None:
            jobs_line = (f"applications declare their jobs; {sizer_label or 'cold-start sizer'} sizes them"
                         if job_configs else "applications declare no job (--no-job-config): grants follow forecasts only")
            print(f"forecaster: {label}\n{jobs_line}\n", file=live, flush=True)
        ended = asyncio.Event()
        loop = asyncio.get_running_loop()
        if end_on_sigint:
            loop.add_signal_handler(signal.SIGINT, ended.set)
        started = time.monotonic()
        launchers = [asyncio.create_task(run_app(i, app_id, app_trace, started, stubs))
                     for i, (app_id, app_trace) in enumerate(apps)]
        # the first application runs before the first tick (once it has declared its job)
        await asyncio.wait([asyncio.create_task(first_up.wait()), launchers[0]], return_when=asyncio.FIRST_COMPLETED)
        run = asyncio.create_task(streamer.run())
        try:
            deadline = started + seconds
            while not run.done() and time.monotonic() < deadline and not ended.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), min(refresh_s, max(0.0, deadline - time.monotonic())))
                if ended.is_set():
                    break
                min_limit = min(min_limit, device.power_limit_mw())
                if live is not None and time.monotonic() < deadline + 0.05:
                    print(render_table(allocator, manager, backend, time.monotonic() - started) + "\n", file=live,
                          flush=True)
            streamer.stop()
            await run
        finally:
            if end_on_sigint:
                loop.remove_signal_handler(signal.SIGINT)
            for task in launchers:
                task.cancel()
            failed = [r for r in await asyncio.gather(*launchers, return_exceptions=True)
                      if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
            await asyncio.to_thread(stubs.close)
            if not run.done():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
            await server.stop(0.5)
            end_limit_before_restore = device.power_limit_mw()
            await asyncio.sleep(0)  # the power follower takes the events published so far
            allocator.stop()  # ends the follower's subscription (after what it queued)
            await power_events
            backend.close()
    if failed:
        raise failed[0]  # an application's task failed: a bug, not a result
    stats = streamer.stats
    leads = watch.leads(period_s)
    overruns = watch.overruns()
    oom_by_app = sorted(((app, o.events) for app, o in overruns.items() if o.events), key=lambda a: (-a[1], a[0]))
    summary = DemoSummary(
        apps=len(trace.apps),
        ticks=streamer.loop.stats.ticks,
        signatures=manager.stats.signatures,
        decisions=manager.stats.decisions,
        power_limit_changes=allocator.counters.power_limit_changes,
        mig_changes=allocator.counters.mig_changes,
        oom_events=sum(o.events for o in overruns.values()),
        oom_events_by_app=tuple(oom_by_app),
        overrun_samples=sum(o.samples for o in overruns.values()),
        rises=leads.rises,
        lead_time_median_s=leads.median,
        lead_time_median_visible_s=leads.median_visible,
        job_configs=job_configs,
        cold_start_grants=allocator.counters.grant_changes.get((str(EventKind.GRANTED), "cold_start"), 0),
        registrations_refused=sum(1 for r in stubs.registrations if r.refused),
        reclaims=allocator.counters.reclaims,
    )
    return DemoResult(
        summary=summary,
        forecaster=label,
        apps_present_total=source.apps_present_total,
        signatures_sent=stats.signatures_sent,
        rejected=manager.stats.rejected,
        power_limit_start_mw=start_limit,
        power_limit_end_mw=end_limit_before_restore,
        power_limit_min_seen_mw=min(min_limit, end_limit_before_restore, *applied_mw),
        seconds=time.monotonic() - started,
        power_limits_applied_mw=tuple(applied_mw),
        history=tuple(allocator.history.series()),
        registrations=tuple(stubs.registrations),
        sizer=(sizer_label or "cold-start sizer") if job_configs else "",
    )


_POWER_CHANGE = re.compile(r"(\d+) -> (\d+) mW")  # POWER_LIMIT_CHANGED's detail; a restore's starts "restored"


def _power_changes(count: int, result: DemoResult, most: int = 8) -> str:
    """The power-limit changes the allocator applied during the run, counted and listed in watts."""
    if count == 0:
        return "no power-limit change applied during the run"
    path = [result.power_limit_start_mw, *result.power_limits_applied_mw]
    watts = [f"{mw / 1000:.0f}" for mw in path]
    if len(watts) > most + 1:
        watts = [*watts[:most // 2], "...", *watts[-most // 2:]]
    return (f"{count} power-limit change{'s' if count != 1 else ''} applied during the run: "
            + " -> ".join(watts) + " W")


def describe(result: DemoResult) -> str:
    s = result.summary
    return "\n".join(
        [
            f"summary after {result.seconds:.1f} s ({result.forecaster}):",
            f"  applications        {s.apps}",
            f"  profiler ticks      {s.ticks} (every 100 ms)",
            f"  signatures          {s.signatures} received, {result.rejected} rejected",
            f"  decisions           {s.decisions}",
            f"  power limit         {result.power_limit_start_mw / 1000:.0f} W at start, lowest "
            f"{result.power_limit_min_seen_mw / 1000:.0f} W, {result.power_limit_end_mw / 1000:.0f} W at the end; "
            f"{_power_changes(s.power_limit_changes, result)}; "
            f"restored to {result.power_limit_start_mw / 1000:.0f} W after",
            f"  MIG changes         {s.mig_changes}",
            f"  OOM events          {s.oom_events} ({_oom_apps(s)}runs of samples asking more memory than granted; "
            f"{s.overrun_samples} samples over)",
            f"  lead time           {_lead_line(s)}",
            f"  job configs         {_jobs_line(result)}",
        ]
    )


def _oom_apps(s: DemoSummary) -> str:
    """The applications that had OOM events, each with its count, ahead of the OOM line's gloss."""
    if not s.oom_events_by_app:
        return ""
    return ", ".join(f"{app} {n}" for app, n in s.oom_events_by_app) + "; "


def _jobs_line(result: DemoResult) -> str:
    s = result.summary
    if not s.job_configs:
        return "none declared (--no-job-config): every grant came from the forecasts"
    line = (f"{len(result.registrations)} declared through the client stub, {s.cold_start_grants} granted at "
            f"the size {result.sizer} gave ({s.reclaims} of them by taking room from other applications' "
            f"forecast grants), {s.registrations_refused} refused")
    codes = Counter(r.refused.partition(":")[0] for r in result.registrations if r.refused)
    return line + (f" ({', '.join(f'{n} {code}' for code, n in sorted(codes.items()))})" if codes else "")


def _lead_line(s: DemoSummary) -> str:
    """How far ahead of each rise of memory its grant had grown (> 0: ahead), or why there is no figure."""
    if s.rises == 0:
        return ("none: no rise of memory beyond its grant in this run (a run shorter than about 9 s ends "
                "before the first)")
    return (f"median {_secs(s.lead_time_median_s)} over {s.rises} rise{'s' if s.rises != 1 else ''} of memory, "
            f"{_secs(s.lead_time_median_visible_s)} over those after a ramp (> 0: the grant grew before the use)")


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f} s"


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run profiler, manager and allocator on a simulated GPU.")
    p.add_argument("--seconds", type=float, default=20.0, help="how long to run (default 20)")
    p.add_argument("--json", action="store_true", help="print only the summary as JSON")
    p.add_argument("--gpu", default="h100-80gb", help="simulated GPU model (default h100-80gb)")
    p.add_argument("--speed", type=float, default=10.0,
                   help="trace seconds per wall second (default 10: the 200 s trace in 20 s)")
    p.add_argument("--baseline", action="store_true", help="use the baseline forecaster even when a model exists")
    p.add_argument("--no-job-config", action="store_true",
                   help="the applications declare no job: no cold-start sizing, grants from the forecasts alone")
    p.add_argument("--plot", metavar="FILE", help="also draw use, forecast and grant over the run into FILE "
                   "(.png, .svg or .html) and print its path")
    return p


def plot_demo(result: DemoResult, path: str, gpu: str) -> str:
    """Draw every application of the run, one panel each, on seconds since the first point."""
    from vgpu import plots  # noqa: PLC0415 - matplotlib only when a picture is asked for
    from vgpu.allocator.service import history_to_pb  # noqa: PLC0415

    series = [history_to_pb(s) for s in result.history]
    t0 = min((h.t_unix_s[0] for h in series if len(h.t_unix_s)), default=0.0)
    timelines = [plots.from_history(h, t0) for h in series]
    title = f"vgpu demo: {gpu}, {result.forecaster}"
    fig = plots.figure([[tl] for tl in timelines], title=title, xlabel="time since the first forecast (s)")
    return str(plots.save(fig, Path(path), title=title, timelines=timelines))


def main(argv: Sequence[str], prog: str = "vgpu demo") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    if not (args.seconds > 0 and math.isfinite(args.seconds)):
        parser.error(f"--seconds must be a positive number, got {args.seconds}")
    if not (args.speed > 0 and math.isfinite(args.speed)):
        parser.error(f"--speed must be a positive number, got {args.speed}")
    from vgpu.device.skus import SKUS  # noqa: PLC0415

    if args.gpu not in SKUS:
        parser.error(f"--gpu must be one of {', '.join(sorted(SKUS))}, got {args.gpu!r}")
    if args.plot:
        from vgpu.plots import destination_problem  # noqa: PLC0415

        problem = destination_problem(Path(args.plot))
        if problem is not None:  # said before the run, not after it
            parser.error(f"--plot {args.plot}: {problem}")
    log.configure("console", "warning")
    forecaster: Forecaster | None = None
    label = None
    if args.baseline:
        forecaster = default_baseline()
        label = f"baseline ({getattr(forecaster, 'name', 'baseline')}), as asked"
    if not args.json:
        print(f"vgpu demo: {args.seconds:g} s on a simulated {args.gpu}, the bundled trace at {args.speed:g}x, "
              "applications starting one by one"
              f"{'' if args.no_job_config else ' and declaring their jobs'}; Ctrl-C ends early (with the summary).")
    try:
        result = asyncio.run(
            run_demo(
                seconds=args.seconds,
                gpu=args.gpu,
                speed=args.speed,
                forecaster=forecaster,
                forecaster_label=label,
                live=None if args.json else sys.stdout,
                end_on_sigint=True,
                job_configs=not args.no_job_config,
            )
        )
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SizerUnavailable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(result.summary.to_json())
    else:
        print(describe(result))
    if args.plot:
        try:
            # with --json, stdout holds the summary alone (one JSON document); the path goes to stderr
            print(f"picture: {plot_demo(result, args.plot, args.gpu)}", file=sys.stderr if args.json else sys.stdout)
        except (OSError, ValueError) as exc:
            print(f"{prog}: cannot write the picture: {exc}", file=sys.stderr)
            return 1
    return 0
