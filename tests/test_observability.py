"""Metrics that fit Prometheus and Grafana: a running `vgpu serve` with a replay profiler is scraped,
and every metric the shipped dashboard (deploy/grafana) and alerting rules (deploy/prometheus) use
must be among what it exports; the names follow the conventions; the collector's pieces."""

from __future__ import annotations

import json
import math
import platform
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon_fixtures import ROOT, Env, Serve, metric_samples
from tests.test_operator_views import cli, start_profiler
from vgpu import __version__
from vgpu.daemon.metrics import AppSnapshot, CounterSnapshot, DaemonMetrics, DeviceSnapshot
from vgpu.histogram import LatencyHistogram
from vgpu.inapp import INAPP_MAX

DASHBOARD = ROOT / "deploy" / "grafana" / "vgpu-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "vgpu-alerts.yml"
NAME = re.compile(r"\bvgpu_[a-z0-9_]+")
MIB = 1024 * 1024


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def rule_exprs() -> list[str]:
    # One `expr:` per rule, on one line (the file keeps them so; PyYAML is not a dependency).
    return [line.split("expr:", 1)[1].strip() for line in RULES.read_text().splitlines() if line.strip().startswith("expr:")]


def used_names() -> set[str]:
    return {name for expr in (*dashboard_exprs(), *rule_exprs()) for name in NAME.findall(expr)}


def scrape(port: int) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """family name -> [(sample name, labels, value)], with every family the endpoint declares; a
    counter's family is also listed as NAME_total (its samples' name) even before it has one."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for f in text_string_to_metric_families(body):
        out[f.name] = [(s.name, s.labels, s.value) for s in f.samples]
        if f.type == "counter":
            out.setdefault(f.name + "_total", [])
    return out


def exported_names(families: dict[str, list[tuple[str, dict[str, str], float]]]) -> set[str]:
    return set(families) | {s for samples in families.values() for s, _, _ in samples}


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert all(t["expr"].strip() for t in p["targets"])
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "instance", "device"]


# An aggregation with its `by`/`without` clause before or after its argument, a join's `on`/`ignoring`.
_AGGREGATION = re.compile(r"\b(sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile|count_values)\s*"
                          r"(?:(by|without)\s*\(([^)]*)\))?\s*\(")
_POSTFIX_CLAUSE = re.compile(r"\)\s*(by|without)\s*\(")
_JOIN = re.compile(r"\b(on|ignoring)\s*\(([^)]*)\)")
_QUANTILE = re.compile(r"histogram_quantile\(\s*[0-9.]+\s*,\s*(\w+)\s*(?:by\s*\(([^)]*)\))?")


def _labels(text: str | None) -> set[str]:
    return {label.strip() for label in (text or "").split(",") if label.strip()}


def per_node_problems(expr: str) -> list[str]:
    """Where `expr` would merge nodes or lose the label that names one: an aggregation not by
    `instance`, a join not on it, a histogram quantile over several nodes' buckets."""
    problems = []
    for m in _AGGREGATION.finditer(expr):
        if m.group(2) != "by" or "instance" not in _labels(m.group(3)):
            problems.append(f"{m.group(0)!r} does not keep instance")
    if _POSTFIX_CLAUSE.search(expr):
        problems.append("a by/without clause after its argument (write it before, with instance)")
    for m in _JOIN.finditer(expr):
        if m.group(1) != "on" or "instance" not in _labels(m.group(2)):
            problems.append(f"{m.group(0)!r} matches across nodes")
    for m in _QUANTILE.finditer(expr):
        if not {"instance", "le"} <= _labels(m.group(2)):
            problems.append(f"{m.group(0)!r}: a quantile of buckets summed over nodes")
    return problems


def test_per_node_problems_finds_what_merges_nodes() -> None:
    assert per_node_problems('histogram_quantile(0.99, sum by (instance, le) (rate(x_bucket[5m])))') == []
    for merged in ("histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m])))", "sum(rate(x[5m]))",
                   "sum without (device) (x)", "sum(x) by (instance)", "a and on (device) b", "a and ignoring (app) b"):
        assert per_node_problems(merged), merged


