"""Prometheus metrics of the daemon, read from its live state at scrape time.

`DaemonMetrics(registry, source)` registers a collector that asks `source` (a `MetricsSource`: plain
frozen snapshots, no allocator or manager types) for the current applications, devices and
counters when Prometheus scrapes, so nothing is sampled between scrapes and nothing goes stale.
Events that only the daemon sees (denied calls, store writes, restores) are counters it
increments. The registry is injected: tests pass a fresh `CollectorRegistry` and read it back with
`registry.get_sample_value(...)`.

Metric names (all prefixed `vgpu_`):
- per application: `app_mem_used_mib`, `app_sm_util_pct`, `app_forecast_mem_p90_mib`,
  `app_forecast_sm_p90_pct`, `app_granted_mem_mib`, `app_granted_sm_pct`, `app_grants`;
- per device: `device_mem_total_mib`, `device_mem_granted_mib`, `device_power_limit_mw`;
- enforcement: `enforcement_actions_total{mechanism}`, `enforcement_failures_total{device,mechanism}`,
  `enforcement_disabled{device,mechanism}`, `restore_actions_total{mechanism,result}`;
- manager: `forecast_batch_seconds` (summary: count = forecaster calls, one per batch of the
  applications due together, and sum = their wall time; divide for the mean latency of one batch),
  `forecast_failures_total` (batches whose forecaster raised and the fallback served), `signatures_total{result}`, `forecaster_serving{forecaster}` (1 for
  "mixture", "model" or "baseline", whichever serves), `forecaster_reloads_total{result}` (hot reloads of the
  checkpoint, "ok" or "failed");
- access: `access_denied_total{method,code}`; persistence: `store_writes_total`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class AppSnapshot:
    app_id: str
    mem_used_mib: float = math.nan
    sm_util_pct: float = math.nan
    forecast_mem_p90_mib: float = math.nan
    forecast_sm_p90_pct: float = math.nan
    granted_mem_mib: float = 0.0
    granted_sm_pct: float = 0.0
    grants: int = 0


@dataclass(frozen=True)
class DeviceSnapshot:
    device_id: str
    mem_total_mib: float
    mem_granted_mib: float
    power_limit_mw: int | None = None
    # mechanism -> why it is off on this device
    disabled: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CounterSnapshot:
    """Totals since start."""

    power_limit_changes: int = 0
    mig_changes: int = 0
    grants_resized: int = 0
    # (device_id, mechanism, count) of device changes that failed, mechanism "power_limit", "mig" or
    # "cgroup_memory"
    failures: tuple[tuple[str, str, int], ...] = ()
    forecast_batches: int = 0  # forecaster calls, one per batch of due applications
    forecast_s_total: float = 0.0
    forecast_failures: int = 0
    signatures_accepted: int = 0
    signatures_rejected: int = 0  # malformed
    signatures_out_of_order: int = 0  # rejected: older than the application's last sample
    signatures_unknown_device: int = 0  # rejected: for a device the daemon does not have
    signatures_duplicate: int = 0  # a profiler's resend the window already held, dropped quietly
    forecaster: str = ""  # "mixture", "model" or "baseline"; empty = unknown
    forecaster_reloads: int = 0
    forecaster_reload_failures: int = 0


class MetricsSource(Protocol):
    def app_snapshots(self) -> Sequence[AppSnapshot]: ...

    def device_snapshots(self) -> Sequence[DeviceSnapshot]: ...

    def counter_snapshot(self) -> CounterSnapshot: ...


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


class _StateCollector(Collector):
    def __init__(self, source: MetricsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        app_gauges = {
            "mem_used_mib": GaugeMetricFamily("vgpu_app_mem_used_mib", "Memory the application uses (MiB)", labels=["app"]),
            "sm_util_pct": GaugeMetricFamily("vgpu_app_sm_util_pct", "SM utilisation of the application (%)", labels=["app"]),
            "forecast_mem_p90_mib": GaugeMetricFamily(
                "vgpu_app_forecast_mem_p90_mib", "Peak P90 memory forecast over 1-5 s (MiB)", labels=["app"]
            ),
            "forecast_sm_p90_pct": GaugeMetricFamily(
                "vgpu_app_forecast_sm_p90_pct", "Peak P90 SM forecast over 1-5 s (%)", labels=["app"]
            ),
            "granted_mem_mib": GaugeMetricFamily("vgpu_app_granted_mem_mib", "Memory granted (MiB)", labels=["app"]),
            "granted_sm_pct": GaugeMetricFamily("vgpu_app_granted_sm_pct", "SM share granted (%)", labels=["app"]),
            "grants": GaugeMetricFamily("vgpu_app_grants", "Grants held", labels=["app"]),
        }
        for app in self._source.app_snapshots():
            for attr, family in app_gauges.items():
                value = float(getattr(app, attr))
                if _finite(value):  # unknown values are absent, not 0
                    family.add_metric([app.app_id], value)
        yield from app_gauges.values()

        total = GaugeMetricFamily("vgpu_device_mem_total_mib", "Device memory (MiB)", labels=["device"])
        granted = GaugeMetricFamily("vgpu_device_mem_granted_mib", "Device memory granted (MiB)", labels=["device"])
        power = GaugeMetricFamily("vgpu_device_power_limit_mw", "Current power limit (mW)", labels=["device"])
        disabled = GaugeMetricFamily(
            "vgpu_enforcement_disabled", "1 when a mechanism is off on a device", labels=["device", "mechanism"]
        )
        for dev in self._source.device_snapshots():
            total.add_metric([dev.device_id], dev.mem_total_mib)
            granted.add_metric([dev.device_id], dev.mem_granted_mib)
            if dev.power_limit_mw is not None:
                power.add_metric([dev.device_id], dev.power_limit_mw)
            for mechanism, _reason in dev.disabled:
                disabled.add_metric([dev.device_id, mechanism], 1)
        yield from (total, granted, power, disabled)

        c = self._source.counter_snapshot()
        actions = CounterMetricFamily("vgpu_enforcement_actions", "Device changes made", labels=["mechanism"])
        actions.add_metric(["power_limit"], c.power_limit_changes)
        actions.add_metric(["mig"], c.mig_changes)
        actions.add_metric(["grant_resize"], c.grants_resized)
        yield actions
        failures = CounterMetricFamily(
            "vgpu_enforcement_failures", "Device changes that failed", labels=["device", "mechanism"]
        )
        for device_id, mechanism, count in c.failures:
            failures.add_metric([device_id, mechanism], count)
        yield failures
        yield SummaryMetricFamily(
            "vgpu_forecast_batch_seconds",
            "Wall time of one forecaster call over a batch of the applications due together",
            count_value=c.forecast_batches,
            sum_value=c.forecast_s_total,
        )
        yield CounterMetricFamily("vgpu_forecast_failures", "Forecast batches whose forecaster raised (the fallback served)", value=c.forecast_failures)
        sigs = CounterMetricFamily("vgpu_signatures", "Signatures ingested", labels=["result"])
        sigs.add_metric(["accepted"], c.signatures_accepted)
        sigs.add_metric(["rejected"], c.signatures_rejected)
        sigs.add_metric(["out_of_order"], c.signatures_out_of_order)
        sigs.add_metric(["unknown_device"], c.signatures_unknown_device)
        sigs.add_metric(["duplicate"], c.signatures_duplicate)
        yield sigs
        serving = GaugeMetricFamily("vgpu_forecaster_serving", "1 for the forecaster that serves", labels=["forecaster"])
        if c.forecaster:
            serving.add_metric([c.forecaster], 1)
        yield serving
        reloads = CounterMetricFamily("vgpu_forecaster_reloads", "Hot reloads of the forecaster checkpoint", labels=["result"])
        reloads.add_metric(["ok"], c.forecaster_reloads)
        reloads.add_metric(["failed"], c.forecaster_reload_failures)
        yield reloads


class DaemonMetrics:
    """The daemon's metrics in `registry`."""

    def __init__(self, registry: CollectorRegistry, source: MetricsSource | None = None) -> None:
        self.registry = registry
        self.denied = Counter(
            "vgpu_access_denied", "Calls refused by access control", ["method", "code"], registry=registry
        )
        self.store_writes = Counter("vgpu_store_writes", "Commits to the state database", registry=registry)
        self.restores = Counter(
            "vgpu_restore_actions", "Device settings restored at stop or start", ["mechanism", "result"], registry=registry
        )
        if source is not None:
            registry.register(_StateCollector(source))

    def on_denied(self, method: str, code: object) -> None:
        self.denied.labels(method=method, code=getattr(code, "name", str(code))).inc()
