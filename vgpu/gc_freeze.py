"""A long-running vgpu process's start-up heap and Python's cyclic garbage collector.

A full (generation 2) collection walks every object the collector tracks, and runs on whichever
thread happens to allocate when it is due: in the daemon that is mostly the event loop, in the
middle of an ingest or an allocator apply. What the manager's process holds once started (the
imported modules, the forecaster's runtime, gRPC, the configuration) is about 200,000 tracked
objects that never become garbage; a full collection over them stalled the loop 134-165 ms on the
shared 2-core development machine (docs/performance.md, *The busy node's decision tail*), and every
profiler batch that arrived meanwhile waited, with the decisions it brought. The profiler's own
full collections (14-30 ms) delayed its sends the same way.

`freeze_startup_heap()` collects once, then moves every object alive now into the collector's
permanent generation (`gc.freeze`), which no collection walks. Later full collections walk only what
the process made since, a few thousand objects in the manager at 256 applications. Objects frozen
here are never freed by the cyclic collector, so it is called once, when start-up is over: a
start-up object that later becomes cyclic garbage is kept (reference counting still frees the rest).
`vgpu serve` and `vgpu profiler` call it, and `thaw_heap()` when they stop, so that a process that
goes on after them (a test run, an embedding program) gets its collector back whole. (The C heap is
another matter: manager/heap.py.)

`freeze_for_exit()` is for a process that is about to end: the interpreter's exit runs one more full
collection over everything still alive, which frees nothing the operating system does not take back
anyway. With torch and the forecaster loaded that collection took 0.4-1.1 s of every `vgpu serve`
stop on the shared 2-core development machine (docs/performance.md, *A daemon's start and stop*).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze every object alive now out of the collector's
    reach. Returns how many objects the permanent generation holds afterwards."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (its oldest generation), as before the freeze."""
    gc.unfreeze()


def freeze_for_exit() -> None:
    """Move every object alive now out of the collector's reach, just before the process exits, so the
    interpreter's final full collection has nothing to walk. Exit handlers (atexit, weakref.finalize)
    still run and the standard streams are still flushed; only cyclic garbage is left to the operating
    system. Only for a process's last step: nothing here is ever thawed."""
    gc.freeze()
