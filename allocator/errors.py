"""Allocator errors and the ONE map from typed errors to gRPC status codes.

Where an allocator error means the same as a device error (the request does not fit, no such
grant), the device error is reused so callers catch one class whichever layer refused. What only
the allocator can say lives here: a bad argument (`InvalidRequest`), a caller acting on another
application's grant (`PermissionDenied`), a write that did not read back (`VerifyFailed`).

Every RPC edge (allocator/service.py, manager/service.py and the daemon in vgpu/daemon/serve.py) converts exceptions with
`status_for(exc)`; no other module chooses status codes.
"""

from __future__ import annotations

import grpc

from vgpu.device.errors import (
    DeviceError,
    DriverNotLoaded,
    GpuLost,
    InsufficientResources,
    InUse,
    InvalidArgument,
    LibraryNotFound,
    NoPermission,
    NotFound,
    NotSupported,
    ResetRequired,
    Uninitialized,
)
from vgpu.jobs import InvalidJobConfig

__all__ = [
    "AllocatorError",
    "DeviceError",
    "GpuLost",
    "InUse",
    "InsufficientResources",
    "InvalidJobConfig",
    "InvalidRequest",
    "NoPermission",
    "NotFound",
    "NotSupported",
    "PermissionDenied",
    "QUOTA_SETTINGS",
    "QuotaExceeded",
    "StateNotSaved",
    "Stopping",
    "Unavailable",
    "VerifyFailed",
    "status_for",
]


class AllocatorError(Exception):
    """An allocator-level failure that no device error describes."""


# The settings a `QuotaExceeded` names (each counted from 0 in vgpu_quota_refusals_total).
QUOTA_SETTINGS = ("max_grants_per_node", "max_grants_per_uid", "max_grants_per_app", "max_watchers",
                  "max_watchers_per_caller", "max_watchers_per_uid")


class QuotaExceeded(InsufficientResources):
    """A caller is at one of the node's bounds on what it may hold (grants, watchers): refused as a
    request that does not fit (RESOURCE_EXHAUSTED), but counted and logged for the operator, since
    a caller at a bound is either a flood or a setting too low. `quota` names the setting."""

    def __init__(self, message: str, *, quota: str) -> None:
        super().__init__(message)
        self.quota = quota


class InvalidRequest(AllocatorError, ValueError):
    """A request argument is malformed or out of range; the message says which and what is allowed."""


class PermissionDenied(AllocatorError):
    """The caller may not act on this application's grants or limits."""


class VerifyFailed(AllocatorError):
    """A device write succeeded but reading the value back gave something else."""


class Unavailable(AllocatorError):
    """Something the call needs is not ready yet (e.g. the cold-start model still loading); retry."""


class Stopping(Unavailable):
    """The daemon is stopping: the change was refused and nothing changed; send it again once it is back."""


class StateNotSaved(Unavailable):
    """A change could not be stored (a full or failing state directory): it was undone, not made."""


# Checked in order with isinstance, so subclasses must come before their bases.
_STATUS_MAP: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidJobConfig, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (InsufficientResources, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (NoPermission, grpc.StatusCode.PERMISSION_DENIED),
    (NotSupported, grpc.StatusCode.FAILED_PRECONDITION),
    (InUse, grpc.StatusCode.FAILED_PRECONDITION),
    (ResetRequired, grpc.StatusCode.FAILED_PRECONDITION),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (GpuLost, grpc.StatusCode.UNAVAILABLE),
    (DriverNotLoaded, grpc.StatusCode.UNAVAILABLE),
    (LibraryNotFound, grpc.StatusCode.UNAVAILABLE),
    (Uninitialized, grpc.StatusCode.UNAVAILABLE),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (VerifyFailed, grpc.StatusCode.INTERNAL),
    (DeviceError, grpc.StatusCode.INTERNAL),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message for an exception.

    Unknown exceptions become INTERNAL with the exception's class name only (no internals leak);
    the caller logs the traceback.
    """
    for cls, code in _STATUS_MAP:
        if isinstance(exc, cls):
            return code, str(exc) or cls.__name__
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"
