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

The daemon runs as root and removes files, so it sweeps only a directory no other user controls
(`inapp_dir_problem`: not a symbolic link, owned by the daemon's user or root, not writable by
others unless sticky), and only through a descriptor: the directory is opened once (O_NOFOLLOW)
and listed, examined and unlinked relative to that descriptor, so a name swapped for a symbolic link
later cannot lead a removal elsewhere. Each sweep first checks that the configured path still names
the directory held; when it does not, the sweep is skipped (`SweepResult.skipped` says why) and the
next one opens the path afresh, with the same checks.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from vgpu.client import INAPP_REPORT_NAME, MAX_INAPP_SCAN_ENTRIES

# How the held directory is opened: never through a symbolic link, and not inherited by children.
_OPEN_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

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


def inapp_dir_problem(st: os.stat_result, euid: int) -> str | None:
    """Why a directory whose lstat is `st` is not one a daemon running as `euid` may read in-app
    reports from and remove files in, or None when it may: another user who controls it could point
    it elsewhere or replace the reports in it."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid not in (euid, 0):
        return f"it is owned by uid {st.st_uid}, not by the daemon's user (uid {euid}) or root"
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return f"its mode is {mode:04o}: writable by other users without the sticky bit (it should be 1777)"
    return None


def inapp_dir_shuts_out_others(st: os.stat_result) -> str | None:
    """Why applications of users other than the directory's owner cannot write their in-app reports
    there (it is sound, but not 1777), or None when every user's can."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH and mode & stat.S_IXOTH:
        return None
    return (f"its mode is {mode:04o}: only applications of uid {st.st_uid}"
            f"{' and its group' if mode & stat.S_IWGRP else ''} can write their in-app reports there "
            "(1777 lets every user's)")


def process_start_s(pid: int) -> float | None:
    """When process `pid` started (Unix s), or None when there is no such process."""
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError, ValueError):
        return None


class _Listing(Protocol):
    """What `os.scandir` returns: the entries, and `close` to let a listing go before its end."""

    def __next__(self) -> os.DirEntry[str]: ...

    def close(self) -> None: ...


@dataclass
class SweepResult:
    removed: int = 0
    kept_running: int = 0  # reports of processes that still run but write no more
    not_removable: int = 0
    entries: int = 0  # directory entries read
    skipped: str | None = None  # why nothing was swept: the directory is not one to sweep (see the module docstring)


class InAppSweeper:
    """See the module docstring. One sweep at a time: `sweep` runs in a worker thread and `close`
    waits for it."""

    def __init__(
        self,
        directory: str | Path,
        *,
        older_than_s: float = INAPP_SWEEP_AGE_S,
        scan_entries: int = MAX_INAPP_SCAN_ENTRIES,
        process_start: Callable[[int], float | None] = process_start_s,
        euid: int | None = None,
    ) -> None:
        if older_than_s <= 0 or scan_entries < 1:
            raise ValueError("older_than_s must be > 0 and scan_entries >= 1")
        self.directory = Path(directory)
        self.older_than_s = older_than_s
        self._scan_entries = scan_entries
        self._process_start = process_start
        self._euid = os.geteuid() if euid is None else euid
        self._fd: int | None = None  # the directory held, opened without following links
        self._held: tuple[int, int] | None = None  # its (st_dev, st_ino)
        self._entries: _Listing | None = None
        self._lock = threading.Lock()

    def sweep(self, now_s: float) -> SweepResult:
        """One bounded step over the directory (`now_s`: the wall clock, as file times are)."""
        with self._lock:
            result = SweepResult()
            result.skipped = self._hold()
            if result.skipped is not None or self._fd is None:
                return result
            while result.entries < self._scan_entries:
                if self._entries is None:
                    try:
                        self._entries = os.scandir(self._fd)
                    except OSError:
                        return result
                try:
                    entry = next(self._entries)
                except StopIteration:
                    self._entries = None
                    break  # the listing is done; the next sweep starts it again
                except OSError:
                    self._entries = None
                    break
                result.entries += 1
                self._look_at(self._fd, entry, now_s, result)
            return result

    def close(self) -> None:
        """Let the directory go (after a sweep under way ends); a later sweep opens it again."""
        with self._lock:
            self._let_go()

    def _hold(self) -> str | None:
        """Make sure the descriptor held is the directory the path names now: open it when none is
        held, let go of one the path no longer names. Why this sweep must not go on, or None (also
        when there is no directory: nothing to sweep, nothing to warn of)."""
        try:
            now = os.lstat(self.directory)
        except OSError:
            self._let_go()
            return None  # no directory (yet): nothing to sweep
        if self._fd is not None and (now.st_dev, now.st_ino) != self._held:
            self._let_go()
            return f"{self.directory} no longer names the directory the daemon opened; the next sweep opens it again"
        if self._fd is not None:
            return None
        problem = inapp_dir_problem(now, self._euid)
        if problem is not None:
            return f"{self.directory}: {problem}"
        try:
            fd = os.open(self.directory, _OPEN_DIR_FLAGS)
        except OSError as exc:
            return f"{self.directory}: cannot open it ({exc.strerror or exc})"
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):  # replaced between the look and the open
            os.close(fd)
            return f"{self.directory} was replaced while it was opened; the next sweep opens it again"
        self._fd, self._held = fd, (st.st_dev, st.st_ino)
        return None

    def _let_go(self) -> None:
        if self._entries is not None:
            self._entries.close()
            self._entries = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._held = None

    def _look_at(self, fd: int, entry: os.DirEntry[str], now_s: float, result: SweepResult) -> None:
        # `entry` comes from listing `fd`: its stat is relative to that descriptor, as the unlink is
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
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return
        except OSError:
            result.not_removable += 1
            return
        result.removed += 1
