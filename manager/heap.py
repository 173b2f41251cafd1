"""Keep the C heap's freed memory between forecast rounds (glibc only).

A forecast round builds its features from every sample of the applications it forecasts: numpy
temporaries of a few hundred KiB to a few MiB each (76,800 samples x 8 bytes for 64 applications
with 120 s of 100 ms samples), freed at the end of the round. glibc's malloc returns the freed top
of its heap to the kernel once it exceeds the trim threshold, and takes memory above the mmap
threshold straight from the kernel and gives it back on free. Both thresholds move with what the
process has freed before (glibc's dynamic rule), so whether a round's temporaries stay mapped depends
on the process's history: with an ONNX Runtime session loaded, every round grew the heap by about
7 MiB and gave it back, and the feature encoding paid some 1,700 page faults per round, more than
half its CPU time (docs/performance.md).

`hold_heap` fixes both thresholds (`mallopt`), at 16 MiB for mmap and 8 MiB for trimming: values
inside the range glibc's own dynamic rule may reach (up to 32 MiB and twice that), so the process
holds at most 8 MiB of freed heap top, enough for a 64-application round's temporaries (about 7 MiB;
a round faults a few dozen pages more than with 32 MiB held, against thousands with the heap given
back), and allocations of 16 MiB or more are still mapped and unmapped on their own. A larger trim
threshold saves those few faults and keeps whatever else the process frees at its heap top resident:
with 32 MiB a simulated day (bench/soak.py) held 20 MiB more than with glibc's own rule, with 8 MiB
none that shows (328.0 against 328.2 MiB). Where an operator set malloc's own environment
(`MALLOC_*_` variables or glibc tunables) that setting is left as it is; on a C library other than
glibc nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Callable, Mapping
from typing import Protocol

from vgpu.log import get_logger

_log = get_logger("vgpu.manager.heap")

# mallopt's parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 16 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 8 * 1024 * 1024
# what an operator sets to tune glibc's malloc; any of them present: theirs stands
_OPERATOR_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


class Libc(Protocol):
    """What `hold_heap` uses of the C library."""

    def mallopt(self, param: int, value: int) -> int: ...


def glibc() -> Libc | None:
    """The process's glibc, or None on another C library."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    lib: Libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return lib


def operator_set(environ: Mapping[str, str]) -> bool:
    """Whether the environment tunes glibc's malloc itself."""
    return any(v in environ for v in _OPERATOR_VARS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def hold_heap(
    *,
    environ: Mapping[str, str] = os.environ,
    libc: Callable[[], Libc | None] = glibc,
    mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES,
) -> bool:
    """Fix glibc's mmap and trim thresholds (see the module docstring). Returns whether they were
    set: False on another C library, where the operator's environment tunes malloc, or where
    `mallopt` refused. Idempotent; process-wide."""
    if operator_set(environ):
        return False
    lib = libc()
    if lib is None:
        return False
    ok = (lib.mallopt(M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
          and lib.mallopt(M_TRIM_THRESHOLD, trim_threshold_bytes) == 1)
    if not ok:
        _log.warning("heap_thresholds_refused", mmap_threshold_bytes=mmap_threshold_bytes,
                     trim_threshold_bytes=trim_threshold_bytes)
    return ok
