"""`vgpu --help` as a user reads it (a subprocess): every command, `--version`, and the trace subcommands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def vgpu(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)


def test_help_lists_version_and_the_trace_subcommands() -> None:
    r = vgpu("--help")
    assert r.returncode == 0
    assert re.search(r"^\s+--version\s+\S", r.stdout, re.M), r.stdout
    (trace_line,) = [x for x in r.stdout.splitlines() if x.strip().startswith("trace ")]
    trace_help = vgpu("trace", "--help").stdout
    subcommands = re.search(r"\{([a-z,]+)\}", trace_help).group(1).split(",")  # type: ignore[union-attr]
    assert set(subcommands) == {"convert", "info", "cut", "synth"}
    for sub in subcommands:
        assert sub in trace_line, (sub, trace_line)
    version = vgpu("--version")
    assert version.returncode == 0 and version.stdout.startswith("vgpu ")
