"""Logging goes to whatever sys.stderr is at write time, as JSON lines for daemons."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from vgpu import log


@pytest.fixture(autouse=True)
def _reset() -> None:
    yield
    structlog.reset_defaults()


def test_json_lines_follow_a_replaced_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    log.configure("json")
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    log.get_logger("t").info("one", app="a")
    first.close()  # a stream closed under the logger (pytest capture ending) must not break it
    monkeypatch.setattr("sys.stderr", second)
    log.get_logger("t").warning("two", n=2)
    record = json.loads(second.getvalue())
    assert record["event"] == "two" and record["n"] == 2 and record["level"] == "warning"


def test_level_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    log.configure("json", level="warning")
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    log.get_logger("t").info("hidden")
    log.get_logger("t").error("shown")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [r["event"] for r in lines] == ["shown"]
