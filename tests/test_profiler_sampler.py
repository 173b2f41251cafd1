"""The live sampler: content of a signature, degraded reads, lost GPUs, vanished processes, caching."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.profiler_fakes import (
    AccessDenied,
    FakeBackend,
    FakeDevice,
    FakeProc,
    FakePsutil,
    ManualClock,
    RecordingLogger,
    mig_instance,
)
from vgpu.client import InAppCounters, InAppReport, VgpuClient, write_inapp
from vgpu.device.base import ProcessInfo, ProcessUtilization
from vgpu.device.errors import GpuLost, InvalidArgument, NoData, NotFound, NotSupported, UnknownDeviceError
from vgpu.profiler.sampler import Sampler
from vgpu.traces import AppTrace

MIB = 1024 * 1024


def make(
    devices: list[FakeDevice],
    procs: list[FakeProc],
    tmp_path: Path,
    **kw: object,
) -> tuple[Sampler, ManualClock, RecordingLogger, FakeBackend]:
    mono = ManualClock(100.0)
    log = RecordingLogger()
    backend = FakeBackend(devices)
    sampler = Sampler(
        backend,
        psutil_module=FakePsutil(procs),
        inapp_dir=tmp_path / "inapp",
        clock=lambda: 1_700_000_000.0 + mono.t,
        monotonic=mono,
        logger=log,
        **kw,  # type: ignore[arg-type]
    )
    return sampler, mono, log, backend


def test_signature_carries_every_counter(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=2048.0)])
    dev.util_samples = [ProcessUtilization(pid=11, timestamp_us=5_000, sm_pct=37.0, mem_bw_pct=9.0)]
    sampler, mono, _, _ = make([dev], [FakeProc(11, name_="train.py", read_bytes=0, write_bytes=0)], tmp_path)

    (sig,) = sampler.sample()
    assert sig.app_id == "pid:11:train.py" and sig.pid == 11 and sig.device_id == "GPU-fake-0"
    assert sig.seq == 1 and sig.timestamp_s == pytest.approx(1_700_000_100.0)
    d = sig.device
    assert (d.mem_used_mib, d.mem_total_mib, d.sm_util_pct, d.mem_bw_util_pct) == (1000.0, 81559.0, 42.0, 17.0)
    assert (d.power_mw, d.power_limit_mw, d.sm_clock_mhz) == (250_000, 700_000, 1980)
    assert (d.pcie_tx_kbps, d.pcie_rx_kbps) == (1200.0, 3400.0)
    assert sig.process.gpu_mem_used_mib == 2048.0 and sig.process.sm_util_pct == 37.0
    assert sig.host.rss_mib == 512.0
    # rates need two observations
    assert not sig.host.HasField("cpu_pct") and not sig.host.HasField("io_read_kbps")
    assert not sig.HasField("in_app")

    psutil = sampler._psutil
    psutil.procs[11].read_bytes = 1024 * 100
    psutil.procs[11].write_bytes = 1024 * 50
    mono.advance(0.5)
    (sig2,) = sampler.sample()
    assert sig2.seq == 2
    assert sig2.host.cpu_pct == 55.0
    assert sig2.host.io_read_kbps == pytest.approx(200.0) and sig2.host.io_write_kbps == pytest.approx(100.0)


def test_process_utilization_asks_only_for_new_samples(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=1.0)])
    dev.util_samples = [ProcessUtilization(11, 1_000, 10.0, 0.0), ProcessUtilization(11, 2_000, 20.0, 0.0)]
    sampler, mono, _, _ = make([dev], [FakeProc(11)], tmp_path, util_hold_s=1.0)
    assert sampler.sample()[0].process.sm_util_pct == 20.0  # the newest of the batch
    dev.util_samples.append(ProcessUtilization(11, 3_000, 30.0, 0.0))
    mono.advance(0.1)
    assert sampler.sample()[0].process.sm_util_pct == 30.0
    mono.advance(0.1)
    assert sampler.sample()[0].process.sm_util_pct == 30.0  # no new sample: held
    assert dev.since_args == [0, 2_000, 3_000]
    mono.advance(1.5)  # older than util_hold_s, and the read answers no sample: NVML samples only busy processes
    assert sampler.sample()[0].process.sm_util_pct == 0.0
    dev.fail["process_utilization"] = UnknownDeviceError("the read fails")
    mono.advance(1.5)  # no read to go by: unset rather than pretend
    assert not sampler.sample()[0].process.HasField("sm_util_pct")


DEVICE_FIELDS = {
    "memory": ("mem_used_mib", "mem_total_mib"),
    "utilization": ("sm_util_pct", "mem_bw_util_pct"),
    "power_usage_mw": ("power_mw",),
    "power_limit_mw": ("power_limit_mw",),
    "sm_clock_mhz": ("sm_clock_mhz",),
    "pcie_throughput_kbps": ("pcie_tx_kbps", "pcie_rx_kbps"),
}


@pytest.mark.parametrize("method", sorted(DEVICE_FIELDS))
def test_not_supported_leaves_field_unset_and_logs_once(tmp_path: Path, method: str) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=1.0)])
    dev.fail[method] = NotSupported()
    sampler, mono, log, _ = make([dev], [FakeProc(11)], tmp_path)
    for _ in range(3):
        (sig,) = sampler.sample()
        mono.advance(0.1)
        for name, fields in DEVICE_FIELDS.items():
            for f in fields:
                assert sig.device.HasField(f) == (name != method), f
    assert len(log.matching("not supported")) == 1
    assert sampler.stats.errors == {}


def test_process_reads_not_supported(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=None)])
    dev.fail["process_utilization"] = NotSupported()
    sampler, _, _, _ = make([dev], [FakeProc(11)], tmp_path)
    (sig,) = sampler.sample()
    assert not sig.process.HasField("gpu_mem_used_mib") and not sig.process.HasField("sm_util_pct")
    assert sig.device.HasField("mem_used_mib")


def test_no_data_from_process_utilization_is_not_an_error(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=1.0)])
    dev.fail["process_utilization"] = NoData()
    sampler, _, log, _ = make([dev], [FakeProc(11)], tmp_path)
    assert len(sampler.sample()) == 1
    assert sampler.stats.errors == {} and not log.records



@pytest.mark.parametrize("no_samples", [NoData, NotFound])
def test_no_new_samples_as_an_error_code_still_reads_an_idle_process_as_zero(
        tmp_path: Path, no_samples: type[Exception]) -> None:
    """NO_DATA / NOT_FOUND from the utilization read is NVML's "no sample newer" (as an empty answer
    is): the read worked, so a process listed for longer than the hold with no sample was idle."""
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=1.0)])
    dev.fail["process_utilization"] = no_samples()
    sampler, mono, _, _ = make([dev], [FakeProc(11)], tmp_path, util_hold_s=1.0)
    assert not sampler.sample()[0].process.HasField("sm_util_pct")  # just listed: too early to say
    mono.advance(1.5)
    sig = sampler.sample()[0]
    assert sig.process.HasField("sm_util_pct") and sig.process.sm_util_pct == 0.0


def test_other_errors_are_counted_and_logged_sparsely(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=1.0)])
    dev.fail["power_usage_mw"] = InvalidArgument("boom")
    sampler, mono, log, _ = make([dev], [FakeProc(11)], tmp_path)
    for _ in range(12):
        (sig,) = sampler.sample()
        mono.advance(0.1)
    assert not sig.device.HasField("power_mw") and sig.device.HasField("power_limit_mw")
    assert sampler.stats.errors == {("GPU-fake-0", "power_usage"): 12}
    assert [r[2]["count"] for r in log.matching("read failed")] == [1, 10]


def test_gpu_lost_skips_that_device_until_rediscovery(tmp_path: Path) -> None:
    good = FakeDevice(0, procs=[ProcessInfo(pid=11, used_mib=1.0)])
    bad = FakeDevice(1, procs=[ProcessInfo(pid=12, used_mib=1.0)])
    bad.fail["utilization"] = GpuLost()
    sampler, mono, log, _ = make([good, bad], [FakeProc(11), FakeProc(12)], tmp_path, rediscover_every_s=10.0)

    assert [s.device_id for s in sampler.sample()] == ["GPU-fake-0"]
    assert sampler.lost_devices() == ["GPU-fake-1"]
    assert len(log.matching("GPU lost")) == 1
    calls = sum(bad.calls.values())
    for _ in range(5):
        mono.advance(0.1)
        assert [s.device_id for s in sampler.sample()] == ["GPU-fake-0"]
    assert sum(bad.calls.values()) == calls  # not touched while lost

    del bad.fail["utilization"]  # the GPU comes back (e.g. after a reset)
    mono.advance(10.0)
    assert sorted(s.device_id for s in sampler.sample()) == ["GPU-fake-0", "GPU-fake-1"]
    assert sampler.lost_devices() == []
    assert sampler.stats.lost_events == 1


def test_backend_enumeration_failure_keeps_going(tmp_path: Path) -> None:
    class Broken(FakeBackend):
        def devices(self):  # type: ignore[no-untyped-def]
            raise GpuLost("driver gone")

    sampler = Sampler(Broken([]), psutil_module=FakePsutil(), inapp_dir=None, logger=RecordingLogger())
    assert sampler.sample() == []
    assert sampler.stats.errors == {("backend", "devices"): 1}


def test_process_vanished_mid_sample_is_skipped(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=1.0), ProcessInfo(pid=12, used_mib=2.0)])
    p11, p12 = FakeProc(11), FakeProc(12)
    sampler, mono, _, _ = make([dev], [p11, p12], tmp_path)
    assert len(sampler.sample()) == 2
    p11.gone = True  # exits between NVML's list and psutil's read
    mono.advance(0.1)
    sigs = sampler.sample()
    assert [s.pid for s in sigs] == [12]
    assert sampler.stats.vanished == 1
    # a process that NVML lists but psutil never knew
    dev.procs.append(ProcessInfo(pid=99, used_mib=1.0))
    mono.advance(1.0)
    assert [s.pid for s in sampler.sample()] == [12]


def test_host_counter_access_denied_degrades(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=1.0)])
    proc = FakeProc(11, fail={"io_counters": AccessDenied(11)})
    sampler, mono, log, _ = make([dev], [proc], tmp_path)
    sampler.sample()
    mono.advance(0.1)
    (sig,) = sampler.sample()
    assert sig.host.HasField("cpu_pct") and sig.host.HasField("rss_mib")
    assert not sig.host.HasField("io_read_kbps")
    assert len(log.matching("host counter not readable")) == 1


def test_process_enumeration_at_most_once_a_second(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=11, used_mib=1.0)])
    sampler, mono, _, _ = make([dev], [FakeProc(11)], tmp_path)
    for _ in range(25):  # 2.5 s of 100 ms ticks
        sampler.sample()
        mono.advance(0.1)
    assert dev.calls["processes"] == 3
    assert dev.calls["memory"] == 25
    # a new process shows up at the next enumeration, not before
    dev.procs.append(ProcessInfo(pid=12, used_mib=1.0))
    sampler._psutil.procs[12] = FakeProc(12)
    seen = []
    for _ in range(11):
        seen.append(len(sampler.sample()))
        mono.advance(0.1)
    assert seen[0] == 1 and seen[-1] == 2


def test_seq_strictly_increasing_per_app_across_devices(tmp_path: Path) -> None:
    d0 = FakeDevice(0, procs=[ProcessInfo(pid=11, used_mib=1.0)])
    d1 = FakeDevice(1, procs=[ProcessInfo(pid=11, used_mib=1.0), ProcessInfo(pid=12, used_mib=1.0)])
    sampler, mono, _, _ = make([d0, d1], [FakeProc(11), FakeProc(12, name_="infer")], tmp_path)
    seqs: dict[str, list[int]] = {}
    for _ in range(4):
        for s in sampler.sample():
            seqs.setdefault(s.app_id, []).append(s.seq)
        mono.advance(0.1)
    assert seqs == {"pid:11:python": list(range(1, 9)), "pid:12:infer": [1, 2, 3, 4]}


def test_mig_process_reports_its_instance(tmp_path: Path) -> None:
    dev = FakeDevice(
        procs=[
            ProcessInfo(pid=11, used_mib=3000.0, gpu_instance_id=1),
            ProcessInfo(pid=12, used_mib=500.0, gpu_instance_id=1),
            ProcessInfo(pid=13, used_mib=100.0, gpu_instance_id=2),
        ]
    )
    dev.instances = [mig_instance(1), mig_instance(2, mem_total_mib=19968.0)]
    dev.fail["utilization"] = NotSupported()  # as NVML under MIG
    sampler, _, _, _ = make([dev], [FakeProc(11), FakeProc(12), FakeProc(13)], tmp_path)
    by_pid = {s.pid: s for s in sampler.sample()}
    assert by_pid[11].device_id == "MIG-fake-1" and by_pid[13].device_id == "MIG-fake-2"
    assert by_pid[11].device.mem_used_mib == 3500.0 and by_pid[11].device.mem_total_mib == 9856.0
    assert by_pid[13].device.mem_total_mib == 19968.0
    assert not by_pid[11].device.HasField("sm_util_pct")


def test_no_psutil_for_simulated_pids(tmp_path: Path) -> None:
    dev = FakeDevice(procs=[ProcessInfo(pid=424242, used_mib=1.0)])
    sampler = Sampler(
        FakeBackend([dev]), psutil_module=None, inapp_dir=None, app_id_of={424242: "bert"}.get
    )
    (sig,) = sampler.sample()
    assert sig.app_id == "bert" and not sig.HasField("host")


# --- in-app counters --------------------------------------------------------------------------------


def _real_sampler(tmp_path: Path, monotonic: ManualClock | None = None) -> tuple[Sampler, FakeDevice]:
    dev = FakeDevice(procs=[ProcessInfo(pid=os.getpid(), used_mib=1.0)])
    kw = {} if monotonic is None else {"monotonic": monotonic}
    return Sampler(FakeBackend([dev]), inapp_dir=tmp_path, logger=RecordingLogger(), **kw), dev  # type: ignore[arg-type]


def test_inapp_counters_from_the_stub_reach_the_signature(tmp_path: Path) -> None:
    client = VgpuClient("resnet-train", socket="unix:///nonexistent.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        client.step(7)
        client.report_now()
        sampler, _ = _real_sampler(tmp_path)
        (sig,) = sampler.sample()
        assert sig.app_id == "resnet-train"  # the stub's registration names the app
        assert sig.in_app.step == 7
        assert not sig.in_app.HasField("torch_allocated_mib")  # no torch with CUDA here
        assert sig.host.rss_mib > 0  # real psutil on our own process
    finally:
        client.close()
    assert not (tmp_path / f"{os.getpid()}.json").exists()


def _report(pid: int, written_at_s: float, pid_start_s: float | None, app_id: str = "x") -> InAppReport:
    return InAppReport(app_id, pid, pid_start_s, written_at_s, InAppCounters(step=3, torch_reserved_mib=10.0))


def test_a_bad_inapp_counter_is_left_out_counted_and_logged_once_and_the_rest_kept(tmp_path: Path) -> None:
    import json
    import time

    import psutil

    counters = {"requests_running": 12, "requests_waiting": -3, "kv_used_mib": 1e30, "kv_total_mib": 8192.0,
                "step": 5}
    (tmp_path / f"{os.getpid()}.json").write_text(json.dumps(
        {"v": 1, "app_id": "llm", "pid": os.getpid(), "pid_start_s": psutil.Process().create_time(),
         "written_at_s": time.time(), "counters": counters}))
    sampler, _ = _real_sampler(tmp_path)
    for _ in range(3):
        (sig,) = sampler.sample()
    assert sig.app_id == "llm" and sig.in_app.requests_running == 12 and sig.in_app.kv_total_mib == 8192.0
    assert sig.in_app.step == 5
    assert not sig.in_app.HasField("requests_waiting") and not sig.in_app.HasField("kv_used_mib")
    assert sampler.stats.inapp_dropped == {"requests_waiting: negative": 3, "kv_used_mib: above 1.67772e+07": 3}
    assert sampler.stats.inapp_bad == 0  # the file itself is fine
    logged = [r for r in sampler._log.records if "left out" in r[1]]  # type: ignore[attr-defined]
    assert len(logged) == 2  # once per process and counter, not per tick


def test_stale_inapp_file_is_ignored(tmp_path: Path) -> None:
    import time

    import psutil

    start = psutil.Process().create_time()
    write_inapp(tmp_path, _report(os.getpid(), time.time() - 60, start))
    sampler, _ = _real_sampler(tmp_path)
    (sig,) = sampler.sample()
    assert not sig.HasField("in_app") and sig.app_id.startswith(f"pid:{os.getpid()}:")


def test_an_overlong_inapp_app_id_is_not_used(tmp_path: Path) -> None:
    import time

    import psutil

    start = psutil.Process().create_time()
    write_inapp(tmp_path, _report(os.getpid(), time.time(), start, app_id="a" * 5000))
    sampler, _ = _real_sampler(tmp_path)
    (sig,) = sampler.sample()
    assert sig.app_id.startswith(f"pid:{os.getpid()}") and sig.in_app.step == 3  # counters kept, name not


def test_inapp_file_of_an_earlier_process_with_the_same_pid_is_ignored(tmp_path: Path) -> None:
    import time

    import psutil

    start = psutil.Process().create_time()
    write_inapp(tmp_path, _report(os.getpid(), time.time(), start - 3600))
    sampler, _ = _real_sampler(tmp_path)
    assert not sampler.sample()[0].HasField("in_app")


def test_malformed_inapp_file_is_ignored_and_counted(tmp_path: Path) -> None:
    (tmp_path / f"{os.getpid()}.json").write_text("{not json")
    sampler, _ = _real_sampler(tmp_path)
    (sig,) = sampler.sample()
    assert not sig.HasField("in_app") and sampler.stats.inapp_bad == 1


@pytest.mark.parametrize("text", [
    "[" * 30_000 + "]" * 30_000,  # nested beyond the JSON decoder's recursion (RecursionError)
    '{"v": 1, "app_id": "x", "pid": %(pid)d, "written_at_s": 1%(zeros)s}',  # beyond a double (OverflowError)
    '{"v": 1, "app_id": "x", "pid": %(pid)d, "written_at_s": 1, "pid_start_s": 1%(zeros)s}',
    # an integer of more digits than Python converts from text (4,300): ValueError from the decoder
    '{"v": 1, "app_id": "x", "pid": 1%(many)s, "written_at_s": 1}',
    '{"v": 1, "app_id": "x", "pid": %(pid)d, "written_at_s": 1, "counters": {"step": 1%(many)s}}',
], ids=["deep", "huge-written-at", "huge-start", "pid-of-5001-digits", "counter-of-5001-digits"])
def test_an_in_app_file_beyond_the_json_decoder_is_malformed_and_the_tick_goes_on(tmp_path: Path, text: str) -> None:
    """A 64 KiB in-app file may still hold what the decoder or a float cannot: before, parsing it raised
    RecursionError or OverflowError out of `sample()`, so every process of the node lost that tick's
    signature, tick after tick, for one file."""
    (tmp_path / f"{os.getpid()}.json").write_text(text % {"pid": os.getpid(), "zeros": "0" * 400, "many": "0" * 5000}
                                                   if "%(" in text else text)
    sampler, _ = _real_sampler(tmp_path)
    (sig,) = sampler.sample()
    assert not sig.HasField("in_app") and sampler.stats.inapp_bad == 1


def test_a_counter_of_more_digits_than_a_double_holds_is_left_out_alone(tmp_path: Path) -> None:
    import json
    import time

    import psutil

    (tmp_path / f"{os.getpid()}.json").write_text(json.dumps(
        {"v": 1, "app_id": "llm", "pid": os.getpid(), "pid_start_s": psutil.Process().create_time(),
         "written_at_s": time.time(), "counters": {"step": 5}}).replace('"step": 5', '"step": 1' + "0" * 400))
    sampler, _ = _real_sampler(tmp_path)
    (sig,) = sampler.sample()
    assert sig.app_id == "llm" and not sig.in_app.HasField("step")
    assert sampler.stats.inapp_dropped == {"step: above 9.0072e+15": 1}


def test_registered_app_id_sticks_when_the_file_goes_stale(tmp_path: Path) -> None:
    import time

    import psutil

    start = psutil.Process().create_time()
    write_inapp(tmp_path, _report(os.getpid(), time.time(), start, app_id="bert"))
    mono = ManualClock(0.0)
    sampler, _ = _real_sampler(tmp_path, mono)
    assert sampler.sample()[0].app_id == "bert"
    (tmp_path / f"{os.getpid()}.json").unlink()
    mono.advance(0.1)
    (sig,) = sampler.sample()
    assert sig.app_id == "bert" and sig.seq == 2 and not sig.HasField("in_app")


# --- on the simulator ---------------------------------------------------------------------------------


def test_sampler_on_the_simulated_h100() -> None:
    sim = pytest.importorskip("vgpu.device.sim")
    clock = sim.ManualClock(0.0)
    backend = sim.SimBackend(["h100-80gb"], clock=clock)
    t = np.arange(0.0, 10.0, 1.0)
    trace = AppTrace(app="bert", t_s=t, columns={"mem_used_mib": 1000.0 + 100 * t, "sm_util_pct": np.full(10, 60.0)})
    backend.launch("bert", 4242, trace)
    sampler = Sampler(backend, psutil_module=None, inapp_dir=None, monotonic=clock, app_id_of={4242: "bert"}.get)
    clock.advance(3.05)
    (sig,) = sampler.sample()
    assert sig.app_id == "bert" and sig.device_id == backend.devices()[0].uuid
    assert sig.process.gpu_mem_used_mib == pytest.approx(1300.0)
    assert sig.device.mem_total_mib > 80_000 and sig.device.HasField("power_mw")
    backend.devices()[0].lose()
    clock.advance(0.1)
    assert sampler.sample() == [] and sampler.lost_devices() == [sig.device_id]


def test_a_report_whose_reading_fails_unforeseen_costs_only_its_own_process_the_counters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a user's in-app file makes the reader raise, the tick goes on: that process's
    signature is sent without in-app counters and the failure is counted."""
    import time

    from vgpu.profiler import sampler as sampler_module

    write_inapp(tmp_path, _report(os.getpid(), time.time(), None))

    def broken(*_args: object, **_kwargs: object) -> None:
        raise LookupError("a failure no rule foresaw")

    monkeypatch.setattr(sampler_module, "read_inapp_reports", broken)
    sampler, _ = _real_sampler(tmp_path)
    (sig,) = sampler.sample()
    assert not sig.HasField("in_app") and sampler.stats.errors[(f"pid:{os.getpid()}", "inapp")] == 1
