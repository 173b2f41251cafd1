"""Prometheus metrics of the daemon, read from its live state at scrape time.

`DaemonMetrics(registry, source)` registers a collector that asks `source` (a `MetricsSource`: plain
frozen snapshots, no allocator or manager types) for the current applications, devices and
counters when Prometheus scrapes, so nothing is sampled between scrapes and nothing goes stale.
Events that only the daemon sees (denied calls, store writes, restores) are counters it
increments. A labelled counter whose label values are known at start (devices, mechanisms, reasons,
results) has a series at 0 for each from the start, so `rate()`/`increase()` see its first event;
`access_denied_total{method,code}` and the per-application counters appear with their first value. The registry is injected: tests pass a fresh `CollectorRegistry` and read it back with
`registry.get_sample_value(...)`.

Names follow Prometheus conventions: base units (bytes, seconds, watts, hertz, celsius, ratios
0-1), `_total` on counters, a `device` label (the GPU UUID) on everything per device and per
application. A value the daemon does not know (no forecast yet, a counter the device cannot report)
is absent, not 0. All prefixed `vgpu_`:
- per application {app, device}: `app_memory_used_bytes`, `app_sm_utilization_ratio`,
  `app_forecast_memory_p50_bytes`, `app_forecast_memory_p90_bytes`, `app_forecast_sm_p90_ratio`,
  `app_granted_memory_bytes`, `app_granted_sm_ratio`, `app_grants`, `app_last_seen_timestamp_seconds`;
  counters `app_memory_overruns_total` (forecast ticks with the use above the grant) and
  `app_oom_events_total` (runs of overruns: where a memory cap fails an allocation),
  `app_inapp_value{app,device,counter}` (the newest value of each in-app counter it reports);
- per device {device}: `device_info{device,index,name,pci_bus_id}` (1), `device_memory_total_bytes`,
  `device_memory_granted_bytes`, `device_memory_used_bytes`, `device_power_limit_watts`,
  `device_power_draw_watts`, `device_temperature_celsius`, `device_sm_clock_hertz`,
  `device_sm_utilization_ratio`, `device_dry_run` (1: decisions are logged, nothing is written),
  `device_memory_limits_hard` (1: the device is contended and grants are hard cgroup caps; 0: they
  are cooperative, kept by the applications themselves);
  `profiler_connected` (1 while a profiler stream that sent for the device is open),
  `profiler_streams`, `newest_signature_age_seconds`;
- enforcement: `enforcement_actions_total{mechanism}`, `enforcement_failures_total{device,mechanism}`,
  `enforcement_disabled{device,mechanism}` (1: turned off after failing at runtime),
  `enforcement_unsupported{device,mechanism}` (1: off because the driver or GPU does not have it),
  `restore_actions_total{mechanism,result}`,
  `grant_changes_total{kind,reason}` (kind granted/resized/released; reason the grant's source,
  grow/shrink, limits, reclaim (a managed grant cut for an application's request), released,
  superseded (a forecast grant replaced by its application's declared job), or exited (the process
  the grant named exited: Allocator.release_exited));
- manager: `forecast_batch_seconds` (histogram: one observation per forecaster call, which serves a
  batch of the applications due together), `tick_seconds` (histogram: windows copied, forecast,
  allocator acted), `forecast_failures_total` (failures in forecast rounds: the forecaster or the
  fallback raised, a forecast that could not be made a decision, a window that could not be copied;
  each application was decided all the same, manager/core.py), `signatures_total{result}`, `forecaster_serving{forecaster}` (1 for "mixture", "model"
  or "baseline", whichever serves), `forecaster_reloads_total{result}`, `local_model_state{state}` (1 for
  the node-local model's state, 0 for the others: "serving", "unusable" (`local.pt` does not load: the
  global model serves without it) or "none"; absent without the expert mixture) and
  `local_model_loads_total{result}` (loads of a changed `local.pt`, "ok" or "failed"), `node_trees_state{state}`
  and `node_trees_loads_total{result}` (the same for the node-local trees, `trees.json`), `inapp_apps{counter}`
  (applications whose newest sample carries that in-app counter, e.g. `inapp_kv_used_mib`),
  `inapp_values_dropped_total{reason}` (in-app values left out: not finite, negative, too large);
- access: `access_denied_total{method,code}`; persistence: `store_writes_total`;
- the metrics endpoint itself: `metrics_connections_refused_total{reason}` (closed at accept:
  `max_connections`, `max_connections_per_address`), `metrics_connections_failed_total` (closed
  unanswered); the node history:
  `history_rows_refused_total`, `history_write_failures_total` (each 0 from the start, and 0 with
  the history off);
- the Unix socket's front (vgpu/daemon/front.py): `connections_refused_total{reason}` (closed at
  accept: `max_connections`, `max_connections_per_uid`, `upstream` when gRPC's own socket refused,
  `no_descriptors`), `connections_open` (relayed connections open now; absent with the front off);
- `build_info{version,python,backend}` (1).

Beside them, prometheus_client's standard process metrics of the daemon (`process_resident_memory_bytes`,
`process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds`, `process_cpu_seconds_total`,
`process_start_time_seconds`; Linux only) and `python_info`. No counter has a `_created` series
(prometheus_client's are turned off, `DaemonMetrics`). An application with no device yet (limits set
with `vgpu set-limit --create` before it runs) has no series: `device=""` is no device.

`/metrics?name[]=NAME` (repeatable) answers with those families or samples only (`metrics_app`).

Per-application series are bounded: any caller of the socket may create applications (up to the
node's grant quota), and each would add up to eleven series per device to every scrape. `select_apps` keeps at most
`max_apps` applications (`metrics.max_apps`): every application an operator has set limits on, then
those that have had an OOM event, then the largest memory footprint (the larger of use, P90 forecast
and grant, summed over its devices), ties by id. The others are left out of the `app_*` families and summed
per device: `device_apps{device}` (applications on the device), `device_apps_unlisted{device}` (of
those, left out), `device_unlisted_memory_used_bytes`, `device_unlisted_memory_granted_bytes`,
`device_unlisted_granted_sm_ratio`, `device_unlisted_grants`; `metrics_max_apps` is the bound in force.
"""

