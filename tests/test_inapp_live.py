"""In-app counters on the live path: the client stub reports them (a serving engine's through
`report_serving`, read from its Prometheus text by `serving_counters_from_metrics`), the profiler puts
them in the signature, the wire codec and the manager's windows carry them, and feature encoding v4
sees them as present; a bad value is dropped alone, with a counted reason, at each reader."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from daemon_fixtures import ROOT, SKU, Env, Serve, metric_samples
from manager_fakes import EwmaMarginForecaster

from vgpu import auth
from vgpu.client import (
    MAX_INAPP_MIB,
    ServingCounters,
    VgpuClient,
    read_inapp,
    scrape_serving_metrics,
    serving_counters_from_metrics,
)
from vgpu.manager.core import Manager
from vgpu.manager.features import FEATURES_V4, encode_latest
from vgpu.manager.forecast import Forecast
from vgpu.manager.history import NodeHistory
from vgpu.manager.window import WindowStore
from vgpu.traces import AppTrace, read_trace
from vgpu.v1 import ingest_pb2, ingest_pb2_grpc
from vgpu.v1 import signature_pb2 as spb
from vgpu.wire import columns_from_signatures, encode_columns, parse_signature

GPU = "GPU-0"

# What a vLLM server's /metrics gives (the lines that matter, with their HELP and TYPE as vLLM writes
# them, and a histogram around them), for a model with two engines behind one endpoint.
VLLM_METRICS = textwrap.dedent("""\
    # HELP vllm:num_requests_running Number of requests in model execution batches.
    # TYPE vllm:num_requests_running gauge
    vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
    vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
    # HELP vllm:num_requests_waiting Number of requests waiting to be processed.
    # TYPE vllm:num_requests_waiting gauge
    vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
    vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
    # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
    # TYPE vllm:kv_cache_usage_perc gauge
    vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
    vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
    # HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
    # TYPE vllm:iteration_tokens_total histogram
    vllm:iteration_tokens_total_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 51.0
    vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
    vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
    vllm:iteration_tokens_total_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
    # HELP vllm:prompt_tokens_total Number of prefill tokens processed.
    # TYPE vllm:prompt_tokens_total counter
    vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8128.0
    """)
# An older vLLM (gpu_cache_usage_perc) and SGLang, one engine each.
VLLM_OLD_METRICS = textwrap.dedent("""\
    # TYPE vllm:num_requests_running gauge
    vllm:num_requests_running{model_name="m"} 4.0
    # TYPE vllm:num_requests_waiting gauge
    vllm:num_requests_waiting{model_name="m"} 1.0
    # TYPE vllm:gpu_cache_usage_perc gauge
    vllm:gpu_cache_usage_perc{model_name="m"} 0.125
    """)
SGLANG_METRICS = textwrap.dedent("""\
    # HELP sglang:prompt_tokens_total Number of prefill tokens processed.
    # TYPE sglang:prompt_tokens_total counter
    sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
    # HELP sglang:num_running_reqs The number of running requests.
    # TYPE sglang:num_running_reqs gauge
    sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 28.0
    # HELP sglang:num_used_tokens The number of used tokens.
    # TYPE sglang:num_used_tokens gauge
    sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 123859.0
    # HELP sglang:token_usage The token usage.
    # TYPE sglang:token_usage gauge
    sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
    # HELP sglang:num_queue_reqs The number of requests in the waiting queue.
    # TYPE sglang:num_queue_reqs gauge
    sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
    """)


# --- the scrape helper ----------------------------------------------------------------------------
def test_vllm_metrics_become_serving_counters() -> None:
    got = serving_counters_from_metrics(VLLM_METRICS, kv_total_mib=20_000.0)
    assert got.engine == "vllm" and got.skipped == ()
    assert got.counters == ServingCounters(requests_running=21, requests_waiting=3, kv_used_mib=7_500.0,
                                           kv_total_mib=20_000.0, tokens_in_flight=None)
    assert got.kv_used_frac == pytest.approx(0.375)  # the engines' mean
    one = serving_counters_from_metrics(VLLM_METRICS, kv_total_mib=10_000.0, labels={"engine": "1"})
    assert (one.counters.requests_running, one.counters.requests_waiting, one.counters.kv_used_mib) == (9, 0, 2_500.0)
    old = serving_counters_from_metrics(VLLM_OLD_METRICS)  # no pool size: the fraction only
    assert old.counters == ServingCounters(requests_running=4, requests_waiting=1) and old.kv_used_frac == 0.125


def test_sglang_metrics_become_serving_counters() -> None:
    got = serving_counters_from_metrics(SGLANG_METRICS, kv_total_mib=40_000.0)
    assert got.engine == "sglang"
    assert got.counters == ServingCounters(requests_running=28, requests_waiting=7, kv_used_mib=pytest.approx(11_200.0),
                                           kv_total_mib=40_000.0, tokens_in_flight=123_859)


def test_unusable_metrics_are_skipped_with_a_reason_and_bad_text_refused() -> None:
    text = VLLM_OLD_METRICS.replace("} 0.125", "} 1.5").replace("} 4.0", "} -3.0")
    got = serving_counters_from_metrics(text, kv_total_mib=100.0)
    assert got.counters.requests_running is None and got.counters.kv_used_mib is None
    assert got.counters.requests_waiting == 1 and got.counters.kv_total_mib == 100.0
    assert set(got.skipped) == {"vllm:num_requests_running: negative",
                                "vllm:gpu_cache_usage_perc: not a fraction in 0-1 (1.5)"}
    assert serving_counters_from_metrics("# TYPE other gauge\nother 1\n").engine is None
    with pytest.raises(ValueError, match="not Prometheus text"):
        serving_counters_from_metrics("vllm:num_requests_running{ 3\n")
    with pytest.raises(ValueError, match="kv_total_mib"):
        serving_counters_from_metrics(VLLM_METRICS, kv_total_mib=math.nan)


def test_scraping_an_endpoint_reads_its_metrics_and_refuses_a_non_http_url() -> None:
    import http.server
    import threading

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name in http.server
            body = SGLANG_METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        got = scrape_serving_metrics(f"http://127.0.0.1:{server.server_port}/metrics", kv_total_mib=1000.0)
        assert got.engine == "sglang" and got.counters.requests_waiting == 7
        assert got.counters.kv_used_mib == pytest.approx(280.0)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    with pytest.raises(ValueError, match="http"):
        scrape_serving_metrics("file:///etc/passwd")


# --- the client stub --------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def test_reported_serving_counters_go_out_while_fresh(tmp_path: Path) -> None:
    clock = Clock()
    client = VgpuClient("llm", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False, report=False,
                        clock=clock, pid=4242, pid_start_s=None, torch_module=None)
    try:
        client.report_serving(ServingCounters(requests_running=5, requests_waiting=2, kv_used_mib=100.0,
                                              kv_total_mib=400.0, tokens_in_flight=9000))
        client.report_now()
        report = read_inapp(tmp_path, 4242, now_s=clock.t)
        assert report is not None and report.counters.requests_running == 5 and report.counters.kv_total_mib == 400.0
        assert report.counters.tokens_in_flight == 9000
        clock.t += 6.0  # past serving_max_age_s (5 s): the scraper stopped; say nothing rather than stale
        client.report_now()
        report = read_inapp(tmp_path, 4242, now_s=clock.t)
        assert report is not None and report.counters.requests_running is None and report.counters.step == 0
        for bad, named in ((ServingCounters(requests_running=-1), "requests_running: negative"),
                           (ServingCounters(kv_used_mib=math.inf), "kv_used_mib: not finite"),
                           (ServingCounters(kv_total_mib=MAX_INAPP_MIB * 2), "kv_total_mib: above"),
                           (ServingCounters(kv_used_mib=500.0, kv_total_mib=400.0), "more than the pool")):
            with pytest.raises(ValueError, match=named):
                client.report_serving(bad)
    finally:
        client.close(release=False)


# --- the manager, through the real wire codec -----------------------------------------------------
def _sig(app: str, seq: int, t_s: float, **inapp: float) -> spb.BehavioralSignature:
    sig = spb.BehavioralSignature(app_id=app, device_id=GPU, seq=seq, timestamp_s=t_s)
    sig.process.gpu_mem_used_mib = 1000.0 + seq
    sig.process.sm_util_pct = 50.0
    sig.device.mem_total_mib = 80_000.0
    for name, value in inapp.items():
        setattr(sig.in_app, name, value)
    return sig


SERVING = {"requests_running": 8, "requests_waiting": 3, "kv_used_mib": 2048.0, "kv_total_mib": 8192.0,
           "tokens_in_flight": 5000}


def _stream(serving_app: str, plain_app: str, n: int = 40) -> list[spb.BehavioralSignature]:
    sigs = []
    for k in range(1, n + 1):
        sigs.append(_sig(serving_app, k, 1000.0 + 0.1 * k, **SERVING))
        sigs.append(_sig(plain_app, k, 1000.0 + 0.1 * k))
    return sigs


class Spy(EwmaMarginForecaster):
    """Keeps the histories the manager forecasts from (what a served model encodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, AppTrace] = {}

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        self.seen.update({h.app: h for h in histories})
        return super().forecast_batch(histories)


