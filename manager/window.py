"""A bounded window of recent samples per application, built from behavioural signatures.

Pure: no I/O, no clock of its own (callers pass `now_s`). Bounds: at most `max_samples` per
application (oldest dropped) and at most `max_apps` applications (the one silent longest is evicted
to make room); `evict_idle(now_s)` drops applications silent for more than `idle_evict_s`. A sample
whose time goes back, or whose `seq` is not above the application's last one at no newer time, is
dropped and counted; a lower seq with a newer time is taken as a restarted profiler and kept.
`holds(app_id, seq, t_s)` says whether the window already has a sample (same seq and time): a profiler
resends what the manager did not acknowledge, and the manager drops such a resend quietly instead of
rejecting it as out of order.
`trace(app_id)` gives the window as a `vgpu.traces.AppTrace` for forecasters.

Values are indexed like `vgpu.wire.COLUMNS`: the format's columns, then the in-app counters
(`inapp_*`). The in-app rows are held only by the windows of applications that have reported one: a
window starts without them and gets them (NaN before) with its first in-app value, so an application
that reports none costs what it did before they existed, and one that does costs at most
`max_samples` x len(INAPP_NUMERIC) doubles more.

What a signature contributes (the canonical trace columns; unset fields are NaN):
    mem_used_mib   process.gpu_mem_used_mib, else in_app.torch_reserved_mib
    sm_util_pct    process.sm_util_pct
    mem_total_mib  device.mem_total_mib         mem_util_pct  device.mem_bw_util_pct
    power_w        device.power_mw / 1000       power_limit_w device.power_limit_mw / 1000
    sm_clock_mhz, pcie_tx_kbps, pcie_rx_kbps    the device fields of the same names
    inapp_<name>   in_app.<name> (torch_*_mib, alloc_retries, oom_count, step, requests_running,
                   requests_waiting, kv_used_mib, kv_total_mib, tokens_in_flight)
"""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from vgpu.traces import INAPP_NUMERIC, NUMERIC, AppTrace
from vgpu.v1 import signature_pb2
from vgpu.wire import COLUMNS, parse_signature

_COL = {name: i for i, name in enumerate(COLUMNS)}
_NB = len(NUMERIC)  # the format's columns come first; the in-app ones after them
_NI = len(INAPP_NUMERIC)
Values = Sequence[float] | npt.NDArray[np.float64]  # one sample's values, indexed like COLUMNS (or NUMERIC)


@dataclass(frozen=True)
class Sample:
    app_id: str
    device_id: str
    seq: int
    t_s: float
    values: tuple[float, ...]  # indexed like vgpu.wire.COLUMNS (or only vgpu.traces.NUMERIC); NaN where unknown

    def get(self, column: str) -> float:
        k = _COL[column]
        return self.values[k] if k < len(self.values) else math.nan


def sample_from_signature(sig: signature_pb2.BehavioralSignature) -> Sample:
    """The window's view of a (validated) signature: the same mapping the manager's ingest uses
    (`vgpu.wire.parse_signature`), as a Sample."""
    _, values = parse_signature(sig)
    return Sample(sig.app_id, sig.device_id, sig.seq, sig.timestamp_s, tuple(values))


