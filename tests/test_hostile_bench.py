"""bench/abuse.py and bench/halfsent.py run end to end on a real `vgpu serve` in short runs and report
every field; the daemon's watcher and stream bounds show in what it accepted. bench/watch_fanout.py runs
in process the same way.
No speed target is asserted (docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_abuse_bench_short_run_reports_every_field() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "abuse.py"), "--n", "0", "20", "--pairs", "5", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    out = json.loads(proc.stdout)
    assert [r["n"] for r in out["rows"]] == [0, 20]
    last = out["rows"][-1]
    assert last["grants_accepted"] == 20 and last["idle_connections"] == 20
    assert 0 <= last["idle_connections_held"] <= 20 and last["new_client_served"] is True  # 20 < max_connections
    # the pile comes from one uid, 20 below its bound: none refused
    assert out["peer_credentials"] is True and out["max_connections_per_uid"] == 256
    assert last["idle_connections_refused"] == 0 and last["idle_connections_reopened"] >= 0
    assert last["watchers_accepted"] == 16  # server.max_watchers_per_caller: anonymous callers count as one
    assert any("max_watchers_per_caller" in k for k in last["refusals"])
    for r in out["rows"]:
        assert 0 < r["pair_p50_ms"] <= r["pair_p99_ms"] and r["daemon_rss_mib"] > 0
    assert isinstance(out["p99_within_2x"], bool) and isinstance(out["rss_within_100_mib"], bool)


def test_watch_fanout_bench_short_run_every_stream_gets_every_event_once_serialized() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "watch_fanout.py"), "--watchers", "3", "--pairs", "50",
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    out = json.loads(proc.stdout)
    assert out["watchers"] == 3 and out["pairs"] == 50 and out["read"] is True
    assert out["received"] == [100] and out["in_order"] is True  # 2 events a pair, to each of the 3 streams
    assert out["events_serialized"] == 100  # once per event, not once per stream
    assert out["cpu_per_pair_us_without"] >= 0 and isinstance(out["us_per_event_per_stream"], float)


def test_watch_fanout_bench_measures_the_python_part_alone() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "watch_fanout.py"), "--no-grpc", "--watchers", "2",
                           "--pairs", "20", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    out = json.loads(proc.stdout)
    assert out["no_grpc"] is True and out["watchers"] == 2 and isinstance(out["python_us_per_event_per_stream"], float)


def test_halfsent_bench_short_run_reports_every_field() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "halfsent.py"), "--connections", "2", "--calls", "20",
                           "--announce-bytes", "262144", "--push-s", "2", "--settle-s", "0.2", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(proc.stdout)
    assert out["connections"] == 2 and out["calls_per_connection"] == 20 and out["announce_bytes"] == [262144]
    # the daemon's SETTINGS bound the calls per connection: the rest are refused, none goes unaccounted
    assert out["max_streams_per_connection"] == 16 and out["streams_held"] + out["streams_refused"] == 40
    assert out["reset_codes"].get("7", 0) == 2 * (20 - 16)  # REFUSED_STREAM
    assert out["bytes_pushed_mib"] > 0 and out["rss_before_mib"] > 0 and out["rss_held_mib"] > 0
    assert out["other_client_served"] is True and out["daemon_alive"] is True
