"""CPU of one allocator apply on a busy node, in process, and a digest of everything the applies did.

    python bench/apply_cost.py --apps 256 --applies 60 --json

The node of `bench/ingest.py --apps 256 --apps-per-stream 256`: one simulated H100, the daemon's
`ForecastPolicy` and hard-limit rule, every application's newest recommendation handed to
`Allocator.apply_recommendations` once a (simulated) second, as the manager does while its acting
budget holds applies to about one a second. The recommendations are seeded: each application's
memory use walks by up to 3 % a second around 150-450 MiB (the 256 of them fill the device, so
the device is over-committed and most grants are resized at every apply), SM use by up to 3 points.

Prints the thread CPU per apply (p10 / p50 / mean over `--applies`, after `--warmup` applies: by
then the policy's usage history is as long as it gets) and
the resizes per apply. `--digest` adds a SHA-256 over every apply's outcome: the report (grants
made and resized, in order), the events a watcher receives, the ledger changes handed to the store,
the plan's hard/cooperative decisions, the ledger after each apply and the per-application history
at the end, all with floats written exactly (`float.hex`). Two builds that make the same decisions
give the same digest (tests/test_apply_cost.py pins it); run it with `PYTHONPATH` pointing at
another tree to compare builds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu import log  # noqa: E402
from vgpu.allocator.core import AllocationEvent, Allocator, ApplyReport, Subscription, device_capacities  # noqa: E402
from vgpu.allocator.ledger import Grant, Ledger  # noqa: E402
from vgpu.allocator.policy.base import Recommendation, hard_limit_at_frac_for  # noqa: E402
from vgpu.allocator.policy.forecast import ForecastPolicy  # noqa: E402
from vgpu.device.sim import SimBackend  # noqa: E402

SKU = "h100-80gb"
START_S = 1_000_000.0


@dataclass
class FakeClock:
    """The node's clock: one simulated second per apply."""

    t_s: float = START_S

    def __call__(self) -> float:
        return self.t_s


@dataclass
class Node:
    """One simulated H100 with the daemon's allocator, and the seeded use of its applications."""

    clock: FakeClock
    allocator: Allocator
    device_id: str
    rng: random.Random
    mem_used_mib: list[float]
    sm_used_pct: list[float]
    stored: list[str] = field(default_factory=list)
    seq: int = 0


def _hex(x: float | None) -> str:
    return "-" if x is None else float(x).hex()


def _grant_text(g: Grant) -> str:
    return "|".join((g.grant_id, g.app_id, g.device_id, _hex(g.memory_mib), _hex(g.sm_pct), str(g.priority),
                     _hex(g.created_at_s), _hex(g.updated_at_s), g.source, str(g.pid), _hex(g.mem_updated_at_s),
                     _hex(g.cold_start_mib)))


def build_node(apps: int = 256, seed: int = 7, *, store: bool = False) -> Node:
    """The node before its first apply. With `store`, the allocator hands its changes to a store
    stand-in (`on_change`) that writes them down as the daemon's store would receive them."""
    clock = FakeClock()
    backend = SimBackend([SKU], clock=clock)
    counter = iter(range(1 << 30))
    ledger = Ledger(device_capacities(backend), clock=clock, id_factory=lambda: f"g{next(counter):05d}")
    policy = ForecastPolicy()
    stored: list[str] = []

    def save(led: Ledger) -> None:
        ch = led.changes()
        stored.append(";".join([*(_grant_text(g) for g in ch.grants), *ch.grants_removed,
                                *(repr(lim) for lim in ch.limits), *ch.limits_removed]))
        led.commit_changes()

    allocator = Allocator(backend, clock=clock, dry_run=False, policy=policy, ledger=ledger,
                          hard_limit_at_frac=hard_limit_at_frac_for("contended", policy.config.hard_limit_at_frac),
                          on_change=save if store else None)
    rng = random.Random(seed)
    node = Node(clock, allocator, sorted(c.device_id for c in ledger.devices())[0], rng,
                [rng.uniform(150, 450) for _ in range(apps)], [rng.uniform(0, 40) for _ in range(apps)])
    node.stored = stored
    return node


