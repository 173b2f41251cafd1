"""The windows' bulk path (`WindowStore.add_latest`, one numpy assignment for a batch with one
sample per application, the rings in one slab) against `add_row` one sample at a time; and the
one-pass check of a batch's application ids against the per-id rule."""

from __future__ import annotations

import math
import random
import string

import numpy as np
import pytest

from vgpu.ids import all_app_ids_valid, app_id_problem
from vgpu.manager.window import WindowStore
from vgpu.traces import INAPP_NUMERIC, NUMERIC

NB = len(NUMERIC)


def _state(store: WindowStore) -> list[object]:
    """Everything a reader of the store can see, in its LRU order."""
    out: list[object] = [store.out_of_order, store.seq_restarts, store.evicted_total, store.apps()]
    for app in store.apps():
        w = store.window(app)
        tr = w.trace()
        out.append((app, len(w), w.device_id, w.last_seq, w.last_t_s, w.last_seen_s, tr.t_s.tobytes(),
                    {c: np.asarray(v).tobytes() for c, v in tr.columns.items()}, [s.seq for s in w.samples]))
    return out


def _batch(rng: np.random.Generator, apps: list[str], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = len(apps)
    seq = np.full(m, k, dtype=np.uint64)
    t = 1000.0 + 0.1 * k + rng.uniform(0, 0.05, m)
    values = rng.uniform(0, 100, (NB, m))
    values[rng.uniform(size=(NB, m)) < 0.2] = math.nan
    return seq, t, values


@pytest.mark.parametrize(("max_samples", "max_apps", "reserve_samples"),
                         [(1200, 40, 2**22), (1200, 40, 0), (50, 8, 0), (64, 3, 2**22)])
def test_bulk_batches_give_the_windows_one_by_one_gives(max_samples: int, max_apps: int, reserve_samples: int) -> None:
    """Batches of one sample per application through `add_latest` and through `add_row`: the same
    windows, counters and LRU order, across the slab's capacity doublings (past 64 samples, where the
    slab is not mapped whole: `reserve_samples` 0) and slot growth, new applications, evictions (an evicted slot taken by another application), a
    restarted profiler (seq back to 1, time on), and samples the bulk path must refuse
    (out of order, resent)."""
    rng = np.random.default_rng(7)
    bulk = WindowStore(max_samples=max_samples, max_apps=max_apps, reserve_samples=reserve_samples)
    rows = WindowStore(max_samples=max_samples, max_apps=max_apps)
    names = [f"app{i}" for i in range(max_apps + 3)]
    refused = 0
    for k in range(1, 160):
        shift = (k // 30) % 4  # from k = 40 every 30 batches: newcomers, evictions
        apps = names[: max_apps // 2 + 1] if k < 40 else names[shift: shift + max_apps]
        seq, t, values = _batch(rng, apps, k)
        if k == 90:
            seq[0] = 1  # a restarted profiler: lower seq, newer time
        if k == 120:
            t[-1] = 900.0  # out of order
        if k == 130:
            seq[:], t[:] = k - 1, 1000.0 + 0.1 * (k - 1)  # resent: refused in bulk
        devices = [f"GPU-{k % 2}"] * len(apps)
        now = 2000.0 + k
        taken = bulk.add_latest(apps, devices, seq, t, values, now)
        if not taken:
            refused += 1
            for j, app in enumerate(apps):
                bulk.add_row(app, devices[j], int(seq[j]), float(t[j]), values[:, j].tolist(), now)
        for j, app in enumerate(apps):
            rows.add_row(app, devices[j], int(seq[j]), float(t[j]), values[:, j].tolist(), now)
        assert _state(bulk) == _state(rows), k
    assert rows.seq_restarts >= 1 and rows.out_of_order >= 1 and rows.evicted_total >= 1
    assert 3 <= refused < 20  # the bulk path served the usual batches


def test_bulk_refuses_without_changing_anything() -> None:
    """A new application, an in-app window or a sample `add_row` would not keep: False, and the
    store is as it was (the caller then adds the samples one by one)."""
    store = WindowStore(max_samples=100, max_apps=4)
    vals = np.ones((NB, 2))
    for a in ("a", "b"):
        store.add_row(a, "GPU-0", 1, 1000.0, [1.0] * NB, 1.0)
    before = _state(store)
    assert not store.add_latest(["a", "new"], ["GPU-0"] * 2, np.array([2, 2], np.uint64), np.array([1001.0] * 2), vals,
                                2.0)
    assert not store.add_latest(["a", "b"], ["GPU-0"] * 2, np.array([2, 1], np.uint64), np.array([1001.0, 1000.0]),
                                vals, 2.0)
    assert _state(store) == before
    store.add_row("b", "GPU-0", 2, 1001.0, [1.0] * NB + [5.0] * len(INAPP_NUMERIC), 2.0)
    assert store.window("b").has_inapp
    before = _state(store)
    assert not store.add_latest(["a", "b"], ["GPU-0"] * 2, np.array([3, 3], np.uint64), np.array([1002.0] * 2), vals,
                                3.0)
    assert _state(store) == before


def test_an_evicted_window_still_reads_as_it_did_when_its_slot_is_taken() -> None:
    store = WindowStore(max_samples=100, max_apps=2)
    store.add_row("a", "GPU-0", 1, 1000.0, [7.0] * NB, 1.0)
    old = store.window("a")
    store.add_row("b", "GPU-0", 1, 1000.0, [8.0] * NB, 2.0)
    _, evicted = store.add_row("c", "GPU-0", 1, 1000.0, [9.0] * NB, 3.0)  # evicts a: c takes its slot
    assert evicted == ["a"]
    assert old.trace().columns["mem_used_mib"].tolist() == [7.0]
    assert store.window("c").trace().columns["mem_used_mib"].tolist() == [9.0]
    assert store.evict_idle(100.0) == ["b", "c"]


def _hostile_ids() -> list[list[str]]:
    cases = [["a"], ["a", "b#1"], ["a\nb"], [""], [" a"], ["a" * 256], ["a" * 257], ["é"], ["a", "a "], ["-a"],
             ["a\n"], ["\n"], ["a", ""], ["a/b:c@d+e=f.g_h-i"], ["x" * 255, "y"], ["y", "x" * 257], []]
    rnd = random.Random(3)
    alphabet = string.ascii_letters + string.digits + "._-:@#+=/ \n\t\x00é\u200b"
    for _ in range(3000):
        cases.append(["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 6))) for _ in range(rnd.randint(1, 4))])
    return cases


def test_the_one_pass_id_check_agrees_with_the_rule() -> None:
    for ids in _hostile_ids():
        assert all_app_ids_valid(ids) == (bool(ids) and all(app_id_problem(x) is None for x in ids)), ids
