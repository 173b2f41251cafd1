"""The /metrics endpoint against callers that connect and say nothing: any local user may reach it
(127.0.0.1 by default). prometheus_client's own server gave each connection a thread that waited for
its request without end; the daemon's (`MetricsServer`) closes a connection silent for its idle
timeout, serves at most `max_connections` at once and closes the rest at accept, and writes nothing
to stderr (the daemon's JSON log) for either. One peer address holds at most `max_per_address` of the
connections (every loopback address and the IPv4-mapped forms counting as one): a caller reconnecting
all the time from one address once held most of the slots, and a scrape from elsewhere was refused."""

from __future__ import annotations

import http.client
import ipaddress
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
from daemon_fixtures import Env, Serve, free_port, metric_samples, wait_for
from prometheus_client import CollectorRegistry, Gauge
from structlog.testing import capture_logs

from vgpu.daemon.metrics import LOOPBACK_PEER, DaemonMetrics, MetricsServer, peer_of, start_metrics_server
from vgpu.log import LogBudget


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
    with pytest.raises(ValueError):
        MetricsServer(("127.0.0.1", 0), max_per_address=0)


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

    def refused(reason: str) -> float | None:
        return registry.get_sample_value("vgpu_metrics_connections_refused_total", {"reason": reason})

    assert refused("max_connections") == 0 and refused("max_connections_per_address") == 0
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
        assert refused("max_connections") == 1 and refused("max_connections_per_address") == 0
        assert value("vgpu_metrics_connections_failed_total") == 1
        assert 'vgpu_metrics_connections_refused_total{reason="max_connections"} 1.0' in _scrape(port)
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


# --- one address's share ---------------------------------------------------------------------------

def _connect(host: str, port: int, source: str) -> socket.socket:
    """A connection to host:port from the address `source` (a loopback or local address)."""
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    conn = socket.socket(family, socket.SOCK_STREAM)
    conn.settimeout(5)
    conn.bind((source, 0))
    conn.connect((host, port))
    return conn


def _scrape_from(host: str, port: int, source: str) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=5, source_address=(source, 0))
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


@contextmanager
def _endpoint(address: str, **kw: object) -> Iterator[tuple[MetricsServer, CollectorRegistry]]:
    registry = CollectorRegistry()
    Gauge("vgpu_test_up", "up", registry=registry).set(1)
    metrics = DaemonMetrics(registry)
    server = start_metrics_server(address, 0, registry, **kw)  # type: ignore[arg-type]
    metrics.watch_endpoint(server)
    try:
        yield server, registry
    finally:
        server.shutdown()
        server.server_close()