def next_recommendations(node: Node) -> list[Recommendation]:
    """Every application's next recommendation, a simulated second after the last."""
    node.clock.t_s += 1.0
    node.seq += 1
    out = []
    rng, now = node.rng, node.clock.t_s
    for i in range(len(node.mem_used_mib)):
        mem = node.mem_used_mib[i] = max(64.0, node.mem_used_mib[i] * rng.uniform(0.97, 1.03))
        sm = node.sm_used_pct[i] = min(100.0, max(0.0, node.sm_used_pct[i] + rng.uniform(-3, 3)))
        p90 = mem * rng.uniform(1.0, 1.2)
        out.append(Recommendation(
            app_id=f"app-{i:03d}", device_id=node.device_id, memory_mib=p90 * 1.1, sm_pct=sm * 1.1, source="model",
            mem_p90_peak_mib=p90, sm_p90_peak_pct=sm * 1.15, mem_used_mib=mem, sm_util_pct=sm, for_seq=node.seq,
            decided_at_s=now, mem_p50_peak_mib=mem, sm_p50_peak_pct=sm, first_use_s=now - 100.0))
    return out


def outcome_text(node: Node, report: ApplyReport, events: Iterable[AllocationEvent]) -> str:
    """What one apply did, written exactly (see the module docstring)."""
    alloc = node.allocator
    parts = ["created", *(_grant_text(g) for g in report.created), "resized", *(_grant_text(g) for g in report.resized),
             "power", *(repr(p) for p in report.power), f"mig {report.mig_changes}", "skipped", *report.skipped,
             "events"]
    parts += [f"{e.kind}|{_hex(e.at_s)}|{e.app_id}|{e.device_id}|{e.detail}|{e.mem_limit}|"
              f"{_grant_text(e.grant) if e.grant else '-'}" for e in events]
    parts += ["stored", *node.stored, "enforcement", *(repr(e) for _, e in sorted(alloc._plan_enforcement.items()))]
    parts += ["ledger", *(_grant_text(g) for g in alloc.ledger.grants())]
    parts.append(repr(sorted(alloc.counters.grant_changes.items())))
    node.stored.clear()
    return "\n".join(parts)


def history_text(node: Node) -> str:
    out = []
    for s in node.allocator.history.series():
        out.append(f"{s.app_id}|{s.device_id}|{s.overruns}|{s.ooms}")
        out += ["p " + " ".join(_hex(x) for x in (p.t_s, p.mem_used_mib, p.mem_p50_mib, p.mem_p90_mib,
                                                    p.mem_granted_mib, p.sm_used_pct, p.sm_p90_pct, p.sm_granted_pct))
                for p in s.points]
        out += [f"e {_hex(e.t_s)} {e.kind} {e.detail} {_hex(e.mem_granted_mib)}" for e in s.events]
    return "\n".join(out)


def run(*, apps: int = 256, applies: int = 60, warmup: int = 120, seed: int = 7, digest: bool = False,
        watch: bool = True) -> dict[str, Any]:
    """Time `applies` applies after `warmup` ones; with `digest`, hash every apply's outcome (a
    watcher subscribed when `watch`, so the events are part of it)."""
    node = build_node(apps, seed, store=digest)
    sub: Subscription | None = node.allocator.watch() if digest and watch else None
    h = hashlib.sha256()
    cpu_s: list[float] = []
    resized = 0
    for k in range(warmup + applies):
        recs = next_recommendations(node)
        started = time.thread_time()
        report = node.allocator.apply_recommendations(recs)
        took = time.thread_time() - started
        if k >= warmup:
            cpu_s.append(took)
            resized += len(report.resized)
        if digest:
            h.update(outcome_text(node, report, sub.drain_nowait() if sub is not None else ()).encode())
    if digest:
        h.update(history_text(node).encode())
    cpu_s.sort()
    out: dict[str, Any] = {
        "apps": apps, "applies": applies, "warmup": warmup, "seed": seed,
        "apply_cpu_ms_p10": round(cpu_s[len(cpu_s) // 10] * 1e3, 3) if cpu_s else None,
        "apply_cpu_ms_p50": round(cpu_s[len(cpu_s) // 2] * 1e3, 3) if cpu_s else None,
        "apply_cpu_ms_mean": round(sum(cpu_s) / len(cpu_s) * 1e3, 3) if cpu_s else None,
        "resized_per_apply": round(resized / applies, 2) if applies else None,
        "grants": len(node.allocator.ledger.grants()),
    }
    if digest:
        out["digest"] = h.hexdigest()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--apps", type=int, default=256)
    ap.add_argument("--applies", type=int, default=60)
    # the policy's usage history holds 120 s: from then on an apply costs what it costs for good
    ap.add_argument("--warmup", type=int, default=120)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--digest", action="store_true", help="also hash every apply's outcome (with a watcher)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    log.configure("console", "error")
    result = run(apps=args.apps, applies=args.applies, warmup=args.warmup, seed=args.seed, digest=args.digest)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