def test_every_dashboard_query_and_rule_is_per_node() -> None:
    """Prometheus scrapes one daemon per node: a panel that sums, or an alert that aggregates or
    joins, across `instance` merges the nodes (one slow node's P99 diluted by the fast ones, an
    alert with no node to name). Every dashboard query is filtered by the Node variable too."""
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["instance"]["definition"] == "label_values(vgpu_build_info, instance)"
    assert variables["instance"]["includeAll"] and variables["instance"]["allValue"] == ".*"
    assert variables["device"]["definition"] == 'label_values(vgpu_device_info{instance=~"$instance"}, device)'
    targets = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(targets) >= 30
    for expr in targets:
        assert not per_node_problems(expr), (expr, per_node_problems(expr))
        for m in re.finditer(r"\b(vgpu_[a-z0-9_]+)(\{[^}]*\})?", expr):
            assert 'instance=~"$instance"' in (m.group(2) or ""), (m.group(1), expr)
    quantiles = [e for e in (*targets, *rule_exprs()) if "histogram_quantile" in e]
    assert len(quantiles) >= 4
    for expr in rule_exprs():
        assert not per_node_problems(expr), (expr, per_node_problems(expr))
    slow = next(e for e in rule_exprs() if "vgpu_forecast_batch_seconds_bucket" in e)
    assert "sum by (instance, le)" in slow


def test_rules_file_has_an_expr_per_alert() -> None:
    text = RULES.read_text()
    alerts = re.findall(r"^\s+- alert: (\w+)$", text, flags=re.M)
    assert len(alerts) == len(rule_exprs()) >= 5
    assert {"VgpuProfilerSilent", "VgpuForecastFailures", "VgpuEnforcementDisabled", "VgpuOomEvents"} <= set(alerts)


