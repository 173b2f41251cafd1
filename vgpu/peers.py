"""Who is on the other end of the daemon's Unix socket.

gRPC's Python server does not show a Unix-socket caller's credentials: `context.peer()` is the
address the *client* socket is bound to, which a client normally leaves unbound (`"unix:"`). The
daemon therefore accepts on its public socket itself (vgpu/daemon/front.py), reads the kernel's
`SO_PEERCRED` (the pid, uid and gid of the process that connected), and relays the connection to
gRPC's own socket from a client socket it binds to a name that spells those credentials:

    <relay directory>/<uid>-<gid>-<pid>-<serial in hex>

gRPC then reports that name as the call's peer (`"unix:<relay directory>/<name>"`), and
`RelayNames.peer` reads the credentials back. The relay directory is private to the daemon
(mode 0700, its own): no other user can connect to gRPC's socket in it, nor bind a name there, so
a peer name under it can only have been made by the relay. A connection over TCP, or one the relay
did not make, has no credentials here (`peer` returns None).
"""

from __future__ import annotations

import os
import re
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# sockaddr_un.sun_path holds 108 bytes, the terminating NUL included.
SUN_PATH_MAX = 108
_NAME = re.compile(r"(\d{1,10})-(\d{1,10})-(\d{1,10})-([0-9a-f]{1,16})")
# The longest name `RelayNames.path` makes: three 10-digit ids, a 16-digit serial, three dashes.
MAX_NAME_CHARS = 3 * 10 + 16 + 3


