"""Ingest throughput and decision latency of a real manager, with the profilers in another process.

    python bench/ingest.py --apps 64 --seconds 20 --json        # 64 profilers, 10 Hz each
    python bench/ingest.py --max --json                          # highest sustained signatures/s

What runs. A child process is the manager: a grpc.aio server on a Unix socket in a temporary
directory with the `Ingest` and `Allocator` servicers (allocator/service.py `build_server`), the
`Manager` (forecast tick every `--forecast-interval-s`, the daemon's default 1 s, with the daemon's
fallback forecaster) and an `Allocator` on `--gpus` simulated H100s with the daemon's predictive
policy, as `vgpu serve` wires them; once serving, its start-up heap is frozen out of the garbage collector's
full passes, as `vgpu serve` does (vgpu/gc_freeze.py). This process runs the load, so the manager's CPU is measured alone (psutil on the child pid).

Normal mode: `--apps` N `SignatureStreamer`s, each its own gRPC stream with its own `ReplaySource`
of one application of the bundled demo trace (looping; 1 s rows replayed at `--hz` x, so one
signature per app per 100 ms tick), started staggered over one period like independent profilers; once they are made, this process's
heap is frozen out of the garbage collector's full passes, as `vgpu profiler` does at start-up.
After `--warmup-s` the measurement window of `--seconds` opens. The manager's windows hold 120 s of an
application: with the default 3 s they are a quarter full or less while it is measured, and a forecast
of full windows (a node in its steady state) costs more; `--warmup-s 125` measures that. Printed:

    {"apps", "signatures_per_s", "decision_p50_ms", "decision_p99_ms", "manager_cpu_frac", ...}

* signatures_per_s: signatures the manager accepted (its own counter) per second of the window;
* decision latency: for every Decision a profiler receives, `decided_at_s` minus the wall time at
  which the signature numbered `for_seq` was handed to gRPC (both clocks are this machine's
  time.time()). A decision covers the newest signature of each app at the manager's forecast tick,
  so this includes the wait from the signature's send to the next tick, up to one profiler period;
* extra fields: `tick_p50_ms`/`tick_p99_ms` (manager-side duration of a forecast tick, from taking
  the window snapshot to the decisions published and handed on: the allocator's apply, queued behind
  the round's replies, is not in it), `reply_p99_ms` (signature send ->
  decision received by the profiler), `decisions`, `rejected`;
* manager_cpu_frac: the manager process's CPU time (user + system, all threads) over the window's
  wall time; 1.0 is one core;
* applies / applies_deferred: the manager's calls to the allocator over the whole run, and how many
  rounds found its acting budget (`Manager(act_duty_max=...)`, manager/core.py) spent, their
  decisions left for a later apply.

`--forecaster served`: the manager forecasts with what `vgpu serve` serves by default, the expert
mixture over the last value and the shipped model (manager/experts.py `make_served`, the model on
`SERVING_THREADS`); `served-trees` is that mixture with node-local trees in
its "trees" slot (manager/nodetrees.py), fitted at start on the demo trace the profilers replay, as a
node whose learner has promoted trees serves; `default`/`model` are the model alone (on `SERVING_THREADS` too, as the daemon
loads it), `baseline` the fallback.

`--learn-trace PATH`: node-local learning in the background while the window runs, as the daemon's
`BackgroundLearner` runs it (`python -m vgpu.manager.nodelearn learn ...`, nice 19, one thread):
PATH (a canonical trace) is written, as 1 s means per application, its applications starting one
after another over two hours (the learner needs an hour), into a node history in a temporary
directory, and rounds run back to back from the window's start to its end (the daemon runs
one every `manager.learn_interval_s`, an hour by default: back to back is the worst case). Adds
`learn_rounds` (finished), `learn_cpu_s` and `learn_cpu_frac` (the rounds' CPU, a round cut at the
window's end included, over the window's wall time; 1.0 is one core) and `learn_round_wall_s`.

`--null-manager`: the same streams into a servicer that only reads them (no manager behind it): its
manager_cpu_frac is what gRPC alone costs for that many streams, the floor under the real figure.

`--max`: a few raw streams send batched ticks (10 batches/s per stream, thousands of signatures per
batch, 200 applications so windows stay within the manager's app bound) at stepped offered rates;
a rate is sustained when the manager's accepted rate over the step reaches 95 % of it and it has
handled the batches sent in the step within 0.5 s of the step's end. The batches are encoded from pre-serialised pieces
(valid protobuf, parsed by the manager like any other) so that the load generator is not the
bottleneck. Bounded by `--max-seconds`. Prints {"max_sustained_signatures_per_s", "steps": [...],
"manager_cpu_frac_at_max", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.config import ManagerConfig  # noqa: E402
from vgpu.device.sim import SimBackend  # noqa: E402
from vgpu.gc_freeze import freeze_startup_heap  # noqa: E402
from vgpu.manager.core import Decision, Item, Manager  # noqa: E402
from vgpu.profiler.replay import ReplaySource  # noqa: E402
from vgpu.profiler.stream import DEFAULT_COLUMNS_FROM, SignatureStreamer  # noqa: E402
from vgpu.traces import AppTrace, Trace, read_trace  # noqa: E402
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc, signature_pb2  # noqa: E402

SKU = "h100-80gb"
ACK_INTERVAL_S = ManagerConfig().ack_interval_ms / 1000.0  # as `vgpu serve` answers quiet batches
INGEST_METHOD = "/vgpu.v1.Ingest/StreamSignatures"
HISTORY_SPAN_S = 7200.0  # --learn-trace: the node history's timeline


def sim_device_ids(gpus: int) -> list[str]:
    """The UUIDs the manager's simulated GPUs will have (the simulator derives them from index and SKU)."""
    return [d.uuid for d in SimBackend([SKU] * gpus).devices()]


