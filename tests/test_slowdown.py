"""Slowdown of a smaller MIG slice or a lower power limit, with its measured error."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from vgpu.offline.slowdown import SlowdownModel, _Group, _PowerCurve, compute_slices

SLICES_40 = ("1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")


def _synthetic() -> SlowdownModel:
    # t = c * (7/g)^k with k = 0.8 for "resnet" (cnn) and 0.4 for "bert" (transformer); power: a40 curve
    groups = []
    for model, k in (("resnet", 0.8), ("bert", 0.4)):
        for batch, c in ((32, 0.1), (64, 0.2)):
            times = {g: c * (7 / g) ** k for g in (1, 2, 3, 7)}
            groups.append(_Group(("t", model, str(batch)), model, batch, times))
    limits = np.array([100.0, 150.0, 200.0, 250.0])
    t = np.array([20.0, 14.0, 11.0, 10.0])
    curves = {("a40", "resnet50", 128): _PowerCurve(limits, t / t[-1], np.array([95.0, 140.0, 180.0, 210.0]), t)}
    return SlowdownModel(groups, curves)


def test_compute_slices_parses_profiles_and_refuses_others() -> None:
    assert [compute_slices(s) for s in SLICES_40] == [1, 2, 3, 4, 7]
    assert compute_slices("full") == 7 and compute_slices("1g.10gb") == 1
    for bad in ("", "big", "9g.90gb", "3g"):
        with pytest.raises(ValueError, match="MIG profile"):
            compute_slices(bad)


def test_measured_pairs_are_exact_and_fitted_ones_follow_the_power_law() -> None:
    m = _synthetic()
    exact = m.slice_slowdown("resnet", 32, "7g.40gb", "1g.5gb")
    assert exact.basis == "measured" and exact.factor == pytest.approx(7**0.8)
    fitted = m.slice_slowdown("resnet", 32, "7g.40gb", "4g.20gb")  # 4 slices never measured
    assert fitted.basis == "model" and fitted.factor == pytest.approx((7 / 4) ** 0.8, rel=1e-6)
    assert m.errors["slice"]["mape_pct"] == pytest.approx(0.0, abs=1e-6)  # a perfect power law


def test_less_slices_never_run_faster() -> None:
    m = _synthetic()
    for model in ("resnet", "bert", "vgg16", "unknown-net"):
        for batch in (1, 32, 48, 64, 512):
            factors = [m.slice_slowdown(model, batch, "7g.40gb", s).factor for s in SLICES_40]
            assert all(a >= b for a, b in zip(factors, factors[1:], strict=False))
            assert factors[-1] == pytest.approx(1.0) and factors[0] >= 1.0


def test_unknown_model_falls_back_with_a_flag() -> None:
    m = _synthetic()
    vgg = m.slice_slowdown("vgg16", 32, "7g.40gb", "1g.5gb")
    assert vgg.fallback and vgg.basis == "family" and vgg.used == "cnn" and "vgg16" in vgg.note
    other = m.slice_slowdown("mystery", 32, "7g.40gb", "1g.5gb")
    assert other.fallback and other.basis == "global" and other.factor > 1.0
    assert not m.slice_slowdown("bert", 32, "7g.40gb", "1g.5gb").fallback


def test_power_slowdown_and_energy() -> None:
    m = _synthetic()
    trade = m.power_tradeoff("resnet50", 128, 250, 150, gpu="A40")
    assert trade.slowdown.factor == pytest.approx(1.4)
    assert trade.power_ratio == pytest.approx(140 / 210)
    assert trade.energy_ratio == pytest.approx(1.4 * 140 / 210)
    assert m.power_slowdown("resnet50", 128, 150, 250, gpu="a40").factor == pytest.approx(1 / 1.4)
    near = m.power_slowdown("resnet50", 100, 250, 150, gpu="a40")
    assert "nearest 128" in near.note
    clamped = m.power_slowdown("resnet50", 128, 250, 50, gpu="a40")
    assert clamped.factor == pytest.approx(2.0) and "clamped" in clamped.note
    fam = m.power_slowdown("vgg16", 128, 250, 150, gpu="a40")
    assert fam.fallback and fam.used == "resnet50"
    glob = m.power_tradeoff("mystery", 128, 250, 150, gpu="a40")
    assert glob.slowdown.basis == "global" and math.isnan(glob.from_power_w)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.slice_slowdown("resnet", 0, "7g.40gb", "1g.5gb"), "batch"),
        (lambda m: m.slice_slowdown("resnet", 8, "7g.40gb", "huge"), "MIG profile"),
        (lambda m: m.power_slowdown("resnet50", 8, 250, -1, gpu="a40"), "positive number of watts"),
        (lambda m: m.power_slowdown("resnet50", 8, 250, 150, gpu="h100"), "no power data for GPU"),
    ],
)
def test_bad_input(call: Callable[[SlowdownModel], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(_synthetic())


def test_nothing_to_model_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing to model"):
        SlowdownModel([], {})


def test_real_data_error_is_reported_and_curves_are_monotone(shared_data: Path) -> None:
    m = SlowdownModel.from_data(shared_data)
    for kind in ("slice", "power"):
        err = m.errors[kind]
        assert err["n"] > 100 and 0 < err["mape_pct"] < 50
    for model, batch in (("resnet", 128), ("bert", 4), ("bert-base-multilingual-cased", 16), ("gpt-j", 8)):
        factors = [m.slice_slowdown(model, batch, "7g.40gb", s).factor for s in SLICES_40]
        assert factors[0] >= 1.0 and factors[-1] == pytest.approx(1.0)
    for g in m._groups:  # every measured group: a smaller slice is never faster
        for s in g.times_s:
            for t in g.times_s:
                f = m.slice_slowdown(g.model, g.batch, f"{s}g.x", f"{t}g.x").factor
                assert (f >= 1.0) if t < s else (f <= 1.0) if t > s else f == 1.0
    for gpu in ("a40", "v100"):
        slow = [m.power_slowdown("resnet50", 128, 250, w, gpu=gpu).factor for w in (100, 150, 200, 250)]
        assert all(a >= b for a, b in zip(slow, slow[1:], strict=False)) and slow[0] > 1.0
        assert m.power_tradeoff("resnet50", 128, 250, 150, gpu=gpu).power_ratio < 1.0