def _local_address(family: socket.AddressFamily) -> str | None:
    """An address of this host that is not loopback nor link-local, in `family`; None if it has none."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family != family:
                continue
            ip = ipaddress.ip_address(a.address.split("%", 1)[0])
            if not (ip.is_loopback or ip.is_link_local):
                return str(ip)
    return None


def test_an_address_beyond_its_share_is_refused_counted_and_logged_while_slots_are_free() -> None:
    """Two connections from 127.0.0.1 hold loopback's share of 2 (of 8 in all): a third from it is
    closed at accept, and so is one from 127.0.0.2 (a local caller may pick any loopback address,
    so they are one peer); each is counted under its own reason and logged with its address, within
    the log budget. Once the two holders close, loopback is served again."""
    with capture_logs() as logs, _endpoint("127.0.0.1", idle_timeout_s=5.0, max_connections=8, max_per_address=2,
                                           log_budget=LogBudget(interval_s=3600, burst=2)) as (server, registry):
        port = server.server_address[1]
        held = [_connect("127.0.0.1", port, "127.0.0.1") for _ in range(2)]
        beyond = [_connect("127.0.0.1", port, "127.0.0.1"), _connect("127.0.0.1", port, "127.0.0.2"),
                  _connect("127.0.0.1", port, "127.0.0.3")]
        try:
            # refused at once, well inside the 5 s idle timeout that would close them otherwise
            assert all(_closed_by_server(c, 2.0) for c in beyond)
            assert not any(_closed_by_server(c, 0.2) for c in held)  # the share itself is served
            by_reason = {r: registry.get_sample_value("vgpu_metrics_connections_refused_total", {"reason": r})
                         for r in ("max_connections", "max_connections_per_address")}
            assert by_reason == {"max_connections": 0, "max_connections_per_address": 3}, by_reason
            records = [e for e in logs if e["event"] == "metrics_connection_refused"]
            # the budget's 2 records for the peer; the third refusal is counted, not logged
            assert [(e["address"], e["peer"], e["reason"]) for e in records] == [
                ("127.0.0.1", LOOPBACK_PEER, "max_connections_per_address"),
                ("127.0.0.2", LOOPBACK_PEER, "max_connections_per_address")], records
            assert records[0]["bound"] == 2 and records[0]["open_for_peer"] == 2 and records[0]["log_level"] == "warning"
        finally:
            for c in held + beyond:
                c.close()
        wait_for("their slots given back", lambda: server.open_connections == 0, timeout_s=5)
        assert "vgpu_test_up 1.0" in _scrape_from("127.0.0.1", port, "127.0.0.1")


def test_a_scrape_from_another_address_is_served_while_one_holds_its_share() -> None:
    """A local caller connecting from loopback as fast as it likes holds 3 of the endpoint's 4
    slots and no more; a scrape from another address (this host's own, as a remote Prometheus
    would have its own) is served meanwhile. Without the bound per address the caller took all 4
    and the scrape was refused."""
    other = _local_address(socket.AF_INET)
    if other is None:
        pytest.skip("this host has no IPv4 address besides loopback to scrape from")
    with _endpoint(other, idle_timeout_s=5.0, max_connections=4, max_per_address=3) as (server, registry):
        port = server.server_address[1]
        holder = [_connect(other, port, "127.0.0.1") for _ in range(6)]
        try:
            assert sum(_closed_by_server(c, 1.0) for c in holder) == 3  # the three beyond its share
            assert "vgpu_test_up 1.0" in _scrape_from(other, port, other)
            assert registry.get_sample_value("vgpu_metrics_connections_refused_total",
                                             {"reason": "max_connections_per_address"}) == 3
            # the other address has its own share, as the endpoint's total allows: one more of it is
            # refused for the total (4 served), not for its share
            wait_for("the scrape's slot given back", lambda: server.open_connections == 3, timeout_s=5)
            mine = [_connect(other, port, other), _connect(other, port, other)]
            try:
                assert [_closed_by_server(c, 1.0) for c in mine] == [False, True]
                assert registry.get_sample_value("vgpu_metrics_connections_refused_total",
                                                 {"reason": "max_connections"}) == 1
            finally:
                for c in mine:
                    c.close()
        finally:
            for c in holder:
                c.close()


def test_ipv4_loopback_on_a_dual_stack_endpoint_counts_with_ipv6_loopback() -> None:
    """On a listener bound to `::` an IPv4 caller arrives as ::ffff:127.0.0.1, which Python does not
    call loopback: unmapped first, 127.0.0.1, 127.0.0.2 and ::1 are one peer, so a caller cannot
    step past its share by switching family or loopback address. Another address is still served."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with _endpoint("::", idle_timeout_s=5.0, max_connections=8, max_per_address=2) as (server, registry):
        port = server.server_address[1]
        held = [_connect("::1", port, "::1"), _connect("::1", port, "::1")]
        beyond = [_connect("127.0.0.1", port, "127.0.0.1"), _connect("127.0.0.1", port, "127.0.0.2"),
                  _connect("::1", port, "::1")]
        try:
            assert all(_closed_by_server(c, 2.0) for c in beyond)
            assert registry.get_sample_value("vgpu_metrics_connections_refused_total",
                                             {"reason": "max_connections_per_address"}) == 3
            other = _local_address(socket.AF_INET)
            if other is not None:  # arrives as ::ffff:<other>: its own peer, served
                assert "vgpu_test_up 1.0" in _scrape_from(other, port, other)
        finally:
            for c in held + beyond:
                c.close()


@pytest.mark.parametrize(("host", "peer"), [
    ("127.0.0.1", LOOPBACK_PEER), ("127.45.6.7", LOOPBACK_PEER), ("::1", LOOPBACK_PEER),
    ("::ffff:127.0.0.2", LOOPBACK_PEER), ("192.0.2.7", "192.0.2.7"), ("::ffff:192.0.2.7", "192.0.2.7"),
    ("2001:db8::1", "2001:db8::1"), ("2001:DB8:0::1", "2001:db8::1"), ("fe80::1%eth0", "fe80::1"),
])
def test_the_peer_an_address_counts_against(host: str, peer: str) -> None:
    assert peer_of(host) == peer


def test_the_daemon_bounds_one_address_by_its_setting(env: Env, serves: list[Serve]) -> None:
    """`vgpu serve` with metrics.max_connections_per_address 2 (from the environment): a third
    connection from loopback is closed at accept, counted under its reason on the scrape, and
    logged with the address in the daemon's JSON log."""
    port = free_port()
    env.env["VGPU_METRICS_MAX_CONNECTIONS_PER_ADDRESS"] = "2"
    daemon = Serve(env, "--metrics-port", str(port))
    serves.append(daemon)
    held = [_connect("127.0.0.1", port, "127.0.0.1") for _ in range(2)]
    try:
        third = _connect("127.0.0.1", port, "127.0.0.1")
        try:
            assert _closed_by_server(third, 3.0)
        finally:
            third.close()
    finally:
        for c in held:
            c.close()
    key = ("vgpu_metrics_connections_refused_total", (("reason", "max_connections_per_address"),))

    scrapes_refused = 0
    seen: list[float | None] = []

    def scraped() -> bool:
        nonlocal scrapes_refused
        try:
            seen.append(metric_samples(port).get(key))
            return True
        except OSError:  # the holders' slots not given back yet: this scrape was a third connection
            scrapes_refused += 1
            return False

    wait_for("a scrape once the holders closed", scraped, timeout_s=10)
    assert seen == [1 + scrapes_refused], (seen, scrapes_refused)
    record = daemon.event("metrics_connection_refused")
    assert record["address"] == "127.0.0.1" and record["bound"] == 2, record
