"""Shared by the daemon tests: an in-process `Daemon` on a simulated H100 in a temporary directory,
and `vgpu serve` as a real process (`Serve`) with the operator CLI run against it (`Env`)."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from vgpu import config
from vgpu.allocator.core import Sizer
from vgpu.daemon.serve import Daemon, SdNotifier
from vgpu.device.base import Backend


class FullDisk:
    """A SQLite connection (a Store's `_db`) whose writes fail as on a full disk while `full` is set."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.full = True

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if self.full and sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


def sim_daemon(tmp_path: Path, *, load_sizer: Callable[[], Sizer] | None = None, backend: Backend | None = None,
               **overrides: object) -> Daemon:
    """Not started: `await d.start()`, then `await d.stop("test")`. `backend`: in place of the one
    `server.backend` names."""
    cfg = config.load(None, env={}, overrides={
        "server.socket": str(tmp_path / "v.sock"), "server.state_dir": str(tmp_path / "state"),
        "server.backend": "sim:h100-80gb", "metrics.port": 0, "server.grace_s": 0.0, **overrides,
    })
    return Daemon(cfg, notifier=SdNotifier(env={}), registry=CollectorRegistry(), load_sizer=load_sizer,
                  backend=backend)


ROOT = Path(__file__).resolve().parent.parent
SKU = "h100-80gb"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class Env:
    tmp: Path
    sock: Path
    state: Path
    env: dict[str, str]

    def vgpu(self, *args: str, check: bool = True) -> Result:
        """An operator command, run in this process (the daemon is the real subprocess)."""
        from vgpu import ctl as cli

        if args[0] == "serve":
            from contextlib import redirect_stderr

            from vgpu.daemon import serve as daemon

            err = io.StringIO()
            with redirect_stderr(err):
                rc = daemon.main(list(args[1:]), "vgpu serve")
            return Result(rc, "", err.getvalue())
        fn = getattr(cli, args[0].replace("-", "_") + "_main")
        out, err = io.StringIO(), io.StringIO()
        from contextlib import redirect_stderr

        with redirect_stderr(err):
            rc = fn(list(args[1:]), f"vgpu {args[0]}", out=out, env=self.env)
        if check and rc != 0:
            raise AssertionError(f"vgpu {' '.join(args)} -> {rc}\n{out.getvalue()}\n{err.getvalue()}")
        return Result(rc, out.getvalue(), err.getvalue())

    def json(self, *args: str) -> dict:  # type: ignore[type-arg]
        return json.loads(self.vgpu(*args, "--socket", str(self.sock), "--json").stdout)  # type: ignore[no-any-return]


def make_env(tmp_path: Path) -> Env:
    """For an `env` fixture: a socket and state directory under tmp_path, no inherited VGPU_* settings."""
    e = dict(os.environ)
    e.update({"XDG_CONFIG_HOME": str(tmp_path / "home-config"), "PYTHONPATH": str(ROOT)})
    for k in list(e):
        if k.startswith(("VGPU_SERVER_", "VGPU_TOKEN", "NOTIFY_SOCKET", "WATCHDOG_")):
            del e[k]
    return Env(tmp_path, tmp_path / "run" / "vgpu.sock", tmp_path / "state", e)


class Serve:
    def __init__(self, env: Env, *extra: str, notify: Path | None = None, prefix: Sequence[str] = ()) -> None:
        """`prefix`: a command the daemon runs under (e.g. setpriv with the unit's capabilities)."""
        self.log_path = env.tmp / f"serve-{time.monotonic_ns()}.log"
        penv = dict(env.env)
        if notify is not None:
            penv.update({"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "300000"})
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(env.sock), "--state-dir", str(env.state),
             "--backend", f"sim:{SKU}", "--metrics-port", "0", *extra],
            cwd=ROOT, env=penv, stdout=subprocess.DEVNULL, stderr=self.log,
        )
        try:
            self.wait_for("serving")
        except BaseException:
            # the caller never gets this object to stop: stop the process here, on every path
            self.stop_now()
            raise

    def stop_now(self) -> None:
        """Kill the process if it still runs (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()

    def events(self) -> list[dict]:  # type: ignore[type-arg]
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return out

    @property
    def metrics_port(self) -> int:
        """The metrics endpoint's port, as `serving` names it (start the daemon with
        `--metrics-port auto`)."""
        return bound_port(self.event("serving"), "metrics")

    def event(self, name: str) -> dict:  # type: ignore[type-arg]
        found = [e for e in self.events() if e.get("event") == name]
        assert found, f"no {name!r} event in {self.log_path.read_text()}"
        return found[-1]

    def wait_for(self, name: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(e.get("event") == name for e in self.events()):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        raise AssertionError(f"no {name!r} within {timeout_s} s:\n{self.log_path.read_text()}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def term(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(30)
        self.log.close()
        return rc


def serves_killed_after() -> Iterator[list[Serve]]:
    """For a `serves` fixture: the daemons a test started, killed after it if still running."""
    started: list[Serve] = []
    yield started
    for s in started:
        s.stop_now()


@contextmanager
def one_daemon_for_the_module(env: Env) -> Iterator[Env]:
    """For a module-scoped fixture: one `vgpu serve` on `env` for every test of the module that only
    looks at it or asks about ids of its own (a start is 2-3 s of the suite), stopped after them."""
    daemon = Serve(env)
    try:
        yield env
    finally:
        daemon.stop_now()


async def start_logging_serving(d: Daemon) -> dict:  # type: ignore[type-arg]
    """`await d.start()` for an in-process daemon; the `serving` record it logged (where it listens)."""
    with capture_logs() as logs:
        await d.start()
    return next(r for r in logs if r["event"] == "serving")


def bound_port(serving: dict, key: str) -> int:  # type: ignore[type-arg]
    """The port a daemon bound, as its `serving` record names it under `key` ("metrics" or "tcp":
    "HOST:PORT", "[v6]:PORT"): with `--metrics-port auto` / `--tcp HOST:auto` the kernel picks a free
    one at bind, so no other process can take it between choosing and binding."""
    address = serving.get(key)
    assert address, f"the serving record names no {key} address: {serving}"
    return int(str(address).rpartition(":")[2])


def metric_samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A running daemon's /metrics as (name, sorted labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float = 0.1) -> None:
    """Poll `check` until it holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)
