"""structlog set-up: JSON lines for daemons (journald keeps them), readable console output for people.

One record is one line, always valid JSON: every logger of the process writes through one shared
sink under one lock, each record in a single write (threads never interleave two records on a line),
and floats JSON cannot hold (inf, NaN) are written as the strings "inf", "-inf" and "nan"."""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
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
        structlog.processors.JSONRenderer(serializer=_dumps) if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )


def _finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by its name as a string."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else ("nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf"))
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _dumps(obj: Any, **kw: Any) -> str:
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:  # an inf or a NaN somewhere: rare, so only then is the record walked
        return json.dumps(_finite(obj), allow_nan=False, **kw)


class _LineSink:
    """Where every logger of the process writes: sys.stderr, looked up at each write (so a replaced
    or closed stream, pytest's capture or a redirected daemon, never leaves a logger holding a dead
    file), one record per write under one process-wide lock."""

    _lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            stream = sys.stderr
            stream.write(message + "\n")
            stream.flush()

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


_SINK = _LineSink()


def _stderr_logger(*_args: object) -> _LineSink:
    return _SINK


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


class _LibraryLogger:
    """A library's logger (the client stub runs inside applications): through the application's
    structlog set-up when it made one, else to stderr, never to stdout, which is the application's
    own output (structlog's unconfigured default prints to stdout)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _target(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger(self._name)
        return structlog.wrap_logger(structlog.PrintLogger(sys.stderr))

    def debug(self, event: str, *args: Any, **kw: Any) -> Any:
        return self._target().debug(event, *args, **kw)

    def info(self, event: str, *args: Any, **kw: Any) -> Any:
        return self._target().info(event, *args, **kw)

    def warning(self, event: str, *args: Any, **kw: Any) -> Any:
        return self._target().warning(event, *args, **kw)

    def error(self, event: str, *args: Any, **kw: Any) -> Any:
        return self._target().error(event, *args, **kw)


def get_library_logger(name: str) -> Logger:
    """The logger for code that runs inside someone else's program: see `_LibraryLogger`."""
    return _LibraryLogger(name)


def worth_logging(count: int) -> bool:
    """Whether the `count`-th repeat of one failure gets its own log line: the 1st, 10th and 100th,
    then every 1000th, so a failure that repeats every tick neither floods the log nor goes quiet."""
    return count in (1, 10, 100) or (count > 0 and count % 1000 == 0)


class LogBudget:
    """Which of many like events get a log record: the first `burst` of each key in each
    `interval_s`; the rest are counted, and the key's next record carries the count. At most
    `max_keys` keys are held: a new key past that forgets the key whose interval began first (one
    whose interval is over, unless a caller makes up keys faster: then a live one, whose count of
    events left out is lost and whose next event is logged). For events a caller can cause at will
    (refused calls, applications it makes up), so that it cannot fill the log."""

    def __init__(self, *, interval_s: float = 60.0, burst: int = 10,
                 max_keys: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        if not (interval_s > 0 and burst >= 1 and max_keys >= 1):
            raise ValueError("interval_s must be > 0, burst and max_keys >= 1")
        self.interval_s, self.burst, self.max_keys = interval_s, burst, max_keys
        self._clock = clock
        # key -> [start of its interval, records in it, events left out since its last record], in the
        # order their intervals began (a key whose interval restarts moves to the end), so the key to
        # forget is the first one: no pass over the table per new key
        self._keys: dict[tuple[object, ...], list[float]] = {}

    def admit(self, key: tuple[object, ...]) -> int | None:
        """None: leave this event out of the log (it is counted); else log it, with this many of its
        key left out before it."""
        now = self._clock()
        state = self._keys.get(key)
        if state is None:
            while len(self._keys) >= self.max_keys:  # the interval that began first: an expired one if any
                del self._keys[next(iter(self._keys))]
            state = self._keys[key] = [now, 0.0, 0.0]
        elif now - state[0] >= self.interval_s:
            state[0], state[1] = now, 0.0
            self._keys[key] = self._keys.pop(key)  # to the end: the intervals stay in the order they began
        if state[1] >= self.burst:
            state[2] += 1
            return None
        state[1] += 1
        since, state[2] = int(state[2]), 0.0
        return since
