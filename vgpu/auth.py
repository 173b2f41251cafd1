"""Who is calling, and may they? Scoped tokens, mutual TLS, the Unix peer's uid, and one access rule per RPC.

Identity. gRPC's Python server does not expose the Unix socket peer's credentials (SO_PEERCRED):
`context.peer()` is the client socket's own address, normally `"unix:"`. The daemon's front
(vgpu/daemon/front.py) therefore accepts on the socket, reads them, and relays each connection to
gRPC from a socket whose address spells them (vgpu/peers.py); `AccessControl(peer_of=...)` reads
them back from `context.peer()`. So the socket's owner/group/mode decides who may *connect*, the
kernel says which uid and pid connected, and scoped tokens say which role or application is
*calling*:

- a token is `vgpu1.<base64url(scope)>.<hex HMAC-SHA256(secret, scope)>`, sent as metadata
  `authorization: Bearer <token>`; the secret (32 random bytes) lives in `<state_dir>/tokens/secret`
  (0600), so tokens are stable across restarts and deleting the secret revokes all of them;
- scopes: `operator` (every call), `profiler` (Ingest streams) and `app:<id>` (that application's
  own grants). The daemon writes `tokens/operator.token` and `tokens/profiler.token` (0600, or 0640
  with a configured group) and `tokens/apps/<id>.token` (0600) for each application it knows;
- a client with no token may claim an application id that nobody owns yet and has nothing in the
  ledger (`auth.app_self_registration`); its first grant comes back with the application's token in
  the trailing metadata `vgpu-app-token`;
- over TCP (TLS only) a client certificate verified against `tls.ca` makes the caller a profiler.

A request that names a pid (its grant then caps that process's cgroup) is taken from the operator,
from a caller whose uid the process runs as (real, effective and saved uid: `vgpu.peers.runs_as`),
or when the process itself reports that it runs the application (`pid_proof`); any other pid is
PERMISSION_DENIED. A Unix-socket caller's pid is first read in the caller's own pid namespace and
rewritten to the daemon's (`AccessControl.place_pid`): a client in a container names processes by
their pids there. Callers without a token are told apart by uid where it is known (`caller_name()`:
`anonymous (uid N)`), so per-caller bounds do not put every user's anonymous calls together.

Every denied call is answered PERMISSION_DENIED (known caller, not allowed) or UNAUTHENTICATED (no
or a bad token), never reaches the servicer (so it changes nothing), is counted
(`vgpu_access_denied_total`), and is logged as `access_denied`: at most `DENIAL_LOG_BURST` records
per caller (its uid where known), method and code in each `DENIAL_LOG_INTERVAL_S`, the next record
saying how many were left out (`denied_since_last_record`), so a caller looping a refused call
cannot fill the log (`DenialLog`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import contextvars
import errno
import grp
import hashlib
import hmac
import inspect
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import grpc
import structlog

from vgpu.capped import FileTooLarge, read_capped
from vgpu.config import DEFAULT_STATE_DIR
from vgpu.ids import MAX_PID, app_id_digest, app_id_problem
from vgpu.log import LogBudget, get_logger
from vgpu.peers import NamespaceUnreadable, PeerCred, pid_here, runs_as
from vgpu.tokenfile import TokenFileError, read_token
from vgpu.tokenfile import write_atomically as _write_private

TOKEN_PREFIX = "vgpu1"
AUTH_METADATA_KEY = "authorization"
APP_TOKEN_TRAILER = "vgpu-app-token"
SECRET_BYTES = 32
TOKEN_DIR_NAME = "tokens"

Role = Literal["operator", "profiler", "app", "anonymous"]
# What a method needs. "app_request": the request's app_id must be the caller's (or claimable);
# "app_grant": the grant's owner must be the caller; "read": anyone when open_reads, else a token.
Need = Literal["open", "read", "operator", "profiler", "app_request", "app_grant"]

METHOD_NEEDS: dict[str, Need] = {
    "/vgpu.v1.Allocator/RequestResourceAllocation": "app_request",
    "/vgpu.v1.Allocator/ReleaseResources": "app_grant",
    "/vgpu.v1.Allocator/GetAvailableResources": "read",
    "/vgpu.v1.Allocator/ListApplications": "read",
    "/vgpu.v1.Allocator/GetAppHistory": "read",
    "/vgpu.v1.Allocator/WatchAllocations": "read",
    "/vgpu.v1.Allocator/SetResourceLimits": "operator",
    "/vgpu.v1.Allocator/ForgetApplications": "operator",
    "/vgpu.v1.Ingest/StreamSignatures": "profiler",
}
OPEN_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/", "/grpc.reflection.")


_CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("vgpu_caller", default=None)
_PRINCIPAL: contextvars.ContextVar[str] = contextvars.ContextVar("vgpu_principal", default="")
_BOUNDED_UID: contextvars.ContextVar[int | None] = contextvars.ContextVar("vgpu_bounded_uid", default=None)


def caller_name() -> str:
    """Who the current call is ("operator", "profiler", "app:<id>", "anonymous (uid N)" when the
    Unix peer's uid is known, else "anonymous"), for per-caller bounds; set by `AuthInterceptor` for
    the call's task."""
    return _PRINCIPAL.get()


def bounded_uid() -> int | None:
    """The Unix uid whose per-uid shares (grants, watchers) the current call takes, whatever token it
    sent (`uid_bound`); set by `AuthInterceptor` for the call's task."""
    return _BOUNDED_UID.get()


def uid_bound(principal: Principal, peer: PeerCred | None) -> int | None:
    """The uid a caller's per-uid shares count against: the Unix peer's, whatever token it presents
    (a user may claim many application ids, each with a token of its own); None (bounded per node
    only) for the operator token, for uid 0 (root, and every container that runs as root without a
    user namespace: one uid, many users) and where the uid is unknown (TCP, the front off)."""
    if peer is None or peer.uid == 0 or principal.role == "operator":
        return None
    return peer.uid


def identify_caller(_context: object = None) -> str | None:
    """The application the current call acts as (None: a trusted caller, operator or profiler), for
    `vgpu.allocator.service.AllocatorServicer(identify=...)`. Set by `AuthInterceptor` for the call's task,
    so the ledger re-checks ownership behind the interceptor (defence in depth)."""
    return _CALLER.get()


def need_for(method: str) -> Need:
    """The access a method needs; a method this table does not know needs the operator."""
    if method.startswith(OPEN_PREFIXES):
        return "open"
    return METHOD_NEEDS.get(method, "operator")


class AuthSetupError(RuntimeError):
    """The token directory, its secret or a configured group cannot be set up."""


@dataclass(frozen=True)
class Principal:
    role: Role
    app_id: str = ""
    # "token", "mtls" or "none"
    via: str = "none"

    def describe(self) -> str:
        return f"app:{self.app_id}" if self.role == "app" else self.role


ANONYMOUS = Principal("anonymous")


def token_dir(state_dir: str | Path) -> Path:
    """Where the daemon with this state directory keeps its tokens."""
    return Path(state_dir) / TOKEN_DIR_NAME


def role_token_file(role: Literal["operator", "profiler"], state_dir: str | Path | None = None) -> Path:
    """The token file the daemon writes for a role (default state directory: the daemon's default)."""
    return token_dir(DEFAULT_STATE_DIR if state_dir is None else state_dir) / f"{role}.token"


def app_token_file(app_id: str, state_dir: str | Path) -> Path:
    """The token file the daemon writes for an application."""
    return token_dir(state_dir) / "apps" / app_token_filename(app_id)


def read_token_file(path: str | Path) -> str:
    """The token in a file (vgpu/tokenfile.py reads it); OSError (missing, unreadable) or
    ValueError (no token in it) with a message that names the file otherwise."""
    try:
        token = read_token(path)
    except TokenFileError as exc:
        if isinstance(exc.__cause__, OSError):
            raise OSError(str(exc)) from exc.__cause__
        raise
    if token is None:
        raise OSError(f"cannot read the token file {path}: {os.strerror(errno.ENOENT)}")
    return token


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def app_token_filename(app_id: str) -> str:
    """A file name for an application id: the id's SHA-256 in hex, so its length is fixed whatever
    the id (an id spelled out in a file name can exceed the file system's 255-byte limit)."""
    return app_id_digest(app_id) + ".token"


class TokenAuthority:
    """Issues and verifies scoped tokens; owns `<state_dir>/tokens/`."""

    def __init__(
        self,
        token_dir: Path,
        *,
        operator_group: str = "",
        profiler_group: str = "",
        secret: bytes | None = None,
    ) -> None:
        self.token_dir = Path(token_dir)
        self._groups = {"operator": operator_group, "profiler": profiler_group}
        for name in self._groups.values():
            if name:
                _gid(name)  # fail at start, not at the first write
        self._secret = secret if secret is not None else self._load_or_create_secret()

    def _load_or_create_secret(self) -> bytes:
        path = self.token_dir / "secret"
        try:
            self.token_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.token_dir, 0o711)  # traversable, not listable
            if not path.exists():
                _write_private(path, secrets.token_bytes(SECRET_BYTES), 0o600, durable=True)
            data = read_capped(path, SECRET_BYTES)
        except FileTooLarge:
            raise AuthSetupError(
                f"{path} holds more than {SECRET_BYTES} bytes, expected {SECRET_BYTES}; delete it to issue new tokens"
            ) from None
        except OSError as exc:
            raise AuthSetupError(f"cannot set up the token secret {path}: {exc}") from exc
        if len(data) != SECRET_BYTES:
            raise AuthSetupError(
                f"{path} holds {len(data)} bytes, expected {SECRET_BYTES}; delete it to issue new tokens"
            )
        return data

    def token_for(self, scope: str) -> str:
        mac = hmac.new(self._secret, scope.encode("utf-8"), hashlib.sha256).hexdigest()
        return f"{TOKEN_PREFIX}.{_b64(scope.encode('utf-8'))}.{mac}"

    def verify(self, token: str) -> Principal | None:
        """The principal a token names, or None when it is not one of ours."""
        parts = token.strip().split(".")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            return None
        try:
            scope = _unb64(parts[1]).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        if not hmac.compare_digest(self.token_for(scope), token.strip()):
            return None
        if scope == "operator":
            return Principal("operator", via="token")
        if scope == "profiler":
            return Principal("profiler", via="token")
        if scope.startswith("app:") and len(scope) > 4:
            return Principal("app", app_id=scope[4:], via="token")
        return None

    # --- token files -------------------------------------------------------------------------------
    def role_token_path(self, role: Literal["operator", "profiler"]) -> Path:
        return self.token_dir / f"{role}.token"  # = role_token_file(role, <state_dir>)

    def app_token_path(self, app_id: str) -> Path:
        return self.token_dir / "apps" / app_token_filename(app_id)

    def write_role_tokens(self) -> dict[str, Path]:
        """(Re)write operator.token and profiler.token with their modes and groups."""
        out: dict[str, Path] = {}
        for role in ("operator", "profiler"):
            path = self.role_token_path(role)
            group = self._groups[role]
            try:
                _write_private(path, (self.token_for(role) + "\n").encode(), 0o640 if group else 0o600)
                if group:
                    os.chown(path, -1, _gid(group))
            except OSError as exc:
                raise AuthSetupError(f"cannot write {path}: {exc}") from exc
            out[role] = path
        return out

    def write_app_token(self, app_id: str) -> Path:
        path = self.app_token_path(app_id)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _write_private(path, (self.token_for(f"app:{app_id}") + "\n").encode(), 0o600)
        except OSError as exc:
            raise AuthSetupError(f"cannot write {path}: {exc}") from exc
        return path


