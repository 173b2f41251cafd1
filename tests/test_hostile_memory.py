"""A signature's memory reading is checked against the device it names: against a real `vgpu serve` on
the simulated H100, a profiler-token stream (the simulator takes replays, so no real pid is needed)
claiming 1e12 MiB for an application is rejected with the value and the device's total in the reason
and makes no forecast grant, while a normal application in the same batch is taken and granted; in
rows and in columns alike. In process: the slack at the total, the in-app reserved fallback, and a
MIG instance's own memory as the bound."""

from __future__ import annotations

import time
import urllib.request

import grpc
from daemon_fixtures import Env, Serve
from hostile import Raw

from vgpu import auth
from vgpu.allocator.core import Allocator
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.manager.core import Manager
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc
from vgpu.v1 import signature_pb2 as spb
from vgpu.wire import MAX_COUNTER, columns_from_signatures, mem_limit_mib


def _signatures(app_id: str, device_id: str, mem_mib: float, n: int = 4, pid: int = 123) -> list[spb.BehavioralSignature]:
    now = time.time()
    out = []
    for i in range(n):
        s = spb.BehavioralSignature(app_id=app_id, pid=pid, device_id=device_id, timestamp_s=now - n + i, seq=i + 1)
        s.process.gpu_mem_used_mib = mem_mib
        s.process.sm_util_pct = 50.0
        out.append(s)
    return out


def _stream(env: Env, batch: ingest_pb2.SignatureBatch) -> ingest_pb2.IngestReply:
    token = auth.read_token_file(auth.role_token_file("profiler", env.state))
    with grpc.insecure_channel(f"unix:{env.sock}") as ch:
        replies = ingest_pb2_grpc.IngestStub(ch).StreamSignatures(iter([batch]), metadata=auth.bearer(token),
                                                                  timeout=10)
        reply: ingest_pb2.IngestReply = next(replies)
        replies.cancel()
    return reply


def test_a_reading_above_the_device_is_rejected_and_granted_nothing(env: Env, serves: list[Serve],
                                                                    client: Raw) -> None:
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    dev = client.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10).devices[0]
    gpu, total = dev.device_id, dev.mem_total_mib
    # rows: the made-up application at the wire's generic bound, a normal one beside it
    reply = _stream(env, ingest_pb2.SignatureBatch(
        tick=1, signatures=_signatures("bloated", gpu, MAX_COUNTER) + _signatures("normal", gpu, 30_000.0)))
    assert reply.accepted == 4
    assert sorted(r.index for r in reply.rejected) == [0, 1, 2, 3]
    assert {r.app_id for r in reply.rejected} == {"bloated"}
    assert f"memory reading 1e+12 MiB is above the {total:g} MiB of device {gpu!r}" in reply.rejected[0].reason
    # columns (what the profiler sends): the same check, row by row
    columns, as_rows = columns_from_signatures(_signatures("bloated-cols", gpu, 2 * total)
                                               + _signatures("normal-cols", gpu, 20_000.0))
    assert not as_rows
    reply = _stream(env, ingest_pb2.SignatureBatch(tick=2, columns=columns))
    assert reply.accepted == 4
    assert sorted(r.index for r in reply.rejected) == [0, 1, 2, 3]
    assert {r.app_id for r in reply.rejected} == {"bloated-cols"}
    assert f"memory reading {2 * total:g} MiB is above the {total:g} MiB" in reply.rejected[0].reason
    assert client.wait_granted("normal", 20.0) and client.wait_granted("normal-cols", 20.0)
    assert not any(a.app_id in ("bloated", "bloated-cols") for a in client.apps())
    # logged per batch with such rejections (1st, 10th, ...), not per signature
    logged = [e for e in serves[-1].events() if e.get("event") == "signatures_rejected_over_capacity"]
    assert len(logged) == 1 and logged[0]["mem_total_mib"] == total and logged[0]["in_batch"] == 4
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counts = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("vgpu_signatures_total{")}
    assert counts["over_capacity"] == 8 and counts["rejected"] == 0 and counts["accepted"] == 8
    assert serves[-1].term() == 0


def _manager(total_mib: dict[str, float]) -> Manager:
    return Manager(None, device_known=lambda d: d in total_mib, device_mem_total_mib=total_mib.get,
                   clock=lambda: 1.7e9 + 10)


def _batch(sigs: list[spb.BehavioralSignature]) -> ingest_pb2.SignatureBatch:
    for s in sigs:
        s.timestamp_s = 1.7e9 + s.seq
    return ingest_pb2.SignatureBatch(tick=1, signatures=sigs)


def test_the_slack_at_the_total_and_the_reserved_fallback() -> None:
    m = _manager({"GPU-a": 81_559.0})
    limit = mem_limit_mib(81_559.0)
    assert 81_559.0 < limit < 81_559.0 * 1.02  # a reading at the total is taken, twice it is not
    reply = m.accept(_batch(_signatures("at-limit", "GPU-a", limit, n=1) + _signatures("past", "GPU-a", limit + 1, n=1)))
    assert reply.accepted == 1 and [r.app_id for r in reply.rejected] == ["past"]
    # no process memory: the in-app reserved memory stands in for it, and is bounded the same
    (sig,) = _signatures("reserved", "GPU-a", 0.0, n=1)
    sig.process.ClearField("gpu_mem_used_mib")
    sig.in_app.torch_reserved_mib = 500_000.0
    reply = m.accept(_batch([sig]))
    assert reply.accepted == 0 and "500000 MiB is above the 81559 MiB" in reply.rejected[0].reason
    assert m.stats.over_capacity == 2 and m.stats.rejected == 2
    # a device whose total is not known is not bounded here (the wire's own bound still holds)
    assert _manager({"GPU-a": 81_559.0, "GPU-b": float("nan")}).accept(
        _batch(_signatures("b", "GPU-b", 1e6, n=1))).accepted == 1


def test_a_mig_instance_is_bounded_by_its_own_memory() -> None:
    clock = ManualClock(0.0)
    backend = SimBackend(["h100-80gb"], clock=clock, mig_enabled=True)
    dev = backend.devices()[0]
    dev.create_gpu_instance(9, 0)  # 3g.40gb
    (gi,) = dev.gpu_instances()
    allocator = Allocator(backend, clock=clock, dry_run=True)
    try:
        whole = allocator.device_mem_total_mib(dev.uuid)
        assert whole is not None and whole > gi.mem_total_mib > 0
        assert allocator.device_mem_total_mib(gi.uuid) == gi.mem_total_mib
        assert allocator.device_mem_total_mib("MIG-nowhere") is None
        m = Manager(None, device_known=allocator.knows_device, device_mem_total_mib=allocator.device_mem_total_mib,
                    clock=lambda: 1.7e9 + 10)
        reply = m.accept(_batch(_signatures("fits-gpu-not-instance", gi.uuid, gi.mem_total_mib * 1.5, n=1)
                                + _signatures("fits", gi.uuid, gi.mem_total_mib * 0.5, n=1)))
        assert reply.accepted == 1 and [r.app_id for r in reply.rejected] == ["fits-gpu-not-instance"]
        assert f"above the {gi.mem_total_mib:g} MiB of device {gi.uuid!r}" in reply.rejected[0].reason
    finally:
        allocator.stop()
        backend.close()