def test_dashboard_and_rules_load_only_what_a_running_daemon_exports(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    device = json.loads(cli(env, "available", "--json").stdout)["devices"][0]["device_id"]
    assert cli(env, "request", "--app", "asked", "--memory-mib", "512").returncode == 0
    prof = start_profiler(env, device)
    try:
        # until what the checks below read has happened (a forecast, the grant it made, every metric the
        # dashboard and rules use) or 60 s went by: polled, not a fixed wait a loaded machine can outlast
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            fams = scrape(port)
            reasons = {(labels["kind"], labels["reason"]) for name, labels, v in fams.get("vgpu_grant_changes", [])
                       if name == "vgpu_grant_changes_total" and v > 0}
            if any(v > 0 for _, _, v in fams.get("vgpu_app_forecast_memory_p90_bytes", [])) and \
                    fams.get("vgpu_app_oom_events") and ("granted", "forecast") in reasons and \
                    not used_names() - exported_names(fams):
                break
            time.sleep(0.5)
    finally:
        prof.terminate()
        prof.wait(10)

    missing = sorted(used_names() - exported_names(fams))
    assert not missing, f"the dashboard or rules use metrics the daemon does not export: {missing}"
    assert len(used_names()) >= 25

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        return [s for fam in fams.values() for s in fam if s[0] == name]

    # a device label on every per-application metric
    for fam, rows in fams.items():
        if fam.startswith("vgpu_app_") and not fam.endswith("_total"):
            # the in-app counters' series exist only for applications that report them (none here)
            assert rows or fam == "vgpu_app_inapp_value", fam
            assert all("device" in labels and "app" in labels for _, labels, _ in rows), fam
    used = {labels["app"]: v for _, labels, v in samples("vgpu_app_memory_used_bytes")}
    assert used["bert-train"] > 1000 * MIB  # bytes, not MiB
    (draw,) = samples("vgpu_device_power_draw_watts")
    assert 50 < draw[2] < 800
    assert samples("vgpu_device_power_limit_watts")[0][2] <= 700
    assert samples("vgpu_profiler_connected")[0][1:] == ({"device": device}, 1.0)
    assert 0 <= samples("vgpu_newest_signature_age_seconds")[0][2] < 10
    (build,) = samples("vgpu_build_info")
    assert build[1]["version"] == __version__ and build[1]["backend"] == "sim:h100-80gb"
    buckets = samples("vgpu_forecast_batch_seconds_bucket")
    assert buckets[-1][1]["le"] == "+Inf" and buckets[-1][2] == samples("vgpu_forecast_batch_seconds_count")[0][2] > 0
    assert samples("vgpu_tick_seconds_count")[0][2] > 0
    # counted, not only exported (every series is exported at 0 from the start)
    reasons = {(labels["kind"], labels["reason"]) for _, labels, v in samples("vgpu_grant_changes_total") if v > 0}
    assert ("granted", "request") in reasons and ("granted", "forecast") in reasons
    assert {labels["mechanism"] for _, labels, v in samples("vgpu_enforcement_disabled") if v == 0} >= {"power_limit"}
    assert {labels["mechanism"] for _, labels, v in samples("vgpu_enforcement_unsupported")
            if v == 0} >= {"power_limit", "cgroup_memory"}  # the simulator has both
    # conventions: base units in names (no MiB, percent or milliwatts), counters end in _total
    for fam in fams:
        assert not re.search(r"_(mib|pct|mw)(_|$)", fam), fam
    for name in ("vgpu_signatures_total", "vgpu_grant_changes_total", "vgpu_app_oom_events_total",
                 "vgpu_app_memory_overruns_total", "vgpu_forecast_failures_total", "vgpu_store_writes_total"):
        assert samples(name), name


def test_labelled_counters_are_exported_at_zero_before_their_first_event(env: Env, serves: list[Serve]) -> None:
    """A counter series that appeared only at its first event would begin at 1, and the dashboard's
    rate()/increase() would miss that event: every label value known at start has its series at 0
    as soon as the daemon serves, before anything happened."""
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    fams = scrape(port)
    devices = [d["device_id"] for d in json.loads(cli(env, "available", "--json").stdout)["devices"]]
    assert devices

    def zeros(name: str) -> set[tuple[str, ...]]:
        rows = fams[name]
        assert all(v == 0 for _, _, v in rows), (name, rows)
        return {tuple(labels.values()) for _, labels, _ in rows}

    assert zeros("vgpu_enforcement_failures") == {(d, m) for d in devices
                                                  for m in ("power_limit", "mig", "cgroup_memory")}
    assert zeros("vgpu_restore_actions") == {(m, r) for m in ("power_limit", "mig")
                                             for r in ("ok", "mismatch", "failed")}
    assert zeros("vgpu_connections_refused") == {("max_connections",), ("max_connections_per_uid",),
                                                 ("upstream",), ("no_descriptors",)}
    assert zeros("vgpu_grant_changes") == {("granted", "request"), ("granted", "forecast"),
                                           ("granted", "cold_start"), ("resized", "grow"), ("resized", "shrink"),
                                           ("resized", "limits"), ("resized", "reclaim"),
                                           ("released", "released"), ("released", "superseded"),
                                           ("released", "exited")}
    dropped = zeros("vgpu_inapp_values_dropped")
    assert {("in_app.kv_used_mib dropped: not finite",), ("in_app.kv_used_mib dropped: negative",),
            ("in_app.kv_used_mib dropped: above 1.67772e+07",)} <= dropped
    assert len(dropped) == 3 * len(INAPP_MAX)
    # the endpoint's own connections (refused by reason) and the node history's losses, at 0
    assert zeros("vgpu_metrics_connections_refused") == {("max_connections",), ("max_connections_per_address",)}
    for name in ("vgpu_metrics_connections_failed", "vgpu_history_rows_refused", "vgpu_history_write_failures"):
        assert zeros(name) == {()}, name
    # an event adds to its zero series rather than starting a new one
    assert cli(env, "request", "--app", "asked", "--memory-mib", "512").returncode == 0
    granted = {tuple(labels.values()): v for _, labels, v in scrape(port)["vgpu_grant_changes"]}
    assert granted[("granted", "request")] == 1 and len(granted) == 10


def test_a_scrape_has_no_created_series(env: Env, serves: list[Serve]) -> None:
    """prometheus_client's `_created` series (when a counter began) are off: nothing reads them, the
    docs list none, and only the counters the daemon increments itself would have them."""
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    assert cli(env, "request", "--app", "asked", "--memory-mib", "512").returncode == 0  # a store write
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    fams = scrape(port)
    assert fams["vgpu_store_writes"][0][2] >= 1 and fams["vgpu_restore_actions"]
    assert "_created" not in body, [line for line in body.splitlines() if "_created" in line]


@pytest.mark.parametrize("mixture", [True, False], ids=["mixture", "model-alone"])
def test_the_forecaster_record_names_the_forecaster_the_metric_says_serves(env: Env, serves: list[Serve],
                                                                          mixture: bool) -> None:
    """The start's `forecaster` record said "serving": "model" while vgpu_forecaster_serving said the
    expert mixture served (the shipped model is one of its experts): an operator grepping the
    journal got another answer than the scrape. Both now name the same forecaster; `model` says
    whether the checkpoint loaded."""
    env.env["VGPU_MANAGER_MIXTURE"] = "true" if mixture else "false"
    serves.append(Serve(env, "--metrics-port", "auto"))
    serves[-1].wait_for("forecaster", 120.0)  # the shipped model loads in the background
    record = serves[-1].event("forecaster")
    serving = [labels["forecaster"] for _, labels, v in scrape(serves[-1].metrics_port)["vgpu_forecaster_serving"]
               if v == 1]
    assert serving == [record["serving"]] == ["mixture" if mixture else "model"], (serving, record)
    assert record["model"] == "loaded" and record["path"].endswith("default.pt"), record


def test_an_application_limited_before_it_runs_has_no_device_series(env: Env, serves: list[Serve]) -> None:
    """`set-limit --create` for an application that never ran: it has no device, so it is on no
    device's count; before, it made a `device=""` series in every per-device family (an extra
    "device" in each `sum by (device)` and in the dashboard's device list)."""
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    device = json.loads(cli(env, "available", "--json").stdout)["devices"][0]["device_id"]
    r = cli(env, "set-limit", "--app", "future", "--max-memory-mib", "2000", "--create")
    assert r.returncode == 0, r.stderr
    assert cli(env, "request", "--app", "running", "--memory-mib", "512").returncode == 0
    samples = metric_samples(port)
    assert [k for k in samples if ("device", "") in k[1]] == []
    assert samples[("vgpu_device_apps", (("device", device),))] == 1  # "running" only
    assert samples[("vgpu_device_apps_unlisted", (("device", device),))] == 0
    assert not [k for k in samples if ("app", "future") in k[1]]
    assert ("vgpu_app_grants", (("app", "running"), ("device", device))) in samples


def test_process_metrics_and_a_name_filter_on_the_endpoint(env: Env, serves: list[Serve]) -> None:
    """The daemon's own RSS, descriptors, CPU and start time, to watch it approach the unit's
    MemoryMax and LimitNOFILE; `?name[]=` answers with the families named (it gave an empty 200)."""
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    samples = metric_samples(port)
    if platform.system() == "Linux":
        # the daemon's, not this test's: its RSS is of a process that has loaded the daemon
        assert 20 * MIB < samples[("process_resident_memory_bytes", ())] < 4096 * MIB
        assert 5 < samples[("process_open_fds", ())] <= samples[("process_max_fds", ())]
        assert abs(samples[("process_start_time_seconds", ())] - time.time()) < 600
        assert samples[("process_cpu_seconds_total", ())] > 0
    assert any(name == "python_info" for name, _ in samples)

    def get(query: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?{query}", timeout=10) as r:
            return r.status, r.read().decode()

    status, body = get("name[]=vgpu_build_info")
    assert status == 200
    fams = list(text_string_to_metric_families(body))
    assert [f.name for f in fams] == ["vgpu_build_info"] and fams[0].samples[0].labels["version"] == __version__
    # several names; a counter by its family or by its samples' name
    status, body = get("name[]=vgpu_store_writes&name[]=process_open_fds&name[]=vgpu_signatures_total")
    names = {s.name for f in text_string_to_metric_families(body) for s in f.samples}
    assert names == {"vgpu_store_writes_total", "process_open_fds", "vgpu_signatures_total"}
    assert get("name[]=vgpu_no_such_metric") == (200, "")
    # without the filter, everything, as before
    assert "vgpu_device_info" in get("")[1] and "vgpu_device_info" in get("other=1")[1]


class _Source:
    def __init__(self, apps: list[AppSnapshot], devices: list[DeviceSnapshot], counters: CounterSnapshot) -> None:
        self.apps, self.devices, self.counters = apps, devices, counters

    def app_snapshots(self) -> list[AppSnapshot]:
        return self.apps

    def device_snapshots(self) -> list[DeviceSnapshot]:
        return self.devices

    def counter_snapshot(self) -> CounterSnapshot:
        return self.counters


def test_collector_units_absent_values_and_histograms() -> None:
    hist = LatencyHistogram()
    for s in (0.0004, 0.003, 0.003, 0.2, 9.0, math.nan, -1.0):
        hist.observe(s)
    registry = CollectorRegistry()
    DaemonMetrics(registry, _Source(
        [AppSnapshot("a", "GPU-1", mem_used_mib=100, sm_util_pct=50, granted_mem_mib=200, grants=1, overruns=3,
                     oom_events=1),
         AppSnapshot("a", "GPU-2", granted_mem_mib=10, grants=1)],  # another device: no use known there
        [DeviceSnapshot("GPU-1", 1000, 200, 300_000, (("power_limit", ""), ("cgroup_memory", "not supported")),
                        unsupported=("cgroup_memory",), index=0, name="X", pci_bus_id="00000000:17:00.0",
                        power_draw_mw=150_000, temperature_c=40, sm_clock_mhz=1500, sm_util_pct=50, profiler_streams=0),
         DeviceSnapshot("GPU-2", 1000, 0, None, (("power_limit", "NoPermission: refused"), ("cgroup_memory", "")))],
        CounterSnapshot(forecast_latency=hist, tick_latency=LatencyHistogram(), forecast_batches=4,
                        grant_changes=(("resized", "grow", 2),), backend="nvml")))
    get = registry.get_sample_value
    assert get("vgpu_app_memory_used_bytes", {"app": "a", "device": "GPU-1"}) == 100 * MIB
    assert get("vgpu_app_memory_used_bytes", {"app": "a", "device": "GPU-2"}) is None  # unknown: absent
    assert get("vgpu_app_granted_memory_bytes", {"app": "a", "device": "GPU-2"}) == 10 * MIB
    assert get("vgpu_app_sm_utilization_ratio", {"app": "a", "device": "GPU-1"}) == 0.5
    assert get("vgpu_app_oom_events_total", {"app": "a", "device": "GPU-1"}) == 1
    assert get("vgpu_app_oom_events_total", {"app": "a", "device": "GPU-2"}) is None
    assert get("vgpu_device_power_draw_watts", {"device": "GPU-1"}) == 150
    assert get("vgpu_device_sm_clock_hertz", {"device": "GPU-1"}) == 1.5e9
    assert get("vgpu_device_memory_used_bytes", {"device": "GPU-1"}) is None  # not reported
    # off because the driver lacks it: unsupported, not disabled (which VgpuEnforcementDisabled fires on)
    assert get("vgpu_enforcement_disabled", {"device": "GPU-1", "mechanism": "power_limit"}) == 0
    assert get("vgpu_enforcement_disabled", {"device": "GPU-1", "mechanism": "cgroup_memory"}) == 0
    assert get("vgpu_enforcement_unsupported", {"device": "GPU-1", "mechanism": "cgroup_memory"}) == 1
    assert get("vgpu_enforcement_unsupported", {"device": "GPU-1", "mechanism": "power_limit"}) == 0
    # off after failing at runtime: disabled
    assert get("vgpu_enforcement_disabled", {"device": "GPU-2", "mechanism": "power_limit"}) == 1
    assert get("vgpu_enforcement_unsupported", {"device": "GPU-2", "mechanism": "power_limit"}) == 0
    assert get("vgpu_enforcement_disabled", {"device": "GPU-2", "mechanism": "cgroup_memory"}) == 0
    assert get("vgpu_profiler_connected", {"device": "GPU-1"}) == 0
    assert get("vgpu_newest_signature_age_seconds", {"device": "GPU-1"}) is None
    assert get("vgpu_device_info", {"device": "GPU-1", "index": "0", "name": "X", "pci_bus_id": "00000000:17:00.0"}) == 1
    assert get("vgpu_grant_changes_total", {"kind": "resized", "reason": "grow"}) == 2
    assert get("vgpu_forecast_batch_seconds_bucket", {"le": "0.0005"}) == 1
    assert get("vgpu_forecast_batch_seconds_bucket", {"le": "0.005"}) == 3
    assert get("vgpu_forecast_batch_seconds_bucket", {"le": "2.5"}) == 4
    assert get("vgpu_forecast_batch_seconds_bucket", {"le": "+Inf"}) == get("vgpu_forecast_batch_seconds_count") == 5
    assert get("vgpu_forecast_batch_seconds_sum") == pytest.approx(9.2064)
    assert get("vgpu_tick_seconds_count") == 0
    assert get("vgpu_build_info", {"version": __version__, "python": platform.python_version(), "backend": "nvml"}) == 1


def test_histogram_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        LatencyHistogram(bounds_s=(0.1, 0.01))


def test_every_vgpu_command_an_alert_suggests_runs_as_written(tmp_path: Path) -> None:
    """The commands the alerting rules and the alert table of docs/operations.md hand the on-call
    operator are accepted by the CLI as written (label templates filled in): against a socket where
    no daemon listens each fails to reach it (exit 1), never with a usage error (exit 2); one that
    reads the state directory (`vgpu model`) is told of one that does not exist (exit 2, no usage)."""
    import os
    import subprocess
    import sys

    ops = (ROOT / "docs" / "operations.md").read_text()
    table = ops[ops.index("## Alerts"):].split("\n## ", 1)[0]
    # a command with options is one to run; a bare name only names the command, except those run bare
    commands = {c for c in re.findall(r"`(vgpu [^`]+)`", RULES.read_text() + table)
                if " --" in c or c in ("vgpu doctor", "vgpu apps")}
    assert any(c.startswith("vgpu report") for c in commands), commands
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "vgpu.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**env, "PYTHONPATH": str(ROOT)}, check=False)

    for command in sorted(commands):
        argv = re.sub(r"\{\{\s*\$labels\.\w+\s*\}\}", "bert-train", command).replace("APP", "bert-train").split()
        # a command that waits for a daemon to come up is told not to: none will
        helped = run(argv[1], "--help").stdout
        no_wait = ["--wait-s", "0"] if "--wait-s" in helped else []
        socket = ["--socket", str(tmp_path / "none.sock")] if "--socket" in helped else []
        r = run(*argv[1:], *socket, "--state-dir", str(tmp_path / "state"), *no_wait)
        expected = 1 if socket else 2
        assert r.returncode == expected and "usage:" not in r.stderr, (command, r.returncode, r.stderr)
        if not socket:
            assert "no state directory" in r.stderr, (command, r.stderr)


def test_daemon_down_fires_for_one_node_of_many_and_for_none_scraped(tmp_path: Path) -> None:
    """`promtool test rules` on synthetic series: node-a's daemon stops (up 0, its series go stale)
    while node-b's keeps exporting; VgpuDaemonDown fires for node-a (absent(vgpu_build_info) alone
    did not: node-b still exported it). Nothing fires while both are up; with no vgpu target scraped
    at all it fires without an instance. Skipped where promtool is not installed (Debian's
    `prometheus` package has it)."""
    info = 'vgpu_build_info{{job="vgpu", instance="{}", version="0.1.0", python="3.11.7", backend="nvml"}}'
    tests = f"""
  - interval: 30s
    input_series:
      - series: 'up{{job="vgpu", instance="node-a:9464"}}'
        values: '1x10 0x20'
      - series: '{info.format("node-a:9464")}'
        values: '1x10 _x20'
      - series: 'up{{job="vgpu", instance="node-b:9464"}}'
        values: '1x30'
      - series: '{info.format("node-b:9464")}'
        values: '1x30'
    alert_rule_test:
      - eval_time: 4m
        alertname: VgpuDaemonDown
        exp_alerts: []
      - eval_time: 14m
        alertname: VgpuDaemonDown
        exp_alerts:
          - exp_labels: {{severity: critical, job: vgpu, instance: "node-a:9464"}}
            exp_annotations:
              summary: "no vgpu daemon is exporting metrics at node-a:9464"
              description: "The daemon is down or its metrics endpoint is not scraped (up == 0 for a target that exported vgpu_build_info, or vgpu_build_info absent everywhere). Check `systemctl status vgpu-manager` and `vgpu doctor`."
  - interval: 30s
    input_series:
      - series: 'up{{job="node", instance="node-a:9100"}}'
        values: '1x10'
    alert_rule_test:
      - eval_time: 4m
        alertname: VgpuDaemonDown
        exp_alerts:
          - exp_labels: {{severity: critical}}
            exp_annotations:
              summary: "no vgpu daemon is exporting metrics"
              description: "The daemon is down or its metrics endpoint is not scraped (up == 0 for a target that exported vgpu_build_info, or vgpu_build_info absent everywhere). Check `systemctl status vgpu-manager` and `vgpu doctor`."
"""
    promtool_test_rules(tmp_path, tests)


def promtool_test_rules(tmp_path: Path, tests: str) -> None:
    """`promtool test rules` on `tests` (the `tests:` list of a rule test file, its items indented two
    spaces), against the shipped rules evaluated every 30 s; skipped where promtool is not installed."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed here (apt-get install prometheus provides it)")
    (tmp_path / "tests.yml").write_text(f"\nrule_files: [{RULES}]\nevaluation_interval: 30s\ntests:{tests}")
    r = subprocess.run([promtool, "test", "rules", str(tmp_path / "tests.yml")], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_forecasts_slow_on_one_node_of_two_fire_for_that_node(tmp_path: Path) -> None:
    """node-a makes one forecast per 30 s, each 0.25-0.5 s; node-b 100, each under 0.1 s. Summed over
    both nodes the P99 is under 0.1 s and nothing fired; per node, node-a's is 0.4975 s and fires,
    named by its instance."""
    def buckets(instance: str, per_interval: dict[str, int]) -> str:
        return "".join(f"""
      - series: 'vgpu_forecast_batch_seconds_bucket{{job="vgpu", instance="{instance}", le="{le}"}}'
        values: '0+{n}x60'""" for le, n in per_interval.items())

    tests = f"""
  - interval: 30s
    input_series:{buckets("node-a:9464", {"0.1": 0, "0.25": 0, "0.5": 1, "+Inf": 1})}{
        buckets("node-b:9464", {"0.1": 100, "0.25": 100, "0.5": 100, "+Inf": 100})}
    alert_rule_test:
      - eval_time: 5m
        alertname: VgpuForecastSlow
        exp_alerts: []
      - eval_time: 25m
        alertname: VgpuForecastSlow
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "node-a:9464"}}
            exp_annotations:
              summary: "P99 forecast latency 497.5ms on node-a:9464"
              description: "Forecasts take a quarter of their 1 s period or more: the CPU is short, or the batches too large."
