"""Making room for a request out of the policy's own grants: pure logic, no I/O.

The predictive policy sizes the grants it manages (source "forecast", and a cold-start grant once
the policy resizes it) with margins, lead room and slow shrinks: elastic shaping that may fill a
device. A request an application makes itself (explicit memory, or a job the cold-start sizer sizes)
is a commitment. So when such a request does not fit in what is free, the allocator asks
`plan_reclaim` whether it fits once the managed grants give back their slack: what each holds above
its floor (`Slack`), the floor being what the application needs now (its usage plus a margin,
never below its usage; a cold-start grant also keeps the sizer's size). The allocator computes the
floors (allocator/core.py `Allocator._slacks`); this module only chooses the cuts.

Memory is taken lowest priority first, then from the largest slack first (as the policy's contention
rule yields memory strictly by priority). SM is time-sliced: it is taken lowest priority first and in
proportion to the slack within a priority (as the policy cuts SM shares). An SM share the request did
not ask for itself (the sizer's estimate of a job's SM use: `sm_elastic`) is trimmed to what is free
after the cuts rather than refused: a smaller share slows a job, it never fails it, and the policy
gives every application its share at its next plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-6


@dataclass(frozen=True)
class Slack:
    """A managed grant and the least it may be cut to (`*_floor_*`, at most what it holds)."""

    grant_id: str
    app_id: str
    priority: int
    memory_mib: float
    sm_pct: float
    mem_floor_mib: float
    sm_floor_pct: float

    @property
    def mem_slack_mib(self) -> float:
        return max(0.0, self.memory_mib - self.mem_floor_mib)

    @property
    def sm_slack_pct(self) -> float:
        return max(0.0, self.sm_pct - self.sm_floor_pct)


@dataclass(frozen=True)
class Cut:
    """One managed grant's new size."""

    grant_id: str
    app_id: str
    memory_mib: float
    sm_pct: float


@dataclass(frozen=True)
class ReclaimPlan:
    """The cuts that make room for a request on a device, and what the request is then granted."""

    device_id: str
    cuts: tuple[Cut, ...]
    memory_mib: float
    sm_pct: float
    mem_reclaimed_mib: float
    sm_reclaimed_pct: float
    # memory still free on the device once the cuts are made and the request granted
    mem_left_mib: float


def plan_reclaim(device_id: str, free_mem_mib: float, free_sm_pct: float, memory_mib: float, sm_pct: float,
                 slacks: Sequence[Slack], *, sm_elastic: bool = False) -> ReclaimPlan | None:
    """The cuts that let a request of `memory_mib` / `sm_pct` fit beside `free_*` on the device, or
    None when it does not fit even with every slack taken. Each cut leaves its grant at or above its
    floor; nothing is cut more than the request needs."""
    mem_need = max(0.0, memory_mib - free_mem_mib)
    mem_slack = sum(s.mem_slack_mib for s in slacks)
    if mem_need > mem_slack + _EPS:
        return None
    sm_need = max(0.0, sm_pct - free_sm_pct)
    sm_slack = sum(s.sm_slack_pct for s in slacks)
    if sm_need > sm_slack + _EPS and not sm_elastic:
        return None
    mem_cut = _memory_cuts(slacks, mem_need)
    sm_take = min(sm_need, sm_slack)
    sm_cut = _sm_cuts(slacks, sm_take)
    cuts = tuple(
        Cut(s.grant_id, s.app_id, s.memory_mib - mem_cut.get(s.grant_id, 0.0), s.sm_pct - sm_cut.get(s.grant_id, 0.0))
        for s in slacks if mem_cut.get(s.grant_id, 0.0) > 0 or sm_cut.get(s.grant_id, 0.0) > 0
    )
    granted_sm = min(sm_pct, max(0.0, free_sm_pct) + sm_take) if sm_elastic else sm_pct
    reclaimed = sum(mem_cut.values())
    return ReclaimPlan(device_id, cuts, memory_mib, granted_sm, reclaimed, sum(sm_cut.values()),
                       max(0.0, free_mem_mib + reclaimed - memory_mib))


def _memory_cuts(slacks: Sequence[Slack], need: float) -> dict[str, float]:
    """grant id -> MiB taken: lowest priority first, then the largest slack first."""
    cut: dict[str, float] = {}
    for s in sorted(slacks, key=lambda s: (s.priority, -s.mem_slack_mib, s.grant_id)):
        if need <= 0:
            break
        take = min(s.mem_slack_mib, need)
        if take > 0:
            cut[s.grant_id] = take
            need -= take
    return cut


def _sm_cuts(slacks: Sequence[Slack], need: float) -> dict[str, float]:
    """grant id -> SM points taken: lowest priority first, in proportion to the slack within a priority."""
    cut: dict[str, float] = {}
    ordered = sorted(slacks, key=lambda s: s.priority)
    for _, group in itertools.groupby(ordered, key=lambda s: s.priority):
        if need <= 0:
            break
        members = [s for s in group if s.sm_slack_pct > 0]
        total = sum(s.sm_slack_pct for s in members)
        if total <= 0:
            continue
        frac = min(1.0, need / total)
        for s in members:
            cut[s.grant_id] = s.sm_slack_pct * frac
        need -= total * frac
    return cut
