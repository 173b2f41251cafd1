"""What the streamer takes signatures from: the live sampler or a trace replay."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from vgpu.inapp import INT_COUNTERS, inapp_value_problem
from vgpu.v1 import signature_pb2


@runtime_checkable
class SignatureSource(Protocol):
    """Called once per tick; returns the signatures observed since the previous call (may be empty)."""

    def sample(self) -> list[signature_pb2.BehavioralSignature]: ...

    def close(self) -> None: ...


class SeqCounter:
    """Per-application sequence numbers, strictly increasing from 1."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def next(self, app_id: str) -> int:
        seq = self._last.get(app_id, 0) + 1
        self._last[app_id] = seq
        return seq


def set_inapp_values(msg: signature_pb2.InAppCounters, values: Mapping[str, float]) -> None:
    """Set the in-app counters of `values` (counter name -> value, as a trace's `inapp_<name>` columns
    give them) on `msg`: an integer counter rounded, NaN or a value the counter cannot hold
    (`inapp_value_problem`) left unset, as every reader of in-app counters does."""
    for name, value in values.items():
        if value == value and inapp_value_problem(name, value) is None:  # value == value: not NaN
            setattr(msg, name, int(round(value)) if name in INT_COUNTERS else value)
