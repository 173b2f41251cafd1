"""Reading a small file whole, with a size cap: the daemon's own files on disk (its token secret,
token files, the simulated GPUs' saved settings, the promotion log) are read at start or at each
call, and a file that is huge (damaged, or replaced by something else) must give a clear error
without reading gigabytes into memory first.

Standard library only: the client stub reads token files through it too.

The caps (each beside its reader, and listed in docs/reliability.md):
- the token secret: exactly `vgpu.auth.SECRET_BYTES` (32) bytes;
- a token file: `vgpu.tokenfile.MAX_TOKEN_FILE_BYTES` (4 KiB; a token is at most about 2.2 KB);
- `sim-devices.json`: `vgpu.device.simstate.MAX_STATE_BYTES` (16 MiB);
- `promotions.jsonl`: its newest `vgpu.manager.nodelearn.MAX_LOG_BYTES` (8 MiB) are read, the older
  part is skipped with one log line (`read_tail`); the log is rotated past 1 MiB, so only a damaged
  one comes near that.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class FileTooLarge(OSError):
    """A file over its cap; an OSError (EFBIG) so that a reader's handling of unreadable files
    names it, with `strerror` saying why."""

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        super().__init__(errno.EFBIG, f"larger than {max_bytes} bytes, the most this file may hold; not read",
                         str(path))
        self.max_bytes = max_bytes


def read_capped(path: str | Path, max_bytes: int) -> bytes:
    """The whole of `path`, at most `max_bytes` of it read: FileTooLarge when it holds more.
    Whatever open and read raise (FileNotFoundError, PermissionError) propagates."""
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLarge(path, max_bytes)
    return data


def read_tail(path: str | Path, max_bytes: int) -> tuple[bytes, int]:
    """(the last `max_bytes` of `path` from the first line that starts within them, the bytes
    skipped before that): for a log of lines whose newest part matters."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size <= max_bytes:
            data = fh.read(max_bytes + 1)
            if len(data) <= max_bytes:
                return data, 0
            size = max(os.fstat(fh.fileno()).st_size, len(data))  # grew since: its tail as it is now, below
        # from the byte before the window: a newline there means the window starts with a whole line
        before = size - max_bytes - 1
        fh.seek(before)
        data = fh.read(max_bytes + 1)
    cut = data.find(b"\n") + 1  # the line cut at the start is left out (none: all of it is)
    if cut == 0:
        return b"", before + len(data)
    return data[cut:], before + cut


__all__ = ["FileTooLarge", "read_capped", "read_tail"]