def _gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise AuthSetupError(f"group {group!r} does not exist (create it, or clear the setting)") from None


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a token."""
    return ((AUTH_METADATA_KEY, f"Bearer {token.strip()}"),)


class AppRegistry(Protocol):
    """What access control needs to know about applications and grants."""

    def app_claimed(self, app_id: str) -> bool: ...

    def claim_app(self, app_id: str, uid: int | None = None) -> bool: ...

    def unclaim_app(self, app_id: str) -> bool: ...

    def claimed_count(self, uid: int | None = None) -> int: ...

    def claim_uid(self, app_id: str) -> int | None: ...

    def claimed_by(self, uid: int) -> list[str]: ...


class LedgerView(Protocol):
    def grant_owner(self, grant_id: str) -> str | None:
        """The app_id holding the grant; None if there is no such grant."""
        ...

    def has_app(self, app_id: str) -> bool:
        """The ledger holds grants someone asked for, or limits, for the application (forecast
        grants, made from signatures, do not make an application owned)."""
        ...


@dataclass(frozen=True)
class Denied(Exception):
    code: grpc.StatusCode
    reason: str


class AccessControl:
    """Decides each call. Pure policy over a principal and a request; no gRPC objects needed."""

    def __init__(
        self,
        authority: TokenAuthority,
        registry: AppRegistry,
        ledger: LedgerView,
        *,
        open_reads: bool = True,
        app_self_registration: bool = True,
        max_self_registered_apps: int | None = None,
        max_self_registered_apps_per_uid: int | None = None,
        pid_proof: Callable[[int, str], bool] | None = None,
        open_ingest: bool = False,
        mtls_role: Role = "profiler",
        peer_of: Callable[[str], PeerCred | None] | None = None,
        pid_runs_as: Callable[[int, int], bool] = runs_as,
        pid_from_caller: Callable[[int, int], int | None] = pid_here,
    ) -> None:
        self.authority = authority
        self.registry = registry
        self.ledger = ledger
        self.open_reads = open_reads
        self.app_self_registration = app_self_registration
        self.max_self_registered_apps = max_self_registered_apps
        self.max_self_registered_apps_per_uid = max_self_registered_apps_per_uid
        # Claims failed calls gave back whose rows the store could not delete (a full disk); retried
        # at each later claim and unclaim (`_retry_unclaims`).
        self.unclaims_pending: set[str] = set()
        # Held from a claim's first write to the end of the call it is for (`AuthInterceptor`), and
        # while claims are forgotten (`forget`): two anonymous callers cannot both win an id, and a
        # claim is not forgotten half-made.
        self.claim_lock = asyncio.Lock()
        # pid_proof(pid, app_id): whether the process shows it is that application's, in a way
        # only its own user could arrange (the daemon: `InAppPidProof`); None: nothing proves it.
        self.pid_proof = pid_proof
        self.open_ingest = open_ingest
        self.mtls_role = mtls_role
        # peer_of(context.peer()): the Unix peer's credentials when the daemon's front relayed the
        # call, else None (TCP, or the front is off). pid_runs_as(pid, uid): the process runs as uid.
        self.peer_of = peer_of
        self.pid_runs_as = pid_runs_as
        # pid_from_caller(pid, caller_pid): the pid here of the process the caller calls `pid` in its
        # own pid namespace (a container's), or None when it cannot be told; NamespaceUnreadable when
        # the kernel would not let the daemon read a namespace it needed (vgpu.peers.pid_here).
        self.pid_from_caller = pid_from_caller

    def peer(self, peer: str) -> PeerCred | None:
        """The credentials a call's `context.peer()` carries, or None."""
        return self.peer_of(peer) if self.peer_of is not None else None

    def identify(self, metadata: Sequence[tuple[str, str | bytes]], *, verified_client_cert: bool) -> Principal:
        """The caller: from a token if one is sent (a bad one raises Denied UNAUTHENTICATED),
        else from a verified client certificate, else anonymous."""
        for key, value in metadata:
            if key.lower() != AUTH_METADATA_KEY:
                continue
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "authorization metadata must be 'Bearer <token>'")
            principal = self.authority.verify(token)
            if principal is None:
                raise Denied(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "the token is not valid for this daemon (revoked, or issued by another state directory)",
                )
            return principal
        if verified_client_cert:
            return Principal(self.mtls_role, via="mtls")
        return ANONYMOUS

    def authorize(self, need: Need, principal: Principal, request: object, peer: PeerCred | None = None) -> str | None:
        """None if allowed outright; an app_id to claim for an anonymous caller after success;
        raises Denied otherwise. `peer`: the Unix peer's credentials, when known."""
        role = principal.role
        if need == "open" or role == "operator":
            return None
        if need == "read":
            if self.open_reads or role != "anonymous":
                return None
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "reads need a token on this daemon (auth.open_reads=false)")
        if need == "operator":
            if role == "anonymous":
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "this call needs the operator token")
            raise Denied(grpc.StatusCode.PERMISSION_DENIED, f"{principal.describe()} may not do this; it needs the operator role")
        if need == "profiler":
            if role == "profiler" or (self.open_ingest and role == "anonymous"):
                return None
            if role == "anonymous":
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "streaming signatures needs the profiler token")
            raise Denied(grpc.StatusCode.PERMISSION_DENIED, f"{principal.describe()} may not stream signatures")
        if need == "app_request":
            app_id = _request_app_id(request)
            problem = app_id_problem(app_id, "request.app_id") if app_id else None
            if problem is not None:  # checked before anything is claimed for it
                raise Denied(grpc.StatusCode.INVALID_ARGUMENT, problem)
            pid = _request_pid(request)
            if pid > MAX_PID:
                raise Denied(grpc.StatusCode.INVALID_ARGUMENT, f"request.pid {pid} is out of range: a pid is 1 to {MAX_PID} (0: none)")
            if pid and not self._may_name(pid, app_id, peer):  # (the operator was let through above)
                raise Denied(grpc.StatusCode.PERMISSION_DENIED, self._pid_refusal(principal, pid, app_id, peer))
            if role == "app":
                if principal.app_id == app_id:
                    return None
                raise Denied(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"app:{principal.app_id} may not request resources for application {app_id!r}",
                )
            if role == "anonymous" and app_id:
                if not self.app_self_registration:
                    raise Denied(grpc.StatusCode.UNAUTHENTICATED, "requests need the application's token")
                claimed = self.registry.app_claimed(app_id)
                uid = uid_bound(principal, peer)
                if self.ledger.has_app(app_id) or (claimed and not self._reclaimable(app_id, uid)):
                    raise Denied(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"application {app_id!r} is owned by another client; present its token",
                    )
                if not claimed or app_id in self.unclaims_pending:  # a new claim: the pending one is forgotten first
                    self._check_claim_quotas(uid)
                return app_id
            if role == "anonymous":
                return None  # empty app_id: the servicer answers INVALID_ARGUMENT
            raise Denied(grpc.StatusCode.PERMISSION_DENIED, f"{principal.describe()} may not request resources")
        if need == "app_grant":
            grant_id = str(getattr(request, "grant_id", ""))
            owner = self.ledger.grant_owner(grant_id)
            if owner is None:
                return None  # the servicer answers NOT_FOUND (grant ids are random: nothing to probe)
            if role == "app" and principal.app_id == owner:
                return None
            if role == "anonymous":
                raise Denied(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"grant {grant_id} belongs to {owner!r}: present its token or the operator token",
                )
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{principal.describe()} may not change grant {grant_id} of application {owner!r}",
            )
        raise Denied(grpc.StatusCode.PERMISSION_DENIED, f"unknown access rule {need!r}")

    def _reclaimable(self, app_id: str, uid: int | None) -> bool:
        """A claimed id that holds nothing may be claimed (again): one a failed call gave back that
        the store could not forget yet (a full disk: `unclaim`), by anyone, since the call was
        answered that nothing changed; and any, by the uid that self-registered it (its token handed
        out again), so that a claim left behind by a failure is its caller's still after a restart,
        when the pending ones are not known any more (`uid`: the caller's, `uid_bound`). A uid is one user (its processes may read each
        other's memory); uid 0 is not (every container that runs as root without a user namespace is
        uid 0), so its claims are never taken again this way."""
        if app_id in self.unclaims_pending:  # given back: free, once the store forgets it (`claim`)
            return True
        return uid is not None and self.registry.claim_uid(app_id) == uid

    def _check_claim_quotas(self, uid: int | None) -> None:
        """The node's bound on self-registered ids, and the share of `uid` (`uid_bound`; None: none)."""
        limit = self.max_self_registered_apps
        if limit is not None and self.registry.claimed_count() >= limit:
            raise Denied(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"quota: {limit} application ids are claimed (auth.max_self_registered_apps = {limit}); "
                "ask the operator for this application's token",
            )
        per_uid = self.max_self_registered_apps_per_uid
        if per_uid is None or uid is None:
            return
        held = self.registry.claimed_count(uid)
        if held >= per_uid:
            raise Denied(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"quota: uid {uid} has claimed {held} application ids (auth.max_self_registered_apps_per_uid = "
                f"{per_uid}); reuse one of them, or ask the operator to forget those that hold nothing "
                "(`vgpu forget-app`)",
            )

    def place_pid(self, request: object, peer: PeerCred | None) -> None:
        """Rewrite a request's pid from the caller's pid namespace into the daemon's, before any rule
        reads it: a caller in a container names processes by their pid in the container, which here
        is another process or none. The grant, its cgroup cap, the exit release and the reply then
        all name the process the caller meant. Raises Denied when the caller's namespace is not this
        one and the pid cannot be placed in it (nothing is changed), saying so apart when the daemon
        was refused a read of a namespace it needed (no CAP_SYS_PTRACE). Without the Unix peer (TCP, or
        the front off) the pid is taken as it is: only the operator or an in-app report, both read
        in the daemon's namespace, can make it stand there."""
        pid = _request_pid(request)
        if peer is None or not 0 < pid <= MAX_PID:
            return  # no pid, or one `authorize` refuses as out of range
        try:
            here = self.pid_from_caller(pid, peer.pid)
        except NamespaceUnreadable as exc:
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"cannot tell which process pid {pid} is: the caller (pid {peer.pid} on this host) runs in another "
                f"pid namespace (a container's), and the kernel refused the daemon a read of its processes' pid "
                f"namespace (/proc/<pid>/ns/pid: {exc.error.strerror or exc.error}): the daemon lacks "
                "CAP_SYS_PTRACE, which reading another user's, or a root container's, needs; give it that "
                "capability (the shipped systemd unit does), or name the caller's own pid",
            ) from exc
        if here is None:
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"cannot tell which process pid {pid} is: the caller (pid {peer.pid} on this host) runs in another "
                "pid namespace (a container's) with no process of that pid the daemon can see, or has exited; "
                "name the pid as it is inside the caller's own namespace, or name none",
            )
        if here != pid:
            request.request.pid = here  # type: ignore[attr-defined]  # _request_pid found it there

    def _may_name(self, pid: int, app_id: str, peer: PeerCred | None) -> bool:
        """A grant tied to a pid caps that process's cgroup: the caller must be the process's own
        user (the kernel's word, from the socket), or the process must report that it runs the
        application (its in-app report, owned by its own user)."""
        if peer is not None and self.pid_runs_as(pid, peer.uid):
            return True
        return self.pid_proof is not None and self.pid_proof(pid, app_id)

    @staticmethod
    def _pid_refusal(principal: Principal, pid: int, app_id: str, peer: PeerCred | None) -> str:
        who = principal.describe()
        if peer is None:  # TCP, or the front is off: the caller's uid is unknown
            return (f"{who} may not name process {pid}: the caller's user is unknown on this connection and the "
                    f"process does not report itself as {app_id!r} (a fresh in-app report of its own user); "
                    "naming it needs the operator token")
        return (f"{who} (uid {peer.uid}) may not name process {pid}: it does not run as uid {peer.uid} (or does "
                f"not exist) and does not report itself as {app_id!r} (a fresh in-app report of its own user); "
                "naming another user's process needs the operator token")

    async def claim(self, app_id: str, uid: int | None = None) -> tuple[str, bool]:
        """Mark the application owned (self-registered by `uid`; None: by the operator), write its
        token file, and return the token and whether the call's failure is to give the claim back
        (`unclaim`): a new claim. An id its own uid claimed before and kept (`_reclaimable`) keeps
        its claim whatever the call does: its token was handed out, and a claim given up could be
        taken by another user, who would be issued the same token. A claim a failed call gave back
        that the store could not forget (`unclaims_pending`) is forgotten first, so the id is
        claimed afresh, by this caller. On any failure nothing new stays claimed and ClaimFailed says
        why. The registry is called on the caller's thread (the daemon's store is a SQLite connection
        bound to it); the file is written in a worker thread, so a slow disk never stalls the event
        loop's other calls."""
        self._retry_unclaims()
        if app_id in self.unclaims_pending:
            raise ClaimFailed("cannot record the new application: the state directory still refuses to forget the "
                              "claim an earlier call for it gave back")
        try:
            new = self.registry.claim_app(app_id, uid)
        except Exception as exc:  # noqa: BLE001 - the store says why (a full disk, a damaged file)
            raise ClaimFailed(f"cannot record the new application: {exc}") from exc
        try:
            await asyncio.to_thread(self.authority.write_app_token, app_id)
        except AuthSetupError as exc:
            if new:
                await self.unclaim(app_id)
            raise ClaimFailed(f"cannot write the application's token file: {exc.__cause__ or exc}") from exc
        return self.authority.token_for(f"app:{app_id}"), new

    async def unclaim(self, app_id: str) -> bool:
        """Undo `claim` (the call it was for failed): the id is free again; True when it is. When
        the store cannot forget the claim (a full disk), the claim and its token file both stay as
        they are, consistent with each other, and the id is kept in `unclaims_pending`, to be
        forgotten by a later claim or unclaim once the store takes writes again, a claim of this id
        first of all: the caller retrying the call it was told changed nothing gets the id and its
        token (`_reclaimable`; after a restart, when it is no longer known as pending, if the same
        uid claimed it). A token file whose
        claim is gone is harmless (it names nothing the ledger holds, and the id may be claimed
        again, which rewrites it)."""
        try:
            self._drop_claim(app_id)
        except Exception:  # noqa: BLE001 - a full disk, a damaged file: kept for a retry
            self.unclaims_pending.add(app_id)
            return False
        self._retry_unclaims()
        return True

    def _drop_claim(self, app_id: str) -> None:
        """Forget a claim: its row (raises, nothing changed, when the store refuses), then its pending
        mark and its token file."""
        self.registry.unclaim_app(app_id)
        self.unclaims_pending.discard(app_id)
        with contextlib.suppress(OSError):
            self.authority.app_token_path(app_id).unlink()

    def _retry_unclaims(self) -> None:
        """Forget the claims failed calls gave back that the store could not forget then; stops at
        the first refusal (the disk is still full)."""
        for app_id in list(self.unclaims_pending):
            if self.ledger.has_app(app_id):  # the operator made grants for it meanwhile: it is owned
                self.unclaims_pending.discard(app_id)
                continue
            try:
                self._drop_claim(app_id)
            except Exception:  # noqa: BLE001 - still refused: kept for the next try
                return


    async def forget(self, app_ids: Sequence[str], uid: int | None = None) -> tuple[list[str], list[tuple[str, str]]]:
        """Drop the claims of `app_ids`, and of every id `uid` self-registered, that hold nothing (no
        grant, no limits): the operator's remedy for ids claimed and left (`vgpu forget-app`). Each
        dropped claim's token file is deleted; the token itself stays valid for the id (tokens are
        derived from the id and the daemon's secret), so whoever held it acts for the id again once
        anyone claims it anew. The ids forgotten, and those kept with why."""
        wanted = list(dict.fromkeys([*app_ids, *(self.registry.claimed_by(uid) if uid is not None else [])]))
        forgotten: list[str] = []
        kept: list[tuple[str, str]] = []
        async with self.claim_lock:
            for app_id in wanted:
                if not self.registry.app_claimed(app_id):
                    kept.append((app_id, "not claimed"))
                elif self.ledger.has_app(app_id):
                    kept.append((app_id, "holds grants or limits: release them, and clear its limits, first"))
                else:
                    try:
                        self._drop_claim(app_id)
                    except Exception as exc:  # noqa: BLE001 - a full disk: said, and the rest kept too
                        kept.append((app_id, f"the state directory refused the change: {exc}"))
                        continue
                    forgotten.append(app_id)
        return forgotten, kept