from __future__ import annotations

import io
import ipaddress
import math
import platform
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from vgpu import __version__
from vgpu.config import METRICS_MAX_CONNECTIONS, MetricsConfig
from vgpu.daemon.sockdiag import PEER_UID_UNKNOWN_REASONS, PeerUidUnknown, tcp_peer_uid
from vgpu.histogram import LatencyHistogram
from vgpu.log import LogBudget, get_logger

MIB = 1024 * 1024
# The node-local model's states (manager/nodelearn.py LocalModelWatcher.state), each a series.
LOCAL_MODEL_STATES = ("serving", "unusable", "none")


@dataclass(frozen=True)
class AppSnapshot:
    """One application on one device."""

    app_id: str
    device_id: str = ""
    mem_used_mib: float = math.nan
    sm_util_pct: float = math.nan
    forecast_mem_p50_mib: float = math.nan
    forecast_mem_p90_mib: float = math.nan
    forecast_sm_p90_pct: float = math.nan
    granted_mem_mib: float = 0.0
    granted_sm_pct: float = 0.0
    grants: int = 0
    last_seen_s: float = math.nan  # Unix s
    overruns: int | None = None  # None: no history kept for it
    oom_events: int | None = None
    limited: bool = False  # an operator has set limits on the application
    # in-app column -> the newest sample's value (the application's own counters, e.g. KV cache in use)
    inapp: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class DeviceSnapshot:
    device_id: str
    mem_total_mib: float
    mem_granted_mib: float
    power_limit_mw: int | None = None
    # mechanism -> why it is off on this device ("" when it is on)
    disabled: tuple[tuple[str, str], ...] = ()
    # the mechanisms of `disabled` that are off because the driver or GPU does not have them
    unsupported: tuple[str, ...] = ()
    index: int = 0
    name: str = ""
    pci_bus_id: str | None = None
    mem_used_mib: float | None = None
    power_draw_mw: int | None = None
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    sm_util_pct: float | None = None
    dry_run: bool = False
    profiler_streams: int | None = None  # None: unknown
    newest_signature_age_s: float | None = None
    # the device's memory grants are hard limits (it is contended) rather than cooperative; None: unknown
    memory_limits_hard: bool | None = None


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
    forecast_latency: LatencyHistogram | None = None
    tick_latency: LatencyHistogram | None = None
    forecast_failures: int = 0
    signatures_accepted: int = 0
    signatures_rejected: int = 0  # malformed
    signatures_out_of_order: int = 0  # rejected: older than the application's last sample
    signatures_unknown_device: int = 0  # rejected: for a device the daemon does not have
    signatures_over_capacity: int = 0  # rejected: a memory reading above the named device's total
    signatures_duplicate: int = 0  # a profiler's resend the window already held, dropped quietly
    forecaster: str = ""  # "mixture", "model" or "baseline"; empty = unknown
    forecaster_reloads: int = 0
    forecaster_reload_failures: int = 0
    local_model: str = ""  # LOCAL_MODEL_STATES; empty: no node-local model slot (no expert mixture)
    local_model_loads: int = 0
    local_model_load_failures: int = 0
    node_trees: str = ""  # the node-local trees' state, LOCAL_MODEL_STATES; empty: no trees slot
    node_trees_loads: int = 0
    node_trees_load_failures: int = 0
    # (kind, reason, count) of grant changes
    grant_changes: tuple[tuple[str, str, int], ...] = field(default=())
    # (quota setting, calls refused at it)
    quota_refusals: tuple[tuple[str, int], ...] = ()
    # requests answered with the cold-start grant their process already held for the same job
    cold_start_reused: int = 0
    backend: str = ""
    # (in-app counter, applications whose newest sample carries it)
    inapp_apps: tuple[tuple[str, int], ...] = ()
    # (reason, count) of in-app values the manager left out of kept signatures
    inapp_dropped: tuple[tuple[str, int], ...] = ()


class MetricsSource(Protocol):
    def app_snapshots(self) -> Sequence[AppSnapshot]: ...

    def device_snapshots(self) -> Sequence[DeviceSnapshot]: ...

    def counter_snapshot(self) -> CounterSnapshot: ...


DEFAULT_MAX_APPS = 100
# the label values of the counters DaemonMetrics increments (vgpu/daemon/serve.py restores device
# settings by mechanism with a result; vgpu/daemon/front.py refuses connections for a reason)
RESTORE_MECHANISMS = ("power_limit", "mig")
RESTORE_RESULTS = ("ok", "mismatch", "failed")
REFUSAL_REASONS = ("max_connections", "max_connections_per_uid", "upstream", "no_descriptors")
# why the metrics endpoint closed a connection at accept (MetricsServer)
METRICS_REFUSAL_REASONS = ("max_connections", "max_connections_per_address")


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _footprint_mib(app: AppSnapshot) -> float:
    """The memory an application takes on one device: the largest of its use, its P90 forecast and
    its grant that is known."""
    known = [x for x in (app.mem_used_mib, app.forecast_mem_p90_mib, app.granted_mem_mib) if _finite(x)]
    return max(known, default=0.0)


