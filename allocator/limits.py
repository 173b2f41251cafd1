"""Per-application limits: the cooperative memory limit, MPS thread percentage, NVML memory limits.

Three mechanisms, each optional and each degrading cleanly where the node lacks it:

1. **Cooperative memory limit** (`MemoryLimitBook`, pure bookkeeping): the grant's memory is the
   limit the client stub (vgpu/client.py) applies itself through
   `torch.cuda.set_per_process_memory_fraction(limit / total)` when it sees the grant on
   `WatchAllocations`; it reports what it applied in its in-app counters (`applied_mem_limit_mib`).
   The book records what was published and what each client says it applied, so `vgpu apps` and
   the allocator can tell an application that follows its limit from one that does not (no torch,
   no CUDA, an old stub).
2. **MPS active-thread percentage** (`MpsControl`): where an MPS control daemon runs, new clients
   get `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (`client_env`), and the daemon's default for new clients is
   set through its control pipe (`set_default_active_thread_percentage`, check -> change -> verify,
   the original read and saved first, restored by `restore()`). Detection: the pipe directory
   (`CUDA_MPS_PIPE_DIRECTORY`, default /tmp/nvidia-mps) has a `control` pipe and
   `nvidia-cuda-mps-control` is on PATH. Absent: NotSupported, logged once, the mechanism is off.
3. **NVML cgroup memory limits** (`CgroupMemoryLimits`): `nvmlDeviceSetMemoryLimits_v1` (driver
   R615+) caps the GPU memory of a cgroup. Only the device layer talks to NVML, so this asks the
   device for `set_memory_limit_mib(cgroup, soft_mib, hard_mib)` and `memory_limit_mib(cgroup)`;
   a device without them (the current NVML and simulated backends) or a driver that answers
   NotSupported turns the mechanism off with one log line. Writes otherwise fail loudly.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import structlog

from allocator.errors import VerifyFailed
from vgpu.device.base import Device
from vgpu.device.errors import DeviceError, NoPermission, NotSupported
from vgpu.log import get_logger

DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"
MPS_CONTROL = "nvidia-cuda-mps-control"


# ------------------------------------------------------------------------------------------------
# 1. Cooperative memory limit
# ------------------------------------------------------------------------------------------------
def memory_fraction(limit_mib: float, device_total_mib: float) -> float:
    """The fraction for `torch.cuda.set_per_process_memory_fraction`: limit / total, in (0, 1]."""
    if not (device_total_mib > 0 and math.isfinite(device_total_mib)):
        raise ValueError(f"device total must be a positive number of MiB, got {device_total_mib}")
    if not (limit_mib > 0 and math.isfinite(limit_mib)):
        raise ValueError(f"a memory limit must be a positive number of MiB, got {limit_mib}")
    return min(1.0, limit_mib / device_total_mib)


@dataclass(frozen=True)
class LimitStatus:
    app_id: str
    published_mib: float | None  # the limit the allocator granted
    applied_mib: float | None  # what the client reported applying (None: nothing reported / applied)
    # "applied" (within tolerance), "pending" (not reported yet), "not applied" (the client reports
    # no limit), "mismatch" (the client applied something else)
    state: str


class MemoryLimitBook:
    """Published limits beside what each client says it applied (pure, no I/O)."""

    def __init__(self, tolerance_mib: float = 1.0) -> None:
        self.tolerance_mib = tolerance_mib
        self._published: dict[str, float] = {}
        self._applied: dict[str, float | None] = {}

    def publish(self, app_id: str, limit_mib: float) -> None:
        if not (limit_mib > 0 and math.isfinite(limit_mib)):
            raise ValueError(f"{app_id}: a memory limit must be a positive number of MiB, got {limit_mib}")
        if self._published.get(app_id) != limit_mib:
            self._published[app_id] = limit_mib
            self._applied.pop(app_id, None)  # the old report is about the old limit

    def report_applied(self, app_id: str, applied_mib: float | None) -> None:
        """From the client's in-app counters (`applied_mem_limit_mib`; None: it applied none)."""
        self._applied[app_id] = applied_mib

    def forget(self, app_id: str) -> None:
        self._published.pop(app_id, None)
        self._applied.pop(app_id, None)

    def status(self, app_id: str) -> LimitStatus:
        published = self._published.get(app_id)
        if app_id not in self._applied:
            return LimitStatus(app_id, published, None, "pending")
        applied = self._applied[app_id]
        if applied is None:
            state = "not applied"
        elif published is not None and abs(applied - published) <= self.tolerance_mib:
            state = "applied"
        else:
            state = "mismatch"
        return LimitStatus(app_id, published, applied, state)

    def statuses(self) -> list[LimitStatus]:
        return [self.status(a) for a in sorted(self._published)]


