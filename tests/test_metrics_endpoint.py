"""The /metrics endpoint against callers that connect and say nothing: any local user may reach it
(127.0.0.1 by default). prometheus_client's own server gave each connection a thread that waited for
its request without end; the daemon's (`MetricsServer`) closes a connection silent for its idle
timeout, serves at most `max_connections` at once and closes the rest at accept, and writes nothing
to stderr (the daemon's JSON log) for either. One peer holds at most `max_per_address` of the
connections: a caller reconnecting all the time from one address once held most of the slots, and a
scrape from elsewhere was refused. A peer is the caller's address (an IPv4-mapped form counting as its
IPv4 address); on loopback, where any local user may use any address, it is the user owning the
caller's socket, read from the kernel (sock_diag), or one shared peer when that cannot be read."""

from __future__ import annotations

import functools
import http.client
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from daemon_fixtures import Env, Serve, make_env, metric_samples, wait_for
from prometheus_client import CollectorRegistry, Gauge
from structlog.testing import capture_logs

from vgpu import __version__
from vgpu.daemon.metrics import (
    LOOPBACK_PEER,
    DaemonMetrics,
    MetricsServer,
    peer_of,
    start_metrics_server,
    uid_peer,
)
from vgpu.daemon.sockdiag import PeerUidUnknown, SocketOwner, parse_reply, tcp_socket_owner
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
        deadline = time.monotonic() + 30
        while server.refused < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.refused >= 6  # beyond the 4 served at once: closed at accept
        assert threading.active_count() <= threads_before + 1 + 4  # the server's thread and one per slot
        assert all(_closed_by_server(c, 15.0) for c in idle)  # the silent ones time out (3 s), not never
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
        # about 30 bytes at one a second would take 30 s: closed at the deadline instead (the
        # margin is for a loaded machine's scheduling, far short of the dribble's own length)
        assert all(s is not None and s < deadline_s + 3 for s in closed_after_s), closed_after_s
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
        assert all(_closed_by_server(c, 15.0) for c in conns)
        deadline = time.monotonic() + 30
        while server.failed < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused("max_connections") == 1 and refused("max_connections_per_address") == 0
        assert value("vgpu_metrics_connections_failed_total") == 1
        # the handler thread counts the failure before it gives the one slot back: a scrape sent
        # between the two would be refused
        wait_for("the slot given back", lambda: server.open_connections == 0, timeout_s=30)
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


@functools.cache
def _sock_diag_missing() -> str | None:
    """Why the kernel cannot say who owns a loopback connection's far end here; None if it can."""
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname(), timeout=5) as conn:
        accepted, _ = listener.accept()
        with accepted:
            try:
                tcp_socket_owner(conn.getsockname(), listener.getsockname())
            except PeerUidUnknown as exc:
                return f"no sock_diag lookup here: {exc}"
    return None


def _my_peer() -> str:
    """The peer this test process's loopback connections count against."""
    return uid_peer(os.getuid()) if _sock_diag_missing() is None else LOOPBACK_PEER


def test_an_address_beyond_its_share_is_refused_counted_and_logged_while_slots_are_free() -> None:
    """Two connections from 127.0.0.1 hold this user's share of 2 (of 8 in all): a third from it is
    closed at accept, and so is one from 127.0.0.2 (a local caller may pick any loopback address,
    and it is the same user, so they are one peer); each is counted under its own reason and logged with its address, within
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
                ("127.0.0.1", _my_peer(), "max_connections_per_address"),
                ("127.0.0.2", _my_peer(), "max_connections_per_address")], records
            assert records[0]["bound"] == 2 and records[0]["open_for_peer"] == 2 and records[0]["log_level"] == "warning"
        finally:
            for c in held + beyond:
                c.close()
        wait_for("their slots given back", lambda: server.open_connections == 0, timeout_s=30)
        assert "vgpu_test_up 1.0" in _scrape_from("127.0.0.1", port, "127.0.0.1")


def test_ipv4_loopback_on_a_dual_stack_endpoint_counts_with_ipv6_loopback() -> None:
    """On a listener bound to `::` an IPv4 caller arrives as ::ffff:127.0.0.1, which Python does not
    call loopback: unmapped first, 127.0.0.1, 127.0.0.2 and ::1 are one peer, so a caller cannot
    step past its share by switching family or loopback address."""
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


@contextmanager
def _notify_socket(path: Path) -> Iterator[socket.socket]:
    """A datagram socket at `path` for a daemon's NOTIFY_SOCKET, one per daemon: the watchdog pings
    of one would fill the queue another's READY=1 has to get into."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(10)
    try:
        yield listener
    finally:
        listener.close()


