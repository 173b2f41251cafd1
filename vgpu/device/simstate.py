"""A simulated GPU whose settings outlive the daemon, as a real GPU's do.

A real GPU keeps the power limit, MIG layout and cgroup memory limits vgpu set when the daemon
crashes; a restarted daemon finds them there and must reconcile. `PersistentSimBackend` gives the
simulator the same property: after every successful write it saves each device's power limit, MIG
mode, GPU instances and memory limits to a JSON file (atomically), and when it is created over an
existing file it puts the devices back into that state. Tests read the file to observe the device from outside the daemon.

Only `vgpu serve --backend sim:<sku>` uses it; the simulator itself (vgpu/device/sim.py) stays pure.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vgpu.capped import FileTooLarge, read_capped
from vgpu.device.base import (
    Backend,
    Device,
    GpuInstance,
    GpuInstanceProfile,
    MemoryInfo,
    MemoryLimitMib,
    PowerConstraints,
    ProcessInfo,
    ProcessUtilization,
    Utilization,
)
from vgpu.device.errors import DeviceError
from vgpu.device.sim import SimBackend, SimDevice

STATE_VERSION = 1


# The most `read_state` reads (vgpu/capped.py): the file holds a few fields per device and one entry per
# capped cgroup, kilobytes; a larger one is damaged, and is refused without being read whole.
MAX_STATE_BYTES = 16 * 1024 * 1024


class SimStateError(ValueError):
    """The saved state of the simulated devices cannot be used; the message names the file and
    what to do."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: the simulated GPUs' saved settings cannot be used ({why}); remove the file "
                         "to start them with their defaults")


def device_state(dev: SimDevice | PersistentSimDevice) -> dict[str, Any]:
    """What the file keeps of one device. A memory limit kept is finite: soft <= hard, and a limit
    set back to (inf, inf) is removed, not kept."""
    sim = dev.inner if isinstance(dev, PersistentSimDevice) else dev
    mig = dev.mig_enabled()
    return {
        "memory_limits_mib": {ns: list(limits) for ns, limits in sorted(sim.memory_limits().items())},
        "power_limit_mw": dev.power_limit_mw(),
        "mig_enabled": mig,
        "gpu_instances": [
            {"profile_id": gi.profile_id, "start": gi.placement.start, "profile_name": gi.profile_name}
            for gi in (dev.gpu_instances() if mig else ())
        ],
    }


def read_state(path: Path) -> dict[str, dict[str, Any]]:
    """uuid -> device state, from a file written by `PersistentSimBackend` ({} when absent)."""
    path = Path(path)
    try:
        raw = json.loads(read_capped(path, MAX_STATE_BYTES).decode("utf-8"))
    except FileNotFoundError:
        return {}
    except FileTooLarge:
        raise SimStateError(path, f"larger than {MAX_STATE_BYTES} bytes, the most it may hold; not read") from None
    except RecursionError:  # nested deeper than the decoder goes, within the size cap
        raise SimStateError(path, "not valid JSON: nested too deep") from None
    except (ValueError, UnicodeDecodeError) as exc:  # ValueError: JSONDecodeError, or a 4,300-digit integer
        raise SimStateError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise SimStateError(path, "not a JSON object")
    if raw.get("version") != STATE_VERSION:
        raise SimStateError(path, f"version {raw.get('version')!r}, expected {STATE_VERSION}")
    devices = raw.get("devices")
    if not isinstance(devices, dict) or not all(isinstance(st, dict) for st in devices.values()):
        raise SimStateError(path, "'devices' is not an object of device objects")
    return devices


