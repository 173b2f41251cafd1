"""The in-app counters' bounds and the one check every reader applies to a counter's value.

Standard library only: the client stub, the profiler and the wire codec all read counters, and the
wire codec sits on the manager's forecasting path, which must not load gRPC and the client stub
(tens of MiB of resident memory: docs/performance.md) just to know a bound.
"""

from __future__ import annotations

import math

INT_COUNTERS = {"alloc_retries", "oom_count", "step", "requests_running", "requests_waiting", "tokens_in_flight"}
# The largest sane value of each in-app counter. Above it a value is corrupt, not large: no GPU holds
# 16 TiB, no engine keeps ten million requests in flight, and a cumulative count past 2**53 is no
# longer exact as a double. Every reader of the counters (the client stub, the profiler reading the file,
# the manager reading the wire) drops a value that is not finite, negative or above its bound.
MAX_INAPP_MIB = float(2**24)
MAX_INAPP_REQUESTS = 10_000_000.0
MAX_INAPP_TOKENS = 1e10
MAX_INAPP_COUNT = float(2**53)
INAPP_MAX: dict[str, float] = {
    "torch_allocated_mib": MAX_INAPP_MIB,
    "torch_reserved_mib": MAX_INAPP_MIB,
    "torch_active_mib": MAX_INAPP_MIB,
    "alloc_retries": MAX_INAPP_COUNT,
    "oom_count": MAX_INAPP_COUNT,
    "step": MAX_INAPP_COUNT,
    "applied_mem_limit_mib": MAX_INAPP_MIB,
    "requests_running": MAX_INAPP_REQUESTS,
    "requests_waiting": MAX_INAPP_REQUESTS,
    "kv_used_mib": MAX_INAPP_MIB,
    "kv_total_mib": MAX_INAPP_MIB,
    "tokens_in_flight": MAX_INAPP_TOKENS,
}


def inapp_value_problem(name: str, value: object) -> str | None:
    """Why `value` is no usable value of the in-app counter `name` (None when it is one). The reason
    never quotes the value, so reasons counted by name stay a small, fixed set."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "not a number"
    if isinstance(value, float) and not math.isfinite(value):
        return "not finite"
    # an int is compared exactly: JSON allows any number of digits, and one past a double's range
    # would raise OverflowError in a conversion to float
    if value < 0:
        return "negative"
    if value > INAPP_MAX[name]:
        return f"above {INAPP_MAX[name]:g}"
    return None
