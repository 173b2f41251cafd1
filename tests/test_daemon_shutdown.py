"""A stop waits for background model loads: a process that exits while another thread is inside torch
or ONNX Runtime aborts (SIGABRT, "terminate called without an active exception") instead of exiting 0.
Seen on a fresh clone, where the first imports are slow enough for SIGTERM to land mid-load."""

from __future__ import annotations

import signal
import threading
import time
import types
from pathlib import Path

from daemon_fixtures import Serve, make_env

from vgpu.daemon.serve import Daemon


class _Waits:
    def __init__(self, delay_s: float) -> None:
        self.done = threading.Event()
        self._delay_s = delay_s
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        time.sleep(self._delay_s)
        self.done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.done.wait(timeout_s)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        self.done.wait(timeout_s)


def _daemon_with_loaders(delay_s: float) -> tuple[Daemon, threading.Event, _Waits, _Waits]:
    daemon = Daemon.__new__(Daemon)
    loaded = threading.Event()

    def load() -> None:
        time.sleep(delay_s)
        loaded.set()

    daemon.model_loader = threading.Thread(target=load, daemon=True)
    daemon.model_loader.start()
    sizer, reload = _Waits(delay_s), _Waits(delay_s)
    daemon.sizer = sizer  # type: ignore[assignment]
    daemon.manager = types.SimpleNamespace(forecaster=reload)  # type: ignore[assignment]
    return daemon, loaded, sizer, reload


def test_stop_waits_for_every_background_load() -> None:
    daemon, loaded, sizer, reload = _daemon_with_loaders(0.3)
    daemon._wait_for_loaders(10.0)
    assert loaded.is_set() and sizer.done.is_set() and reload.done.is_set()


def test_the_wait_is_bounded_by_one_deadline() -> None:
    daemon, loaded, _, _ = _daemon_with_loaders(5.0)
    started = time.monotonic()
    daemon._wait_for_loaders(0.3)
    assert time.monotonic() - started < 1.5  # one deadline for all three, not 0.3 s each plus slack
    assert not loaded.is_set()


def test_a_hang_up_signal_is_logged_and_the_daemon_keeps_serving(tmp_path: Path) -> None:
    """SIGHUP (`kill -HUP` meant as a reload, or the terminal of a daemon started by hand closing)
    killed `vgpu serve` on the spot, by Python's default action: no stop, no device restore, the socket
    left behind. It is now logged with what to do instead, and the daemon goes on serving."""
    env = make_env(tmp_path)
    serve = Serve(env)
    try:
        env.json("request", "--app", "a", "--memory-mib", "10")
        serve.proc.send_signal(signal.SIGHUP)
        serve.wait_for("sighup_ignored", timeout_s=10)
        assert serve.proc.poll() is None
        assert [a["app_id"] for a in env.json("apps")["apps"]] == ["a"]
    finally:
        assert serve.term() == 0
    assert serve.event("stopped") and not env.sock.exists()


# `vgpu serve` whose cold-start sizer takes 40 s to load (the shipped loader, then a wait): the process
# is stopped while that load is still under way.
SLOW_LOAD = """
import sys, time
from vgpu.daemon import serve

shipped = serve.default_sizer

def slow():
    sizer = shipped()
    time.sleep(40)
    return sizer

serve.default_sizer = slow
sys.exit(serve.main(sys.argv[1:]))
"""


def test_a_stop_during_a_background_load_ends_the_process_at_once_with_everything_saved(tmp_path: Path) -> None:
    """The process does not wait for a background load when it stops: right after `stopped` it ends
    (os._exit, exit status 0: a normal exit would run torch's C++ destructors under the loading
    thread), with every grant saved for the next start."""
    import subprocess
    import sys

    from daemon_fixtures import ROOT, SKU

    env = make_env(tmp_path)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_LOAD, "--socket", str(env.sock), "--state-dir", str(env.state),
             "--backend", f"sim:{SKU}", "--metrics-port", "0"],
            cwd=ROOT, env=env.env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 60
            while '"serving"' not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.05)
            grant = env.json("request", "--app", "kept", "--memory-mib", "64")
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            assert proc.wait(30) == 0, log_path.read_text()
            assert time.monotonic() - started < 20  # not the 40 s load
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    events = [e for e in log_path.read_text().splitlines() if e.startswith("{")]
    assert '"stopped"' in events[-1] and not any('"coldstart_sizer_loaded"' in e for e in events)
    serve = Serve(env)  # the grant was saved before the process ended
    try:
        assert serve.event("reconciled")["grants_restored"] == 1
        assert [g["grant_id"] for a in env.json("apps")["apps"] for g in a["grants"]] == [grant["grant_id"]]
    finally:
        assert serve.term() == 0