class ClaimFailed(Exception):
    """A new application could not be claimed (its row or its token file could not be written)."""


def _request_pid(request: object) -> int:
    inner = getattr(request, "request", None)
    pid = getattr(inner, "pid", 0) if inner is not None else 0
    return pid if isinstance(pid, int) else 0


def _request_app_id(request: object) -> str:
    inner = getattr(request, "request", None)
    return str(getattr(inner, "app_id", "") if inner is not None else getattr(request, "app_id", ""))


def caller_label(principal: Principal, peer: PeerCred | None) -> str:
    """The caller's name for per-caller bounds: callers without a token are one caller per uid where
    the uid is known (one user's anonymous watchers cannot use up another's share), else one."""
    if principal.role == "anonymous" and peer is not None:
        return f"anonymous (uid {peer.uid})"
    return principal.describe()


def audit_fields(principal: Principal, peer: PeerCred | None, address: str) -> dict[str, object]:
    """Who made a call, for the log lines of what it changed: its role (`caller`: "operator",
    "profiler", "app:<id>", "anonymous") and how it proved it (`caller_via`), and the kernel's word
    on its process over a Unix socket (`caller_uid`, `caller_pid`, in the daemon's pid namespace),
    else its address (`caller_addr`, TCP)."""
    fields: dict[str, object] = {"caller": principal.describe(), "caller_via": principal.via}
    if peer is not None:
        fields.update(caller_uid=peer.uid, caller_pid=peer.pid)
    elif address:
        fields["caller_addr"] = address
    return fields