@pytest.mark.parametrize("form", ["rows", "columns"])
def test_serving_counters_reach_the_window_and_v4_features_as_present(form: str) -> None:
    spy = Spy()
    m = Manager(None, spy, clock=lambda: 1010.0, min_samples=1)  # type: ignore[arg-type]
    sigs = _stream("llm", "train")
    if form == "rows":
        batch = ingest_pb2.SignatureBatch(tick=1, signatures=sigs)
    else:  # what the profiler sends: columns from its signatures (profiler/stream.py)
        cols, rows = columns_from_signatures(sigs)
        assert not rows and "inapp_kv_used_mib" in cols.column_names
        batch = ingest_pb2.SignatureBatch(tick=1, columns=cols)
    reply = m.ingest(batch)  # windowed, then forecast at once on this thread
    assert reply.accepted == len(sigs) and not reply.rejected and not m.stats.inapp_dropped
    llm, train = spy.seen["llm"], spy.seen["train"]  # what the forecaster was given
    assert np.all(llm.column("inapp_requests_running") == 8) and np.all(llm.column("inapp_kv_total_mib") == 8192.0)
    assert np.all(llm.column("inapp_tokens_in_flight") == 5000)
    assert not any(c.startswith("inapp_") for c in train.columns)  # nothing reported: nothing kept
    assert not m.windows.window("train").has_inapp
    assert m.windows.inapp_reporting() == {c: 1 for c in (
        "inapp_requests_running", "inapp_requests_waiting", "inapp_kv_used_mib", "inapp_kv_total_mib",
        "inapp_tokens_in_flight")}

    windows, present = encode_latest([llm, train], 16, version=4)
    assert present.all()
    x = windows.x[:, -1]  # the origin's step

    def f(name: str) -> np.ndarray:
        return x[:, FEATURES_V4.index(name)]

    np.testing.assert_array_equal(f("requests_present"), [1.0, 0.0])
    np.testing.assert_array_equal(f("kv_present"), [1.0, 0.0])
    np.testing.assert_array_equal(f("torch_present"), [0.0, 0.0])
    assert f("kv_used_frac")[0] == pytest.approx(0.25)  # of the pool, as reported
    assert f("requests_running_log")[0] == pytest.approx(math.log1p(8) / 8.0)
    assert f("requests_running_log")[1] == 0.0 and f("kv_used_frac")[1] == 0.0