def select_apps(apps: Sequence[AppSnapshot], max_apps: int) -> tuple[list[AppSnapshot], list[AppSnapshot]]:
    """`apps` (one snapshot per application and device) split into (listed, left out), whole
    applications at a time: every application with operator limits, then up to `max_apps` in all
    ranked by an OOM event first, then memory footprint over its devices, then id. More than
    `max_apps` are listed only when operators have limited more applications than that."""
    by_app: dict[str, list[AppSnapshot]] = {}
    for a in apps:
        by_app.setdefault(a.app_id, []).append(a)
    if len(by_app) <= max_apps:
        return list(apps), []

    def rank(app_id: str) -> tuple[bool, bool, float, str]:
        rows = by_app[app_id]
        return (not any(r.limited for r in rows), not any((r.oom_events or 0) > 0 for r in rows),
                -sum(_footprint_mib(r) for r in rows), app_id)

    ranked = sorted(by_app, key=rank)
    keep = {app_id for i, app_id in enumerate(ranked) if i < max_apps or any(r.limited for r in by_app[app_id])}
    listed = [a for a in apps if a.app_id in keep]
    return listed, [a for a in apps if a.app_id not in keep]


def _histogram(name: str, doc: str, hist: LatencyHistogram | None, count: int, sum_s: float) -> HistogramMetricFamily:
    if hist is None:  # only totals known: every observation in +Inf
        return HistogramMetricFamily(name, doc, buckets=[("+Inf", count)], sum_value=sum_s)
    return HistogramMetricFamily(name, doc, buckets=hist.cumulative(), sum_value=hist.sum_s)