"""
    promtool_test_rules(tmp_path, tests)


def test_an_oom_event_of_an_application_whose_series_starts_with_it_fires(tmp_path: Path) -> None:
    """`old` had series from the start and has its first OOM event at 5 min; `new` gets series only
    then (beyond metrics.max_apps, it is listed once it has had an OOM event, so its counter appears at
    1). Both fire; increase() alone saw nothing of `new`, although docs/operations.md promises that
    listing applications with OOM events keeps VgpuOomEvents firing for them. Both resolve once 10
    minutes pass without another event."""
    def expected(app: str) -> str:
        return f"""
          - exp_labels: {{severity: warning, app: {app}, device: GPU-1}}
            exp_annotations:
              summary: "{app} used more memory than granted (1 times in 10 minutes)"
              description: "The use crossed above the grant: with memory caps on, an allocation failed there. `vgpu report --app {app} --out oom.png` draws use against forecast and grant."
"""
    tests = f"""
  - interval: 30s
    input_series:
      - series: 'vgpu_app_oom_events_total{{app="old", device="GPU-1"}}'
        values: '0x10 1x40'
      - series: 'vgpu_app_oom_events_total{{app="new", device="GPU-1"}}'
        values: '_x10 1x40'
    alert_rule_test:
      - eval_time: 4m
        alertname: VgpuOomEvents
        exp_alerts: []
      - eval_time: 7m
        alertname: VgpuOomEvents
        exp_alerts:{expected("old")}{expected("new")}
      - eval_time: 17m
        alertname: VgpuOomEvents
        exp_alerts: []
