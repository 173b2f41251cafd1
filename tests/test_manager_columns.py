"""Columnar signature batches (vgpu/wire.py): the manager reads them like rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from manager_fakes import EwmaMarginForecaster

from vgpu.manager.core import Manager
from vgpu.manager.window import WindowStore
from vgpu.v1 import ingest_pb2
from vgpu.v1 import signature_pb2 as spb
from vgpu.wire import ColumnsFormatError, columns_from_signatures, encode_columns, read_columns

GPU = "GPU-0"


def _manager(**kw: object) -> Manager:
    return Manager(None, EwmaMarginForecaster(), clock=lambda: 2000.0, min_samples=1, **kw)  # type: ignore[arg-type]


def _rows(n_apps: int, per_app: int) -> tuple[list[str], list[int], list[float], list[float], list[float]]:
    apps, seq, t, mem, sm = [], [], [], [], []
    for r in range(per_app):
        for a in range(n_apps):
            apps.append(f"app{a}")
            seq.append(r + 1)
            t.append(1000.0 + r * 0.1)
            mem.append(100.0 * a + r)
            sm.append(math.nan if r % 3 == 0 else float(r % 100))
    return apps, seq, t, mem, sm


def test_columns_and_rows_give_the_same_windows() -> None:
    apps, seq, t, mem, sm = _rows(5, 90)  # past the window's first capacity (64)
    by_rows, by_cols = _manager(), _manager()
    sigs = []
    for a, s, ts, m, u in zip(apps, seq, t, mem, sm, strict=True):
        sig = spb.BehavioralSignature(app_id=a, device_id=GPU, seq=s, timestamp_s=ts)
        sig.process.gpu_mem_used_mib = m
        if not math.isnan(u):
            sig.process.sm_util_pct = u
        sigs.append(sig)
    r1 = by_rows.accept(ingest_pb2.SignatureBatch(tick=1, signatures=sigs))
    cols = encode_columns(apps, [GPU] * len(apps), seq, t, {"mem_used_mib": mem, "sm_util_pct": sm})
    r2 = by_cols.accept(ingest_pb2.SignatureBatch(tick=1, columns=cols))
    assert r1.accepted == r2.accepted == len(apps) and not r2.rejected
    for a in set(apps):
        x, y = by_rows.windows.trace(a), by_cols.windows.trace(a)
        np.testing.assert_array_equal(x.t_s, y.t_s)
        for c in ("mem_used_mib", "sm_util_pct"):
            np.testing.assert_array_equal(x.column(c), y.column(c))
        assert by_cols.windows.window(a).last_seq == 90 and y.gpu == GPU
    assert by_cols.due_apps() and by_cols.stats.signatures == len(apps)


def test_bad_rows_are_rejected_with_their_index_and_the_rest_kept() -> None:
    m = _manager()
    row = spb.BehavioralSignature(app_id="r", device_id=GPU, seq=1, timestamp_s=1000.0)
    cols = encode_columns(
        ["a", "", "a", "a", "b", "x" * 300, "a"],
        [GPU] * 7,
        [1, 1, 0, 2, 1, 1, 3],
        [1000.0, 1000.0, 1000.0, -1.0, 1000.0, 1000.0, 1000.2],
        {"mem_used_mib": [1, 1, 1, 1, -5, 1, 1], "sm_util_pct": [10, 10, 10, 10, 10, 10, 150],
         "power_w": [math.inf, 1, 1, 1, 1, 1, 1]},
    )
    reply = m.accept(ingest_pb2.SignatureBatch(tick=1, signatures=[row], columns=cols))
    got = {r.index: r.reason for r in reply.rejected}
    assert sorted(got) == [1, 2, 3, 4, 5, 6, 7]  # row 0 of the columns is batch index 1
    assert "power_w is not a finite number" in got[1] and got[2] == "app_id is empty"
    assert got[3].startswith("seq is 0") and "timestamp_s" in got[4] and got[5] == "mem_used_mib is negative"
    assert "at most 256" in got[6] and got[7] == "sm_util_pct is outside 0-100"
    assert reply.accepted == 1 and m.stats.rejected == 7 and m.stats.signatures == 8
    assert m.windows.apps() == ["r"]


def test_out_of_order_rows_are_rejected_as_such_and_the_rest_windowed() -> None:
    m = _manager()
    m.accept(ingest_pb2.SignatureBatch(tick=1, columns=encode_columns(["a"], [GPU], [5], [1000.5], {})))
    cols = encode_columns(["a"] * 4, [GPU] * 4, [4, 6, 6, 7], [1000.4, 1000.6, 1000.6, 1000.7],
                          {"mem_used_mib": [1, 2, 3, 4]})
    reply = m.accept(ingest_pb2.SignatureBatch(tick=2, columns=cols))
    # row 0 is late; row 2 repeats row 1 (same seq and time): the same sample again, a duplicate
    assert reply.accepted == 2 and [r.index for r in reply.rejected] == [0]
    assert reply.rejected[0].reason.startswith("out of order") and m.stats.out_of_order == 1
    assert m.stats.duplicates == 1
    assert [s.seq for s in m.windows.window("a").samples] == [5, 6, 7]


def test_a_bulk_append_larger_than_the_window_keeps_the_newest() -> None:
    m = _manager(windows=WindowStore(max_samples=50))
    n = 130
    cols = encode_columns(["a"] * n, [GPU] * n, list(range(1, n + 1)), [1000.0 + k for k in range(n)],
                          {"mem_used_mib": [float(k) for k in range(n)]})
    assert m.accept(ingest_pb2.SignatureBatch(tick=1, columns=cols)).accepted == n
    np.testing.assert_array_equal(m.windows.trace("a").column("mem_used_mib"), np.arange(n - 50, n))


@pytest.mark.parametrize("breakage", ["seq", "time", "values", "names"])
def test_arrays_that_do_not_fit_together_reject_the_block_and_nothing_else(breakage: str) -> None:
    cols = encode_columns(["a", "a"], [GPU, GPU], [1, 2], [1000.0, 1000.1], {"mem_used_mib": [1.0, 2.0]})
    if breakage == "seq":
        cols.seq_u64 = cols.seq_u64[:-3]
    elif breakage == "time":
        cols.timestamp_s_f64 = cols.timestamp_s_f64[:8]
    elif breakage == "values":
        cols.values_f64 += b"\x00" * 8
    else:
        cols.column_names[0] = "bogus"
    with pytest.raises(ColumnsFormatError):
        read_columns(cols)
    m = _manager()
    row = spb.BehavioralSignature(app_id="r", device_id=GPU, seq=1, timestamp_s=1000.0)
    reply = m.accept(ingest_pb2.SignatureBatch(tick=1, signatures=[row], columns=cols))
    assert reply.accepted == 1 and [r.index for r in reply.rejected] == [1]
    assert reply.rejected[0].reason.startswith("columns:")


def test_encode_refuses_unknown_columns_and_ragged_rows() -> None:
    with pytest.raises(ValueError, match="unknown value columns"):
        encode_columns(["a"], [GPU], [1], [1.0], {"gpu_temp_c": [3.0]})
    with pytest.raises(ValueError, match="one entry per row"):
        encode_columns(["a", "b"], [GPU], [1], [1.0], {})


def test_columns_from_signatures_keeps_the_window_values_and_leaves_bad_ones_as_rows() -> None:
    good = []
    for k in range(1, 4):
        s = spb.BehavioralSignature(app_id="a", device_id=GPU, seq=k, timestamp_s=1000.0 + k, pid=7)
        s.in_app.torch_reserved_mib = 100.0 * k  # stands in for the process memory
        s.device.power_mw = 250_000
        good.append(s)
    bad = spb.BehavioralSignature(app_id="", device_id=GPU, seq=1, timestamp_s=1000.0)
    cols, rows = columns_from_signatures([good[0], bad, good[1], good[2]])
    assert rows == [bad]
    m = _manager()
    reply = m.accept(ingest_pb2.SignatureBatch(tick=1, signatures=rows, columns=cols))
    assert reply.accepted == 3 and [r.reason for r in reply.rejected] == ["app_id is empty"]
    trace = m.windows.trace("a")
    np.testing.assert_array_equal(trace.column("mem_used_mib"), [100.0, 200.0, 300.0])
    np.testing.assert_array_equal(trace.column("power_w"), [250.0] * 3)


def test_implausibly_large_counters_are_rejected_in_rows_and_columns() -> None:
    """Found by hypothesis: a finite but absurd memory (1.4e308 MiB) passed ingest, and the forecast plus
    margin overflowed to an infinite recommendation. Counters beyond any GPU are rejected, both forms."""
    m = _manager()
    row = spb.BehavioralSignature(app_id="b", device_id=GPU, seq=1, timestamp_s=1000.0)
    row.process.gpu_mem_used_mib = 1.4211012923812774e308
    cols = encode_columns(["c", "c"], [GPU, GPU], [1, 2], [1000.0, 1000.1],
                          {"mem_used_mib": [1.4211012923812774e308, 512.0], "sm_util_pct": [0.0, 0.0]})
    reply = m.accept(ingest_pb2.SignatureBatch(tick=1, signatures=[row], columns=cols))
    got = {r.index: r.reason for r in reply.rejected}
    assert sorted(got) == [0, 1]
    assert "implausibly large" in got[0] and "implausibly large" in got[1]
    assert reply.accepted == 1 and m.windows.apps() == ["c"]


def test_rows_and_columns_for_a_device_the_daemon_lacks_are_rejected_and_counted() -> None:
    m = _manager(device_known=lambda d: d == GPU)
    row = spb.BehavioralSignature(app_id="r", device_id="GPU-elsewhere", seq=1, timestamp_s=1000.0)
    row.process.gpu_mem_used_mib = 5.0
    cols = encode_columns(["a", "b", "a"], [GPU, "GPU-elsewhere", GPU], [1, 1, 2], [1000.0, 1000.0, 1000.1],
                          {"mem_used_mib": [1, 1, 1]})
    reply = m.accept(ingest_pb2.SignatureBatch(tick=1, signatures=[row], columns=cols))
    got = {r.index: (r.app_id, r.reason) for r in reply.rejected}
    assert sorted(got) == [0, 2]
    assert got[0][0] == "r" and got[2][0] == "b" and all("unknown device 'GPU-elsewhere'" in why for _, why in got.values())
    assert reply.accepted == 2 and m.stats.unknown_device == 2 and m.stats.rejected == 2
    assert m.windows.last_seen_s("b") is None and m.windows.last_seen_s("a") == 2000.0


def test_a_good_rows_id_is_answered_whole_since_the_edge_bounds_it() -> None:
    """A row read_columns passes has an app_index within the ids and an id of at most
    MAX_APP_ID_BYTES, within the reply's MAX_ID_CHARS: the manager answers it with the id as it is."""
    from vgpu.ids import MAX_APP_ID_BYTES
    from vgpu.wire import MAX_ID_CHARS

    assert MAX_APP_ID_BYTES <= MAX_ID_CHARS
    longest = "a" * MAX_APP_ID_BYTES
    m = _manager(device_known=lambda d: d == GPU, max_future_s=5.0)
    cols = encode_columns([longest, longest], ["GPU-elsewhere", GPU], [1, 2], [1000.0, 3000.0], {"mem_used_mib": [1, 1]})
    reply = m.accept(ingest_pb2.SignatureBatch(tick=1, columns=cols))
    got = {r.index: (r.app_id, r.reason) for r in reply.rejected}
    assert got[0][0] == got[1][0] == longest
    assert "unknown device" in got[0][1] and "ahead of the manager's clock" in got[1][1]


