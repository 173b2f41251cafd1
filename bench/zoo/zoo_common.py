"""What every zoo job shares: arguments, the device, reporting in-app counters through vgpu's client
stub (PyTorch allocator counters and the step) so `vgpu record` writes them beside NVML's."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test)")
    p.add_argument("--seconds", type=float, default=300.0, help="stop after this long (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--app-id", default=None, help="the id the in-app counters carry (default: the job's name)")
    p.add_argument("--inapp-dir", default=None, help="where the client stub writes counters (default vgpu's)")
    return p


@contextmanager
def vgpu_client(app_id: str, inapp_dir: str | None) -> Iterator[Any]:
    """vgpu's client stub reporting this process's counters every second (no daemon needed: it only
    writes the in-app file the profiler reads); a no-op where vgpu is not importable."""
    try:
        from vgpu.client import VgpuClient
    except ImportError:
        yield None
        return
    kw: dict[str, Any] = {"watch": False}
    if inapp_dir:
        kw["inapp_dir"] = inapp_dir
    client = VgpuClient(app_id, **kw)
    try:
        yield client
    finally:
        client.close()


class Clock:
    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.seconds = seconds

    def running(self) -> bool:
        return time.monotonic() - self.start < self.seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start
