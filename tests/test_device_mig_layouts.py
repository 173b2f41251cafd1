"""Every valid MIG layout of the simulated A100-40GB, A100-80GB and H100-80GB: apply, read back,
compare, destroy; then recreate restores the same instances. Runs on the simulator and on the NVML
backend over the fake pynvml (writes: never on a real GPU). Through the fake (about 80 NVML calls per
layout) the recreate step runs on every 5th layout to keep the suite fast; the simulator runs it on
every layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from device_rigs import Rig

from vgpu.device.base import Device, GpuInstance
from vgpu.device.skus import SKUS, LayoutSlot, get_sku, valid_layouts


def _key(gi: GpuInstance) -> tuple[int, int, int, int, str, float]:
    return (gi.instance_id, gi.profile_id, gi.placement.start, gi.placement.size, gi.profile_name, gi.mem_total_mib)


def _apply(dev: Device, layout: Sequence[LayoutSlot]) -> list[GpuInstance]:
    return [dev.create_gpu_instance(slot.profile_id, slot.start) for slot in layout]


def _clear(dev: Device, instances: Sequence[GpuInstance]) -> None:
    for gi in reversed(instances):
        dev.destroy_gpu_instance(gi.instance_id)


@pytest.mark.parametrize("sku_name", sorted(SKUS))
def test_every_valid_layout_round_trips(rig_factory: Callable[..., Rig], sku_name: str) -> None:
    r = rig_factory(gpus=[sku_name], mig_enabled=True, mig_reconfig_s=0.0)
    r.need_writes()
    dev = r.device()
    sku = get_sku(sku_name)
    layouts = valid_layouts(sku)
    assert len(layouts) > 100
    recreate_every = 5 if r.kind == "fake" else 1
    for n, layout in enumerate(layouts):
        created = _apply(dev, layout)
        read = dev.gpu_instances()
        wanted = sorted((s.profile_id, s.start) for s in layout)
        assert sorted((g.profile_id, g.placement.start) for g in read) == wanted, layout
        assert sorted(map(_key, read)) == sorted(map(_key, created)), layout
        for gi in read:
            prof = sku.profile(gi.profile_id)
            assert prof is not None and gi.placement.size == prof.placement_at(gi.placement.start).size  # type: ignore[union-attr]
            assert gi.uuid.startswith("MIG-")
        _clear(dev, read)
        assert dev.gpu_instances() == []
        if n % recreate_every:
            continue
        again = _apply(dev, layout)
        assert sorted(map(_key, dev.gpu_instances())) == sorted(map(_key, read)), layout
        _clear(dev, again)
    assert dev.gpu_instances() == []
