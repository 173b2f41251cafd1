"""The replay's power loop: per device, choose a limit from the forecast need
(`vgpu.allocator.policy.power.choose_power_limit_mw`) and apply it through the allocator's own
`PowerLimitMechanism`. The daemon does the same inside `Allocator.apply_recommendations`; the replay
drives devices directly, without a ledger, so it keeps this small loop of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vgpu.allocator.mechanisms.power import PowerLimitMechanism, PowerLimitResult
from vgpu.allocator.policy.power import DEFAULT_CURVE, PowerCurve, PowerPolicyConfig, choose_power_limit_mw
from vgpu.device.base import Device
from vgpu.device.errors import NotSupported


class PowerController:
    """Per device: choose a limit from the forecast need and apply it through the mechanism."""

    def __init__(
        self,
        mechanism: PowerLimitMechanism | None = None,
        *,
        curve: PowerCurve = DEFAULT_CURVE,
        config: PowerPolicyConfig | None = None,
    ) -> None:
        self.mechanism = mechanism or PowerLimitMechanism()
        self.curve = curve
        self.config = config or PowerPolicyConfig()

    def step(self, devices: Sequence[Device], need_sm_pct: Mapping[str, float]) -> list[PowerLimitResult]:
        """One decision per device (keyed by UUID); devices without a need entry are left alone.
        A device whose constraints cannot be read is handed to the mechanism, which disables itself
        for that device with one log line."""
        results = []
        for dev in devices:
            if dev.uuid not in need_sm_pct:
                continue
            if self.mechanism.disabled_reason(dev.uuid) is not None:
                results.append(self.mechanism.apply(dev, 0))  # reports "disabled: ..."
                continue
            try:
                constraints = dev.power_constraints()
            except NotSupported:  # the mechanism reads again and turns itself off for the device
                results.append(self.mechanism.apply(dev, 0))
                continue
            choice = choose_power_limit_mw(need_sm_pct[dev.uuid], constraints, self.curve, self.config)
            results.append(self.mechanism.apply(dev, choice.limit_mw))
        return results

    def stop(self) -> list[PowerLimitResult]:
        """Restore every original limit."""
        return self.mechanism.restore()
