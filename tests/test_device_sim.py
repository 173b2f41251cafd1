"""Simulator-only pieces: the SKU tables and their layouts, backend specs, inputs it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from device_rigs import trace

from vgpu.device import open_backend, parse_sim_spec
from vgpu.device.errors import InvalidArgument, NotFound
from vgpu.device.fake_pynvml import FakePynvml
from vgpu.device.nvml import NvmlBackend
from vgpu.device.sim import ManualClock, SimBackend
from vgpu.device.skus import SKUS, LayoutSlot, get_sku, layout_problem, valid_layouts
from vgpu.traces import AppTrace

# --- SKU tables ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SKUS))
def test_sku_figures_from_the_reference(name: str) -> None:
    sku = get_sku(name)
    assert sku.power_min_mw < sku.power_max_mw == sku.power_default_mw
    names = {p.name for p in sku.mig_profiles}
    ids = {p.profile_id: p.name for p in sku.mig_profiles}
    assert len(names) == 7 and len(ids) == 7
    assert ids[19].startswith("1g.") and ids[0].startswith("7g.") and ids[9].startswith("3g.")
    for p in sku.mig_profiles:
        assert p.mem_mib <= sku.mem_total_mib or p.slice_count == 7
        for place in p.placements:
            assert place.start + place.size <= sku.memory_slices


def test_a100_40gb_profile_table() -> None:
    sku = get_sku("a100-40gb")
    by_id = {p.profile_id: (p.name, p.mem_mib, p.max_count, [(x.start, x.size) for x in p.placements]) for p in sku.mig_profiles}
    assert by_id[19] == ("1g.5gb", 4864, 7, [(i, 1) for i in range(7)])
    assert by_id[20][0] == "1g.5gb+me" and by_id[20][2] == 1
    assert by_id[15] == ("1g.10gb", 9856, 4, [(0, 2), (2, 2), (4, 2), (6, 2)])
    assert by_id[14] == ("2g.10gb", 9856, 3, [(0, 2), (2, 2), (4, 2)])
    assert by_id[9] == ("3g.20gb", 19968, 2, [(0, 4), (4, 4)])
    assert by_id[5] == ("4g.20gb", 19968, 1, [(0, 4)])
    assert by_id[0] == ("7g.40gb", 40192, 1, [(0, 8)])
    assert (sku.power_min_mw, sku.power_max_mw) == (100_000, 400_000)
    assert (get_sku("h100-80gb").power_min_mw, get_sku("h100-80gb").power_max_mw) == (200_000, 700_000)


@pytest.mark.parametrize("name", sorted(SKUS))
def test_layout_enumeration_is_sound_and_complete(name: str) -> None:
    sku = get_sku(name)
    layouts = valid_layouts(sku)
    as_set = set(layouts)
    assert len(as_set) == len(layouts)
    assert () in as_set
    slots = [LayoutSlot(pl.start, p.profile_id) for p in sku.mig_profiles for pl in p.placements]
    for layout in layouts:
        assert layout_problem(sku, layout) is None
        assert list(layout) == sorted(layout)
        # closure: any slot that can be added gives another listed layout. With () listed and
        # validity kept under removal, this makes the list complete.
        for slot in slots:
            bigger = tuple(sorted((*layout, slot)))
            if layout_problem(sku, bigger) is None:
                assert bigger in as_set, bigger


def test_known_layouts_and_violations() -> None:
    sku = get_sku("a100-40gb")
    layouts = set(valid_layouts(sku))
    assert (LayoutSlot(0, 0),) in layouts  # 7g alone
    assert (LayoutSlot(0, 5), LayoutSlot(4, 9)) in layouts  # 4g + 3g
    assert (LayoutSlot(0, 9), LayoutSlot(4, 9)) in layouts  # 3g + 3g
    assert tuple(LayoutSlot(i, 19) for i in range(7)) in layouts  # 7 x 1g
    assert "overlaps" in (layout_problem(sku, [LayoutSlot(0, 9), LayoutSlot(0, 5)]) or "")
    assert "more than 1" in (layout_problem(sku, [LayoutSlot(0, 20), LayoutSlot(1, 20)]) or "")
    assert "cannot start" in (layout_problem(sku, [LayoutSlot(7, 19)]) or "")
    assert "no MIG profile" in (layout_problem(sku, [LayoutSlot(0, 77)]) or "")


def test_unknown_sku_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="a100-40gb, a100-80gb, h100-80gb"):
        get_sku("v100")


# --- backend specs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("sim", ["h100-80gb"]),
        ("sim:h100-80gb", ["h100-80gb"]),
        ("sim:a100-40gb,a100-80gb", ["a100-40gb", "a100-80gb"]),
        ("sim:h100-80gb*8", ["h100-80gb"] * 8),
        (" SIM:A100-40GB*2, h100-80gb ", ["a100-40gb", "a100-40gb", "h100-80gb"]),
    ],
)
def test_sim_specs(spec: str, names: list[str]) -> None:
    assert parse_sim_spec(spec) == names
    backend = open_backend(spec, clock=ManualClock())
    assert [d.sku.key for d in backend.devices()] == names  # type: ignore[attr-defined]
    assert len({d.uuid for d in backend.devices()}) == len(names)


@pytest.mark.parametrize("spec", ["", "gpu", "sim:", "sim:v100", "sim:h100-80gb*0", "sim:h100-80gb*x", "sim:a100-40gb,,h100-80gb", "sim:h100-80gb*65"])
def test_bad_specs_are_clear_value_errors(spec: str) -> None:
    with pytest.raises(ValueError, match="h100-80gb") as info:
        open_backend(spec)
    assert "a100-40gb" in str(info.value)


def test_nvml_spec_passes_keywords_to_the_backend() -> None:
    backend = open_backend("nvml", nvml=FakePynvml(SimBackend(["a100-80gb", "a100-80gb"])))
    assert isinstance(backend, NvmlBackend)
    assert [d.name for d in backend.devices()] == ["NVIDIA A100-SXM4-80GB"] * 2


# --- inputs the simulator refuses ----------------------------------------------------------------


def test_launch_refusals() -> None:
    clock = ManualClock()
    sim = SimBackend(["a100-40gb"], clock=clock, mig_enabled=True)
    t = trace("x", [1, 2], 1.0)
    with pytest.raises(InvalidArgument, match="name a GPU instance"):
        sim.launch("x", 1, t)
    with pytest.raises(NotFound):
        sim.launch("x", 1, t, gpu_instance_id=3)
    with pytest.raises(InvalidArgument):
        sim.launch("x", 1, t, device_index=5)
    with pytest.raises(ValueError):
        sim.launch("x", 1, t, speed=0)
    with pytest.raises(ValueError):
        sim.launch("x", 1, AppTrace("x", np.zeros(0), {}))
    plain = SimBackend(["a100-40gb"], clock=clock)
    with pytest.raises(InvalidArgument, match="MIG disabled"):
        plain.launch("x", 1, t, gpu_instance_id=1)
    assert plain.kill(12345) is False
    with pytest.raises(ValueError):
        SimBackend([])
    with pytest.raises(ValueError):
        SimBackend(["h100-80gb"], mig_reconfig_s=-1)


def test_memory_over_capacity_is_clipped_and_shown_in_the_snapshot() -> None:
    clock = ManualClock()
    sim = SimBackend(["a100-40gb"], clock=clock)
    sim.launch("big", 1, trace("big", [30000] * 5, 50.0))
    sim.launch("late", 2, trace("late", [20000] * 5, 50.0))
    clock.advance(0.5)
    dev = sim.devices()[0]
    snap = {s.pid: s for s in dev.snapshot()}
    assert snap[1].used_mib == 30000 and not snap[1].clipped
    assert snap[2].demand_mib == 20000 and snap[2].used_mib == 40960 - 30000 and snap[2].clipped
    assert dev.memory().free_mib == 0


def test_missing_trace_values_carry_forward() -> None:
    clock = ManualClock()
    sim = SimBackend(["h100-80gb"], clock=clock)
    t = AppTrace("gappy", np.arange(4.0), {"mem_used_mib": np.array([np.nan, 100.0, np.nan, 300.0])})
    sim.launch("gappy", 1, t)
    dev = sim.devices()[0]
    seen = []
    for _ in range(4):
        seen.append(dev.memory().used_mib)
        clock.advance(1.0)
    assert seen == [0, 100, 100, 300]
    assert dev.utilization().sm_pct == 0  # no sm column: 0


def test_manual_clock_does_not_go_back() -> None:
    clock = ManualClock(5.0)
    with pytest.raises(ValueError):
        clock.advance(-1)
    with pytest.raises(ValueError):
        clock.set(4.0)
    assert clock.advance(1.5) == 6.5
