"""MIG: pick a layout that fits the forecast needs, and reach it one GPU instance at a time.

Three parts:
- `choose_layout` (pure): among the SKU's valid layouts (`vgpu.device.skus.valid_layouts`), one that
  gives every application its own GPU instance with at least its memory and compute need; among
  those, the one that changes the fewest instances of the current layout, then uses the fewest
  compute slices and the least memory (what stays free is free for the next application).
- `plan_steps` (pure): the destroys and creates that turn the current instances into the target,
  one instance per step, destroys first; instances in both are kept.
- `MigReconfigurer`: check -> change -> verify per step. The original layout is checkpointed (in
  memory and, with `state_path`, in a JSON file that survives a crash) before the first write and
  written back by `restore()`. An instance with processes is never destroyed: the step is skipped
  with reason IN_USE (and so is any create that needs its slices) and the result says the layout is
  incomplete, to be retried on a later tick. In dry-run the plan is logged and returned, nothing is
  written. Applying the layout the device already has makes zero writes. A device without MIG
  (NotSupported) or a caller without the privilege (NoPermission) turns the mechanism off for that
  device with one log line; other device errors propagate.

Acting ahead of need: a reconfiguration takes `mig_reconfig_s` (the simulator's, at least 6 s)
before new instances can run work. `needs_ahead` extends the 1-5 s P90 forecast to that lead time
with its trend (never downwards), and `MigScheduler.decide` reconfigures as soon as the larger of
the need now and the need at now + lead no longer fits the current layout; a layout that still
fits is kept (no churn). Limitation: the assignment of applications to instances is recomputed, not
pinned to where each application runs now; a move that needs a busy instance waits (IN_USE).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from vgpu.allocator.policy.base import MigOutcome
from vgpu.device.base import Device, GpuInstance
from vgpu.device.errors import InsufficientResources, InUse, NoPermission, NotSupported
from vgpu.device.skus import SKUS, LayoutSlot, MigLayout, MigProfile, Sku, layout_problem, valid_layouts
from vgpu.log import get_logger

MIN_RECONFIG_S = 6.0


@dataclass(frozen=True)
class MigNeed:
    """One application's need of a GPU instance: memory, and compute as a share of the whole GPU."""

    app_id: str
    mem_mib: float
    sm_pct: float = 0.0

    def __post_init__(self) -> None:
        if not (self.mem_mib >= 0 and math.isfinite(self.mem_mib)):
            raise ValueError(f"{self.app_id}: mem_mib must be a finite number >= 0")
        if not 0 <= self.sm_pct <= 100:
            raise ValueError(f"{self.app_id}: sm_pct must be in [0, 100]")


@dataclass(frozen=True)
class LayoutChoice:
    layout: MigLayout
    # app id -> the slot it goes into
    assignment: tuple[tuple[str, LayoutSlot], ...]
    changes: int  # instances destroyed + created to reach it from the current layout


def sku_for_device(device: Device) -> Sku:
    """The SKU table entry of a device (the simulator's own, or by product name); NotSupported when
    the model is unknown, since the planner cannot enumerate its layouts."""
    sku = getattr(device, "sku", None)
    if isinstance(sku, Sku):
        return sku
    for s in SKUS.values():
        if s.product_name == device.name:
            return s
    raise NotSupported(f"no MIG table for {device.name!r}")


def _slices_for(sku: Sku, sm_pct: float) -> int:
    return max(1, math.ceil(sm_pct / 100.0 * sku.compute_slices - 1e-9))


def _profile(sku: Sku, profile_id: int) -> MigProfile:
    """The profile of a slot of one of `valid_layouts(sku)`, which are made of the SKU's own profiles."""
    prof = sku.profile(profile_id)
    assert prof is not None, f"{sku.key} has no MIG profile {profile_id}"
    return prof


def _assign(sku: Sku, layout: MigLayout, needs: Sequence[MigNeed]) -> list[tuple[str, LayoutSlot]] | None:
    """Largest need first into the smallest free instance that fits it; None if one does not fit."""
    free = sorted(layout, key=lambda s: (_profile(sku, s.profile_id).mem_mib, s.start))
    out = []
    for need in sorted(needs, key=lambda n: (-n.mem_mib, -n.sm_pct, n.app_id)):
        want_slices = _slices_for(sku, need.sm_pct)
        for slot in free:
            prof = _profile(sku, slot.profile_id)
            if prof.mem_mib >= need.mem_mib and prof.slice_count >= want_slices:
                out.append((need.app_id, slot))
                free.remove(slot)
                break
        else:
            return None
    return out