def _peer_text(context: Any) -> str:
    try:
        peer = context.peer()
    except Exception:  # noqa: BLE001 - a context without a peer (a test's stand-in): unknown
        return ""
    return peer.decode("utf-8", "replace") if isinstance(peer, bytes) else str(peer or "")


def _verified_client_cert(context: Any) -> bool:
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001 - no auth context: not TLS
        return False
    kind = [v.decode() if isinstance(v, bytes) else v for v in auth.get("transport_security_type", [])]
    return "ssl" in kind and bool(auth.get("x509_common_name") or auth.get("x509_subject"))


Behavior = Callable[..., Any]
Before = Callable[[object, Any], Awaitable[Any]]
After = Callable[[Any, Any, bool], Awaitable[None]]


def wrap_handler(
    handler: grpc.RpcMethodHandler[Any, Any], before: Before, after: After | None = None
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler that awaits `before(request, context)` (request is None for client-streaming
    calls; it aborts the call to deny it), then runs the original, then always awaits
    `after(state, context, ok)` where `state` is what `before` returned and `ok` says whether the
    original returned normally. Both streaming styles (async generator, context.write) are kept."""

    async def run(request: object, context: Any, body: Callable[[], Awaitable[Any]]) -> Any:
        state = await before(request, context)
        ok = False
        try:
            result = await body()
            ok = True
            return result
        finally:
            if after is not None:
                await after(state, context, ok)

    async def run_gen(request: object, context: Any, items: Callable[[], AsyncIterator[Any]]) -> AsyncIterator[Any]:
        state = await before(request, context)
        ok = False
        try:
            async for item in items():
                yield item
            ok = True
        finally:
            if after is not None:
                await after(state, context, ok)

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        uu = handler.unary_unary

        async def uu_wrapped(request: object, context: Any) -> Any:
            return await run(request, context, lambda: uu(request, context))

        return grpc.unary_unary_rpc_method_handler(uu_wrapped, **kw)
    if handler.stream_unary is not None:
        su = handler.stream_unary

        async def su_wrapped(requests: Any, context: Any) -> Any:
            return await run(None, context, lambda: su(requests, context))

        return grpc.stream_unary_rpc_method_handler(su_wrapped, **kw)
    streaming: Behavior | None = handler.unary_stream if handler.unary_stream is not None else handler.stream_stream
    assert streaming is not None, "a method handler has one behaviour"
    client_streams = handler.unary_stream is None
    make = grpc.stream_stream_rpc_method_handler if client_streams else grpc.unary_stream_rpc_method_handler

    if inspect.isasyncgenfunction(streaming):

        async def gen_wrapped(request: Any, context: Any) -> AsyncIterator[Any]:
            # grpc picks the streaming style with inspect.isasyncgenfunction: this must be one.
            async for item in run_gen(None if client_streams else request, context, lambda: streaming(request, context)):
                yield item

        return make(gen_wrapped, **kw)

    async def co_wrapped(request: Any, context: Any) -> Any:
        return await run(None if client_streams else request, context, lambda: streaming(request, context))

    return make(co_wrapped, **kw)


# Records of refused calls: at most DENIAL_LOG_BURST per (caller, method, code) in each interval.
DENIAL_LOG_INTERVAL_S = 60.0
DENIAL_LOG_BURST = 10
_DENIAL_LOG_MAX_KEYS = 4096


class DenialLog(LogBudget):
    """Which refusals get an `access_denied` record (`vgpu.log.LogBudget`, keyed by caller, uid,
    method and code): the first `DENIAL_LOG_BURST` of each key in each `DENIAL_LOG_INTERVAL_S`."""

    def __init__(self, *, interval_s: float = DENIAL_LOG_INTERVAL_S, burst: int = DENIAL_LOG_BURST,
                 max_keys: int = _DENIAL_LOG_MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(interval_s=interval_s, burst=burst, max_keys=max_keys, clock=clock)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Applies `AccessControl` to every call before the servicer sees it."""

    def __init__(
        self,
        access: AccessControl,
        *,
        logger: structlog.typing.FilteringBoundLogger | None = None,
        on_denied: Callable[[str, grpc.StatusCode], None] | None = None,
        denial_log: DenialLog | None = None,
    ) -> None:
        self.access = access
        self._log = logger or get_logger("vgpu.auth")
        self._on_denied = on_denied
        self._denial_log = denial_log or DenialLog()
        # While the state directory is full every new id's claim fails: one record per failure would
        # let any caller fill the journal too (the first ten per uid a minute, then a count)
        self._claim_failure_log = LogBudget()
        # Claims of new application ids are serialised so two anonymous callers cannot both win.
        self._claim_lock = access.claim_lock
        self._pending_token: dict[str, str] = {}

    async def _deny(self, context: Any, method: str, caller: str, denied: Denied, peer: PeerCred | None = None) -> None:
        if self._on_denied is not None:
            self._on_denied(method, denied.code)
        since = self._denial_log.admit((caller, peer.uid if peer is not None else None, method, denied.code))
        if since is not None:
            where: dict[str, object] = {"uid": peer.uid, "pid": peer.pid} if peer is not None else {}
            if since:
                where["denied_since_last_record"] = since
            self._log.warning("access_denied", method=method, caller=caller, code=denied.code.name,
                              reason=denied.reason, **where)
        await context.abort(denied.code, denied.reason)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        need = need_for(method)
        if handler is None or need == "open":
            return handler
        metadata = tuple(handler_call_details.invocation_metadata or ())
        access = self.access

        async def before(request: object, context: Any) -> tuple[str | None, bool, bool]:
            caller = "bad-token"
            address = _peer_text(context)
            peer = access.peer(address)
            try:
                principal = access.identify(metadata, verified_client_cert=_verified_client_cert(context))
                caller = principal.describe()
                if need == "app_request":
                    access.place_pid(request, peer)
                claim = access.authorize(need, principal, request, peer)
            except Denied as denied:
                await self._deny(context, method, caller, denied, peer)
                raise  # abort raises; never reached
            _CALLER.set(principal.app_id if principal.role == "app" else claim)
            _PRINCIPAL.set(caller_label(principal, peer))
            _BOUNDED_UID.set(uid_bound(principal, peer))
            # every line logged for this call (granted, released, limits_set, reclaimed, ...) says who
            # asked: the call runs in its own task, so the binding ends with it
            structlog.contextvars.bind_contextvars(**audit_fields(principal, peer, address))
            if claim is None and principal.role == "operator" and need == "app_request":
                app_id = _request_app_id(request)
                if app_id and app_id_problem(app_id) is None and not access.registry.app_claimed(app_id):
                    claim = app_id  # the operator's first grant for an app creates its token file
            if claim is None:
                return None, False, False
            await self._claim_lock.acquire()
            try:  # re-check under the lock: another caller may have claimed it meanwhile
                access.authorize(need, principal, request, peer)
            except Denied as denied:
                self._claim_lock.release()
                await self._deny(context, method, caller, denied, peer)
                raise
            # Validate, then write: the claim (its row and token file) is made before the call
            # changes anything, so a claim that cannot be written fails the call with nothing done,
            # and a call that fails gives the claim back (`after`).
            try:
                self._pending_token[claim], give_back = await access.claim(
                    claim, peer.uid if peer is not None and principal.role == "anonymous" else None)
            except ClaimFailed as exc:
                self._claim_lock.release()
                since = self._claim_failure_log.admit((peer.uid if peer is not None else None,))
                if since is not None:
                    self._log.error("app_claim_failed", method=method, app=claim, error=str(exc),
                                    **({"failed_since_last_record": since} if since else {}))
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; free space in the state directory and retry")
                raise
            return claim, True, give_back

        async def after(state: tuple[str | None, bool, bool], context: Any, ok: bool) -> None:
            claim, locked, give_back = state
            try:
                if claim is not None:
                    token = self._pending_token.pop(claim, "")
                    if ok:
                        context.set_trailing_metadata(((APP_TOKEN_TRAILER, token),))
                        self._log.info("app_claimed", app=claim, token_file=str(access.authority.app_token_path(claim)))
                    elif give_back and not await access.unclaim(claim):
                        self._log.warning("app_unclaim_pending", app=claim,
                                          reason="the state directory refused to forget the claim; kept, with its "
                                                 "token file, for the claiming uid's retry, and forgotten once it "
                                                 "takes writes again")
            finally:
                if locked:
                    self._claim_lock.release()

        return wrap_handler(handler, before, after)
