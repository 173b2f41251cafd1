"""What one user's half-sent calls make a real `vgpu serve` hold, and whether another client is served meanwhile.

    python bench/halfsent.py --json                                  # 8 connections x 40 calls, 4 MiB announced
    python bench/halfsent.py --connections 1 --calls 20 --json
    python bench/halfsent.py --connections 256 --calls 16 --announce-bytes 262144 --gap-s 0.03 --push-s 20 --json
    python bench/halfsent.py --env VGPU_SERVER_MAX_STREAMS_PER_CONNECTION=1000 --json   # without the stream bound

gRPC core reads a call's request message into memory until the message is complete, before any vgpu
code sees the call. The attack: open connections to the daemon's socket and, on each, start calls
(`/vgpu.v1.Allocator/GetAvailableResources`, which needs no token) whose request announces a message of
`--announce-bytes` (default 4 MiB, gRPC's own default limit) and send all of it but the last byte, as
fast as HTTP/2 flow control lets, then hold the calls open. The HTTP/2 client here is hand-made
(`HalfSentConn`: frames, flow control, SETTINGS / PING answers; no HPACK table, literal headers only)
because gRPC's own clients never leave a message unfinished.

What runs. `vgpu serve --backend sim:h100-80gb` as a child process on a temporary state directory, with
`--env` settings added to its environment. Once it serves and its forecaster has loaded (or fallen
back), its RSS is read; the calls are opened and pushed for up to `--push-s` (`--gap-s`: connection i
starts its calls i x gap after the first; started all at once, gRPC sheds calls that arrive faster
than the server takes them up, so a paced attack is the worse one); then, with every call still held
open, a well-behaved client (the gRPC stub, a fresh channel) asks GetAvailableResources and the
daemon's RSS is read again after `--settle-s`. The attacker runs as the bench's own uid: run as root,
uid 0 is exempt from the front's per-uid connection bound, so `--connections` is what is opened (keep
it at or under `server.max_connections_per_uid` for a figure that another user could reach). Printed:

    {"connections", "calls_per_connection", "announce_bytes", "max_streams_per_connection" (the daemon's
     SETTINGS), "streams_refused" (reset by the daemon) and "reset_codes" (HTTP/2 error code -> how
     many), "connections_closed" (GOAWAY or closed), "streams_held" (open at the end of the push),
     "bytes_pushed_mib" (what flow control let through), "rss_before_mib", "rss_held_mib",
     "rss_added_mib", "rss_after_close_mib" (`--settle-s` after the attacker closed its connections),
     "rss_added_per_stream_held_kib", "other_client_served", "other_client_ms", "daemon_alive", "env",
     "gap_s"}

No figure is tuned here; the worst case per uid (`server.max_connections_per_uid` x
`server.max_streams_per_connection` x `server.max_request_bytes`) is in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from abuse import daemon  # noqa: E402

from vgpu.v1 import allocator_pb2 as pb  # noqa: E402
from vgpu.v1 import allocator_pb2_grpc as pb_grpc  # noqa: E402

OPEN_METHOD = "/vgpu.v1.Allocator/GetAvailableResources"
_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY, _WINDOW = 0, 1, 3, 4, 6, 7, 8
_SETTINGS_MAX_STREAMS, _SETTINGS_INITIAL_WINDOW = 3, 4
_FRAME_BYTES = 16384  # HTTP/2's default SETTINGS_MAX_FRAME_SIZE


def _frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding (RFC 7541 6.2.2)."""
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


