"""A simulated GPU that behaves like a real one, driven by canonical traces.

`SimBackend(gpus=["h100-80gb"], clock=time.monotonic, privileged=True)` holds `SimDevice`s built from
the SKU tables in `vgpu.device.skus`. Applications are launched onto a device with a canonical trace
(`vgpu.traces.AppTrace`); every read evaluates the device at `clock()`:

- Trace time: a process launched at `t0` with `speed` shows the trace sample in force at trace time
  `(clock() - t0) * speed` measured from the trace's first sample (zero-order hold: the last sample at
  or before that time; a missing value carries the previous one forward, 0 before the first). By
  default the process *ends* (leaves `processes()`) one sample period after the trace's last sample;
  with `loop=True` the trace repeats with that period. The trace is not stretched by power throttling:
  the slowdown is reported (`SimDevice.throttle()`), benchmarks apply it.
- Memory: a process uses the trace's `mem_used_mib`, capped at what is left in its domain (the whole
  GPU, or its GPU instance under MIG) after processes launched before it: an over-ask is clipped, as an
  allocation past capacity fails on a real GPU (`SimDevice.snapshot()` shows the demand beside it).
- Per-cgroup memory limits (NVML's nvmlDeviceSetMemoryLimits_v1): a process launched with
  `cgroup=PATH` belongs to that namespace; its memory is also capped at the namespace's hard limit
  minus what the namespace's earlier processes use, clipped like an over-ask of capacity. The soft
  limit is stored and read back but not enforced (what a driver does at it is not documented).
  `SimBackend(memory_limits=False)` models a driver without the functions (NotSupported).
- Utilization: the device's SM / memory-bandwidth utilization are the sums over processes, capped at
  100. Reads raise NotSupported while MIG is enabled, as on real devices.
- SM contention (`contention_speeds`): a process's `sm_util_pct` is what it asks of a whole GPU when
  alone. An MPS share (`set_sm_share`) caps what it gets; the processes of one domain (the GPU, or a
  MIG instance, which serves slices / compute slices of the GPU) that together ask for more than the
  domain serves are time-sliced in proportion to what they ask. A process's progress rate
  (`SimProcessSample.speed`, 1.0 = as fast as alone) is what it got over what it asked, so five
  processes at 90 % on one GPU each run at 100 / 450 = 0.22 x. Checked against the Gavel pair
  throughputs and the MISO per-slice iteration times (tests/test_contention.py). The trace itself
  is not stretched; benchmarks account the lost progress (bench/replay.py).
- Power: demand = idle floor + (max limit - idle floor) * SM util / 100. When the demand exceeds the
  power limit, the draw is the limit and the SM clock drops by the cube root of the dynamic-power
  ratio (dynamic power ~ f * V^2 with V ~ f); `throttle().slowdown` = 1 / clock ratio.
- Per-process utilization: one sample per process every `sample_period_s` (on a grid of the injected
  clock, timestamps in its microseconds), kept for `sample_buffer_s`; `process_utilization(since_us)`
  returns the samples newer than `since_us`.
- In-app counters: `SimBackend.inapp_counters(pid)` gives what the process's application would report
  about itself (a client stub's in-app file on a real node): its trace's `inapp_*` columns at the row
  in force, without forward fill (an empty cell is a counter not reported then). No NVML read gives
  them; the profiler's Sampler takes them through its `inapp_of` (`vgpu record --sim-trace`).
- MIG reconfiguration takes `mig_reconfig_s` (default 6 s): the first MIG write after a quiet period
  opens a reconfiguration window of that length; writes inside the window join it. Writes return at
  once and the layout reads back at once, but instances created in a window become usable when it
  closes: a process launched into one starts (appears, follows its trace) only then.
- Constraints: power limit outside the constraints -> InvalidArgument; writes without privilege ->
  NoPermission; MIG calls with MIG disabled or on a SKU without MIG -> NotSupported; overlapping
  placement, over max count or over the compute slices -> InsufficientResources; a start that is no
  placement of the profile -> InvalidArgument; destroying an instance with processes -> InUse; after
  `lose()` every call -> GpuLost. `inject(method, error, times)` makes the next calls of a method fail.

Not modelled: ECC, clocks other than SM, temperature, compute instances smaller than their GPU
instance, the GPU reset some A100 boards need after a MIG mode change, the driver's own memory.
"""

from __future__ import annotations

import math
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from vgpu.device.base import (
    Backend,
    Device,
    GpuInstance,
    GpuInstanceProfile,
    MemoryInfo,
    MemoryLimitMib,
    Placement,
    PowerConstraints,
    ProcessInfo,
    ProcessUtilization,
    Utilization,
    check_memory_limit,
    check_memory_limit_namespace,
)
from vgpu.device.errors import (
    DeviceError,
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidArgument,
    NoPermission,
    NotFound,
    NotSupported,
    from_nvml_code,
)
from vgpu.device.skus import LayoutSlot, Sku, get_sku, layout_problem
from vgpu.traces import INAPP_NUMERIC, AppTrace

Clock = Callable[[], float]

