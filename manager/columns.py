"""Columnar signature batches (`SignatureColumns` in proto/vgpu/v1/ingest.proto): encoding, and
reading with numpy.

A batch of many signatures costs the manager about 8 us per signature as rows (one Python pass per
message); as columns it is a handful of `numpy.frombuffer` views and vectorised checks per batch,
plus one bulk window append per application. The checks are those of the row form
(manager/core.py `parse_signature`), except that NaN is allowed and means unknown.

    msg = encode_columns(app_ids, device_ids, seq, t_s, {"mem_used_mib": mem, "sm_util_pct": sm})
    rows = read_columns(msg)            # ColumnRows: arrays, plus (row, reason) for rejected rows
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vgpu.traces import NUMERIC
from vgpu.v1 import ingest_pb2

MAX_ID_CHARS = 256
_PCT = ("sm_util_pct", "mem_util_pct")
_COL = {name: k for k, name in enumerate(NUMERIC)}


@dataclass(frozen=True)
class ColumnRows:
    """The rows of one `SignatureColumns`, all of them (rejected ones included, see `good`)."""

    app_ids: tuple[str, ...]
    device_ids: tuple[str, ...]
    app_index: npt.NDArray[np.int64]
    device_index: npt.NDArray[np.int64]
    seq: npt.NDArray[np.uint64]
    t_s: npt.NDArray[np.float64]
    values: npt.NDArray[np.float64]  # (len(NUMERIC), rows), NaN where unknown
    good: npt.NDArray[np.bool_]
    rejected: tuple[tuple[int, str], ...]  # (row, reason), rows in order

    def __len__(self) -> int:
        return len(self.t_s)


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
    unknown = sorted(set(values) - set(NUMERIC))
    if unknown:
        raise ValueError(f"unknown value columns {unknown}; known: {', '.join(NUMERIC)}")
    apps, app_index = _table(app_ids)
    devs, dev_index = _table(device_ids)
    names = [c for c in NUMERIC if c in values]
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


class ColumnsFormatError(ValueError):
    """The message's arrays do not fit together; no row of it can be read."""


def _array(data: bytes, dtype: str, what: str, n: int) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) != n * size:
        raise ColumnsFormatError(f"columns: {what} has {len(data)} bytes; {n} rows need {n * size}")
    return np.frombuffer(data, dtype=dtype)


def _bad_ids(ids: Sequence[str], what: str) -> list[str | None]:
    out: list[str | None] = []
    for x in ids:
        if not x.strip():
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
        raise ColumnsFormatError(f"columns: column_names must be distinct canonical names ({', '.join(NUMERIC)}); "
                                 f"got {names}")
    block = _array(msg.values_f64, "<f8", "values_f64", n * len(names)).reshape(len(names), n)
    values = np.full((len(NUMERIC), n), np.nan)
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
        for k, why in enumerate(_bad_ids(table, what)):
            if why is not None:
                mark(index == k, why)
    mark(seq == 0, "seq is 0: sequence numbers start at 1")
    mark(~(t_s > 0) | ~np.isfinite(t_s), "timestamp_s must be Unix seconds > 0 and finite")
    with np.errstate(invalid="ignore"):
        for c in names:
            v = values[_COL[c]]
            mark(np.isinf(v), f"{c} is not a finite number")
            mark(v < 0, f"{c} is negative")
            if c in _PCT:
                mark(v > 100.0, f"{c} is outside 0-100")
    bad = np.flatnonzero(reason)
    return ColumnRows(apps, devs, app_index, device_index, seq, t_s, values, reason == 0,
                      tuple((int(i), reasons[reason[i]]) for i in bad))