class _StateCollector(Collector):
    def __init__(self, source: MetricsSource, max_apps: int) -> None:
        self._source = source
        self._max_apps = max_apps

    def collect(self) -> Iterator[Metric]:
        devices = self._source.device_snapshots()
        # a snapshot without a device (an application known by its limits only) is on no device:
        # a `device=""` series would add a device to every `sum by (device)`
        apps = [a for a in self._source.app_snapshots() if a.device_id]
        listed, unlisted = select_apps(apps, self._max_apps)
        yield from self._apps(listed)
        yield from self._unlisted([d.device_id for d in devices], listed, unlisted)
        yield from self._devices(devices)
        yield from self._counters()

    def _unlisted(self, device_ids: list[str], listed: list[AppSnapshot],
                  unlisted: list[AppSnapshot]) -> Iterator[Metric]:
        """Per device: how many applications there are and how many were left out of the
        per-application series, with the sums of what those left out use and hold."""
        dev = ["device"]
        apps = GaugeMetricFamily("vgpu_device_apps", "Applications with a grant, use or forecast on the device",
                                 labels=dev)
        left = GaugeMetricFamily("vgpu_device_apps_unlisted", "Applications on the device left out of the vgpu_app_* "
                                 "series (beyond metrics.max_apps)", labels=dev)
        used = GaugeMetricFamily("vgpu_device_unlisted_memory_used_bytes", "GPU memory the applications left out "
                                 "use, summed", labels=dev)
        granted = GaugeMetricFamily("vgpu_device_unlisted_memory_granted_bytes", "GPU memory granted to the "
                                    "applications left out, summed", labels=dev)
        sm = GaugeMetricFamily("vgpu_device_unlisted_granted_sm_ratio", "SM share granted to the applications left "
                               "out, summed (0-1)", labels=dev)
        grants = GaugeMetricFamily("vgpu_device_unlisted_grants", "Grants the applications left out hold", labels=dev)
        # every device, with zeros when nothing is left out, so that `> 0` rules have a series
        order = list(dict.fromkeys([*device_ids, *(a.device_id for a in listed), *(a.device_id for a in unlisted)]))
        totals = {d: [0, 0, 0.0, 0.0, 0.0, 0] for d in order}  # apps, left out, used, granted, SM, grants
        for a in listed:
            totals[a.device_id][0] += 1
        for a in unlisted:
            t = totals[a.device_id]
            t[0] += 1
            t[1] += 1
            t[2] += a.mem_used_mib if _finite(a.mem_used_mib) else 0.0
            t[3] += a.granted_mem_mib
            t[4] += a.granted_sm_pct
            t[5] += a.grants
        for d, (n, n_left, used_mib, granted_mib, sm_pct, n_grants) in totals.items():
            apps.add_metric([d], n)
            left.add_metric([d], n_left)
            used.add_metric([d], used_mib * MIB)
            granted.add_metric([d], granted_mib * MIB)
            sm.add_metric([d], sm_pct * 0.01)
            grants.add_metric([d], n_grants)
        yield from (apps, left, used, granted, sm, grants)
        yield GaugeMetricFamily("vgpu_metrics_max_apps", "Applications given vgpu_app_* series at most "
                                "(metrics.max_apps; operator-limited ones beyond it)", value=self._max_apps)

    def _apps(self, snapshots: Sequence[AppSnapshot]) -> Iterator[Metric]:
        labels = ["app", "device"]
        # attribute -> (family, scale to base units)
        gauges = {
            "mem_used_mib": (GaugeMetricFamily("vgpu_app_memory_used_bytes", "GPU memory the application uses",
                                               labels=labels), MIB),
            "sm_util_pct": (GaugeMetricFamily("vgpu_app_sm_utilization_ratio",
                                              "Share of the GPU's SMs the application keeps busy (0-1)", labels=labels),
                            0.01),
            "forecast_mem_p50_mib": (GaugeMetricFamily("vgpu_app_forecast_memory_p50_bytes",
                                                       "Peak P50 memory forecast over the next 1-5 s", labels=labels),
                                     MIB),
            "forecast_mem_p90_mib": (GaugeMetricFamily("vgpu_app_forecast_memory_p90_bytes",
                                                       "Peak P90 memory forecast over the next 1-5 s", labels=labels),
                                     MIB),
            "forecast_sm_p90_pct": (GaugeMetricFamily("vgpu_app_forecast_sm_p90_ratio",
                                                      "Peak P90 SM forecast over the next 1-5 s (0-1)", labels=labels),
                                    0.01),
            "granted_mem_mib": (GaugeMetricFamily("vgpu_app_granted_memory_bytes", "GPU memory granted",
                                                  labels=labels), MIB),
            "granted_sm_pct": (GaugeMetricFamily("vgpu_app_granted_sm_ratio", "SM share granted (0-1)",
                                                 labels=labels), 0.01),
            "grants": (GaugeMetricFamily("vgpu_app_grants", "Grants held", labels=labels), 1.0),
            "last_seen_s": (GaugeMetricFamily("vgpu_app_last_seen_timestamp_seconds",
                                              "When the daemon last heard from the application (Unix time)",
                                              labels=labels), 1.0),
        }
        overruns = CounterMetricFamily("vgpu_app_memory_overruns", "Forecast ticks at which the application "
                                       "used more memory than it was granted", labels=labels)
        ooms = CounterMetricFamily("vgpu_app_oom_events", "Runs of overruns: where a memory cap fails an allocation",
                                   labels=labels)
        inapp = GaugeMetricFamily("vgpu_app_inapp_value", "The newest value of an in-app counter the application "
                                  "reports (its unit is in the counter's name: _mib, or a count)",
                                  labels=[*labels, "counter"])
        for app in snapshots:
            key = [app.app_id, app.device_id]
            for attr, (family, scale) in gauges.items():
                value = float(getattr(app, attr))
                if _finite(value):  # unknown values are absent, not 0
                    family.add_metric(key, value * scale)
            if app.overruns is not None:
                overruns.add_metric(key, app.overruns)
            if app.oom_events is not None:
                ooms.add_metric(key, app.oom_events)
            for counter, value in app.inapp:
                inapp.add_metric([*key, counter], value)
        yield from (family for family, _ in gauges.values())
        yield from (overruns, ooms, inapp)

    def _devices(self, devices: Sequence[DeviceSnapshot]) -> Iterator[Metric]:
        dev = ["device"]
        info = GaugeMetricFamily("vgpu_device_info", "The GPU's index, name and bus id (value 1)",
                                 labels=["device", "index", "name", "pci_bus_id"])
        total = GaugeMetricFamily("vgpu_device_memory_total_bytes", "GPU memory", labels=dev)
        granted = GaugeMetricFamily("vgpu_device_memory_granted_bytes", "GPU memory granted", labels=dev)
        used = GaugeMetricFamily("vgpu_device_memory_used_bytes", "GPU memory in use, as the device reports it",
                                 labels=dev)
        limit = GaugeMetricFamily("vgpu_device_power_limit_watts", "Power limit in force", labels=dev)
        draw = GaugeMetricFamily("vgpu_device_power_draw_watts", "Power drawn", labels=dev)
        temp = GaugeMetricFamily("vgpu_device_temperature_celsius", "GPU core temperature", labels=dev)
        clock = GaugeMetricFamily("vgpu_device_sm_clock_hertz", "SM clock", labels=dev)
        util = GaugeMetricFamily("vgpu_device_sm_utilization_ratio", "Share of the last sample period the SMs were "
                                 "busy (0-1)", labels=dev)
        dry = GaugeMetricFamily("vgpu_device_dry_run", "1 when the allocator writes nothing to the device", labels=dev)
        hard = GaugeMetricFamily("vgpu_device_memory_limits_hard", "1 when the device is contended and memory "
                                 "grants are hard cgroup caps, 0 when they are cooperative", labels=dev)
        disabled = GaugeMetricFamily("vgpu_enforcement_disabled", "1 when a mechanism was turned off on a device "
                                     "after failing at runtime", labels=["device", "mechanism"])
        unsupported = GaugeMetricFamily("vgpu_enforcement_unsupported", "1 when a mechanism is off on a device "
                                        "because its driver or GPU does not have it", labels=["device", "mechanism"])
        connected = GaugeMetricFamily("vgpu_profiler_connected", "1 while a profiler stream that sent signatures "
                                      "for the device is open", labels=dev)
        streams = GaugeMetricFamily("vgpu_profiler_streams", "Open profiler streams that sent for the device",
                                    labels=dev)
        age = GaugeMetricFamily("vgpu_newest_signature_age_seconds", "Seconds since the newest signature for the "
                                "device arrived", labels=dev)
        for d in devices:
            k = [d.device_id]
            info.add_metric([d.device_id, str(d.index), d.name, d.pci_bus_id or ""], 1)
            total.add_metric(k, d.mem_total_mib * MIB)
            granted.add_metric(k, d.mem_granted_mib * MIB)
            dry.add_metric(k, int(d.dry_run))
            if d.memory_limits_hard is not None:
                hard.add_metric(k, int(d.memory_limits_hard))
            for family, value, scale in ((used, d.mem_used_mib, MIB), (limit, d.power_limit_mw, 1e-3),
                                         (draw, d.power_draw_mw, 1e-3), (temp, d.temperature_c, 1.0),
                                         (clock, d.sm_clock_mhz, 1e6), (util, d.sm_util_pct, 0.01),
                                         (age, d.newest_signature_age_s, 1.0)):
                if value is not None and _finite(float(value)):
                    family.add_metric(k, float(value) * scale)
            for mechanism, reason in d.disabled:
                lacks = bool(reason) and mechanism in d.unsupported
                disabled.add_metric([d.device_id, mechanism], 1 if reason and not lacks else 0)
                unsupported.add_metric([d.device_id, mechanism], 1 if lacks else 0)
            if d.profiler_streams is not None:
                streams.add_metric(k, d.profiler_streams)
                connected.add_metric(k, 1 if d.profiler_streams > 0 else 0)
        yield from (info, total, granted, used, limit, draw, temp, clock, util, dry, hard, disabled, unsupported,
                    connected, streams, age)

    def _counters(self) -> Iterator[Metric]:
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
        changes = CounterMetricFamily("vgpu_grant_changes", "Grants made, resized and released, by reason",
                                      labels=["kind", "reason"])
        for kind, reason, count in c.grant_changes:
            changes.add_metric([kind, reason], count)
        yield changes
        quotas = CounterMetricFamily("vgpu_quota_refusals", "Calls refused because the caller was at one of the "
                                     "node's bounds (grants, watchers), by setting", labels=["quota"])
        for quota, count in c.quota_refusals:
            quotas.add_metric([quota], count)
        yield quotas
        yield CounterMetricFamily("vgpu_cold_start_reused", "Requests answered with the cold-start grant their "
                                  "process already held for the same job (nothing granted)",
                                  value=c.cold_start_reused)
        yield _histogram("vgpu_forecast_batch_seconds",
                         "Wall time of one forecaster call over a batch of the applications due together",
                         c.forecast_latency, c.forecast_batches, c.forecast_s_total)
        if c.tick_latency is not None:
            yield _histogram("vgpu_tick_seconds", "Wall time of one manager tick: windows copied, forecast, "
                             "the allocator acted", c.tick_latency, 0, 0.0)
        yield CounterMetricFamily("vgpu_forecast_failures", "Failures in forecast rounds (the fallback or the last value decided)", value=c.forecast_failures)
        sigs = CounterMetricFamily("vgpu_signatures", "Signatures ingested", labels=["result"])
        sigs.add_metric(["accepted"], c.signatures_accepted)
        sigs.add_metric(["rejected"], c.signatures_rejected)
        sigs.add_metric(["out_of_order"], c.signatures_out_of_order)
        sigs.add_metric(["unknown_device"], c.signatures_unknown_device)
        sigs.add_metric(["over_capacity"], c.signatures_over_capacity)
        sigs.add_metric(["duplicate"], c.signatures_duplicate)
        yield sigs
        inapp = GaugeMetricFamily("vgpu_inapp_apps", "Applications whose newest sample carries this in-app "
                                  "counter (a leading signal the forecaster gets)", labels=["counter"])
        for counter, n in c.inapp_apps:
            inapp.add_metric([counter], n)
        yield inapp
        dropped = CounterMetricFamily("vgpu_inapp_values_dropped", "In-app values left out of kept signatures "
                                      "(not finite, negative, above their bound)", labels=["reason"])
        for reason, n in c.inapp_dropped:
            dropped.add_metric([reason], n)
        yield dropped
        serving = GaugeMetricFamily("vgpu_forecaster_serving", "1 for the forecaster that serves", labels=["forecaster"])
        if c.forecaster:
            serving.add_metric([c.forecaster], 1)
        yield serving
        reloads = CounterMetricFamily("vgpu_forecaster_reloads", "Hot reloads of the forecaster checkpoint", labels=["result"])
        reloads.add_metric(["ok"], c.forecaster_reloads)
        reloads.add_metric(["failed"], c.forecaster_reload_failures)
        yield reloads
        if c.local_model:
            yield from _learnt_file_metrics(
                "vgpu_local_model", c.local_model, c.local_model_loads, c.local_model_load_failures,
                "1 for the node-local model's state: serving, unusable (it does not load; the global model serves "
                "without it) or none", "Loads of a changed node-local model file")
        if c.node_trees:
            yield from _learnt_file_metrics(
                "vgpu_node_trees", c.node_trees, c.node_trees_loads, c.node_trees_load_failures,
                "1 for the node-local trees' state: serving, unusable (trees.json does not load; the mixture serves "
                "without them) or none", "Loads of a changed node-local trees file")
        build = GaugeMetricFamily("vgpu_build_info", "The daemon's version (value 1)",
                                  labels=["version", "python", "backend"])
        build.add_metric([__version__, platform.python_version(), c.backend], 1)
        yield build


