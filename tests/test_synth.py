"""Derived series: the serving engine model and the training-job composer, through `vgpu trace synth`
as a user runs it, on small cuts of the permitted datasets (tests/fixtures/synth_data)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vgpu.offline import synth_serving, synth_training
from vgpu.traces import read_trace

DATA = Path(__file__).parent / "fixtures" / "synth_data"
SERVING_DATA = DATA / "llm-serving-requests"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", "trace", *args], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.parametrize("memory", ["dynamic", "pool"])
def test_serving_cli_is_deterministic_valid_and_physical(tmp_path: Path, memory: str) -> None:
    outs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.csv.gz"
        r = _cli("synth", "--kind", "serving", "--service", "azure-code", "--data", str(DATA), "--replicas", "2",
                 "--memory", memory, "--seed", "3", "--out", str(out))
        assert r.returncode == 0, r.stderr
        outs.append(out)
    assert outs[0].read_bytes() == outs[1].read_bytes()  # same seed: the same bytes (gzip without a time)
    trace = read_trace(outs[0], strict=True)  # every row valid by the reader
    assert trace.metadata["derived"] is True and trace.metadata["engine"]["memory"] == memory
    assert {i["license"] for i in trace.metadata["inputs"]} == {"CC-BY-4.0", "MIT"}
    assert len(trace.apps) == 2
    for app in trace.apps.values():
        mem, total = app.column("mem_used_mib"), app.column("mem_total_mib")
        kv, pool = app.column("inapp_kv_used_mib"), app.column("inapp_kv_total_mib")
        assert np.all(mem <= total) and np.all(mem >= 0)
        ok = np.isfinite(kv)
        assert ok.any() and np.all(kv[ok] <= pool[ok] + 1e-6)
        assert np.all((app.column("sm_util_pct") >= 0) & (app.column("sm_util_pct") <= 100))
        assert np.nanmax(app.column("inapp_requests_running")) <= 64
        assert np.all(app.column("power_w") <= app.column("power_limit_w") + 1e-6)
        assert np.all(np.diff(app.t_s) > 0)
        if memory == "pool":  # flat once serving; the counter moves
            serving = np.isfinite(kv)
            assert np.ptp(mem[serving]) < 1e-6 and np.ptp(kv[serving]) > 0
        else:
            assert np.ptp(kv[ok]) > 0
            np.testing.assert_allclose(mem - 1200.0, app.column("inapp_torch_reserved_mib"))


def test_other_seed_changes_the_series(tmp_path: Path) -> None:
    cfg = synth_serving.EngineConfig()
    a, _ = synth_serving.synthesize(SERVING_DATA, "azure-code", cfg, replicas=1, seed=1)
    b, _ = synth_serving.synthesize(SERVING_DATA, "azure-code", cfg, replicas=1, seed=2)
    assert not np.array_equal(a[0].column("mem_used_mib")[:500], b[0].column("mem_used_mib")[:500])


def test_requests_are_kept_and_dealt_in_turn() -> None:
    reqs = synth_serving.load_requests(SERVING_DATA / "azure-llm-2023/AzureLLMInferenceTrace_code.csv.gz")
    assert len(reqs) == 150 and reqs[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    _, meta = synth_serving.synthesize(SERVING_DATA, "azure-code", synth_serving.EngineConfig(), replicas=3, seed=0)
    counts = [r["requests"] for r in meta["per_replica"]]
    assert counts == [50, 50, 50]
    assert all(r["finished"] + r["dropped"] == r["requests"] for r in meta["per_replica"])


def test_full_cache_stops_admission() -> None:
    """A tiny cache (high memory utilisation taken away) makes requests wait for blocks."""
    perf = synth_serving.load_perf(SERVING_DATA / "splitwise-perf/perf_model.csv.gz", "llama2-70b", "a100-80gb", 2)
    cfg = synth_serving.EngineConfig(gpu_memory_utilization=0.86)
    assert 0 < cfg.kv_blocks < 1200
    reqs = [synth_serving.Request(0.01 * i, 1500, 300) for i in range(40)]
    trace, stats = synth_serving.serve_series("x", reqs, cfg, perf, seed=0)
    assert stats.cache_full_steps > 0 and stats.finished == 40
    kv, pool = trace.column("inapp_kv_used_mib"), trace.column("inapp_kv_total_mib")
    ok = np.isfinite(kv)
    assert np.nanmax(kv) <= pool[ok][0] + 1e-6
    assert np.nanmax(trace.column("inapp_requests_waiting")) > 0


def test_a_prompt_that_never_fits_is_dropped() -> None:
    perf = synth_serving.load_perf(SERVING_DATA / "splitwise-perf/perf_model.csv.gz", "llama2-70b", "a100-80gb", 2)
    cfg = synth_serving.EngineConfig()
    huge = cfg.kv_blocks * synth_serving.BLOCK_TOKENS + 10
    _, stats = synth_serving.serve_series("x", [synth_serving.Request(0, huge, 5), synth_serving.Request(1, 100, 5)],
                                          cfg, perf, seed=0)
    assert stats.dropped == 1 and stats.finished == 1


def test_perf_table_without_the_configuration_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no measured rows"):
        synth_serving.load_perf(SERVING_DATA / "splitwise-perf/perf_model.csv.gz", "bloom-176b", "a100-80gb", 8)
    out = tmp_path / "x.csv.gz"
    r = _cli("synth", "--kind", "serving", "--service", "azure-code", "--data", str(DATA), "--tp", "8", "--out", str(out))
    assert r.returncode == 1 and "no measured rows" in r.stderr and not out.exists()


def test_kv_bytes_follow_the_architecture() -> None:
    # llama2-70b: 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 320 KiB per token; TP 2 halves it
    assert synth_serving.EngineConfig(tp=1).kv_bytes_per_token == 80 * 8 * 128 * 2 * 2
    assert synth_serving.EngineConfig(tp=2).kv_bytes_per_token == 80 * 4 * 128 * 2 * 2
    assert synth_serving.EngineConfig(tp=8).kv_bytes_per_token == 80 * 1 * 128 * 2 * 2


def test_mooncake_requests_read() -> None:
    reqs = synth_serving.load_requests(SERVING_DATA / "mooncake-fast25/conversation_trace.jsonl.gz")
    assert len(reqs) == 30 and reqs[0].prompt_tokens == 6758 and reqs[0].output_tokens == 500


def test_training_cli_is_deterministic_valid_and_has_phases(tmp_path: Path) -> None:
    outs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.csv.gz"
        r = _cli("synth", "--kind", "training", "--jobs", "6", "--data", str(DATA), "--seed", "5", "--out", str(out), "--json")
        assert r.returncode == 0, r.stderr
        outs.append(out)
    assert outs[0].read_bytes() == outs[1].read_bytes()
    meta = json.loads(r.stdout)
    assert meta["derived"] and len(meta["jobs"]) == 6
    trace = read_trace(outs[0], strict=True)
    assert trace.metadata["generator"] == synth_training.GENERATOR
    for app in trace.apps.values():
        mem, sm = app.column("mem_used_mib"), app.column("sm_util_pct")
        assert np.all(mem <= app.column("mem_total_mib")) and np.all((sm >= 0) & (sm <= 100))
        assert mem[0] > 0 and sm[0] == 0  # launch: context, idle
        assert mem[-1] == 0  # teardown: the process has gone
        peak = int(np.argmax(mem))
        assert mem[peak] > 2 * mem[0]  # a ramp from the context to the working set
        assert np.all(app.column("power_w") <= app.column("power_limit_w") + 1e-9)
        step, reserved = app.column("inapp_step"), app.column("inapp_torch_reserved_mib")
        live = np.isfinite(step)
        assert live[0] and not live[-1]  # counters while the process lives, none after it exits
        assert np.all(np.diff(step[live]) >= 0) and step[live][-1] > 10
        np.testing.assert_allclose(reserved[live], mem[live] - mem[0], atol=1e-5)  # NVML = context + reserve


def test_training_profiles_from_each_source() -> None:
    cat = synth_training.Catalogue.load(DATA)
    assert {p.source for p in cat.profiles} == {"migperf-a100-mig", "miso-a100-mig", "gpumemnet-mlp"}
    assert all(p.peak_mem_mib > 0 and p.mem_total_mib > 0 for p in cat.profiles)
    with pytest.raises(ValueError, match="unknown profile source"):
        synth_training.Catalogue.load(DATA, ["nope"])


def test_missing_data_is_an_error(tmp_path: Path) -> None:
    r = _cli("synth", "--kind", "training", "--jobs", "2", "--data", str(tmp_path), "--out", str(tmp_path / "o.csv"))
    assert r.returncode == 1 and "synth" in r.stderr
    r = _cli("synth", "--kind", "serving", "--service", "azure-code", "--data", str(tmp_path), "--out", str(tmp_path / "o.csv"))
    assert r.returncode == 1


@pytest.mark.shared_data
def test_real_azure_code_first_minutes_are_served(shared_data: Path) -> None:
    apps, meta = synth_serving.synthesize(shared_data / "llm-serving-requests", "azure-code",
                                          synth_serving.EngineConfig(), max_requests=400, seed=0)
    assert sum(r["finished"] for r in meta["per_replica"]) == 400
    assert all(np.nanmax(a.column("mem_used_mib")) <= 81920 for a in apps)


def test_serving_without_a_service_says_which_services_exist(tmp_path: Path) -> None:
    r = _cli("synth", "--kind", "serving", "--out", str(tmp_path / "x.csv"))
    assert r.returncode == 2 and not (tmp_path / "x.csv").exists()
    assert "--kind serving needs --service (azure-conv, azure-code, mooncake)" in r.stderr
    assert r.stderr.startswith("usage: vgpu trace synth"), r.stderr  # the command's own usage, not its parent's
