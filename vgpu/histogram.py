"""A fixed-bucket latency histogram: plain counts, no I/O, no locks (one writer thread, readers
that tolerate a count read mid-update), for the daemon's metrics to export as a Prometheus
histogram at scrape time."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# Seconds: from half a millisecond (a baseline forecast of a few applications) to 2.5 s.
LATENCY_BUCKETS_S: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class LatencyHistogram:
    """Counts per upper bound (`le`, cumulative when read with `cumulative()`), their sum and count."""

    bounds_s: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)  # one per bound, then +Inf; not cumulative
    sum_s: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds_s) != sorted(set(self.bounds_s)) or not self.bounds_s:
            raise ValueError(f"bucket bounds must be increasing and distinct, got {self.bounds_s}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds_s) + 1)

    def observe(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.counts[bisect.bisect_left(self.bounds_s, seconds)] += 1
        self.sum_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) per bound and "+Inf", as Prometheus lists them."""
        out, total = [], 0
        for bound, n in zip((*(repr(float(b)) for b in self.bounds_s), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


__all__ = ["LATENCY_BUCKETS_S", "LatencyHistogram"]