"""
    promtool_test_rules(tmp_path, tests)


def test_the_first_enforcement_failure_of_a_device_fires(tmp_path: Path) -> None:
    """A vgpu_enforcement_failures_total series that begins at 1 (the daemon exports it at 0 from the
    start, but a scrape can miss the start): one failed power-limit write once fired nothing
    (increase() saw no change); it fires now, and a second failure later on another series still does."""
    desc = "Device writes (power limit, MIG, cgroup memory limit) failed or did not read back."
    tests = f"""
  - interval: 30s
    input_series:
      - series: 'vgpu_enforcement_failures_total{{device="GPU-1", mechanism="power_limit"}}'
        values: '_x10 1x40'
      - series: 'vgpu_enforcement_failures_total{{device="GPU-1", mechanism="mig"}}'
        values: '_x10 1x20 2x20'
    alert_rule_test:
      - eval_time: 4m
        alertname: VgpuEnforcementFailures
        exp_alerts: []
      - eval_time: 7m
        alertname: VgpuEnforcementFailures
        exp_alerts:
          - exp_labels: {{severity: warning, device: GPU-1, mechanism: power_limit}}
            exp_annotations:
              summary: "power_limit changes failed on GPU GPU-1"
              description: "{desc}"
          - exp_labels: {{severity: warning, device: GPU-1, mechanism: mig}}
            exp_annotations:
              summary: "mig changes failed on GPU GPU-1"
              description: "{desc}"
      - eval_time: 18m
        alertname: VgpuEnforcementFailures
        exp_alerts:
          - exp_labels: {{severity: warning, device: GPU-1, mechanism: mig}}
            exp_annotations:
              summary: "mig changes failed on GPU GPU-1"
              description: "{desc}"
