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
   device (`Device.memory_limit_mib(cgroup)` / `set_memory_limit_mib(cgroup, soft, hard)`) with
   check -> change -> verify, saving each cgroup's original limits before the first write and
   writing them back on `restore()` (or `restore_one` when the application's grants are gone); a
   cgroup found already at the cap asked for is in force without a write, adopted with what it
   holds as its original. A
   device or driver that answers NotSupported (no such NVML function, an older nvidia-ml-py), or
   NoPermission on a write, turns the mechanism off for that device with one log line; other
   errors and a value that does not read back fail loudly. Off is one of two things
   (`unsupported`): the driver or GPU has no such limits (NotSupported before the mechanism ever
   wrote to the device: a fact of the node, said once, `cgroup_memory_limit_unsupported`; the
   daemon asks each device at start, `probe`), or it failed at runtime (NoPermission, or
   NotSupported after a write had worked: `cgroup_memory_limit_disabled`, what the
   VgpuEnforcementDisabled alert is for). The allocator finds an application's
   cgroup from its pid (`read_cgroup`: /proc/<pid>/cgroup). Given the daemon's store, each original
   is also recorded there before the first write (first record wins) and forgotten once written
   back; at start-up `reconcile` puts back what a crashed run left on cgroups no grant holds now.
"""

from __future__ import annotations

import math
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from vgpu.allocator.errors import VerifyFailed
from vgpu.allocator.store import CgroupOriginal, Store, StoreError
from vgpu.device.base import Backend, Device
from vgpu.device.errors import DeviceError, NoPermission, NotFound, NotSupported
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
def read_cgroup(pid: int, proc_root: str | Path = "/proc") -> str | None:
    """The cgroup path of `pid` (the cgroup v2 entry "0::PATH" of /proc/<pid>/cgroup, else the v1
    memory controller's), or None when the process is gone or the file says nothing usable (a path
    that is not UTF-8 included)."""
    if pid <= 0:
        return None
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text(encoding="utf-8")
    except OSError:
        return None
    except UnicodeDecodeError:
        # a cgroup named in bytes that are not UTF-8 (any user may name one in a subtree delegated to
        # it): no path to cap, rather than an error out of every change on the device
        return None
    v1_memory = None
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/"):
            continue
        if hier == "0" and controllers == "":
            return path
        if "memory" in controllers.split(","):
            v1_memory = path
    return v1_memory


def cgroup_exists(cgroup: str, root: str | Path = "/sys/fs/cgroup") -> bool:
    """Whether `cgroup` (a path as /proc/<pid>/cgroup gives it) still exists under the cgroup v2
    hierarchy, a hybrid layout's unified one, or the v1 memory controller's. True when none of
    these is mounted under `root`: unknown counts as existing, so its original is kept, not dropped."""
    base = Path(root)
    rel = cgroup.strip("/")
    hierarchies = [h for h in (base, base / "unified", base / "memory")
                   if (h / "cgroup.controllers").exists() or (h / "cgroup.procs").exists()]
    if not hierarchies:
        return True
    return any((h / rel).is_dir() for h in hierarchies)


def _same(a: float, b: float) -> bool:
    """Equal limits in MiB (bytes round-trip through NVML); inf equals only inf."""
    return a == b or (math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=0.0, abs_tol=0.01))


class CgroupMemoryLimits:
    """Per-cgroup GPU memory caps with check -> change -> verify, originals saved and restored.

    With a `store`, each original is also recorded there before the first write (the first record
    wins) and forgotten once written back, so that a daemon started after a crash restores the
    true original rather than the limit vgpu left (`reconcile`)."""

    def __init__(
        self,
        *,
        dry_run: bool = False,
        store: Store | None = None,
        cgroup_exists: Callable[[str], bool] = cgroup_exists,
        clock: Callable[[], float] = time.time,
        logger: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self.dry_run = dry_run
        self.store = store
        self._cgroup_exists = cgroup_exists
        self._clock = clock
        self._log = logger or get_logger("vgpu.allocator.memlimit")
        self._disabled: dict[str, str] = {}
        self._unsupported: set[str] = set()  # devices whose driver or GPU has no per-cgroup limits
        # devices where this once held a cgroup's original or cap: kept once those are forgotten
        # (restored), so that a later NotSupported there is a failure at runtime, not the driver's nature
        self._worked: set[str] = set()
        self._original: dict[tuple[str, str], tuple[float, float]] = {}
        # (device, cgroup) -> the hard cap (MiB) this wrote there and read back: what is in force now
        self._capped: dict[tuple[str, str], float] = {}
        # written back, yet still stored (the store could not delete it: a full disk): not the
        # original of a later cap there, which records its own (`_record_original`)
        self._not_forgotten: set[tuple[str, str]] = set()
        self._devices: dict[str, Device] = {}
        self.writes = 0

    def disabled_reason(self, device_id: str) -> str | None:
        return self._disabled.get(device_id)

    def limited(self, device_id: str) -> set[str]:
        """The cgroups of the device whose limits this changed, or found already at the cap asked
        for (and will restore: for the latter, a write of nothing while it still holds it)."""
        return {cg for dev, cg in self._original if dev == device_id}

    def capped(self, device_id: str) -> set[str]:
        """The cgroups of the device that hold a cap of this mechanism now: written and read back
        (or found already at it), not restored since. A cap whose write raised, or did not read
        back, is not counted; nor is anything in dry run, which writes nothing."""
        return {cg for dev, cg in self._capped if dev == device_id}

    def unsupported(self, device_id: str) -> bool:
        """Whether the mechanism is off for the device because its driver or GPU has no per-cgroup
        memory limits (NotSupported before any write of ours worked there, a restore since
        included), rather than after failing at runtime."""
        return device_id in self._unsupported

    def _disable(self, device_id: str, exc: Exception) -> None:
        """Off for the device, said once: unsupported (NotSupported where nothing of ours was ever
        written there) or failed (anything else)."""
        if device_id in self._disabled:
            return
        reason = f"{type(exc).__name__}: {exc}"
        self._disabled[device_id] = reason
        wrote = device_id in self._worked or any(dev == device_id for dev, _ in (*self._original, *self._capped))
        if isinstance(exc, NotSupported) and not wrote:
            self._unsupported.add(device_id)
            self._log.warning("cgroup_memory_limit_unsupported", device=device_id, reason=reason,
                              meaning="memory grants on this GPU stay cooperative: no cgroup is capped",
                              fix="per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1) need a driver "
                                  "and nvidia-ml-py that have them (R615 / 13.615 or newer)")
        else:
            self._log.warning("cgroup_memory_limit_disabled", device=device_id, reason=reason)

    def probe(self, devices: Iterable[Device]) -> dict[str, str]:
        """Ask each device whether it has per-cgroup memory limits at all (a read of the root
        cgroup's, which writes nothing): one that answers NotSupported is off from here on,
        unsupported, said once now rather than at the first contention. device -> reason for each
        such device. Any other answer (a lost GPU, a refused read) says nothing about support and is
        left to the first write."""
        out: dict[str, str] = {}
        for dev in devices:
            if dev.uuid in self._disabled:
                continue
            try:
                dev.memory_limit_mib("/")
            except NotSupported as exc:
                self._disable(dev.uuid, exc)
                if dev.uuid in self._unsupported:
                    out[dev.uuid] = self._disabled[dev.uuid]
            except DeviceError:
                continue
        return out

    def apply(self, device: Device, cgroup: str, hard_mib: float, soft_mib: float | None = None) -> bool:
        """Cap `cgroup` on `device`; True when a write happened. False when off, unchanged or dry-run."""
        if not cgroup.startswith("/"):
            raise ValueError(f"cgroup must be an absolute cgroup path, got {cgroup!r}")
        if not (hard_mib > 0 and math.isfinite(hard_mib)):
            raise ValueError(f"hard_mib must be a positive number, got {hard_mib}")
        soft = hard_mib if soft_mib is None else soft_mib
        if not 0 < soft <= hard_mib:
            raise ValueError(f"soft_mib must be in (0, hard_mib], got {soft}")
        if device.uuid in self._disabled:
            return False
        try:
            return self._write(device, cgroup, soft, hard_mib, save=True, dry_run=self.dry_run)
        except (NotSupported, NoPermission) as exc:
            self._disable(device.uuid, exc)
            return False

    def _write(self, device: Device, cgroup: str, soft: float, hard: float, *, save: bool, dry_run: bool) -> bool:
        """check -> change -> verify; True when a write happened. Device errors propagate."""
        dev_id = device.uuid
        before = device.memory_limit_mib(cgroup)
        if _same(before.soft_mib, soft) and _same(before.hard_mib, hard):
            if not save:
                self._capped.pop((dev_id, cgroup), None)  # the original is what it holds
            elif not dry_run:
                if (dev_id, cgroup) not in self._original:
                    # The cgroup already holds exactly the cap asked for (an operator's limit, say):
                    # in force without a write. It is adopted as ours: its original is what it holds
                    # (recorded as before a write, so a later, different cap is put back to it) and
                    # its release writes nothing.
                    self._original[(dev_id, cgroup)] = self._record_original(dev_id, cgroup, before.soft_mib,
                                                                             before.hard_mib)
                    self._devices[dev_id] = device
                self._capped[(dev_id, cgroup)] = hard  # our cap, in force
            return False
        if dry_run:
            self._log.info("cgroup_memory_limit_plan", device=dev_id, cgroup=cgroup, dry_run=True,
                           before_mib=[before.soft_mib, before.hard_mib], soft_mib=soft, hard_mib=hard)
            return False
        if save and (dev_id, cgroup) not in self._original:
            self._original[(dev_id, cgroup)] = self._record_original(dev_id, cgroup, before.soft_mib, before.hard_mib)
        if save:
            self._devices[dev_id] = device
        self.writes += 1
        device.set_memory_limit_mib(cgroup, soft, hard)  # raising, the device holds what it held
        after = device.memory_limit_mib(cgroup)
        if not (_same(after.soft_mib, soft) and _same(after.hard_mib, hard)):
            self._capped.pop((dev_id, cgroup), None)  # whatever it holds, not the cap asked for
            raise VerifyFailed(f"cgroup {cgroup} on {dev_id} reads {after[:2]} MiB after setting {(soft, hard)}")
        if save:
            self._capped[(dev_id, cgroup)] = hard
        else:
            self._capped.pop((dev_id, cgroup), None)
        self._log.info("cgroup_memory_limit_set", device=dev_id, cgroup=cgroup, hard_mib=hard,
                       before_mib=[before.soft_mib, before.hard_mib])
        return True

    def _record_original(self, device_id: str, cgroup: str, soft_mib: float, hard_mib: float) -> tuple[float, float]:
        """Persist the original before the first write; the stored one when a previous run (which
        crashed, leaving its own limit on the device) recorded it first."""
        if self.store is None:
            return soft_mib, hard_mib
        if (device_id, cgroup) in self._not_forgotten:  # raising, like the save below: nothing is written
            self.store.forget_cgroup_original(device_id, cgroup)
            self._not_forgotten.discard((device_id, cgroup))
        self.store.save_cgroup_original(CgroupOriginal(device_id, cgroup, soft_mib, hard_mib, self._clock()))
        stored = self.store.cgroup_original(device_id, cgroup)
        assert stored is not None
        return stored.soft_mib, stored.hard_mib

    def _forget(self, device_id: str, cgroup: str) -> None:
        if (device_id, cgroup) in self._original or (device_id, cgroup) in self._capped:
            self._worked.add(device_id)
        self._original.pop((device_id, cgroup), None)
        self._capped.pop((device_id, cgroup), None)
        if self.store is None:
            return
        # Best effort: the limit is back already. A record left stored is written back (the same
        # values) and forgotten by the next start's `reconcile`; the other cgroups still get theirs.
        try:
            self.store.forget_cgroup_original(device_id, cgroup)
        except (sqlite3.Error, StoreError, OSError) as exc:
            self._not_forgotten.add((device_id, cgroup))
            self._log.warning("cgroup_memory_limit_original_not_forgotten", device=device_id, cgroup=cgroup,
                              error=f"{type(exc).__name__}: {exc}")

    def restore_one(self, device_id: str, cgroup: str) -> str:
        """Write the cgroup's saved original back (even where the mechanism is off or dry-run: a
        saved original means vgpu wrote). "restored"; "unchanged" (nothing saved); "forgotten:
        cgroup gone" (the write-back failed and the cgroup no longer exists, by `cgroup_exists` or
        NVML's NotFound for the namespace: nothing is left to restore); "failed: ..." (the original
        stays saved for `restore()` and the next start; NotSupported or NoPermission also turn the
        mechanism off for the device). A failure is one log line."""
        saved = self._original.get((device_id, cgroup))
        if saved is None:
            return "unchanged"
        try:
            self._write(self._devices[device_id], cgroup, saved[0], saved[1], save=False, dry_run=False)
        except (DeviceError, VerifyFailed) as exc:
            return self._restore_failed(device_id, cgroup, exc)
        self._forget(device_id, cgroup)
        return "restored"

    def _restore_failed(self, device_id: str, cgroup: str, exc: DeviceError | VerifyFailed) -> str:
        if isinstance(exc, NotFound) or not self._cgroup_exists(cgroup):  # NotFound: no such namespace
            return self._gone(device_id, cgroup, exc)
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (NotSupported, NoPermission)):
            self._disabled.setdefault(device_id, error)  # said once, by the line below
        self._log.error("cgroup_memory_limit_restore_failed", device=device_id, cgroup=cgroup, error=error)
        return f"failed: {error}"

    def _gone(self, device_id: str, cgroup: str, exc: Exception) -> str:
        self._forget(device_id, cgroup)
        self._log.warning("cgroup_memory_limit_original_forgotten", device=device_id, cgroup=cgroup,
                          reason="cgroup gone", error=f"{type(exc).__name__}: {exc}")
        return "forgotten: cgroup gone"

    def restore(self) -> list[tuple[str, str, str]]:
        """Write every saved original back; (device, cgroup, outcome) per entry, failures logged."""
        return [(dev_id, cgroup, self.restore_one(dev_id, cgroup)) for dev_id, cgroup in list(self._original)]

    def reconcile(self, backend: Backend, in_use: Mapping[str, Collection[str]]) -> list[tuple[str, str, str]]:
        """At start-up, for each original the store holds (a previous run recorded it and did not
        write it back: it crashed): a cgroup that `in_use[device_id]` names keeps its record and is
        adopted, so that its eventual restore (release, stop) writes the true original ("kept: in
        use"); any other gets its original written back and forgotten (`restore_one`'s outcomes).
        A device the backend does not have keeps its records ("failed: ...", one line each) unless
        the cgroup is gone too. Dry-run touches neither the devices nor the store: it logs each
        restore it would make ("planned")."""
        if self.store is None:
            return []
        out: list[tuple[str, str, str]] = []
        for rec in self.store.cgroup_originals():
            dev_id, cgroup, original = rec.device_id, rec.cgroup, (rec.soft_mib, rec.hard_mib)
            held = cgroup in in_use.get(dev_id, ())
            if self.dry_run:
                if not held:
                    self._log.info("cgroup_memory_limit_plan", device=dev_id, cgroup=cgroup, dry_run=True,
                                   restore_mib=list(original))
                out.append((dev_id, cgroup, "kept: in use" if held else "planned"))
                continue
            try:
                self._devices[dev_id] = backend.device(dev_id)
            except DeviceError as exc:
                out.append((dev_id, cgroup, self._device_missing(dev_id, cgroup, exc)))
                continue
            self._original.setdefault((dev_id, cgroup), original)
            if held:
                self._log.info("cgroup_memory_limit_original_kept", device=dev_id, cgroup=cgroup,
                               original_mib=list(original))
                self._adopt_cap(dev_id, cgroup, original)
                out.append((dev_id, cgroup, "kept: in use"))
            else:
                out.append((dev_id, cgroup, self.restore_one(dev_id, cgroup)))
        return out

    def _adopt_cap(self, device_id: str, cgroup: str, original: tuple[float, float]) -> None:
        """A cgroup kept at start-up still holds what the crashed run wrote, unless it reads as its
        original: that cap is in force (`capped`) until the next sync writes the grant's. A read that
        fails says nothing; the next write finds out."""
        try:
            now = self._devices[device_id].memory_limit_mib(cgroup)
        except DeviceError:
            return
        if math.isfinite(now.hard_mib) and not (_same(now.soft_mib, original[0]) and _same(now.hard_mib, original[1])):
            self._capped[(device_id, cgroup)] = now.hard_mib

    def _device_missing(self, device_id: str, cgroup: str, exc: DeviceError) -> str:
        if not self._cgroup_exists(cgroup):
            return self._gone(device_id, cgroup, exc)
        error = f"{type(exc).__name__}: {exc}"
        self._log.error("cgroup_memory_limit_restore_failed", device=device_id, cgroup=cgroup,
                        error=f"device not found: {error}")
        return f"failed: {error}"
