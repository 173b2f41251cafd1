"""structlog set-up: JSON lines for daemons (journald keeps them), readable console output for people."""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, Protocol

import structlog


def configure(fmt: Literal["json", "console"] = "json", level: str = "info") -> None:
    """Configure structlog once per process. Logs go to stderr so stdout stays free for --json output."""
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )


class _Stderr:
    """Looks sys.stderr up at each write, so a replaced or closed stream (pytest's capture, a
    redirected daemon) never leaves the logger holding a dead file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _stderr_logger(*_args: object) -> structlog.PrintLogger:
    return structlog.PrintLogger(file=_Stderr())  # type: ignore[arg-type]


class Logger(Protocol):
    """The calls our code makes on a logger: `get_logger`'s structlog loggers have them, and so may
    a quiet or recording stand-in that a component takes as its `logger` argument."""

    def debug(self, event: str, *args: Any, **kw: Any) -> Any: ...

    def info(self, event: str, *args: Any, **kw: Any) -> Any: ...

    def warning(self, event: str, *args: Any, **kw: Any) -> Any: ...

    def error(self, event: str, *args: Any, **kw: Any) -> Any: ...


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger


def worth_logging(count: int) -> bool:
    """Whether the `count`-th repeat of one failure gets its own log line: the 1st, 10th and 100th,
    then every 1000th, so a failure that repeats every tick neither floods the log nor goes quiet."""
    return count in (1, 10, 100) or (count > 0 and count % 1000 == 0)
