"""The daemon's front on its Unix socket: each caller's credentials, and a bound on connections per uid.

gRPC's Python server hides the Unix-socket peer's credentials, so `vgpu serve` does not let gRPC
listen on the public socket. `PeerFront` does, in one thread:

- it accepts a connection and reads the caller's pid, uid and gid from the kernel (`SO_PEERCRED`);
- it refuses the connection at once (closes it) when the node already holds `max_connections`
  relayed connections, or the caller's uid holds `max_per_uid` (uids in `exempt_uids` are bounded
  only by the total); each refusal is counted (`on_refused(reason)`), and logged at most once per
  uid and reason per `log_interval_s`, with how many were refused since the last record;
- otherwise it opens a connection to gRPC's own socket in the private relay directory from a
  client socket bound to a name that spells the credentials (vgpu/peers.py), unlinks that name at
  once (the kernel keeps the address with the socket, so gRPC still reports it as the peer, and no
  files pile up), and relays bytes both ways.

Relaying is one `epoll` loop over every connection, level-triggered. Backpressure: a side is read
only when what it sent before has been passed on, so at most one chunk (`chunk_bytes`) waits per
direction; a caller that does not read stops gRPC's writes to it through the kernel's socket buffers
and HTTP/2 flow control, as a direct connection would. A side that sends end-of-file (a half-close)
has it passed on (`shutdown(SHUT_WR)`) once its data is; a side that is gone (hang-up: closed, or
both directions shut) has what it sent passed on, and the link then closes, the other side given
at most `linger_s` to take what is still buffered for it. A connection gRPC closes (its handshake
and idle timeouts) is closed to the caller in the same step, so those timeouts still bound idle
callers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vgpu.log import Logger
from vgpu.peers import PeerCred, RelayNames, peer_cred

CHUNK_BYTES = 64 * 1024
LINGER_S = 5.0
LOG_INTERVAL_S = 60.0
# accept() calls per wake-up before the loop serves the connections it holds again
ACCEPT_BATCH = 64
# after accept() fails for want of descriptors (EMFILE, ENFILE), the listener rests this long
ACCEPT_PAUSE_S = 1.0

_IN, _OUT, _HUP, _ERR = select.EPOLLIN, select.EPOLLOUT, select.EPOLLHUP, select.EPOLLERR


@dataclass(eq=False)
class _End:
    """One side of a relayed connection: its socket and what waits to be written to it."""

    sock: socket.socket
    out: bytearray = field(default_factory=bytearray)
    eof_in: bool = False  # it sent end-of-file (or is gone): nothing more will be read from it
    shut_out: bool = False  # end-of-file was passed on to it
    gone: bool = False  # hung up: closed, nothing can be written to it
    mask: int = -1  # what epoll watches it for


@dataclass(eq=False)
class _Link:
    client: _End
    upstream: _End
    cred: PeerCred
    counted_uid: int | None  # the uid whose per-uid count it holds (None: exempt)
    linger_until: float | None = None
    spoke: bool = False  # the client has sent a byte (before that, it can carry no call)

    def other(self, end: _End) -> _End:
        return self.upstream if end is self.client else self.client


class PeerFront:
    """The front (see the module docstring). `start()` runs the relay thread on a listening socket;
    `stop_accepting()` closes the listener and the connections that never sent a byte (the others go
    on, so gRPC can finish in-flight calls); `stop()` closes everything and ends the thread. Counts
    are read from other threads."""

    def __init__(
        self,
        listener: socket.socket,
        upstream_path: str,
        names: RelayNames,
        *,
        max_connections: int,
        max_per_uid: int,
        exempt_uids: frozenset[int] = frozenset({0}),
        on_refused: Callable[[str], None] | None = None,
        logger: Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        chunk_bytes: int = CHUNK_BYTES,
        linger_s: float = LINGER_S,
        log_interval_s: float = LOG_INTERVAL_S,
    ) -> None:
        self._listener: socket.socket | None = listener
        self._upstream_path = upstream_path
        self.names = names
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid
        self.exempt_uids = exempt_uids
        self._on_refused = on_refused
        self._log = logger
        self._clock = clock
        self._chunk = chunk_bytes
        self._linger_s = linger_s
        self._log_interval_s = log_interval_s
        self._ep = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ends: dict[int, tuple[_Link, _End]] = {}
        self._links: set[_Link] = set()
        self._lingering: set[_Link] = set()
        self._per_uid: dict[int, int] = {}
        # (uid, reason) -> (when last logged, refusals since)
        self._refusal_log: dict[tuple[int, str], tuple[float, int]] = {}
        self._serial = 0
        self._accept_paused_until: float | None = None
        self._stop_accepting = threading.Event()
        self._listener_closed = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.refused: dict[str, int] = {}
        self.accepted = 0

    # --- from other threads ---------------------------------------------------------------------------
    @property
    def open_connections(self) -> int:
        return len(self._links)

    def open_for_uid(self, uid: int) -> int:
        return self._per_uid.get(uid, 0)

    def start(self) -> None:
        assert self._listener is not None and self._thread is None
        self._listener.setblocking(False)
        self._listener.listen(socket.SOMAXCONN)
        self._ep.register(self._listener.fileno(), _IN)
        self._ep.register(self._wake_r, _IN)
        self._thread = threading.Thread(target=self._run, name="vgpu-front", daemon=True)
        self._thread.start()

    def stop_accepting(self, timeout_s: float = 5.0) -> None:
        """Close the listener (no new connections) and every connection that has not sent a byte;
        relayed ones that have go on."""
        if self._thread is None or not self._thread.is_alive():
            self._close_listener()
            return
        self._stop_accepting.set()
        self._wake()
        self._listener_closed.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close every connection and the listener, and end the thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        self._stop_accepting.set()
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout_s)
        else:
            self._close_listener()
            self._teardown()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending), or closed (the thread ended)
            os.write(self._wake_w, b"x")

    # --- the relay thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._stop_accepting.is_set() and self._listener is not None:
                    self._close_listener()
                    # A connection that never sent a byte carries no call to finish, but gRPC's
                    # shutdown waits for its handshake until the grace period runs out: close it.
                    for link in [lk for lk in self._links if not lk.spoke]:
                        self._close(link)
                accept = False
                for fd, events in self._ep.poll(self._poll_timeout()):
                    if fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                    elif self._listener is not None and fd == self._listener.fileno():
                        accept = True
                    elif fd in self._ends:
                        link, end = self._ends[fd]
                        try:
                            self._serve(link, end, events)
                        except Exception as exc:  # noqa: BLE001 - one link's fault never ends the relay
                            self._close(link)
                            if not isinstance(exc, OSError):
                                self._report("front_link_failed", exc, uid=link.cred.uid)
                # Accepting after the batch: a descriptor a link closed in this batch may be reused by
                # a new connection, and the batch's stale events for it must not reach the new one.
                if accept and self._listener is not None and not self._stop_accepting.is_set():
                    try:
                        self._accept()
                    except Exception as exc:  # noqa: BLE001 - the next wake-up accepts again
                        self._report("front_accept_failed", exc)
                self._timers()
        except Exception as exc:  # noqa: BLE001 - said once; the daemon's stop still cleans up
            self._report("front_failed", exc)
        finally:
            self._close_listener()
            self._teardown()

    def _report(self, event: str, exc: BaseException, **kw: object) -> None:
        if self._log is not None:
            self._log.error(event, error=repr(exc), exc_info=exc, **kw)

    def _teardown(self) -> None:
        for link in list(self._links):
            self._close(link)
        self._ep.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _close_listener(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(self._listener.fileno())
            self._listener.close()
            self._listener = None
        self._listener_closed.set()

    def _poll_timeout(self) -> float | None:
        deadlines = [lk.linger_until for lk in self._lingering if lk.linger_until is not None]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - self._clock())

    def _timers(self) -> None:
        now = self._clock()
        for link in [lk for lk in self._lingering if lk.linger_until is not None and lk.linger_until <= now]:
            self._close(link)
        if self._accept_paused_until is not None and self._accept_paused_until <= now and self._listener is not None:
            self._accept_paused_until = None
            self._ep.register(self._listener.fileno(), _IN)

    # --- accepting ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # the caller waits in the backlog; a level-triggered listener would spin meanwhile
                    self._ep.unregister(self._listener.fileno())
                    self._accept_paused_until = self._clock() + ACCEPT_PAUSE_S
                    self._refuse(None, "no_descriptors", detail=exc.strerror or str(exc))
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                raise
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        try:
            cred = peer_cred(conn)
        except OSError:
            conn.close()
            return
        exempt = cred.uid in self.exempt_uids
        # counted before the close, so a caller that sees the close finds it counted
        if len(self._links) >= self.max_connections:
            self._refuse(cred, "max_connections")
            conn.close()
            return
        if not exempt and self._per_uid.get(cred.uid, 0) >= self.max_per_uid:
            self._refuse(cred, "max_connections_per_uid")
            conn.close()
            return
        self._serial += 1
        path = self.names.path(cred, self._serial)
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            up.bind(path)
            try:
                up.connect(self._upstream_path)
            finally:
                # gRPC reads the peer's address from the connection, not from the file
                with contextlib.suppress(OSError):
                    os.unlink(path)
        except OSError as exc:
            up.close()
            # EAGAIN: gRPC's backlog is full; anything else: gRPC's socket is gone (stopping)
            self._refuse(cred, "upstream", detail=exc.strerror or str(exc))
            conn.close()
            return
        conn.setblocking(False)
        link = _Link(_End(conn), _End(up), cred, None if exempt else cred.uid)
        if link.counted_uid is not None:
            self._per_uid[cred.uid] = self._per_uid.get(cred.uid, 0) + 1
        self._links.add(link)
        self.accepted += 1
        for end in (link.client, link.upstream):
            self._ends[end.sock.fileno()] = (link, end)
            self._ep.register(end.sock.fileno(), 0)
        self._rearm(link)

    def _refuse(self, cred: PeerCred | None, reason: str, *, detail: str = "") -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        if self._on_refused is not None:
            self._on_refused(reason)
        if self._log is None:
            return
        uid = cred.uid if cred is not None else -1
        now = self._clock()
        last, since = self._refusal_log.get((uid, reason), (None, 0))
        if last is not None and now - last < self._log_interval_s:
            self._refusal_log[(uid, reason)] = (last, since + 1)
            return
        if len(self._refusal_log) > 4096:  # forget uids that have not been refused for an interval
            self._refusal_log = {k: v for k, v in self._refusal_log.items() if now - v[0] < self._log_interval_s}
        self._refusal_log[(uid, reason)] = (now, 0)
        bound = {"max_connections": self.max_connections, "max_connections_per_uid": self.max_per_uid}.get(reason)
        self._log.warning(
            "connection_refused", reason=reason, uid=cred.uid if cred else None, pid=cred.pid if cred else None,
            bound=bound, open_for_uid=self._per_uid.get(uid, 0) if cred else None,
            open_connections=len(self._links), refused_since_last_record=since,
            **({"detail": detail} if detail else {}),
        )

    # --- relaying -----------------------------------------------------------------------------------
    def _serve(self, link: _Link, end: _End, events: int) -> None:
        other = link.other(end)
        if events & _ERR:
            self._close(link)
            return
        if events & _OUT and end.out:
            self._flush(link, end)
        if events & (_IN | _HUP) and not end.eof_in and not other.out:
            self._read(link, end)
        if events & _HUP and not end.gone:
            self._hang_up(link, end)
        if link in self._links:
            self._rearm(link)

    def _read(self, link: _Link, end: _End) -> None:
        other = link.other(end)
        try:
            data = end.sock.recv(self._chunk)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            end.eof_in = True
            self._pass_eof(other)
            return
        if other.gone:
            return  # nowhere to go
        if end is link.client:
            link.spoke = True
        other.out += data
        self._flush(link, other)

    def _flush(self, link: _Link, end: _End) -> None:
        try:
            sent = end.sock.send(end.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(link)
            return
        del end.out[:sent]
        if not end.out:
            if link.other(end).eof_in:
                self._pass_eof(end)
            if link.linger_until is not None and (link.client.gone or link.upstream.gone):
                self._close(link)  # the gone side's last data has reached the other side

    def _pass_eof(self, end: _End) -> None:
        """The other side sent end-of-file: pass it on once its data is."""
        if end.out or end.shut_out or end.gone:
            return
        end.shut_out = True
        with contextlib.suppress(OSError):
            end.sock.shutdown(socket.SHUT_WR)

    def _hang_up(self, link: _Link, end: _End) -> None:
        """`end` is gone: take what it still sent, pass it on, then close the link."""
        other = link.other(end)
        end.gone = True
        end.out.clear()
        while not end.eof_in:  # bounded by the kernel's buffer of what it sent
            try:
                data = end.sock.recv(self._chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                end.eof_in = True
                break
            if not data:
                end.eof_in = True
            elif not other.gone:
                other.out += data
        self._forget(end)  # a hung-up socket would be reported on every poll
        if other.gone or not other.out:
            self._close(link)
            return
        self._flush(link, other)
        if link in self._links:
            if other.out:
                link.linger_until = self._clock() + self._linger_s
                self._lingering.add(link)
            else:
                self._close(link)

    def _rearm(self, link: _Link) -> None:
        for end in (link.client, link.upstream):
            if end.gone:
                continue
            other = link.other(end)
            want = 0
            if not end.eof_in and not other.out:
                want |= _IN
            if end.out:
                want |= _OUT
            if want != end.mask:
                end.mask = want
                self._ep.modify(end.sock.fileno(), want)

    def _forget(self, end: _End) -> None:
        fd = end.sock.fileno()
        if fd >= 0:
            self._ends.pop(fd, None)
            with contextlib.suppress(OSError, ValueError):
                self._ep.unregister(fd)
        end.sock.close()

    def _close(self, link: _Link) -> None:
        if link not in self._links:
            return
        self._links.discard(link)
        self._lingering.discard(link)
        for end in (link.client, link.upstream):
            self._forget(end)
        if link.counted_uid is not None:
            left = self._per_uid.get(link.counted_uid, 1) - 1
            if left > 0:
                self._per_uid[link.counted_uid] = left
            else:
                self._per_uid.pop(link.counted_uid, None)