def _pct(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, rounded; None (JSON null) when there is nothing to take it of."""
    return round(float(np.percentile(np.asarray(values, dtype=np.float64), q)), 3) if len(values) else None


# --- the manager process ---------------------------------------------------------------------------------
class TimedManager(Manager):
    """The daemon's Manager, timing each forecast tick (snapshot -> decisions acted on)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tick_ms: list[float] = []
        self._tick_started = 0.0

    def _begin_tick(self, apps: Sequence[str]) -> list[Item]:
        self._tick_started = time.perf_counter()
        return super()._begin_tick(apps)

    def _act(self, decisions: list[Decision], *, after_replies: bool = False) -> None:
        super()._act(decisions, after_replies=after_replies)
        self.tick_ms.append((time.perf_counter() - self._tick_started) * 1000.0)


def manager_main(conn: Connection, address: str, gpus: int, forecast_interval_s: float, profile_path: str = "",
                 batch_window_s: float = 0.001, forecaster: str = "default", duty: float = 0.25,
                 ack_interval_s: float = ACK_INTERVAL_S, null: bool = False) -> None:
    """Child process: serve until told to stop, then send back the manager's counters. With
    `profile_path`, the event loop's thread runs under cProfile and its stats are dumped there."""
    from vgpu import log
    from vgpu.allocator.core import Allocator
    from vgpu.allocator.policy.base import hard_limit_at_frac_for
    from vgpu.allocator.policy.forecast import ForecastPolicy
    from vgpu.allocator.service import AllocatorServicer, build_server
    from vgpu.manager.service import IngestServicer

    log.configure("console", "error")
    conn_info: dict[str, str] = {}

    async def serve() -> None:
        backend = SimBackend([SKU] * gpus)
        # the daemon's policy and hard-limit rule (vgpu/daemon/serve.py), so an apply costs what it costs there
        policy = ForecastPolicy()
        allocator = Allocator(backend, dry_run=False, policy=policy,
                              hard_limit_at_frac=hard_limit_at_frac_for("contended", policy.config.hard_limit_at_frac))
        manager = TimedManager(allocator, open_forecaster(forecaster), forecast_interval_s=forecast_interval_s,
                               batch_window_s=batch_window_s, forecast_duty_max=duty)
        conn_info["forecaster"] = getattr(manager.forecaster, "name", "?")
        server = build_server(address, allocator_servicer=AllocatorServicer(allocator),
                              ingest_servicer=NullIngest() if null else IngestServicer(manager, ack_interval_s=ack_interval_s))
        await server.start()
        freeze_startup_heap()  # as `vgpu serve` does once started (vgpu/gc_freeze.py)
        conn.send(("ready", os.getpid(), conn_info["forecaster"]))
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg == "mark":
                manager.tick_ms.clear()
                conn.send(("marked", asdict_stats(manager)))
            elif msg == "stats":
                conn.send(("stats", asdict_stats(manager)))
            elif msg == "stop":
                break
        result = asdict_stats(manager)
        result["tick_ms"] = list(manager.tick_ms)
        await server.stop(0.2)
        allocator.stop()
        conn.send(("stopped", result))

    if not profile_path:
        asyncio.run(serve())
        return
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        asyncio.run(serve())
    finally:
        prof.disable()
        prof.dump_stats(profile_path)


class NullIngest(ingest_pb2_grpc.IngestServicer):
    """Reads every batch of a stream and does nothing else: what gRPC itself costs the manager process
    for the same streams (`--null-manager`), the floor under manager_cpu_frac."""

    # The read/write form (context.read, no yield), as the manager's servicer. Two stubs miss what grpc.aio
    # does here, hence the narrow ignores: a stream-stream handler may be a coroutine that returns None
    # (mypy-protobuf's servicer stub allows only an iterator or async iterator of replies), and
    # ServicerContext.read() returns grpc.aio.EOF at the end of the stream (types-grpcio types it as the
    # request message alone).
    async def StreamSignatures(  # type: ignore[override]  # noqa: N802 - gRPC name
        self,
        request_iterator: AsyncIterator[ingest_pb2.SignatureBatch],
        context: grpc.aio.ServicerContext[ingest_pb2.SignatureBatch, ingest_pb2.IngestReply],
    ) -> None:
        while await context.read() is not grpc.aio.EOF:  # type: ignore[comparison-overlap]
            pass


def open_forecaster(which: str) -> Any:
    """"baseline": the manager's fallback; "model": the shipped checkpoint (vgpu.manager.predictor's
    DEFAULT_MODEL_PATH), which must load; "default": what `vgpu serve` uses with no model
    configured, the shipped checkpoint when it loads, else the baseline; "served": the expert mixture
    over the last value and the shipped model, as `vgpu serve` forecasts by default; "served-trees": the
same with node-local trees fitted on the demo trace, as it forecasts once its learner promoted trees."""
    if which == "baseline":
        return None
    if which in ("served", "served-trees"):
        from vgpu.manager.experts import make_served
        from vgpu.manager.predictor import DEFAULT_MODEL_PATH, SERVING_THREADS, load_forecaster

        mixture = make_served(load_forecaster(DEFAULT_MODEL_PATH, "cpu", threads=SERVING_THREADS), local=True)
        if which == "served-trees":
            from vgpu.manager.nodetrees import NodeTrees

            mixture.set_expert("trees", NodeTrees().fit(demo_apps()))
        return mixture
    try:
        from vgpu.manager.predictor import DEFAULT_MODEL_PATH, SERVING_THREADS, load_forecaster

        # on the intra-op threads `vgpu serve` gives it (manager/modelpath.py), not torch's count (the
        # machine's cores): a second ONNX Runtime thread costs a wake-up per round and shortens nothing
        return load_forecaster(DEFAULT_MODEL_PATH, threads=SERVING_THREADS)
    except Exception:
        if which == "model":
            raise
        return None


def asdict_stats(manager: Manager) -> dict[str, Any]:
    s = manager.stats
    return {k: getattr(s, k) for k in vars(s)}


@dataclass
class ManagerProcess:
    """Starts the manager child and measures its CPU time."""

    gpus: int
    forecast_interval_s: float
    profile_path: str = ""
    batch_window_s: float = 0.001
    forecaster: str = "default"
    duty: float = 0.25
    ack_interval_s: float = ACK_INTERVAL_S
    null: bool = False
    address: str = ""
    proc: Any = None
    conn: Connection | None = None
    pid: int = 0
    forecaster_name: str = ""
    _tmp: Any = None

    def start(self) -> None:
        import psutil

        self._tmp = tempfile.TemporaryDirectory(prefix="vgpu-bench-")
        self.address = f"unix:{self._tmp.name}/manager.sock"
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=manager_main, args=(child, self.address, self.gpus, self.forecast_interval_s,
                                                                  self.profile_path, self.batch_window_s, self.forecaster,
                                                                  self.duty, self.ack_interval_s, self.null),
                                daemon=True)
        self.proc.start()
        if not parent.poll(60):
            raise RuntimeError("the manager process did not start within 60 s")
        tag, self.pid, self.forecaster_name = parent.recv()
        assert tag == "ready"
        self.conn = parent
        self._ps = psutil.Process(self.pid)

    def cpu_s(self) -> float:
        t = self._ps.cpu_times()
        return float(t.user + t.system)

    def mark(self) -> dict[str, Any]:
        assert self.conn is not None
        self.conn.send("mark")
        return dict(self.conn.recv()[1])

    def stats(self) -> dict[str, Any]:
        """The manager's counters (ManagerStats) now."""
        assert self.conn is not None
        self.conn.send("stats")
        return dict(self.conn.recv()[1])

    def stop(self) -> dict[str, Any]:
        assert self.conn is not None
        self.conn.send("stop")
        result: dict[str, Any] = {}
        if self.conn.poll(30):
            result = dict(self.conn.recv()[1])
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self._tmp.cleanup()
        return result