# ------------------------------------------------------------------------------------------------
# 2. MPS active-thread percentage
# ------------------------------------------------------------------------------------------------
Runner = Callable[[list[str], str], str]  # (argv, stdin) -> stdout; raises OSError / CalledProcessError


def _run(argv: list[str], stdin: str) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=5, check=True)
    return done.stdout


def client_env(active_thread_pct: float) -> dict[str, str]:
    """Environment for a new MPS client limited to this share of the SMs."""
    if not 0 < active_thread_pct <= 100:
        raise ValueError(f"active thread percentage must be in (0, 100], got {active_thread_pct}")
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{active_thread_pct:g}"}


class MpsControl:
    """The MPS control daemon's default active-thread percentage, through its control pipe."""

    def __init__(
        self,
        *,
        pipe_dir: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        runner: Runner = _run,
        which: Callable[[str], str | None] = shutil.which,
        dry_run: bool = False,
        logger: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.pipe_dir = Path(pipe_dir or env.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_MPS_PIPE_DIR))
        self._runner = runner
        self._which = which
        self.dry_run = dry_run
        self._log = logger or get_logger("vgpu.allocator.mps")
        self.disabled: str | None = None
        self.original_pct: float | None = None
        self.writes = 0

    def _disable(self, reason: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            self._log.warning("mps_disabled", reason=reason)

    def available(self) -> bool:
        """An MPS control daemon answers here (detection only; logs nothing)."""
        return (self.pipe_dir / "control").exists() and self._which(MPS_CONTROL) is not None

    def _control(self, command: str) -> str:
        binary = self._which(MPS_CONTROL)
        if binary is None or not (self.pipe_dir / "control").exists():
            raise NotSupported(f"no MPS control daemon (pipe {self.pipe_dir / 'control'}, {MPS_CONTROL} on PATH)")
        try:
            return self._runner([binary], command + "\n").strip()
        except (OSError, subprocess.SubprocessError) as exc:
            raise NotSupported(f"MPS control command {command!r} failed: {exc}") from exc

    def default_active_thread_pct(self) -> float:
        out = self._control("get_default_active_thread_percentage")
        try:
            return float(out.split()[-1])
        except (IndexError, ValueError) as exc:
            raise NotSupported(f"unexpected answer from MPS control: {out!r}") from exc

    def set_default_active_thread_pct(self, pct: float) -> bool:
        """check -> change -> verify; True when a write happened. False when off, unchanged or dry-run."""
        if not 0 < pct <= 100:
            raise ValueError(f"active thread percentage must be in (0, 100], got {pct}")
        if self.disabled is not None:
            return False
        try:
            before = self.default_active_thread_pct()
        except NotSupported as exc:
            self._disable(str(exc))
            return False
        if math.isclose(before, pct, abs_tol=1e-6):
            return False
        if self.dry_run:
            self._log.info("mps_plan", before_pct=before, target_pct=pct, dry_run=True)
            return False
        if self.original_pct is None:
            self.original_pct = before
        self.writes += 1
        try:
            self._control(f"set_default_active_thread_percentage {pct:g}")
        except NotSupported as exc:
            self._disable(str(exc))
            return False
        after = self.default_active_thread_pct()
        if not math.isclose(after, pct, abs_tol=0.5):
            raise VerifyFailed(f"MPS default active thread percentage reads {after} after setting {pct}")
        self._log.info("mps_set", before_pct=before, after_pct=after)
        return True

    def restore(self) -> bool:
        if self.original_pct is None:
            return False
        original, self.original_pct = self.original_pct, None
        dry, self.dry_run = self.dry_run, False
        disabled, self.disabled = self.disabled, None
        try:
            return self.set_default_active_thread_pct(original)
        finally:
            self.dry_run = dry
            self.disabled = self.disabled or disabled


# ------------------------------------------------------------------------------------------------
# 3. NVML cgroup-based memory limits (through the device layer)
# ------------------------------------------------------------------------------------------------
@runtime_checkable
class MemoryLimitDevice(Protocol):
    """What a device offers when its backend wraps nvmlDevice{Set,Get}MemoryLimits_v1."""

    uuid: str

    def set_memory_limit_mib(self, cgroup: str, soft_mib: float, hard_mib: float) -> None: ...

    def memory_limit_mib(self, cgroup: str) -> tuple[float, float]:
        """(soft, hard) limits of the cgroup in MiB."""
        ...


class CgroupMemoryLimits:
    """Per-cgroup GPU memory caps with check -> change -> verify, originals saved and restored."""

    def __init__(self, *, dry_run: bool = False, logger: structlog.typing.FilteringBoundLogger | None = None) -> None:
        self.dry_run = dry_run
        self._log = logger or get_logger("vgpu.allocator.memlimit")
        self._disabled: dict[str, str] = {}
        self._original: dict[tuple[str, str], tuple[float, float]] = {}
        self._devices: dict[str, Device] = {}
        self.writes = 0

    def disabled_reason(self, device_id: str) -> str | None:
        return self._disabled.get(device_id)

    def _disable(self, device_id: str, reason: str) -> None:
        if device_id not in self._disabled:
            self._disabled[device_id] = reason
            self._log.warning("cgroup_memory_limit_disabled", device=device_id, reason=reason)

    def apply(self, device: Device, cgroup: str, hard_mib: float, soft_mib: float | None = None) -> bool:
        """Cap `cgroup` on `device`; True when a write happened."""
        if not cgroup.startswith("/"):
            raise ValueError(f"cgroup must be an absolute cgroup path, got {cgroup!r}")
        if not (hard_mib > 0 and math.isfinite(hard_mib)):
            raise ValueError(f"hard_mib must be a positive number, got {hard_mib}")
        soft = hard_mib if soft_mib is None else soft_mib
        dev_id = device.uuid
        if dev_id in self._disabled:
            return False
        if not isinstance(device, MemoryLimitDevice):
            self._disable(dev_id, "the device backend has no NVML memory-limit support (needs driver R615+)")
            return False
        try:
            before = device.memory_limit_mib(cgroup)
        except NotSupported as exc:
            self._disable(dev_id, f"NotSupported: {exc}")
            return False
        if math.isclose(before[0], soft) and math.isclose(before[1], hard_mib):
            return False
        if self.dry_run:
            self._log.info("cgroup_memory_limit_plan", device=dev_id, cgroup=cgroup, before=before, hard_mib=hard_mib)
            return False
        self._original.setdefault((dev_id, cgroup), before)
        self._devices[dev_id] = device
        self.writes += 1
        try:
            device.set_memory_limit_mib(cgroup, soft, hard_mib)
        except (NotSupported, NoPermission) as exc:
            self._disable(dev_id, f"{type(exc).__name__}: {exc}")
            return False
        after = device.memory_limit_mib(cgroup)
        if not (math.isclose(after[0], soft) and math.isclose(after[1], hard_mib)):
            raise VerifyFailed(f"cgroup {cgroup} on {dev_id} reads {after} MiB after setting {(soft, hard_mib)}")
        return True

    def restore(self) -> list[tuple[str, str, str]]:
        """Write every saved original back; (device, cgroup, outcome) per entry, failures logged."""
        out = []
        for (dev_id, cgroup), (soft, hard) in list(self._original.items()):
            device = self._devices[dev_id]
            try:
                device.set_memory_limit_mib(cgroup, soft, hard)  # type: ignore[attr-defined]
                out.append((dev_id, cgroup, "restored"))
            except DeviceError as exc:
                self._log.error("cgroup_memory_limit_restore_failed", device=dev_id, cgroup=cgroup, error=repr(exc))
                out.append((dev_id, cgroup, f"failed: {exc}"))
            del self._original[(dev_id, cgroup)]
        return out
