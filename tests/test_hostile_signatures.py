"""The profiler token may describe only processes the node runs: against a real `vgpu serve` that does
not accept replays, signatures naming a pid no GPU of the node lists (or none) are rejected with the
reason and make no forecast grant, while the operator token may still replay; in process, with a
simulated GPU whose processes the daemon's check reads, a process that runs there is taken and a pid
another application's signatures name is not."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from daemon_fixtures import Env, Serve
from hostile import Raw, operator_token

from vgpu import auth, config
from vgpu.daemon.serve import ObservedPids
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.manager.core import Manager, StreamState
from vgpu.traces import read_trace
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc
from vgpu.v1 import signature_pb2 as spb
from vgpu.wire import columns_from_signatures

TRACE = Path(__file__).resolve().parent.parent / "vgpu" / "data" / "demo_trace.csv.gz"


def _signatures(app_id: str, pid: int, device_id: str, n: int = 4) -> list[spb.BehavioralSignature]:
    now = time.time()
    out = []
    for i in range(n):
        s = spb.BehavioralSignature(app_id=app_id, pid=pid, device_id=device_id, timestamp_s=now - n + i, seq=i + 1)
        s.process.gpu_mem_used_mib = 30_000.0
        s.process.sm_util_pct = 50.0
        out.append(s)
    return out


def _stream(env: Env, token: str, sigs: list[spb.BehavioralSignature]) -> ingest_pb2.IngestReply:
    with grpc.insecure_channel(f"unix:{env.sock}") as ch:
        replies = ingest_pb2_grpc.IngestStub(ch).StreamSignatures(
            iter([ingest_pb2.SignatureBatch(tick=1, signatures=sigs)]), metadata=auth.bearer(token), timeout=10)
        reply: ingest_pb2.IngestReply = next(replies)
        replies.cancel()
    return reply


def _serving(serve: Serve) -> dict:  # type: ignore[type-arg]
    return next(e for e in serve.events() if e.get("event") == "serving")


def test_the_profiler_token_cannot_invent_processes_but_the_operator_may_replay(env: Env, serves: list[Serve],
                                                                                client: Raw) -> None:
    serves.append(Serve(env, "--accept-replay", "no"))
    assert _serving(serves[-1])["accept_replay"] is False
    gpu = client.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10).devices[0].device_id
    profiler = auth.read_token_file(auth.role_token_file("profiler", env.state))
    # A pid no GPU of this node runs (the attack: an 80 GB forecast grant for a made-up app), and no pid at all.
    made_up = _stream(env, profiler, _signatures("invented", 4_000_000, gpu) + _signatures("no-pid", 0, gpu))
    assert made_up.accepted == 0 and len(made_up.rejected) == 8
    assert "pid 4000000 is not a GPU process on device" in made_up.rejected[0].reason
    assert "names no pid" in made_up.rejected[4].reason
    assert "operator token" in made_up.rejected[0].reason
    assert not client.wait_granted("invented", 3.0)
    assert "invented" not in [a.app_id for a in client.apps()]
    # The operator's replay is taken, as before, and becomes a forecast grant.
    replay = _stream(env, operator_token(env.state), _signatures("replayed", 4_000_001, gpu))
    assert replay.accepted == 4 and not replay.rejected
    assert client.wait_granted("replayed", 20.0)
    assert serves[-1].term() == 0


def test_on_the_simulator_replays_are_taken_by_default(env: Env, serves: list[Serve], client: Raw) -> None:
    serves.append(Serve(env))
    assert _serving(serves[-1])["accept_replay"] is True  # auto: the simulator
    gpu = client.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10).devices[0].device_id
    profiler = auth.read_token_file(auth.role_token_file("profiler", env.state))
    assert _stream(env, profiler, _signatures("from-a-trace", 123, gpu)).accepted == 4
    assert serves[-1].term() == 0


def test_accept_replay_auto_means_no_on_nvml() -> None:
    cfg = config.load(None, env={}, overrides={"server.backend": "nvml"})
    assert config.accepts_replay(cfg) is False
    assert config.accepts_replay(config.load(None, env={}, overrides={"server.backend": "sim:h100-80gb"})) is True
    assert config.accepts_replay(config.load(None, env={}, overrides={"server.backend": "nvml",
                                                                       "manager.accept_replay": "yes"})) is True
    with pytest.raises(config.ConfigError, match="accept_replay"):
        config.load(None, env={}, overrides={"manager.accept_replay": "maybe"})


# --- in process: the check against a simulated GPU's own process list ------------------------------
@pytest.fixture
def node() -> Iterator[tuple[SimBackend, ManualClock, Manager, str]]:
    clock = ManualClock(1000.0)
    sim = SimBackend(["h100-80gb"], clock=clock)
    manager = Manager(None, pid_observed=ObservedPids(sim, clock=clock), clock=lambda: clock() + 1.7e9)
    yield sim, clock, manager, sim.devices()[0].uuid
    sim.close()


def _batch(app_id: str, pid: int, device_id: str, seq0: int = 1) -> ingest_pb2.SignatureBatch:
    sigs = _signatures(app_id, pid, device_id)
    for i, s in enumerate(sigs):
        s.seq = seq0 + i
    return ingest_pb2.SignatureBatch(tick=seq0, signatures=sigs)


def test_a_process_the_gpu_runs_is_taken_and_others_are_not(node: tuple[SimBackend, ManualClock, Manager, str]) -> None:
    sim, clock, manager, gpu = node
    trace = read_trace(TRACE)
    first = sorted(trace.apps)[0]
    sim.launch(first, 4242, trace.apps[first])
    untrusted = StreamState(replay_ok=False)
    assert manager.accept(_batch("trainer", 4242, gpu), untrusted).accepted == 4
    # another device's id, a pid the GPU does not run, another app naming the same process
    assert manager.accept(_batch("trainer", 4242, "GPU-elsewhere"), untrusted).accepted == 0
    reply = manager.accept(_batch("ghost", 5353, gpu), untrusted)
    assert reply.accepted == 0 and "pid 5353 is not a GPU process" in reply.rejected[0].reason
    reply = manager.accept(_batch("impostor", 4242, gpu), untrusted)
    assert reply.accepted == 0 and "named by application 'trainer'" in reply.rejected[0].reason
    assert manager.stats.unobserved_pid == 12
    # a stream that may replay (the operator's) takes what it sends, as before
    assert manager.accept(_batch("ghost", 5353, gpu), StreamState(replay_ok=True)).accepted == 4
    # a process that starts after the list was read is found at its next signature once the list is stale
    sim.launch(first, 6464, trace.apps[first])
    clock.advance(0.5)
    assert manager.accept(_batch("late", 6464, gpu), untrusted).accepted == 4


def test_the_columnar_form_is_checked_row_by_row(node: tuple[SimBackend, ManualClock, Manager, str]) -> None:
    sim, _clock, manager, gpu = node
    trace = read_trace(TRACE)
    first = sorted(trace.apps)[0]
    sim.launch(first, 4242, trace.apps[first])
    sigs = _signatures("trainer", 4242, gpu) + _signatures("ghost", 5353, gpu)
    columns, as_rows = columns_from_signatures(sigs)
    assert not as_rows
    batch = ingest_pb2.SignatureBatch(tick=1, columns=columns)
    reply = manager.accept(batch, StreamState(replay_ok=False))
    assert reply.accepted == 4
    assert sorted(r.index for r in reply.rejected) == [4, 5, 6, 7]
    assert all("pid 5353 is not a GPU process" in r.reason for r in reply.rejected)


def test_made_up_pids_cost_at_most_one_device_read_per_interval() -> None:
    clock = ManualClock(0.0)
    sim = SimBackend(["h100-80gb"], clock=clock)
    observed = ObservedPids(sim, clock=clock, max_age_s=1.0, min_refresh_s=0.2)
    gpu = sim.devices()[0].uuid
    for pid in range(1000, 2000):  # a stream of made-up pids within one instant
        assert not observed(gpu, pid)
    assert observed.reads == 1
    clock.advance(0.3)
    assert not observed(gpu, 1)
    assert observed.reads == 2
    sim.close()