def test_bad_inapp_values_are_dropped_with_a_counted_reason_and_the_signature_kept() -> None:
    m = Manager(None, EwmaMarginForecaster(), clock=lambda: 1010.0, min_samples=1)  # type: ignore[arg-type]
    rows = [_sig("a", 1, 1000.0, kv_used_mib=-5.0, requests_running=3),
            _sig("a", 2, 1000.1, kv_used_mib=math.nan),
            _sig("a", 3, 1000.2, kv_total_mib=1e15, requests_waiting=2**31)]
    dropped: list[str] = []
    assert parse_signature(rows[0], dropped)[0] is None and dropped == ["in_app.kv_used_mib dropped: negative"]
    reply = m.accept(ingest_pb2.SignatureBatch(tick=1, signatures=rows))
    assert reply.accepted == 3 and not reply.rejected
    assert m.stats.inapp_dropped == {
        "in_app.kv_used_mib dropped: negative": 1, "in_app.kv_used_mib dropped: not finite": 1,
        "in_app.kv_total_mib dropped: above 1.67772e+07": 1, "in_app.requests_waiting dropped: above 1e+07": 1}
    trace = m.windows.trace("a")
    assert np.isnan(trace.column("inapp_kv_used_mib")).all() and "inapp_kv_total_mib" not in trace.columns
    np.testing.assert_array_equal(trace.column("inapp_requests_running"), [3.0, np.nan, np.nan])
    np.testing.assert_array_equal(trace.column("mem_used_mib"), [1001.0, 1002.0, 1003.0])  # the sample is kept
    # columns from a profiler that did not check: the same rule, counted per value
    cols = encode_columns(["b"] * 3, [GPU] * 3, [1, 2, 3], [1000.0, 1000.1, 1000.2],
                          {"mem_used_mib": [1.0, 2.0, 3.0], "inapp_kv_used_mib": [-1.0, np.inf, 10.0],
                           "inapp_requests_waiting": [np.nan, 1e8, 4.0]})
    reply = m.accept(ingest_pb2.SignatureBatch(tick=2, columns=cols))
    assert reply.accepted == 3 and not reply.rejected
    assert m.stats.inapp_dropped["in_app.kv_used_mib dropped: negative"] == 2
    assert m.stats.inapp_dropped["in_app.kv_used_mib dropped: not finite"] == 2
    assert m.stats.inapp_dropped["in_app.requests_waiting dropped: above 1e+07"] == 2
    b = m.windows.trace("b")
    np.testing.assert_array_equal(b.column("inapp_kv_used_mib"), [np.nan, np.nan, 10.0])
    np.testing.assert_array_equal(b.column("inapp_requests_waiting"), [np.nan, np.nan, 4.0])