@dataclass(frozen=True)
class PeerCred:
    """A Unix-socket peer's credentials as the kernel recorded them when it connected."""

    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """The credentials of the process at the other end of a connected Unix socket (SO_PEERCRED).
    OSError when the socket has none (not AF_UNIX, already closed)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid=pid, uid=uid & 0xFFFFFFFF, gid=gid & 0xFFFFFFFF)


@dataclass(frozen=True)
class RelayNames:
    """The relay directory, spelled as the relay binds in it (and so as gRPC reports the names)."""

    directory: str

    def path(self, cred: PeerCred, serial: int) -> str:
        return f"{self.directory}/{cred.uid}-{cred.gid}-{cred.pid}-{serial:x}"

    def peer(self, peer: str) -> PeerCred | None:
        """The credentials in a call's `context.peer()`, or None when the relay did not make the
        connection (TCP, a direct connection to gRPC's socket, anything not under the directory)."""
        prefix = f"unix:{self.directory}/"
        if not peer.startswith(prefix):
            return None
        m = _NAME.fullmatch(peer[len(prefix):])
        if m is None:
            return None
        uid, gid, pid = (int(m.group(i)) for i in (1, 2, 3))
        if max(uid, gid, pid) > 0xFFFFFFFF:
            return None
        return PeerCred(pid=pid, uid=uid, gid=gid)


def fits_sun_path(path: str) -> bool:
    """Whether a socket can be bound at `path` (its bytes and a NUL fit sockaddr_un.sun_path)."""
    return len(path.encode()) + 1 <= SUN_PATH_MAX


def relay_names(directory: Path, dir_fd: int) -> RelayNames:
    """How to spell `directory` in socket addresses: its own path when the longest relay name under
    it fits `sun_path`, else `/proc/self/fd/<dir_fd>`, which names the same directory in this process
    (through the descriptor the daemon holds open on it) in 20-odd bytes whatever its real path."""
    real = str(directory)
    if fits_sun_path(f"{real}/{'x' * MAX_NAME_CHARS}"):
        return RelayNames(real)
    return RelayNames(f"/proc/self/fd/{dir_fd}")


def _status_field(pid: int, name: str, proc_root: Path) -> list[str] | None:
    """The values of one line (`Uid:`, `NSpid:`) of `/proc/<pid>/status`, or None when there is no
    such process, its status cannot be read, or it has no such line."""
    try:
        text = (proc_root / str(pid) / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{name}:"):
            return line.split()[1:]
    return None


def process_uids(pid: int, proc_root: Path = Path("/proc")) -> tuple[int, int, int] | None:
    """A process's real, effective and saved uid (`/proc/<pid>/status`), or None when there is no
    such process (or its status cannot be read)."""
    parts = _status_field(pid, "Uid", proc_root)
    if parts is None or len(parts) < 3 or not all(p.isdigit() for p in parts[:3]):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def runs_as(pid: int, uid: int, proc_root: Path = Path("/proc")) -> bool:
    """Whether process `pid` runs as `uid` and as nobody else: its real, effective and saved uid are
    all `uid` (a set-uid program a user started keeps another effective or saved uid, and is not
    the user's to name)."""
    uids = process_uids(pid, proc_root)
    return uids is not None and uids == (uid, uid, uid)


def ns_pids(pid: int, proc_root: Path = Path("/proc")) -> tuple[int, ...] | None:
    """A process's pid in each pid namespace it belongs to, outermost (the one /proc shows) first:
    the `NSpid` line of `/proc/<pid>/status` (Linux 4.1 on). None when there is no such process, its
    status cannot be read, or the kernel has no `NSpid` line."""
    parts = _status_field(pid, "NSpid", proc_root)
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


class NamespaceUnreadable(Exception):
    """A process's pid namespace (`/proc/<pid>/ns/pid`) that the daemon may not read: the kernel
    shows it to a reader of another uid, or one whose capabilities do not cover the process's (root
    with a reduced set reading a root container's process), only with CAP_SYS_PTRACE."""

    def __init__(self, pid: int | str, error: OSError) -> None:
        super().__init__(f"cannot read the pid namespace of process {pid}: {error.strerror or error}")
        self.pid = pid
        self.error = error


def pid_namespace(pid: int | str, proc_root: Path = Path("/proc"),
                  readlink: Callable[[Path], str] = os.readlink) -> str | None:
    """The pid namespace a process belongs to (`/proc/<pid>/ns/pid`, e.g. `pid:[4026531836]`), or
    None when there is no such process. Raises NamespaceUnreadable when the kernel refuses the read
    (EACCES, EPERM: another user's process, or a root container's, to a daemon without CAP_SYS_PTRACE)."""
    try:
        return readlink(proc_root / str(pid) / "ns" / "pid")
    except PermissionError as exc:  # EACCES and EPERM
        raise NamespaceUnreadable(pid, exc) from exc
    except OSError:
        return None


def pid_here(pid: int, caller_pid: int, proc_root: Path = Path("/proc"),
             readlink: Callable[[Path], str] = os.readlink) -> int | None:
    """The pid, in the namespace /proc shows (the daemon's), of the process that the caller
    `caller_pid` (a pid here: the kernel translates `SO_PEERCRED`'s) calls `pid`. A caller in a
    container's pid namespace names processes by their pid in that namespace, which here is another
    process's pid or none; read as ours, it would let a caller have an unrelated process capped.

    A caller in this namespace: `pid` unchanged. A caller in a nested namespace that names itself
    (the client stub's usual request): its own pid here. Another process of its namespace: found by
    reading each process's `NSpid` (its innermost pid) and namespace, a scan of /proc made only for
    this case. None when it cannot be told: the caller has exited, is outside this namespace
    (`caller_pid` 0), or no process of its namespace has that pid. Raises NamespaceUnreadable when
    the answer needed a namespace the kernel would not let the daemon read (the caller's, or that of
    a process with that pid): the daemon lacks CAP_SYS_PTRACE (NamespaceUnreadable says when it is needed)."""
    chain = ns_pids(caller_pid, proc_root) if caller_pid > 0 else None
    if chain is None:
        # no NSpid line (a kernel before 4.1) or no caller: only a caller in our own namespace is understood
        ns = pid_namespace(caller_pid, proc_root, readlink) if caller_pid > 0 else None
        return pid if ns is not None and ns == pid_namespace("self", proc_root, readlink) else None
    if len(chain) == 1:
        return pid
    if chain[-1] == pid:
        return caller_pid
    ns = pid_namespace(caller_pid, proc_root, readlink)
    if ns is None:
        return None
    try:
        entries = [e.name for e in os.scandir(proc_root) if e.name.isdigit()]
    except OSError:
        return None
    unreadable: NamespaceUnreadable | None = None
    for name in entries:
        other = ns_pids(int(name), proc_root)
        if other is None or len(other) != len(chain) or other[-1] != pid:
            continue
        try:
            if pid_namespace(name, proc_root, readlink) == ns:
                return int(name)
        except NamespaceUnreadable as exc:  # it may be the one: said if no other is
            unreadable = exc
    if unreadable is not None:
        raise unreadable
    return None