class EndpointCounts(Protocol):
    """The metrics endpoint's own counts (`MetricsServer`)."""

    @property
    def refused_by_reason(self) -> dict[str, int]: ...

    @property
    def failed(self) -> int: ...


class HistoryCounts(Protocol):
    """The node history's counts (manager/history.py `NodeHistory`)."""

    @property
    def rows_refused(self) -> int: ...

    @property
    def write_failures(self) -> int: ...


class _OwnCountsCollector(Collector):
    """Counters of the endpoint and the node history, read at scrape time; 0 before either is
    watched (the endpoint not started yet, the history off), so every series exists from the start."""

    def __init__(self) -> None:
        self.endpoint: EndpointCounts | None = None
        self.history: HistoryCounts | None = None

    def collect(self) -> Iterator[Metric]:
        endpoint, history = self.endpoint, self.history
        refused = CounterMetricFamily("vgpu_metrics_connections_refused", "Connections to the metrics endpoint "
                                      "closed at accept: all its slots were taken (max_connections), or the "
                                      "caller's address (on loopback, its local user) held its share "
                                      "(max_connections_per_address)",
                                      labels=["reason"])
        by_reason = endpoint.refused_by_reason if endpoint else {}
        for reason in METRICS_REFUSAL_REASONS:
            refused.add_metric([reason], by_reason.get(reason, 0))
        yield refused
        yield CounterMetricFamily("vgpu_metrics_connections_failed", "Connections to the metrics endpoint closed "
                                  "unanswered: silent past the idle timeout, request unfinished at its deadline, "
                                  "or broken", value=endpoint.failed if endpoint else 0)
        yield CounterMetricFamily("vgpu_history_rows_refused", "Node-history rows refused for memory above their "
                                  "capacity, at write or at read", value=history.rows_refused if history else 0)
        yield CounterMetricFamily("vgpu_history_write_failures", "Node-history writes that failed (rows lost)",
                                  value=history.write_failures if history else 0)


