"""Removing in-app reports whose process is gone.

A client stub removes its report (`<inapp_dir>/<pid>.json`, or `<pid>.<token>.json`) when it closes
or its interpreter exits, but a process killed with SIGKILL, or by the OOM killer, leaves it behind,
and so does one killed while writing (the temporary `.<name>.<random>` beside it). Readers ignore a
report older than `INAPP_MAX_AGE_S`, so nothing reads a wrong counter; the files still pile up on a
node that runs for months, each listing of the directory (`InAppFinder`) reads them, and a later
process of another user that gets the same pid finds its usual name taken and reports under a name
that must be found by listing.

`InAppSweeper.sweep` removes a file only when all of these hold:
- its name is one the stubs write (`<pid>.json`, `<pid>.<32 hex>.json`, or their temporary
  `.<that name>.<suffix>`); anything else in the directory is left alone;
- it is not a directory, and was last written more than `older_than_s` ago (a live stub rewrites its
  report every second, so a report that old is not being written);
- for a report: no process has its pid now, or the one that has it started after the file was last
  written (the pid was reused). A process that still runs and stopped writing (stopped with SIGSTOP,
  say) keeps its report. A temporary file that old is debris whatever runs at its pid.

One sweep reads at most `scan_entries` directory entries, going on where the last one stopped, so a
directory filled with entries costs each sweep a bounded amount. The directory is the daemon's
(it creates it: `prepare_inapp_dir`), so the sticky bit lets it remove other users' files there; a
file it may not remove (a directory made by someone else) is left and counted.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from vgpu.client import INAPP_REPORT_NAME, MAX_INAPP_SCAN_ENTRIES

# Reports not rewritten for this long, of processes that are gone, are removed (a stub rewrites its
# own every second; readers already ignore one older than INAPP_MAX_AGE_S).
INAPP_SWEEP_AGE_S = 60.0
# How often the daemon sweeps.
INAPP_SWEEP_EVERY_S = 60.0
# A report written before its process started by less than this is not told apart from one written
# at the start: psutil's start times come from a boot time in whole seconds.
_START_SLACK_S = 1.0

# write_atomically's temporary file beside a report: mkstemp(prefix=".<name>.")
_TEMP_NAME = re.compile(rf"\.{INAPP_REPORT_NAME.pattern}\.[A-Za-z0-9_]{{1,32}}")


def process_start_s(pid: int) -> float | None:
    """When process `pid` started (Unix s), or None when there is no such process."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError, ValueError):
        return None


@dataclass
class SweepResult:
    removed: int = 0
    kept_running: int = 0  # reports of processes that still run but write no more
    not_removable: int = 0
    entries: int = 0  # directory entries read


class InAppSweeper:
    """See the module docstring. Not thread-safe: one sweep at a time (the daemon's one task)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        older_than_s: float = INAPP_SWEEP_AGE_S,
        scan_entries: int = MAX_INAPP_SCAN_ENTRIES,
        process_start: Callable[[int], float | None] = process_start_s,
    ) -> None:
        if older_than_s <= 0 or scan_entries < 1:
            raise ValueError("older_than_s must be > 0 and scan_entries >= 1")
        self.directory = Path(directory)
        self.older_than_s = older_than_s
        self._scan_entries = scan_entries
        self._process_start = process_start
        self._entries: Iterator[os.DirEntry[str]] | None = None

    def sweep(self, now_s: float) -> SweepResult:
        """One bounded step over the directory (`now_s`: the wall clock, as file times are)."""
        result = SweepResult()
        while result.entries < self._scan_entries:
            if self._entries is None:
                try:
                    self._entries = os.scandir(self.directory)
                except OSError:
                    return result  # no directory (yet): nothing to sweep
            try:
                entry = next(self._entries)
            except StopIteration:
                self._entries = None
                break  # the listing is done; the next sweep starts it again
            except OSError:
                self._entries = None
                break
            result.entries += 1
            self._look_at(entry, now_s, result)
        return result

    def _look_at(self, entry: os.DirEntry[str], now_s: float, result: SweepResult) -> None:
        name = entry.name
        report = INAPP_REPORT_NAME.fullmatch(name)
        temp = None if report else _TEMP_NAME.fullmatch(name)
        if report is None and temp is None:
            return
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return  # gone meanwhile
        if stat.S_ISDIR(st.st_mode) or now_s - st.st_mtime <= self.older_than_s:
            return
        if report is not None:
            started = self._process_start(int(report.group(1)))
            if started is not None and started <= st.st_mtime + _START_SLACK_S:
                result.kept_running += 1  # its process still runs: its own report, not written lately
                return
        try:
            os.unlink(os.path.join(self.directory, name))
        except FileNotFoundError:
            return
        except OSError:
            result.not_removable += 1
            return
        result.removed += 1
