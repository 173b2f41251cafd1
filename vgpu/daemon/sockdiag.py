"""Which local user owns the other end of a TCP connection on this host: one NETLINK_SOCK_DIAG
request (sock_diag(7), `inet_diag_req_v2`) for the exact 4-tuple.

The metrics endpoint (vgpu/daemon/metrics.py) counts a caller on loopback by the uid that owns the
caller's socket: every local user can connect from any loopback address, so the address says
nothing about who is calling, while the kernel records the uid that created each socket. The
request names one connection (not a dump with a filter): the kernel finds it in its connection hash
table, so a lookup costs the same however many sockets the host has (bench/metrics_peer_uid.py).
pyroute2's DiagSocket only dumps whole families, which would cost as much as reading /proc/net/tcp.

Everything the kernel sends back is checked before use: the message type, its length, the sequence
number and the connection's ports. Failures raise `PeerUidUnknown` with a reason from a small set
(`PEER_UID_UNKNOWN_REASONS`), so that callers can count them without inventing labels.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import socket
import struct
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4  # linux/netlink.h
SOCK_DIAG_BY_FAMILY = 20  # linux/sock_diag.h
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
ALL_TCP_STATES = 0xFFFFFFFF
# struct nlmsghdr: length, type, flags, sequence, port id
_NLMSGHDR = struct.Struct("=IHHII")
# struct inet_diag_req_v2 up to its sockid: family, protocol, extensions, pad, states
_REQ_HEAD = struct.Struct("=BBBBI")
# struct inet_diag_sockid: source and destination port (big-endian), source and destination address
# (16 bytes each, an IPv4 one in the first 4), interface, cookie
_SOCKID = struct.Struct(">HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
# struct inet_diag_msg after its sockid: expires, rqueue, wqueue, uid, inode
_MSG_HEAD = struct.Struct("=BBBB")
_MSG_TAIL = struct.Struct("=IIIII")
_MSG_LEN = _MSG_HEAD.size + _SOCKID.size + _SOCKID_TAIL.size + _MSG_TAIL.size  # 72
REPLY_TIMEOUT_S = 0.5  # the kernel answers within the send; this only bounds a kernel that does not

PEER_UID_UNKNOWN_REASONS = (
    "unsupported",  # no sock_diag here: not Linux, the module not loaded, or netlink refused
    "gone",  # the kernel has no open socket for the connection: its owner closed it already
    "error",  # anything else: a malformed reply, a send or receive that failed
)

_seq = itertools.count(1)


class PeerUidUnknown(Exception):
    """The owner of a connection's far end could not be read; `reason` is one of
    PEER_UID_UNKNOWN_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class SocketOwner:
    uid: int  # as this process's user namespace sees it (65534 for a uid not mapped into it)
    inode: int  # the socket's inode, as fstat() of the owner's descriptor shows it


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # a dual-stack listener's view of an IPv4 connection
    return ip


def _request(seq: int, owner: tuple[str, int], other: tuple[str, int]) -> bytes:
    """The request for the socket bound to `owner` and connected to `other` (host, port)."""
    src, dst = _ip(owner[0]), _ip(other[0])
    if src.version != dst.version:
        raise PeerUidUnknown("error", f"addresses of two families: {owner[0]}, {other[0]}")
    family = socket.AF_INET if src.version == 4 else socket.AF_INET6
    body = (_REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, ALL_TCP_STATES)
            + _SOCKID.pack(owner[1], other[1], src.packed.ljust(16, b"\0"), dst.packed.ljust(16, b"\0"))
            + _SOCKID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_reply(data: bytes, seq: int, owner_port: int, other_port: int) -> SocketOwner:
    """The owner in the kernel's reply `data` to request `seq`; PeerUidUnknown if it is an error, is
    malformed, or is about another connection."""
    if len(data) < _NLMSGHDR.size:
        raise PeerUidUnknown("error", f"reply of {len(data)} bytes")
    length, kind, _flags, got_seq, _pid = _NLMSGHDR.unpack_from(data)
    if got_seq != seq or not _NLMSGHDR.size <= length <= len(data):
        raise PeerUidUnknown("error", f"reply for sequence {got_seq} of length {length}, expected {seq}")
    if kind == NLMSG_ERROR:
        if length < _NLMSGHDR.size + 4:
            raise PeerUidUnknown("error", "truncated error reply")
        code = -struct.unpack_from("=i", data, _NLMSGHDR.size)[0]
        if code == errno.ENOENT:
            raise PeerUidUnknown("gone", "no such connection")
        raise PeerUidUnknown("error", f"kernel error {errno.errorcode.get(code, code)}")
    if kind != SOCK_DIAG_BY_FAMILY or length < _NLMSGHDR.size + _MSG_LEN:
        raise PeerUidUnknown("error", f"reply of type {kind}, length {length}")
    offset = _NLMSGHDR.size + _MSG_HEAD.size
    sport, dport, _src, _dst = _SOCKID.unpack_from(data, offset)
    if (sport, dport) != (owner_port, other_port):
        raise PeerUidUnknown("error", f"reply for ports {sport}->{dport}, expected {owner_port}->{other_port}")
    _expires, _rqueue, _wqueue, uid, inode = _MSG_TAIL.unpack_from(data, offset + _SOCKID.size + _SOCKID_TAIL.size)
    if inode == 0:
        # no process holds the socket: closed and waiting to be torn down (a TIME_WAIT entry reads
        # uid 0, which would be wrong)
        raise PeerUidUnknown("gone", "the socket is closed")
    return SocketOwner(uid=uid, inode=inode)


def tcp_socket_owner(owner: tuple[str, int], other: tuple[str, int]) -> SocketOwner:
    """Who owns the TCP socket bound to `owner` and connected to `other`, both (host, port) as
    Python gives them (an IPv6 host may carry a zone; IPv4-mapped addresses are read as IPv4)."""
    if not hasattr(socket, "AF_NETLINK"):
        raise PeerUidUnknown("unsupported", "no netlink sockets on this system")
    try:
        conn = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    except OSError as exc:
        reason = "error" if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) else "unsupported"
        raise PeerUidUnknown(reason, f"netlink sock_diag socket: {exc}") from exc
    with conn:
        seq = next(_seq) & 0xFFFFFFFF
        try:
            request = _request(seq, owner, other)
        except ValueError as exc:  # not an IP address
            raise PeerUidUnknown("error", str(exc)) from exc
        try:
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.sendto(request, (0, 0))
            data = conn.recv(8192)
        except OSError as exc:
            raise PeerUidUnknown("error", f"sock_diag request: {exc}") from exc
    return parse_reply(data, seq, owner[1], other[1])


def tcp_peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int:
    """The uid owning the far end of this host's connection from `local` to `peer` (the far end is a
    socket of this host too: a connection over loopback). PeerUidUnknown if it cannot be read."""
    return tcp_socket_owner(peer, local).uid
