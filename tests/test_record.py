"""`vgpu record` / `vgpu profiler --record`: what the profiler samples, written as a canonical trace and
read back with vgpu.traces exactly as it was streamed."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vgpu.client import InAppCounters, InAppReport, write_inapp
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.profiler.record import RECORD_HEADER, RecordingSource, TraceRecorder, signature_values
from vgpu.profiler.sampler import Sampler
from vgpu.traces import AppTrace, TraceFormatError, read_trace, write_trace
from vgpu.v1 import signature_pb2

DEMO = Path(__file__).resolve().parent.parent / "vgpu" / "data" / "demo_trace.csv.gz"


def _ramp(app: str, n: int = 60) -> AppTrace:
    t = np.arange(n, dtype=np.float64) / 10
    k = np.arange(n, dtype=np.float64)
    return AppTrace(app, t, {"mem_used_mib": 1000.0 + 50 * k, "sm_util_pct": 10.0 + (k % 7) * 5})


@pytest.mark.parametrize("name", ["rec.csv", "rec.csv.gz"])
def test_recorded_rows_are_what_was_streamed(tmp_path: Path, name: str) -> None:
    clock = ManualClock(0.0)
    backend = SimBackend(["h100-80gb"], clock=clock)
    backend.launch("train", 101, _ramp("train"))
    backend.launch("infer", 102, _ramp("infer", 40))
    inapp = tmp_path / "inapp"
    write_inapp(inapp, InAppReport("train-job", 101, None, 1_700_000_000.0,
                                   InAppCounters(torch_allocated_mib=900.0, torch_reserved_mib=1024.0, step=7)))
    sampler = Sampler(backend, psutil_module=None, inapp_dir=inapp, inapp_max_age_s=1e12,
                      clock=lambda: 1_700_000_000.0 + clock(), monotonic=clock)
    path = tmp_path / name
    source = RecordingSource(sampler, TraceRecorder(path, {"recorded": True, "clock": "shared"}, monotonic=clock))
    streamed: list[signature_pb2.BehavioralSignature] = []
    for _ in range(30):
        clock.advance(0.1)
        streamed += source.sample()
    source.close()

    trace = read_trace(path, strict=True)
    assert trace.metadata == {"recorded": True, "clock": "shared"}
    assert len(streamed) == trace.samples > 40 and not trace.issues
    assert set(trace.apps) == {s.app_id for s in streamed} == {"train-job", "pid:102"}
    for app_id, app in trace.apps.items():
        sigs = [s for s in streamed if s.app_id == app_id]
        np.testing.assert_allclose(app.t_s, [s.timestamp_s for s in sigs], atol=1e-6)
        assert app.gpu == sigs[0].device_id
        for column in RECORD_HEADER[3:]:
            expected = np.array([signature_values(s).get(column, np.nan) for s in sigs])
            np.testing.assert_allclose(app.column(column), expected, atol=1e-6, equal_nan=True, err_msg=column)
    train = trace.apps["train-job"]
    assert np.all(train.column("inapp_torch_reserved_mib") == 1024.0) and np.all(train.column("inapp_step") == 7)
    assert np.isnan(trace.apps["pid:102"].column("inapp_step")).all()
    assert np.nanmax(train.column("mem_used_mib")) > np.nanmin(train.column("mem_used_mib"))  # it follows the trace
    assert np.all(train.column("dev_mem_used_mib") >= train.column("mem_used_mib"))


def test_a_signature_without_a_target_is_counted_not_written(tmp_path: Path) -> None:
    rec = TraceRecorder(tmp_path / "r.csv")
    sig = signature_pb2.BehavioralSignature(app_id="a", device_id="g", timestamp_s=1.0)
    sig.device.power_mw = 100_000
    ok = signature_pb2.BehavioralSignature(app_id="a", device_id="g", timestamp_s=2.0)
    ok.process.gpu_mem_used_mib = 5.0
    ok.device.power_mw = 150_000
    assert rec.write([sig, ok]) == 1
    rec.close()
    assert rec.skipped_no_target == 1
    app = read_trace(tmp_path / "r.csv", strict=True).apps["a"]
    assert app.t_s.tolist() == [2.0] and app.column("power_w").tolist() == [150.0]


def test_cli_records_the_simulated_gpu(tmp_path: Path) -> None:
    src = tmp_path / "src.csv"
    write_trace(src, [_ramp("job-a", 100)])
    out = tmp_path / "node.csv.gz"
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "record", "--backend", "sim:a100-80gb", "--sim-trace", str(src),
                        "--seconds", "1.5", "--period-ms", "100", "--inapp-dir", str(tmp_path / "none"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    trace = read_trace(out, strict=True)
    assert trace.metadata["recorded"] is True and trace.metadata["backend"] == "sim:a100-80gb"
    assert trace.metadata["devices"][0]["mem_total_mib"] == 81920.0
    assert list(trace.apps) == ["job-a"] and 8 <= trace.samples <= 16
    assert gzip.open(out, "rt").readline().startswith("#meta ")


def test_cli_refuses_bad_options(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", "record", *args], capture_output=True, text=True,
                              timeout=120, check=False)

    assert run("--backend", "nvml", "--sim-trace", str(DEMO), "--out", str(tmp_path / "x.csv")).returncode == 2
    r = run("--backend", "sim:nope", "--out", str(tmp_path / "x.csv"))
    assert r.returncode == 1 and "cannot open backend" in r.stderr
    r = run("--backend", "sim:h100-80gb", "--sim-trace", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "x.csv"))
    assert r.returncode == 1 and "no such file" in r.stderr
    # the in-app directory comes from the node's setting when not given: one that is no absolute path is said
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "record", "--backend", "sim:h100-80gb", "--out",
                        str(tmp_path / "x.csv")], capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, "VGPU_SERVER_INAPP_DIR": "run/inapp"})
    assert r.returncode == 2 and "VGPU_SERVER_INAPP_DIR='run/inapp' is not an absolute path" in r.stderr, r.stderr
    assert not (tmp_path / "x.csv").exists()


def test_profiler_record_option_writes_the_trace_while_streaming(tmp_path: Path) -> None:
    """The profiler keeps sampling (and recording) while its manager is away, and says at exit that it
    never reached it (exit 1); the bare simulated GPU has no process, so the trace is its metadata and
    header."""
    out = tmp_path / "p.csv"
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "profiler", "--backend", "sim:h100-80gb", "--no-token",
                        "--manager", "127.0.0.1:9", "--seconds", "1", "--record", str(out),
                        "--inapp-dir", str(tmp_path / "none")], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1 and "never reached the manager" in r.stderr, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0].startswith("#meta ") and '"recorded":true' in lines[0]
    assert lines[1] == ",".join(RECORD_HEADER) and len(lines) == 2


def _trace_with_bad_rows(tmp_path: Path) -> Path:
    """A trace of one good application and five bad rows: lines 12 to 16 of the file."""
    src = tmp_path / "src.csv"
    write_trace(src, [_ramp("job-a", 10)])
    with src.open("a") as fh:
        for i in range(5):
            fh.write(f"{100 + i}.0,job-b,,not-a-number,10.0,,,,,,,\n")
    return src


@pytest.mark.parametrize("command", ["record", "profiler"])
def test_bad_rows_of_a_trace_are_said_once_with_the_count_and_the_first_few(tmp_path: Path, command: str) -> None:
    """`vgpu record --sim-trace` and `vgpu profiler --replay` skip a trace's bad rows as `vgpu eval`
    does, and say so once on stderr: how many, and the first three by file:line."""
    src = _trace_with_bad_rows(tmp_path)
    if command == "record":
        args = ["record", "--backend", "sim:h100-80gb", "--sim-trace", str(src), "--seconds", "0.3",
                "--inapp-dir", str(tmp_path / "none"), "--out", str(tmp_path / "out.csv")]
    else:  # no manager listens there: the profiler replays, then says it never reached it
        args = ["profiler", "--replay", str(src), "--no-token", "--manager", "127.0.0.1:9", "--seconds", "0.3"]
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", *args], capture_output=True, text=True, timeout=120,
                       check=False)
    said = [line for line in r.stderr.splitlines() if "bad rows skipped" in line]
    assert len(said) == 1, r.stderr
    assert said[0].startswith(f"vgpu {command}: 5 bad rows skipped in {src} (first: {src}:12: "), said
    assert f"{src}:14: " in said[0] and f"{src}:15: " not in said[0] and said[0].endswith("; 2 more)"), said
    if command == "record":
        assert r.returncode == 0, r.stderr
        assert list(read_trace(tmp_path / "out.csv", strict=True).apps) == ["job-a"]


def test_a_clean_trace_says_nothing_of_bad_rows(tmp_path: Path) -> None:
    src = tmp_path / "src.csv"
    write_trace(src, [_ramp("job-a", 10)])
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "record", "--backend", "sim:h100-80gb", "--sim-trace", str(src),
                        "--seconds", "0.3", "--inapp-dir", str(tmp_path / "none"), "--out", str(tmp_path / "out.csv")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and "bad row" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["record", "profiler"])
def test_a_recording_of_a_derived_trace_stays_derived(tmp_path: Path, command: str) -> None:
    """`vgpu record --sim-trace` and `vgpu profiler --replay --record` play a trace back and record it:
    the recording names the trace it replayed and keeps its provenance (derived, generator, inputs with
    their licences), so a derived series recorded again is not taken for a real one by `vgpu trace info`
    (nor `vgpu eval` / `vgpu train`, which read the same keys); a replay names no device backend."""
    src = tmp_path / "derived.csv"
    inputs = [{"path": "migperf-a100-mig", "license": "MIT"}]
    write_trace(src, [_ramp("job-a", 60)], metadata={"derived": True, "generator": "test-generator v1",
                                                     "inputs": inputs, "clock": "per-app"})
    out = tmp_path / "again.csv"
    if command == "record":
        args = ["record", "--backend", "sim:h100-80gb", "--sim-trace", str(src), "--seconds", "1",
                "--inapp-dir", str(tmp_path / "none"), "--out", str(out)]
    else:  # no manager listens there: the profiler replays and records, then says it never reached it
        args = ["profiler", "--replay", str(src), "--no-token", "--manager", "127.0.0.1:9", "--seconds", "1",
                "--record", str(out)]
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", *args], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == (0 if command == "record" else 1), r.stderr
    trace = read_trace(out, strict=True)
    assert list(trace.apps) == ["job-a"]
    meta = trace.metadata
    assert meta["recorded"] is True and meta["replayed"] == str(src)
    assert meta["derived"] is True and meta["generator"] == "test-generator v1" and meta["inputs"] == inputs
    assert meta["backend"] == ("sim:h100-80gb" if command == "record" else "replay")
    assert meta["clock"] == "shared"  # the recording's own clock, not the source's
    info = subprocess.run([sys.executable, "-m", "vgpu.cli", "trace", "info", str(out)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert "derived series: test-generator v1" in info.stdout, info.stdout


def _trace_info(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", "trace", "info", str(path), *extra],
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_recording_killed_without_warning_keeps_its_rows_to_the_last_checkpoint(tmp_path: Path) -> None:
    """SIGKILL (an OOM kill, a reboot) gives the recorder no chance to end its gzip stream: what it
    flushed every second is read, the unfinished end is reported as a damaged tail."""
    import json
    import signal
    import time

    out = tmp_path / "r.csv.gz"
    proc = subprocess.Popen([sys.executable, "-m", "vgpu.cli", "record", "--backend", "sim:h100-80gb",
                             "--sim-trace", str(DEMO), "--period-ms", "100", "--inapp-dir", str(tmp_path / "none"),
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:  # rows on disk while it records, read as a reader would
            time.sleep(0.5)
            try:
                seen = read_trace(out).samples
            except TraceFormatError:  # no file yet, or nothing flushed
                seen = 0
        assert seen, "the recording never had a row readable on disk"
        time.sleep(6)  # past the next flushes
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    r = _trace_info(out, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["samples"] > seen + 100  # what was readable before, and the next flushes' rows
    assert info["apps"] >= 4
    assert set(info["skipped_by_reason"]) <= {"damaged tail: the file ends inside a gzip member"}


def test_a_gzip_trace_cut_short_is_read_to_the_damage_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "t.csv.gz"
    write_trace(path, [_ramp("job", 2000)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4])  # a copy cut short; the end of the one gzip stream is gone

    trace = read_trace(path)
    (issue,) = trace.issues
    assert issue.reason.startswith("damaged tail: the file ends inside a gzip member")
    job = trace.apps["job"]
    assert 500 < len(job) < 2000
    # every row kept is whole: the row cut at the damage is dropped, not read with its value cut short
    np.testing.assert_array_equal(job.column("mem_used_mib"), 1000.0 + 50 * np.arange(len(job)))
    note = trace.skipped_rows_note()
    assert note is not None and note.startswith(f"1 bad row skipped in {path}") and f"{path}:{len(job) + 2}:" in note

    r = _trace_info(path)
    assert r.returncode == 0 and "skipped rows: 1" in r.stdout and "damaged tail" in r.stdout, r.stdout + r.stderr
    r = _trace_info(path, "--strict")
    assert r.returncode == 1 and f"{path}:{len(job) + 2}: damaged tail" in r.stderr
    # damaged data rather than a short file: the member's check fails, the rows before it are kept
    members = gzip.compress(b"t_s,app,mem_used_mib\n0,a,1\n1,a,2\n") + gzip.compress(b"2,a,3\n3,a,4\n")
    broken = bytearray(members)
    broken[-6] ^= 0xFF  # the second member's CRC
    path.write_bytes(bytes(broken))
    trace = read_trace(path)
    assert trace.apps["a"].column("mem_used_mib").tolist() == [1.0, 2.0]
    assert trace.issues[0].reason.startswith("damaged tail: damaged gzip data")
    # not gzip at all is not a trace cut short: the whole file is refused as before
    path.write_bytes(b"t_s,app,mem_used_mib\n0,a,1\n")
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(path)


def test_a_recording_with_no_row_fails_and_says_why(tmp_path: Path) -> None:
    # a stub's in-app file for this process: the sim backend never samples a host process, so it is not recorded
    inapp = tmp_path / "inapp"
    inapp.mkdir()
    write_inapp(inapp, InAppReport(app_id="mine", pid=os.getpid(), pid_start_s=None, written_at_s=time.time(),
                                   counters=InAppCounters(step=3)))
    out = tmp_path / "a.csv"
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "record", "--backend", "sim", "--seconds", "0.5",
                        "--inapp-dir", str(inapp), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vgpu record: no GPU process can be sampled"), r.stderr
    assert "--sim-trace" in lines[0] and "never host processes" in lines[0]
    assert not out.exists() and r.stdout == ""  # said at once: no wait, no empty file


def test_a_recording_of_a_replay_keeps_the_traces_in_app_counters(tmp_path: Path) -> None:
    # a serving engine's counters, as `vgpu trace synth --kind serving` writes them, from the first row on
    n = 40
    k = np.arange(n, dtype=np.float64)
    running = k % 5
    running[1] = np.nan  # an empty cell: a counter not reported then stays empty
    app = AppTrace("serve", k / 2, {"mem_used_mib": 2000.0 + k, "sm_util_pct": 50.0 + k % 3,
                                     "inapp_requests_running": running, "inapp_kv_used_mib": 100.0 + 10 * k,
                                     "inapp_kv_total_mib": np.full(n, 4096.0)})
    src = tmp_path / "serv.csv"
    write_trace(src, [app])
    out = tmp_path / "d.csv"
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "record", "--backend", "sim:h100-80gb", "--sim-trace", str(src),
                        "--seconds", "1.5", "--inapp-dir", str(tmp_path / "none"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    rec = read_trace(out, strict=True).apps["serve"]
    assert {"inapp_requests_running", "inapp_kv_used_mib", "inapp_kv_total_mib"} <= set(rec.columns)
    assert np.isnan(rec.column("inapp_step")).all()  # a column the replayed trace lacks stays empty
    # each recorded row carries one row of the trace, whole: its kv_used_mib (100 + 10 j) names the row j
    j = (rec.column("inapp_kv_used_mib") - 100.0) / 10.0
    assert np.array_equal(j, np.rint(j)) and (np.diff(j) >= 0).all()
    row = j.astype(int)
    assert np.array_equal(rec.column("inapp_requests_running"), running[row], equal_nan=True)
    assert (rec.column("inapp_kv_total_mib") == 4096.0).all()
    assert len(rec) >= 8 and {0, 1, 2} <= set(row.tolist())  # row 1: its empty cell recorded empty


def test_the_sim_gives_a_processes_in_app_counters_at_the_row_in_force() -> None:
    clock = ManualClock()
    backend = SimBackend(["h100-80gb"], clock=clock)
    t = np.arange(4, dtype=np.float64)
    backend.launch("a", 7, AppTrace("a", t, {"mem_used_mib": np.full(4, 10.0),
                                            "inapp_step": np.array([1.0, np.nan, 3.0, 4.0])}))
    backend.launch("b", 8, AppTrace("b", t, {"mem_used_mib": np.full(4, 10.0)}))
    assert backend.inapp_counters(7) == {"step": 1.0}
    clock.set(1.5)
    assert backend.inapp_counters(7) == {}  # an empty cell is no report, not the last one carried on
    clock.set(2.0)
    assert backend.inapp_counters(7) == {"step": 3.0}
    assert backend.inapp_counters(8) == {} and backend.inapp_counters(9) == {}
    sigs = {s.pid: s for s in Sampler(backend, psutil_module=None, inapp_dir=None,
                                      inapp_of=backend.inapp_counters).sample()}
    assert sigs[7].in_app.step == 3 and not sigs[8].HasField("in_app")
    clock.set(4.0)  # the trace's last row and its period are over: the process has left
    assert backend.inapp_counters(7) == {}
