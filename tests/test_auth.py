"""vgpu/auth.py: tokens, the access policy, and the interceptor in front of the real Allocator servicer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import stat
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from vgpu import auth
from vgpu.auth import AccessControl, AuthInterceptor, Denied, Principal, TokenAuthority
from vgpu.peers import PeerCred
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc


# --- tokens -------------------------------------------------------------------------------------------
def test_tokens_round_trip_and_reject_forgeries(tmp_path: Path) -> None:
    ta = TokenAuthority(tmp_path / "tokens")
    assert ta.verify(ta.token_for("operator")) == Principal("operator", via="token")
    assert ta.verify(ta.token_for("app:a/b c")) == Principal("app", app_id="a/b c", via="token")
    forged = ta.token_for("app:a").replace(auth._b64(b"app:a"), auth._b64(b"operator"))
    assert ta.verify(forged) is None
    other = TokenAuthority(tmp_path / "other")
    assert other.verify(ta.token_for("operator")) is None
    for junk in ("", "vgpu1", "vgpu1.!!.00", "Bearer x", "vgpu1.b3BlcmF0b3I.zz", ta.token_for("nobody")):
        assert ta.verify(junk) is None, junk
    # Stable across restarts: the secret is kept in the token directory.
    assert TokenAuthority(tmp_path / "tokens").verify(ta.token_for("operator")) is not None


def test_token_files_are_private(tmp_path: Path) -> None:
    ta = TokenAuthority(tmp_path / "tokens")
    paths = ta.write_role_tokens()
    app_path = ta.write_app_token("job/1")
    for path in [*paths.values(), app_path, tmp_path / "tokens" / "secret"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert ta.verify(paths["operator"].read_text()) == Principal("operator", via="token")
    assert app_path.name == auth.app_token_filename("job/1") and len(app_path.name) == 64 + len(".token")
    assert ta.verify(app_path.read_text()) == Principal("app", app_id="job/1", via="token")


def test_group_readable_operator_token(tmp_path: Path) -> None:
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    ta = TokenAuthority(tmp_path / "tokens", operator_group=group)
    path = ta.write_role_tokens()["operator"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.stat().st_gid == os.getgid()


def test_unknown_group_and_bad_secret_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(auth.AuthSetupError, match="group 'no-such-group-xyz' does not exist"):
        TokenAuthority(tmp_path / "t", operator_group="no-such-group-xyz")
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "secret").write_bytes(b"short")
    with pytest.raises(auth.AuthSetupError, match="holds 5 bytes"):
        TokenAuthority(tmp_path / "u")


# --- the policy, without gRPC ------------------------------------------------------------------------------
@dataclass
class Registry:
    claimed: dict[str, int | None] = field(default_factory=dict)

    def app_claimed(self, app_id: str) -> bool:
        return app_id in self.claimed

    def claim_app(self, app_id: str, uid: int | None = None) -> bool:
        new = app_id not in self.claimed
        self.claimed.setdefault(app_id, uid)
        return new

    def unclaim_app(self, app_id: str) -> bool:
        return self.claimed.pop(app_id, -1) != -1

    def claimed_count(self, uid: int | None = None) -> int:
        return len(self.claimed) if uid is None else sum(1 for u in self.claimed.values() if u == uid)

    def claim_uid(self, app_id: str) -> int | None:
        return self.claimed.get(app_id)

    def claimed_by(self, uid: int) -> list[str]:
        return sorted(a for a, u in self.claimed.items() if u == uid)


@dataclass
class Grants:
    owners: dict[str, str] = field(default_factory=dict)

    def grant_owner(self, grant_id: str) -> str | None:
        return self.owners.get(grant_id)

    def has_app(self, app_id: str) -> bool:
        return app_id in self.owners.values()


def _access(tmp_path: Path, **kw: bool) -> AccessControl:
    return AccessControl(
        TokenAuthority(tmp_path / "tokens"),
        Registry({"a": None}),
        Grants({"ga": "a", "gx": "unclaimed-but-granted"}),
        **kw,
    )


def _req(app_id: str) -> pb.RequestResourceAllocationRequest:
    return pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app_id, memory_mib=1))


OP = Principal("operator")
APP_A = Principal("app", "a")
APP_B = Principal("app", "b")
PROF = Principal("profiler")
ANON = auth.ANONYMOUS
DENY = grpc.StatusCode.PERMISSION_DENIED
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("need", "who", "req", "expect"),
    [
        ("operator", OP, None, None),
        ("operator", APP_A, None, DENY),
        ("operator", PROF, None, DENY),
        ("operator", ANON, None, UNAUTH),
        ("profiler", PROF, None, None),
        ("profiler", APP_A, None, DENY),
        ("profiler", ANON, None, UNAUTH),
        ("read", ANON, None, None),
        ("app_request", APP_A, _req("a"), None),
        ("app_request", APP_B, _req("a"), DENY),
        ("app_request", ANON, _req("a"), DENY),  # claimed by someone else
        ("app_request", ANON, _req("unclaimed-but-granted"), DENY),  # the ledger knows it
        ("app_request", ANON, _req("new"), "new"),  # claimable
        ("app_request", OP, _req("a"), None),
        ("app_grant", APP_A, pb.ReleaseResourcesRequest(grant_id="ga"), None),
        ("app_grant", APP_B, pb.ReleaseResourcesRequest(grant_id="ga"), DENY),
        ("app_grant", PROF, pb.ReleaseResourcesRequest(grant_id="ga"), DENY),
        ("app_grant", ANON, pb.ReleaseResourcesRequest(grant_id="ga"), UNAUTH),
        ("app_grant", OP, pb.ReleaseResourcesRequest(grant_id="ga"), None),
        ("app_grant", APP_B, pb.ReleaseResourcesRequest(grant_id="missing"), None),  # servicer: NOT_FOUND
        ("app_grant", ANON, pb.ReleaseResourcesRequest(grant_id="missing"), None),  # NOT_FOUND, not UNAUTHENTICATED
    ],
)
def test_policy(tmp_path: Path, need: auth.Need, who: Principal, req: object, expect: object) -> None:
    access = _access(tmp_path)
    if isinstance(expect, grpc.StatusCode):
        with pytest.raises(Denied) as info:
            access.authorize(need, who, req)
        assert info.value.code == expect
    else:
        assert access.authorize(need, who, req) == expect


def test_closed_reads_and_no_self_registration(tmp_path: Path) -> None:
    access = _access(tmp_path, open_reads=False, app_self_registration=False)
    with pytest.raises(Denied):
        access.authorize("read", ANON, None)
    assert access.authorize("read", APP_B, None) is None
    with pytest.raises(Denied) as info:
        access.authorize("app_request", ANON, _req("new"))
    assert info.value.code == UNAUTH


def test_identify(tmp_path: Path) -> None:
    access = _access(tmp_path)
    tok = access.authority.token_for("app:a")
    assert access.identify(auth.bearer(tok), verified_client_cert=False) == Principal("app", "a", "token")
    assert access.identify((), verified_client_cert=False) == ANON
    assert access.identify((), verified_client_cert=True) == Principal("profiler", via="mtls")
    for bad in ((("authorization", "Bearer nope"),), (("authorization", "Basic abc"),)):
        with pytest.raises(Denied) as info:
            access.identify(bad, verified_client_cert=False)
        assert info.value.code == UNAUTH


def test_unknown_methods_need_the_operator() -> None:
    assert auth.need_for("/vgpu.v1.Allocator/SomethingNew") == "operator"
    assert auth.need_for("/grpc.health.v1.Health/Check") == "open"
    assert auth.need_for("/vgpu.v1.Allocator/SetResourceLimits") == "operator"


# --- through gRPC, in front of the real servicer -----------------------------------------------------------
# Every call carries a deadline, so a lost reply fails the test in seconds instead of stalling the run.
RPC_TIMEOUT_S = 10.0


@dataclass
class Served:
    channel: grpc.aio.Channel
    stub: pb_grpc.AllocatorStub
    authority: TokenAuthority
    allocator: object

    def tok(self, scope: str) -> tuple[tuple[str, str], ...]:
        return auth.bearer(self.authority.token_for(scope))


@contextlib.asynccontextmanager
async def _serve(tmp_path: Path, authority: TokenAuthority, registry: Registry | None = None,
                 peer_of: Callable[[str], PeerCred | None] | None = None) -> AsyncIterator[Served]:
    from vgpu.allocator.core import Allocator
    from vgpu.allocator.service import AllocatorServicer, build_server
    from vgpu.daemon.serve import LedgerView
    from vgpu.device.sim import SimBackend

    allocator = Allocator(SimBackend(["h100-80gb"]), dry_run=False)
    access = AccessControl(authority, registry if registry is not None else Registry(), LedgerView(allocator),
                           peer_of=peer_of)
    sock = f"unix:{tmp_path}/s.sock"
    server = build_server(
        sock,
        allocator_servicer=AllocatorServicer(allocator, identify=auth.identify_caller),
        interceptors=[AuthInterceptor(access)],
    )
    await server.start()
    channel = grpc.aio.insecure_channel(sock)
    try:
        yield Served(channel, pb_grpc.AllocatorStub(channel), authority, allocator)
    finally:
        allocator.stop()  # ends open watch streams
        await asyncio.wait_for(channel.close(), RPC_TIMEOUT_S)
        await asyncio.wait_for(server.stop(0), RPC_TIMEOUT_S)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async with _serve(tmp_path, TokenAuthority(tmp_path / "tokens")) as s:
        yield s


async def _request(s: Served, app: str, mib: float, md: tuple[tuple[str, str], ...] = ()) -> tuple[pb.Grant, str]:
    msg = pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app, memory_mib=mib))
    call = s.stub.RequestResourceAllocation(msg, metadata=md, timeout=RPC_TIMEOUT_S)
    resp = await call
    trailers = dict(await call.trailing_metadata() or ())
    return resp.grant, trailers.get(auth.APP_TOKEN_TRAILER, "")


async def test_an_app_cannot_release_or_resize_anothers_grant(served: Served) -> None:
    grant_a, token_a = await _request(served, "a", 1024)
    assert served.authority.verify(token_a) == Principal("app", "a", "token")
    before = served.allocator.ledger.to_records()  # type: ignore[attr-defined]
    with capture_logs() as logs:
        for md, code in ((served.tok("app:b"), DENY), ((), UNAUTH), ((("authorization", "Bearer forged"),), UNAUTH)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await served.stub.ReleaseResources(
                    pb.ReleaseResourcesRequest(grant_id=grant_a.grant_id), metadata=md, timeout=RPC_TIMEOUT_S
                )
            assert info.value.code() == code
        # "Resizing" is a request on the app's behalf; b may not do it either, nor claim a again.
        for md in (served.tok("app:b"), ()):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _request(served, "a", 4096, md)
            assert info.value.code() == DENY
    assert served.allocator.ledger.to_records() == before  # type: ignore[attr-defined]
    denied = [e for e in logs if e["event"] == "access_denied"]
    assert len(denied) == 5 and {e["method"] for e in denied} >= {"/vgpu.v1.Allocator/ReleaseResources"}
    # The owner and the operator may.
    await served.stub.ReleaseResources(
        pb.ReleaseResourcesRequest(grant_id=grant_a.grant_id), metadata=auth.bearer(token_a), timeout=RPC_TIMEOUT_S
    )
    grant_a2, _ = await _request(served, "a", 10, served.tok("app:a"))
    await served.stub.ReleaseResources(
        pb.ReleaseResourcesRequest(grant_id=grant_a2.grant_id), metadata=served.tok("operator"), timeout=RPC_TIMEOUT_S
    )
    assert served.allocator.ledger.grants() == []  # type: ignore[attr-defined]


async def test_operator_calls_need_the_role(served: Served) -> None:
    limits = pb.SetResourceLimitsRequest(limits=pb.AppLimits(app_id="a", max_memory_mib=100))
    for md, code in ((served.tok("app:a"), DENY), (served.tok("profiler"), DENY), ((), UNAUTH)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.SetResourceLimits(limits, metadata=md, timeout=RPC_TIMEOUT_S)
        assert info.value.code() == code
    assert served.allocator.ledger.limits("a") is None  # type: ignore[attr-defined]
    resp = await served.stub.SetResourceLimits(limits, metadata=served.tok("operator"), timeout=RPC_TIMEOUT_S)
    assert resp.limits.max_memory_mib == 100


async def test_reads_are_open_and_failed_requests_claim_nothing(served: Served) -> None:
    avail = await served.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=RPC_TIMEOUT_S)
    assert len(avail.devices) == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _request(served, "big", 10_000_000)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Nothing was claimed by the failed call: a later caller may still claim "big".
    _, token = await _request(served, "big", 10)
    assert token


@dataclass
class FullDisk(Registry):
    """A store whose disk fills: while `full`, a claim is still written but forgetting one fails."""

    full: bool = False

    def unclaim_app(self, app_id: str) -> bool:
        if self.full:
            raise sqlite3.OperationalError("disk I/O error")
        return super().unclaim_app(app_id)


async def test_a_failed_call_whose_claim_cannot_be_forgotten_leaves_the_id_free(tmp_path: Path) -> None:
    """The store cannot delete the claim a failed call gives back (its disk is full): the claim and
    its token file stay together, and once the store takes writes the caller's retry (told the call
    changed nothing) claims the id afresh and gets its token. A claim such a failure left behind
    without anything pending in memory (a restart) is its own uid's to claim again, and no other's."""
    registry = FullDisk(full=True)
    uid = {"n": 1000}
    authority = TokenAuthority(tmp_path / "tokens")
    async with _serve(tmp_path, authority, registry, peer_of=lambda _p: PeerCred(pid=1, uid=uid["n"], gid=1)) as s:
        with capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as info:
            await _request(s, "big", 10_000_000)  # refused after the claim was written
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert registry.claimed == {"big": 1000} and authority.app_token_path("big").exists()
        assert [e["app"] for e in logs if e["event"] == "app_unclaim_pending"] == ["big"]
        with pytest.raises(grpc.aio.AioRpcError) as info:  # the disk is still full: nothing changes
            await _request(s, "big", 10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and registry.claimed == {"big": 1000}
        registry.full = False
        grant, token = await _request(s, "big", 10)  # the retry
        assert grant.app_id == "big" and authority.verify(token) == Principal("app", "big", "token")
        assert registry.claimed == {"big": 1000}
        # what a failure left behind before a restart: claimed by uid 1000, no token file, nothing pending
        registry.claimed["old"] = 1000
        uid["n"] = 1001
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _request(s, "old", 10)
        assert info.value.code() == DENY
        uid["n"] = 1000
        with pytest.raises(grpc.aio.AioRpcError):
            await _request(s, "old", 10_000_000)  # a failed call does not give back a claim it did not make
        assert registry.claimed["old"] == 1000
        _, token = await _request(s, "old", 10)
        assert authority.verify(token) == Principal("app", "old", "token")


class _NoSpace(Registry):
    """A store on a full disk: no new claim can be written."""

    def claim_app(self, app_id: str, uid: int | None = None) -> bool:
        raise sqlite3.OperationalError("database or disk is full")


async def test_claims_failing_on_a_full_disk_do_not_fill_the_log(tmp_path: Path) -> None:
    """Every new id's claim fails while the state directory is full: each call is answered UNAVAILABLE,
    and a caller looping over new ids gets ten `app_claim_failed` records a minute, not one per call."""
    authority = TokenAuthority(tmp_path / "tokens")
    async with _serve(tmp_path, authority, _NoSpace(), peer_of=lambda _p: PeerCred(pid=1, uid=1000, gid=1)) as s:
        with capture_logs() as logs:
            for k in range(40):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _request(s, f"new-{k}", 10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        failed = [e for e in logs if e["event"] == "app_claim_failed"]
        assert len(failed) == 10 and failed[0]["app"] == "new-0" and "disk is full" in failed[0]["error"]


async def test_watch_stream_passes_through(served: Served) -> None:
    call = served.stub.WatchAllocations(pb.WatchAllocationsRequest(app_id="w"), timeout=RPC_TIMEOUT_S)
    # The watch must be registered before the grant, or its event is (rightly) not delivered: the
    # watch RPC and the request race through the server, and under load the request often wins
    # (without a wait, about half the runs on a loaded 2-core machine waited forever in read()).
    # The server sends initial metadata once the subscription is registered.
    await asyncio.wait_for(call.initial_metadata(), RPC_TIMEOUT_S)
    assert served.allocator.watchers == 1  # type: ignore[attr-defined]
    await _request(served, "w", 5)
    event = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
    assert event.kind == pb.AllocationEvent.GRANTED and event.grant.app_id == "w"
    call.cancel()


class _SlowDisk(TokenAuthority):
    """A token directory on a disk that stalls: each app token write waits until released."""

    def __init__(self, token_dir: Path) -> None:
        super().__init__(token_dir)
        self.writing = threading.Event()
        self.release = threading.Event()

    def write_app_token(self, app_id: str) -> Path:
        self.writing.set()
        assert self.release.wait(RPC_TIMEOUT_S), "the test never released the write"
        return super().write_app_token(app_id)


async def test_a_slow_token_write_does_not_stall_other_calls(tmp_path: Path) -> None:
    disk = _SlowDisk(tmp_path / "tokens")
    async with _serve(tmp_path, disk) as s:
        claiming = asyncio.ensure_future(_request(s, "slow", 5))
        assert await asyncio.to_thread(disk.writing.wait, RPC_TIMEOUT_S), "the claim never wrote its token"
        # The claim is stuck in its token write; the event loop still answers everyone else.
        # (its deadline stays well short of the write's RPC_TIMEOUT_S wait, so that a loop blocked by
        # the write fails here instead of being answered once the write gives up; half of it leaves
        # a loaded machine room)
        avail = await s.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=RPC_TIMEOUT_S / 2)
        # (the claim is written before the grant is made: nothing is granted until it is on disk)
        assert avail.devices[0].mem_granted_mib == 0
        assert not claiming.done()
        disk.release.set()
        _, token = await asyncio.wait_for(claiming, RPC_TIMEOUT_S)
        assert disk.verify(token) == Principal("app", "slow", "token")
        assert disk.verify(disk.app_token_path("slow").read_text()) == Principal("app", "slow", "token")


def test_denial_records_are_bounded_per_key_and_say_how_many_were_left_out() -> None:
    now = [0.0]
    log = auth.DenialLog(interval_s=60.0, burst=2, max_keys=2, clock=lambda: now[0])
    a, b = ("anonymous", 1000, "/m", "UNAUTHENTICATED"), ("app:x", 1000, "/m", "PERMISSION_DENIED")
    assert [log.admit(a) for _ in range(5)] == [0, 0, None, None, None]
    assert log.admit(b) == 0  # another key keeps its own records
    now[0] = 59.9
    assert log.admit(a) is None
    now[0] = 60.0  # a new interval: the next record says how many were left out before it
    assert [log.admit(a), log.admit(a), log.admit(a)] == [4, 0, None]
    now[0] = 200.0
    c = ("anonymous", 1001, "/m", "UNAUTHENTICATED")
    assert log.admit(c) == 0 and len(log._keys) <= 2  # keys whose interval is over are forgotten
    with pytest.raises(ValueError):
        auth.DenialLog(burst=0)


def test_denial_records_hold_at_most_max_keys_while_every_key_is_live() -> None:
    """A caller that makes up keys faster than their interval ends (app ids it claimed, each
    refused on every method) must not grow the budget past `max_keys`: the keys held are what the
    daemon keeps in memory, and each new key once rebuilt the whole table when it was full."""
    now = [0.0]
    log = auth.DenialLog(interval_s=60.0, burst=1, max_keys=8, clock=lambda: now[0])
    for i in range(100):
        now[0] = i * 0.01  # all within one interval: none has expired
        assert log.admit((f"app:{i}", 1000, "/m", "PERMISSION_DENIED")) == 0
        assert len(log._keys) <= 8
    # the newest keys are the ones kept: a key just seen is still within its budget
    assert log.admit(("app:99", 1000, "/m", "PERMISSION_DENIED")) is None
