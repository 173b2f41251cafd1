"""What the streamer takes signatures from: the live sampler or a trace replay."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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