class AppWindow:
    """One application's recent samples, kept as columns in a numpy ring buffer: `values` is
    (len(NUMERIC), capacity), with the sample times and seqs beside it, and the in-app counters
    (len(INAPP_NUMERIC), capacity) from the first sample that has one. The buffer starts small and
    doubles up to `max_samples`; once full, the oldest sample is overwritten. `trace()` is a slice
    copy (two when the ring has wrapped), not a rebuild. Values given to `append` / `extend` are
    indexed like vgpu.wire.COLUMNS; rows of the format's columns only (vgpu.traces.NUMERIC) are
    taken as having no in-app counter."""

    _FIRST_CAPACITY = 64

    def __init__(self, app_id: str, max_samples: int, max_span_s: float | None = None,
                 slab: _Slab | None = None) -> None:
        self.app_id = app_id
        self.max_samples = max_samples
        # `trace()` covers at most this many seconds before the latest sample: what a forecast
        # builds from it (a 1 s grid) is then bounded whatever the samples' time stamps.
        self.max_span_s = max_span_s
        self._inapp: np.ndarray | None = None  # (len(INAPP_NUMERIC), capacity) once one is reported
        # In a `WindowStore`, the ring is one slot of the store's `_Slab` (views into its arrays), so
        # that a batch with one sample per application is written with one numpy assignment.
        self._n = 0  # samples held
        self._end = 0  # where the next sample goes
        self._slab = slab
        self._slot = -1
        if slab is not None:
            self._slot = slab.take(self)
        else:
            cap = min(max_samples, self._FIRST_CAPACITY)
            self._values = np.empty((_NB, cap), dtype=np.float64)
            self._t = np.empty(cap, dtype=np.float64)
            self._seq = np.zeros(cap, dtype=np.uint64)
        self.device_id = ""
        self.last_seq = 0
        self.last_t_s = -math.inf
        self.last_seen_s = -math.inf  # caller's clock when the last sample arrived

    def __len__(self) -> int:
        return self._n

    def _view(self, values: np.ndarray, t_s: np.ndarray, seq: np.ndarray) -> None:
        """Point the ring at its slot of the store's arrays (new ones after the slab grew)."""
        self._values, self._t, self._seq = values, t_s, seq
        cap = len(t_s)
        if self._n < cap:  # not wrapped (the slab grows only below max_samples): samples at [0, n)
            self._end = self._n
            if self._inapp is not None and self._inapp.shape[1] < cap:
                self._inapp = np.concatenate([self._inapp[:, : self._n], np.empty((_NI, cap - self._n))], axis=1)

    def _detach(self) -> None:
        """Leave the store's slab (the window was evicted): the ring becomes a copy of its own, so
        the slot can serve another application while this object still reads as it did."""
        if self._slab is not None:
            self._values, self._t, self._seq = self._values.copy(), self._t.copy(), self._seq.copy()
            self._slab = None
            self._slot = -1

    def _grow(self, need: int) -> int:
        """Room for `need` more samples, up to `max_samples`; returns the capacity. Before the
        capacity reaches `max_samples` the ring has not wrapped: samples sit at [0, n)."""
        cap = len(self._t)
        if self._n + need > cap and cap < self.max_samples:
            new = min(self.max_samples, max(2 * cap, self._n + need))
            if self._slab is not None:  # every window of the store grows with it (none has wrapped)
                self._slab.grow_capacity(new)
                return new
            self._values = np.concatenate([self._values[:, : self._n], np.empty((_NB, new - self._n))], axis=1)
            if self._inapp is not None:
                self._inapp = np.concatenate([self._inapp[:, : self._n], np.empty((_NI, new - self._n))], axis=1)
            self._t = np.concatenate([self._t[: self._n], np.empty(new - self._n)])
            self._seq = np.concatenate([self._seq[: self._n], np.zeros(new - self._n, dtype=np.uint64)])
            self._end = self._n % new
            cap = new
        return cap

    def _inapp_rows(self, inapp: np.ndarray | None) -> np.ndarray | None:
        """The in-app block to write `inapp` into (made, NaN, at the first in-app value), or None
        when there is nothing to keep."""
        if self._inapp is None:
            if inapp is None or not np.isfinite(inapp).any():
                return None
            self._inapp = np.full((_NI, len(self._t)), np.nan)
        return self._inapp

    def extend(self, device_id: str, seq: np.ndarray, t_s: np.ndarray, values: np.ndarray) -> None:
        """Append many samples at once (`values`: (len(COLUMNS) or len(NUMERIC), m)); already checked
        in order."""
        m = len(t_s)
        if not m:
            return
        cap = self._grow(m)
        if m > cap:
            seq, t_s, values, m = seq[-cap:], t_s[-cap:], values[:, -cap:], cap
        inapp = values[_NB:] if len(values) > _NB else None
        block = self._inapp_rows(inapp)
        i = self._end
        first = min(m, cap - i)
        self._values[:, i:i + first] = values[:_NB, :first]
        if block is not None:
            block[:, i:i + first] = inapp[:, :first] if inapp is not None else np.nan
        self._t[i:i + first] = t_s[:first]
        self._seq[i:i + first] = seq[:first]
        if first < m:
            self._values[:, : m - first] = values[:_NB, first:]
            if block is not None:
                block[:, : m - first] = inapp[:, first:] if inapp is not None else np.nan
            self._t[: m - first] = t_s[first:]
            self._seq[: m - first] = seq[first:]
        self._end = (i + m) % cap
        self._n = min(self._n + m, cap)
        self.device_id = device_id
        self.last_seq, self.last_t_s = int(seq[-1]), float(t_s[-1])

    def append(self, device_id: str, seq: int, t_s: float, values: Values) -> None:
        cap = self._grow(1)
        i = self._end
        # one sample at a time is the rows path's hot loop: plain slices, and numpy only where the
        # application has in-app counters
        has_inapp = len(values) > _NB
        self._values[:, i] = values[:_NB] if has_inapp else values
        block = self._inapp
        if block is None and has_inapp and any(x == x for x in values[_NB:]):  # a first value (x == x: not NaN)
            block = self._inapp = np.full((_NI, len(self._t)), np.nan)
        if block is not None:
            block[:, i] = values[_NB:] if has_inapp else np.nan
        self._t[i] = t_s
        self._seq[i] = seq
        self._end = (i + 1) % cap
        self._n = min(self._n + 1, cap)
        self.device_id = device_id
        self.last_seq, self.last_t_s = seq, t_s

    def _order(self) -> tuple[slice, slice | None]:
        cap = len(self._t)
        if self._n < cap:
            return slice(0, self._n), None
        return slice(self._end, cap), slice(0, self._end)

    def _take(self, arr: np.ndarray) -> np.ndarray:
        a, b = self._order()
        return arr[..., a].copy() if b is None else np.concatenate([arr[..., a], arr[..., b]], axis=-1)

    def has(self, seq: np.ndarray, t_s: np.ndarray) -> np.ndarray:
        """Which of these (seq, time) pairs are samples in the window: one pass over the window, for
        the rare samples that are not past its last one."""
        order = np.argsort(self._seq[: self._n], kind="stable")
        by_seq, t_by_seq = self._seq[order], self._t[order]
        lo = np.searchsorted(by_seq, seq, "left")
        hi = np.searchsorted(by_seq, seq, "right")
        out = np.zeros(len(seq), dtype=bool)
        one = hi - lo == 1
        out[one] = t_by_seq[lo[one]] == t_s[one]
        for i in np.flatnonzero(hi - lo > 1).tolist():  # a seq held twice: the profiler restarted
            out[i] = bool((t_by_seq[lo[i]:hi[i]] == t_s[i]).any())
        return out

    @property
    def has_inapp(self) -> bool:
        """Whether the application has reported an in-app counter while this window existed."""
        return self._inapp is not None

    def _column_at(self, i: int) -> list[float]:
        out: list[float] = self._values[:, i].tolist()
        inapp: list[float] = self._inapp[:, i].tolist() if self._inapp is not None else [math.nan] * _NI
        return out + inapp

    def latest(self) -> Sample | None:
        if not self._n:
            return None
        i = (self._end - 1) % len(self._t)
        return Sample(self.app_id, self.device_id, int(self._seq[i]), float(self._t[i]), tuple(self._column_at(i)))

    def latest_value(self, column: str) -> float:
        """The newest sample's value of `column` (NaN when none)."""
        if not self._n:
            return math.nan
        k, i = _COL[column], (self._end - 1) % len(self._t)
        if k < _NB:
            return float(self._values[k, i])
        return float(self._inapp[k - _NB, i]) if self._inapp is not None else math.nan

    def _data(self) -> np.ndarray:
        """All columns, oldest sample first (in-app rows NaN when the window has none)."""
        data = self._take(self._values)
        inapp = self._take(self._inapp) if self._inapp is not None else np.full((_NI, self._n), np.nan)
        return np.concatenate([data, inapp])

    @property
    def samples(self) -> list[Sample]:
        """The window as `Sample`s, oldest first (a copy; for inspection, not the hot path)."""
        data, t, seq = self._data(), self._take(self._t), self._take(self._seq)
        return [Sample(self.app_id, self.device_id, int(seq[k]), float(t[k]), tuple(float(v) for v in data[:, k]))
                for k in range(self._n)]

    def trace(self) -> AppTrace:
        """The window as an AppTrace: each column with a value in it (the in-app counters among
        them: what feature encoding v4 reads, with a presence flag where they are present)."""
        data, t = self._take(self._values), self._take(self._t)
        inapp = self._take(self._inapp) if self._inapp is not None else None
        if self.max_span_s is not None and self._n and t[-1] - t[0] > self.max_span_s:
            first = int(np.searchsorted(t, t[-1] - self.max_span_s, side="left"))  # samples are in time order
            data, t = data[:, first:], t[first:]
            inapp = inapp[:, first:] if inapp is not None else None
        finite = ~np.isnan(data).all(axis=1) if self._n else np.zeros(_NB, dtype=bool)
        columns = {c: data[k] for k, c in enumerate(NUMERIC) if finite[k]}
        if inapp is not None and self._n:
            some = ~np.isnan(inapp).all(axis=1)
            columns.update({c: inapp[k] for k, c in enumerate(INAPP_NUMERIC) if some[k]})
        return AppTrace(self.app_id, t, columns, gpu=self.device_id or None)


