"""The device layer: one `Backend`/`Device` interface (`base`), NVML and simulated backends.

`open_backend(spec)` builds one from a string:

- ``"nvml"``: every GPU NVML sees (keyword arguments go to `NvmlBackend`).
- ``"sim"``: one simulated H100-80GB.
- ``"sim:h100-80gb"``, ``"sim:a100-40gb,a100-80gb"``, ``"sim:h100-80gb*8"``: simulated GPUs by SKU, a
  ``*N`` suffix repeating one (keyword arguments go to `SimBackend`: clock, privileged, ...).
"""

from __future__ import annotations

from typing import Any

from vgpu.device.base import Backend
from vgpu.device.skus import SKUS

__all__ = ["open_backend", "parse_sim_spec"]

_MAX_SIM_GPUS = 64


def _spec_error(spec: str, why: str) -> ValueError:
    return ValueError(
        f"bad device backend spec {spec!r}: {why}. Use 'nvml', 'sim', or 'sim:SKU[*N][,SKU[*N]...]' "
        f"with SKU one of {', '.join(sorted(SKUS))} (e.g. 'sim:h100-80gb*8')"
    )


def is_nvml_spec(spec: str) -> bool:
    """Whether a backend spec names the real GPUs ("nvml", in any case and with spaces around): the
    one test every reader of a spec uses, so that a real GPU is never taken for a simulator."""
    return spec.strip().lower() == "nvml"


def parse_sim_spec(spec: str) -> list[str]:
    """The SKU names of a "sim:..." spec, one per GPU; ValueError naming the problem otherwise."""
    text = spec.strip()
    if text.lower() == "sim":
        return ["h100-80gb"]
    head, sep, body = text.partition(":")
    if head.strip().lower() != "sim" or not sep:
        raise _spec_error(spec, "not a simulator spec")
    gpus: list[str] = []
    for part in body.split(","):
        part = part.strip().lower()
        if not part:
            raise _spec_error(spec, "empty SKU in the list")
        name, star, count_text = part.partition("*")
        name = name.strip()
        count = 1
        if star:
            try:
                count = int(count_text)
            except ValueError:
                raise _spec_error(spec, f"{count_text.strip()!r} is not a GPU count") from None
            if not 1 <= count <= _MAX_SIM_GPUS:
                raise _spec_error(spec, f"GPU count {count} is outside 1..{_MAX_SIM_GPUS}")
        if name not in SKUS:
            raise _spec_error(spec, f"unknown SKU {name!r}")
        gpus.extend([name] * count)
    if len(gpus) > _MAX_SIM_GPUS:
        raise _spec_error(spec, f"{len(gpus)} GPUs is more than {_MAX_SIM_GPUS}")
    return gpus


def open_backend(spec: str, **kw: Any) -> Backend:
    """A backend for `spec` ("nvml", "sim", "sim:h100-80gb*8", ...); ValueError for a bad spec."""
    if not isinstance(spec, str) or not spec.strip():
        raise _spec_error(str(spec), "empty")
    if is_nvml_spec(spec):
        from vgpu.device.nvml import NvmlBackend

        return NvmlBackend(**kw)
    gpus = parse_sim_spec(spec)
    from vgpu.device.sim import SimBackend

    return SimBackend(gpus, **kw)
