"""bench/apply_cost.py: what the allocator's applies decide on a busy node is pinned.

The digests below were recorded with the allocator as it was before its apply was made cheaper
(main at 5c28aa0: exact totals as `Fraction`s, per-application scans of a device's grants, an
event object per resize whether or not anyone watched) and are what the cheaper apply gives too:
the same grants made and resized in the same order, the same events, the same changes stored,
the same hard/cooperative decisions and history, floats to the last bit. They were recorded again
once when the predictive policy began to give a one-second jump's extrapolated grant back
(`ramp_jump_release`): with that rule off the apply gives the earlier digests to the last bit. The
watched 256-application digest was recorded again when an event's `mem_limit` began to say what
is in force on the application's processes rather than the device's decision: this node has no
cgroup mechanism and no pids, so its events say "cooperative" where the over-committed device used
to make them say "hard"; the grants, stores and decisions (the unwatched digests) are unchanged. All five were recorded again
when a resize's event detail (which the history keeps, so the unwatched digests hash it too) began to
end with the plan's rules, "(memory: ramp, SM: forecast)": with that text left out the apply gives the
digests before it, so no decision changed. A digest
that changes means a decision changed: if that is intended (a policy change), record the new ones with
`python bench/apply_cost.py --apps N --applies K --warmup 0 --digest --json` and say why in the
commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import apply_cost  # noqa: E402

GOLDEN = {
    # (applications, applies, a watcher subscribed): digest
    (64, 20, True): "8ee980ea3af73a4275a4e88057f4118b824fa8ad6d2e1200e85bb61bf685c40a",
    (64, 20, False): "e38e7fcc408796fa58de0b317794141121526e90f815425a4e9942529f76271e",
    # past the policy's 30 s window of recent peak usage
    (64, 50, False): "1602dc6c8ea3c57e7fdc37cbd372c1b77bec661266a9252479103a313372b2c6",
    (256, 15, True): "a21e6eb45233d0f949d7db6509c83094aaf8655b54490582a8b10781e04613b7",
    (256, 15, False): "5b7e01d07624a1d07a372cd5c8c1d18780855dbad4fdf65a62d61264f1be2150",
}


@pytest.mark.parametrize(("apps", "applies", "watch"), sorted(GOLDEN))
def test_applies_decide_what_they_decided_before(apps: int, applies: int, watch: bool) -> None:
    result = apply_cost.run(apps=apps, applies=applies, warmup=0, digest=True, watch=watch)
    assert result["grants"] == apps
    if apps == 256:
        assert result["resized_per_apply"] > 100  # the over-committed device: most grants move every apply
    assert result["digest"] == GOLDEN[(apps, applies, watch)]


def test_the_digest_sees_a_change_of_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Carrying out the same plan in another order (growth before shrinks) gives another digest."""
    base = apply_cost.run(apps=64, applies=5, warmup=0, digest=True)["digest"]
    node = apply_cost.build_node(64, store=True)
    alloc = node.allocator
    original = alloc._shrinks_first
    monkeypatch.setattr(alloc, "_shrinks_first", lambda targets: list(reversed(original(targets))))
    sub = alloc.watch()
    h = hashlib.sha256()
    for _ in range(5):
        report = alloc.apply_recommendations(apply_cost.next_recommendations(node))
        h.update(apply_cost.outcome_text(node, report, sub.drain_nowait()).encode())
    h.update(apply_cost.history_text(node).encode())
    assert h.hexdigest() != base


def test_the_bench_prints_its_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert apply_cost.main(["--apps", "16", "--applies", "3", "--warmup", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["apps"] == 16 and out["applies"] == 3 and out["apply_cpu_ms_p50"] > 0 and "digest" not in out