class PersistentSimDevice(Device):
    """A `SimDevice` that reports every successful write to `on_write`."""

    def __init__(self, inner: SimDevice, on_write: Callable[[], None]) -> None:
        self.inner = inner
        self._on_write = on_write

    @property
    def index(self) -> int:
        return self.inner.index

    @property
    def uuid(self) -> str:
        return self.inner.uuid

    @property
    def name(self) -> str:
        return self.inner.name

    def memory(self) -> MemoryInfo:
        return self.inner.memory()

    def utilization(self) -> Utilization:
        return self.inner.utilization()

    def power_usage_mw(self) -> int:
        return self.inner.power_usage_mw()

    def power_limit_mw(self) -> int:
        return self.inner.power_limit_mw()

    def power_constraints(self) -> PowerConstraints:
        return self.inner.power_constraints()

    def sm_clock_mhz(self) -> int:
        return self.inner.sm_clock_mhz()

    def pci_bus_id(self) -> str:
        return self.inner.pci_bus_id()

    def temperature_c(self) -> int:
        return self.inner.temperature_c()

    def pcie_throughput_kbps(self) -> tuple[float, float]:
        return self.inner.pcie_throughput_kbps()

    def processes(self) -> Sequence[ProcessInfo]:
        return self.inner.processes()

    def process_utilization(self, since_us: int) -> Sequence[ProcessUtilization]:
        return self.inner.process_utilization(since_us)

    def mig_enabled(self) -> bool:
        return self.inner.mig_enabled()

    def gpu_instance_profiles(self) -> Sequence[GpuInstanceProfile]:
        return self.inner.gpu_instance_profiles()

    def gpu_instances(self) -> Sequence[GpuInstance]:
        return self.inner.gpu_instances()

    def memory_limit_mib(self, namespace: str) -> MemoryLimitMib:
        return self.inner.memory_limit_mib(namespace)

    def set_power_limit_mw(self, limit_mw: int) -> None:
        self.inner.set_power_limit_mw(limit_mw)
        self._on_write()

    def set_memory_limit_mib(self, namespace: str, soft_mib: float, hard_mib: float) -> None:
        self.inner.set_memory_limit_mib(namespace, soft_mib, hard_mib)
        self._on_write()

    def create_gpu_instance(self, profile_id: int, start: int) -> GpuInstance:
        gi = self.inner.create_gpu_instance(profile_id, start)
        self._on_write()
        return gi

    def destroy_gpu_instance(self, instance_id: int) -> None:
        self.inner.destroy_gpu_instance(instance_id)
        self._on_write()

    def set_mig_mode(self, enabled: bool) -> None:
        self.inner.set_mig_mode(enabled)
        self._on_write()


class PersistentSimBackend(Backend):
    """`SimBackend(gpus)` whose device settings are kept in `state_path`."""

    name = "sim"

    def __init__(self, gpus: Sequence[str], state_path: Path, **sim_kwargs: Any) -> None:
        self.sim = SimBackend(gpus, **sim_kwargs)
        self.state_path = Path(state_path)
        saved = read_state(self.state_path)
        self._devices = [PersistentSimDevice(d, self.save) for d in self.sim.devices()]
        for dev in self.sim.devices():
            st = saved.get(dev.uuid)
            if st is None:
                continue
            try:
                if st.get("mig_enabled") and dev.sku.supports_mig:
                    dev.set_mig_mode(True)
                    for gi in st.get("gpu_instances", []):
                        dev.create_gpu_instance(int(gi["profile_id"]), int(gi["start"]))
                dev.set_power_limit_mw(int(st["power_limit_mw"]))
                for ns, (soft, hard) in (st.get("memory_limits_mib", {}) if self.sim.memory_limits else {}).items():
                    dev.set_memory_limit_mib(ns, float(soft), float(hard))
            except KeyError as exc:
                raise SimStateError(self.state_path, f"device {dev.uuid} has no {exc}") from exc
            except (TypeError, ValueError, AttributeError, DeviceError) as exc:
                raise SimStateError(self.state_path, f"device {dev.uuid}: {type(exc).__name__}: {exc}") from exc
        self.save()

    def devices(self) -> Sequence[PersistentSimDevice]:
        return self._devices

    def close(self) -> None:
        self.sim.close()

    def save(self) -> None:
        body = {"version": STATE_VERSION, "devices": {d.uuid: device_state(d) for d in self._devices}}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
        os.replace(tmp, self.state_path)
