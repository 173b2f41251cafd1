"""The daemon's heap and Python's cyclic garbage collector.

A full (generation 2) collection walks every object the collector tracks, and runs on whichever
thread happens to allocate when it is due: in the daemon that is mostly the event loop, in the
middle of an ingest or an allocator apply. What a daemon holds after start-up (the imported
modules, the forecaster's runtime, gRPC, the configuration) is about 200,000 tracked objects that
never become garbage, and a full collection over them stalled the loop 70-190 ms on the shared
2-core development machine (docs/performance.md, *A decision never waits behind the collector*): every
profiler batch that arrived meanwhile waited, and the decisions they carried blew their latency budget.

`freeze_startup_heap()` collects once, then moves every object alive now into the collector's
permanent generation (`gc.freeze`), which no collection walks. Later full collections walk only what
the daemon made since, a few thousand objects at 256 applications. Objects frozen here are never freed
by the cyclic collector, so it is called once, when start-up is over: a start-up object that later
becomes cyclic garbage is kept (reference counting still frees the rest).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze every object alive now out of the collector's
    reach. Returns how many objects the permanent generation holds afterwards."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