class DaemonMetrics:
    """The daemon's metrics in `registry`; per-application series for `max_apps` applications at
    most (`select_apps`)."""

    def __init__(self, registry: CollectorRegistry, source: MetricsSource | None = None, *,
                 max_apps: int = DEFAULT_MAX_APPS) -> None:
        if max_apps < 0:
            raise ValueError(f"max_apps: must be >= 0, got {max_apps}")
        self.registry = registry
        # prometheus_client's counters would each add a `<name>_created` gauge (when the series began),
        # which nothing here reads and the collector's families do not have: off, so every counter
        # looks alike. The switch is prometheus_client's process-wide one, read at each scrape.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client
        self.denied = Counter(
            "vgpu_access_denied", "Calls refused by access control", ["method", "code"], registry=registry
        )
        self.store_writes = Counter("vgpu_store_writes", "Commits to the state database", registry=registry)
        self.restores = Counter(
            "vgpu_restore_actions", "Device settings restored at stop or start", ["mechanism", "result"], registry=registry
        )
        self.connections_refused = Counter(
            "vgpu_connections_refused", "Unix-socket connections closed at accept, by the bound that refused them",
            ["reason"], registry=registry,
        )
        # every label value these counters can take, exported at 0 from the start, so that a
        # series exists before its first event and `rate()`/`increase()` see that event
        for mechanism in RESTORE_MECHANISMS:
            for result in RESTORE_RESULTS:
                self.restores.labels(mechanism=mechanism, result=result)
        for reason in REFUSAL_REASONS:
            self.connections_refused.labels(reason=reason)
        self._registry = registry
        # RSS, open and allowed descriptors, CPU seconds and start time of this process (from
        # /proc; absent elsewhere), and python_info: what the unit's MemoryMax and LimitNOFILE bound
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        self._own = _OwnCountsCollector()
        registry.register(self._own)
        if source is not None:
            registry.register(_StateCollector(source, max_apps))

    def watch_endpoint(self, server: EndpointCounts) -> None:
        """Report the metrics endpoint's refused (by reason) and failed connections at each scrape."""
        self._own.endpoint = server

    def watch_history(self, history: HistoryCounts) -> None:
        """Report the node history's refused rows and write failures at each scrape."""
        self._own.history = history

    def on_connection_refused(self, reason: str) -> None:
        self.connections_refused.labels(reason=reason).inc()

    def watch_connections(self, open_connections: Callable[[], int]) -> None:
        """Report `open_connections()` as `vgpu_connections_open` at each scrape."""
        gauge = Gauge("vgpu_connections_open", "Unix-socket connections the front relays now", registry=self._registry)
        gauge.set_function(lambda: float(open_connections()))

    def on_denied(self, method: str, code: object) -> None:
        self.denied.labels(method=method, code=getattr(code, "name", str(code))).inc()


# --- the endpoint -----------------------------------------------------------------------------------
# prometheus_client's own server (start_http_server) gives every connection a thread that waits for
# its request without a time limit: any local user could open connections to the port and send
# nothing, each a thread of the daemon (about 250 KiB) held for good. Here a connection has
# METRICS_IDLE_TIMEOUT_S between reads (a scrape sends its request at once; Prometheus's own scrape
# timeout is 10 s) and METRICS_REQUEST_DEADLINE_S in all from accept to read its request: a caller
# sending a byte every few seconds would otherwise keep its slot for good. At most
# METRICS_MAX_CONNECTIONS (vgpu/config.py) are served at once, and at most
# `metrics.max_connections_per_address` of them for one peer: one beyond either is closed as soon as
# it is accepted (`refused_by_reason`). A peer is the caller's address (`peer_of`), or, on loopback,
# the local user owning the caller's socket (`uid:1000`), read from the kernel for the connection's
# 4-tuple (vgpu/daemon/sockdiag.py): any local user can connect from any loopback address, so on the
# default binding (127.0.0.1) the address would make every caller one peer, and one local user
# holding its share would lock out the local Prometheus. Without a bound per peer, one caller that
# reconnects as each of its connections is closed held most of the slots, and a scrape from another
# peer was refused as often as not.
METRICS_IDLE_TIMEOUT_S = 10.0
METRICS_REQUEST_DEADLINE_S = 10.0
METRICS_MAX_CONNECTIONS_PER_ADDRESS = MetricsConfig.max_connections_per_address
# loopback callers whose uid could not be read (not Linux, no sock_diag, the caller closed already)
# share this one peer
LOOPBACK_PEER = "loopback"
# (the caller's host and port, the endpoint's host and port) -> the uid owning the caller's socket;
# raises when it cannot tell (PeerUidUnknown, with its reason)
PeerUidLookup = Callable[[tuple[str, int], tuple[str, int]], int]


def uid_peer(uid: int) -> str:
    """The peer a loopback caller whose socket `uid` owns counts against."""
    return f"uid:{uid}"