def layout_of(instances: Sequence[GpuInstance]) -> MigLayout:
    return tuple(sorted(LayoutSlot(gi.placement.start, gi.profile_id) for gi in instances))


def choose_layout(sku: Sku, needs: Sequence[MigNeed], current: MigLayout = ()) -> LayoutChoice | None:
    """The layout for `needs` (one instance per application), or None if no valid layout fits them."""
    if len({n.app_id for n in needs}) != len(needs):
        raise ValueError("each application may appear once in the needs")
    cur = set(current)
    best: tuple[tuple[int, int, float, MigLayout], LayoutChoice] | None = None
    for layout in valid_layouts(sku):
        if len(layout) < len(needs):
            continue
        assignment = _assign(sku, layout, needs)
        if assignment is None:
            continue
        # instances nobody uses are not worth creating: keep only assigned slots plus kept ones
        used = {slot for _, slot in assignment}
        trimmed = tuple(s for s in layout if s in used or s in cur)
        if trimmed != layout:
            continue  # the trimmed layout is itself enumerated and will be scored
        changes = len(cur.symmetric_difference(layout))
        slices = sum(_profile(sku, s.profile_id).slice_count for s in layout)
        mem = sum(_profile(sku, s.profile_id).mem_mib for s in layout)
        key = (changes, slices, mem, layout)
        if best is None or key < best[0]:
            best = (key, LayoutChoice(layout, tuple(sorted(assignment)), changes))
    return None if best is None else best[1]


@dataclass(frozen=True)
class MigStep:
    kind: Literal["destroy", "create"]
    profile_id: int
    profile_name: str
    start: int
    size: int
    instance_id: int | None = None  # for destroys

    def describe(self) -> str:
        where = f"{self.profile_name} at {self.start}:{self.size}"
        return f"destroy GPU instance {self.instance_id} ({where})" if self.kind == "destroy" else f"create {where}"


def plan_steps(sku: Sku, current: Sequence[GpuInstance], target: MigLayout) -> tuple[MigStep, ...]:
    """Destroys (of instances not in the target), then creates (of target slots not present)."""
    problem = layout_problem(sku, target)
    if problem:
        raise ValueError(f"target layout is not valid on {sku.key}: {problem}")
    want = set(target)
    have = {LayoutSlot(gi.placement.start, gi.profile_id): gi for gi in current}
    steps: list[MigStep] = []
    for slot, gi in sorted(have.items()):
        if slot not in want:
            steps.append(MigStep("destroy", gi.profile_id, gi.profile_name, gi.placement.start,
                                 gi.placement.size, gi.instance_id))
    for slot in sorted(want - set(have)):
        prof = sku.profile(slot.profile_id)
        assert prof is not None
        place = prof.placement_at(slot.start)
        assert place is not None
        steps.append(MigStep("create", prof.profile_id, prof.name, slot.start, place.size))
    return tuple(steps)


def format_plan(device_id: str, steps: Sequence[MigStep]) -> str:
    if not steps:
        return f"{device_id}: MIG layout already as planned (no change)"
    lines = [f"{device_id}: MIG plan, {len(steps)} step(s), one GPU instance at a time"]
    lines += [f"  {i}. {s.describe()}" for i, s in enumerate(steps, start=1)]
    return "\n".join(lines)


@dataclass(frozen=True)
class MigApplyResult:
    device_id: str
    steps: tuple[MigStep, ...]  # what the plan was
    done: tuple[MigStep, ...]
    skipped: tuple[tuple[MigStep, str], ...]  # (step, why): "IN_USE ...", "blocked by ...", ...
    writes: int
    dry_run: bool
    disabled: str | None = None  # why the mechanism is off for the device

    @property
    def complete(self) -> bool:
        return self.disabled is None and not self.skipped and (self.dry_run or len(self.done) == len(self.steps))