DEFAULT_MIG_RECONFIG_S = 6.0
# NVML averages utilization over 1/6 s to 1 s depending on the product (reference "Sampling").
DEFAULT_SAMPLE_PERIOD_S = 1 / 6
DEFAULT_SAMPLE_BUFFER_S = 10.0
# Lowest SM clock ratio the power model throttles to.
MIN_CLOCK_RATIO = 0.2


def contention_speeds(
    demand_pct: Sequence[float],
    capacity_pct: float = 100.0,
    share_pct: Sequence[float] | None = None,
) -> list[float]:
    """The progress rate of each process of one domain under SM contention (1.0: as fast as alone).

    `demand_pct[i]` is the SM share of a whole GPU process i keeps busy when alone (its trace's
    `sm_util_pct`); `capacity_pct` is what the domain serves (100 for a whole GPU, 100 x slices /
    compute slices for a MIG instance); `share_pct[i]` caps what process i may get (an MPS active
    thread percentage; inf or absent: no cap). Each process first gets min(demand, share); when
    those together exceed the capacity, each is scaled by capacity / their sum (time slicing in
    proportion to demand). The rate is got / demand; a process asking nothing runs at 1.0."""
    if capacity_pct < 0 or not math.isfinite(capacity_pct):
        raise ValueError(f"capacity_pct must be a finite number >= 0, not {capacity_pct}")
    shares = list(share_pct) if share_pct is not None else [math.inf] * len(demand_pct)
    if len(shares) != len(demand_pct):
        raise ValueError("demand_pct and share_pct must have one entry per process")
    asked = [max(0.0, min(float(d), s)) for d, s in zip(demand_pct, shares, strict=True)]
    total = sum(asked)
    scale = 1.0 if total <= capacity_pct or total <= 0 else capacity_pct / total
    return [1.0 if d <= 0 else min(1.0, a * scale / float(d)) for d, a in zip(demand_pct, asked, strict=True)]


