"""Typed device errors and the one table that maps NVML return codes onto them.

Only the NVML backend sees `pynvml.NVMLError`; it converts each through `from_nvml_code`. The
simulated backend raises the same typed errors, so code above the device layer never depends on
which backend is in use.
"""

from __future__ import annotations


class DeviceError(Exception):
    """A device-layer failure. `nvml_code` is NVML's return code where one applies."""

    nvml_code: int | None = None

    def __init__(self, message: str = "", *, nvml_code: int | None = None) -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)
        if nvml_code is not None:
            self.nvml_code = nvml_code


class Uninitialized(DeviceError):
    """NVML was not initialised."""

    nvml_code = 1


class InvalidArgument(DeviceError):
    """An argument is out of range or refers to nothing."""

    nvml_code = 2


class NotSupported(DeviceError):
    """The device or driver does not support this operation."""

    nvml_code = 3


class NoPermission(DeviceError):
    """The caller lacks the privilege for this operation (root or CAP_SYS_ADMIN)."""

    nvml_code = 4


class NotFound(DeviceError):
    """No such device, instance or process."""

    nvml_code = 6


class DriverNotLoaded(DeviceError):
    """The NVIDIA driver is not loaded."""

    nvml_code = 9


class LibraryNotFound(DeviceError):
    """libnvidia-ml.so was not found: no driver is installed."""

    nvml_code = 12


class GpuLost(DeviceError):
    """The GPU fell off the bus or stopped answering."""

    nvml_code = 15


class ResetRequired(DeviceError):
    """The GPU needs a reset before this operation can proceed."""

    nvml_code = 16


class InUse(DeviceError):
    """The resource is in use (e.g. a MIG instance that still has processes)."""

    nvml_code = 19


class NoData(DeviceError):
    """No data is available yet (e.g. no new process-utilization samples)."""

    nvml_code = 21


class InsufficientResources(DeviceError):
    """The request exceeds what the device has left (e.g. MIG capacity)."""

    nvml_code = 23


class UnknownDeviceError(DeviceError):
    """NVML returned a code this table does not know."""

    nvml_code = 999


# NVML return code -> typed error. The one place this mapping is written down.
NVML_ERRORS: dict[int, type[DeviceError]] = {
    cls.nvml_code: cls
    for cls in (
        Uninitialized,
        InvalidArgument,
        NotSupported,
        NoPermission,
        NotFound,
        DriverNotLoaded,
        LibraryNotFound,
        GpuLost,
        ResetRequired,
        InUse,
        NoData,
        InsufficientResources,
        UnknownDeviceError,
    )
}

# NVML_ERROR_FUNCTION_NOT_FOUND: the installed driver's libnvidia-ml lacks the function (nvidia-ml-py
# knows functions newer than the driver, e.g. nvmlDeviceSetMemoryLimits_v1 before R615). For a caller
# this is the same as the device not supporting the operation.
FUNCTION_NOT_FOUND = 13
NVML_ERRORS[FUNCTION_NOT_FOUND] = NotSupported


def from_nvml_code(code: int, message: str = "") -> DeviceError:
    """The typed error for an NVML return code; codes outside the table become UnknownDeviceError."""
    cls = NVML_ERRORS.get(code, UnknownDeviceError)
    return cls(message or f"NVML error {code}", nvml_code=code)
