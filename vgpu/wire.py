"""Columnar signature batches (`SignatureColumns` in proto/vgpu/v1/ingest.proto): encoding, and
reading with numpy; and the one-pass reading of one signature that both forms share.

A batch of many signatures costs the manager about 8 us per signature as rows (one Python pass per
message); as columns it is a handful of `numpy.frombuffer` views and vectorised checks per batch,
plus one bulk window append per application. The checks are those of the row form
(`parse_signature`, below), except that NaN is allowed and means unknown.

    msg = encode_columns(app_ids, device_ids, seq, t_s, {"mem_used_mib": mem, "sm_util_pct": sm})
    rows = read_columns(msg)            # ColumnRows: arrays, plus (row, reason) for rejected rows

The values are the window's columns, `COLUMNS`: the trace format's own (`vgpu.traces.NUMERIC`), then
the application's in-app counters (`vgpu.traces.INAPP_NUMERIC`, from `InAppCounters` in
signature.proto). An in-app value is the application's word about itself, so one that is not finite,
is negative or is above its bound (`vgpu.inapp.INAPP_MAX`) is dropped alone (NaN: not reported), with
its reason counted (`dropped`), and the signature is kept; a bad value of any other column rejects
the signature.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from vgpu.ids import all_app_ids_valid, app_id_problem
from vgpu.inapp import INAPP_MAX
from vgpu.traces import INAPP_NUMERIC, NUMERIC
from vgpu.v1 import ingest_pb2, signature_pb2

MAX_ID_CHARS = 256
# No GPU counter comes near this (a petabyte in MiB, a terawatt in W); larger values are corrupt, and
# carried through a forecast plus margin they overflow to inf.
MAX_COUNTER = 1e12
_PCT = ("sm_util_pct", "mem_util_pct")
# A memory reading may exceed its device's total memory by this share plus this many MiB and still be
# taken: a profiler turns NVML's bytes into MiB (up to 1 MiB of rounding), and the total the daemon
# holds for a device (its ledger capacity, a MIG instance's profile memory) and a process's reading
# come from different NVML calls. No reading a device can give goes past its total by more; what does
# is made up or corrupt (the manager rejects it, the node history refuses it).
MEM_OVER_TOTAL_SHARE = 0.01
MEM_OVER_TOTAL_MIB = 1.0
INAPP_PREFIX = "inapp_"
# the window's and the wire's value columns: the format's own, then the in-app counters
COLUMNS: tuple[str, ...] = NUMERIC + INAPP_NUMERIC
# each in-app column's largest sane value (the counter's bound, vgpu.inapp.INAPP_MAX)
INAPP_COLUMN_MAX: dict[str, float] = {c: INAPP_MAX[c[len(INAPP_PREFIX):]] for c in INAPP_NUMERIC}


@dataclass(frozen=True)
class ColumnRows:
    """The rows of one `SignatureColumns`, all of them (rejected ones included, see `good`)."""

    app_ids: tuple[str, ...]
    device_ids: tuple[str, ...]
    app_index: npt.NDArray[np.int64]
    device_index: npt.NDArray[np.int64]
    seq: npt.NDArray[np.uint64]
    t_s: npt.NDArray[np.float64]
    # (len(COLUMNS), rows), NaN where unknown; (len(NUMERIC), rows) when the message has no in-app column
    values: npt.NDArray[np.float64]
    good: npt.NDArray[np.bool_]
    rejected: tuple[tuple[int, str], ...]  # (row, reason), rows in order
    # (reason, how many values) for in-app values dropped from good rows (the rows are kept)
    dropped: tuple[tuple[str, int], ...] = ()

    def __len__(self) -> int:
        return len(self.t_s)


_Total = TypeVar("_Total", float, npt.NDArray[np.float64])


def mem_limit_mib(total_mib: _Total) -> _Total:
    """The largest memory reading (MiB) taken for a device of `total_mib` (see MEM_OVER_TOTAL_SHARE);
    elementwise for an array."""
    return total_mib * (1.0 + MEM_OVER_TOTAL_SHARE) + MEM_OVER_TOTAL_MIB


def encode_columns(
    app_ids: Sequence[str],
    device_ids: Sequence[str],
    seq: Sequence[int] | npt.NDArray[np.uint64],
    t_s: Sequence[float] | npt.NDArray[np.float64],
    values: Mapping[str, Sequence[float] | npt.NDArray[np.float64]],
    pids: Sequence[int] | None = None,
) -> ingest_pb2.SignatureColumns:
    """One `SignatureColumns` from per-row ids and arrays (`values`: canonical column -> per-row
    values, NaN unknown)."""
    n = len(app_ids)
    if not (len(device_ids) == len(seq) == len(t_s) == n) or any(len(v) != n for v in values.values()):
        raise ValueError("every per-row argument must have one entry per row")
    unknown = sorted(set(values) - set(COLUMNS))
    if unknown:
        raise ValueError(f"unknown value columns {unknown}; known: {', '.join(COLUMNS)}")
    apps, app_index = _table(app_ids)
    devs, dev_index = _table(device_ids)
    names = [c for c in COLUMNS if c in values]
    block = np.asarray([values[c] for c in names], dtype="<f8").reshape(len(names), n)
    return ingest_pb2.SignatureColumns(
        app_ids=apps,
        device_ids=devs,
        app_index_u32=np.asarray(app_index, dtype="<u4").tobytes(),
        device_index_u32=np.asarray(dev_index, dtype="<u4").tobytes(),
        seq_u64=np.asarray(seq, dtype="<u8").tobytes(),
        timestamp_s_f64=np.asarray(t_s, dtype="<f8").tobytes(),
        pid_u32=np.asarray(pids if pids is not None else np.zeros(n), dtype="<u4").tobytes(),
        column_names=names,
        values_f64=block.tobytes(),
    )


def _table(ids: Sequence[str]) -> tuple[list[str], list[int]]:
    """(distinct ids in first-seen order, each row's index into them)."""
    index: dict[str, int] = {}
    rows = [index.setdefault(x, len(index)) for x in ids]
    return list(index), rows


# --- one signature: checked and turned into window values in one pass ------------------------------
_PCT_FIELDS = {"sm_util_pct", "mem_bw_util_pct"}
_COL = {name: k for k, name in enumerate(COLUMNS)}
_MEM = _COL["mem_used_mib"]
_N_ALL = len(COLUMNS)


def _field_specs() -> dict[object, tuple[str, int, float, bool, float]]:
    """Each counter field: (where, window column or -1, scale, is a percentage, bound of an in-app
    counter or 0 for the others). Keyed by descriptor."""
    sig = signature_pb2.BehavioralSignature.DESCRIPTOR
    to_col = {
        ("device", "mem_total_mib"): ("mem_total_mib", 1.0),
        ("device", "power_mw"): ("power_w", 1e-3),
        ("device", "power_limit_mw"): ("power_limit_w", 1e-3),
        ("device", "mem_bw_util_pct"): ("mem_util_pct", 1.0),
        ("device", "sm_clock_mhz"): ("sm_clock_mhz", 1.0),
        ("device", "pcie_tx_kbps"): ("pcie_tx_kbps", 1.0),
        ("device", "pcie_rx_kbps"): ("pcie_rx_kbps", 1.0),
        ("process", "gpu_mem_used_mib"): ("mem_used_mib", 1.0),
        ("process", "sm_util_pct"): ("sm_util_pct", 1.0),
    }
    out: dict[object, tuple[str, int, float, bool, float]] = {}
    for part in ("device", "process", "host", "in_app"):
        message = sig.fields_by_name[part].message_type
        assert message is not None, f"BehavioralSignature.{part} is a message field"
        for fd in message.fields:
            if part == "in_app":
                col = INAPP_PREFIX + fd.name
                out[fd] = (f"in_app.{fd.name}", _COL.get(col, -1), 1.0, False, INAPP_MAX[fd.name])
                continue
            col, scale = to_col.get((part, fd.name), ("", 1.0))
            out[fd] = (f"{part}.{fd.name}", _COL[col] if col else -1, scale, fd.name in _PCT_FIELDS, 0.0)
    return out


_SPECS = _field_specs()
_INAPP_RESERVED = signature_pb2.InAppCounters.DESCRIPTOR.fields_by_name["torch_reserved_mib"]
_NAN_ROW = [math.nan] * len(COLUMNS)
_NAN_BASE = [math.nan] * len(NUMERIC)
_NAN_INAPP = [math.nan] * len(INAPP_NUMERIC)


def inapp_reason(where: str, why: str) -> str:
    """The counted reason of a dropped in-app value (no value in it: a small, fixed set of reasons)."""
    return f"{where} dropped: {why}"


def inapp_drop_reasons() -> tuple[str, ...]:
    """Every reason an in-app value can be dropped for (`inapp_reason`): each counter not finite,
    negative, or above its bound."""
    return tuple(inapp_reason(f"in_app.{name}", why) for name, bound in INAPP_MAX.items()
                 for why in ("not finite", "negative", f"above {bound:g}"))


def parse_signature(
    sig: signature_pb2.BehavioralSignature, dropped: list[str] | None = None
) -> tuple[str | None, list[float]]:
    """(why the signature is unusable or None, its window values indexed like `COLUMNS`, NaN where
    unset; only the format's columns, `NUMERIC`, when it sets no in-app counter: the common case
    costs no more than before the in-app columns). One pass over the set fields: validation and
    extraction together.

    What a signature contributes: mem_used_mib = process.gpu_mem_used_mib, else
    in_app.torch_reserved_mib; sm_util_pct = process.sm_util_pct; the device columns from the device
    fields (power in W from mW); `inapp_<name>` from in_app.<name>. An in-app value that is not finite,
    is negative or is above its bound is left out (NaN) and its reason appended to `dropped`."""
    problem = _app_id_problem(sig.app_id)
    if problem is not None:
        return problem, _NAN_ROW
    device_id = sig.device_id
    if not device_id:
        return "device_id is empty: give the GPU or MIG UUID the application runs on", _NAN_ROW
    if len(device_id) > MAX_ID_CHARS:
        return f"device_id is {len(device_id)} characters long; at most {MAX_ID_CHARS} are allowed", _NAN_ROW
    if sig.seq == 0:
        return "seq is 0: sequence numbers start at 1", _NAN_ROW
    t = sig.timestamp_s
    if not (0 < t < math.inf):
        return f"timestamp_s must be Unix seconds > 0, got {t}", _NAN_ROW
    values = _NAN_BASE.copy()
    reserved = math.nan
    specs = _SPECS
    for part_fd, part in sig.ListFields():
        if part_fd.message_type is None:
            continue
        for fd, value in part.ListFields():
            where, col, scale, pct, bound = specs[fd]
            if bound:
                if not (0.0 <= value <= bound):  # NaN fails too
                    if dropped is not None:
                        why = ("not finite" if value != value or value in (math.inf, -math.inf)
                               else "negative" if value < 0 else f"above {bound:g}")
                        dropped.append(inapp_reason(where, why))
                    continue
                if fd is _INAPP_RESERVED:
                    reserved = value
                if col >= 0 and len(values) < _N_ALL:
                    values += _NAN_INAPP
            elif value.__class__ is float:
                if not (0.0 <= value <= MAX_COUNTER):
                    if value != value or value in (math.inf, -math.inf):
                        return f"{where} is not a finite number ({value})", _NAN_ROW
                    if value > MAX_COUNTER:
                        return f"{where} is implausibly large ({value:g} > {MAX_COUNTER:g})", _NAN_ROW
                    return f"{where} is negative ({value:g})", _NAN_ROW
                if pct and value > 100.0:
                    return f"{where} is outside 0-100 ({value:g})", _NAN_ROW
            if col >= 0:
                values[col] = value * scale
    if values[_MEM] != values[_MEM]:
        values[_MEM] = reserved
    return None, values


def columns_from_signatures(
    sigs: Sequence[signature_pb2.BehavioralSignature],
) -> tuple[ingest_pb2.SignatureColumns, list[signature_pb2.BehavioralSignature]]:
    """(the usable signatures as columns, the unusable ones as they are: sent as rows, the manager
    answers each with its reason). Columns carry the window values only, in-app counters included
    (no host counters; in_app.torch_reserved_mib stands in for a missing process memory, as the
    manager reads rows; an unusable in-app value is left out)."""
    rows: list[signature_pb2.BehavioralSignature] = []
    keep: list[signature_pb2.BehavioralSignature] = []
    vals: list[list[float]] = []
    for sig in sigs:
        reason, values = parse_signature(sig)
        if reason is None:
            keep.append(sig)
            vals.append(values if len(values) == _N_ALL else values + _NAN_INAPP)
        else:
            rows.append(sig)
    block = np.asarray(vals, dtype=np.float64).reshape(len(vals), len(COLUMNS)).T
    known = [k for k in range(len(COLUMNS)) if not np.isnan(block[k]).all()]
    cols = encode_columns([s.app_id for s in keep], [s.device_id for s in keep], [s.seq for s in keep],
                          [s.timestamp_s for s in keep], {COLUMNS[k]: block[k] for k in known},
                          [s.pid for s in keep])
    return cols, rows


class ColumnsFormatError(ValueError):
    """The message's arrays do not fit together; no row of it can be read."""


def _array(data: bytes, dtype: str, what: str, n: int) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) != n * size:
        raise ColumnsFormatError(f"columns: {what} has {len(data)} bytes; {n} rows need {n * size}")
    return np.frombuffer(data, dtype=dtype)