class HalfSentConn:
    """One HTTP/2 connection to a Unix socket that opens gRPC calls and pushes each one's request up to,
    not including, its last byte. A reader thread answers SETTINGS and PING and keeps the flow-control
    windows; `closed_streams` are the streams the server reset or ended, `dead` says the connection went."""

    def __init__(self, path: str | Path, timeout_s: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(path))
        self.sock.settimeout(None)
        self._cv = threading.Condition()
        self.conn_window = 65535
        self.initial_window = 65535
        self.max_streams: int | None = None  # the server's SETTINGS_MAX_CONCURRENT_STREAMS, once seen
        self.settings_seen = threading.Event()
        self.windows: dict[int, int] = {}
        self.closed_streams: set[int] = set()
        self.reset_streams: set[int] = set()
        self.reset_codes: dict[int, int] = {}  # RST_STREAM error code -> streams reset with it
        self.dead = False
        self._next_stream = 1
        try:
            self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(_SETTINGS, 0, 0))
        except OSError:  # closed at once (the front's per-uid bound): the reader sees end-of-file
            self.dead = True
        self._reader = threading.Thread(target=self._read, name="halfsent-reader", daemon=True)
        self._reader.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(5.0)

    def _recv(self, n: int) -> bytes:
        b = b""
        while len(b) < n:
            c = self.sock.recv(n - len(b))
            if not c:
                raise EOFError
            b += c
        return b

    def _read(self) -> None:
        try:
            while True:
                head = self._recv(9)
                length, ftype, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = self._recv(length)
                with self._cv:
                    self._on_frame(ftype, flags, stream, payload)
                    self._cv.notify_all()
        except (EOFError, OSError):
            pass
        with self._cv:
            self.dead = True
            self._cv.notify_all()
        self.settings_seen.set()

    def _on_frame(self, ftype: int, flags: int, stream: int, payload: bytes) -> None:
        if ftype == _SETTINGS and not flags & 1:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack(">HI", payload[i:i + 6])
                if key == _SETTINGS_INITIAL_WINDOW:
                    delta, self.initial_window = value - self.initial_window, value
                    for s in self.windows:
                        self.windows[s] += delta
                elif key == _SETTINGS_MAX_STREAMS:
                    self.max_streams = value
            self.sock.sendall(_frame(_SETTINGS, 1, 0))
            self.settings_seen.set()
        elif ftype == _WINDOW:
            inc = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if stream == 0:
                self.conn_window += inc
            elif stream in self.windows:
                self.windows[stream] += inc
        elif ftype == _PING and not flags & 1:
            self.sock.sendall(_frame(_PING, 1, 0, payload))
        elif ftype == _RST:
            self.closed_streams.add(stream)
            self.reset_streams.add(stream)
            code = int.from_bytes(payload[:4], "big")
            self.reset_codes[code] = self.reset_codes.get(code, 0) + 1
        elif ftype == _HEADERS and flags & 1:  # trailers: the server ended the call
            self.closed_streams.add(stream)
        elif ftype == _GOAWAY:
            self.dead = True

    def open(self, method: str = OPEN_METHOD) -> int:
        """Start a call (its headers only); returns its stream id."""
        block = b"".join(_literal(k, v) for k, v in ((":method", "POST"), (":scheme", "http"), (":path", method),
                                                      (":authority", "localhost"), ("content-type", "application/grpc"),
                                                      ("te", "trailers")))
        with self._cv:
            stream = self._next_stream
            self._next_stream += 2
            self.windows[stream] = self.initial_window
            try:
                self.sock.sendall(_frame(_HEADERS, 4, stream, block))  # END_HEADERS, not END_STREAM
            except OSError:
                self.dead = True
        return stream

    def push_some(self, stream: int, announce_bytes: int, offset: int) -> int:
        """Send what the windows allow now of the call's request from `offset` (no waiting); bytes sent."""
        total = 5 + announce_bytes - 1
        sent = 0
        with self._cv:
            while offset + sent < total and not self.dead and stream not in self.closed_streams:
                n = min(_FRAME_BYTES, self.conn_window, self.windows[stream], total - offset - sent)
                if n <= 0:
                    break
                pos = offset + sent
                data = (struct.pack(">BI", 0, announce_bytes) + b"\0" * _FRAME_BYTES)[pos:pos + n] if pos < 5 else b"\0" * n
                try:
                    self.sock.sendall(_frame(_DATA, 0, stream, data))
                except OSError:
                    self.dead = True
                    break
                self.conn_window -= n
                self.windows[stream] -= n
                sent += n
        return sent


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def hold(sock: Path, connections: int, calls: int, announce: Sequence[int], push_s: float,
         gap_s: float = 0.0) -> tuple[list[HalfSentConn], dict[str, Any]]:
    """Open the connections and, on each, `calls` half-sent calls announcing `announce` bytes in turn
    (one pushing thread per connection, round-robin over its calls so each gets its share; connection
    i starts its calls i x `gap_s` after the first); returns the connections (still open: the caller
    closes them) and what was pushed."""
    conns = [HalfSentConn(sock) for _ in range(connections)]
    for c in conns:
        c.settings_seen.wait(5.0)
    start = time.monotonic()
    deadline = start + push_s + connections * gap_s
    pushed = [0] * connections

    def run(i: int) -> None:
        c = conns[i]
        time.sleep(max(0.0, start + i * gap_s - time.monotonic()))
        if c.dead:
            return
        streams = {c.open(): announce[k % len(announce)] for k in range(calls)}
        progress = dict.fromkeys(streams, 0)

        def done(s: int) -> bool:
            return s in c.closed_streams or progress[s] >= 5 + streams[s] - 1

        while time.monotonic() < deadline and not c.dead and not all(done(s) for s in streams):
            moved = False
            for s, length in streams.items():
                if not done(s):
                    got = c.push_some(s, length, progress[s])
                    progress[s] += got
                    moved = moved or got > 0
            if not moved:
                with c._cv:
                    c._cv.wait(0.05)
        pushed[i] = sum(progress.values())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    streams_held = sum(len(c.windows) - len(c.closed_streams) for c in conns if not c.dead)
    return conns, {
        "max_streams_per_connection": next((c.max_streams for c in conns if c.max_streams is not None), None),
        "streams_refused": sum(len(c.reset_streams) for c in conns),
        "reset_codes": {str(k): sum(c.reset_codes.get(k, 0) for c in conns)
                        for k in sorted({k for c in conns for k in c.reset_codes})},
        "connections_closed": sum(1 for c in conns if c.dead),
        "streams_held": streams_held,
        "bytes_pushed_mib": round(sum(pushed) / 2**20, 1),
    }