# --- normal mode: N profilers -----------------------------------------------------------------------------
@dataclass
class Latencies:
    sent: dict[tuple[str, int], float] = field(default_factory=dict)
    window_start_s: float = math.inf
    window_end_s: float = math.inf
    decision_ms: list[float] = field(default_factory=list)
    reply_ms: list[float] = field(default_factory=list)
    accepted: int = 0  # by the manager in the window (its counter, not the replies': those come later)
    rejected: int = 0
    decisions: int = 0

    def on_reply(self, reply: ingest_pb2.IngestReply) -> None:
        now = time.time()
        if not (self.window_start_s <= now < self.window_end_s):
            return
        self.rejected += len(reply.rejected)
        for d in reply.decisions:
            sent = self.sent.get((d.app_id, d.for_seq))
            if sent is None or sent < self.window_start_s:
                continue
            self.decisions += 1
            self.decision_ms.append((d.decided_at_s - sent) * 1000.0)
            self.reply_ms.append((now - sent) * 1000.0)


class TimedStreamer(SignatureStreamer):
    """A SignatureStreamer that notes when each signature is handed to gRPC."""

    def __init__(self, *args: Any, lat: Latencies, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._lat = lat

    async def _send(self, k: int) -> None:
        n = min(len(self.buffer), self.max_batch)
        keys = [(self.buffer[i].app_id, self.buffer[i].seq) for i in range(n)]
        now = time.time()
        before = self.stats.batches_sent
        # noted before the write: the manager can decide and its reply arrive while this task still
        # awaits the write's completion, and a decision whose send time is not yet known is not counted
        sent = self._lat.sent
        for key in keys:
            sent[key] = now
        await super()._send(k)
        if self.stats.batches_sent == before:  # not sent (the stream failed): no decision can follow
            for key in keys:
                sent.pop(key, None)
        if len(sent) > 200_000:  # keep the last few minutes only
            for key in list(sent)[:100_000]:
                del sent[key]


class LearningRounds:
    """Node-learning rounds back to back in child processes, the daemon's command and environment
    (manager/nodelearn.py `BackgroundLearner._round`), on a node history written from a trace."""

    def __init__(self, trace_path: str) -> None:
        from vgpu.manager.history import NodeHistory
        from vgpu.manager.predictor import DEFAULT_MODEL_PATH

        self._tmp = tempfile.TemporaryDirectory(prefix="vgpu-bench-learn-")
        self.state_dir = Path(self._tmp.name) / "state"
        self.history_dir = Path(self._tmp.name) / "history"
        self.state_dir.mkdir()
        history = NodeHistory(self.history_dir, max_bytes=2**40)
        apps = list(read_trace(trace_path).apps.values())
        # the node's timeline: the applications start one after another over two hours (the learner
        # needs an hour of history and holds out the last 30 minutes), whatever their origins
        stagger_s = HISTORY_SPAN_S / max(len(apps), 1)
        for i, app in enumerate(apps):
            secs = np.floor(app.t_s - app.t_s[0] + i * stagger_s).astype(np.int64) if len(app) else np.zeros(0, np.int64)
            uniq, where = np.unique(secs, return_inverse=True)
            means = []
            for col in ("mem_used_mib", "sm_util_pct"):
                v = app.columns.get(col, np.full(len(secs), np.nan))
                ok = np.isfinite(v)
                n = np.bincount(where[ok], minlength=len(uniq))
                means.append(np.where(n > 0, np.bincount(where[ok], weights=v[ok], minlength=len(uniq)) / np.maximum(n, 1),
                                      np.nan))
            total = app.columns.get("mem_total_mib")
            cap = float(total[-1]) if total is not None and len(total) else math.nan
            history.add([app.app] * len(uniq), [app.gpu or ""] * len(uniq), uniq.astype(np.float64),
                        np.stack(means, axis=1), [cap] * len(uniq))
        history.close()
        self.global_model = DEFAULT_MODEL_PATH
        self.rounds = 0
        self.cpu_s = 0.0
        self.round_wall_s: list[float] = []
        self._stop = threading.Event()
        self._child: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="bench-learner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        child = self._child
        if child is not None and child.poll() is None:
            child.terminate()
        self._thread.join(60)
        self._tmp.cleanup()

    def _run(self) -> None:
        cmd = [sys.executable, "-m", "vgpu.manager.nodelearn", "learn", "--state-dir", str(self.state_dir),
               "--history-dir", str(self.history_dir), "--global-model", str(self.global_model)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._child = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _, status, usage = os.wait4(self._child.pid, 0)
            self._child.returncode = os.waitstatus_to_exitcode(status)
            self.cpu_s += usage.ru_utime + usage.ru_stime
            if self._child.returncode == 0:
                self.rounds += 1
                self.round_wall_s.append(time.perf_counter() - t0)


def demo_apps() -> list[AppTrace]:
    from vgpu.data import demo_trace_path

    trace = read_trace(demo_trace_path())
    # The rows re-timed onto an even 1 s grid: one application of the demo trace has a 64 s gap,
    # which would show as a stale signature in the decision latency rather than as manager work.
    out = []
    for name in sorted(trace.apps):
        a = trace.apps[name]
        out.append(AppTrace(name, float(a.t_s[0]) + np.arange(len(a), dtype=np.float64), a.columns))
    return out


async def _run_profilers(address: str, apps: int, hz: float, device_ids: list[str], mgr: ManagerProcess,
                         warmup_s: float, seconds: float, apps_per_stream: int = 1,
                         learner: LearningRounds | None = None) -> tuple[Latencies, float, float, list[SignatureStreamer]]:
    base = demo_apps()
    lat = Latencies()
    period_s = 0.1
    streamers: list[SignatureStreamer] = []
    for first in range(0, apps, apps_per_stream):
        members = range(first, min(apps, first + apps_per_stream))
        traces = {}
        for i in members:
            a = base[i % len(base)]
            name = f"{a.app}#{i}"
            traces[name] = AppTrace(name, a.t_s, a.columns)
        # one device per stream (a profiler's applications share its GPUs; the allocator needs a known one)
        source = ReplaySource(Trace(traces), speed=hz, loop=True, align="per_app",
                              device_id=device_ids[(first // apps_per_stream) % len(device_ids)], pid_base=10_000 + first)
        streamers.append(TimedStreamer(source, address, period_s=period_s, profiler_id=f"bench-{first}",
                                       on_reply=lat.on_reply, lat=lat))
    freeze_startup_heap()  # as `vgpu profiler` does once its source and streamer are made (vgpu/gc_freeze.py)

    async def launch(i: int, s: SignatureStreamer) -> asyncio.Task[Any]:
        # Independent profilers: ticks spread over one period. The replay clock starts half a period
        # before the profiler's first tick, so each tick finds exactly one row due (a row due at the
        # tick's own instant would fall to either side of it by timer jitter: 0 rows, then 2).
        await asyncio.sleep(i * period_s / len(streamers))
        s.enqueue(s.source.sample())
        await asyncio.sleep(period_s / 2)
        return asyncio.create_task(s.run())

    tasks = await asyncio.gather(*(launch(i, s) for i, s in enumerate(streamers)))
    await asyncio.sleep(warmup_s)
    accepted0 = mgr.mark()["accepted"]
    cpu0, wall0 = mgr.cpu_s(), time.time()
    lat.window_start_s, lat.window_end_s = wall0, wall0 + seconds
    if learner is not None:
        learner.start()
    await asyncio.sleep(seconds)
    cpu1, wall1 = mgr.cpu_s(), time.time()
    if learner is not None:
        learner.stop()
    lat.accepted = mgr.stats()["accepted"] - accepted0
    for s in streamers:
        s.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    return lat, cpu1 - cpu0, wall1 - wall0, streamers


def run_ingest(*, apps: int = 64, seconds: float = 20.0, hz: float = 10.0, gpus: int = 8, warmup_s: float = 3.0,
               forecast_interval_s: float = 1.0, profile_path: str = "", apps_per_stream: int = 1,
               batch_window_s: float = 0.001, forecaster: str = "default", duty: float = 0.25,
               ack_interval_s: float = ACK_INTERVAL_S, null: bool = False, learn_trace: str = "") -> dict[str, Any]:
    """Normal mode; see the module docstring."""
    from vgpu import log

    log.configure("console", "error")
    learner = LearningRounds(learn_trace) if learn_trace else None
    mgr = ManagerProcess(gpus, forecast_interval_s, profile_path, batch_window_s, forecaster, duty, ack_interval_s,
                         null)
    mgr.start()
    try:
        lat, cpu_s, wall_s, streamers = asyncio.run(
            _run_profilers(mgr.address, apps, hz, sim_device_ids(gpus), mgr, warmup_s, seconds, apps_per_stream,
                           learner)
        )
    finally:
        stats = mgr.stop()
        if learner is not None:
            learner.stop()
    tick_ms = stats.get("tick_ms", [])
    learning = {} if learner is None else {
        "learn_rounds": learner.rounds,
        "learn_cpu_s": round(learner.cpu_s, 2),
        "learn_cpu_frac": round(learner.cpu_s / wall_s, 4),
        "learn_round_wall_s": [round(w, 1) for w in learner.round_wall_s],
    }
    return {
        **learning,
        "apps": apps,
        "streams": len(streamers),
        "signatures_per_s": round(lat.accepted / wall_s, 1),
        "decision_p50_ms": _pct(lat.decision_ms, 50),
        "decision_p99_ms": _pct(lat.decision_ms, 99),
        "manager_cpu_frac": round(cpu_s / wall_s, 4),
        "reply_p99_ms": _pct(lat.reply_ms, 99),
        "tick_p50_ms": _pct(tick_ms, 50),
        "tick_p99_ms": _pct(tick_ms, 99),
        "forecast_interval_s": forecast_interval_s,
        "batch_window_ms": batch_window_s * 1000.0,
        "forecaster": "none" if null else mgr.forecaster_name,
        "forecast_duty_max": duty,
        "ack_interval_ms": ack_interval_s * 1000.0,
        "null_manager": null,
        "decisions": lat.decisions,
        # allocator calls over the whole run (warm-up included), and how many waited for the acting budget
        "applies": stats.get("applies", 0),
        "applies_deferred": stats.get("applies_deferred", 0),
        "rejected": lat.rejected,
        "late_ticks": sum(s.loop.stats.late_ticks for s in streamers),
        "disconnects": sum(s.stats.disconnects for s in streamers),
        "seconds": round(wall_s, 2),
    }


# --- --max mode: raw batched streams ---------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class BatchEncoder:
    """Builds serialised `SignatureBatch`es quickly: each signature is its app's pre-serialised
    identity (fields 1-3), then timestamp_s (field 4, a double) and seq (field 5, a varint), then one
    of the app's pre-serialised counter blocks (fields 6-7) taken from its trace rows. Protobuf
    parses fields in any order, so the bytes equal what `SerializeToString` would give up to order."""

    def __init__(self, apps: Sequence[AppTrace], names: Sequence[str], device_ids: Sequence[str]) -> None:
        self.names = list(names)
        self.prefix: list[bytes] = []
        self.blocks: list[list[bytes]] = []
        self.seq = [0] * len(names)
        self.last_t = [0.0] * len(names)
        for i, name in enumerate(names):
            a = apps[i % len(apps)]
            ident = signature_pb2.BehavioralSignature(app_id=name, pid=10_000 + i, device_id=device_ids[i % len(device_ids)])
            self.prefix.append(ident.SerializeToString())
            mem, sm = a.column("mem_used_mib"), a.column("sm_util_pct")
            blocks = []
            for r in range(min(len(a), 64)):
                s = signature_pb2.BehavioralSignature()
                if math.isfinite(mem[r]):
                    s.process.gpu_mem_used_mib = float(mem[r])
                    s.device.mem_used_mib = float(mem[r])
                if math.isfinite(sm[r]):
                    s.process.sm_util_pct = float(sm[r])
                s.device.mem_total_mib = 81559.0
                blocks.append(s.SerializeToString())
            self.blocks.append(blocks)

    def signature(self, i: int, t_s: float) -> bytes:
        self.seq[i] += 1
        seq = self.seq[i]
        t_s = max(t_s, self.last_t[i] + 1e-6)  # never back in time for one app, however big the batch
        self.last_t[i] = t_s
        blocks = self.blocks[i]
        return self.prefix[i] + b"\x21" + struct.pack("<d", t_s) + b"\x28" + varint(seq) + blocks[seq % len(blocks)]

    def batch(self, profiler_id: str, tick: int, app_idx: Sequence[int], per_app: int) -> tuple[bytes, int]:
        now = time.time()
        head = ingest_pb2.SignatureBatch(profiler_id=profiler_id, tick=tick, sent_at_s=now).SerializeToString()
        parts = [head]
        n = 0
        for r in range(per_app):
            t = now - (per_app - 1 - r) * 1e-4
            for i in app_idx:
                sig = self.signature(i, t)
                parts.append(b"\x22" + varint(len(sig)) + sig)
                n += 1
        return b"".join(parts), n


class ColumnEncoder(BatchEncoder):
    """The same signatures as `BatchEncoder`, a batch of `columns_from` or more sent as one
    `SignatureColumns` (what the profiler does, profiler/stream.py; vgpu/wire.py), smaller
    ones as rows. `columns_from` 0: every batch as columns."""

    def __init__(self, apps: Sequence[AppTrace], names: Sequence[str], device_ids: Sequence[str],
                 columns_from: int = 0) -> None:
        super().__init__(apps, names, device_ids)
        self.columns_from = columns_from
        self.device_ids = [device_ids[i % len(device_ids)] for i in range(len(names))]
        self.rows: list[np.ndarray] = []  # per app: (3, 64) mem, sm, mem_total from its trace
        for i in range(len(names)):
            a = apps[i % len(apps)]
            k = min(len(a), 64)
            self.rows.append(np.stack([a.column("mem_used_mib")[:k], a.column("sm_util_pct")[:k], np.full(k, 81559.0)]))

    def batch(self, profiler_id: str, tick: int, app_idx: Sequence[int], per_app: int) -> tuple[bytes, int]:
        from vgpu.wire import encode_columns

        if per_app * len(app_idx) < self.columns_from:
            return super().batch(profiler_id, tick, app_idx, per_app)
        now = time.time()
        idx = list(app_idx)
        n_apps = len(idx)
        last_t = np.asarray([self.last_t[i] for i in idx])
        first_seq = np.asarray([self.seq[i] for i in idx], dtype=np.uint64)
        # row r of every app, r = 0..per_app-1, in batch order (r outer, app inner) like the row form
        r = np.repeat(np.arange(per_app), n_apps)
        t = np.maximum(now - (per_app - 1 - r) * 1e-4, np.tile(last_t, per_app) + 1e-6 * (1 + r))
        seq = np.tile(first_seq, per_app) + (r + 1).astype(np.uint64)
        vals = np.empty((3, per_app * n_apps))
        for j, i in enumerate(idx):
            block = self.rows[i]
            pos = (seq[j::n_apps] % np.uint64(block.shape[1])).astype(np.int64)
            vals[:, j::n_apps] = block[:, pos]
            self.seq[i] += per_app
            self.last_t[i] = float(t[(per_app - 1) * n_apps + j])
        cols = encode_columns([self.names[i] for i in idx] * per_app, [self.device_ids[i] for i in idx] * per_app,
                              seq, t, {"mem_used_mib": vals[0], "sm_util_pct": vals[1], "mem_total_mib": vals[2]})
        msg = ingest_pb2.SignatureBatch(profiler_id=profiler_id, tick=tick, sent_at_s=now, columns=cols)
        return msg.SerializeToString(), len(t)


async def _max_stream(channel: Any, enc: BatchEncoder, sid: int, app_idx: list[int], state: dict[str, Any]) -> None:
    call = channel.stream_stream(INGEST_METHOD, request_serializer=None,
                                 response_deserializer=ingest_pb2.IngestReply.FromString)()

    async def read() -> None:
        async for reply in call:
            state["rejected"] += len(reply.rejected)

    reader = asyncio.create_task(read())
    period = 0.1
    k = 0
    next_t = time.monotonic()
    try:
        while not state["stop"]:
            per_app = state["per_app"]
            if per_app > 0:
                data, n = enc.batch(f"max-{sid}", k, app_idx, per_app)
                await call.write(data)
                state["batches"] += 1
                state["offered"] += n
            k += 1
            next_t += period
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
    finally:
        # A backlog left by a rate the manager could not sustain is cut off, not waited for.
        call.cancel()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def _run_max(address: str, mgr: ManagerProcess, device_ids: list[str], rates: Sequence[int], step_s: float,
                   budget_s: float, streams: int, n_apps: int, encoding: str = "auto") -> dict[str, Any]:
    names = [f"max-app-{i}" for i in range(n_apps)]
    if encoding == "rows":
        enc: BatchEncoder = BatchEncoder(demo_apps(), names, device_ids)
    else:  # "auto": as the profiler sends them (columns from DEFAULT_COLUMNS_FROM signatures a batch)
        enc = ColumnEncoder(demo_apps(), names, device_ids, 0 if encoding == "columns" else DEFAULT_COLUMNS_FROM)
    state: dict[str, Any] = {"rejected": 0, "batches": 0, "offered": 0, "per_app": 0, "stop": False}
    groups = [list(range(s, n_apps, streams)) for s in range(streams)]
    started = time.monotonic()
    steps: list[dict[str, Any]] = []
    best = 0
    best_cpu = math.nan
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 16 * 1024 * 1024)]) as ch:
        tasks = [asyncio.create_task(_max_stream(ch, enc, s, groups[s], state)) for s in range(streams)]
        for rate in rates:
            settle_s = min(1.0, step_s / 4)
            if time.monotonic() - started + settle_s + step_s + 0.5 > budget_s:
                break
            # signatures per app per batch: rate / (10 batches/s * apps)
            state["per_app"] = max(1, round(rate / (10 * n_apps)))
            offered_rate = state["per_app"] * 10 * n_apps
            await asyncio.sleep(settle_s)  # settle into the new rate
            a0, b0 = mgr.stats()["accepted"], state["batches"]
            cpu0, t0 = mgr.cpu_s(), time.monotonic()
            await asyncio.sleep(step_s)
            a1, cpu1, t1 = mgr.stats()["accepted"], mgr.cpu_s(), time.monotonic()
            sent_batches = state["batches"] - b0
            achieved = (a1 - a0) / (t1 - t0)
            # does the manager catch up with what was sent in the step? (its batch counter against
            # what was sent: the streams began before the step, so both started counting at 0)
            deadline = time.monotonic() + 0.5
            while (backlog := state["batches"] - mgr.stats()["batches"]) > streams and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            ok = achieved >= 0.95 * offered_rate and backlog <= streams
            steps.append({"offered_per_s": offered_rate, "accepted_per_s": round(achieved, 1),
                          "manager_cpu_frac": round((cpu1 - cpu0) / (t1 - t0), 3), "backlog_batches": backlog,
                          "batches": sent_batches, "sustained": ok})
            if not ok:
                break
            best, best_cpu = offered_rate, (cpu1 - cpu0) / (t1 - t0)
        state["stop"] = True
        state["per_app"] = 0
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "max_sustained_signatures_per_s": best,
        "manager_cpu_frac_at_max": round(best_cpu, 3) if math.isfinite(best_cpu) else None,
        "streams": streams,
        "apps": n_apps,
        "encoding": encoding,
        "batches_per_s_per_stream": 10,
        "rejected": state["rejected"],
        "steps": steps,
        "seconds": round(time.monotonic() - started, 1),
    }


DEFAULT_RATES = (5_000, 10_000, 20_000, 30_000, 40_000, 60_000, 80_000, 100_000, 130_000, 160_000, 200_000, 300_000,
                 500_000)


def run_max(*, gpus: int = 8, step_s: float = 3.0, budget_s: float = 60.0, streams: int = 4, apps: int = 200,
            rates: Sequence[int] = DEFAULT_RATES, forecast_interval_s: float = 1.0, batch_window_s: float = 0.001,
            profile_path: str = "", encoding: str = "auto", forecaster: str = "default") -> dict[str, Any]:
    from vgpu import log

    log.configure("console", "error")
    mgr = ManagerProcess(gpus, forecast_interval_s, profile_path, batch_window_s, forecaster)
    mgr.start()
    try:
        result = asyncio.run(_run_max(mgr.address, mgr, sim_device_ids(gpus), rates, step_s, budget_s, streams, apps,
                                      encoding))
    finally:
        stats = mgr.stop()
    result["forecaster"] = mgr.forecaster_name
    result["manager_out_of_order"] = stats.get("out_of_order")
    result["manager_forecast_tick_p99_ms"] = _pct(stats.get("tick_ms", []), 99)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--apps", type=int, default=64, help="profilers, one application and one stream each (default 64)")
    p.add_argument("--seconds", type=float, default=20.0, help="measurement window (default 20)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="run before measuring (default 3; 125 fills the manager's 2-minute windows first)")
    p.add_argument("--apps-per-stream", type=int, default=1,
                   help="applications per profiler stream (default 1: N streams; 64: one node-wide profiler)")
    p.add_argument("--hz", type=float, default=10.0, help="signatures per second per application (default 10)")
    p.add_argument("--gpus", type=int, default=8, help="simulated GPUs behind the allocator (default 8)")
    p.add_argument("--forecast-interval-s", type=float, default=1.0, help="manager forecast tick (default 1, as the daemon)")
    p.add_argument("--batch-window-ms", type=float, default=1.0,
                   help="manager: how long due applications wait for others to join one forecast (default 1)")
    p.add_argument("--max", action="store_true", help="find the highest sustained rate with batched ticks")
    p.add_argument("--forecaster", choices=("default", "model", "baseline", "served", "served-trees"),
                   default="default",
                   help="manager's forecaster: the shipped model when it loads, else the baseline; the shipped "
                        "model; the baseline; the daemon's served mixture over the model; or that mixture with "
                        "node-local trees fitted on the replayed trace (default: default)")
    p.add_argument("--learn-trace", metavar="PATH", default="",
                   help="run node-learning rounds in the background during the window, on a node history made "
                        "from this canonical trace")
    p.add_argument("--forecast-duty-max", type=float, default=0.25,
                   help="manager: most of the time its forecasting thread may be busy (default 0.25, as the daemon)")
    p.add_argument("--encoding", choices=("auto", "rows", "columns"), default="auto",
                   help="--max: batches as signature rows, as one SignatureColumns, or as the profiler sends them "
                        f"(auto, the default: columns from {DEFAULT_COLUMNS_FROM} signatures a batch)")
    p.add_argument("--max-seconds", type=float, default=60.0, help="--max: time budget (default 60)")
    p.add_argument("--step-s", type=float, default=3.0, help="--max: seconds per offered rate (default 3)")
    p.add_argument("--streams", type=int, default=4, help="--max: concurrent streams (default 4)")
    p.add_argument("--ack-interval-ms", type=float, default=ACK_INTERVAL_S * 1000.0,
                   help="manager: longest a stream goes without a reply when there is nothing to say "
                        f"(default {ACK_INTERVAL_S * 1000.0:g}, as the daemon; 0: a reply per batch)")
    p.add_argument("--null-manager", action="store_true",
                   help="replace the manager by a servicer that only reads the batches: gRPC's own CPU for the "
                        "same streams, the floor under manager_cpu_frac")
    p.add_argument("--profile-manager", metavar="PATH", default="",
                   help="run the manager's event loop under cProfile and write its stats to PATH")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args(None if argv is None else list(argv))
    if args.apps < 1 or args.apps_per_stream < 1 or args.seconds <= 0 or args.hz <= 0 or args.gpus < 1 or args.streams < 1:
        p.error("--apps, --gpus and --streams must be >= 1; --seconds and --hz > 0")
    if args.max:
        result = run_max(gpus=args.gpus, step_s=args.step_s, budget_s=args.max_seconds, streams=args.streams,
                         forecast_interval_s=args.forecast_interval_s, profile_path=args.profile_manager,
                         batch_window_s=args.batch_window_ms / 1000.0, encoding=args.encoding,
                         forecaster=args.forecaster)
    else:
        result = run_ingest(apps=args.apps, seconds=args.seconds, hz=args.hz, gpus=args.gpus, warmup_s=args.warmup_s,
                            forecast_interval_s=args.forecast_interval_s, profile_path=args.profile_manager,
                            batch_window_s=args.batch_window_ms / 1000.0, forecaster=args.forecaster,
                            duty=args.forecast_duty_max, ack_interval_s=args.ack_interval_ms / 1000.0,
                            null=args.null_manager, apps_per_stream=args.apps_per_stream,
                            learn_trace=args.learn_trace)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>32}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
