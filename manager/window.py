"""A bounded window of recent samples per application, built from behavioural signatures.

Pure: no I/O, no clock of its own (callers pass `now_s`). Bounds: at most `max_samples` per
application (oldest dropped) and at most `max_apps` applications (the one silent longest is evicted
to make room); `evict_idle(now_s)` drops applications silent for more than `idle_evict_s`. A sample
whose time goes back, or whose `seq` is not above the application's last one at no newer time, is
dropped and counted; a lower seq with a newer time is taken as a restarted profiler and kept.
`trace(app_id)` gives the window as a `vgpu.traces.AppTrace` for forecasters.

What a signature contributes (the canonical trace columns; unset fields are NaN):
    mem_used_mib   process.gpu_mem_used_mib, else in_app.torch_reserved_mib
    sm_util_pct    process.sm_util_pct
    mem_total_mib  device.mem_total_mib         mem_util_pct  device.mem_bw_util_pct
    power_w        device.power_mw / 1000       power_limit_w device.power_limit_mw / 1000
    sm_clock_mhz, pcie_tx_kbps, pcie_rx_kbps    the device fields of the same names
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from vgpu.traces import NUMERIC, AppTrace
from vgpu.v1 import signature_pb2

_COL = {name: i for i, name in enumerate(NUMERIC)}


@dataclass(frozen=True)
class Sample:
    app_id: str
    device_id: str
    seq: int
    t_s: float
    values: tuple[float, ...]  # indexed like vgpu.traces.NUMERIC; NaN where unknown

    def get(self, column: str) -> float:
        return self.values[_COL[column]]


def _opt(msg: object, name: str, scale: float = 1.0) -> float:
    if msg is not None and msg.HasField(name):  # type: ignore[attr-defined]
        return float(getattr(msg, name)) * scale
    return math.nan


def sample_from_signature(sig: signature_pb2.BehavioralSignature) -> Sample:
    """The window's view of a (validated) signature."""
    dev = sig.device if sig.HasField("device") else None
    proc = sig.process if sig.HasField("process") else None
    inapp = sig.in_app if sig.HasField("in_app") else None
    mem = _opt(proc, "gpu_mem_used_mib")
    if math.isnan(mem):
        mem = _opt(inapp, "torch_reserved_mib")
    values = dict.fromkeys(NUMERIC, math.nan)
    values.update(
        mem_used_mib=mem,
        sm_util_pct=_opt(proc, "sm_util_pct"),
        mem_total_mib=_opt(dev, "mem_total_mib"),
        power_w=_opt(dev, "power_mw", 1e-3),
        power_limit_w=_opt(dev, "power_limit_mw", 1e-3),
        mem_util_pct=_opt(dev, "mem_bw_util_pct"),
        sm_clock_mhz=_opt(dev, "sm_clock_mhz"),
        pcie_tx_kbps=_opt(dev, "pcie_tx_kbps"),
        pcie_rx_kbps=_opt(dev, "pcie_rx_kbps"),
    )
    return Sample(sig.app_id, sig.device_id, sig.seq, sig.timestamp_s, tuple(values[c] for c in NUMERIC))


class AppWindow:
    """One application's recent samples."""

    def __init__(self, app_id: str, max_samples: int) -> None:
        self.app_id = app_id
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self.last_seq = 0
        self.last_t_s = -math.inf
        self.last_seen_s = -math.inf  # caller's clock when the last sample arrived

    @property
    def device_id(self) -> str:
        return self.samples[-1].device_id if self.samples else ""

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def trace(self) -> AppTrace:
        if not self.samples:
            return AppTrace(self.app_id, np.zeros(0), {c: np.zeros(0) for c in NUMERIC})
        data = np.asarray([s.values for s in self.samples], dtype=np.float64)
        t = np.asarray([s.t_s for s in self.samples], dtype=np.float64)
        columns = {c: data[:, i] for i, c in enumerate(NUMERIC) if not np.isnan(data[:, i]).all()}
        return AppTrace(self.app_id, t, columns, gpu=self.device_id or None)


class WindowStore:
    """Windows of every application, bounded in samples per app and in apps."""

    def __init__(self, *, max_samples: int = 1200, max_apps: int = 256, idle_evict_s: float = 30.0) -> None:
        if max_samples < 1 or max_apps < 1 or idle_evict_s <= 0:
            raise ValueError("max_samples and max_apps must be >= 1 and idle_evict_s > 0")
        self.max_samples = max_samples
        self.max_apps = max_apps
        self.idle_evict_s = idle_evict_s
        # Least recently seen first: move_to_end on every sample.
        self._apps: OrderedDict[str, AppWindow] = OrderedDict()
        self.out_of_order = 0
        self.seq_restarts = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._apps)

    def __contains__(self, app_id: object) -> bool:
        return app_id in self._apps

    def apps(self) -> list[str]:
        return list(self._apps)

    def window(self, app_id: str) -> AppWindow:
        return self._apps[app_id]

    def trace(self, app_id: str) -> AppTrace:
        return self._apps[app_id].trace()

    def add(self, sample: Sample, now_s: float) -> tuple[bool, list[str]]:
        """Add a sample. Returns (kept, apps evicted to make room). A sample that is out of order
        (seq not above the app's last, or time before its last sample) is not kept."""
        evicted: list[str] = []
        win = self._apps.get(sample.app_id)
        if win is None:
            while len(self._apps) >= self.max_apps:
                old, _ = self._apps.popitem(last=False)
                evicted.append(old)
            self.evicted_total += len(evicted)
            win = self._apps[sample.app_id] = AppWindow(sample.app_id, self.max_samples)
        if sample.t_s < win.last_t_s or (sample.seq <= win.last_seq and sample.t_s <= win.last_t_s):
            self.out_of_order += 1
            return False, evicted
        if sample.seq <= win.last_seq:
            # A lower seq with a newer time: the profiler restarted and numbers from 1 again.
            self.seq_restarts += 1
        win.samples.append(sample)
        win.last_seq, win.last_t_s, win.last_seen_s = sample.seq, sample.t_s, now_s
        self._apps.move_to_end(sample.app_id)
        return True, evicted

    def evict_idle(self, now_s: float) -> list[str]:
        """Drop applications whose last sample arrived more than `idle_evict_s` before `now_s`."""
        gone = []
        for app_id, win in list(self._apps.items()):  # least recently seen first
            if now_s - win.last_seen_s <= self.idle_evict_s:
                break
            del self._apps[app_id]
            gone.append(app_id)
        self.evicted_total += len(gone)
        return gone
