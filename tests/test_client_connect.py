"""The client stub's channel options let a slow handshake finish: a daemon that accepts a connection
but answers it late (loading its model, a loaded machine) is still reached, not timed out and
retried for ever."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from vgpu.client import RECONNECT_OPTIONS

HANDSHAKE_DELAY_S = 0.4


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def slow_socket(tmp_path: Path) -> Iterator[str]:
    """A Unix socket whose server answers each connection HANDSHAKE_DELAY_S after accepting it: a
    relay in front of a real gRPC server (health service) that waits before it connects through."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    inner = tmp_path / "inner.sock"
    server.add_insecure_port(f"unix:{inner}")
    server.start()
    outer = tmp_path / "outer.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(outer))
    listener.listen(16)
    stop = threading.Event()

    def relay(conn: socket.socket) -> None:
        time.sleep(HANDSHAKE_DELAY_S)
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(str(inner))
        except OSError:  # the test is over and its server gone
            up.close()
            conn.close()
            return
        threading.Thread(target=_pipe, args=(conn, up), daemon=True).start()
        _pipe(up, conn)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=relay, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"unix:{outer}"
    finally:
        stop.set()
        listener.close()
        server.stop(0)


def _check(target: str, options: tuple[tuple[str, int], ...], timeout_s: float = 3.0) -> int:
    with grpc.insecure_channel(target, options=list(options)) as ch:
        stub: Any = health_pb2_grpc.HealthStub(ch)  # grpc_health ships no type stubs for its methods
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return int(reply.status)


def test_a_server_that_answers_late_is_reached_with_the_stubs_options(slow_socket: str) -> None:
    # a generous deadline: the answer comes about HANDSHAKE_DELAY_S in, later on a loaded machine
    assert _check(slow_socket, RECONNECT_OPTIONS, timeout_s=30.0) == health_pb2.HealthCheckResponse.SERVING


def test_a_connect_timeout_under_the_servers_delay_would_never_reach_it(slow_socket: str) -> None:
    # what the stub's options did before: gRPC core takes min_reconnect_backoff_ms as the time a
    # connection attempt may take, so every attempt ends before the late server's first frame
    too_short = (*RECONNECT_OPTIONS, ("grpc.min_reconnect_backoff_ms", 100))
    with pytest.raises(grpc.RpcError) as err:
        _check(slow_socket, too_short)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
