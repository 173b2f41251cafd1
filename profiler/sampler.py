"""The live signature source: one `BehavioralSignature` per (GPU process, device) per tick.

Where each part of a signature comes from, and how often it is refreshed:

* device counters (memory used/total, SM and memory-bandwidth utilisation, power and its limit, SM clock,
  PCIe tx/rx): the device layer, every tick, once per device;
* the GPU processes and their GPU memory (`Device.processes()`, plus the MIG instances): enumerated at most
  once per `enumerate_every_s` (1 s) and cached in between; a new process is found within that period;
* per-process SM utilisation: `Device.process_utilization(since_us)` every tick, with the last-seen
  timestamp kept per device so each call returns only new samples; only samples of listed processes are
  used and move that timestamp; a process without a new sample keeps its last value for `util_hold_s`;
  after that it reads 0 while the read works and the process has been listed for longer than the hold
  (NVML samples only processes that used the GPU in the period), and is unset while the read fails;
* host counters (CPU %, RSS, I/O rates) of the process: psutil, every tick; rates need two observations, so
  the first sample of a process leaves CPU and I/O unset;
* in-app counters: the client stub's per-pid file, every tick: `<pid>.json`, or, where that name was
  taken by another user's file, the stub's `<pid>.<token>.json`, found by listing the directory at most
  once per `inapp_scan_every_s` while some process has no report, each listing bounded
  (`vgpu.client.InAppFinder`); only a file owned by the process's user (or root) counts. Its app id names
  the application. A counter that is not finite, negative or above its bound is left out of the
  signature (the rest of the report kept), counted in `stats.inapp_dropped` and logged once per process
  and counter. A process with no such file may have its counters from `inapp_of(pid)` instead: the
  simulator's replay of a trace's in-app columns (`SimBackend.inapp_counters`), so a recording of a
  replay keeps them as a real engine's file would.

Reads degrade field by field: NotSupported leaves the field unset and is logged once per (device, field);
so does NoPermission, which is also counted; any other error is counted per (device, field) and logged
at its 1st, 10th, 100th... occurrence; GpuLost marks the device lost and it is skipped until the next rediscovery (every `rediscover_every_s`, or
`rediscover()`). A process that exits mid-sample is skipped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from vgpu.client import DEFAULT_INAPP_DIR, InAppFinder, InAppFound, InAppReport, read_inapp_reports
from vgpu.device.base import Backend, Device, GpuInstance, ProcessInfo, ProcessUtilization
from vgpu.device.errors import GpuLost, NoData, NoPermission, NotFound, NotSupported
from vgpu.ids import app_id_problem, sanitize_app_id_part  # the manager's rule for app ids
from vgpu.log import get_logger
from vgpu.profiler.source import SeqCounter, set_inapp_values
from vgpu.v1 import signature_pb2

T = TypeVar("T")
MIB = 1024 * 1024
_DEFAULT_PSUTIL: Any = object()


@dataclass
class SamplerStats:
    samples: int = 0
    signatures: int = 0
    enumerations: int = 0
    vanished: int = 0
    lost_events: int = 0
    rediscoveries: int = 0
    # (device uuid or "pid:N", field) -> count of errors other than NotSupported
    errors: dict[tuple[str, str], int] = field(default_factory=dict)
    inapp_bad: int = 0
    # in-app counters left out of otherwise good reports (vgpu.client.inapp_value_problem), by
    # "counter: why" (a fixed set of keys)
    inapp_dropped: dict[str, int] = field(default_factory=dict)
    # listings of the in-app directory for the stub's other report names, and the entries they read
    # (each at most vgpu.client.MAX_INAPP_SCAN_ENTRIES)
    inapp_scans: int = 0
    inapp_scan_entries: int = 0


@dataclass
class _DeviceState:
    device: Device
    uuid: str
    lost: bool = False
    util_since_us: int = 0
    procs: tuple[ProcessInfo, ...] = ()
    instances: dict[int, GpuInstance] = field(default_factory=dict)
    enumerated_at: float | None = None
    # pid -> (sm_pct, monotonic time the sample arrived)
    util: dict[int, tuple[float, float]] = field(default_factory=dict)
    # the per-process utilization read of this tick answered (with samples or with none newer)
    util_read_ok: bool = False
    # pid -> monotonic time the process was first listed
    listed_at: dict[int, float] = field(default_factory=dict)


@dataclass
class _ProcState:
    proc: Any
    name: str
    start_s: float | None
    uid: int | None
    app_id: str | None = None
    primed_cpu: bool = False
    last_io: tuple[float, float, float] | None = None  # (monotonic s, read bytes, write bytes)


class _Vanished(Exception):
    pass


class _Lost(Exception):
    pass


class Sampler:
    """Samples every GPU application of every device of `backend`.

    `psutil_module` is psutil by default; pass a fake for tests, or None where the pids are not host
    processes (the simulator), which leaves host counters unset and names apps `pid:<pid>`. `inapp_dir`
    None turns in-app counters off. `clock` gives the signatures' wall time, `monotonic` paces the caches.
    An application's id is, in order: the id its client stub registered (in-app file), `app_id_of(pid)`
    when given and not None (the demo names simulated processes this way), else `pid:<pid>:<name>`.
    `inapp_of(pid)`, when given, is the in-app counters (name -> value) of a process without an in-app
    file: the simulator's (`SimBackend.inapp_counters`), whose processes are not host processes.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        psutil_module: Any = _DEFAULT_PSUTIL,
        inapp_dir: str | Path | None = DEFAULT_INAPP_DIR,
        inapp_max_age_s: float = 5.0,
        inapp_scan_every_s: float = 1.0,
        enumerate_every_s: float = 1.0,
        rediscover_every_s: float = 30.0,
        util_hold_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        app_id_of: Callable[[int], str | None] | None = None,
        inapp_of: Callable[[int], Mapping[str, float]] | None = None,
        logger: Any = None,
    ) -> None:
        if psutil_module is _DEFAULT_PSUTIL:
            import psutil as psutil_module  # noqa: PLC0415 - a default, injected in tests
        self._backend = backend
        self._psutil = psutil_module
        self._inapp = None if inapp_dir is None else InAppFinder(inapp_dir)
        self._inapp_max_age_s = inapp_max_age_s
        self._inapp_scan_every_s = inapp_scan_every_s
        self._inapp_scanned_at = -math.inf
        self._enumerate_every_s = enumerate_every_s
        self._rediscover_every_s = rediscover_every_s
        self._util_hold_s = util_hold_s
        self._clock = clock
        self._mono = monotonic
        self._app_id_of = app_id_of
        self._inapp_of = inapp_of
        self._log = logger or get_logger("vgpu.profiler.sampler")
        self._seq = SeqCounter()
        self._devices: dict[str, _DeviceState] = {}
        self._procs: dict[int, _ProcState] = {}
        self._logged_once: set[tuple[str, str]] = set()
        self._discovered_at: float | None = None
        self.stats = SamplerStats()

    # --- public --------------------------------------------------------------------------------------
    def sample(self) -> list[signature_pb2.BehavioralSignature]:
        now_mono = self._mono()
        if self._discovered_at is None or now_mono - self._discovered_at >= self._rediscover_every_s:
            self.rediscover()
        now_s = self._clock()
        host_cache: dict[int, tuple[_ProcState, signature_pb2.HostCounters] | None] = {}
        out: list[signature_pb2.BehavioralSignature] = []
        seen_pids: set[int] = set()
        for state in list(self._devices.values()):
            if state.lost:
                continue
            try:
                out.extend(self._sample_device(state, now_s, now_mono, host_cache, seen_pids))
            except _Lost:
                continue
        for pid in set(self._procs) - seen_pids:  # forget processes that left every device
            del self._procs[pid]
        if self._inapp is not None:
            self._inapp.retain(self._procs)
        self.stats.samples += 1
        self.stats.signatures += len(out)
        return out

    def rediscover(self) -> None:
        """Re-read the backend's devices; lost devices get another chance."""
        self._discovered_at = self._mono()
        try:
            devices = list(self._backend.devices())
        except Exception as exc:  # noqa: BLE001 - keep the devices we had
            self._count_error("backend", "devices", exc)
            return
        self.stats.rediscoveries += 1
        fresh: dict[str, _DeviceState] = {}
        for dev in devices:
            try:
                uuid = dev.uuid
            except Exception as exc:  # noqa: BLE001
                self._count_error(f"index:{getattr(dev, 'index', '?')}", "uuid", exc)
                continue
            old = self._devices.get(uuid)
            if old is not None and not old.lost:
                old.device = dev
                fresh[uuid] = old
            else:
                if old is not None:
                    self._log.info("device rediscovered, sampling it again", device=uuid)
                fresh[uuid] = _DeviceState(device=dev, uuid=uuid)
        for uuid in set(self._devices) - set(fresh):
            self._log.warning("device gone from the backend", device=uuid)
        self._devices = fresh

    def lost_devices(self) -> list[str]:
        return [uuid for uuid, s in self._devices.items() if s.lost]

    def close(self) -> None:
        self._devices.clear()
        self._procs.clear()
        if self._inapp is not None:
            self._inapp.close()

    # --- one device ---------------------------------------------------------------------------------
    def _sample_device(
        self,
        state: _DeviceState,
        now_s: float,
        now_mono: float,
        host_cache: dict[int, tuple[_ProcState, signature_pb2.HostCounters] | None],
        seen_pids: set[int],
    ) -> list[signature_pb2.BehavioralSignature]:
        dev = state.device
        counters = self._device_counters(state)
        if state.enumerated_at is None or now_mono - state.enumerated_at >= self._enumerate_every_s:
            self._enumerate(state, now_mono)
        self._update_util(state, now_mono)
        out = []
        for info in state.procs:
            seen_pids.add(info.pid)
            if info.pid not in host_cache:
                host_cache[info.pid] = self._host(info.pid, now_mono)
            host = host_cache[info.pid]
            if host is None:
                continue  # vanished
            pstate, host_counters = host
            inapp_values: Mapping[str, float] = {}
            try:
                inapp = self._read_inapp(info.pid, pstate, now_s, now_mono)
                if inapp is None and self._inapp_of is not None:
                    inapp_values = self._inapp_of(info.pid)
            except Exception as exc:  # noqa: BLE001 - a file a user writes: its process goes on without it
                # one process's report must never cost every process of the node its signature
                self._count_error(f"pid:{info.pid}", "inapp", exc)
                inapp = None
            app_id = self._app_id(info.pid, pstate, inapp)
            sig = signature_pb2.BehavioralSignature(
                app_id=app_id, pid=info.pid, device_id=dev.uuid, timestamp_s=now_s, seq=self._seq.next(app_id)
            )
            sig.device.CopyFrom(counters)
            instance = state.instances.get(info.gpu_instance_id) if info.gpu_instance_id is not None else None
            if instance is not None and instance.uuid:  # no UUID read: reported on its GPU
                sig.device_id = instance.uuid
                sig.device.mem_total_mib = instance.mem_total_mib
                used = [p.used_mib for p in state.procs if p.gpu_instance_id == info.gpu_instance_id]
                if all(u is not None for u in used):
                    sig.device.mem_used_mib = float(sum(u for u in used if u is not None))
                else:
                    sig.device.ClearField("mem_used_mib")
            if info.used_mib is not None:
                sig.process.gpu_mem_used_mib = float(info.used_mib)
            util = state.util.get(info.pid)
            if util is not None and now_mono - util[1] <= self._util_hold_s:
                sig.process.sm_util_pct = util[0]
            elif state.util_read_ok and now_mono - state.listed_at.get(info.pid, now_mono) > self._util_hold_s:
                # NVML returns a sample only for a process that used the GPU in the sample period (NVML
                # reference, nvmlDeviceGetProcessUtilization), so a process listed for longer than the
                # hold with no sample in it, while the read works, was idle
                sig.process.sm_util_pct = 0.0
            if host_counters.ListFields():
                sig.host.CopyFrom(host_counters)
            if inapp is not None:
                _fill_inapp(sig.in_app, inapp)
            elif inapp_values:
                set_inapp_values(sig.in_app, inapp_values)
            out.append(sig)
        return out

    def _device_counters(self, state: _DeviceState) -> signature_pb2.DeviceCounters:
        dev, c = state.device, signature_pb2.DeviceCounters()
        mem = self._read(state, "memory", dev.memory)
        if mem is not None:
            c.mem_used_mib, c.mem_total_mib = float(mem.used_mib), float(mem.total_mib)
        util = self._read(state, "utilization", dev.utilization)
        if util is not None:
            c.sm_util_pct, c.mem_bw_util_pct = float(util.sm_pct), float(util.mem_bw_pct)
        power = self._read(state, "power_usage", dev.power_usage_mw)
        if power is not None:
            c.power_mw = int(power)
        limit = self._read(state, "power_limit", dev.power_limit_mw)
        if limit is not None:
            c.power_limit_mw = int(limit)
        clock = self._read(state, "sm_clock", dev.sm_clock_mhz)
        if clock is not None:
            c.sm_clock_mhz = int(clock)
        pcie = self._read(state, "pcie", dev.pcie_throughput_kbps)
        if pcie is not None:
            c.pcie_tx_kbps, c.pcie_rx_kbps = float(pcie[0]), float(pcie[1])
        return c

    def _enumerate(self, state: _DeviceState, now_mono: float) -> None:
        dev = state.device
        state.enumerated_at = now_mono
        self.stats.enumerations += 1
        procs = self._read(state, "processes", dev.processes)
        state.procs = tuple(procs) if procs is not None else ()
        state.listed_at = {p.pid: state.listed_at.get(p.pid, now_mono) for p in state.procs}
        state.instances = {}
        if any(p.gpu_instance_id is not None for p in state.procs):
            instances = self._read(state, "gpu_instances", dev.gpu_instances)
            state.instances = {gi.instance_id: gi for gi in instances or ()}

    def _update_util(self, state: _DeviceState, now_mono: float) -> None:
        def new_samples() -> Sequence[ProcessUtilization]:
            try:
                return state.device.process_utilization(state.util_since_us)
            except (NoData, NotFound):
                return ()  # NVML's way of saying "no new samples": the read worked

        samples = self._read(state, "process_utilization", new_samples)
        state.util_read_ok = samples is not None
        listed = {p.pid for p in state.procs}
        for s in samples or ():
            # Only a sample of a listed process is trusted, and only it moves the last-seen timestamp:
            # drivers have answered samples of processes that do not run (nvtop issue #110), and one
            # with a bogus timestamp far ahead would hide every later sample.
            if s.pid not in listed:
                continue
            state.util_since_us = max(state.util_since_us, int(s.timestamp_us))
            state.util[s.pid] = (float(s.sm_pct), now_mono)
        for pid in [p for p, (_, at) in state.util.items() if now_mono - at > self._util_hold_s]:
            del state.util[pid]

    def _read(self, state: _DeviceState, name: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except NotSupported:
            self._once(state.uuid, name, "field not supported by the device; left unset")
            return None
        except NoPermission as exc:
            # lasts as long as the process runs as it does (an unprivileged profiler on a MIG GPU is
            # refused the GPU's aggregate figures): said once, counted every time
            self._once(state.uuid, name, f"field not readable without privileges; left unset: {exc}")
            self.stats.errors[(state.uuid, name)] = self.stats.errors.get((state.uuid, name), 0) + 1
            return None
        except (NoData, NotFound):
            self._count_error(state.uuid, name, NotFound(f"{name}: no data"))
            return None
        except GpuLost as exc:
            state.lost = True
            self.stats.lost_events += 1
            self._log.error("GPU lost; skipping it until rediscovery", device=state.uuid, field=name, error=str(exc))
            raise _Lost() from exc
        except Exception as exc:  # noqa: BLE001 - one bad read must not stop the sample
            self._count_error(state.uuid, name, exc)
            return None

    # --- host side ------------------------------------------------------------------------------------
    def _host(self, pid: int, now_mono: float) -> tuple[_ProcState, signature_pb2.HostCounters] | None:
        ps = self._psutil
        host = signature_pb2.HostCounters()
        if ps is None:
            pstate = self._procs.get(pid)
            if pstate is None:
                pstate = self._procs[pid] = _ProcState(proc=None, name="", start_s=None, uid=None)
            return pstate, host
        try:
            pstate = self._proc_state(pid)
            proc = pstate.proc
            cpu = self._host_field(pid, "cpu_pct", proc.cpu_percent)
            if cpu is not None:
                if pstate.primed_cpu:
                    host.cpu_pct = float(cpu)
                pstate.primed_cpu = True
            mem = self._host_field(pid, "rss_mib", proc.memory_info)
            if mem is not None:
                host.rss_mib = mem.rss / MIB
            io = self._host_field(pid, "io", proc.io_counters)
            if io is not None:
                last = pstate.last_io
                pstate.last_io = (now_mono, float(io.read_bytes), float(io.write_bytes))
                if last is not None and now_mono > last[0]:
                    dt = now_mono - last[0]
                    host.io_read_kbps = max(0.0, io.read_bytes - last[1]) / 1024 / dt
                    host.io_write_kbps = max(0.0, io.write_bytes - last[2]) / 1024 / dt
        except _Vanished:
            self.stats.vanished += 1
            self._procs.pop(pid, None)
            self._log.info("process exited while being sampled; skipped", pid=pid)
            return None
        return pstate, host

    def _proc_state(self, pid: int) -> _ProcState:
        ps = self._psutil
        existing = self._procs.get(pid)
        if existing is not None:
            # still the same process? (a reused pid has another start time)
            if existing.start_s is None or _call(existing.proc, "create_time", ps) == existing.start_s:
                return existing
        try:
            proc = ps.Process(pid)
        except ps.NoSuchProcess as exc:
            raise _Vanished() from exc
        name = _call(proc, "name", ps)
        start = _call(proc, "create_time", ps)
        uids = _call(proc, "uids", ps)
        state = _ProcState(
            proc=proc,
            name=str(name) if name else "",
            start_s=float(start) if start is not None else None,
            uid=int(uids.real) if uids is not None else None,
        )
        self._procs[pid] = state
        return state

    def _host_field(self, pid: int, name: str, fn: Callable[[], T]) -> T | None:
        ps = self._psutil
        try:
            return fn()
        except ps.NoSuchProcess as exc:  # ZombieProcess is one too
            raise _Vanished() from exc
        except (ps.AccessDenied, NotImplementedError, AttributeError):
            self._once(f"pid:{pid}", name, "host counter not readable; left unset")
            return None

    # --- in-app counters and app ids -----------------------------------------------------------------
    def _read_inapp(self, pid: int, pstate: _ProcState, now_s: float, now_mono: float) -> InAppReport | None:
        finder = self._inapp
        if finder is None:
            return None
        owners = self._owners(pstate)
        paths = finder.paths(pid)
        found = self._inapp_reports(finder, pid, pstate, paths, owners, now_s)
        if not found.reports and now_mono - self._inapp_scanned_at >= self._inapp_scan_every_s:
            # no report under the names known: list the directory (bounded) for the stub's other name,
            # for every process of the node at once
            self._inapp_scanned_at = now_mono
            read_before = finder.entries_read
            try:
                finder.scan({p: self._owners(s) for p, s in self._procs.items()})
            except FileNotFoundError:
                pass  # no directory: no stub has written yet
            except OSError as exc:
                self._count_error("inapp_dir", "scan", exc)
            self.stats.inapp_scans += 1
            self.stats.inapp_scan_entries += finder.entries_read - read_before
            new = [p for p in finder.paths(pid) if p not in paths]
            if new:
                found = self._inapp_reports(finder, pid, pstate, new, owners, now_s)
        if not found.reports:
            return None
        report = found.reports[0]
        for name, why in report.dropped:
            key = f"{name}: {why}"
            self.stats.inapp_dropped[key] = self.stats.inapp_dropped.get(key, 0) + 1
            self._once(f"pid:{pid}", f"inapp.{name}", f"in-app counter {name} left out: {why}")
        return report

    @staticmethod
    def _owners(pstate: _ProcState) -> tuple[int, ...] | None:
        """Who may own a process's in-app file: root or the process's user (None: its user unknown)."""
        return None if pstate.uid is None else (0, pstate.uid)

    def _inapp_reports(self, finder: InAppFinder, pid: int, pstate: _ProcState, paths: list[Path],
                       owners: tuple[int, ...] | None, now_s: float) -> InAppFound:
        found = read_inapp_reports(
            paths, pid, now_s=now_s, pid_start_s=pstate.start_s, owners=owners, max_age_s=self._inapp_max_age_s,
            gone=lambda path: finder.forget(pid, path),
        )
        for kind, name, why in found.skipped:
            if kind == "malformed":
                self.stats.inapp_bad += 1
                self._once(f"pid:{pid}", "inapp", f"ignoring malformed in-app file {name}: {why}")
            elif kind == "owner":
                self._once(f"pid:{pid}", "inapp_owner", f"ignoring in-app file {name} {why}, not by root or uid {pstate.uid}")
            else:
                self._count_error(f"pid:{pid}", "inapp", OSError(f"{name}: {why}"))
        return found

    def _app_id(self, pid: int, pstate: _ProcState, inapp: InAppReport | None) -> str:
        if pstate.app_id is None and inapp is not None:
            problem = app_id_problem(inapp.app_id)
            if problem is None:
                pstate.app_id = inapp.app_id  # sticky for the life of the process
            else:
                self._once(f"pid:{pid}", "inapp_app_id", f"ignoring the in-app app_id: {problem}")
        if pstate.app_id is None and self._app_id_of is not None:
            pstate.app_id = self._app_id_of(pid)
        if pstate.app_id is not None:
            return pstate.app_id
        # A process name may hold any character: it is cut to what the app-id rule allows.
        name = sanitize_app_id_part(pstate.name)[:64] if pstate.name else ""
        return f"pid:{pid}:{name}" if name else f"pid:{pid}"

    # --- logging -------------------------------------------------------------------------------------
    def _once(self, where: str, name: str, message: str) -> None:
        key = (where, name)
        if key not in self._logged_once:
            self._logged_once.add(key)
            self._log.warning(message, where=where, field=name)

    def _count_error(self, where: str, name: str, exc: BaseException) -> None:
        key = (where, name)
        n = self.stats.errors.get(key, 0) + 1
        self.stats.errors[key] = n
        if _is_power_of_ten(n):
            self._log.warning("read failed", where=where, field=name, error=repr(exc), count=n)


def _fill_inapp(msg: signature_pb2.InAppCounters, report: InAppReport) -> None:
    """Every counter of the report (already checked by `parse_inapp`) into the signature's in_app."""
    c = report.counters
    for f in fields(c):
        value = getattr(c, f.name)
        if value is not None:
            setattr(msg, f.name, value)


def _call(proc: Any, method: str, ps: Any) -> Any:
    """A psutil Process method that may be missing or denied: its value, or None. NoSuchProcess escapes
    as _Vanished."""
    fn = getattr(proc, method, None)
    if fn is None:
        return None
    try:
        return fn()
    except ps.NoSuchProcess as exc:
        raise _Vanished() from exc
    except (ps.AccessDenied, NotImplementedError):
        return None


def _is_power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1

