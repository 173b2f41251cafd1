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


def test_every_command_help_says_what_it_does_and_points_only_at_what_a_node_has() -> None:
    """Each `vgpu COMMAND --help` has a description under its usage (the ctl commands and `vgpu
    report` had none), and none points at the development checkout's ../shared folder, which an
    installed node lacks; `vgpu eval` names the project's own doc of the trace format."""
    from vgpu.cli import COMMANDS

    for name in COMMANDS:
        r = vgpu(name, "--help")
        assert r.returncode == 0, (name, r.stderr)
        after_usage = r.stdout.split("\n\n", 1)[1]
        assert not after_usage.startswith(("options:", "positional arguments:")), (name, r.stdout)
        assert "../shared" not in r.stdout and "TRACE_FORMAT" not in r.stdout, (name, r.stdout)
    report = " ".join(vgpu("report", "--help").stdout.split())
    assert "forecast" in report and "grant" in report and "PNG, SVG or interactive HTML" in report
    evaluate = " ".join(vgpu("eval", "--help").stdout.split())
    assert "docs/evaluation.md" in evaluate and "t_s, app" in evaluate
    assert "## The trace format" in (ROOT / "docs" / "evaluation.md").read_text()
    assert "default v5, the shipped model's" in " ".join(vgpu("train", "--help").stdout.split())


def test_help_of_a_command_by_name_as_git_help() -> None:
    """`vgpu help apps` is `vgpu apps --help`; `vgpu help` of a command that is not one says so (2)."""
    by_name, by_flag = vgpu("help", "apps"), vgpu("apps", "--help")
    assert by_name.returncode == 0 and by_name.stdout == by_flag.stdout and "--all" in by_name.stdout
    assert "vgpu help COMMAND" in vgpu("help").stdout
    typo = vgpu("help", "ap")
    assert typo.returncode == 2 and typo.stdout == "" and typo.stderr.startswith("vgpu: unknown command 'ap'")