def _app_id_problem(app_id: str) -> str | None:
    """Why a signature's application id is unusable (`app_id_problem`, vgpu/ids.py; empty or blank:
    "app_id is empty"), or None: the one check of it for rows and columns alike."""
    return "app_id is empty" if not app_id.strip() else app_id_problem(app_id)


def _bad_ids(ids: Sequence[str], what: str) -> list[str | None]:
    if what == "app_id" and all_app_ids_valid(ids):  # the usual batch: every id good, one pass
        return [None] * len(ids)
    out: list[str | None] = []
    for x in ids:
        if what == "app_id":
            out.append(_app_id_problem(x))
        elif not x.strip():
            out.append(f"{what} is empty")
        elif len(x) > MAX_ID_CHARS:
            out.append(f"{what} is {len(x)} characters long; at most {MAX_ID_CHARS} are allowed")
        else:
            out.append(None)
    return out


def read_columns(msg: ingest_pb2.SignatureColumns) -> ColumnRows:
    """Every row of `msg` with its validity; ColumnsFormatError when the arrays do not fit together
    (lengths, unknown or repeated column names)."""
    if len(msg.seq_u64) % 8:
        raise ColumnsFormatError(f"columns: seq_u64 has {len(msg.seq_u64)} bytes, not a multiple of 8")
    n = len(msg.seq_u64) // 8
    seq = _array(msg.seq_u64, "<u8", "seq_u64", n)
    t_s = _array(msg.timestamp_s_f64, "<f8", "timestamp_s_f64", n)
    app_index = _array(msg.app_index_u32, "<u4", "app_index_u32", n).astype(np.int64)
    device_index = _array(msg.device_index_u32, "<u4", "device_index_u32", n).astype(np.int64)
    if msg.pid_u32:
        _array(msg.pid_u32, "<u4", "pid_u32", n)
    names = list(msg.column_names)
    unknown = [c for c in names if c not in _COL]
    if unknown or len(set(names)) != len(names):
        raise ColumnsFormatError(f"columns: column_names must be distinct canonical names ({', '.join(COLUMNS)}); "
                                 f"got {names[:len(COLUMNS) + 1]}")
    block = _array(msg.values_f64, "<f8", "values_f64", n * len(names)).reshape(len(names), n)
    # the in-app rows only when the message has an in-app column (the windows take either)
    values = np.full((len(COLUMNS) if any(c in INAPP_COLUMN_MAX for c in names) else len(NUMERIC), n), np.nan)
    values[[_COL[c] for c in names]] = block

    apps, devs = tuple(msg.app_ids), tuple(msg.device_ids)
    reason = np.zeros(n, dtype=np.int64)  # 0: fine; else an index into `reasons`
    reasons: list[str] = [""]

    def mark(mask: npt.NDArray[np.bool_], text: str) -> None:
        hit = mask & (reason == 0)
        if hit.any():
            reasons.append(text)
            reason[hit] = len(reasons) - 1

    mark(app_index >= len(apps), f"app_index_u32 is past the {len(apps)} app_ids")
    mark(device_index >= len(devs), f"device_index_u32 is past the {len(devs)} device_ids")
    for table, index, what in ((apps, app_index, "app_id"), (devs, device_index, "device_id")):
        # each row takes its id's reason through one lookup: a batch may hold tens of thousands of bad
        # ids, and a pass over the rows per id would hold the event loop for seconds
        code = np.zeros(len(table) + 1, dtype=np.int64)  # the last entry: an index past the table
        texts: dict[str, int] = {}
        for k, why in enumerate(_bad_ids(table, what)):
            if why is not None:
                code[k] = texts.setdefault(why, len(reasons) + len(texts))
        if texts:
            row_code = code[np.minimum(index, len(table))]
            hit = (row_code > 0) & (reason == 0)
            reason[hit] = row_code[hit]
            reasons.extend(texts)
    mark(seq == 0, "seq is 0: sequence numbers start at 1")
    mark(~(t_s > 0) | ~np.isfinite(t_s), "timestamp_s must be Unix seconds > 0 and finite")
    with np.errstate(invalid="ignore"):
        for c in names:
            v = values[_COL[c]]
            if c in INAPP_COLUMN_MAX:
                continue
            mark(np.isinf(v), f"{c} is not a finite number")
            mark(v < 0, f"{c} is negative")
            mark(np.isfinite(v) & (v > MAX_COUNTER), f"{c} is implausibly large (> {MAX_COUNTER:g})")
            if c in _PCT:
                mark(v > 100.0, f"{c} is outside 0-100")
    good = reason == 0
    dropped: list[tuple[str, int]] = []
    with np.errstate(invalid="ignore"):
        for c in names:
            bound = INAPP_COLUMN_MAX.get(c)
            if bound is None:
                continue
            v = values[_COL[c]]
            where = "in_app." + c[len(INAPP_PREFIX):]
            for mask, why in ((np.isinf(v), "not finite"), (v < 0, "negative"),
                              (np.isfinite(v) & (v > bound), f"above {bound:g}")):
                hit = mask & good
                k = int(hit.sum())
                if k:
                    dropped.append((inapp_reason(where, why), k))
                    v[mask] = np.nan
    bad = np.flatnonzero(reason)
    return ColumnRows(apps, devs, app_index, device_index, seq, t_s, values, good,
                      tuple((int(i), reasons[reason[i]]) for i in bad), tuple(dropped))