def _ready_status(listener: socket.socket) -> str:
    """The STATUS line of the READY=1 message a daemon sent to its NOTIFY_SOCKET (the first it sends)."""
    message = listener.recv(4096).decode()
    assert message.startswith("READY=1"), message
    return next(line for line in message.splitlines() if line.startswith("STATUS="))


def test_auto_binds_a_port_the_kernel_picks_and_the_daemon_names_it(tmp_path: Path, serves: list[Serve]) -> None:
    """`--metrics-port auto`: each daemon binds a free port at once (two on one host get two ports,
    so nothing has to hand ports out between choosing and binding), and says which in its `serving`
    record and in the STATUS systemd shows; the scrape is served there. `--metrics-port 0` is still
    off: `serving` has no address and STATUS no metrics."""
    envs = []
    for name in ("a", "b", "off"):
        (tmp_path / name).mkdir()
        envs.append(make_env(tmp_path / name))
    with _notify_socket(tmp_path / "a.notify") as notify_a, _notify_socket(tmp_path / "off.notify") as notify_off:
        serves.append(Serve(envs[0], "--metrics-port", "auto", notify=tmp_path / "a.notify"))
        status_a = _ready_status(notify_a)
        serves.append(Serve(envs[1], "--metrics-port", "auto"))
        a, b = serves[0].metrics_port, serves[1].metrics_port
        assert a != b and 0 not in (a, b) and serves[0].event("serving")["metrics"] == f"127.0.0.1:{a}"
        assert status_a == f"STATUS=serving on {envs[0].sock}, metrics on http://127.0.0.1:{a}/metrics"
        for port in (a, b):
            assert metric_samples(port)[("vgpu_build_info", (("backend", "sim:h100-80gb"),
                                         ("python", platform.python_version()), ("version", __version__)))] == 1
        serves.append(Serve(envs[2], notify=tmp_path / "off.notify"))  # the fixture's --metrics-port 0
        assert serves[2].event("serving")["metrics"] is None
        assert _ready_status(notify_off) == f"STATUS=serving on {envs[2].sock}"


def test_the_daemon_bounds_one_address_by_its_setting(env: Env, serves: list[Serve]) -> None:
    """`vgpu serve` with metrics.max_connections_per_address 2 (from the environment): a third
    connection from loopback is closed at accept, counted under its reason on the scrape, and
    logged with the address in the daemon's JSON log."""
    env.env["VGPU_METRICS_MAX_CONNECTIONS_PER_ADDRESS"] = "2"
    daemon = Serve(env, "--metrics-port", "auto")
    serves.append(daemon)
    port = daemon.metrics_port
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
    assert record["peer"] == _my_peer(), record  # this test's user, as the daemon read it from the kernel


# --- loopback: one share per local user ------------------------------------------------------------

def _scrape_over(conn: socket.socket) -> bytes:
    """The answer to GET /metrics sent on an open connection, read to its end."""
    conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_loopback_caller_counts_as_the_user_owning_its_socket() -> None:
    """The kernel's answer for a loopback connection is the caller's socket (its inode, not the
    endpoint's end of it) and this process's uid; the endpoint counts the caller under `uid:<uid>`,
    whichever loopback address it comes from."""
    missing = _sock_diag_missing()
    if missing is not None:
        pytest.skip(missing)
    with capture_logs() as logs, _endpoint("127.0.0.1", idle_timeout_s=5.0, max_connections=8,
                                           max_per_address=1) as (server, registry):
        port = server.server_address[1]
        held = _connect("127.0.0.1", port, "127.0.0.1")
        beyond = _connect("127.0.0.1", port, "127.0.0.5")
        try:
            owner = tcp_socket_owner(held.getsockname(), ("127.0.0.1", port))
            assert owner == SocketOwner(uid=os.getuid(), inode=os.fstat(held.fileno()).st_ino)
            assert _closed_by_server(beyond, 2.0)
            assert not _closed_by_server(held, 0.2)
            records = [e for e in logs if e["event"] == "metrics_connection_refused"]
            assert [(e["address"], e["peer"]) for e in records] == [("127.0.0.5", f"uid:{os.getuid()}")], records
            assert not [e for e in logs if e["event"] == "metrics_peer_uid_unknown"]
            assert set(server.peer_uid_unknown.values()) == {0}
        finally:
            held.close()
            beyond.close()


