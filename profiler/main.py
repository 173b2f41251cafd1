"""`vgpu profiler`: sample GPU applications (or replay a trace) and stream signatures to the manager.

    vgpu profiler                                         # NVML every 100 ms, to /run/vgpu/vgpu.sock
    vgpu profiler --manager 127.0.0.1:7070 --backend sim:h100-80gb
    vgpu profiler --replay trace.csv.gz --speed 10 --loop --device-id GPU-...
    vgpu profiler --record node.csv                       # also write what is sampled (vgpu/profiler/record.py)

The daemon accepts signatures only from a profiler that sends its profiler token (vgpu/auth.py):
`--token-file` (default /var/lib/vgpu/tokens/profiler.token, written by `vgpu serve`) is read at
start and again at every reconnect, and sent as `authorization: Bearer <token>` on the Ingest
stream. A missing or unreadable token file stops the profiler at start with exit status 2;
`--no-token` streams without one (for a daemon with `auth.open_ingest = true`).

A replay's `--device-id` must be a device of the daemon: it is checked against `GetAvailableResources`
at start (exit status 2 when the daemon answers without it; a daemon not reachable yet is only
warned about). Signatures the daemon rejects (for a device it does not have, malformed, out of order)
are logged with the daemon's reason and counted in the final `profiler stream stopped` line.

SIGTERM or SIGINT stops it gracefully: the last batch is flushed, the stream closed, exit status 0;
1 when it never reached the manager, or the manager refused every stream (wrong socket, wrong token).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from vgpu import auth, log
from vgpu.client import default_inapp_dir, default_socket, device_of_index, grpc_target, is_device_index
from vgpu.gc_freeze import freeze_startup_heap, thaw_heap
from vgpu.profiler.source import SignatureSource
from vgpu.profiler.stream import SignatureStreamer, StreamStats


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Stream behavioural signatures of GPU applications.")
    p.add_argument("--manager", default=None,
                   help="manager address: unix:///path.sock, /path.sock or host:port (default: the node's, as the "
                        "CLI finds it: VGPU_SERVER_SOCKET, else server.socket of /etc/vgpu/vgpu.toml, else "
                        "/run/vgpu/vgpu.sock)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--backend", default="nvml", help="device backend: nvml (default), sim, or sim:SKU[*N][,SKU[*N]...], e.g. sim:h100-80gb*2")
    src.add_argument("--replay", type=Path, metavar="TRACE", help="replay a canonical trace instead of sampling GPUs")
    p.add_argument("--device-id", default=None,
                   help="replay: the device the signatures name, a device of the daemon by its index (IDX) or "
                   "UUID, as `vgpu available` lists them; default: the trace's gpu column")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token-file", type=Path, default=auth.role_token_file("profiler"),
                     help="the daemon's profiler token (default %(default)s)")
    tok.add_argument("--no-token", action="store_true",
                     help="send no token (only a daemon with auth.open_ingest = true accepts that)")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed factor (default 1: the trace's pace)")
    p.add_argument("--copies", type=int, default=1, help="replay each application N times (load tests)")
    p.add_argument("--loop", action="store_true", help="replay: start over at the end of the trace")
    p.add_argument("--period-ms", type=float, default=100.0, help="tick period in ms (default 100)")
    p.add_argument("--inapp-dir", type=Path, default=None,
                   help="where client stubs write in-app counters (default: the node's server.inapp_dir, found as "
                        "the socket is, else /run/vgpu/inapp)")
    p.add_argument("--buffer-max", type=int, default=10_000, help="signatures kept while the manager is away")
    p.add_argument("--profiler-id", default=None, help="id sent with every batch (default <hostname>:profiler)")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this many seconds (default: run until signalled)")
    p.add_argument("--record", type=Path, default=None, metavar="FILE",
                   help="also write every sampled signature to this canonical trace (see `vgpu record`)")
    p.add_argument("--log-format", choices=("json", "console"), default="json")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: Sequence[str], prog: str = "vgpu profiler") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(list(argv))
    try:
        # where the daemon is and reads in-app reports, as the node configures them (the stub's rule)
        args.manager = default_socket() if args.manager is None else args.manager
        args.inapp_dir = default_inapp_dir() if args.inapp_dir is None else args.inapp_dir
        grpc_target(args.manager)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.period_ms > 0:
        parser.error("--period-ms must be positive")
    if not args.speed > 0:
        parser.error("--speed must be positive")
    if args.copies < 1 or args.buffer_max < 1:
        parser.error("--copies and --buffer-max must be at least 1")
    if args.device_id is not None and args.replay is None:
        parser.error("--device-id only applies to --replay (sampled signatures name their own device)")
    log.configure(args.log_format, args.log_level)
    logger = log.get_logger("profiler")
    metadata = None
    if not args.no_token:
        try:
            token_reader = TokenReader(args.token_file, logger)
        except (OSError, ValueError) as exc:
            print(f"{prog}: {exc}; give the daemon's profiler token with --token-file "
                  "(or --no-token for a daemon with auth.open_ingest = true)", file=sys.stderr)
            return 2
        metadata = token_reader.metadata

    backend = None
    replayed: tuple[Path, dict[str, Any]] | None = None  # the replayed trace and its #meta
    source: SignatureSource
    try:
        if args.replay is not None:
            from vgpu.profiler.replay import ReplaySource
            from vgpu.traces import TraceFormatError

            if args.device_id is not None:
                try:
                    args.device_id = resolve_device_id(args.manager, args.device_id, metadata, logger)
                except ValueError as exc:
                    print(f"{prog}: {exc}", file=sys.stderr)
                    return 2
            try:
                source = ReplaySource(args.replay, speed=args.speed, copies=args.copies, loop=args.loop,
                                      device_id=args.device_id)
            except (TraceFormatError, OSError) as exc:
                print(f"{prog}: {exc}", file=sys.stderr)
                return 1
            replayed = (args.replay, source.trace.metadata)
            note = source.trace.skipped_rows_note()
            if note:
                print(f"{prog}: {note}", file=sys.stderr)
        else:
            from vgpu.device import open_backend
            from vgpu.device.errors import DeviceError
            from vgpu.profiler.sampler import Sampler

            try:
                backend = open_backend(args.backend)
            except (DeviceError, ValueError) as exc:
                print(f"{prog}: cannot open backend {args.backend!r}: {exc}", file=sys.stderr)
                return 1
            # simulated processes are not host processes: no psutil for them
            psutil_module = None if args.backend.startswith("sim") else _psutil()
            source = Sampler(backend, psutil_module=psutil_module, inapp_dir=args.inapp_dir)
        if args.record is not None:
            from vgpu.profiler.record import RecordingSource, TraceRecorder, recording_metadata

            try:
                # a replay samples no device: the recording names the trace it replayed, not --backend
                recorder = TraceRecorder(args.record, recording_metadata(
                    list(argv), prog, "replay" if args.replay is not None else args.backend, backend, replayed))
            except OSError as exc:
                print(f"{prog}: cannot write {args.record}: {exc}", file=sys.stderr)
                return 1
            source = RecordingSource(source, recorder)
        streamer = SignatureStreamer(
            source,
            args.manager,
            period_s=args.period_ms / 1000.0,
            profiler_id=args.profiler_id,
            buffer_max=args.buffer_max,
            metadata=metadata,
        )
        # start-up is over: what it built is kept out of the garbage collector's full passes, which
        # would otherwise stall a batch's send (vgpu/gc_freeze.py)
        frozen = freeze_startup_heap()
        logger.info("profiler starting", manager=streamer.target, source=type(source).__name__,
                    period_ms=args.period_ms, token_file=None if args.no_token else str(args.token_file),
                    heap_frozen_objects=frozen)
        try:
            stats = asyncio.run(_run(streamer, args.seconds))
        finally:
            thaw_heap()  # the collector whole again for whatever runs on in this process
        if stats.connects == 0 or (stats.refused and not stats.acked):
            why = ("the manager refused every stream (see the log: the profiler token?)" if stats.refused
                   else f"never reached the manager ({stats.connect_failures} failed attempts; is vgpu serve "
                        "listening there?)")
            print(f"{prog}: {streamer.target}: {why}; {stats.signatures_sent} signatures sent", file=sys.stderr)
            return 1
        if stats.rejected:
            print(f"{prog}: the manager rejected {stats.rejected} of {stats.signatures_sent} signatures "
                  "(reasons in the log: 'manager rejected signatures')", file=sys.stderr)
        return 0
    finally:
        if backend is not None:
            backend.close()


class TokenReader:
    """The profiler token from its file: read at start (errors raise), re-read at every connect so a
    daemon that issued new tokens is followed; a later read that fails keeps the last good token."""

    def __init__(self, path: Path, logger: structlog.typing.FilteringBoundLogger) -> None:
        self.path = path
        self._log = logger
        self.token = auth.read_token_file(path)  # checked there: a token, or an error naming the file

    def metadata(self) -> tuple[tuple[str, str], ...]:
        try:
            self.token = auth.read_token_file(self.path)
        except (OSError, ValueError) as exc:
            self._log.warning("cannot re-read the profiler token; using the last one", error=str(exc))
        return auth.bearer(self.token)


def resolve_device_id(
    manager: str,
    device_id: str,
    metadata: Callable[[], tuple[tuple[str, str], ...]] | None,
    logger: structlog.typing.FilteringBoundLogger,
    timeout_s: float = 5.0,
) -> str:
    """The device the replayed signatures name: `device_id` as given (a GPU or MIG UUID), or the UUID
    of the GPU whose index it is, looked up as every `--device` flag is (vgpu.client.device_of_index).
    ValueError saying why it cannot be used with the daemon at `manager` (it answers without such a
    device or MIG instance, or an index cannot be looked up). A daemon that cannot be asked now is
    warned about for a UUID, not an error: the profiler waits for it like for any manager that is
    away."""
    import grpc

    from vgpu.v1 import allocator_pb2, allocator_pb2_grpc

    channel = grpc.insecure_channel(grpc_target(manager))
    try:
        resp = allocator_pb2_grpc.AllocatorStub(channel).GetAvailableResources(
            allocator_pb2.GetAvailableResourcesRequest(), timeout=timeout_s,
            metadata=metadata() if metadata is not None else (),
        )
    except grpc.RpcError as exc:
        if is_device_index(device_id):
            raise ValueError(f"--device-id {device_id} is a GPU index, which only the daemon can look up, and it "
                             f"cannot be reached at {manager} ({exc.code().name}: {exc.details()}); start it first, "
                             "or give the GPU's UUID (vgpu available)") from None
        logger.warning("cannot check --device-id against the manager", manager=manager, device_id=device_id,
                       code=str(exc.code()), detail=exc.details())
        return device_id
    finally:
        channel.close()
    if is_device_index(device_id):
        try:
            return device_of_index(resp, device_id)
        except LookupError as exc:
            raise ValueError(f"--device-id {device_id}: {exc}") from None
    ids = [d.device_id for d in resp.devices]
    if device_id in ids or any(device_id == m.instance_id for d in resp.devices for m in d.mig_instances):
        return device_id
    raise ValueError(f"--device-id {device_id!r} is not a device of the daemon at {manager}; its devices: "
                     f"{', '.join(f'{d.index} ({d.device_id})' for d in resp.devices) or 'none'} (vgpu available)")


async def _run(streamer: SignatureStreamer, seconds: float) -> StreamStats:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, streamer.stop)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    if seconds > 0:
        loop.call_later(seconds, streamer.stop)
    try:
        return await streamer.run()
    finally:
        streamer.source.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass


def _psutil() -> object:
    import psutil

    return psutil