def _mapped(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
    """A zeroed array in an anonymous memory map of its own: its pages take memory only once written
    (a slot or a ring's tail not yet used costs nothing), and they go back to the system when the
    array is dropped, instead of leaving a hole in the C heap (glibc keeps arrays under its 16 MiB
    mmap threshold, manager/heap.py, in the heap)."""
    count = int(np.prod(shape))
    size = count * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=dtype, count=count).reshape(shape)


class _Slab:
    """The rings of every window of a store in three arrays, one slot (row) per application:
    values (slots, len(NUMERIC), capacity), times and seqs (slots, capacity). The capacity is
    shared: it starts at `first_cap` (`max_samples` where the store maps the slab whole) and
    doubles up to `max_samples` when a window
    needs more (no ring has wrapped before it reaches `max_samples`, so the samples keep their
    places); the slots grow by a quarter, up to `max_apps`, as applications arrive, and an evicted
    application's slot is taken by the next one. The arrays are memory maps (`_mapped`): only the
    pages written hold memory, so the store holds what its windows' samples need, as separate
    windows would, except that the slots are not given back: it keeps the pages of the most
    applications it has held at once."""

    _FIRST_SLOTS = 8

    def __init__(self, max_samples: int, max_apps: int, first_cap: int, first_slots: int) -> None:
        self.max_samples = max_samples
        self.max_apps = max_apps
        self.cap = min(max_samples, first_cap)
        self.values = _mapped((0, _NB, self.cap), np.float64)
        self.t = _mapped((0, self.cap), np.float64)
        self.seq = _mapped((0, self.cap), np.uint64)
        self.owner: list[AppWindow | None] = []
        self._free: list[int] = []
        if first_slots:
            self._resize(first_slots, self.cap)

    def take(self, win: AppWindow) -> int:
        """A slot for `win` (its ring pointed at it)."""
        if not self._free:
            # a quarter more (slots are never given back: a node whose applications come and go keeps
            # what its busiest moment held, so the step is kept small), at most max_apps
            old = len(self.owner)
            new = old + max(self._FIRST_SLOTS, old // 4)
            if old >= self.max_apps:  # a store holds at most max_apps; one more is a window left over
                new = old + 1
            elif new > self.max_apps:
                new = self.max_apps
            self._resize(new, self.cap)
        slot = self._free.pop()
        self.owner[slot] = win
        win._view(self.values[slot], self.t[slot], self.seq[slot])
        return slot

    def give_back(self, win: AppWindow) -> None:
        """`win` leaves (evicted): it keeps a copy of its samples, its slot is free."""
        slot = win._slot
        win._detach()
        self.owner[slot] = None
        self._free.append(slot)

    def grow_capacity(self, cap: int) -> None:
        self._resize(len(self.owner), cap)

    def _resize(self, slots: int, cap: int) -> None:
        old_slots = len(self.owner)
        values = _mapped((slots, _NB, cap), np.float64)
        t = _mapped((slots, cap), np.float64)
        seq = _mapped((slots, cap), np.uint64)
        # each window's samples: at [0, n) (a ring wraps only at max_samples, where it is full)
        for slot, win in enumerate(self.owner):
            if win is not None and win._n:
                n = win._n
                values[slot, :, :n] = self.values[slot, :, :n]
                t[slot, :n] = self.t[slot, :n]
                seq[slot, :n] = self.seq[slot, :n]
        self.values, self.t, self.seq, self.cap = values, t, seq, cap
        # free slots are taken lowest first
        self._free = sorted([*self._free, *range(old_slots, slots)], reverse=True)
        self.owner += [None] * (slots - old_slots)
        for slot, win in enumerate(self.owner):
            if win is not None:
                win._view(values[slot], t[slot], seq[slot])


class WindowStore:
    """Windows of every application, bounded in samples per app and in apps."""

    def __init__(self, *, max_samples: int = 1200, max_apps: int = 256, idle_evict_s: float = 30.0,
                 max_span_s: float | None = None, reserve_samples: int = 2**22) -> None:
        if max_samples < 1 or max_apps < 1 or idle_evict_s <= 0:
            raise ValueError("max_samples and max_apps must be >= 1 and idle_evict_s > 0")
        if max_span_s is not None and not max_span_s > 0:
            raise ValueError(f"max_span_s must be > 0, got {max_span_s}")
        self.max_samples = max_samples
        self.max_span_s = max_span_s
        self.max_apps = max_apps
        self.idle_evict_s = idle_evict_s
        # Least recently seen first: move_to_end on every sample.
        self._apps: OrderedDict[str, AppWindow] = OrderedDict()
        # Where max_apps x max_samples is at most `reserve_samples`, the slab is mapped whole from the
        # start (only the pages written take memory) and never resized: a resize copies every window
        # at once, a stall of the loop (20 ms for 256 windows growing to 1024 samples, 57 ms for the
        # slots of 256 new applications). Beyond it, rings start small and double, slots grow.
        whole = max_apps * max_samples <= reserve_samples
        self._slab = _Slab(max_samples, max_apps, max_samples if whole else AppWindow._FIRST_CAPACITY,
                           max_apps if whole else 0)
        self.out_of_order = 0
        self.seq_restarts = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._apps)

    def __contains__(self, app_id: object) -> bool:
        return app_id in self._apps

    def apps(self) -> list[str]:
        return list(self._apps)

    def window(self, app_id: str) -> AppWindow:
        return self._apps[app_id]

    def trace(self, app_id: str) -> AppTrace:
        return self._apps[app_id].trace()

    def holds(self, app_id: str, seq: int, t_s: float) -> bool:
        """Whether the window already has this sample: seq not above the application's last, time
        not newer, and a sample with that seq and time still in the window. A profiler resends the
        batches the manager had not acknowledged when the stream broke; those the manager did read
        are held. A sample that is merely late is not held (`add` drops it as out of order); neither
        is one so old that the window no longer keeps it. Pure: the caller drops the held ones."""
        win = self._apps.get(app_id)
        return (win is not None and seq <= win.last_seq and t_s <= win.last_t_s
                and bool(win.has(np.array([seq], dtype=np.uint64), np.array([t_s]))[0]))

    def add(self, sample: Sample, now_s: float) -> tuple[bool, list[str]]:
        """Add a sample. Returns (kept, apps evicted to make room). A sample that is out of order
        (seq not above the app's last, or time before its last sample) is not kept."""
        return self.add_row(sample.app_id, sample.device_id, sample.seq, sample.t_s, sample.values, now_s)

    def add_row(self, app_id: str, device_id: str, seq: int, t_s: float, values: Values,
                now_s: float) -> tuple[bool, list[str]]:
        """`add` without building a `Sample` (values indexed like vgpu.wire.COLUMNS)."""
        evicted: list[str] = []
        win = self._apps.get(app_id)
        if win is None:
            while len(self._apps) >= self.max_apps:
                old, old_win = self._apps.popitem(last=False)
                self._slab.give_back(old_win)
                evicted.append(old)
            self.evicted_total += len(evicted)
            win = self._apps[app_id] = AppWindow(app_id, self.max_samples, self.max_span_s, self._slab)
        if t_s < win.last_t_s or (seq <= win.last_seq and t_s <= win.last_t_s):
            self.out_of_order += 1
            return False, evicted
        if seq <= win.last_seq:
            # A lower seq with a newer time: the profiler restarted and numbers from 1 again.
            self.seq_restarts += 1
        win.append(device_id, seq, t_s, values)
        win.last_seen_s = now_s
        self._apps.move_to_end(app_id)
        return True, evicted

    def add_latest(self, app_ids: Sequence[str], device_ids: Sequence[str], seq: npt.NDArray[np.uint64],
                   t_s: npt.NDArray[np.float64], values: npt.NDArray[np.float64], now_s: float) -> bool:
        """One sample for each of `app_ids` (distinct; `values`: (len(NUMERIC), m), no in-app
        counter), taken as `add_row` would take them one after another in this order, but written
        with one numpy assignment per array: a profiler's usual batch. Returns False, having changed
        nothing, where that cannot be done in bulk: an application without a window, one whose
        window holds in-app counters, or a sample `add_row` would not keep (out of order, a resend);
        the caller then adds them one by one."""
        get = self._apps.get
        wins = [get(a) for a in app_ids]
        if None in wins or len(values) != _NB:
            return False
        windows: list[AppWindow] = wins  # type: ignore[assignment]  # no None among them (checked)
        if any(w._inapp is not None for w in windows):
            return False
        last_t = np.array([w.last_t_s for w in windows], dtype=np.float64)
        last_seq = np.array([w.last_seq for w in windows], dtype=np.uint64)
        lower = seq <= last_seq
        if bool(((t_s < last_t) | (lower & (t_s <= last_t))).any()):
            return False
        slab = self._slab
        if slab.cap < self.max_samples and max(w._n for w in windows) >= slab.cap:
            slab.grow_capacity(min(self.max_samples, 2 * slab.cap))  # as `append` grows a full ring
        cap = slab.cap
        slots = np.fromiter((w._slot for w in windows), dtype=np.intp, count=len(windows))
        ends = np.fromiter((w._end for w in windows), dtype=np.intp, count=len(windows))
        slab.values[slots, :, ends] = values.T
        slab.t[slots, ends] = t_s
        slab.seq[slots, ends] = seq
        self.seq_restarts += int(lower.sum())  # a lower seq with a newer time: a restarted profiler
        move = self._apps.move_to_end
        for w, app_id, device_id, s, t in zip(windows, app_ids, device_ids, seq.tolist(), t_s.tolist(), strict=True):
            end = w._end + 1
            w._end = end if end < cap else 0
            if w._n < cap:
                w._n += 1
            w.device_id = device_id
            w.last_seq, w.last_t_s = s, t
            w.last_seen_s = now_s
            move(app_id)
        return True

    def add_rows(self, app_id: str, device_id: str, seq: np.ndarray, t_s: np.ndarray, values: np.ndarray,
                 now_s: float) -> tuple[np.ndarray, list[str]]:
        """`add_row` for many samples of one application (in batch order; `values`:
        (len(COLUMNS), m)). Returns (which were kept, apps evicted to make room). Samples in strictly
        increasing seq and time after the window's last are appended in bulk; anything else goes
        sample by sample with `add_row`'s rules."""
        m = len(t_s)
        win = self._apps.get(app_id)
        if win is not None and m and self._in_order(win, seq, t_s):
            if int(seq[0]) <= win.last_seq:
                self.seq_restarts += 1
            win.extend(device_id, seq, t_s, values)
            win.last_seen_s = now_s
            self._apps.move_to_end(app_id)
            return np.ones(m, dtype=bool), []
        kept = np.zeros(m, dtype=bool)
        evicted: list[str] = []
        for k in range(m):
            kept[k], ev = self.add_row(app_id, device_id, int(seq[k]), float(t_s[k]), values[:, k], now_s)
            evicted += ev
        return kept, evicted

    @staticmethod
    def _in_order(win: AppWindow, seq: np.ndarray, t_s: np.ndarray) -> bool:
        s0, t0 = int(seq[0]), float(t_s[0])
        if t0 < win.last_t_s or (s0 <= win.last_seq and t0 <= win.last_t_s):
            return False
        return len(t_s) == 1 or bool((np.diff(t_s) > 0).all() and (seq[1:] > seq[:-1]).all())

    def inapp_latest(self, app_id: str) -> dict[str, float]:
        """The in-app columns the newest sample of `app_id` carries, with their values (empty for an
        application without a window or without in-app counters): what the daemon's metrics show of
        its leading signals."""
        win = self._apps.get(app_id)
        if win is None or not win.has_inapp:
            return {}
        values = {c: win.latest_value(c) for c in INAPP_NUMERIC}
        return {c: v for c, v in values.items() if math.isfinite(v)}

    def inapp_reporting(self) -> dict[str, int]:
        """In-app column -> how many applications' newest sample carries it (for the daemon's
        metrics: which leading signals the forecaster gets, from how many applications)."""
        out: dict[str, int] = {}
        for win in self._apps.values():
            if not win.has_inapp:
                continue
            for c in INAPP_NUMERIC:
                if math.isfinite(win.latest_value(c)):
                    out[c] = out.get(c, 0) + 1
        return out

    def last_seen_s(self, app_id: str) -> float | None:
        """When the last sample of `app_id` arrived (the caller's clock); None when it has no window."""
        win = self._apps.get(app_id)
        return None if win is None else win.last_seen_s

    def evict_idle(self, now_s: float) -> list[str]:
        """Drop applications whose last sample arrived more than `idle_evict_s` before `now_s`."""
        gone = []
        while self._apps:
            app_id, win = next(iter(self._apps.items()))  # least recently seen first
            if now_s - win.last_seen_s <= self.idle_evict_s:
                break
            del self._apps[app_id]
            self._slab.give_back(win)
            gone.append(app_id)
        self.evicted_total += len(gone)
        return gone