def test_one_row_per_application_ticks_give_the_windows_rows_give() -> None:
    """A profiler's usual columnar tick (each application once) takes the one-sample path: the same
    windows, in-app counters, pids, duplicates and out-of-order rejections as rows."""
    by_rows, by_cols = _manager(), _manager()
    n = 6
    for k in range(1, 80):  # past the window's first capacity (64)
        sigs = []
        for a in range(n):
            sig = spb.BehavioralSignature(app_id=f"app{a}", device_id=GPU, seq=k, timestamp_s=1000.0 + 0.1 * k,
                                          pid=100 + a)
            sig.process.gpu_mem_used_mib = 100.0 * a + k
            if a % 2 and k > 40:  # in-app counters from some applications, from some tick on
                sig.in_app.torch_reserved_mib = 50.0 * a + k
            sigs.append(sig)
        if k == 50:
            sigs[1] = spb.BehavioralSignature(app_id="app1", device_id=GPU, seq=k - 1, timestamp_s=1000.0 + 0.1 * (k - 1))
            sigs[1].process.gpu_mem_used_mib = 1.0  # app1's previous sample again: a duplicate
            sigs[2].timestamp_s = 1000.0  # app2 goes back in time: out of order
        r1 = by_rows.accept(ingest_pb2.SignatureBatch(tick=k, signatures=sigs))
        cols, rest = columns_from_signatures(sigs)
        assert not rest
        r2 = by_cols.accept(ingest_pb2.SignatureBatch(tick=k, columns=cols))
        assert r1.accepted == r2.accepted
        assert [(x.index, x.app_id) for x in r1.rejected] == [(x.index, x.app_id) for x in r2.rejected]
        assert all(x.reason.startswith("out of order") for x in r2.rejected)
    assert by_cols.stats.duplicates == by_rows.stats.duplicates == 1
    assert by_cols.stats.out_of_order == by_rows.stats.out_of_order == 1
    for a in range(n):
        x, y = by_rows.windows.trace(f"app{a}"), by_cols.windows.trace(f"app{a}")
        np.testing.assert_array_equal(x.t_s, y.t_s)
        assert sorted(x.columns) == sorted(y.columns)
        for c in x.columns:
            np.testing.assert_array_equal(x.column(c), y.column(c))
        assert by_cols.app_pids(f"app{a}") == [100 + a]
    assert "inapp_torch_reserved_mib" in by_cols.windows.trace("app1").columns
    assert "inapp_torch_reserved_mib" not in by_cols.windows.trace("app2").columns