class ManualClock:
    """A clock for tests and replays: call it for the time, `advance(dt_s)` or `set(t_s)` to move it."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._t = float(start_s)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._t

    def advance(self, dt_s: float) -> float:
        if dt_s < 0:
            raise ValueError(f"a clock does not go back ({dt_s} s)")
        with self._lock:
            self._t += dt_s
            return self._t

    def set(self, t_s: float) -> None:
        if t_s < self._t:
            raise ValueError(f"a clock does not go back ({t_s} < {self._t})")
        self._t = float(t_s)


@dataclass(frozen=True)
class SimLaunch:
    """What `SimBackend.launch` started."""

    app_id: str
    pid: int
    device_index: int
    gpu_instance_id: int | None
    start_s: float  # clock time the process appears (later than launch inside a MIG reconfiguration)
    end_s: float | None  # clock time it leaves; None when it loops
    # trace seconds one pass of its trace lasts (a looping process starts it again after that):
    # trace time tau of pass k is at clock time start_s + (k * length_s + tau) / speed
    length_s: float = 0.0


@dataclass(frozen=True)
class Throttle:
    """The power model at one instant."""

    demand_mw: int  # what the load would draw without a limit
    power_mw: int  # what it draws
    clock_ratio: float  # SM clock / max SM clock (1.0 unthrottled)
    sm_clock_mhz: int
    slowdown: float  # 1 / clock_ratio: how much longer compute-bound work takes


@dataclass(frozen=True)
class SimProcessSample:
    """One process as the simulator sees it at an instant (beyond what NVML would show)."""

    app_id: str
    pid: int
    gpu_instance_id: int | None
    demand_mib: float  # the trace's memory
    used_mib: float  # after clipping to its domain's capacity
    sm_pct: float
    mem_bw_pct: float
    speed: float = 1.0  # progress rate under SM contention (contention_speeds), 1.0 = as fast as alone

    @property
    def clipped(self) -> bool:
        return self.used_mib < self.demand_mib


class _Series:
    """A trace prepared for lookups: relative times and forward-filled columns."""

    def __init__(self, trace: AppTrace) -> None:
        if len(trace) == 0:
            raise ValueError(f"trace of {trace.app!r} has no samples")
        t = np.asarray(trace.t_s, dtype=np.float64)
        self.t_rel = t - t[0]
        diffs = np.diff(self.t_rel)
        diffs = diffs[diffs > 0]
        self.period_s = float(np.median(diffs)) if len(diffs) else 1.0
        self.length_s = float(self.t_rel[-1]) + self.period_s
        self.mem = self._ffill(trace.column("mem_used_mib"))
        self.sm = self._ffill(trace.column("sm_util_pct"))
        self.mem_bw = self._ffill(trace.column("mem_util_pct"))
        self.tx = self._ffill(trace.column("pcie_tx_kbps"))
        self.rx = self._ffill(trace.column("pcie_rx_kbps"))
        # the trace's in-app columns by counter name (inapp_step -> step), NaN kept: an empty cell is
        # a counter the application did not report then (SimBackend.inapp_counters)
        self.inapp = {c[len("inapp_"):]: np.asarray(trace.columns[c], dtype=np.float64)
                      for c in INAPP_NUMERIC if c in trace.columns}

    @staticmethod
    def _ffill(values: np.ndarray) -> np.ndarray:
        out = np.array(values, dtype=np.float64)
        ok = np.isfinite(out)
        if not ok.any():
            return np.zeros_like(out)
        idx = np.where(ok, np.arange(len(out)), -1)
        np.maximum.accumulate(idx, out=idx)
        filled = np.where(idx >= 0, out[np.maximum(idx, 0)], 0.0)
        return filled

    def index(self, tau_s: float) -> int:
        return max(0, int(np.searchsorted(self.t_rel, tau_s, side="right")) - 1)


class _Proc:
    def __init__(
        self,
        app_id: str,
        pid: int,
        series: _Series,
        start_s: float,
        speed: float,
        loop: bool,
        gi_id: int | None,
        seq: int,
        cgroup: str | None = None,
    ) -> None:
        self.app_id = app_id
        self.cgroup = cgroup
        self.pid = pid
        self.series = series
        self.start_s = start_s
        self.speed = speed
        self.loop = loop
        self.gi_id = gi_id
        self.seq = seq
        self.end_s = None if loop else start_s + series.length_s / speed

    def active(self, now: float) -> bool:
        return now >= self.start_s and (self.end_s is None or now < self.end_s)

    def row(self, now: float) -> int:
        tau = (now - self.start_s) * self.speed
        if self.loop:
            tau = math.fmod(tau, self.series.length_s)
        return self.series.index(tau)


@dataclass
class _Gi:
    instance_id: int
    profile_id: int
    placement: Placement
    uuid: str
    ready_s: float
    has_ci: bool


_READS = (
    "memory",
    "utilization",
    "power_usage_mw",
    "power_limit_mw",
    "power_constraints",
    "sm_clock_mhz",
    "pci_bus_id",
    "temperature_c",
    "pcie_throughput_kbps",
    "processes",
    "process_utilization",
    "mig_enabled",
    "gpu_instance_profiles",
    "gpu_instances",
    "memory_limit_mib",
)
_WRITES = ("set_power_limit_mw", "create_gpu_instance", "destroy_gpu_instance", "set_mig_mode", "set_memory_limit_mib")
INJECTABLE = frozenset(_READS + _WRITES)


class SimDevice(Device):
    """One simulated GPU. Create through `SimBackend`."""

    def __init__(
        self,
        backend: SimBackend,
        index: int,
        sku: Sku,
        *,
        mig_enabled: bool = False,
        mig_reconfig_s: float = DEFAULT_MIG_RECONFIG_S,
    ) -> None:
        if mig_enabled and not sku.supports_mig:
            raise ValueError(f"{sku.key} has no MIG")
        if mig_reconfig_s < 0:
            raise ValueError(f"mig_reconfig_s must be >= 0, not {mig_reconfig_s}")
        self._backend = backend
        self._index = index
        self.sku = sku
        self._uuid = "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_OID, f"vgpu-sim/{index}/{sku.key}"))
        self._lock = threading.RLock()
        self._power_limit_mw = sku.power_default_mw
        self._mig = mig_enabled
        self._mig_reconfig_s = float(mig_reconfig_s)
        self._reconfig_until_s = -math.inf
        self._gis: dict[int, _Gi] = {}
        self._procs: dict[int, _Proc] = {}
        self._mem_limits: dict[str, tuple[float, float]] = {}  # cgroup -> (soft, hard) MiB
        self._sm_shares: dict[int, float] = {}  # pid -> MPS share cap (set_sm_share)
        self._lost = False
        # method -> (error, calls it still fails or None for until cleared)
        self._faults: dict[str, tuple[DeviceError | type[DeviceError] | int, int | None]] = {}
        self.writes = 0  # state-changing writes so far (a set to the current value is none)

    # --- identity --------------------------------------------------------------------------
    @property
    def index(self) -> int:
        return self._index

    @property
    def uuid(self) -> str:
        return self._uuid

    @property
    def name(self) -> str:
        return self.sku.product_name

    @property
    def mig_reconfig_s(self) -> float:
        """Seconds a MIG reconfiguration takes before its new instances are usable."""
        return self._mig_reconfig_s

    # --- test hooks ------------------------------------------------------------------------
    def lose(self) -> None:
        """The GPU falls off the bus: every later call raises GpuLost."""
        self._lost = True

    @property
    def lost(self) -> bool:
        return self._lost

    def inject(self, method: str, error: DeviceError | type[DeviceError] | int, times: int | None = 1) -> None:
        """The next `times` calls of `method` raise `error` (an error, its class, or an NVML code);
        `times=None` until `clear_faults()`."""
        if method not in INJECTABLE:
            raise ValueError(f"cannot inject into {method!r}; one of {', '.join(sorted(INJECTABLE))}")
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None, not {times}")
        self._faults[method] = (error, times)

    def clear_faults(self) -> None:
        self._faults.clear()

    def _enter(self, method: str, *, write: bool = False) -> None:
        if self._lost:
            raise GpuLost(f"GPU {self._index} ({self._uuid}) is lost")
        fault = self._faults.get(method)
        if fault is not None:
            error, remaining = fault
            if remaining is not None:
                if remaining <= 1:
                    del self._faults[method]
                else:
                    self._faults[method] = (error, remaining - 1)
            if isinstance(error, int):
                raise from_nvml_code(error, f"injected into {method}")
            if isinstance(error, type):
                raise error(f"injected into {method}")
            raise error
        if write:
            self._check_privilege(method)

    def _check_privilege(self, method: str) -> None:
        if not self._backend.privileged:
            raise NoPermission(f"{method} on GPU {self._index} needs root or CAP_SYS_ADMIN")

    def _require_mig(self, method: str) -> None:
        if not self.sku.supports_mig:
            raise NotSupported(f"{method}: {self.sku.key} has no MIG")
        if not self._mig:
            raise NotSupported(f"{method}: MIG is disabled on GPU {self._index}")

    # --- the state at an instant -----------------------------------------------------------
    def _now(self) -> float:
        return self._backend.clock()

    def _prune(self, now: float) -> None:
        for pid in [pid for pid, p in self._procs.items() if p.end_s is not None and now >= p.end_s]:
            del self._procs[pid]
            self._sm_shares.pop(pid, None)
            self._backend._forget(pid)

    def _snapshot(self, now: float) -> list[SimProcessSample]:
        self._prune(now)
        domain_used: dict[int | None, float] = {}
        cgroup_used: dict[str, float] = {}
        out = []
        for p in sorted(self._procs.values(), key=lambda p: p.seq):
            if not p.active(now):
                continue
            i = p.row(now)
            s = p.series
            want = float(s.mem[i])
            cap = self._gi_mem(p.gi_id) if p.gi_id is not None else float(self.sku.mem_total_mib)
            room = cap - domain_used.get(p.gi_id, 0.0)
            if p.cgroup is not None and p.cgroup in self._mem_limits:
                room = min(room, self._mem_limits[p.cgroup][1] - cgroup_used.get(p.cgroup, 0.0))
            used = max(0.0, min(want, room))
            domain_used[p.gi_id] = domain_used.get(p.gi_id, 0.0) + used
            if p.cgroup is not None:
                cgroup_used[p.cgroup] = cgroup_used.get(p.cgroup, 0.0) + used
            out.append(
                SimProcessSample(
                    app_id=p.app_id,
                    pid=p.pid,
                    gpu_instance_id=p.gi_id,
                    demand_mib=want,
                    used_mib=used,
                    sm_pct=float(min(100.0, s.sm[i])),
                    mem_bw_pct=float(min(100.0, s.mem_bw[i])),
                )
            )
        return self._with_speeds(out)

    def _domain_sm_pct(self, gi_id: int | None) -> float:
        """The SM a domain serves, as a share of the whole GPU: 100, or a MIG instance's slices."""
        if gi_id is None or gi_id not in self._gis:
            return 100.0
        prof = self.sku.profile(self._gis[gi_id].profile_id)
        assert prof is not None
        return 100.0 * prof.slice_count / self.sku.compute_slices

    def _with_speeds(self, samples: list[SimProcessSample]) -> list[SimProcessSample]:
        by_domain: dict[int | None, list[int]] = {}
        for i, smp in enumerate(samples):
            by_domain.setdefault(smp.gpu_instance_id, []).append(i)
        out = list(samples)
        for gi_id, idx in by_domain.items():
            speeds = contention_speeds([samples[i].sm_pct for i in idx], self._domain_sm_pct(gi_id),
                                       [self._sm_shares.get(samples[i].pid, math.inf) for i in idx])
            for i, v in zip(idx, speeds, strict=True):
                if v != 1.0:
                    out[i] = replace(samples[i], speed=v)
        return out

    def set_sm_share(self, pid: int, share_pct: float | None) -> None:
        """Cap the SM share process `pid` may use (an MPS client's active thread percentage; None:
        no cap). A simulator hook: NVML has no such call, MPS sets it per client at launch."""
        with self._lock:
            if share_pct is None:
                self._sm_shares.pop(pid, None)
                return
            if not 0 <= share_pct <= 100:
                raise InvalidArgument(f"an SM share must be in [0, 100], not {share_pct}")
            self._sm_shares[pid] = float(share_pct)

    def _gi_mem(self, gi_id: int) -> float:
        prof = self.sku.profile(self._gis[gi_id].profile_id)
        assert prof is not None
        return float(prof.mem_mib)

    def snapshot(self) -> list[SimProcessSample]:
        """Every running process now, with its memory demand beside what it got."""
        with self._lock:
            self._enter("processes")
            return self._snapshot(self._now())

    def _sm_total(self, now: float) -> float:
        return min(100.0, sum(s.sm_pct for s in self._snapshot(now)))

    def _throttle(self, now: float) -> Throttle:
        sku = self.sku
        util = self._sm_total(now)
        idle = sku.idle_power_mw
        demand = idle + (sku.power_max_mw - idle) * util / 100.0
        limit = self._power_limit_mw
        if demand <= limit or demand <= idle:
            ratio = 1.0
            power = demand
        else:
            ratio = max(MIN_CLOCK_RATIO, ((limit - idle) / (demand - idle)) ** (1 / 3))
            power = float(limit)
        return Throttle(
            demand_mw=int(round(demand)),
            power_mw=int(round(power)),
            clock_ratio=ratio,
            sm_clock_mhz=int(round(sku.sm_clock_max_mhz * ratio)),
            slowdown=1.0 / ratio,
        )

    def throttle(self) -> Throttle:
        """The power model now: demand, draw, SM clock and the slowdown of compute-bound work."""
        with self._lock:
            self._enter("power_usage_mw")
            return self._throttle(self._now())

    # --- reads -----------------------------------------------------------------------------
    def memory(self) -> MemoryInfo:
        with self._lock:
            self._enter("memory")
            used = sum(s.used_mib for s in self._snapshot(self._now()))
            total = float(self.sku.mem_total_mib)
            return MemoryInfo(total_mib=total, used_mib=used, free_mib=max(0.0, total - used))

    def utilization(self) -> Utilization:
        with self._lock:
            self._enter("utilization")
            if self._mig:
                raise NotSupported(f"utilization is not reported while MIG is enabled on GPU {self._index}")
            snap = self._snapshot(self._now())
            return Utilization(
                sm_pct=min(100.0, sum(s.sm_pct for s in snap)),
                mem_bw_pct=min(100.0, sum(s.mem_bw_pct for s in snap)),
            )

    def power_usage_mw(self) -> int:
        with self._lock:
            self._enter("power_usage_mw")
            return self._throttle(self._now()).power_mw

    def pci_bus_id(self) -> str:
        with self._lock:
            self._enter("pci_bus_id")
            return f"00000000:{0x17 + 0x10 * self._index:02X}:00.0"

    def temperature_c(self) -> int:
        """A steady-state model: 30 C idle, rising linearly with the power drawn to 80 C at the
        board's maximum power."""
        with self._lock:
            self._enter("temperature_c")
            draw = self._throttle(self._now()).power_mw
            return int(round(30 + 50 * draw / max(1, self.sku.power_max_mw)))

    def power_limit_mw(self) -> int:
        with self._lock:
            self._enter("power_limit_mw")
            return self._power_limit_mw

    def power_constraints(self) -> PowerConstraints:
        with self._lock:
            self._enter("power_constraints")
            s = self.sku
            return PowerConstraints(min_mw=s.power_min_mw, max_mw=s.power_max_mw, default_mw=s.power_default_mw)

    def sm_clock_mhz(self) -> int:
        with self._lock:
            self._enter("sm_clock_mhz")
            return self._throttle(self._now()).sm_clock_mhz

    def pcie_throughput_kbps(self) -> tuple[float, float]:
        with self._lock:
            self._enter("pcie_throughput_kbps")
            now = self._now()
            self._prune(now)
            tx = rx = 0.0
            for p in self._procs.values():
                if p.active(now):
                    i = p.row(now)
                    tx += float(p.series.tx[i])
                    rx += float(p.series.rx[i])
            return tx, rx

    def processes(self) -> Sequence[ProcessInfo]:
        with self._lock:
            self._enter("processes")
            return [
                ProcessInfo(pid=s.pid, used_mib=s.used_mib, gpu_instance_id=s.gpu_instance_id)
                for s in self._snapshot(self._now())
            ]

    def process_utilization(self, since_us: int) -> Sequence[ProcessUtilization]:
        with self._lock:
            self._enter("process_utilization")
            if self._mig:
                raise NotSupported(f"process utilization is not reported while MIG is enabled on GPU {self._index}")
            now = self._now()
            self._prune(now)
            period = self._backend.sample_period_s
            lo_s = max(since_us / 1e6, now - self._backend.sample_buffer_s)
            out: list[ProcessUtilization] = []
            k_hi = math.floor(now / period + 1e-9)
            for p in sorted(self._procs.values(), key=lambda p: p.seq):
                k = max(math.floor(lo_s / period + 1e-9) + 1, math.ceil(p.start_s / period - 1e-9))
                while k <= k_hi:
                    t = k * period
                    ts_us = int(round(t * 1e6))
                    if ts_us > since_us and p.active(t):
                        i = p.row(t)
                        out.append(
                            ProcessUtilization(
                                pid=p.pid,
                                timestamp_us=ts_us,
                                sm_pct=float(min(100.0, p.series.sm[i])),
                                mem_bw_pct=float(min(100.0, p.series.mem_bw[i])),
                            )
                        )
                    k += 1
            out.sort(key=lambda u: (u.timestamp_us, u.pid))
            return out

    def mig_enabled(self) -> bool:
        with self._lock:
            self._enter("mig_enabled")
            if not self.sku.supports_mig:
                raise NotSupported(f"{self.sku.key} has no MIG")
            return self._mig

    def gpu_instance_profiles(self) -> Sequence[GpuInstanceProfile]:
        with self._lock:
            self._enter("gpu_instance_profiles")
            self._require_mig("gpu_instance_profiles")
            return [p.as_gpu_instance_profile() for p in self.sku.mig_profiles]

    def _gi_value(self, gi: _Gi) -> GpuInstance:
        prof = self.sku.profile(gi.profile_id)
        assert prof is not None
        return GpuInstance(
            instance_id=gi.instance_id,
            profile_id=gi.profile_id,
            profile_name=prof.name,
            placement=gi.placement,
            uuid=gi.uuid if gi.has_ci else "",
            mem_total_mib=float(prof.mem_mib),
        )

    def gpu_instances(self) -> Sequence[GpuInstance]:
        with self._lock:
            self._enter("gpu_instances")
            self._require_mig("gpu_instances")
            return [self._gi_value(gi) for gi in sorted(self._gis.values(), key=lambda g: g.instance_id)]

    def _require_memory_limits(self, method: str) -> None:
        if not self._backend.memory_limits:
            raise NotSupported(f"{method}: the driver of GPU {self._index} has no per-cgroup memory limits")

    def memory_limit_mib(self, namespace: str) -> MemoryLimitMib:
        """The namespace's (soft, hard) limits (inf: none) and what its processes use now."""
        with self._lock:
            self._enter("memory_limit_mib")
            self._require_memory_limits("memory_limit_mib")
            check_memory_limit_namespace(namespace)
            soft, hard = self._mem_limits.get(namespace, (math.inf, math.inf))
            used = sum((s.used_mib for s, p in self._snapshot_procs(self._now()) if p.cgroup == namespace), 0.0)
            return MemoryLimitMib(soft, hard, used)

    def memory_limits(self) -> dict[str, tuple[float, float]]:
        """Every namespace with a memory limit: (soft, hard) MiB, inf where that one is unset. The
        simulator's view for tests and for persisting its state; NVML has no such listing."""
        with self._lock:
            return dict(self._mem_limits)

    def _snapshot_procs(self, now: float) -> list[tuple[SimProcessSample, _Proc]]:
        return [(s, self._procs[s.pid]) for s in self._snapshot(now)]

    def mig_reconfiguring_until_s(self) -> float | None:
        """Clock time the current MIG reconfiguration window closes; None when none is open."""
        with self._lock:
            now = self._now()
            return self._reconfig_until_s if self._reconfig_until_s > now else None

    def gpu_instance_ready_s(self, instance_id: int) -> float:
        """Clock time the instance becomes usable (its reconfiguration window's end)."""
        with self._lock:
            gi = self._gis.get(instance_id)
            if gi is None:
                raise NotFound(f"no GPU instance {instance_id} on GPU {self._index}")
            return gi.ready_s

    # --- writes ----------------------------------------------------------------------------
    def set_power_limit_mw(self, limit_mw: int) -> None:
        """Set the power limit; a set to the current limit writes nothing (and needs no privilege)."""
        with self._lock:
            self._enter("set_power_limit_mw")
            s = self.sku
            if not isinstance(limit_mw, int) or isinstance(limit_mw, bool):
                raise InvalidArgument(f"power limit must be an int in mW, not {limit_mw!r}")
            if limit_mw == self._power_limit_mw:
                return
            self._check_privilege("set_power_limit_mw")
            if not s.power_min_mw <= limit_mw <= s.power_max_mw:
                raise InvalidArgument(
                    f"power limit {limit_mw} mW is outside {s.power_min_mw}..{s.power_max_mw} mW on GPU {self._index}"
                )
            self._power_limit_mw = limit_mw
            self.writes += 1

    def set_memory_limit_mib(self, namespace: str, soft_mib: float, hard_mib: float) -> None:
        """Cap the namespace's memory (inf, inf: no limit); a set to the current limits writes nothing.
        A hard limit under what the namespace uses now clips its processes at once."""
        with self._lock:
            self._enter("set_memory_limit_mib")
            self._require_memory_limits("set_memory_limit_mib")
            check_memory_limit(namespace, soft_mib, hard_mib)
            new = (float(soft_mib), float(hard_mib))
            if self._mem_limits.get(namespace, (math.inf, math.inf)) == new:
                return
            self._check_privilege("set_memory_limit_mib")
            if new == (math.inf, math.inf):
                del self._mem_limits[namespace]
            else:
                self._mem_limits[namespace] = new
            self.writes += 1

    def set_mig_mode(self, enabled: bool) -> None:
        """Enable or disable MIG (takes effect at once; the reset some boards need is not modelled).
        InUse while processes run, or, to disable, while GPU instances exist."""
        with self._lock:
            self._enter("set_mig_mode", write=True)
            if not self.sku.supports_mig:
                raise NotSupported(f"{self.sku.key} has no MIG")
            if enabled == self._mig:
                return
            now = self._now()
            self._prune(now)
            if self._procs:
                raise InUse(f"GPU {self._index} has {len(self._procs)} processes; MIG mode needs it idle")
            if not enabled and self._gis:
                raise InUse(f"GPU {self._index} still has {len(self._gis)} GPU instances")
            self._mig = enabled
            self.writes += 1

    def _open_reconfig(self, now: float) -> float:
        if now >= self._reconfig_until_s:
            self._reconfig_until_s = now + self._mig_reconfig_s
        return self._reconfig_until_s

    def _create_gi(self, profile_id: int, start: int, *, with_ci: bool) -> _Gi:
        self._enter("create_gpu_instance", write=True)
        self._require_mig("create_gpu_instance")
        prof = self.sku.profile(profile_id)
        if prof is None:
            raise InvalidArgument(f"{self.sku.key} has no GPU-instance profile id {profile_id}")
        place = prof.placement_at(start)
        if place is None:
            starts = ", ".join(str(p.start) for p in prof.placements)
            raise InvalidArgument(f"{prof.name} cannot start at memory slice {start}; valid starts: {starts}")
        layout = [LayoutSlot(g.placement.start, g.profile_id) for g in self._gis.values()]
        problem = layout_problem(self.sku, [*layout, LayoutSlot(start, profile_id)])
        if problem is not None:
            raise InsufficientResources(f"cannot create {prof.name} at {start}:{place.size} on GPU {self._index}: {problem}")
        gi_id = 1
        while gi_id in self._gis:
            gi_id += 1
        now = self._now()
        gi = _Gi(
            instance_id=gi_id,
            profile_id=profile_id,
            placement=place,
            uuid="MIG-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_OID, f"{self._uuid}/{gi_id}/{profile_id}/{start}")),
            ready_s=self._open_reconfig(now),
            has_ci=with_ci,
        )
        self._gis[gi_id] = gi
        self.writes += 1
        return gi

    def create_gpu_instance(self, profile_id: int, start: int) -> GpuInstance:
        """A GPU instance of `profile_id` at memory slice `start`, with one compute instance spanning it."""
        with self._lock:
            return self._gi_value(self._create_gi(profile_id, start, with_ci=True))

    def _busy(self, gi_id: int) -> list[int]:
        self._prune(self._now())
        return [p.pid for p in self._procs.values() if p.gi_id == gi_id]

    def _destroy_gi(self, instance_id: int, *, method: str = "destroy_gpu_instance", require_no_ci: bool = False) -> None:
        self._enter(method, write=True)
        self._require_mig(method)
        gi = self._gis.get(instance_id)
        if gi is None:
            raise NotFound(f"no GPU instance {instance_id} on GPU {self._index}")
        busy = self._busy(instance_id)
        if busy:
            raise InUse(f"GPU instance {instance_id} on GPU {self._index} has processes {busy}")
        if require_no_ci and gi.has_ci:
            raise InUse(f"GPU instance {instance_id} on GPU {self._index} still has a compute instance")
        del self._gis[instance_id]
        self._open_reconfig(self._now())
        self.writes += 1

    def destroy_gpu_instance(self, instance_id: int) -> None:
        """Destroy the instance and its compute instance; InUse while a process runs in it."""
        with self._lock:
            self._destroy_gi(instance_id)

    # --- used by SimBackend and the fake pynvml ---------------------------------------------
    def _mig_state(self, method: str) -> dict[int, _Gi]:
        """The live GPU instances, after the checks every MIG read makes (lost, faults, MIG on)."""
        self._enter(method)
        self._require_mig(method)
        return self._gis

    def _gi(self, instance_id: int) -> _Gi:
        gi = self._gis.get(instance_id)
        if gi is None:
            raise NotFound(f"no GPU instance {instance_id} on GPU {self._index}")
        return gi

    def _set_ci(self, instance_id: int, present: bool) -> None:
        """Create (present=True) or destroy the whole-instance compute instance."""
        with self._lock:
            self._enter("create_gpu_instance" if present else "destroy_gpu_instance", write=True)
            self._require_mig("compute instance")
            gi = self._gi(instance_id)
            if present:
                if gi.has_ci:
                    raise InsufficientResources(f"GPU instance {instance_id} already has its compute instance")
            else:
                if not gi.has_ci:
                    raise NotFound(f"GPU instance {instance_id} has no compute instance")
                busy = self._busy(instance_id)
                if busy:
                    raise InUse(f"compute instance of GPU instance {instance_id} has processes {busy}")
            gi.has_ci = present
            self.writes += 1

    def _add_proc(self, proc: _Proc) -> None:
        self._procs[proc.pid] = proc

    def _remove_proc(self, pid: int) -> bool:
        self._sm_shares.pop(pid, None)
        return self._procs.pop(pid, None) is not None


