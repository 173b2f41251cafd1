"""bench/zoo: the jobs run (on the CPU, tiny, as a smoke test); run.py refuses unknown jobs. Recording
them needs a GPU (bench/zoo/README.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ZOO = Path(__file__).resolve().parent.parent / "bench" / "zoo"


@pytest.mark.parametrize(
    "args",
    [
        ["gpt_train.py", "--layers", "1", "--width", "64", "--vocab", "50", "--batch", "2", "--context", "8",
         "--max-context", "16", "--grow-every-s", "0.5"],
        ["transformer_infer.py", "--layers", "1", "--width", "64", "--rate", "100"],
    ],
)
def test_zoo_job_runs_on_the_cpu(tmp_path: Path, args: list[str]) -> None:
    r = subprocess.run([sys.executable, str(ZOO / args[0]), *args[1:], "--device", "cpu", "--seconds", "1.5",
                        "--inapp-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr


def test_run_refuses_unknown_jobs() -> None:
    r = subprocess.run([sys.executable, str(ZOO / "run.py"), "--only", "nope"], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2 and "unknown jobs" in r.stderr
