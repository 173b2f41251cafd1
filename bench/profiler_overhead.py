"""Profiler overhead: the live sampler plus the streamer at 10 Hz on simulated GPUs, sending to a sink.

    python bench/profiler_overhead.py --gpus 8 --apps 64 --json

What runs in this process: `vgpu.profiler.sampler.Sampler` over a `SimBackend` of `--gpus` H100s running
`--apps` applications (the bundled demo trace's applications, looping, spread round-robin over the
GPUs), and `vgpu.profiler.stream.SignatureStreamer` sending one batch per 100 ms tick over gRPC on a Unix
socket to a sink server in a child process (it answers each batch with an `IngestReply`, so the
profiler reads replies as it would from the manager; the sink's own CPU is not counted).

Prints {"cpu_frac", "tick_p99_ms", "late_ticks", ...}:
* cpu_frac: this process's CPU time (user + system, every thread, gRPC's included) over wall time,
  MINUS the simulator's own CPU time, over the measurement window; 1.0 is one core. The simulator
  stands in for NVML and computes every read from its traces in Python, which real NVML does in the
  driver; its cost is measured by timing the thread CPU time spent inside each device call
  (`sim_cpu_frac`) and reported separately, and `cpu_frac_with_sim` is the undivided figure. A real
  NVML call costs roughly 10-100 us of driver time that neither figure contains.
* tick_p50_ms / tick_p99_ms: wall time of one tick's work (sample every device, build and write the
  batch), simulator included;
* late_ticks: deadlines skipped because a tick ran a whole period late (FixedRateLoop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu.device.sim import SimBackend  # noqa: E402
from vgpu.profiler.sampler import Sampler  # noqa: E402
from vgpu.profiler.stream import SignatureStreamer  # noqa: E402
from vgpu.traces import AppTrace, read_trace  # noqa: E402
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc  # noqa: E402

_FIRST_PID = 20_000


# --- the sink ----------------------------------------------------------------------------------------------
class _Sink(ingest_pb2_grpc.IngestServicer):
    async def StreamSignatures(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[ingest_pb2.SignatureBatch], context: Any
    ) -> AsyncIterator[ingest_pb2.IngestReply]:
        async for batch in request_iterator:
            yield ingest_pb2.IngestReply(tick=batch.tick, accepted=len(batch.signatures))


def sink_main(conn: Connection, address: str) -> None:
    import grpc

    async def serve() -> None:
        server = grpc.aio.server()
        ingest_pb2_grpc.add_IngestServicer_to_server(_Sink(), server)
        server.add_insecure_port(address)
        await server.start()
        conn.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(0.2)

    asyncio.run(serve())


# --- simulator cost, measured apart ---------------------------------------------------------------------------
class SimMeter:
    """Thread CPU seconds spent inside device calls."""

    def __init__(self) -> None:
        self.cpu_s = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                self.cpu_s += time.thread_time() - t0

        return timed


class MeteredDevice:
    """A device whose every method call is timed by a `SimMeter` (identity properties pass through)."""

    def __init__(self, device: Any, meter: SimMeter) -> None:
        self._device = device
        self._meter = meter
        self.uuid = device.uuid
        self.index = device.index
        self.name = device.name

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._device, name)
        return self._meter.wrap(attr) if callable(attr) else attr


class MeteredBackend:
    def __init__(self, backend: SimBackend, meter: SimMeter) -> None:
        self._devices = [MeteredDevice(d, meter) for d in backend.devices()]
        self.name = backend.name

    def devices(self) -> list[MeteredDevice]:
        return list(self._devices)

    def close(self) -> None:
        pass


# --- the profiler ------------------------------------------------------------------------------------------
class TimedStreamer(SignatureStreamer):
    """Records the wall time of each tick's work."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tick_ms: list[float] = []

    async def _tick(self, k: int) -> None:
        t0 = time.perf_counter()
        await super()._tick(k)
        self.tick_ms.append((time.perf_counter() - t0) * 1000.0)