def peer_of(host: str) -> str:
    """The peer a connection from `host` (an accepted socket's address) counts against, by its
    address: every loopback address as one (`LOOPBACK_PEER`: a local caller may connect from any of
    127.0.0.0/8 or ::1 as it likes, and they are all this host; `MetricsServer` tells them apart by
    the uid owning the caller's socket), an IPv4-mapped IPv6 address as its IPv4 address (a
    dual-stack listener sees IPv4 callers so), any other address as itself, without an IPv6 zone."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # not an IP address: no TCP peer has one, but count it as what it says
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return LOOPBACK_PEER if ip.is_loopback else str(ip)


def _host(client_address: Any) -> str:
    """The address of an accepted TCP socket's peer: (host, port) for IPv4, (host, port, flowinfo,
    scope_id) for IPv6."""
    return str(client_address[0]) if isinstance(client_address, tuple) and client_address else ""


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each bounded by `idle_timeout_s` and all of them by `deadline`
    (time.monotonic()): TimeoutError once it has passed."""

    def __init__(self, conn: socket.socket, idle_timeout_s: float, deadline: float) -> None:
        super().__init__()
        self._conn, self._idle_timeout_s, self._deadline = conn, idle_timeout_s, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left_s = self._deadline - time.monotonic()
        if left_s <= 0:
            raise TimeoutError("request deadline passed")
        self._conn.settimeout(min(self._idle_timeout_s, left_s))
        return self._conn.recv_into(buffer)


class _Handler(WSGIRequestHandler):
    """One request per connection, each read bounded by the server's `idle_timeout_s` and all of
    them by its `request_deadline_s` from accept; no access log."""

    def setup(self) -> None:
        super().setup()
        idle_s = getattr(self.server, "idle_timeout_s", METRICS_IDLE_TIMEOUT_S)
        deadline = time.monotonic() + getattr(self.server, "request_deadline_s", METRICS_REQUEST_DEADLINE_S)
        self.connection.settimeout(idle_s)  # the answer's writes
        self.rfile.close()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, idle_s, deadline))

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