def test_each_row_gets_its_own_ids_reason_among_many_bad_ids() -> None:
    """Rows take the reason of the id they name, app id before device id, whatever the number of bad
    ids in the tables (one lookup per row: a table of tens of thousands of bad ids costs one pass)."""
    app_ids = ["ok", "", "x" * 300, "a b", *(f"bad {k}" for k in range(2000))]
    device_ids = [GPU, " ", "y" * 300]
    rows = [(0, 0), (1, 0), (2, 0), (3, 1), (0, 1), (0, 2), (2003, 0), (9999, 0), (0, 0)]
    msg = ingest_pb2.SignatureColumns(
        app_ids=app_ids, device_ids=device_ids,
        app_index_u32=np.array([a for a, _ in rows], "<u4").tobytes(),
        device_index_u32=np.array([d for _, d in rows], "<u4").tobytes(),
        seq_u64=np.arange(1, len(rows) + 1, dtype="<u8").tobytes(),
        timestamp_s_f64=np.full(len(rows), 1000.0, "<f8").tobytes(),
        column_names=["mem_used_mib"], values_f64=np.ones(len(rows), "<f8").tobytes())
    got = dict(read_columns(msg).rejected)
    assert sorted(got) == [1, 2, 3, 4, 5, 6, 7]
    assert got[1] == "app_id is empty" and "at most 256" in got[2] and "'a b'" in got[3] and "'bad 1999'" in got[6]
    assert got[4] == "device_id is empty" and "at most 256" in got[5] and "past the 2004 app_ids" in got[7]