def served(sock: Path, timeout_s: float = 10.0) -> tuple[bool, float]:
    """Whether a fresh well-behaved client gets GetAvailableResources answered, and how long it took (ms)."""
    t0 = time.monotonic()
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        try:
            reply = pb_grpc.AllocatorStub(ch).GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False, (time.monotonic() - t0) * 1000.0
    return len(reply.devices) > 0, (time.monotonic() - t0) * 1000.0


def measure(connections: int, calls: int, announce: Sequence[int], push_s: float, settle_s: float,
            env_extra: dict[str, str], gap_s: float = 0.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vgpu-halfsent-") as d, daemon(Path(d), env_extra) as (proc, sock, _state):
        served(sock)  # the first call's one-off costs (channel, servicer paths) before the baseline
        time.sleep(0.5)
        before = rss_mib(proc.pid)
        conns, pile = hold(sock, connections, calls, announce, push_s, gap_s)
        try:
            time.sleep(settle_s)
            ok, ms = served(sock)
            held = rss_mib(proc.pid)
            alive = proc.poll() is None
        finally:
            for c in conns:
                c.close()
        time.sleep(settle_s)
        after = rss_mib(proc.pid)
        added = held - before
        return {
            "connections": connections, "calls_per_connection": calls, "announce_bytes": list(announce),
            "gap_s": gap_s,
            **pile,
            "rss_before_mib": round(before, 1), "rss_held_mib": round(held, 1), "rss_added_mib": round(added, 1),
            "rss_after_close_mib": round(after, 1),
            "rss_added_per_stream_held_kib": round(added * 1024 / pile["streams_held"], 1) if pile["streams_held"] else None,
            "other_client_served": ok, "other_client_ms": round(ms, 1), "daemon_alive": alive,
            "env": env_extra,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--calls", type=int, default=40, help="half-sent calls started on each connection")
    ap.add_argument("--announce-bytes", type=int, nargs="+", default=[4 * 2**20],
                    help="the message length each call announces (several: the calls take them in turn)")
    ap.add_argument("--push-s", type=float, default=5.0, help="how long the calls are pushed")
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--gap-s", type=float, default=0.0,
                    help="each connection starts its calls this long after the one before (0: all at once)")
    ap.add_argument("--env", action="append", default=[], metavar="VGPU_KEY=VALUE",
                    help="a setting for the daemon's environment (repeatable)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    env_extra = dict(e.split("=", 1) for e in args.env)
    out = measure(args.connections, args.calls, args.announce_bytes, args.push_s, args.settle_s, env_extra, args.gap_s)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
