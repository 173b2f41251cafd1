"""Lead time of grant increases: how far ahead of a rise in usage the grant had already grown.

Pure, shared by bench/replay.py and `vgpu demo`. Per application, `used[k]` is the usage and
`granted[k]` the grant in force during sample k (NaN: none yet). A *rise* is a sample whose usage is
over the previous one by more than `rise_frac` and over the grant in force `window` samples
earlier (or at the first sample; no grant counts as 0). Its *lead* is how many samples before the
rise the grant had grown to cover it and held since: 0 when it covered it only at the rise itself,
negative when only after (never covered: minus the samples left). Each rise also carries how many
samples the usage had been rising just before it, so rises a forecast could see (a ramp of at least
2 samples) can be told from sudden steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LEAD_WINDOW = 5
RISE_FRAC = 0.01
VISIBLE_RAMP = 2


def lead_times(used: Sequence[float], granted: Sequence[float], window: int = LEAD_WINDOW,
               rise_frac: float = RISE_FRAC) -> list[tuple[int, int]]:
    """(lead, samples of rising usage before the rise) for each rise (see the module doc)."""
    if len(used) != len(granted):
        raise ValueError("used and granted need one value per sample")
    n = len(used)
    out: list[tuple[int, int]] = []
    ramp = 0
    for k in range(1, n):
        rising = used[k] > used[k - 1] * (1 + rise_frac) and used[k] > used[k - 1]
        before = ramp
        ramp = ramp + 1 if rising else 0
        if not rising:
            continue
        g0 = granted[max(k - window, 0)]
        if used[k] <= (0.0 if math.isnan(g0) else g0):
            continue
        need = used[k]
        if granted[k] >= need:
            j = k
            while j - 1 > max(k - window, -1) and granted[j - 1] >= need:
                j -= 1
            out.append((k - j, before))
        else:
            later = next((j for j in range(k + 1, n) if granted[j] >= need), n)
            out.append((k - later, before))
    return out


@dataclass(frozen=True)
class LeadSummary:
    rises: int
    median: float | None  # over every rise, in samples
    rises_visible: int
    median_visible: float | None  # over rises after at least VISIBLE_RAMP samples of ramp
    ahead_frac_visible: float | None  # share of those covered at least one sample ahead


def summarize(leads: Sequence[tuple[int, int]], visible_ramp: int = VISIBLE_RAMP) -> LeadSummary:
    def median(values: list[int]) -> float | None:
        if not values:
            return None
        s = sorted(values)
        mid = len(s) // 2
        return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2.0

    visible = [lead for lead, ramp in leads if ramp >= visible_ramp]
    return LeadSummary(
        rises=len(leads),
        median=median([lead for lead, _ in leads]),
        rises_visible=len(visible),
        median_visible=median(visible),
        ahead_frac_visible=round(sum(v >= 1 for v in visible) / len(visible), 4) if visible else None,
    )