def mig_outcome(result: MigApplyResult) -> MigOutcome:
    """The allocator's summary of one apply on a device where the mechanism was on: undone steps
    are the skipped ones, plus, when it turned itself off during the apply, the steps it never
    reached (at least 1)."""
    failed = len(result.skipped)
    reasons = [why for _, why in result.skipped]
    if result.disabled is not None:  # `MigLayoutMechanism.apply` calls this only while the device was on
        failed += max(1, len(result.steps) - len(result.done) - len(result.skipped))
        reasons.insert(0, f"off: {result.disabled}")
    return MigOutcome(changed=bool(result.done), failed_steps=failed, reason="; ".join(reasons))


def _overlaps(a_start: int, a_size: int, b_start: int, b_size: int) -> bool:
    return a_start < b_start + b_size and b_start < a_start + a_size


class MigReconfigurer:
    """Reaches a target layout on one device, one GPU instance per step (see the module doc)."""

    def __init__(
        self,
        device: Device,
        *,
        sku: Sku | None = None,
        state_path: str | Path | None = None,
        dry_run: bool = False,
        logger: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self.device = device
        self.dry_run = dry_run
        self._log = logger or get_logger("vgpu.allocator.mig")
        self._state_path = Path(state_path) if state_path is not None else None
        self._sku = sku
        self._original: MigLayout | None = None
        self.disabled: str | None = None
        self.writes = 0
        if self._state_path is not None and self._state_path.exists():
            self._original = self._load_checkpoint(self._state_path)

    @property
    def original(self) -> MigLayout | None:
        return self._original

    def _disable(self, reason: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            self._log.warning("mig_disabled", device=self.device.uuid, reason=reason)

    @staticmethod
    def _load_checkpoint(path: Path) -> MigLayout:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return tuple(sorted(LayoutSlot(int(s["start"]), int(s["profile_id"])) for s in data["layout"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: unreadable MIG checkpoint ({exc}); move it away to start afresh") from exc

    def _checkpoint(self, layout: MigLayout) -> None:
        if self._original is not None:
            return
        self._original = layout
        if self._state_path is not None:
            self._state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"device_id": self.device.uuid, "layout": [
                {"start": s.start, "profile_id": s.profile_id} for s in layout]}), encoding="utf-8")
            os.replace(tmp, self._state_path)
        self._log.info("mig_checkpoint", device=self.device.uuid, layout=[(s.start, s.profile_id) for s in layout])

    def current_layout(self) -> MigLayout:
        return layout_of(self.device.gpu_instances())

    def plan(self, target: MigLayout) -> tuple[MigStep, ...]:
        sku = self._sku or sku_for_device(self.device)
        return plan_steps(sku, self.device.gpu_instances(), target)

    def apply(self, target: MigLayout) -> MigApplyResult:
        dev_id = self.device.uuid
        if self.disabled is not None:
            return MigApplyResult(dev_id, (), (), (), 0, self.dry_run, self.disabled)
        try:
            if not self.device.mig_enabled():
                raise NotSupported("MIG mode is disabled on this GPU")
            current = self.device.gpu_instances()
            sku = self._sku or sku_for_device(self.device)
        except NotSupported as exc:
            self._disable(f"NotSupported: {exc}")
            return MigApplyResult(dev_id, (), (), (), 0, self.dry_run, self.disabled)
        steps = plan_steps(sku, current, target)
        if not steps:
            return MigApplyResult(dev_id, (), (), (), 0, self.dry_run)
        if self.dry_run:
            self._log.info("mig_plan", device=dev_id, dry_run=True, plan=format_plan(dev_id, steps))
            return MigApplyResult(dev_id, steps, (), (), 0, True)
        self._checkpoint(layout_of(current))
        busy = {p.gpu_instance_id for p in self.device.processes() if p.gpu_instance_id is not None}
        done: list[MigStep] = []
        skipped: list[tuple[MigStep, str]] = []
        kept: list[MigStep] = []  # destroys that did not happen: their slices stay taken
        writes_before = self.writes
        for step in steps:
            if step.kind == "destroy":
                if step.instance_id in busy:
                    skipped.append((step, "IN_USE: the instance has processes; retry later"))
                    kept.append(step)
                    continue
            else:
                blocker = next((k for k in kept if _overlaps(k.start, k.size, step.start, step.size)), None)
                if blocker is not None:
                    skipped.append((step, f"blocked by instance {blocker.instance_id} still in use"))
                    continue
            try:
                self._do(step)
            except InUse as exc:
                skipped.append((step, f"IN_USE: {exc}"))
                kept.append(step)
                continue
            except InsufficientResources as exc:
                skipped.append((step, f"INSUFFICIENT_RESOURCES: {exc}"))
                continue
            except (NoPermission, NotSupported) as exc:
                self._disable(f"{type(exc).__name__}: {exc}")
                return MigApplyResult(dev_id, steps, tuple(done), tuple(skipped), self.writes - writes_before,
                                      False, self.disabled)
            done.append(step)
        result = MigApplyResult(dev_id, steps, tuple(done), tuple(skipped), self.writes - writes_before, False)
        self._log.info("mig_applied", device=dev_id, done=len(done), skipped=len(skipped))
        return result

    def _do(self, step: MigStep) -> None:
        """One change, then verify it by reading the instances back."""
        self.writes += 1
        if step.kind == "destroy":
            assert step.instance_id is not None
            self.device.destroy_gpu_instance(step.instance_id)
            if any(gi.instance_id == step.instance_id for gi in self.device.gpu_instances()):
                raise _verify_failed(f"GPU instance {step.instance_id} still exists after destroying it")
        else:
            gi = self.device.create_gpu_instance(step.profile_id, step.start)
            found = [g for g in self.device.gpu_instances() if g.instance_id == gi.instance_id]
            if not found or found[0].profile_id != step.profile_id or found[0].placement.start != step.start:
                raise _verify_failed(f"created {step.describe()} but it does not read back")

    def restore(self) -> MigApplyResult | None:
        """Put the checkpointed layout back (None when nothing was ever changed). The checkpoint file
        is removed once the original layout is fully back."""
        if self._original is None:
            return None
        dry, self.dry_run = self.dry_run, False
        try:
            result = self.apply(self._original)
        finally:
            self.dry_run = dry
        if result.complete:
            self._original = None
            if self._state_path is not None and self._state_path.exists():
                self._state_path.unlink()
        return result


def _verify_failed(message: str) -> Exception:
    from vgpu.allocator.errors import VerifyFailed

    return VerifyFailed(message)


# ------------------------------------------------------------------------------------------------
# Acting ahead of need
# ------------------------------------------------------------------------------------------------
def needs_ahead(horizons_s: Sequence[int], p90: Sequence[float], lead_s: float) -> float:
    """The P90 need at `lead_s` ahead: the forecast itself within its horizons, beyond them the
    last horizon's value plus the least-squares trend over the horizons (a falling trend counts as
    flat). Never below the largest forecast value."""
    pts = [(float(h), float(v)) for h, v in zip(horizons_s, p90, strict=True) if not math.isnan(v)]
    if not pts:
        return math.nan
    peak = max(v for _, v in pts)
    last_h, last_v = pts[-1]
    if lead_s <= last_h or len(pts) < 2:
        return peak
    mh = sum(h for h, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    var = sum((h - mh) ** 2 for h, _ in pts)
    slope = sum((h - mh) * (v - mv) for h, v in pts) / var if var > 0 else 0.0
    return max(peak, last_v + max(slope, 0.0) * (lead_s - last_h))


@dataclass(frozen=True)
class MigScheduler:
    """Decides when a device's layout must change, `lead_s` ahead of the need."""

    sku: Sku
    reconfig_s: float = MIN_RECONFIG_S

    @property
    def lead_s(self) -> float:
        return max(self.reconfig_s, MIN_RECONFIG_S)

    def decide(self, current: MigLayout, now_needs: Sequence[MigNeed],
               ahead_needs: Sequence[MigNeed]) -> LayoutChoice | None:
        """The layout to start reaching now, or None to keep the current one.

        `ahead_needs` are the needs at now + lead_s (`needs_ahead`). Growth: when the current
        layout does not fit the larger of the two needs, change now, so the new instances are
        ready when the need arrives. A layout that fits both is kept."""
        ahead = {n.app_id: n for n in ahead_needs}
        merged = [
            MigNeed(n.app_id, max(n.mem_mib, ahead[n.app_id].mem_mib if n.app_id in ahead else 0.0),
                    max(n.sm_pct, ahead[n.app_id].sm_pct if n.app_id in ahead else 0.0))
            for n in now_needs
        ] + [n for n in ahead_needs if n.app_id not in {m.app_id for m in now_needs}]
        if _assign(self.sku, current, merged) is not None:
            return None
        return choose_layout(self.sku, merged, current)


def sku_for_name(name: str) -> Sku | None:
    """The SKU table entry of a product name ("NVIDIA A100-SXM4-40GB"), or None."""
    for s in SKUS.values():
        if s.product_name == name:
            return s
    return None


def plan_layout(sku: Sku, instances: Sequence[GpuInstance], now_needs: Sequence[MigNeed],
                ahead_needs: Sequence[MigNeed], reconfig_s: float = MIN_RECONFIG_S) -> LayoutChoice | None:
    """The layout a device in MIG mode should start reaching now for the needs now and at now +
    the reconfiguration time, or None to keep the one it has (`MigScheduler.decide`). Instances are
    kept where they can be (fewest changes first), and the reconfigurer never destroys a busy one."""
    return MigScheduler(sku, reconfig_s).decide(layout_of(instances), now_needs, ahead_needs)


# ------------------------------------------------------------------------------------------------
# The allocator's MigMechanism protocol (allocator/core.py): profile names per device
# ------------------------------------------------------------------------------------------------
def layout_for_profiles(sku: Sku, profiles: Sequence[str], current: MigLayout = ()) -> MigLayout:
    """A valid layout holding exactly these profile names ("3g.40gb", ...), the one that keeps the
    most current instances; InvalidArgument when no placement of them exists."""
    from vgpu.device.errors import InvalidArgument

    wanted = sorted(profiles)
    for name in wanted:
        if sku.profile_by_name(name) is None:
            raise InvalidArgument(f"{sku.key} has no MIG profile {name!r}")
    cur = set(current)
    best: tuple[int, MigLayout] | None = None
    for layout in valid_layouts(sku):
        if len(layout) != len(wanted):
            continue
        names = sorted(_profile(sku, s.profile_id).name for s in layout)
        if names != wanted:
            continue
        kept = len(cur.intersection(layout))
        if best is None or kept > best[0]:
            best = (kept, layout)
    if best is None:
        raise InvalidArgument(f"no valid placement of {', '.join(wanted) or 'nothing'} on {sku.key}")
    return best[1]


class MigLayoutMechanism:
    """One `MigReconfigurer` per device behind `vgpu.allocator.core.MigMechanism`:
    `apply(device, profile_names) -> MigOutcome` and `restore()`. `last` keeps each device's latest
    `MigApplyResult` for diagnostics (`vgpu` commands, tests); the allocator reads only the outcome."""

    def __init__(self, *, state_dir: str | Path | None = None, dry_run: bool = False,
                 logger: structlog.typing.FilteringBoundLogger | None = None) -> None:
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self.dry_run = dry_run
        self._log = logger
        self.reconfigurers: dict[str, MigReconfigurer] = {}
        self.last: dict[str, MigApplyResult] = {}

    def _for(self, device: Device) -> MigReconfigurer:
        rec = self.reconfigurers.get(device.uuid)
        if rec is None:
            path = self._state_dir / f"mig-{device.uuid}.json" if self._state_dir is not None else None
            rec = MigReconfigurer(device, state_path=path, dry_run=self.dry_run, logger=self._log)
            self.reconfigurers[device.uuid] = rec
        return rec

    def apply(self, device: Device, profiles: Sequence[str]) -> MigOutcome:
        rec = self._for(device)
        if rec.disabled is not None:
            return MigOutcome(False, 0, f"off: {rec.disabled}")
        try:
            sku = sku_for_device(device)
            target = layout_for_profiles(sku, profiles, rec.current_layout())
        except NotSupported as exc:
            rec._disable(f"NotSupported: {exc}")
            return MigOutcome(False, 1, f"off: {rec.disabled}")  # turned off now: counted once
        result = rec.apply(target)
        self.last[device.uuid] = result
        return mig_outcome(result)

    def restore(self) -> None:
        for rec in self.reconfigurers.values():
            rec.restore()