def test_the_kernel_lookup_says_gone_or_error_rather_than_guess() -> None:
    """A connection whose caller closed its socket (the kernel keeps it, with no owner, and a
    TIME_WAIT entry would read uid 0) and one that never existed are `gone`; a reply that is not for
    the request is an `error`. Each is a refusal to name a user, never a wrong one."""
    missing = _sock_diag_missing()
    if missing is not None:
        pytest.skip(missing)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn = socket.create_connection(listener.getsockname(), timeout=5)
        accepted, _ = listener.accept()
        with accepted:
            mine = conn.getsockname()
            conn.close()
            with pytest.raises(PeerUidUnknown) as closed:
                tcp_socket_owner(mine, listener.getsockname())
            assert closed.value.reason == "gone"
        with pytest.raises(PeerUidUnknown) as never:
            tcp_socket_owner(("127.0.0.1", 1), listener.getsockname())
        assert never.value.reason == "gone"
    for data in (b"", b"\0" * 8, b"\x10\0\0\0\x02\0\0\0\x07\0\0\0\0\0\0\0"):  # short; truncated error
        with pytest.raises(PeerUidUnknown) as bad:
            parse_reply(data, 7, 1000, 2000)
        assert bad.value.reason == "error"


def _diag_reply(*, seq: int = 7, kind: int = 20, sport: int = 1000, dport: int = 2000, uid: int = 1001,
                inode: int = 4242, length: int | None = None, error: int | None = None) -> bytes:
    """A NETLINK_SOCK_DIAG reply as the kernel lays it out (nlmsghdr, then inet_diag_msg or nlmsgerr)."""
    if error is not None:
        body = struct.pack("=i", -error) + b"\0" * 16
        kind = 2
    else:
        body = (struct.pack("=BBBB", socket.AF_INET, 1, 0, 0)
                + struct.pack(">HH16s16s", sport, dport, bytes(16), bytes(16))
                + struct.pack("=III", 0, 0, 0) + struct.pack("=IIIII", 0, 0, 0, uid, inode))
    return struct.pack("=IHHII", 16 + len(body) if length is None else length, kind, 0, seq, 0) + body


@pytest.mark.parametrize(("reply", "reason"), [
    (_diag_reply(seq=8), "error"),  # an answer to another request
    (_diag_reply(sport=1001), "error"),  # about another connection
    (_diag_reply(dport=2001), "error"),
    (_diag_reply(kind=3), "error"),  # NLMSG_DONE, not an answer
    (_diag_reply(length=16 + 71), "error"),  # says it is shorter than an inet_diag_msg
    (_diag_reply(length=16 + 73), "error"),  # says it is longer than what came
    (_diag_reply(error=2), "gone"),  # ENOENT: no such connection
    (_diag_reply(error=13), "error"),
    (_diag_reply(inode=0), "gone"),  # closed: no process holds it (TIME_WAIT reads uid 0)
], ids=["seq", "sport", "dport", "type", "short", "long", "enoent", "eacces", "inode0"])
def test_a_kernel_reply_not_for_the_connection_asked_about_names_no_user(reply: bytes, reason: str) -> None:
    """Each check `parse_reply` makes on what came back, one at a time: a reply that fails one names
    nobody, whatever uid it carries; the same reply with every check met names its uid."""
    assert parse_reply(_diag_reply(), 7, 1000, 2000) == SocketOwner(uid=1001, inode=4242)
    with pytest.raises(PeerUidUnknown) as exc:
        parse_reply(reply, 7, 1000, 2000)
    assert exc.value.reason == reason


class _FailingLookup:
    def __init__(self, exc: Exception) -> None:
        self.exc, self.calls = exc, 0

    def __call__(self, peer: tuple[str, int], local: tuple[str, int]) -> int:
        self.calls += 1
        raise self.exc


@pytest.mark.parametrize(("exc", "reason"), [
    (PeerUidUnknown("unsupported", "no netlink sockets on this system"), "unsupported"),
    (PeerUidUnknown("gone", "no such connection"), "gone"),
    (OSError(24, "Too many open files"), "error"),
])
def test_loopback_callers_whose_user_cannot_be_read_share_one_peer(exc: Exception, reason: str) -> None:
    """When the lookup fails, every loopback caller counts against `loopback`: the bound still holds
    (one share for all of them, as before per-user counting), the failure is counted by reason and
    logged once, not once per connection."""
    lookup = _FailingLookup(exc)
    with capture_logs() as logs, _endpoint("127.0.0.1", idle_timeout_s=5.0, max_connections=8, max_per_address=1,
                                           peer_uid=lookup) as (server, registry):
        port = server.server_address[1]
        held = _connect("127.0.0.1", port, "127.0.0.1")
        beyond = [_connect("127.0.0.1", port, "127.0.0.2"), _connect("127.0.0.1", port, "127.0.0.3")]
        try:
            assert all(_closed_by_server(c, 2.0) for c in beyond)
            assert not _closed_by_server(held, 0.2)
            assert lookup.calls == 3
            assert server.peer_uid_unknown[reason] == 3, server.peer_uid_unknown
            refused = [e for e in logs if e["event"] == "metrics_connection_refused"]
            assert [e["peer"] for e in refused] == [LOOPBACK_PEER, LOOPBACK_PEER], refused
            unknown = [e for e in logs if e["event"] == "metrics_peer_uid_unknown"]
            assert [(e["reason"], e["address"]) for e in unknown] == [(reason, "127.0.0.1")], unknown
        finally:
            held.close()
            for c in beyond:
                c.close()


