"""GPU models as data: memory, power-limit range, SM count and MIG GPU-instance profiles per SKU.

Every figure comes from /work/shared/reference/gpu-skus.md unless a comment says the reference leaves it
open. The valid MIG layouts of a SKU are enumerated from its profiles and placements
(`valid_layouts`), never listed by hand.

Two numberings exist for a MIG profile: NVML's profile *constant* (`NVML_GPU_INSTANCE_PROFILE_*`, what
`nvmlDeviceGetGpuInstanceProfileInfo` takes) and the profile *id* that the returned info carries and that
`nvidia-smi` shows (what placements, instance creation and this project's `GpuInstanceProfile.profile_id`
use). `MigProfile` keeps both.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from vgpu.device.base import GpuInstanceProfile, Placement

# NVML_GPU_INSTANCE_PROFILE_* constants (values as in nvml.h / pynvml; repeated here so that only
# vgpu/device/nvml.py imports pynvml).
GI_PROFILE_1_SLICE = 0
GI_PROFILE_2_SLICE = 1
GI_PROFILE_3_SLICE = 2
GI_PROFILE_4_SLICE = 3
GI_PROFILE_7_SLICE = 4
GI_PROFILE_1_SLICE_REV1 = 7
GI_PROFILE_1_SLICE_REV2 = 9

# NVML_COMPUTE_INSTANCE_PROFILE_* constant of the compute instance that spans a whole GPU instance
# with this many compute slices (nvml.h: 1_SLICE=0, 2_SLICE=1, 3_SLICE=2, 4_SLICE=3, 7_SLICE=4).
CI_PROFILE_FOR_SLICES: dict[int, int] = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}


@dataclass(frozen=True)
class MigProfile:
    """One MIG GPU-instance profile of a SKU."""

    nvml_profile: int  # NVML_GPU_INSTANCE_PROFILE_* constant
    profile_id: int  # the id nvidia-smi shows and placements/creation use
    name: str  # "1g.10gb"
    slice_count: int  # compute slices
    mem_mib: int
    sm_count: int
    max_count: int
    placements: tuple[Placement, ...]  # start:size in memory slices

    def as_gpu_instance_profile(self) -> GpuInstanceProfile:
        return GpuInstanceProfile(
            profile_id=self.profile_id,
            name=self.name,
            slice_count=self.slice_count,
            mem_mib=float(self.mem_mib),
            sm_count=self.sm_count,
            max_count=self.max_count,
            placements=self.placements,
        )

    def placement_at(self, start: int) -> Placement | None:
        for p in self.placements:
            if p.start == start:
                return p
        return None


@dataclass(frozen=True)
class Sku:
    """A GPU model. Power in mW, memory in MiB, as NVML reports them."""

    key: str  # "h100-80gb": the name used in backend specs
    product_name: str  # what nvmlDeviceGetName returns
    mem_total_mib: int
    power_min_mw: int
    power_max_mw: int
    power_default_mw: int
    sm_count: int
    sm_clock_max_mhz: int
    idle_power_mw: int
    mig_profiles: tuple[MigProfile, ...]
    compute_slices: int = 7
    memory_slices: int = 8

    @property
    def supports_mig(self) -> bool:
        return bool(self.mig_profiles)

    def profile(self, profile_id: int) -> MigProfile | None:
        for p in self.mig_profiles:
            if p.profile_id == profile_id:
                return p
        return None

    def profile_by_name(self, name: str) -> MigProfile | None:
        for p in self.mig_profiles:
            if p.name == name:
                return p
        return None


def _starts(starts: Iterable[int], size: int) -> tuple[Placement, ...]:
    return tuple(Placement(start=s, size=size) for s in starts)


# Placements, max counts and slice counts are the same on all three SKUs (reference table).
_P1 = _starts(range(7), 1)  # 0..6 : 1
_P1_REV2 = _starts((0, 2, 4, 6), 2)
_P2 = _starts((0, 2, 4), 2)
_P3 = _starts((0, 4), 4)
_P4 = _starts((0,), 4)
_P7 = _starts((0,), 8)


def _profiles(
    gb: tuple[int, int, int, int, int, int],
    mem: tuple[int, int, int, int, int, int],
    sms_per_slice: int,
    sm_7g: int,
) -> tuple[MigProfile, ...]:
    """The seven profiles of one SKU. `gb` are the name sizes (1g, 1g-double, 2g, 3g, 4g, 7g),
    `mem` the memory of each in MiB."""
    g1, g1d, g2, g3, g4, g7 = gb
    m1, m1d, m2, m3, m4, m7 = mem
    return (
        # Profile ids: the reference lists them for A100-40GB (19, 20, 15, 14, 9, 5, 0); A100-80GB
        # and H100-80GB use the same ids in public `nvidia-smi mig -lgip` listings, which the
        # reference does not state -- verify on hardware.
        MigProfile(GI_PROFILE_1_SLICE, 19, f"1g.{g1}gb", 1, m1, sms_per_slice, 7, _P1),
        # 1g+me has the memory of 1g; the reference lists its max count as 1.
        MigProfile(GI_PROFILE_1_SLICE_REV1, 20, f"1g.{g1}gb+me", 1, m1, sms_per_slice, 1, _P1),
        MigProfile(GI_PROFILE_1_SLICE_REV2, 15, f"1g.{g1d}gb", 1, m1d, sms_per_slice, 4, _P1_REV2),
        MigProfile(GI_PROFILE_2_SLICE, 14, f"2g.{g2}gb", 2, m2, 2 * sms_per_slice, 3, _P2),
        MigProfile(GI_PROFILE_3_SLICE, 9, f"3g.{g3}gb", 3, m3, 3 * sms_per_slice, 2, _P3),
        MigProfile(GI_PROFILE_4_SLICE, 5, f"4g.{g4}gb", 4, m4, 4 * sms_per_slice, 1, _P4),
        MigProfile(GI_PROFILE_7_SLICE, 0, f"7g.{g7}gb", 7, m7, sm_7g, 1, _P7),
    )


H100_80GB = Sku(
    key="h100-80gb",
    product_name="NVIDIA H100 80GB HBM3",
    # Not in the reference: the total nvidia-smi reports for H100 SXM5 80GB (81559 MiB); the 7g
    # instance (81920 MiB in the reference) is listed by the driver as slightly larger than this.
    mem_total_mib=81559,
    power_min_mw=200_000,
    power_max_mw=700_000,
    power_default_mw=700_000,
    # Not in the reference: 132 SMs (H100 SXM5 datasheet) and 1980 MHz max SM clock.
    sm_count=132,
    sm_clock_max_mhz=1980,
    # Not in the reference: an idle floor of about 70 W is typical of H100 SXM5 at rest.
    idle_power_mw=70_000,
    # 7g SM count 112 comes from the go-nvml mock and is flagged unverified by the reference.
    mig_profiles=_profiles(
        (10, 20, 20, 40, 40, 80), (10240, 20480, 20480, 40960, 40960, 81920), 16, 112
    ),
)

A100_40GB = Sku(
    key="a100-40gb",
    product_name="NVIDIA A100-SXM4-40GB",
    # Not in the reference: nvidia-smi's total for A100-SXM4-40GB (40960 MiB).
    mem_total_mib=40960,
    power_min_mw=100_000,
    power_max_mw=400_000,
    power_default_mw=400_000,
    # Not in the reference: 108 SMs (A100 datasheet), 1410 MHz max SM clock.
    sm_count=108,
    sm_clock_max_mhz=1410,
    # Not in the reference: an idle floor of about 55 W for A100 SXM4.
    idle_power_mw=55_000,
    mig_profiles=_profiles((5, 10, 10, 20, 20, 40), (4864, 9856, 9856, 19968, 19968, 40192), 14, 98),
)

A100_80GB = Sku(
    key="a100-80gb",
    product_name="NVIDIA A100-SXM4-80GB",
    # Not in the reference: nvidia-smi's total for A100-SXM4-80GB (81920 MiB).
    mem_total_mib=81920,
    power_min_mw=100_000,
    power_max_mw=400_000,
    power_default_mw=400_000,
    sm_count=108,  # not in the reference (datasheet)
    sm_clock_max_mhz=1410,  # not in the reference (datasheet)
    idle_power_mw=60_000,  # not in the reference (typical idle)
    mig_profiles=_profiles((10, 20, 20, 40, 40, 80), (9856, 19968, 19968, 40192, 40192, 80384), 14, 98),
)

SKUS: dict[str, Sku] = {s.key: s for s in (H100_80GB, A100_40GB, A100_80GB)}


def get_sku(key: str) -> Sku:
    """The SKU called `key` ("h100-80gb"); ValueError listing the known ones otherwise."""
    sku = SKUS.get(key.strip().lower())
    if sku is None:
        raise ValueError(f"unknown GPU SKU {key!r}; known: {', '.join(sorted(SKUS))}")
    return sku


@dataclass(frozen=True, order=True)
class LayoutSlot:
    """One GPU instance of a layout: a profile id at a placement start (memory slice)."""

    start: int
    profile_id: int


MigLayout = tuple[LayoutSlot, ...]  # sorted by start; () is MIG enabled with no instance


def layout_problem(sku: Sku, layout: Iterable[LayoutSlot]) -> str | None:
    """Why `layout` cannot exist on `sku` (unknown profile, bad start, overlap, over max count or
    over the compute slices), or None when a real GPU accepts it."""
    used = [False] * sku.memory_slices
    counts: dict[int, int] = {}
    compute = 0
    for slot in layout:
        prof = sku.profile(slot.profile_id)
        if prof is None:
            return f"{sku.key} has no MIG profile id {slot.profile_id}"
        place = prof.placement_at(slot.start)
        if place is None:
            return f"{prof.name} cannot start at memory slice {slot.start}"
        span = range(place.start, place.start + place.size)
        if any(used[i] for i in span):
            return f"{prof.name} at {place.start}:{place.size} overlaps another instance"
        for i in span:
            used[i] = True
        counts[prof.profile_id] = counts.get(prof.profile_id, 0) + 1
        if counts[prof.profile_id] > prof.max_count:
            return f"more than {prof.max_count} x {prof.name}"
        compute += prof.slice_count
        if compute > sku.compute_slices:
            return f"more than {sku.compute_slices} compute slices"
    return None


def _enumerate(sku: Sku) -> Iterator[MigLayout]:
    starts: dict[int, list[MigProfile]] = {}
    for prof in sku.mig_profiles:
        for place in prof.placements:
            starts.setdefault(place.start, []).append(prof)

    def walk(pos: int, chosen: tuple[LayoutSlot, ...], counts: dict[int, int], compute: int) -> Iterator[MigLayout]:
        if pos >= sku.memory_slices:
            yield chosen
            return
        yield from walk(pos + 1, chosen, counts, compute)  # leave this memory slice empty
        for prof in starts.get(pos, ()):
            place = prof.placement_at(pos)
            assert place is not None
            if pos + place.size > sku.memory_slices:
                continue
            if counts.get(prof.profile_id, 0) >= prof.max_count:
                continue
            if compute + prof.slice_count > sku.compute_slices:
                continue
            counts[prof.profile_id] = counts.get(prof.profile_id, 0) + 1
            yield from walk(pos + place.size, (*chosen, LayoutSlot(pos, prof.profile_id)), counts, compute + prof.slice_count)
            counts[prof.profile_id] -= 1

    yield from walk(0, (), {}, 0)


@functools.cache
def valid_layouts(sku: Sku) -> tuple[MigLayout, ...]:
    """Every set of non-overlapping GPU instances `sku` accepts (within max counts and the compute
    slices), the empty layout included, each sorted by start."""
    return tuple(_enumerate(sku))
