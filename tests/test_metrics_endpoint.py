"""The /metrics endpoint against callers that connect and say nothing: any local user may reach it
(127.0.0.1 by default). prometheus_client's own server gave each connection a thread that waited for
its request without end; the daemon's (`MetricsServer`) closes a connection silent for its idle
timeout, serves at most `max_connections` at once and closes the rest at accept, and writes nothing
to stderr (the daemon's JSON log) for either."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge

from vgpu.daemon.metrics import DaemonMetrics, MetricsServer, start_metrics_server


def _scrape(port: int) -> str:
    body: bytes = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return body.decode()


def _closed_by_server(conn: socket.socket, within_s: float) -> bool:
    conn.settimeout(within_s)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_silent_connections_are_bounded_closed_and_not_printed(capfd: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    Gauge("vgpu_test_up", "up", registry=registry).set(1)
    threads_before = threading.active_count()
    server = start_metrics_server("127.0.0.1", 0, registry, idle_timeout_s=3.0, max_connections=4)
    port = server.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(10)]
    try:
        deadline = time.monotonic() + 5
        while server.refused < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.refused >= 6  # beyond the 4 served at once: closed at accept
        assert threading.active_count() <= threads_before + 1 + 4  # the server's thread and one per slot
        assert all(_closed_by_server(c, 5.0) for c in idle)  # the silent ones time out
        assert "vgpu_test_up 1.0" in _scrape(port)  # slots free again: a scrape is served
        assert server.failed >= 4
    finally:
        for c in idle:
            c.close()
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        MetricsServer(("127.0.0.1", 0), idle_timeout_s=0)
    with pytest.raises(ValueError):
        MetricsServer(("127.0.0.1", 0), max_connections=0)
    with pytest.raises(ValueError):
        MetricsServer(("127.0.0.1", 0), request_deadline_s=0)


def test_a_request_dribbled_past_its_deadline_is_closed_and_scrapes_go_on() -> None:
    """Each byte within the idle timeout, but the request never finished: the per-read timeout
    alone would keep the slot for good. Closed at the request deadline from accept, the slots free
    again, and a scrape is served."""
    registry = CollectorRegistry()
    Gauge("vgpu_test_up", "up", registry=registry).set(1)
    deadline_s = 2.0
    server = start_metrics_server("127.0.0.1", 0, registry, idle_timeout_s=5.0, request_deadline_s=deadline_s,
                                  max_connections=2)
    port = server.server_address[1]
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    closed_after_s: list[float | None] = [None, None]

    def dribble(i: int) -> None:
        start = time.monotonic()
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
            try:
                slow[i].sendall(bytes([byte]))
            except OSError:
                break
            slow[i].settimeout(1.0)
            try:
                if slow[i].recv(1) == b"":  # closed by the server
                    break
            except TimeoutError:
                continue  # a second with no answer: the next byte
            except OSError:
                break
        closed_after_s[i] = time.monotonic() - start

    try:
        threads = [threading.Thread(target=dribble, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        with pytest.raises(OSError):  # both slots taken: a scrape is refused meanwhile
            _scrape(port)
        for t in threads:
            t.join(timeout=15)
        # about 30 bytes at one a second would take 30 s: closed at the deadline instead
        assert all(s is not None and s < deadline_s + 1.5 for s in closed_after_s), closed_after_s
        assert "vgpu_test_up 1.0" in _scrape(port)
        assert server.failed >= 2
    finally:
        for c in slow:
            c.close()
        server.shutdown()
        server.server_close()


def test_refused_and_failed_connections_are_counted_in_the_registry() -> None:
    """`vgpu_metrics_connections_{refused,failed}_total` read the endpoint's counts at each scrape:
    0 before anything, then one refused at accept and one closed silent."""
    registry = CollectorRegistry()
    metrics = DaemonMetrics(registry)

    def value(name: str) -> float | None:
        return registry.get_sample_value(name)

    assert value("vgpu_metrics_connections_refused_total") == 0
    assert value("vgpu_history_write_failures_total") == 0
    server = start_metrics_server("127.0.0.1", 0, registry, idle_timeout_s=1.0, max_connections=1)
    metrics.watch_endpoint(server)
    port = server.server_address[1]
    conns = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        assert all(_closed_by_server(c, 5.0) for c in conns)
        deadline = time.monotonic() + 5
        while server.failed < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert value("vgpu_metrics_connections_refused_total") == 1
        assert value("vgpu_metrics_connections_failed_total") == 1
        assert "vgpu_metrics_connections_refused_total 1.0" in _scrape(port)
    finally:
        for c in conns:
            c.close()
        server.shutdown()
        server.server_close()


def test_history_counts_are_read_at_each_scrape() -> None:
    class History:
        rows_refused = 0
        write_failures = 0

    registry = CollectorRegistry()
    history = History()
    DaemonMetrics(registry).watch_history(history)
    history.rows_refused, history.write_failures = 3, 2
    assert registry.get_sample_value("vgpu_history_rows_refused_total") == 3
    assert registry.get_sample_value("vgpu_history_write_failures_total") == 2