class SimBackend(Backend):
    """Simulated GPUs. `gpus` are SKU names ("h100-80gb") or `Sku`s (e.g. a variant without MIG for tests).

    `privileged` may be flipped at run time to test NoPermission; `clock` drives everything."""

    name = "sim"

    def __init__(
        self,
        gpus: Sequence[str | Sku] = ("h100-80gb",),
        *,
        clock: Clock = time.monotonic,
        privileged: bool = True,
        mig_enabled: bool = False,
        mig_reconfig_s: float = DEFAULT_MIG_RECONFIG_S,
        sample_period_s: float = DEFAULT_SAMPLE_PERIOD_S,
        sample_buffer_s: float = DEFAULT_SAMPLE_BUFFER_S,
        memory_limits: bool = True,
    ) -> None:
        if not gpus:
            raise ValueError("a SimBackend needs at least one GPU")
        if sample_period_s <= 0 or sample_buffer_s <= 0:
            raise ValueError("sample_period_s and sample_buffer_s must be > 0")
        self.clock = clock
        self.privileged = privileged
        self.memory_limits = memory_limits  # False: a driver without per-cgroup memory limits
        self.sample_period_s = float(sample_period_s)
        self.sample_buffer_s = float(sample_buffer_s)
        skus = [get_sku(g) if isinstance(g, str) else g for g in gpus]
        self._devices = [
            SimDevice(
                self,
                i,
                sku,
                mig_enabled=mig_enabled and sku.supports_mig,
                mig_reconfig_s=mig_reconfig_s,
            )
            for i, sku in enumerate(skus)
        ]
        self._where: dict[int, int] = {}  # pid -> device index
        self._seq = 0
        self._lock = threading.Lock()
        self.closed = False

    def devices(self) -> Sequence[SimDevice]:
        return list(self._devices)

    def close(self) -> None:
        self.closed = True

    def _device(self, index: int) -> SimDevice:
        if not 0 <= index < len(self._devices):
            raise InvalidArgument(f"no GPU {index}; this backend has {len(self._devices)}")
        return self._devices[index]

    def launch(
        self,
        app_id: str,
        pid: int,
        trace: AppTrace,
        device_index: int = 0,
        gpu_instance_id: int | None = None,
        speed: float = 1.0,
        *,
        loop: bool = False,
        cgroup: str | None = None,
    ) -> SimLaunch:
        """Start `pid` on a GPU (inside GPU instance `gpu_instance_id` when MIG is enabled), its usage
        following `trace` from now at `speed` x real time; `cgroup` is its memory-limit namespace."""
        if speed <= 0 or not math.isfinite(speed):
            raise ValueError(f"speed must be a positive number, not {speed}")
        if cgroup is not None:
            check_memory_limit_namespace(cgroup)
        dev = self._device(device_index)
        series = _Series(trace)
        other = self._where.get(pid)
        if other is not None:  # it may have ended since: let its device forget it
            with self._devices[other]._lock:
                self._devices[other]._prune(self.clock())
        with dev._lock, self._lock:
            dev._enter("processes")
            now = self.clock()
            if pid in self._where:
                raise InvalidArgument(f"pid {pid} already runs on GPU {self._where[pid]}")
            start = now
            if dev._mig:
                if gpu_instance_id is None:
                    raise InvalidArgument(f"GPU {device_index} has MIG enabled: name a GPU instance to run in")
                gi = dev._gi(gpu_instance_id)
                if not gi.has_ci:
                    raise InvalidArgument(f"GPU instance {gpu_instance_id} has no compute instance to run in")
                start = max(now, gi.ready_s)
            elif gpu_instance_id is not None:
                raise InvalidArgument(f"GPU {device_index} has MIG disabled: no GPU instance {gpu_instance_id}")
            self._seq += 1
            proc = _Proc(app_id, pid, series, start, speed, loop, gpu_instance_id, self._seq, cgroup)
            dev._add_proc(proc)
            self._where[pid] = device_index
            return SimLaunch(app_id, pid, device_index, gpu_instance_id, proc.start_s, proc.end_s, series.length_s)

    def inapp_counters(self, pid: int) -> dict[str, float]:
        """What `pid`'s application reports about itself now, as a client stub's in-app file would say
        it: its trace's in-app columns (`inapp_<name>` -> `name`) at the row in force, empty cells left
        out. Empty for a pid that does not run now or a trace without such columns. Not a device read:
        no NVML function gives it, so no fault is injected here."""
        with self._lock:
            index = self._where.get(pid)
        if index is None:
            return {}
        dev = self._devices[index]
        with dev._lock:
            now = self.clock()
            dev._prune(now)
            proc = dev._procs.get(pid)
            if proc is None or not proc.series.inapp or not proc.active(now):
                return {}
            i = proc.row(now)
            return {name: float(col[i]) for name, col in proc.series.inapp.items() if math.isfinite(col[i])}

    def kill(self, pid: int) -> bool:
        """End `pid` now; False when it was not running."""
        with self._lock:
            index = self._where.pop(pid, None)
        if index is None:
            return False
        dev = self._devices[index]
        with dev._lock:
            return dev._remove_proc(pid)

    def _forget(self, pid: int) -> None:
        self._where.pop(pid, None)


def without_mig(sku: Sku) -> Sku:
    """A variant of `sku` with no MIG (for tests of the NotSupported paths)."""
    return replace(sku, key=sku.key + "-nomig", mig_profiles=())
