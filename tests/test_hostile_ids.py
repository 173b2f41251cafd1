"""Hostile application ids against a real `vgpu serve`: refused at the edge with a reason, nothing
written for them, and the daemon starts again on the same state directory."""

from __future__ import annotations

import grpc
import pytest
from daemon_fixtures import Env, Serve
from hostile import Raw, operator_token

from vgpu import auth
from vgpu.ids import app_id_problem, sanitize_app_id_part
from vgpu.v1 import allocator_pb2 as pb


def test_the_rule_in_short() -> None:
    assert app_id_problem("trainer-7") is None
    assert app_id_problem("team/job:3#2") is None
    assert app_id_problem("x" * 256) is None
    assert "257 characters (257 bytes)" in str(app_id_problem("x" * 257))
    for bad in ("", " lead", "trail ", "a b", "caf\u00e9", "zero\u200bwidth", "\u0430pple", "a\nb", "-x", "\U0001f600"):
        assert app_id_problem(bad) is not None, bad
    assert sanitize_app_id_part("Web Content (1)") == "Web_Content__1_"


def test_a_letter_outside_ascii_is_refused_as_such() -> None:
    """'ü' is a letter: a message saying that only letters are allowed would contradict itself."""
    problem = app_id_problem("\u00fc\U0001f642")
    assert problem is not None and "'\u00fc' (U+00FC)" in problem
    assert "only ASCII letters (A-Z, a-z), digits and" in problem and "starting with an ASCII letter" in problem
    assert "only letters" not in problem


def test_long_and_emoji_ids_are_refused_and_the_daemon_restarts(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env))
    # 250 ASCII characters: valid by the rule; its token file is named by a hash, so it fits.
    long_id = "a" * 250
    grant = client.request(long_id, 64)
    assert grant.app_id == long_id
    token_file = auth.app_token_file(long_id, env.state)
    assert token_file.is_file() and len(token_file.name) < 100
    # 257 characters and 21 emoji (84 bytes, well under 256 characters): INVALID_ARGUMENT, with a
    # reason and without the state directory's path; nothing granted, nothing claimed.
    for bad, says in (("b" * 257, "257 characters"), ("\U0001f600" * 21, "U+1F600"), ("evil ", "' '")):
        with pytest.raises(grpc.RpcError) as err:
            client.request(bad, 64)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert says in str(err.value.details()) and str(env.state) not in str(err.value.details())
    assert client.granted_mib() == 64
    assert [a.app_id for a in client.apps()] == [long_id]
    assert serves[-1].term() == 0
    # The same state directory starts again, with the valid grant.
    serves.append(Serve(env))
    assert serves[-1].event("reconciled")["grants_restored"] == 1
    assert client.granted_mib() == 64
    assert serves[-1].term() == 0


def test_the_operator_s_bad_id_is_refused_before_anything_is_claimed(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env))
    bad = "\U0001f600" * 21
    with pytest.raises(grpc.RpcError) as err:
        client.request(bad, 1, token=operator_token(env.state))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not [e for e in serves[-1].events() if e.get("event") in ("app_claimed", "app_claim_failed")]
    assert serves[-1].term() == 0


def test_a_job_s_long_text_is_refused_before_it_is_read_or_logged(env: Env, serves: list[Serve], client: Raw) -> None:
    """A model type of megabytes, from any user of the socket, cost the daemon 1-2 s of its event
    loop in name matching and wrote itself into two log records per request. (A request over
    server.max_request_bytes, 256 KiB, is now refused by gRPC before it is read: tests/test_hostile_halfsent.py;
    the longest text here stays under it, so the daemon's own check is what answers.)"""
    serves.append(Serve(env))
    serves[-1].wait_for("coldstart_sizer_loaded")  # so a job is sized, not answered "not ready"
    size_before = serves[-1].log_path.stat().st_size
    for field, text in (("model_type", "resnet " * 30_000), ("model_type", "x" * 257), ("optimizer", "a" * 33),
                        ("mode", "m" * 100_000), ("precision", "p" * 100_000)):
        job = pb.JobConfig(model_type="resnet50", batch_size=8, mode="infer")
        setattr(job, field, text)
        with pytest.raises(grpc.RpcError) as err:
            client.stub.RequestResourceAllocation(
                pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=f"big-{field}", job=job)),
                timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        details = str(err.value.details())
        assert f"{field} is {len(text)} characters long; at most" in details and len(details) < 300, details[:300]
    # nothing granted or claimed, and the log holds none of it
    assert client.granted_mib() == 0 and [a.app_id for a in client.apps()] == []
    assert serves[-1].log_path.stat().st_size - size_before < 20_000
    # a job within the bounds is sized as before
    ok = client.stub.RequestResourceAllocation(pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(
        app_id="fits", job=pb.JobConfig(model_type="r" * 256, batch_size=8, mode="infer"))), timeout=10)
    assert ok.grant.memory_mib > 0


def test_a_long_device_or_grant_id_is_refused_with_the_reason(env: Env, serves: list[Serve], client: Raw) -> None:
    """An unknown id is answered with the id in the message; past 16 KiB gRPC dropped that answer and
    the caller got RESOURCE_EXHAUSTED about metadata sizes instead of the reason."""
    serves.append(Serve(env))
    long = "d" * 20_000
    calls = (
        lambda: client.stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=long), timeout=10),
        lambda: client.stub.RequestResourceAllocation(pb.RequestResourceAllocationRequest(
            request=pb.ResourceRequest(app_id="dev", memory_mib=1, device_id=long)), timeout=10),
        lambda: client.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(device_id=long), timeout=10),
        lambda: client.stub.GetAppHistory(pb.GetAppHistoryRequest(device_id=long), timeout=10),
        lambda: client.stub.GetAppHistory(pb.GetAppHistoryRequest(app_id=long), timeout=10),
        lambda: next(iter(client.stub.WatchAllocations(pb.WatchAllocationsRequest(app_id=long), timeout=10))),
    )
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "is 20000 characters long; at most 256 are allowed" in str(err.value.details())
    assert [a.app_id for a in client.apps()] == []  # nothing claimed
    # an id within the bound that is not known is still NOT_FOUND, naming it
    with pytest.raises(grpc.RpcError) as err:
        client.stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id="g" * 256), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "g" * 256 in str(err.value.details())
