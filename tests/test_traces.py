"""The canonical trace format: parsing rules, bad rows, the 1 s grid of the evaluation protocol."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from vgpu.traces import HEADER, AppTrace, TraceFormatError, one_second_grid, read_trace, write_trace


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_reads_interleaved_apps_and_ignores_unknown_columns(tmp_path: Path) -> None:
    p = _write(
        tmp_path / "t.csv",
        "t_s,app,mem_used_mib,sm_util_pct,extra\n0,a,10,5,x\n0,b,20,,y\n1,a,11,6,z\n1.5,b,,50,w\n",
    )
    trace = read_trace(p)
    assert set(trace.apps) == {"a", "b"}
    assert trace.apps["a"].column("mem_used_mib").tolist() == [10, 11]
    b = trace.apps["b"]
    assert np.isnan(b.column("sm_util_pct")[0]) and b.column("sm_util_pct")[1] == 50
    assert np.isnan(b.column("power_w")).all()
    assert trace.issues == []


def test_bad_rows_are_reported_with_line_and_skipped(tmp_path: Path) -> None:
    p = _write(
        tmp_path / "t.csv",
        "t_s,app,mem_used_mib,sm_util_pct\n"
        "0,a,10,5\n"  # 2 ok
        "1,a,abc,5\n"  # 3 unparsable
        "2,a,-1,5\n"  # 4 negative
        "3,a,10,150\n"  # 5 pct out of range
        "4,a,,\n"  # 6 no target
        "-1,a,10,5\n"  # 7 back in time
        ",a,10,5\n"  # 8 empty t_s
        "5,a,12,7\n",  # 9 ok
    )
    trace = read_trace(p)
    assert [i.line for i in trace.issues] == [3, 4, 5, 6, 7, 8]
    assert "back in time" in trace.issues[4].reason
    assert trace.apps["a"].t_s.tolist() == [0, 5]
    with pytest.raises(TraceFormatError, match=r"t\.csv:3"):
        read_trace(p, strict=True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("app,mem_used_mib\na,1\n", "t_s"),
        ("t_s,app,power_w\n0,a,1\n", "neither target"),
        ("t_s,app,mem_used_mib\n0,a,x\n", "no usable row"),
    ],
)
def test_unusable_files_are_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        read_trace(_write(tmp_path / "t.csv", text))


def test_missing_and_corrupt_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no such file"):
        read_trace(tmp_path / "absent.csv")
    (tmp_path / "bad.csv.gz").write_bytes(b"not gzip at all")
    with pytest.raises(TraceFormatError, match="cannot read"):
        read_trace(tmp_path / "bad.csv.gz")


def test_gzip_round_trip(tmp_path: Path) -> None:
    app = AppTrace(
        app="x",
        t_s=np.array([0.0, 0.1, 0.2]),
        columns={"mem_used_mib": np.array([1.0, 2.0, np.nan]), "sm_util_pct": np.array([0.0, 50.0, 100.0])},
        gpu="GPU-1",
    )
    n = write_trace(tmp_path / "t.csv.gz", [app])
    assert n == 3
    with gzip.open(tmp_path / "t.csv.gz", "rt") as fh:
        assert fh.readline().startswith("t_s,app,gpu,mem_used_mib,sm_util_pct")
    back = read_trace(tmp_path / "t.csv.gz").apps["x"]
    assert back.gpu == "GPU-1"
    np.testing.assert_array_equal(back.column("sm_util_pct"), [0, 50, 100])
    assert np.isnan(back.column("mem_used_mib")[2])


def test_one_second_grid_means_and_carries_forward() -> None:
    app = AppTrace(
        app="x",
        t_s=np.array([10.0, 10.5, 11.2, 14.9]),
        columns={"mem_used_mib": np.array([2.0, 4.0, 7.0, 1.0])},
    )
    secs, vals = one_second_grid(app, "mem_used_mib")
    assert secs.tolist() == [10, 11, 12, 13, 14]
    assert vals.tolist() == [3.0, 7.0, 7.0, 7.0, 1.0]
    empty_secs, empty_vals = one_second_grid(app, "sm_util_pct")
    assert len(empty_secs) == 0 and len(empty_vals) == 0


def test_extra_columns_and_metadata_round_trip(tmp_path: Path) -> None:
    """In-app columns and a `#meta` line survive write -> read; a trace without them is written with
    the format's header only."""
    t = np.array([0.0, 0.1, 0.2])
    app = AppTrace(
        "a",
        t,
        {"mem_used_mib": np.array([1.0, 2.0, 3.0]), "inapp_requests_running": np.array([0.0, 4.0, np.nan])},
        gpu="g0",
    )
    p = tmp_path / "t.csv.gz"
    write_trace(p, [app], metadata={"generator": "x", "inputs": [{"path": "p", "license": "MIT"}]})
    trace = read_trace(p, strict=True)
    assert trace.metadata == {"generator": "x", "inputs": [{"path": "p", "license": "MIT"}]}
    got = trace.apps["a"].column("inapp_requests_running")
    assert got[:2].tolist() == [0.0, 4.0] and np.isnan(got[2])
    plain = tmp_path / "plain.csv"
    write_trace(plain, [AppTrace("b", t, {"mem_used_mib": np.ones(3)})])
    assert plain.read_text().splitlines()[0] == ",".join(HEADER)


def test_comment_lines_before_header_are_skipped_and_bad_metadata_reported(tmp_path: Path) -> None:
    p = _write(
        tmp_path / "t.csv",
        '# a comment\n#meta {"a": 1}\n#meta [1]\n#meta {bad\nt_s,app,mem_used_mib\n0,a,1\n1,a,x\n',
    )
    trace = read_trace(p)
    assert trace.metadata == {"a": 1}
    assert [(i.line, "metadata" in i.reason) for i in trace.issues] == [(3, True), (4, True), (7, False)]
    with pytest.raises(TraceFormatError, match=r"t\.csv:3"):
        read_trace(p, strict=True)


def test_extra_columns_are_validated(tmp_path: Path) -> None:
    p = _write(tmp_path / "t.csv", "t_s,app,mem_used_mib,inapp_kv_used_mib,dev_sm_util_pct\n0,a,1,-2,\n1,a,1,,120\n2,a,1,3,50\n")
    trace = read_trace(p)
    assert [i.line for i in trace.issues] == [2, 3]
    assert trace.apps["a"].column("inapp_kv_used_mib").tolist() == [3.0]
