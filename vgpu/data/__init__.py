"""Data shipped with vgpu: the bundled demo trace (see ORIGIN.md beside this file)."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
DEMO_TRACE_NAME = "demo_trace.csv.gz"


def demo_trace_path() -> Path:
    """Path of the bundled multi-application demo trace (canonical format, cut from MIGPerf, MIT).

    Raises FileNotFoundError with the path when the installed package lacks it."""
    path = _HERE / DEMO_TRACE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the bundled demo trace is missing from this installation")
    return path
