"""Per-application series are bounded (vgpu/daemon/metrics.py `select_apps`, `metrics.max_apps`): a real
`vgpu serve` is filled with applications the way an anonymous caller of its socket can, and its
/metrics, scraped over HTTP, lists at most the configured number of them, operator-limited ones
always, and counts and sums the rest per device."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tests.daemon_fixtures import Env, Serve
from tests.hostile import Raw, raw
from tests.test_observability import scrape
from tests.test_operator_views import cli
from vgpu.daemon.metrics import AppSnapshot, CounterSnapshot, DaemonMetrics, DeviceSnapshot, select_apps

MIB = 1024 * 1024
Families = dict[str, list[tuple[str, dict[str, str], float]]]


@pytest.fixture
def caller(env: Env) -> Iterator[Raw]:
    yield from raw(env.sock)


def listed_apps(fams: Families) -> set[str]:
    return {labels["app"] for name, rows in fams.items() if name.startswith("vgpu_app_") for _, labels, _ in rows}


def per_device(fams: Families, name: str) -> dict[str, float]:
    return {labels["device"]: v for _, labels, v in fams[name]}


def test_default_cap_holds_against_an_anonymous_flood(env: Env, serves: list[Serve], caller: Raw) -> None:
    """No setting: 100 applications get series; 5 more, created by anyone, are only counted."""
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    for i in range(105):
        caller.request(f"flood-{i:03d}", 1.0 + i)  # flood-104 is the largest
    fams = scrape(port)
    listed = listed_apps(fams)
    assert len(listed) == 100
    assert listed == {f"flood-{i:03d}" for i in range(5, 105)}  # the five smallest are left out
    (device,) = per_device(fams, "vgpu_device_memory_total_bytes")
    assert per_device(fams, "vgpu_device_apps") == {device: 105}
    assert per_device(fams, "vgpu_device_apps_unlisted") == {device: 5}
    assert per_device(fams, "vgpu_device_unlisted_memory_granted_bytes") == {device: (1 + 2 + 3 + 4 + 5) * MIB}
    assert per_device(fams, "vgpu_device_unlisted_grants") == {device: 5}
    assert fams["vgpu_metrics_max_apps"][0][2] == 100
    # what is listed and what is summed add up to what the device has granted
    granted = sum(v for _, _, v in fams["vgpu_app_granted_memory_bytes"])
    assert granted + per_device(fams, "vgpu_device_unlisted_memory_granted_bytes")[device] == \
        per_device(fams, "vgpu_device_memory_granted_bytes")[device]


def test_operator_limited_applications_keep_their_series(env: Env, serves: list[Serve], caller: Raw) -> None:
    env.env["VGPU_METRICS_MAX_APPS"] = "4"
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    for app, mib in (("big-1", 300.0), ("big-2", 200.0), ("big-3", 100.0), ("quiet", 1.0)):
        caller.request(app, mib)
    for i in range(10):
        caller.request(f"flood-{i}", 1.0)
    assert cli(env, "set-limit", "--app", "quiet", "--max-memory-mib", "50").returncode == 0
    fams = scrape(port)
    assert listed_apps(fams) == {"quiet", "big-1", "big-2", "big-3"}  # the cap counts the limited one
    assert sum(per_device(fams, "vgpu_device_apps_unlisted").values()) == 10
    assert sum(per_device(fams, "vgpu_device_unlisted_memory_granted_bytes").values()) == 10 * MIB
    assert fams["vgpu_metrics_max_apps"][0][2] == 4
    quiet = [(labels, v) for _, labels, v in fams["vgpu_app_granted_memory_bytes"] if labels["app"] == "quiet"]
    assert [v for _, v in quiet] == [1 * MIB]

    # one more limited application takes the place of the smallest unlimited one
    assert cli(env, "set-limit", "--app", "flood-7", "--max-memory-mib", "50").returncode == 0
    fams = scrape(port)
    assert listed_apps(fams) == {"quiet", "flood-7", "big-1", "big-2"}
    assert sum(per_device(fams, "vgpu_device_apps_unlisted").values()) == 10
    assert sum(per_device(fams, "vgpu_device_unlisted_memory_granted_bytes").values()) == (9 + 100) * MIB

    # operators who limit more applications than the cap see them all: the cap bounds the others
    for app in ("flood-1", "flood-2", "flood-3"):
        assert cli(env, "set-limit", "--app", app, "--max-memory-mib", "50").returncode == 0
    fams = scrape(port)
    assert listed_apps(fams) == {"quiet", "flood-7", "flood-1", "flood-2", "flood-3"}
    assert sum(per_device(fams, "vgpu_device_apps_unlisted").values()) == 14 - 5


def test_max_apps_zero_lists_only_limited_applications(env: Env, serves: list[Serve], caller: Raw) -> None:
    env.env["VGPU_METRICS_MAX_APPS"] = "0"
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    caller.request("a", 10.0)
    caller.request("b", 1.0)
    fams = scrape(port)
    assert listed_apps(fams) == set()
    assert sum(per_device(fams, "vgpu_device_apps_unlisted").values()) == 2
    assert cli(env, "set-limit", "--app", "b", "--max-memory-mib", "50").returncode == 0
    assert listed_apps(scrape(port)) == {"b"}


def test_a_negative_cap_is_refused_at_start(env: Env) -> None:
    env.env["VGPU_METRICS_MAX_APPS"] = "-1"
    with pytest.raises(AssertionError, match="metrics.max_apps: must be >= 0"):
        Serve(env)


# The selection itself, on snapshots.

def snap(app: str, device: str = "GPU-1", **kw: float | int | bool | None) -> AppSnapshot:
    return AppSnapshot(app, device, **kw)  # type: ignore[arg-type]


def ids(rows: list[AppSnapshot]) -> list[tuple[str, str]]:
    return [(a.app_id, a.device_id) for a in rows]


def test_under_the_cap_everything_is_listed_in_order() -> None:
    apps = [snap("b", granted_mem_mib=1), snap("a", granted_mem_mib=2)]
    assert select_apps(apps, 2) == (apps, [])


def test_ranking_limited_then_oom_then_footprint_then_id() -> None:
    apps = [
        snap("small-limited", granted_mem_mib=1, limited=True),
        snap("oom", granted_mem_mib=2, oom_events=1),
        snap("no-oom-yet", granted_mem_mib=3, oom_events=0),
        snap("uses-more", granted_mem_mib=1, mem_used_mib=900),  # use above its grant counts
        snap("forecast", forecast_mem_p90_mib=800, mem_used_mib=math.nan),
        snap("big", granted_mem_mib=500),
        snap("tie-b", granted_mem_mib=5),
        snap("tie-a", granted_mem_mib=5),
    ]
    for n, expect in ((1, ["small-limited"]), (2, ["small-limited", "oom"]),
                      (5, ["small-limited", "oom", "uses-more", "forecast", "big"]),
                      (6, ["small-limited", "oom", "uses-more", "forecast", "big", "tie-a"])):
        listed, left = select_apps(apps, n)
        assert sorted(a.app_id for a in listed) == sorted(expect), n
        assert len(listed) + len(left) == len(apps)


def test_an_application_is_listed_or_left_out_on_all_its_devices() -> None:
    apps = [snap("x", "GPU-1", granted_mem_mib=10), snap("x", "GPU-2", granted_mem_mib=10),  # 20 in all
            snap("y", "GPU-1", granted_mem_mib=15), snap("z", "GPU-2", granted_mem_mib=1)]
    listed, left = select_apps(apps, 1)
    assert ids(listed) == [("x", "GPU-1"), ("x", "GPU-2")]
    assert ids(left) == [("y", "GPU-1"), ("z", "GPU-2")]


def test_more_limited_applications_than_the_cap_are_all_listed() -> None:
    apps = [snap(f"l{i}", limited=True) for i in range(3)] + [snap("big", granted_mem_mib=1e5)]
    listed, left = select_apps(apps, 2)
    assert ids(listed) == [("l0", "GPU-1"), ("l1", "GPU-1"), ("l2", "GPU-1")] and ids(left) == [("big", "GPU-1")]


class _Source:
    def __init__(self, apps: list[AppSnapshot], devices: list[DeviceSnapshot]) -> None:
        self.apps, self.devices = apps, devices

    def app_snapshots(self) -> list[AppSnapshot]:
        return self.apps

    def device_snapshots(self) -> list[DeviceSnapshot]:
        return self.devices

    def counter_snapshot(self) -> CounterSnapshot:
        return CounterSnapshot()


def test_collector_sums_what_it_leaves_out_per_device() -> None:
    registry = CollectorRegistry()
    DaemonMetrics(registry, _Source(
        [snap("kept", "GPU-1", granted_mem_mib=900, grants=1),
         snap("gone", "GPU-1", granted_mem_mib=10, granted_sm_pct=20, grants=2, mem_used_mib=30),
         snap("gone", "", grants=0),  # limits only: no device
         snap("also", "GPU-1", granted_mem_mib=5, grants=1, mem_used_mib=math.nan)],
        [DeviceSnapshot("GPU-1", 1000, 915), DeviceSnapshot("GPU-2", 1000, 0)]), max_apps=1)
    get = registry.get_sample_value
    assert get("vgpu_app_granted_memory_bytes", {"app": "kept", "device": "GPU-1"}) == 900 * MIB
    assert get("vgpu_app_granted_memory_bytes", {"app": "gone", "device": "GPU-1"}) is None
    assert get("vgpu_device_apps", {"device": "GPU-1"}) == 3
    assert get("vgpu_device_apps_unlisted", {"device": "GPU-1"}) == 2
    assert get("vgpu_device_apps_unlisted", {"device": ""}) is None  # no device, no series
    assert get("vgpu_device_apps", {"device": ""}) is None
    assert get("vgpu_device_apps_unlisted", {"device": "GPU-2"}) == 0  # a series even with nothing left out
    assert get("vgpu_device_apps", {"device": "GPU-2"}) == 0
    assert get("vgpu_device_unlisted_memory_used_bytes", {"device": "GPU-1"}) == 30 * MIB  # unknown use: not summed
    assert get("vgpu_device_unlisted_memory_granted_bytes", {"device": "GPU-1"}) == 15 * MIB
    assert get("vgpu_device_unlisted_granted_sm_ratio", {"device": "GPU-1"}) == pytest.approx(0.2)
    assert get("vgpu_device_unlisted_grants", {"device": "GPU-1"}) == 3
    assert get("vgpu_metrics_max_apps") == 1


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_apps"):
        DaemonMetrics(CollectorRegistry(), _Source([], []), max_apps=-1)
