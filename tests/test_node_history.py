"""The node's on-disk history (manager/history.py): written by the served mixture, read back, bounded,
and a corrupt or partly written segment skipped (logged once), never fatal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vgpu.manager.experts import make_served
from vgpu.manager.history import HEADER, NodeHistory
from vgpu.traces import INAPP_NUMERIC, AppTrace


class Rec:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def _add(self, event: str, **kw: object) -> None:
        self.events.append((event, kw))

    info = warning = error = debug = _add


def _rows(h: NodeHistory, app: str, secs: range, value: float = 100.0) -> None:
    n = len(secs)
    h.add([app] * n, ["GPU-0"] * n, np.array(list(secs), dtype=np.float64), np.tile([value, 50.0], (n, 1)),
          [40960.0] * n)


def test_the_mixture_writes_each_complete_second_once(tmp_path: Path) -> None:
    hist = NodeHistory(tmp_path / "h")
    served = make_served(None, history=hist)
    t = np.arange(1000.0, 1030.0, 0.5)
    mem = 1000.0 + 10 * np.floor(t - 1000)
    for k in range(1005, 1030):
        keep = t < k + 1
        served.forecast_batch([AppTrace("a", t[keep], {"mem_used_mib": mem[keep], "sm_util_pct": np.full(keep.sum(), 7.0)},
                                        gpu="GPU-x")])
    hist.close()
    (back,) = hist.read()
    assert back.app == "a" and back.gpu == "GPU-x"
    # the last forecast's origin is second 1029 (still filling): 1005..1028 are complete; the second
    # before the first origin only seeds the state and is not written
    assert back.t_s.tolist() == list(range(1005, 1029))
    np.testing.assert_allclose(back.columns["mem_used_mib"], 1000.0 + 10 * (back.t_s - 1000))
    assert (back.columns["sm_util_pct"] == 7.0).all()


def test_a_partial_last_line_and_a_corrupt_segment_are_skipped(tmp_path: Path) -> None:
    log = Rec()
    h = NodeHistory(tmp_path, segment_s=100, logger=log)  # type: ignore[arg-type]
    _rows(h, "a", range(0, 100))
    _rows(h, "a", range(100, 150))
    h.close()
    with open(tmp_path / "seg-1.csv", "a") as fh:
        fh.write("150,a,GPU-0,12")  # a crash mid-line
    (tmp_path / "seg-5.csv").write_bytes(b"\x1f\x8b\x00garbage\xff\xfe")
    (tmp_path / "seg-6.csv").write_text("")
    for _ in range(2):
        (back,) = h.read()
        assert back.t_s.tolist() == list(range(0, 150))
    skipped = [kw["path"] for e, kw in log.events if e == "history_segment_skipped"]
    assert sorted(Path(str(p)).name for p in skipped) == ["seg-5.csv", "seg-6.csv"]  # once each
    # writing goes on after the partial line, which stays one bad row
    h2 = NodeHistory(tmp_path, segment_s=100, logger=log)  # type: ignore[arg-type]
    _rows(h2, "a", range(151, 155))
    h2.close()
    (back,) = h2.read()
    assert back.t_s.tolist() == [*range(0, 150), *range(151, 155)]


def test_segments_past_the_horizon_or_over_the_cap_are_deleted(tmp_path: Path) -> None:
    h = NodeHistory(tmp_path, segment_s=100, horizon_s=300, max_bytes=10**9, prune_every_s=0)
    for seg in range(6):
        _rows(h, "a", range(seg * 100, seg * 100 + 100))
    h.close()
    assert [k for k, _ in h.segments()] == [2, 3, 4, 5]  # segments ending at or before 600 - 300: gone
    size = h.segments()[0][1].stat().st_size
    capped = NodeHistory(tmp_path, segment_s=100, horizon_s=10**6, max_bytes=2 * size + 10, prune_every_s=0)
    _rows(capped, "a", range(600, 610))
    capped.close()
    assert capped.size_bytes() <= 2 * size + 10 + size  # the open segment may sit over the cap
    assert [k for k, _ in capped.segments()][-1] == 6 and len(capped.segments()) <= 3


def test_a_write_that_fails_is_counted_and_logged_once(tmp_path: Path) -> None:
    log = Rec()
    h = NodeHistory(tmp_path / "gone", logger=log)  # type: ignore[arg-type]
    (tmp_path / "gone").rmdir()
    for _ in range(3):
        _rows(h, "a", range(0, 3))
    assert h.write_failures == 3 and [e for e, _ in log.events].count("history_write_failed") == 1


def test_bad_bounds_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        NodeHistory(tmp_path, max_bytes=0)


def test_closed_segments_are_compressed_and_read_the_same(tmp_path: Path) -> None:
    h = NodeHistory(tmp_path, segment_s=100)
    _rows(h, "a", range(0, 250))
    with open(tmp_path / "seg-0.csv", "a") as fh:
        fh.write("99.5,a,GPU-0,1")  # a crash's partial line in a closed segment
    plain = h.size_bytes()
    assert [p.name for p in h.compress_closed()] == ["seg-0.csv.gz", "seg-1.csv.gz"]  # not the open seg-2
    assert h.size_bytes() < plain / 2
    (back,) = h.read()
    assert back.t_s.tolist() == list(range(0, 250))
    # a clock step back writes into a compressed segment's range again: appended on compression
    _rows(h, "b", range(10, 12))
    assert {p.name for _, p in h.segments()} == {"seg-0.csv.gz", "seg-0.csv", "seg-1.csv.gz", "seg-2.csv"}
    assert {a.app: len(a) for a in h.read()} == {"a": 250, "b": 2}
    h.close()
    h2 = NodeHistory(tmp_path, segment_s=100)
    assert [p.name for p in h2.compress_closed()] == ["seg-0.csv.gz", "seg-2.csv.gz"]
    by_app = {a.app: a for a in h2.read()}
    assert by_app["b"].t_s.tolist() == [10, 11] and len(by_app["a"]) == 250


def _serving(t: np.ndarray, gap: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """A serving application's columns at the sample times `t`: memory, compute and in-app counters
    (none reported in the seconds [gap[0], gap[1]))."""
    k = np.floor(t)
    running = 4.0 + (k % 7) + (t - k) * 2  # two reports a second: 0.0 and 0.5 past the second
    kv = 1000.0 + 100.0 * (k % 5)
    if gap is not None:
        off = (k >= gap[0]) & (k < gap[1])
        running, kv = np.where(off, np.nan, running), np.where(off, np.nan, kv)
    return {"mem_used_mib": 30000.0 + kv, "sm_util_pct": np.full(len(t), 60.0), "mem_total_mib": np.full(len(t), 81559.0),
            "inapp_requests_running": running, "inapp_kv_used_mib": kv}


def test_the_mixture_writes_the_in_app_counters_and_the_history_reads_them_back(tmp_path: Path) -> None:
    hist = NodeHistory(tmp_path / "h")
    served = make_served(None, history=hist)
    t = np.arange(1000.0, 1040.0, 0.5)
    cols = _serving(t, gap=(1020, 1023))
    plain_t = np.arange(1000.0, 1040.0, 1.0)
    for k in range(1005, 1040):
        keep = t < k + 1
        served.forecast_batch([AppTrace("svc", t[keep], {c: v[keep] for c, v in cols.items()}, gpu="GPU-x"),
                               AppTrace("plain", plain_t[plain_t < k + 1],
                                        {"mem_used_mib": np.full(int((plain_t < k + 1).sum()), 500.0)}, gpu="GPU-x")])
    hist.close()
    back = {a.app: a for a in hist.read()}
    svc = back["svc"]
    assert svc.t_s.tolist() == list(range(1005, 1039))
    sec = svc.t_s
    want_running = np.where((sec >= 1020) & (sec < 1023), np.nan, 4.0 + (sec % 7) + 0.5)  # the mean of the second's two
    np.testing.assert_allclose(svc.columns["inapp_requests_running"], want_running)
    np.testing.assert_allclose(svc.columns["inapp_kv_used_mib"],
                               np.where((sec >= 1020) & (sec < 1023), np.nan, 1000.0 + 100.0 * (sec % 5)))
    # counters the application never reported are no column; an application without any has none
    assert not {"inapp_torch_reserved_mib", "inapp_step"} & set(svc.columns)
    assert not any(c.startswith("inapp_") for c in back["plain"].columns)


def test_an_older_segment_without_in_app_columns_reads_and_is_continued_in_its_own_columns(tmp_path: Path) -> None:
    old_header = "t_s,app,gpu,mem_used_mib,sm_util_pct,mem_total_mib\n"
    (tmp_path / "seg-0.csv").write_text(old_header + "".join(f"{s},a,GPU-0,100,50,40960\n" for s in range(0, 50)))
    h = NodeHistory(tmp_path, segment_s=100)
    running = np.arange(50, 150, dtype=np.float64)
    h.add(["a"] * 100, ["GPU-0"] * 100, np.arange(50.0, 150.0), np.tile([200.0, 50.0], (100, 1)), [40960.0] * 100,
          inapp={"inapp_requests_running": running})
    h.close()
    # the old segment keeps its header and its rows stay six cells wide; the new one has the in-app columns
    lines = (tmp_path / "seg-0.csv").read_text().splitlines()
    assert lines[0] + "\n" == old_header and all(line.count(",") == 5 for line in lines)
    assert (tmp_path / "seg-1.csv").read_text().splitlines()[0] + "\n" == HEADER
    (a,) = h.read()
    assert a.t_s.tolist() == list(range(0, 150)) and (a.column("mem_used_mib")[50:] == 200.0).all()
    got = a.columns["inapp_requests_running"]
    assert np.isnan(got[:100]).all()  # the old segment's seconds have none
    np.testing.assert_allclose(got[100:], running[50:])
    # compressing the old segment and the clock stepping back into it: the plain rows stay beside the gzip
    assert h.compress_closed() == [tmp_path / "seg-0.csv.gz"]  # seg-1 is still the one being written
    h2 = NodeHistory(tmp_path, segment_s=100)
    h2.add(["a"], ["GPU-0"], np.array([60.0]), np.array([[300.0, 50.0]]), [40960.0],
           inapp={"inapp_requests_running": np.array([9.0])})
    h2.close()
    assert (tmp_path / "seg-0.csv").read_text().splitlines()[0] + "\n" == HEADER
    assert h2.compress_closed() == [tmp_path / "seg-1.csv.gz"]
    h3 = NodeHistory(tmp_path, segment_s=100)
    assert h3.compress_closed() == [] and (tmp_path / "seg-0.csv").exists()  # headers differ: left plain
    (a,) = h3.read()
    assert len(a) == 150 and a.column("mem_used_mib")[60] == 200.0  # the first copy of a second is kept


def test_in_app_rows_stay_within_the_byte_cap(tmp_path: Path) -> None:
    h = NodeHistory(tmp_path, segment_s=100, max_bytes=30_000, prune_every_s=0.0)
    full = {c: np.full(100, 12345.0) for c in INAPP_NUMERIC}
    for seg in range(10):
        secs = np.arange(seg * 100.0, seg * 100.0 + 100.0)
        h.add(["a"] * 100, ["GPU-0"] * 100, secs, np.tile([200.0, 50.0], (100, 1)), [40960.0] * 100, inapp=full)
    h.close()
    closed = [p for k, p in h.segments() if k != 9]
    assert sum(p.stat().st_size for p in closed) <= 30_000 and len(h.segments()) < 10
    (a,) = h.read()
    assert set(INAPP_NUMERIC) <= set(a.columns)


def test_rows_with_memory_above_their_capacity_are_neither_written_nor_read(tmp_path: Path) -> None:
    log = Rec()
    h = NodeHistory(tmp_path, segment_s=100, logger=log)  # type: ignore[arg-type]
    _rows(h, "a", range(0, 5))
    _rows(h, "a", range(5, 8), value=1e12)  # a made-up reading: above the 40960 MiB the rows record
    _rows(h, "a", range(8, 10), value=40960.0)  # at the capacity: taken
    h.close()
    assert h.rows_written == 7 and h.rows_refused == 3
    # an old or damaged file holding such rows (written before the bound): left out when read
    with open(tmp_path / "seg-0.csv", "a") as fh:
        fh.write("10,a,GPU-0,1e+12,50,40960" + "," * len(INAPP_NUMERIC) + "\n")
        fh.write("11,b,GPU-0,99999,50,80000" + "," * len(INAPP_NUMERIC) + "\n")
        fh.write("12,b,GPU-0,99999,50,80000" + "," * len(INAPP_NUMERIC) + "\n")
        fh.write("13,b,GPU-0,99999,50," + "," * len(INAPP_NUMERIC) + "\n")  # no capacity: nothing to bound by
    back = {a.app: a for a in h.read()}
    assert back["a"].t_s.tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert back["a"].columns["mem_used_mib"].max() == 40960.0
    assert back["b"].t_s.tolist() == [13]
    assert h.rows_refused == 6
    refused = [kw for e, kw in log.events if e == "history_rows_refused"]
    assert len(refused) == 1 and refused[0]["mem_used_mib"] == 1e12 and refused[0]["mem_total_mib"] == 40960.0