def _apps() -> list[AppTrace]:
    from vgpu.data import demo_trace_path

    trace = read_trace(demo_trace_path())
    return [trace.apps[n] for n in sorted(trace.apps)]


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _measure(address: str, gpus: int, apps: int, seconds: float, warmup_s: float, period_s: float) -> dict[str, Any]:
    backend = SimBackend(["h100-80gb"] * gpus)
    base = _apps()
    names = {}
    for i in range(apps):
        a = base[i % len(base)]
        pid = _FIRST_PID + i
        names[pid] = f"{a.app}#{i}"
        backend.launch(names[pid], pid, a, device_index=i % gpus, loop=True)
    meter = SimMeter()
    sampler = Sampler(MeteredBackend(backend, meter), psutil_module=None, inapp_dir=None,  # type: ignore[arg-type]
                      app_id_of=names.get)
    replies = [0]
    streamer = TimedStreamer(sampler, address, period_s=period_s, profiler_id="overhead",
                             on_reply=lambda r: replies.__setitem__(0, replies[0] + 1))
    task = asyncio.create_task(streamer.run())
    await asyncio.sleep(warmup_s)
    n0, late0, sent0 = len(streamer.tick_ms), streamer.loop.stats.late_ticks, streamer.stats.signatures_sent
    cpu0, sim0, wall0 = _cpu_s(), meter.cpu_s, time.monotonic()
    await asyncio.sleep(seconds)
    cpu1, sim1, wall1 = _cpu_s(), meter.cpu_s, time.monotonic()
    ticks = streamer.tick_ms[n0:]
    late = streamer.loop.stats.late_ticks - late0
    sent = streamer.stats.signatures_sent - sent0
    streamer.stop()
    await task
    wall = wall1 - wall0
    total, sim = (cpu1 - cpu0) / wall, (sim1 - sim0) / wall
    ms = np.asarray(ticks, dtype=np.float64)
    return {
        "gpus": gpus,
        "apps": apps,
        "cpu_frac": round(total - sim, 4),
        "tick_p99_ms": round(float(np.percentile(ms, 99)), 3) if len(ms) else None,
        "late_ticks": late,
        "cpu_frac_with_sim": round(total, 4),
        "sim_cpu_frac": round(sim, 4),
        "tick_p50_ms": round(float(np.percentile(ms, 50)), 3) if len(ms) else None,
        "ticks": len(ticks),
        "signatures_per_tick": round(sent / max(1, len(ticks)), 1),
        "replies": replies[0],
        "disconnects": streamer.stats.disconnects,
        "seconds": round(wall, 2),
    }


def run(*, gpus: int = 8, apps: int = 64, seconds: float = 20.0, warmup_s: float = 2.0, period_s: float = 0.1) -> dict[str, Any]:
    from vgpu import log

    log.configure("console", "error")
    with tempfile.TemporaryDirectory(prefix="vgpu-overhead-") as tmp:
        address = f"unix:{tmp}/sink.sock"
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=sink_main, args=(child, address), daemon=True)
        proc.start()
        try:
            if not parent.poll(60):
                raise RuntimeError("the sink server did not start within 60 s")
            parent.recv()
            return asyncio.run(_measure(address, gpus, apps, seconds, warmup_s, period_s))
        finally:
            parent.send("stop")
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--gpus", type=int, default=8, help="simulated H100s (default 8)")
    p.add_argument("--apps", type=int, default=64, help="applications, spread round-robin over the GPUs (default 64)")
    p.add_argument("--seconds", type=float, default=20.0, help="measurement window (default 20)")
    p.add_argument("--warmup-s", type=float, default=2.0, help="run before measuring (default 2)")
    p.add_argument("--period-ms", type=float, default=100.0, help="tick period (default 100: 10 Hz)")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args(None if argv is None else list(argv))
    if args.gpus < 1 or args.apps < 0 or args.seconds <= 0 or args.period_ms <= 0 or args.warmup_s < 0:
        p.error("--gpus >= 1, --apps >= 0, --seconds > 0, --period-ms > 0 and --warmup-s >= 0")
    result = run(gpus=args.gpus, apps=args.apps, seconds=args.seconds, warmup_s=args.warmup_s,
                 period_s=args.period_ms / 1000.0)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>20}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