"""
    promtool_test_rules(tmp_path, tests)


def test_a_mechanism_the_driver_lacks_never_fires_one_that_failed_does(tmp_path: Path) -> None:
    """cgroup_memory on GPU-1 is off for good because the driver has no per-cgroup memory limits: the
    daemon exports it as vgpu_enforcement_unsupported = 1 and vgpu_enforcement_disabled = 0, so
    VgpuEnforcementDisabled never fires for it, however long it lasts (it once fired for good on
    such a node). power_limit on GPU-2 is turned off at 5 min after failing at runtime: it fires
    once it has been off for 5 min, and resolves when the daemon, restarted with the cause fixed,
    exports 0 again."""
    desc = ("The allocator turned the mechanism off after it failed at runtime (a write refused for lack of "
            "privilege, or NotSupported after it had worked); the daemon log says why "
            "(`cgroup_memory_limit_disabled`, `power_limit_disabled`). Grants are kept in the ledger but not "
            "applied to the device until the daemon restarts with the cause fixed: `vgpu doctor`.")
    tests = f"""
  - interval: 30s
    input_series:
      - series: 'vgpu_enforcement_disabled{{device="GPU-1", mechanism="cgroup_memory"}}'
        values: '0x120'
      - series: 'vgpu_enforcement_unsupported{{device="GPU-1", mechanism="cgroup_memory"}}'
        values: '1x120'
      - series: 'vgpu_enforcement_disabled{{device="GPU-2", mechanism="power_limit"}}'
        values: '0x10 1x30 0x80'
      - series: 'vgpu_enforcement_unsupported{{device="GPU-2", mechanism="power_limit"}}'
        values: '0x120'
    alert_rule_test:
      - eval_time: 8m
        alertname: VgpuEnforcementDisabled
        exp_alerts: []
      - eval_time: 12m
        alertname: VgpuEnforcementDisabled
        exp_alerts:
          - exp_labels: {{severity: warning, device: GPU-2, mechanism: power_limit}}
            exp_annotations:
              summary: "power_limit enforcement is off on GPU GPU-2"
              description: "{desc}"
      - eval_time: 60m
        alertname: VgpuEnforcementDisabled
        exp_alerts: []
"""
    promtool_test_rules(tmp_path, tests)
