"""Messages a user reads, from the CLI run as a subprocess (or in-process against a real `vgpu serve`):
each names what is wrong and, where it can, what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from daemon_fixtures import ROOT, Env, Serve

from vgpu.traces import AppTrace, write_trace


def vgpu(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_daemon_answers(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    sock = ["--socket", str(env.sock)]
    r = env.vgpu("release", *sock, "--grant", "nosuchgrant", check=False)
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "UNAUTHENTICATED" not in r.stderr
    big = env.vgpu("request", *sock, "--app", "huge", "--memory-mib", "1000000", check=False)
    assert big.returncode == 1 and "RESOURCE_EXHAUSTED" in big.stderr
    assert "MiB are free (not granted to any application)" in big.stderr and "not granted\n" not in big.stderr


def test_a_garbage_token_file_is_named(env: Env, serves: list[Serve]) -> None:
    serves.append(Serve(env))
    garbage = env.tmp / "garbage.token"
    garbage.write_bytes(b"\x00\xffnot a token\n")
    for cmd in (["apps"], ["request", "--app", "x", "--memory-mib", "1"]):
        r = vgpu(*cmd, "--socket", str(env.sock), "--token-file", str(garbage), env=env.env)
        assert r.returncode == 2, r.stderr  # the token the command line names: a usage error, as for the profiler
        assert str(garbage) in r.stderr and "Invalid metadata" not in r.stderr and "INTERNAL" not in r.stderr
    r = vgpu("profiler", "--manager", str(env.sock), "--replay", str(ROOT / "vgpu" / "data" / "demo_trace.csv.gz"),
             "--token-file", str(garbage), "--seconds", "1", env=env.env)
    assert r.returncode == 2 and str(garbage) in r.stderr and "Invalid metadata" not in r.stderr
    text = env.tmp / "words.token"
    text.write_text("hello world\n")
    r = vgpu("apps", "--socket", str(env.sock), "--token-file", str(text), env=env.env)
    assert r.returncode == 2 and f"{text} does not hold a vgpu token" in r.stderr


def test_trace_info_gives_the_reasons_rows_were_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    t = np.arange(0.0, 5.0, 1.0)
    write_trace(path, [AppTrace("a", t, {"mem_used_mib": np.full(len(t), 100.0)})])
    lines = path.read_text().splitlines()
    cols = lines[0].split(",")
    bad_time = lines[1].split(",")
    bad_time[cols.index("t_s")] = "later"
    path.write_text("\n".join([*lines, ",".join(bad_time)]) + "\n")
    r = vgpu("trace", "info", str(path))
    assert r.returncode == 0, r.stderr
    assert "skipped rows: 1" in r.stdout
    listed = r.stdout.split("skipped rows: 1", 1)[1]
    assert "1  unparsable number" in listed  # the reason, counted
    assert f"{path}:{len(lines) + 1}: unparsable number" in listed  # and the row


def test_eval_says_where_it_looked_for_the_models_training_trace(tmp_path: Path) -> None:
    t = np.arange(0.0, 120.0, 1.0)
    trace = tmp_path / "t.csv"
    write_trace(trace, [AppTrace(f"app{i}", t, {"mem_used_mib": 1000 + 10 * i + np.sin(t), "sm_util_pct": np.full(len(t), 30.0)})
                        for i in range(2)])
    r = vgpu("eval", "--trace", str(trace), "--split", "all", "--methods", "model,gbdt", cwd=tmp_path,
             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert "no training data for gbdt" in r.stderr, r.stderr
    assert f"relative to the working directory {tmp_path}" in r.stderr and "--train-trace" in r.stderr
    assert str(tmp_path / "runs" / "migperf.csv.gz") in r.stderr