def test_one_local_user_at_its_share_does_not_lock_out_another() -> None:
    """Two users on loopback (a fake lookup names the user by the caller's source port): user 1001
    holds its share of 2, from two loopback addresses, and its third connection is refused, while a
    scrape by user 1002 is served. Counted by address, the scrape was refused: all of them are
    loopback."""
    uids: dict[int, int] = {}

    def lookup(peer: tuple[str, int], local: tuple[str, int]) -> int:
        if peer[1] not in uids:
            raise PeerUidUnknown("gone", "not a connection of this test")
        return uids[peer[1]]

    with _endpoint("127.0.0.1", idle_timeout_s=5.0, max_connections=8, max_per_address=2,
                   peer_uid=lookup) as (server, registry):
        port = server.server_address[1]

        def connect_as(uid: int, source: str) -> socket.socket:
            conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            conn.settimeout(5)
            conn.bind((source, 0))
            uids[conn.getsockname()[1]] = uid  # known before the endpoint can accept it
            conn.connect(("127.0.0.1", port))
            return conn

        held = [connect_as(1001, "127.0.0.1"), connect_as(1001, "127.0.0.2")]
        beyond = connect_as(1001, "127.0.0.3")
        other = connect_as(1002, "127.0.0.1")
        try:
            assert _closed_by_server(beyond, 2.0)
            assert b"vgpu_test_up 1.0" in _scrape_over(other)
            assert not any(_closed_by_server(c, 0.2) for c in held)
            assert registry.get_sample_value("vgpu_metrics_connections_refused_total",
                                             {"reason": "max_connections_per_address"}) == 1
            assert set(server.peer_uid_unknown.values()) == {0}
        finally:
            for c in [*held, beyond, other]:
                c.close()


_AS_ANOTHER_USER = """
import json, socket, sys
port = int(sys.argv[1])
conns = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
closed = []
for c in conns:
    c.settimeout(1.0)
    try:
        closed.append(c.recv(1) == b"")
    except TimeoutError:
        closed.append(False)
    except ConnectionResetError:
        closed.append(True)
print(json.dumps(closed), flush=True)
sys.stdin.read()
"""


def _start_as_nobody(args: list[str]) -> subprocess.Popen[str]:
    """`python -I -c *args` as uid and gid 65534, with an interpreter that user may run (this one
    may sit under a directory only root can read); skips the test if there is none."""
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            return subprocess.Popen([python, "-I", "-c", *args], user=65534, group=65534, extra_groups=[],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        except (PermissionError, FileNotFoundError):
            continue
    pytest.skip("no Python interpreter that uid 65534 may run")


def test_a_real_second_user_at_its_share_does_not_lock_out_this_one() -> None:
    """With real users and the kernel's own answer: a process running as `nobody` (65534) opens 3
    connections with a share of 2 and its third is refused; meanwhile a scrape by this process's
    user, from the same loopback address, is served. Needs root to start the other user's process."""
    missing = _sock_diag_missing()
    if missing is not None:
        pytest.skip(missing)
    if os.geteuid() != 0 or os.getuid() == 65534:
        pytest.skip("starting a process as another user needs root")
    with capture_logs() as logs, _endpoint("127.0.0.1", idle_timeout_s=5.0, max_connections=8,
                                           max_per_address=2) as (server, registry):
        port = server.server_address[1]
        child = _start_as_nobody([_AS_ANOTHER_USER, str(port)])
        try:
            assert child.stdout is not None and child.stdin is not None
            closed = json.loads(child.stdout.readline())
            assert closed == [False, False, True], closed
            assert "vgpu_test_up 1.0" in _scrape_from("127.0.0.1", port, "127.0.0.1")
            refused = [e for e in logs if e["event"] == "metrics_connection_refused"]
            assert [e["peer"] for e in refused] == [uid_peer(65534)], refused
        finally:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=10)