def test_the_inapp_rows_are_made_only_for_an_app_that_reports_and_stay_bounded() -> None:
    store = WindowStore(max_samples=100)
    m = Manager(None, EwmaMarginForecaster(), clock=lambda: 1010.0, min_samples=1, windows=store)  # type: ignore[arg-type]
    sigs = [_sig("plain", k, 1000.0 + 0.1 * k) for k in range(1, 301)]
    # a late reporter: its first 150 samples have no in-app counter
    sigs += [_sig("late", k, 1000.0 + 0.1 * k, **(SERVING if k > 150 else {})) for k in range(1, 301)]
    m.accept(ingest_pb2.SignatureBatch(tick=1, signatures=sigs))
    assert not store.window("plain").has_inapp and store.window("late").has_inapp
    late = store.trace("late")
    assert len(late) == 100 and np.all(late.column("inapp_requests_running") == 8)  # ring of max_samples
    assert store.window("late")._inapp is not None and store.window("late")._inapp.shape[1] == 100


# --- end to end: a client stub process, the profiler, a real `vgpu serve` ---------------------------
STUB = textwrap.dedent("""\
    import sys, time
    from vgpu.client import VgpuClient, ServingCounters, serving_counters_from_metrics
    sock, inapp, metrics_file = sys.argv[1], sys.argv[2], sys.argv[3]
    with VgpuClient("llm-serve", socket=sock, inapp_dir=inapp, watch=False, report_period_s=0.1) as client:
        try:
            client.report_serving(ServingCounters(requests_running=-1))
        except ValueError as exc:
            print("refused:", exc, flush=True)
        text = open(metrics_file).read()
        scrape = serving_counters_from_metrics(text, kv_total_mib=20000.0)
        client.report_serving(scrape.counters)
        client.report_now()
        print("ready", flush=True)
        while sys.stdin.readline():  # the test says when to stop by closing stdin
            pass
    """)


def _lines_until(stream: IO[str], last: str, limit: int = 100) -> list[str]:
    lines: list[str] = []
    while len(lines) < limit:
        line = stream.readline()
        if not line:
            raise AssertionError(f"the stub ended before {last!r}: {lines}")
        lines.append(line.strip())
        if lines[-1] == last:
            return lines
    raise AssertionError(f"no {last!r} in {lines}")




