"""The power-limit mechanism: check -> change -> verify, original saved first and restored on stop.

`PowerLimitMechanism.apply(device, target_mw)`:
1. check: if the mechanism is disabled for the device, do nothing; read the constraints and clamp
   the target into [min, max]; read the current limit; if it already equals the target, do nothing
   (idempotent: zero writes);
2. save the device's original limit, once per device, before the first write;
3. change: in dry-run mode log the plan and write nothing; otherwise write;
4. verify: read the limit back; a different value raises `VerifyFailed`.

A write refused for lack of privilege or support (`NoPermission`, `NotSupported`) is logged once
and disables the mechanism for that device; later calls return a result saying so. NotSupported
before any write of ours worked there (kept across `restore()`) is the device's nature (`unsupported`, logged as
`power_limit_unsupported`), anything else a failure at runtime (`power_limit_disabled`). Other errors
(`GpuLost`, ...) propagate: writes fail loudly. `restore()` writes each saved original back.

Not thread-safe: the allocator that owns it runs on one asyncio loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from vgpu.allocator.errors import NoPermission, NotSupported, VerifyFailed
from vgpu.device.base import Device, PowerConstraints
from vgpu.log import Logger, get_logger


@dataclass(frozen=True)
class PowerLimitResult:
    """What one apply/restore did on one device."""

    device_id: str
    requested_mw: int
    target_mw: int  # after clamping to the device's constraints
    before_mw: int | None
    after_mw: int | None
    changed: bool  # a write happened and read back as the target
    dry_run: bool = False
    # "" when it changed; else why not: "already at target", "dry run", "disabled: ...", "refused: ..."
    reason: str = ""

    @property
    def planned(self) -> bool:
        """A change would have been written (dry run) or was written."""
        return self.changed or self.reason == "dry run"


class PowerLimitMechanism:
    """Sets power limits on devices with check -> change -> verify and restores originals."""

    def __init__(self, *, dry_run: bool = False, logger: Logger | None = None) -> None:
        self.dry_run = dry_run
        self._log = logger or get_logger("vgpu.allocator.power")
        self._devices: dict[str, Device] = {}
        self._original_mw: dict[str, int] = {}
        self._disabled: dict[str, str] = {}
        self._unsupported: set[str] = set()  # devices that have no settable power limit at all
        # devices where a write of ours read back once: kept across `restore()`, so that a later
        # NotSupported there is a failure at runtime (disabled), never the device's nature
        self._worked: set[str] = set()
        self.writes = 0

    def original_mw(self, device_id: str) -> int | None:
        """The limit the device had before our first write (None: never written)."""
        return self._original_mw.get(device_id)

    def disabled_reason(self, device_id: str) -> str | None:
        """Why the mechanism is off for the device (None: it is on)."""
        return self._disabled.get(device_id)

    def unsupported(self, device_id: str) -> bool:
        """Whether the mechanism is off for the device because the device has no power limit to read
        or set (NotSupported before any write of ours), rather than after failing at runtime."""
        return device_id in self._unsupported

    def _disable(self, device_id: str, reason: str, *, unsupported: bool = False) -> None:
        if device_id not in self._disabled:
            self._disabled[device_id] = reason
            if unsupported:
                self._unsupported.add(device_id)
            self._log.warning("power_limit_unsupported" if unsupported else "power_limit_disabled",
                              device=device_id, reason=reason)

    @staticmethod
    def clamp(target_mw: int, constraints: PowerConstraints) -> int:
        return max(constraints.min_mw, min(constraints.max_mw, int(target_mw)))

    def apply(self, device: Device, target_mw: int) -> PowerLimitResult:
        device_id = device.uuid
        requested = int(target_mw)
        if device_id in self._disabled:
            return PowerLimitResult(
                device_id, requested, requested, None, None, False, self.dry_run, f"disabled: {self._disabled[device_id]}"
            )
        try:
            constraints = device.power_constraints()
            before = device.power_limit_mw()
        except NotSupported as exc:
            self._disable(device_id, f"power limit not readable: {exc}", unsupported=not self._wrote_here(device_id))
            return PowerLimitResult(device_id, requested, requested, None, None, False, self.dry_run, f"disabled: {exc}")
        target = self.clamp(requested, constraints)
        if before == target:
            return PowerLimitResult(device_id, requested, target, before, before, False, self.dry_run, "already at target")
        if self.dry_run:
            self._log.info("power_limit_plan", device=device_id, before_mw=before, target_mw=target, dry_run=True)
            return PowerLimitResult(device_id, requested, target, before, before, False, True, "dry run")
        # Save the original once, before the first write to this device.
        first_write = device_id not in self._original_mw
        worked = self._wrote_here(device_id)
        self._devices.setdefault(device_id, device)
        self._original_mw.setdefault(device_id, before)
        try:
            self._write(device, target)
        except (NoPermission, NotSupported) as exc:
            self._disable(device_id, f"{type(exc).__name__}: {exc}",
                          unsupported=isinstance(exc, NotSupported) and not worked)
            if first_write:  # nothing of ours is on the device, so nothing to restore
                del self._original_mw[device_id]
            return PowerLimitResult(device_id, requested, target, before, before, False, False, f"refused: {exc}")
        after = device.power_limit_mw()
        if after != target:
            raise VerifyFailed(f"power limit of {device_id} reads {after} mW after writing {target} mW")
        self._worked.add(device_id)
        self._log.info("power_limit_set", device=device_id, before_mw=before, after_mw=after)
        return PowerLimitResult(device_id, requested, target, before, after, True, False)

    def _wrote_here(self, device_id: str) -> bool:
        """Whether a write of ours is on the device now, or one read back there once (before a restore)."""
        return device_id in self._original_mw or device_id in self._worked

    def _write(self, device: Device, limit_mw: int) -> None:
        self.writes += 1
        device.set_power_limit_mw(limit_mw)

    def restore(self) -> list[PowerLimitResult]:
        """Write each saved original limit back (check -> change -> verify). A device that fails is
        logged and the others are still restored; the result says what happened per device."""
        results: list[PowerLimitResult] = []
        for device_id, original in list(self._original_mw.items()):
            device = self._devices[device_id]
            try:
                before = device.power_limit_mw()
                if before == original:
                    results.append(
                        PowerLimitResult(device_id, original, original, before, before, False, reason="already at target")
                    )
                else:
                    self._write(device, original)
                    after = device.power_limit_mw()
                    ok = after == original
                    if ok:
                        self._worked.add(device_id)
                    if not ok:
                        self._log.error("power_limit_restore_mismatch", device=device_id, after_mw=after, want_mw=original)
                    results.append(
                        PowerLimitResult(device_id, original, original, before, after, ok, reason="" if ok else "verify failed")
                    )
                    self._log.info("power_limit_restored", device=device_id, before_mw=before, after_mw=after)
            except Exception as exc:  # noqa: BLE001 - restoring the others matters more
                self._log.error("power_limit_restore_failed", device=device_id, error=repr(exc))
                results.append(PowerLimitResult(device_id, original, original, None, None, False, reason=f"failed: {exc}"))
                continue
            del self._original_mw[device_id]
        return results
