"""Logs are one valid JSON record per line: under threads, with inf and NaN values, and when a start
fails (one plain error line for the operator, no traceback, and stop() works from that point)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from daemon_fixtures import ROOT, SKU, Serve, make_env, metric_samples
from hostile import Raw, operator_token

from vgpu import auth
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc
from vgpu.wire import encode_columns

_THREADS = textwrap.dedent(
    """
    import threading
    from vgpu import log
    log.configure("json", "info")
    def work(name):
        lg = log.get_logger(name)  # a logger of its own per thread, as the reload thread has
        for i in range(2000):
            lg.info("tick", i=i, pad="x" * 200, inf=float("inf"), nan=float("nan"), deep={"l": [float("-inf")]})
    ts = [threading.Thread(target=work, args=(f"t{n}",)) for n in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    """
)


def _not_json(token: str) -> None:
    raise ValueError(f"{token} is not JSON")


def test_every_line_is_one_json_record_under_threads() -> None:
    proc = subprocess.run([sys.executable, "-c", _THREADS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True)
    lines = proc.stderr.splitlines()
    assert len(lines) == 8000
    # raises on two records on one line, and (parse_constant) on a bare NaN or Infinity, which JSON lacks
    records = [json.loads(line, parse_constant=_not_json) for line in lines]
    assert {r["logger"] if "logger" in r else r["event"] for r in records} == {"tick"}
    assert records[0]["inf"] == "inf" and records[0]["nan"] == "nan" and records[0]["deep"] == {"l": ["-inf"]}


def test_a_failed_start_is_one_line_with_its_cause(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(env.sock), "--state-dir", str(env.state),
         "--backend", f"sim:{SKU}", "--metrics-port", "0", "--model", str(bad)],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2  # a configured model that does not load: the unit does not restart it
    plain = [line for line in proc.stderr.splitlines() if not line.startswith("{")]
    assert len(plain) == 1 and plain[0].startswith("vgpu serve: manager.model") and str(bad) in plain[0], proc.stderr
    events = [json.loads(line)["event"] for line in proc.stderr.splitlines() if line.startswith("{")]
    assert "stopped" in events and events[-1] == "startup_failed"  # stop() ran to its end
    assert "Traceback" not in proc.stderr and "AttributeError" not in proc.stderr


def test_denied_calls_in_a_loop_do_not_flood_the_log(tmp_path: Path) -> None:
    """A socket user looping a call access control refuses (a made-up token, another application's
    id) got one `access_denied` record per call: some 300 bytes each, hundreds a second, with no
    bound. Records are now bounded per caller, method and refusal; the metric still counts every
    denial, and a caller refused for another reason is still logged."""
    env = make_env(tmp_path)
    serve = Serve(env, "--metrics-port", "auto")
    client = Raw(env.sock)
    try:
        port = serve.metrics_port
        owner = client.request("owned", 1, token=operator_token(env.state))
        for _ in range(200):
            with pytest.raises(grpc.RpcError) as err:
                client.stub.ListApplications(pb.ListApplicationsRequest(), metadata=auth.bearer("vgpu1.eA.00"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:  # another refusal: its own record
            client.stub.ReleaseResources(pb.ReleaseResourcesRequest(grant_id=owner.grant_id), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        denied = [e for e in serve.events() if e.get("event") == "access_denied"]
        assert len(denied) <= 11, len(denied)  # auth.DENIAL_LOG_BURST, and the other refusal
        assert denied[-1]["method"] == "/vgpu.v1.Allocator/ReleaseResources"
        counted = metric_samples(port)[("vgpu_access_denied_total", (
            ("code", "UNAUTHENTICATED"), ("method", "/vgpu.v1.Allocator/ListApplications")))]
        assert counted == 200
    finally:
        client.close()
        assert serve.term() == 0


def test_made_up_application_ids_do_not_flood_the_log(tmp_path: Path) -> None:
    """A profiler stream naming thousands of made-up applications (the token's holder, or anyone
    streaming a replay on the simulator) evicts an application from the manager's windows for each
    new id past their bound (256): every eviction was an `app_evicted` record, 2,000 new ids a batch
    about 2,000 records. They are now at most 10 a minute, the next one counting those left out."""
    env = make_env(tmp_path)
    serve = Serve(env)
    client = Raw(env.sock)
    try:
        device = client.stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10).devices[0].device_id
        token = auth.read_token_file(auth.role_token_file("profiler", env.state))
        n = 600

        def batches() -> Iterator[ingest_pb2.SignatureBatch]:
            for b in range(5):
                now = time.time()
                cols = encode_columns([f"made-up-{b}-{i}" for i in range(n)], [device] * n, np.ones(n, dtype=np.uint64),
                                      np.full(n, now), {"mem_used_mib": np.full(n, 100.0), "sm_util_pct": np.full(n, 5.0)})
                yield ingest_pb2.SignatureBatch(profiler_id="p", tick=b + 1, sent_at_s=now, columns=cols)

        stub = ingest_pb2_grpc.IngestStub(client.channel)
        accepted = sum(r.accepted for r in stub.StreamSignatures(batches(), metadata=auth.bearer(token), timeout=60))
        assert accepted == 5 * n
        serve.wait_for("profiler_disconnected")
        evicted = [e for e in serve.events() if e.get("event") == "app_evicted"]
        assert 1 <= len(evicted) <= 10, len(evicted)
    finally:
        client.close()
        assert serve.term() == 0