def test_a_stubs_serving_counters_reach_the_daemons_windows_and_the_recording(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    from vgpu.device import open_backend
    from vgpu.profiler.record import RecordingSource, TraceRecorder
    from vgpu.profiler.sampler import Sampler
    from vgpu.profiler.stream import SignatureStreamer

    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    inapp = tmp_path / "inapp"
    metrics_file = tmp_path / "vllm-metrics.txt"
    metrics_file.write_text(VLLM_METRICS)
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(env.sock), str(inapp), str(metrics_file)],
                            cwd=ROOT, env=env.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert stub.stdout is not None and stub.stdin is not None
        lines = _lines_until(stub.stdout, "ready")  # the stub logs to stdout too
        refused = [line for line in lines if line.startswith("refused:")]
        assert refused and "requests_running: negative" in refused[0]  # the API refuses a bad value at the source
        # The profiler's own code over a simulated GPU on which the stub's process runs (the sim cannot
        # see a host process, so it is launched there under the stub's pid).
        backend = open_backend(f"sim:{SKU}")
        n = 20
        backend.launch("llm-serve", stub.pid, AppTrace("llm-serve", np.arange(n, dtype=float),  # type: ignore[attr-defined]
                                                       {"mem_used_mib": np.full(n, 30_000.0),
                                                        "sm_util_pct": np.full(n, 60.0)}), loop=True)
        recorder = TraceRecorder(tmp_path / "rec.csv")
        source = RecordingSource(Sampler(backend, psutil_module=None, inapp_dir=inapp), recorder)
        token = auth.read_token_file(env.state / "tokens" / "profiler.token").strip()
        streamer = SignatureStreamer(source, f"unix://{env.sock}", period_s=0.1, columns_from=1,  # as columns
                                     metadata=lambda: auth.bearer(token))
        stats = asyncio.run(streamer.run(max_ticks=15))
        recorder.close()
        assert stats.signatures_sent >= 10 and stats.rejected == 0
        reporting = metric_samples(port)
        # a profiler that does not check (hand-made rows): the daemon drops the bad value, keeps the row
        bad = _sig("llm-serve", 10_000, time.time(), kv_used_mib=-7.0)
        bad.device_id = backend.devices()[0].uuid
        reply = _send(env, token, bad)
        assert reply.accepted == 1 and not reply.rejected
        deadline = time.monotonic() + 60  # ends when the drop is counted
        while True:
            got = metric_samples(port)
            if got.get(("vgpu_inapp_values_dropped_total", (("reason", "in_app.kv_used_mib dropped: negative"),)))\
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        if stub.stdin is not None:
            stub.stdin.close()
        stub.wait(30)
    # reached the manager's windows: every serving counter the stub reports, for its one application
    for counter in ("inapp_requests_running", "inapp_requests_waiting", "inapp_kv_used_mib", "inapp_kv_total_mib"):
        assert reporting[("vgpu_inapp_apps", (("counter", counter),))] == 1.0, reporting
    assert ("vgpu_inapp_apps", (("counter", "inapp_tokens_in_flight"),)) not in reporting  # vLLM does not say
    assert got[("vgpu_inapp_values_dropped_total", (("reason", "in_app.kv_used_mib dropped: negative"),))] == 1.0
    events = [json.loads(line) for line in serves[0].log_path.read_text().splitlines() if line.startswith("{")]
    assert any(e.get("event") == "inapp_values_dropped" and "kv_used_mib" in e.get("reason", "") for e in events)
    # and the recording has them as the stub reported them
    trace = read_trace(tmp_path / "rec.csv")
    app = trace.apps["llm-serve"]
    assert np.all(app.column("inapp_requests_running") == 21) and np.all(app.column("inapp_requests_waiting") == 3)
    assert np.all(app.column("inapp_kv_used_mib") == 7_500.0) and np.all(app.column("inapp_kv_total_mib") == 20_000.0)
    assert np.isnan(app.column("inapp_tokens_in_flight")).all()


def _send(env: Env, token: str, sig: spb.BehavioralSignature) -> ingest_pb2.IngestReply:
    import grpc

    with grpc.insecure_channel(f"unix://{env.sock}") as ch:
        replies = ingest_pb2_grpc.IngestStub(ch).StreamSignatures(
            iter([ingest_pb2.SignatureBatch(profiler_id="hand", tick=1, sent_at_s=time.time(), signatures=[sig])]),
            metadata=auth.bearer(token), timeout=10)
        return next(iter(replies))


