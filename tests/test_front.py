"""The Unix socket's front (vgpu/daemon/front.py) in process, over plain sockets: the caller's
credentials reach the upstream as the peer's address, bytes pass both ways, end-of-file is passed
on, a side that does not read holds back the other (at most one chunk buffered), a side that goes
away closes the link, and connections are bounded per uid with one log record per interval."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vgpu.daemon.front import PeerFront
from vgpu.peers import PeerCred, RelayNames, fits_sun_path, relay_names


@dataclass
class Rig:
    front: PeerFront
    public: Path
    names: RelayNames
    private: Path
    accepted: list[socket.socket]
    refused: list[str]
    records: list[dict[str, object]]
    clock: list[float]

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(self.public))
        return s

    def upstream(self, n: int = 1, timeout_s: float = 10.0) -> socket.socket:
        """The n-th connection the upstream accepted, once it has."""
        deadline = time.monotonic() + timeout_s
        while len(self.accepted) < n:
            assert time.monotonic() < deadline, "the front did not connect upstream"
            time.sleep(0.01)
        return self.accepted[n - 1]


class _Records:
    def __init__(self, out: list[dict[str, object]]) -> None:
        self.out = out

    def _add(self, event: str, *_a: object, **kw: object) -> None:
        self.out.append({"event": event, **kw})

    debug = info = warning = error = _add


def _wait(what: str, check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def _rig(tmp_path: Path, private_dir: Path | None = None, **kw: object) -> Iterator[Rig]:
    private = private_dir or tmp_path / "front"
    private.mkdir(mode=0o700, parents=True)
    fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY)
    names = relay_names(private, fd)
    upstream_path = f"{names.directory}/up.sock"
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    up.bind(upstream_path)
    up.listen(64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = up.accept()
            except OSError:
                return
            conn.settimeout(10)
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    public = tmp_path / "pub.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(public))
    refused: list[str] = []
    records: list[dict[str, object]] = []
    clock = [1000.0]
    opts: dict[str, object] = {"max_connections": 64, "max_per_uid": 64, "on_refused": refused.append,
                               "logger": _Records(records), "clock": lambda: clock[0], **kw}
    front = PeerFront(listener, upstream_path, names, **opts)  # type: ignore[arg-type]
    front.start()
    try:
        yield Rig(front, public, names, private, accepted, refused, records, clock)
        failures = [r for r in records if str(r["event"]).startswith("front_")]
        assert not failures and (front.running or front._stopped), failures
    finally:
        front.stop()
        up.close()
        for s in accepted:
            s.close()
        os.close(fd)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with _rig(tmp_path) as r:
        yield r


def test_the_upstream_sees_the_callers_credentials_and_no_name_is_left_behind(rig: Rig) -> None:
    c = rig.connect()
    u = rig.upstream()
    # the kernel's record of who connected, in the address of the socket that reached the upstream
    peer = u.getpeername()
    assert rig.names.peer(f"unix:{peer}") == PeerCred(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    # the name was unlinked right after the connect: the address stays with the socket, no file piles up
    _wait("the name to be unlinked", lambda: sorted(os.listdir(rig.private)) == ["up.sock"])
    assert rig.names.peer(f"unix:{u.getpeername()}") is not None
    c.close()


def test_names_outside_the_relay_directory_carry_no_credentials(rig: Rig) -> None:
    good = rig.names.path(PeerCred(pid=42, uid=1000, gid=100), 7)
    assert rig.names.peer(f"unix:{good}") == PeerCred(pid=42, uid=1000, gid=100)
    for forged in ("unix:", "unix:/tmp/1000-100-42-7", f"unix:{rig.names.directory}/x/1000-100-42-7",
                   f"unix:{rig.names.directory}/1000-100-42", f"unix:{rig.names.directory}/1000-100-42-7 ",
                   f"unix:{rig.names.directory}/99999999999-1-1-1", "ipv4:127.0.0.1:5000", f"unix:{good}/.."):
        assert rig.names.peer(forged) is None, forged


def test_bytes_pass_both_ways_intact(rig: Rig) -> None:
    c = rig.connect()
    u = rig.upstream()
    payload = os.urandom(3 * 1024 * 1024 + 17)  # many chunks, one odd
    got = bytearray()

    def read_all(s: socket.socket, n: int) -> None:
        while len(got) < n:
            got.extend(s.recv(1 << 20))

    for sender, receiver in ((c, u), (u, c)):  # caller to gRPC, then back
        got.clear()
        reader = threading.Thread(target=read_all, args=(receiver, len(payload)))
        reader.start()
        sender.sendall(payload)
        reader.join(30)
        assert bytes(got) == payload
    c.close()


def test_a_half_close_is_passed_on_and_the_other_direction_goes_on(rig: Rig) -> None:
    c = rig.connect()
    u = rig.upstream()
    c.sendall(b"request")
    c.shutdown(socket.SHUT_WR)
    assert u.recv(100) == b"request"
    assert u.recv(100) == b""  # end-of-file reached the upstream
    u.sendall(b"reply")  # the other direction is still open
    assert c.recv(100) == b"reply"
    u.close()
    assert c.recv(100) == b""
    _wait("the link to close", lambda: rig.front.open_connections == 0)


@pytest.mark.parametrize("who", ["caller", "upstream"])
def test_a_side_that_goes_away_closes_the_link(rig: Rig, who: str) -> None:
    c = rig.connect()
    u = rig.upstream()
    gone, stays = (c, u) if who == "caller" else (u, c)
    gone.sendall(b"last words")
    gone.close()
    data = b""
    while chunk := stays.recv(100):  # what it sent still arrives, then end-of-file
        data += chunk
    assert data == b"last words"
    _wait("the link to close", lambda: rig.front.open_connections == 0)


def test_a_caller_that_does_not_read_holds_the_upstream_back(rig: Rig) -> None:
    c = rig.connect()
    u = rig.upstream()
    u.setblocking(False)
    sent = 0
    block = b"x" * 65536
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # write until the kernel and the front stop taking more
        try:
            sent += u.send(block)
        except BlockingIOError:
            time.sleep(0.05)
    # what the front holds is at most one chunk: the rest waits in the sockets' kernel buffers
    buffered = sum(len(e.out) for link in rig.front._links for e in (link.client, link.upstream))
    assert buffered <= 64 * 1024
    assert sent < 16 * 1024 * 1024  # far from unbounded: the upstream was held back
    c.setblocking(False)
    received = 0
    u.setblocking(True)
    deadline = time.monotonic() + 30  # ends when all of it came through
    while received < sent and time.monotonic() < deadline:
        try:
            received += len(c.recv(1 << 20))
        except BlockingIOError:
            time.sleep(0.01)
    assert received == sent  # and nothing was lost
    c.close()


def test_connections_beyond_the_per_uid_bound_are_refused_and_logged_once_per_interval(tmp_path: Path) -> None:
    with _rig(tmp_path, max_per_uid=3, exempt_uids=frozenset(), log_interval_s=60.0) as rig:
        held = [rig.connect() for _ in range(3)]
        rig.upstream(3)
        extra = [rig.connect() for _ in range(4)]
        for s in extra:
            assert s.recv(10) == b""  # closed at once
        assert rig.refused == ["max_connections_per_uid"] * 4
        refusals = [r for r in rig.records if r["event"] == "connection_refused"]
        assert len(refusals) == 1  # one record, not one per connection
        assert refusals[0]["uid"] == os.getuid() and refusals[0]["bound"] == 3 and refusals[0]["open_for_uid"] == 3
        assert rig.front.open_for_uid(os.getuid()) == 3
        # a connection opened before keeps working
        held[0].sendall(b"still here")
        assert rig.upstream(1).recv(100) == b"still here"
        # after the interval, the next refusal is logged with how many went unlogged
        rig.clock[0] += 61.0
        assert rig.connect().recv(10) == b""
        refusals = [r for r in rig.records if r["event"] == "connection_refused"]
        assert len(refusals) == 2 and refusals[1]["refused_since_last_record"] == 3
        # one closes: there is room again
        held[0].close()
        _wait("the count to drop", lambda: rig.front.open_for_uid(os.getuid()) == 2)
        again = rig.connect()
        rig.upstream(4)
        again.sendall(b"in")
        assert rig.upstream(4).recv(10) == b"in"
        for s in [*held, again]:
            s.close()


def test_an_exempt_uid_is_bounded_by_the_total_only(tmp_path: Path) -> None:
    with _rig(tmp_path, max_per_uid=1, max_connections=3, exempt_uids=frozenset({os.getuid()})) as rig:
        held = [rig.connect() for _ in range(3)]
        rig.upstream(3)
        assert rig.connect().recv(10) == b""
        assert rig.refused == ["max_connections"]
        for s in held:
            s.close()


def test_a_long_directory_is_spelled_through_the_descriptor(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    assert not fits_sun_path(str(deep / "up.sock"))
    with _rig(tmp_path, private_dir=deep) as rig:
        assert rig.names.directory.startswith("/proc/self/fd/")
        c = rig.connect()
        u = rig.upstream()
        assert rig.names.peer(f"unix:{u.getpeername()}") == PeerCred(os.getpid(), os.getuid(), os.getgid())
        c.sendall(b"ok")
        assert u.recv(10) == b"ok"
        c.close()


def test_stop_closes_everything_and_ends_the_thread(tmp_path: Path) -> None:
    with _rig(tmp_path) as rig:
        c = rig.connect()
        u = rig.upstream()
        c.sendall(b"spoke")
        assert u.recv(100) == b"spoke"
        silent = rig.connect()
        rig.upstream(2)
        rig.front.stop_accepting()
        with pytest.raises(OSError):
            rig.connect()  # nobody listens
        # one that never sent a byte carries no call: closed at once, so gRPC's stop need not wait for it
        silent.settimeout(5)
        assert silent.recv(10) == b""
        c.sendall(b"still relayed")
        assert u.recv(100) == b"still relayed"
        rig.front.stop()
        assert not rig.front.running
        assert c.recv(10) == b""
        assert not any(t.name == "vgpu-front" for t in threading.enumerate())
        rig.front.stop()  # idempotent