class MetricsServer(ThreadingWSGIServer):
    """The /metrics endpoint: a thread per connection, at most `max_connections` at once and
    `max_per_address` of them for one peer, each read bounded by `idle_timeout_s`, the request (line
    and headers) by `request_deadline_s` from accept (default METRICS_REQUEST_DEADLINE_S, 10 s). A
    peer is the caller's address (`peer_of`); on loopback, `uid_peer(peer_uid(caller, endpoint))`, the
    local user owning the caller's socket, or `LOOPBACK_PEER` for every loopback caller when
    `peer_uid` is None or cannot tell (counted in `peer_uid_unknown` by reason, each reason logged
    once as `metrics_peer_uid_unknown`). A refusal for the bound per peer is logged
    (`metrics_connection_refused`, with the address and the peer) within `log_budget`'s records per
    peer: any caller can cause them at will."""

    def __init__(self, address: tuple[str, int], *, idle_timeout_s: float = METRICS_IDLE_TIMEOUT_S,
                 request_deadline_s: float = METRICS_REQUEST_DEADLINE_S,
                 max_connections: int = METRICS_MAX_CONNECTIONS,
                 max_per_address: int = METRICS_MAX_CONNECTIONS_PER_ADDRESS,
                 logger: structlog.typing.FilteringBoundLogger | None = None,
                 log_budget: LogBudget | None = None,
                 peer_uid: PeerUidLookup | None = tcp_peer_uid) -> None:
        if not (idle_timeout_s > 0 and request_deadline_s > 0 and max_connections >= 1 and max_per_address >= 1):
            raise ValueError("idle_timeout_s and request_deadline_s must be > 0, max_connections and "
                             "max_per_address >= 1")
        self.idle_timeout_s = idle_timeout_s
        self.request_deadline_s = request_deadline_s
        self.max_connections, self.max_per_address = max_connections, max_per_address
        self._log = logger or get_logger("vgpu.metrics")
        self._log_budget = log_budget or LogBudget()
        # connections served now, in all and per peer; taken on the serving thread, given back on
        # each connection's own
        self._lock = threading.Lock()
        self._open = 0
        self._open_per_peer: dict[str, int] = {}
        self._peer_of_request: dict[Any, str] = {}  # each connection served now -> the peer it counts against
        self._peer_uid = peer_uid
        self.peer_uid_unknown = dict.fromkeys(PEER_UID_UNKNOWN_REASONS, 0)  # loopback callers counted as LOOPBACK_PEER
        self.refused_by_reason = dict.fromkeys(METRICS_REFUSAL_REASONS, 0)  # closed at accept
        self.failed = 0  # timed out or broken while served
        self._failed_lock = threading.Lock()  # handler threads count failures at once
        self.address_family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)[0][0]
        super().__init__(address, _Handler)

    @property
    def port(self) -> int:
        """The port bound: the one asked for, or the one the kernel picked for port 0."""
        return int(self.server_address[1])

    @property
    def open_connections(self) -> int:
        """Connections served now (each until its thread has closed it)."""
        return self._open

    @property
    def refused(self) -> int:
        """Connections closed at accept, for either bound."""
        return sum(self.refused_by_reason.values())

    def process_request(self, request: Any, client_address: Any) -> None:
        host = _host(client_address)
        peer = self._peer(request, client_address, host)
        with self._lock:
            held = self._open_per_peer.get(peer, 0)
            # the address's own share first: a caller beyond it is refused for that, whether or not
            # the endpoint is full as well
            if held >= self.max_per_address:
                reason: str | None = "max_connections_per_address"
            elif self._open >= self.max_connections:
                reason = "max_connections"
            else:
                reason = None
                self._open += 1
                self._open_per_peer[peer] = held + 1
                self._peer_of_request[request] = peer
        if reason is not None:
            self.refused_by_reason[reason] += 1  # only the serving thread refuses
            self.shutdown_request(request)
            if reason == "max_connections_per_address":
                self._log_refusal(host, peer, held)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # the thread did not start: its slot is free again
            self._give_back(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_back(request)

    def _peer(self, request: Any, client_address: Any, host: str) -> str:
        """The peer an accepted connection counts against: its address, or on loopback the uid owning
        the caller's socket (`LOOPBACK_PEER` when that cannot be read)."""
        peer = peer_of(host)
        if peer != LOOPBACK_PEER or self._peer_uid is None:
            return peer
        try:
            local = request.getsockname()
            uid = self._peer_uid((host, int(client_address[1])), (str(local[0]), int(local[1])))
        except PeerUidUnknown as exc:
            reason, detail = exc.reason, exc.detail
        except Exception as exc:  # noqa: BLE001 - a lookup that broke must not stop the serving thread
            reason, detail = "error", repr(exc)
        else:
            if isinstance(uid, int) and uid >= 0:
                return uid_peer(uid)
            reason, detail = "error", f"not a uid: {uid!r}"
        self.peer_uid_unknown[reason] = self.peer_uid_unknown.get(reason, 0) + 1  # only the serving thread
        if self.peer_uid_unknown[reason] == 1:  # once per reason: the count says how often since
            log = self._log.info if reason == "gone" else self._log.warning
            log("metrics_peer_uid_unknown", reason=reason, error=detail, address=host, peer=LOOPBACK_PEER,
                fix="loopback callers whose user cannot be read share one bound" + (
                    "; sock_diag (netlink) is needed to tell local users apart" if reason == "unsupported" else ""))
        return LOOPBACK_PEER

    def _give_back(self, request: Any) -> None:
        with self._lock:
            peer = self._peer_of_request.pop(request, None)
            if peer is None:
                return  # given back already
            self._open -= 1
            left = self._open_per_peer.get(peer, 1) - 1
            if left > 0:
                self._open_per_peer[peer] = left
            else:
                self._open_per_peer.pop(peer, None)

    def _log_refusal(self, host: str, peer: str, held: int) -> None:
        since = self._log_budget.admit((peer, "max_connections_per_address"))
        if since is None:
            return  # counted, not logged: this peer has had its records for the interval
        self._log.warning("metrics_connection_refused", reason="max_connections_per_address", address=host,
                          peer=peer, open_for_peer=held, bound=self.max_per_address,
                          refused_since_last_record=since,
                          fix="raise metrics.max_connections_per_address if a proxy brings scrapers from this peer")

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or broke: counted, not printed (socketserver prints a
        traceback to stderr, the daemon's JSON log, for each)."""
        with self._failed_lock:
            self.failed += 1


class _Named(Collector):
    """The families of `registry` named in `names`, whole, and the samples named there from others
    (`vgpu_signatures_total` of the counter `vgpu_signatures`)."""

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self._registry = registry
        self._names = names

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            samples = family.samples if family.name in self._names else \
                [s for s in family.samples if s.name in self._names]
            if samples:
                out = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples = list(samples)
                yield out


def metrics_app(registry: CollectorRegistry) -> Callable[[dict[str, Any], Callable[..., Any]], Any]:
    """prometheus_client's WSGI app for `registry`, with its `name[]` filter answered here.

    prometheus_client filters by the names collectors declare (`describe`); the daemon's collectors
    read its state at scrape time and declare none, so `?name[]=vgpu_build_info` gave an empty 200.
    Here the filter is applied to what a whole scrape yields: a family by its name, or samples by
    theirs."""
    plain = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        params = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
        names = params.pop("name[]", None)
        if not names:
            return plain(environ, start_response)
        named = CollectorRegistry(auto_describe=False)
        named.register(_Named(registry, frozenset(names)))
        rest = {**environ, "QUERY_STRING": urllib.parse.urlencode(params, doseq=True)}
        return make_wsgi_app(named)(rest, start_response)

    return app


def start_metrics_server(address: str, port: int, registry: CollectorRegistry, *,
                         idle_timeout_s: float = METRICS_IDLE_TIMEOUT_S,
                         request_deadline_s: float = METRICS_REQUEST_DEADLINE_S,
                         max_connections: int = METRICS_MAX_CONNECTIONS,
                         max_per_address: int = METRICS_MAX_CONNECTIONS_PER_ADDRESS,
                         logger: structlog.typing.FilteringBoundLogger | None = None,
                         log_budget: LogBudget | None = None,
                         peer_uid: PeerUidLookup | None = tcp_peer_uid) -> MetricsServer:
    """Serve `registry` at http://address:port/metrics from a daemon thread; `shutdown()` stops it.
    Port 0 binds any free port (the server's `port` says which). OSError when the port cannot be bound."""
    server = MetricsServer((address, port), idle_timeout_s=idle_timeout_s, request_deadline_s=request_deadline_s,
                           max_connections=max_connections, max_per_address=max_per_address, logger=logger,
                           log_budget=log_budget, peer_uid=peer_uid)
    server.set_app(metrics_app(registry))
    threading.Thread(target=server.serve_forever, name="vgpu-metrics", daemon=True).start()
    return server


def _learnt_file_metrics(prefix: str, state: str, loads: int, failures: int, state_help: str,
                         loads_help: str) -> Iterator[Metric]:
    """`<prefix>_state{state}` and `<prefix>_loads_total{result}` of one file the node learnt (the network's
    `local.pt`, the trees' `trees.json`), as its watcher in manager/nodelearn.py sees it."""
    gauge = GaugeMetricFamily(f"{prefix}_state", state_help, labels=["state"])
    for s in LOCAL_MODEL_STATES:
        gauge.add_metric([s], 1 if s == state else 0)
    yield gauge
    counter = CounterMetricFamily(f"{prefix}_loads", loads_help, labels=["result"])
    counter.add_metric(["ok"], loads)
    counter.add_metric(["failed"], failures)
    yield counter