# --- replay: a trace's in-app columns (the synthetic serving corpus) drive the pipeline too ---------
def test_replaying_a_trace_with_inapp_columns_sends_them_and_one_without_sends_none(tmp_path: Path) -> None:
    from vgpu.profiler.replay import ReplaySource
    from vgpu.traces import write_trace

    n = 5
    t = 1000.0 + 0.1 * np.arange(n)
    llm = AppTrace("llm", t, {"mem_used_mib": np.full(n, 30_000.0),
                              "inapp_requests_running": np.array([1.0, 2.0, np.nan, 4.0, 5.0]),
                              "inapp_kv_used_mib": np.full(n, 512.0), "inapp_kv_total_mib": np.full(n, 4096.0),
                              "inapp_tokens_in_flight": np.array([10.0, 20.0, 30.0, 1e12, 50.0])})  # 1e12: too many
    plain = AppTrace("plain", t, {"mem_used_mib": np.full(n, 100.0)})
    write_trace(tmp_path / "t.csv", [llm, plain])
    clock = Clock()
    source = ReplaySource(tmp_path / "t.csv", clock=clock, wall_clock=clock)
    sigs = source.sample()  # starts the replay clock: the rows at its origin
    clock.t += 10.0
    sigs += source.sample()
    by_app: dict[str, list[spb.BehavioralSignature]] = {}
    for s in sigs:
        by_app.setdefault(s.app_id, []).append(s)
    assert [s.in_app.requests_running if s.in_app.HasField("requests_running") else None
            for s in by_app["llm"]] == [1, 2, None, 4, 5]
    assert [s.in_app.tokens_in_flight if s.in_app.HasField("tokens_in_flight") else None
            for s in by_app["llm"]] == [10, 20, 30, None, 50]
    assert all(s.in_app.kv_used_mib == 512.0 and s.in_app.kv_total_mib == 4096.0 for s in by_app["llm"])
    assert len(by_app["plain"]) == n and not any(s.HasField("in_app") for s in by_app["plain"])


def test_vgpu_profiler_replaying_a_serving_series_feeds_its_counters_to_vgpu_serve(
        env: Env, serves: list[Serve], tmp_path: Path) -> None:
    """Both sides as an operator runs them: `vgpu serve`, and `vgpu profiler --replay` of a trace with
    in-app columns (what `vgpu trace synth --kind serving` writes)."""
    from vgpu.traces import write_trace

    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    t = np.arange(0.0, 60.0, 0.1)
    n = len(t)
    write_trace(tmp_path / "serving.csv", [
        AppTrace("llm", t, {"mem_used_mib": np.full(n, 30_000.0), "sm_util_pct": np.full(n, 40.0),
                            "inapp_requests_running": np.full(n, 6.0), "inapp_requests_waiting": np.full(n, 2.0),
                            "inapp_kv_used_mib": np.full(n, 1000.0), "inapp_kv_total_mib": np.full(n, 8000.0)}),
        AppTrace("batch", t, {"mem_used_mib": np.full(n, 2_000.0), "sm_util_pct": np.full(n, 90.0)}),
    ])
    device = env.json("available")["devices"][0]["device_id"]
    profiler = subprocess.Popen(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{env.sock}", "--replay",
         str(tmp_path / "serving.csv"), "--seconds", "30", "--device-id", device,
         "--token-file", str(env.state / "tokens" / "profiler.token")],
        cwd=ROOT, env=env.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    want = {("vgpu_inapp_apps", (("counter", c),)): 1.0 for c in (
        "inapp_requests_running", "inapp_requests_waiting", "inapp_kv_used_mib", "inapp_kv_total_mib")}
    # and per application, with the newest values, for an operator's dashboard
    want |= {("vgpu_app_inapp_value", (("app", "llm"), ("counter", c), ("device", device))): v for c, v in (
        ("inapp_requests_running", 6.0), ("inapp_requests_waiting", 2.0), ("inapp_kv_used_mib", 1000.0),
        ("inapp_kv_total_mib", 8000.0))}
    history = NodeHistory(env.state / "history")  # the daemon's node history, read as the learner reads it

    def recorded() -> dict[str, AppTrace]:
        return {a.app: a for a in history.read()}

    try:
        deadline = time.monotonic() + 60  # ends when both are recorded
        while True:
            got = metric_samples(port)
            rows = recorded()
            if (all(got.get(k) == v for k, v in want.items()) and "llm" in rows and "batch" in rows) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        profiler.terminate()
        _, err = profiler.communicate(timeout=30)
    assert all(got.get(k) == v for k, v in want.items()), (got, err)
    inapp_series = {k for k in got if k[0] == "vgpu_app_inapp_value"}
    assert inapp_series == {k for k in want if k[0] == "vgpu_app_inapp_value"}  # none for "batch", which reports none
    # the node history keeps the in-app counters for node learning; an app without them has none
    llm = rows["llm"]
    assert (llm.columns["inapp_requests_running"] == 6.0).all() and (llm.columns["inapp_kv_total_mib"] == 8000.0).all()
    assert not any(c.startswith("inapp_") for c in rows["batch"].columns)
    assert got[("vgpu_signatures_total", (("result", "rejected"),))] == 0.0
    dropped = [v for k, v in got.items() if k[0] == "vgpu_inapp_values_dropped_total"]
    assert dropped and not any(dropped)  # every reason exported at 0: nothing bad in this series
