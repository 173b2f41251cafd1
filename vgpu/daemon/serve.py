"""`vgpu serve`: the composition root. It builds the daemon from its configuration, starts the parts
in a fixed order, serves until SIGTERM or SIGINT, then stops them and puts the devices back. SIGHUP
is logged (`sighup_ignored`) and changes nothing: there is no reload by signal.

    vgpu serve --socket PATH --state-dir DIR --backend sim:h100-80gb|nvml [--config FILE]
               [--tcp HOST:PORT --tls-cert PEM --tls-key PEM [--tls-ca PEM]] [--metrics-port N|auto] [--dry-run]

This module owns the order of start-up and stop (`Daemon.start`, `Daemon.stop`), the state
directory's lock, the reconciliation of the stored ledger with the devices (`reconcile`), putting
devices back to their recorded originals (`restore_devices`), the public socket and the front's
private directory, the two early releases (idle, stream end), systemd notification and the command
line (`main`). The parts themselves are built elsewhere: the Allocator (allocator/), the Manager
(manager/), the servicers, access control (vgpu/auth.py), the front (vgpu/daemon/front.py) and the
metrics (vgpu/daemon/metrics.py).

Configuration (`main`, before anything starts): defaults < /etc/vgpu/vgpu.toml (or --config) <
VGPU_* < flags (vgpu/config.py). A bad value, a plaintext TCP address or half a TLS pair is a
ConfigError: `vgpu serve: configuration error: ...` on stderr, exit status 2; so are a user or group
the host lacks and a configured file (manager.model; tls.* with server.tcp) that is missing or
unreadable (`--check-config` checks all of it and starts nothing).

Start-up (`Daemon.start`), in order. A step that cannot be done raises StartupError (token files:
auth.AuthSetupError) with a message that names what to fix; `run` calls `stop()`, which undoes only
the steps reached, then removes the state directory if this start created it (`state_dir_removed`),
and `main` logs `startup_failed` and prints `vgpu serve: <message>` on one line
on stderr, exit status 1 (any other exception: `vgpu serve: cannot start: <type>: <message>`), or 2
for a PermanentStartupError, which every later start would meet too (a configured model that does
not load, a TLS file that cannot be read, a damaged state database or one of a newer schema, an
in-app directory another user controls).
1. dry run resolved (`server.dry_run` unset: on for nvml, off for the simulator); when on, a
   `dry_run` warning;
2. the state directory (`_open_state`): created and locked with flock(2), so that two daemons never
   share it (fails: "another vgpu daemon is using the state directory ..."); with --reset-state the
   old database is moved aside (`state_reset`); the SQLite store is opened (a damaged one fails,
   naming --reset-state);
3. the device backend (`open_backend`; NVML that cannot be opened fails naming `vgpu doctor`, a bad
   simulator spec fails as `--backend: ...`);
4. reconciliation (`reconcile`): each device's power limit and MIG layout are recorded as its
   *original* unless a previous run recorded one (then a difference is reported: a crash left the
   daemon's settings, which the next graceful stop puts back); the ledger is loaded (one that cannot
   be read fails, naming --reset-state; a bad row is left out and counted), and grants on devices
   that are gone and grants of processes that have exited are released;
5. the allocator (`_build_allocator`): the MIG mechanism (`<state_dir>/mig`), the cold-start sizer
   (manager/coldstart.py), which loads in a worker thread from step 11 on (requests that need it
   before it is loaded are answered UNAVAILABLE; if it cannot load, one warning, and they are
   answered FAILED_PRECONDITION), cgroup memory limits (each device is asked whether its driver has
   them at all: one that does not is said once, `cgroup_memory_limit_unsupported`, and counted in
   `vgpu_enforcement_unsupported`, not in the alert's `vgpu_enforcement_disabled`) and the predictive
   policy; then a cgroup memory limit a crashed run left on
   a cgroup no remaining grant holds gets its recorded original back (every one of them when
   `server.cgroup_memory_limits` is off: nothing would restore them later);
6. the forecaster and the manager (`_build_manager`, manager/modelpath.py): a configured
   `manager.model` must load or the start fails; otherwise the shipped model loads in a worker thread
   from step 11 on while the baseline serves. Either is a `ReloadingForecaster` that checks its file every
   `manager.model_check_interval_s` and swaps a new checkpoint in without touching the streams
   (`forecaster_reloaded`); a new file that does not load is logged (`forecaster_reload_failed`)
   and the old model keeps serving. With `manager.mixture` the served forecaster is the expert
   mixture (manager/experts.py), and the node history and the background learner start here;
7. the metrics' collectors; the reconciled ledger stored whole (fails: "cannot store the reconciled
   ledger"); one `reconciled` record of what steps 4 and 5 found (`_store_reconciled`);
8. tokens (vgpu/auth.py; an application's token file that cannot be written is logged
   `app_token_unwritable` and the start goes on), the front's private directory
   (`<state_dir>/front`, 0700) and the access-control interceptor (`_access_control`);
9. the sockets: the public socket's path is checked (another daemon listening on it, or a file that
   is not a socket, fails; a stale socket is removed) and its directories created; the in-app
   directory is created when missing (a missing parent is no failure: what was found is in `serving`;
   one another user controls is, `prepare_inapp_dir`); the gRPC server
   is built with the Allocator and Ingest servicers behind the interceptor, listening in the front's
   directory (with `server.peer_credentials = false`, on the public socket itself), and the public
   socket is bound owner-only (`_build_server`), then given its configured owner, group and mode;
   the optional TLS listener (`_add_tcp`); the metrics endpoint (`_serve_metrics`: a port that
   cannot be bound fails the start, metrics.port 0 turns it off); a port given as "auto"
   (metrics.port, server.tcp HOST:auto) is any free port the kernel picks, and `serving` and the
   STATUS sent to systemd name the ports bound;
10. gRPC starts, then the front (`_start_front`) listens on the public socket: it reads each
   caller's credentials (SO_PEERCRED), bounds connections per uid and relays to gRPC;
11. start-up's heap is frozen out of the garbage collector's full passes (vgpu/gc_freeze.py),
   `serving` is logged, READY=1 goes to systemd, WATCHDOG=1 every third of WatchdogSec while the
   loop is alive (they stop, with `front_stopped`, once the front's thread has ended, so that
   systemd restarts a daemon nobody can reach), and the idle release starts. The background loads
   (the cold-start sizer, the shipped model) begin only now: importing torch and loading a model hold
   the interpreter's lock for long stretches, and begun before this step they delayed `serving`
   (docs/performance.md, *A daemon's start and stop*). Once they are over, the heap is frozen again
   (`heap_frozen`), so that what they loaded is out of the full passes too.

Releases while serving: every min(5 s, idle_release_s / 4, exit_release_s / 2, at least 1 s) a sweep
releases the grants whose process the daemon saw run and has exited, its application silent for
`server.exit_release_s` (`Allocator.release_exited`, `app_released_exited`; off with 0), then the
grants of applications silent for idle_release_s (`Allocator.release_vanished`; off with 0); a failed
sweep is logged `idle_release_failed`. With `server.idle_release_s` 0 (keep grants until they are
released) neither the idle release nor the stream-end release below runs; `server.stream_end_grace_s`
(10 s) after a profiler stream ends, its applications whose grants the daemon made from their
signatures and whose process runs on none of their GPUs go (`_release_after_stream`,
`app_released_stream_ended`).

Stop (`Daemon.stop`; SIGTERM or SIGINT, or a failed start), in order: STOPPING=1; the watchdog, the
idle release and the stream-end timers are cancelled; the allocator refuses every change from here on
(`Allocator.refuse_changes`: a call that still reaches it, on a connection already open or a
profiler stream's decisions, is answered UNAVAILABLE "the daemon is stopping" and changes nothing,
so what the last save writes is what was acknowledged); the front stops accepting and the public
socket is removed; the watch streams end (they never end by themselves, so the grace would always
run out on them); the server stops taking calls (in-flight ones get `grace_s`, relayed still); the
front closes what is left and the front's directory is removed; the allocator restores what it
changed (power limits, cgroup limits, MIG), then every device whose power limit or MIG layout still
differs from the recorded original is put back and read back (`device_restored` with before/after;
skipped in a dry run, `restore_skipped`); the ledger is saved; the metrics endpoint stops;
background loads (forecaster, cold-start sizer, a hot reload) are waited for up to LOADER_JOIN_S,
the learner stopped, the history, backend and store closed; `stopped` is logged, the state
directory unlocked; exit status 0. Each step is guarded (`Daemon._stop_step`): one that fails is
logged `stop_step_failed`, listed in `stopped` (`failed_steps`), and the others still run; `main`
then prints `vgpu serve: the stop failed in part (...)` and the exit status is 1. Forgetting a
restored original is best effort (`restore_devices`). `vgpu serve` itself (`main`) does not wait for the background
loads: a stop that comes while one is still under way (seconds after the start) ends the process
right after `stopped` with `os._exit`, because the interpreter's normal exit would run torch's and
ONNX Runtime's C++ destructors under the loading thread and abort (SIGABRT, "terminate called
without an active exception"); everything is saved and closed by then, and the loads' results were
for a process that is ending.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import grp
import math
import os
import pwd
import shutil
import signal
import socket
import sqlite3
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO

import grpc
import psutil
import structlog
from prometheus_client import CollectorRegistry

from vgpu import auth, log, peers
from vgpu import config as vconfig
from vgpu.allocator.core import GRANT_CHANGE_KEYS, Allocator, Sizer, device_capacities
from vgpu.allocator.errors import QUOTA_SETTINGS, NotFound, StateNotSaved
from vgpu.allocator.ledger import Ledger
from vgpu.allocator.mechanisms.limits import CgroupMemoryLimits
from vgpu.allocator.mechanisms.mig import MigLayoutMechanism
from vgpu.allocator.policy.base import hard_limit_at_frac_for
from vgpu.allocator.policy.forecast import ForecastPolicy
from vgpu.allocator.service import AllocatorServicer, ProfilerState, Server, build_server
from vgpu.allocator.store import SCHEMA_VERSION, DeviceOriginal, MigSlot, Store, StoreError, reset_state
from vgpu.capped import read_capped
from vgpu.client import (
    DEFAULT_INAPP_DIR,
    INAPP_MAX_AGE_S,
    PID_START_TOLERANCE_S,
    InAppFinder,
    make_inapp_dir,
    read_inapp_reports,
)
from vgpu.config import Config, ConfigError
from vgpu.daemon.front import PeerFront
from vgpu.daemon.inapp_sweep import (
    INAPP_SWEEP_EVERY_S,
    InAppSweeper,
    inapp_dir_problem,
    inapp_dir_shuts_out_others,
)
from vgpu.daemon.metrics import (
    AppSnapshot,
    CounterSnapshot,
    DaemonMetrics,
    DeviceSnapshot,
    start_metrics_server,
)
from vgpu.device import is_nvml_spec
from vgpu.device.base import Backend, Device
from vgpu.device.errors import DeviceError
from vgpu.gc_freeze import freeze_startup_heap, thaw_heap
from vgpu.ids import MAX_PID
from vgpu.manager.coldstart import AllocatorSizer, BackgroundSizer, ColdStartSizer
from vgpu.manager.core import Manager, StreamState, default_baseline
from vgpu.manager.experts import MixtureForecaster, make_served
from vgpu.manager.forecast import Forecaster
from vgpu.manager.history import NodeHistory
from vgpu.manager.modelpath import ModelChoice, open_forecaster, resolve_model
from vgpu.manager.nodelearn import BackgroundLearner, LocalModelWatcher
from vgpu.manager.nodetrees import TREES, load_trees
from vgpu.manager.service import IngestServicer
from vgpu.manager.window import WindowStore
from vgpu.wire import inapp_drop_reasons

SIM_STATE_FILE = "sim-devices.json"
# The most of a TLS key, certificate or CA bundle that is read (vgpu/capped.py); a system CA bundle is
# about 200 KiB.
MAX_TLS_FILE_BYTES = 16 * 1024 * 1024
LOCK_FILE = "daemon.lock"
# The front's private directory in the state directory (mode 0700), and gRPC's own socket in it.
FRONT_DIR = "front"
UPSTREAM_SOCKET = "grpc.sock"
# A window's trace covers at most this long before its latest sample (a forecast's 1 s grid is
# bounded by it, whatever time stamps a profiler sends); samples stamped further ahead of the
# daemon's clock than MAX_FUTURE_S are rejected with the reason. The profiler reads the node's own
# clock, so its samples are never ahead but by the node's clock adjustments; and a sample accepted
# ahead makes every honest sample of its application "out of order" until the clock reaches it,
# which this bounds to seconds.
MAX_WINDOW_SPAN_S = 3600.0
MAX_FUTURE_S = 10.0
# Connections that hold a descriptor and do nothing are closed: one that has not finished its
# HTTP/2 handshake after 10 s (a local client needs milliseconds), and one with no call for 10 min.
# How many may be open at once is `server.max_connections` (server_options).
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.server_handshake_timeout_ms", 10_000),
    ("grpc.max_connection_idle_ms", 600_000),
)
# How long a stop waits for background model loads to end (they take seconds). The wait comes after the
# devices are restored and the ledger saved, so a stop that systemd kills during it (the shipped unit's
# TimeoutStopSec is 60 s) loses only the clean exit.
LOADER_JOIN_S = 60.0


def server_options(max_connections: int, max_streams_per_connection: int,
                   max_request_bytes: int) -> tuple[tuple[str, int], ...]:
    """The gRPC server's options: SERVER_OPTIONS, the bound on connections open at once (gRPC
    core closes one beyond it as soon as it is accepted; an idle connection costs about 13 KiB, and
    gRPC's read-buffer, BDP and HPACK options do not change that, so the count is what bounds it),
    and what one connection can make the daemon hold in requests not yet complete: gRPC reads a
    call's request message into memory until it is whole (HTTP/2 flow control opens the stream's
    window to the length the message announces, so `grpc.http2.lookahead_bytes` does not bound it),
    so a connection holds at most `max_streams_per_connection` x `max_request_bytes` of them
    (a message announcing more is refused before it is read)."""
    return (*SERVER_OPTIONS, ("grpc.max_allowed_incoming_connections", max_connections),
            ("grpc.max_concurrent_streams", max_streams_per_connection),
            ("grpc.max_receive_message_length", max_request_bytes))


# `vgpu serve`'s exit statuses for a start that fails. The unit restarts the first
# (Restart=on-failure) and not the second (RestartPreventExitStatus=2).
EXIT_START_FAILED = 1  # another start may succeed: NVML not loaded yet at boot, a port still held
EXIT_FIX_FIRST = 2  # every start fails alike until an operator acts: a configuration or state problem


class StartupError(RuntimeError):
    """The daemon cannot start; the message says what to fix."""

    exit_status = EXIT_START_FAILED


class PermanentStartupError(StartupError):
    """A start that fails on what the operator configured or on the stored state (a configured model
    or TLS file missing or unreadable, a damaged state database, one from a newer vgpu): starting
    again cannot get past it, so it exits as a configuration error does."""

    exit_status = EXIT_FIX_FIRST


# --- systemd notification ------------------------------------------------------------------------------
class SdNotifier:
    """sd_notify(3) over $NOTIFY_SOCKET (a datagram socket; '@' = abstract namespace). Without the
    variable (not under systemd) every call does nothing."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self.address = env.get("NOTIFY_SOCKET", "")
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ours = not pid or pid == str(os.getpid())
        self.watchdog_s: float | None = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and ours else None
        self.error: str | None = None

    def notify(self, message: str) -> bool:
        """Send `message`; whether it was sent. A socket that is gone or refuses (a stale variable
        inherited from a unit that ended) is not the daemon's failure, as sd_notify(3) returns an
        error rather than failing its caller: the stop that notifies first must still restore the
        devices and save. Nor is a receiver whose queue is full (it does not read): the message is
        dropped rather than waited on. The last error is kept in `error`."""
        if not self.address:
            return False
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(addr)
                # never waits: the caller is the event loop, and a receiver that does not read (a
                # stale socket some process still holds) would stall it; a full queue is an error
                s.send(message.encode(), socket.MSG_DONTWAIT)
        except OSError as exc:
            self.error = f"{self.address}: {exc.strerror or exc}"
            return False
        return True


# --- pieces the servicers and access control need ------------------------------------------------------
class LedgerView:
    """What access control asks of the allocator's ledger (vgpu.auth.LedgerView)."""

    def __init__(self, allocator: Allocator) -> None:
        self._allocator = allocator

    def grant_owner(self, grant_id: str) -> str | None:
        try:
            return self._allocator.ledger.get(grant_id).app_id
        except NotFound:
            return None

    def has_app(self, app_id: str) -> bool:
        """Grants someone asked for, or limits an operator set. Forecast grants do not count: they
        come from signatures, whose app ids a profiler may make up, and must not lock the real owner
        of an id out of claiming it."""
        ledger = self._allocator.ledger
        return any(g.source != "forecast" for g in ledger.grants(app_id=app_id)) or ledger.limits(app_id) is not None


def model_of(forecaster: Forecaster) -> Forecaster | None:
    """The model behind the served forecaster (the mixture's "model" expert, else itself): what the
    reload counters and the shutdown's wait read."""
    return forecaster.expert("model") if isinstance(forecaster, MixtureForecaster) else forecaster


class NodeView:
    """What the manager knows that the allocator's RPCs show (vgpu.allocator.service.NodeObserver)."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager

    def app_pids(self, app_id: str) -> list[int]:
        return self.manager.app_pids(app_id)

    def profiler_states(self) -> dict[str, ProfilerState]:
        return {dev: ProfilerState(n, t) for dev, (n, t) in self.manager.profiler_states().items()}

    def open_profiler_streams(self) -> int:
        return self.manager.open_streams()


class StateSource:
    """The daemon's live state as metric snapshots (vgpu.daemon.metrics.MetricsSource)."""

    def __init__(self, allocator: Allocator, manager: Manager, backend_name: str = "",
                 local_model: LocalModelWatcher | None = None, node_trees: LocalModelWatcher | None = None) -> None:
        self.allocator = allocator
        self.manager = manager
        self.backend_name = backend_name
        self.local_model = local_model  # None: no node-local model slot
        self.node_trees = node_trees  # None: no node-local trees slot

    def app_snapshots(self) -> list[AppSnapshot]:
        """One snapshot per application and device: its grants there, and its use and forecast on
        the device its signatures name. An application with no device (limits set before it ran)
        has none: a `device=""` series would count a device that does not exist."""
        counts = {(app, dev): (over, oom) for app, dev, over, oom in self.allocator.history.counts()}
        out = []
        for a in self.allocator.list_apps():
            devices = sorted({a.device_id, *(g.device_id for g in a.grants)} - {""})
            for dev in devices:
                grants = [g for g in a.grants if g.device_id == dev]
                mine = dev == a.device_id
                over, oom = counts.get((a.app_id, dev), (None, None))
                out.append(AppSnapshot(
                    app_id=a.app_id,
                    device_id=dev,
                    mem_used_mib=a.mem_used_mib if mine else math.nan,
                    sm_util_pct=a.sm_util_pct if mine else math.nan,
                    forecast_mem_p50_mib=a.forecast_mem_p50_mib if mine else math.nan,
                    forecast_mem_p90_mib=a.forecast_mem_p90_mib if mine else math.nan,
                    forecast_sm_p90_pct=a.forecast_sm_p90_pct if mine else math.nan,
                    granted_mem_mib=sum(g.memory_mib for g in grants),
                    granted_sm_pct=sum(g.sm_pct for g in grants),
                    grants=len(grants),
                    last_seen_s=a.last_seen_s if a.last_seen_s is not None else math.nan,
                    overruns=over,
                    oom_events=oom,
                    limited=a.limits is not None,
                    inapp=tuple(sorted(self.manager.windows.inapp_latest(a.app_id).items())) if mine else (),
                ))
        return out

    def device_snapshots(self) -> list[DeviceSnapshot]:
        states = self.manager.profiler_states()
        now = self.allocator.clock()
        out = []
        for d in self.allocator.available():
            power, lim = self.allocator.power, self.allocator.cgroup_limits
            off = [("power_limit", power.disabled_reason(d.device_id) or "")]
            lacks = ["power_limit"] if power.unsupported(d.device_id) else []
            if lim is not None:
                off.append(("cgroup_memory", lim.disabled_reason(d.device_id) or ""))
                lacks += ["cgroup_memory"] if lim.unsupported(d.device_id) else []
            streams, newest = states.get(d.device_id, (0, None))
            out.append(
                DeviceSnapshot(
                    d.device_id,
                    d.mem_total_mib,
                    d.mem_granted_mib,
                    d.power_limit_mw,
                    tuple(off),
                    unsupported=tuple(lacks),
                    index=d.index,
                    name=d.name,
                    pci_bus_id=d.pci_bus_id,
                    mem_used_mib=d.mem_used_mib,
                    power_draw_mw=d.power_draw_mw,
                    temperature_c=d.temperature_c,
                    sm_clock_mhz=d.sm_clock_mhz,
                    sm_util_pct=d.sm_util_pct,
                    dry_run=d.dry_run,
                    profiler_streams=streams,
                    newest_signature_age_s=max(0.0, now - newest) if newest is not None else None,
                    memory_limits_hard=self.allocator.memory_enforcement(d.device_id).hard_mem,
                )
            )
        return out

    def counter_snapshot(self) -> CounterSnapshot:
        c, s = self.allocator.counters, self.manager.stats
        forecaster = model_of(self.manager.forecaster)
        return CounterSnapshot(
            power_limit_changes=c.power_limit_changes,
            mig_changes=c.mig_changes,
            grants_resized=c.resized,
            failures=tuple((dev, mech, n) for (dev, mech), n in sorted(self._failures(c.failures).items())),
            forecast_batches=s.forecast_batches,
            forecast_s_total=s.forecast_s_total,
            forecast_latency=s.forecast_latency,
            tick_latency=s.tick_latency,
            forecast_failures=s.forecast_failures,
            signatures_accepted=s.accepted,
            signatures_rejected=s.rejected - s.unknown_device - s.over_capacity,
            signatures_out_of_order=s.out_of_order,
            signatures_unknown_device=s.unknown_device,
            signatures_over_capacity=s.over_capacity,
            signatures_duplicate=s.duplicates,
            forecaster=self.manager.source,
            forecaster_reloads=getattr(forecaster, "reloads", 0),
            forecaster_reload_failures=getattr(forecaster, "reload_failures", 0),
            local_model=self.local_model.state if self.local_model is not None else "",
            local_model_loads=self.local_model.loaded if self.local_model is not None else 0,
            local_model_load_failures=self.local_model.failures if self.local_model is not None else 0,
            node_trees=self.node_trees.state if self.node_trees is not None else "",
            node_trees_loads=self.node_trees.loaded if self.node_trees is not None else 0,
            node_trees_load_failures=self.node_trees.failures if self.node_trees is not None else 0,
            grant_changes=tuple((kind, reason, n) for (kind, reason), n in
                                sorted({**dict.fromkeys(GRANT_CHANGE_KEYS, 0), **c.grant_changes}.items())),
            quota_refusals=tuple(sorted({**dict.fromkeys(QUOTA_SETTINGS, 0), **c.quota_refusals}.items())),
            cold_start_reused=c.cold_start_reused,
            backend=self.backend_name,
            inapp_apps=tuple(sorted(self.manager.windows.inapp_reporting().items())),
            inapp_dropped=tuple(sorted({**dict.fromkeys(inapp_drop_reasons(), 0), **s.inapp_dropped}.items())),
        )

    def _failures(self, counted: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        """`counted` with a 0 for every device and every mechanism the allocator has, so that each
        series exists from the start and `rate()`/`increase()` see the first failure."""
        mechanisms = ["power_limit"]
        if self.allocator.mig is not None:
            mechanisms.append("mig")
        if self.allocator.cgroup_limits is not None:
            mechanisms.append("cgroup_memory")
        zeros = {(c.device_id, m): 0 for c in self.allocator.ledger.devices() for m in mechanisms}
        return {**zeros, **counted}


# The daemon's pid proof lists the in-app directory on its event loop: at most one bounded step
# (vgpu.client.MAX_INAPP_SCAN_ENTRIES entries) per this many seconds, whoever asks, and each step looks
# for every pid asked about in the last INAPP_PROOF_ASKED_S (at most INAPP_PROOF_ASKED_MAX of them), so
# that a flood of requests naming pids adds no listing, and its steps find the other pids' names too.
INAPP_PROOF_SCAN_EVERY_S = 0.25
INAPP_PROOF_ASKED_S = 60.0
INAPP_PROOF_ASKED_MAX = 1024


class InAppPidProof:
    """Whether a process runs a given application, shown in a way only the process's own user could
    arrange: its client stub's in-app report (`<inapp_dir>/<pid>.json`, or the stub's
    `<pid>.<token>.json` where another user's file took that name: vgpu/client.py) is a regular file
    owned by the process's user, fresh, written by this very process (its start time), and names the
    application. Another user cannot make a file owned by that user (and in the sticky in-app
    directory cannot replace one); the same user could, but may signal or trace the process anyway.
    Each file is opened once (no symlink, no waiting) and checked through that descriptor
    (`vgpu.client.read_inapp_reports`). The other names are found by listing the directory
    (`vgpu.client.InAppFinder`) when a check finds no report under the names known: one step of at
    most MAX_INAPP_SCAN_ENTRIES entries per INAPP_PROOF_SCAN_EVERY_S, each going on where the last
    stopped, for every pid asked about lately. In a directory of more entries, or while other checks
    take the steps, a report under another name may take a few checks (seconds) to be found."""

    def __init__(self, directory: Path = DEFAULT_INAPP_DIR, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, proc_root: Path = Path("/proc"),
                 process: Callable[[int], psutil.Process] = psutil.Process, finder: InAppFinder | None = None,
                 scan_every_s: float = INAPP_PROOF_SCAN_EVERY_S) -> None:
        self.directory = Path(directory)
        self._clock = clock
        self._mono = monotonic
        self._proc_root = Path(proc_root)
        self._process = process
        self.finder = finder or InAppFinder(self.directory)
        self._scan_every_s = scan_every_s
        self._scanned_at = -math.inf
        # pid -> (its owner's uid, monotonic time it was last asked about), oldest first
        self._asked: dict[int, tuple[int, float]] = {}
        self.scans = 0

    def __call__(self, pid: int, app_id: str) -> bool:
        try:
            proc_uid = os.stat(self._proc_root / str(pid)).st_uid
            start_s = self._process(pid).create_time()
        except (OSError, psutil.Error):
            return False
        now = self._mono()
        self._asked.pop(pid, None)
        self._asked[pid] = (proc_uid, now)
        while len(self._asked) > INAPP_PROOF_ASKED_MAX or now - next(iter(self._asked.values()))[1] > INAPP_PROOF_ASKED_S:
            del self._asked[next(iter(self._asked))]
        known = self.finder.paths(pid)  # the names found stay known (InAppFinder's own bound) while their files do
        if self._proven(pid, app_id, proc_uid, start_s, known):
            return True
        if now - self._scanned_at < self._scan_every_s:
            return False
        # not under the names known: list the directory (one bounded step) for the stubs' other names
        self._scanned_at = now
        self.scans += 1
        try:
            self.finder.scan({p: (uid,) for p, (uid, _) in self._asked.items()})
        except OSError:
            return False
        return self._proven(pid, app_id, proc_uid, start_s, [p for p in self.finder.paths(pid) if p not in known])

    def _proven(self, pid: int, app_id: str, proc_uid: int, start_s: float, paths: list[Path]) -> bool:
        # regular files only, opened without waiting: the directory is every user's, and a FIFO put
        # there under this pid's name held this open (and the event loop) until a writer came
        found = read_inapp_reports(
            paths, pid, now_s=self._clock(), owners=(proc_uid,), max_age_s=INAPP_MAX_AGE_S,
            gone=lambda path: self.finder.forget(pid, path),
        )
        return any(
            report.app_id == app_id
            and report.pid_start_s is not None
            and abs(report.pid_start_s - start_s) <= PID_START_TOLERANCE_S
            for report in found.reports
        )


class ObservedPids:
    """Whether a pid is a GPU process the node's driver lists on a device (NVML's running compute
    processes; the simulator's process list), for the manager's check of profiler signatures
    (`Manager.pid_observed`). The lists are read at most every `max_age_s` when the answer is yes,
    and again on a no once `min_refresh_s` has passed (a process that just started is found at its
    next signature; a stream of made-up pids costs at most one read per `min_refresh_s`). A MIG
    instance's id stands for its GPU's processes; a device that cannot be read lists none."""

    def __init__(self, backend: Backend, *, clock: Callable[[], float] = time.monotonic,
                 max_age_s: float = 1.0, min_refresh_s: float = 0.2) -> None:
        self._backend = backend
        self._clock = clock
        self._max_age_s = max_age_s
        self._min_refresh_s = min_refresh_s
        self._pids: dict[str, frozenset[int]] = {}
        self._read_at_s = -math.inf
        self.reads = 0

    def runs(self, device_id: str, pid: int) -> bool | None:
        """Whether `pid` runs on the device now, from a fresh read of the lists; None when the device
        cannot be read (a pid that may run there)."""
        try:
            self._read(self._clock())
        except DeviceError:
            return None
        pids = self._pids.get(device_id)
        return None if pids is None else pid in pids

    def __call__(self, device_id: str, pid: int) -> bool:
        now = self._clock()
        if now - self._read_at_s > self._max_age_s:
            self._read(now)
        if pid in self._pids.get(device_id, ()):
            return True
        if now - self._read_at_s > self._min_refresh_s:
            self._read(now)
            return pid in self._pids.get(device_id, ())
        return False

    def _read(self, now: float) -> None:
        self._read_at_s = now
        self.reads += 1
        out: dict[str, frozenset[int]] = {}
        for dev in self._backend.devices():
            try:
                pids = frozenset(p.pid for p in dev.processes())
                instances = [gi.uuid for gi in dev.gpu_instances() if gi.uuid] if dev.mig_enabled() else []
            except DeviceError:
                continue
            out[dev.uuid] = pids
            out.update((uuid, pids) for uuid in instances)
        self._pids = out


# --- backend, originals, reconciliation ----------------------------------------------------------------
def open_backend(spec: str, state_dir: Path) -> Backend:
    """A backend by the device layer's one grammar (`vgpu.device.parse_sim_spec`: `nvml`, `sim`,
    `sim:SKU[*N][,SKU[*N]...]`); a simulated node keeps its device settings in the state directory."""
    if is_nvml_spec(spec):
        try:
            from vgpu.device.nvml import NvmlBackend

            return NvmlBackend()
        except (ImportError, DeviceError) as exc:
            raise StartupError(f"cannot open NVML ({type(exc).__name__}: {exc}); run `vgpu doctor`") from exc
    from vgpu.device import parse_sim_spec
    from vgpu.device.simstate import PersistentSimBackend, SimStateError

    try:
        return PersistentSimBackend(parse_sim_spec(spec), state_dir / SIM_STATE_FILE)
    except SimStateError as exc:  # the state directory's file, not the --backend given
        raise PermanentStartupError(str(exc)) from exc
    except (KeyError, ValueError) as exc:
        raise StartupError(f"--backend: {exc}") from exc


def read_original(dev: Device, now_s: float) -> DeviceOriginal:
    """A device's current settings; fields it cannot report are None (reads degrade)."""
    power: int | None
    try:
        power = dev.power_limit_mw()
    except DeviceError:
        power = None
    mig: bool | None
    layout: tuple[MigSlot, ...] = ()
    try:
        mig = dev.mig_enabled()
        if mig:
            layout = tuple(
                sorted(
                    (MigSlot(gi.profile_id, gi.placement.start, gi.profile_name) for gi in dev.gpu_instances()),
                    key=lambda slot: (slot.start, slot.profile_id),
                )
            )
    except DeviceError:
        mig = None
    return DeviceOriginal(dev.uuid, power, mig, layout, now_s)


@dataclass
class Reconciliation:
    """What start-up found; logged as one `reconciled` event."""

    grants_restored: int = 0
    released_gone_device: list[str] = field(default_factory=list)
    released_gone_process: list[str] = field(default_factory=list)
    devices_not_original: dict[str, str] = field(default_factory=dict)
    # records that could not be used (dropped), each with why
    bad_records: list[str] = field(default_factory=list)


def reconcile(
    store: Store,
    backend: Backend,
    *,
    clock: Callable[[], float],
    pid_exists: Callable[[int], bool] = psutil.pid_exists,
) -> tuple[Ledger, Reconciliation]:
    """Record originals, load the ledger, and drop what no longer exists (see module docstring)."""
    rec = Reconciliation()
    for dev in backend.devices():
        current = read_original(dev, clock())
        if store.save_original(current):
            continue
        orig = store.original(dev.uuid)
        assert orig is not None
        diffs = []
        if orig.power_limit_mw is not None and current.power_limit_mw != orig.power_limit_mw:
            diffs.append(f"power limit {current.power_limit_mw} mW, original {orig.power_limit_mw} mW")
        if orig.mig_enabled is not None and (current.mig_enabled, current.mig_layout) != (orig.mig_enabled, orig.mig_layout):
            diffs.append(f"MIG {_layout_text(current)}, original {_layout_text(orig)}")
        if diffs:
            rec.devices_not_original[dev.uuid] = "; ".join(diffs)
    caps = device_capacities(backend)
    records = store.load_ledger()
    if records is None:
        return Ledger(caps, clock=clock), rec
    try:
        ledger = Ledger.from_records(records, devices=caps, clock=clock, skip_bad=True)
    except ValueError as exc:
        raise PermanentStartupError(
            f"{store.path}: the stored ledger cannot be read ({exc}); start with --reset-state to begin empty"
        ) from exc
    rec.bad_records += [*store.bad_rows, *ledger.bad_on_restore]
    rec.released_gone_device = [g.grant_id for g in ledger.dropped_on_restore]
    for g in ledger.grants():
        # One bad record (a pid no process can have) is logged, dropped and counted; it never stops a start.
        try:
            if not 0 <= g.pid <= MAX_PID:
                raise ValueError(f"pid {g.pid} is out of range")
            gone = g.pid > 0 and not pid_exists(g.pid)
        except (ValueError, OverflowError, OSError) as exc:
            ledger.release(g.grant_id)
            rec.bad_records.append(f"grant {g.grant_id}: {exc}")
            continue
        if gone:
            ledger.release(g.grant_id)
            rec.released_gone_process.append(g.grant_id)
    rec.grants_restored = len(ledger.grants())
    return ledger, rec


def _layout_text(o: DeviceOriginal) -> str:
    if not o.mig_enabled:
        return "disabled"
    return "[" + ", ".join(f"{s.profile_name or s.profile_id}@{s.start}" for s in o.mig_layout) + "]"


def restore_devices(
    store: Store, backend: Backend, logger: structlog.typing.FilteringBoundLogger, metrics: DaemonMetrics | None = None,
    *, unrestored: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Put every device whose power limit or MIG layout differs from its recorded original back,
    read it back, and forget the originals that were restored. One dict per action taken; the
    devices left off their originals are added to `unrestored` (their originals stay stored).

    Forgetting is best effort: on a full or failing state directory the originals stay stored, which
    is one warning (`device_originals_not_forgotten`) and no failure. The next start then finds each
    such device at its stored original (`reconcile` reports nothing) and its next stop puts back that
    same original and forgets it; what it costs is that a setting an operator changes by hand while
    the daemon is stopped is taken for the daemon's and undone at that stop, as after a crash."""
    actions: list[dict[str, Any]] = []
    not_forgotten: list[str] = []
    error = ""
    for dev in backend.devices():
        orig = store.original(dev.uuid)
        if orig is None:
            continue
        ok = True
        try:
            if orig.power_limit_mw is not None:
                ok &= _restore_power(dev, orig.power_limit_mw, logger, actions, metrics)
            if orig.mig_enabled:
                ok &= _restore_mig(dev, orig, logger, actions, metrics)
        except Exception as exc:  # noqa: BLE001 - not a DeviceError (the simulator's state file on a full disk, say): the other devices are still put back
            logger.error("device_restore_failed", device=dev.uuid, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            ok = False
        if not ok and unrestored is not None:
            unrestored.append(dev.uuid)
        if ok:
            try:
                store.forget_original(dev.uuid)
            except (sqlite3.Error, StoreError, OSError) as exc:
                not_forgotten.append(dev.uuid)
                error = f"{type(exc).__name__}: {exc}"
    if not_forgotten:
        logger.warning("device_originals_not_forgotten", devices=not_forgotten, error=error,
                       meaning="the devices are back at their originals; the store still holds them, "
                       "and the next start finds each device at its original")
    return actions


def _record(metrics: DaemonMetrics | None, mechanism: str, result: str) -> None:
    if metrics is not None:
        metrics.restores.labels(mechanism=mechanism, result=result).inc()


def _restore_power(
    dev: Device, want_mw: int, logger: Any, actions: list[dict[str, Any]], metrics: DaemonMetrics | None
) -> bool:
    try:
        before = dev.power_limit_mw()
        if before == want_mw:
            return True
        dev.set_power_limit_mw(want_mw)
        after = dev.power_limit_mw()
    except DeviceError as exc:
        logger.error("device_restore_failed", device=dev.uuid, mechanism="power_limit", error=str(exc))
        _record(metrics, "power_limit", "failed")
        return False
    ok = after == want_mw
    entry = {"device": dev.uuid, "mechanism": "power_limit", "before_mw": before, "after_mw": after, "original_mw": want_mw}
    actions.append(entry)
    (logger.info if ok else logger.error)("device_restored" if ok else "device_restore_mismatch", **entry)
    _record(metrics, "power_limit", "ok" if ok else "mismatch")
    return ok


def _restore_mig(
    dev: Device, orig: DeviceOriginal, logger: Any, actions: list[dict[str, Any]], metrics: DaemonMetrics | None
) -> bool:
    current = read_original(dev, 0.0)
    if current.mig_enabled != orig.mig_enabled:
        logger.error("device_restore_failed", device=dev.uuid, mechanism="mig",
                     error=f"MIG mode is {current.mig_enabled}, was {orig.mig_enabled}; set it by hand (nvidia-smi -mig)")
        _record(metrics, "mig", "failed")
        return False
    if current.mig_layout == orig.mig_layout:
        return True
    try:
        for gi in dev.gpu_instances():
            dev.destroy_gpu_instance(gi.instance_id)
        for slot in orig.mig_layout:
            dev.create_gpu_instance(slot.profile_id, slot.start)
    except DeviceError as exc:
        logger.error("device_restore_failed", device=dev.uuid, mechanism="mig", error=str(exc))
        _record(metrics, "mig", "failed")
        return False
    after = read_original(dev, 0.0)
    ok = after.mig_layout == orig.mig_layout
    entry = {"device": dev.uuid, "mechanism": "mig", "before": _layout_text(current), "after": _layout_text(after),
             "original": _layout_text(orig)}
    actions.append(entry)
    (logger.info if ok else logger.error)("device_restored" if ok else "device_restore_mismatch", **entry)
    _record(metrics, "mig", "ok" if ok else "mismatch")
    return ok


def default_sizer() -> Sizer:
    """The cold-start sizer from its shipped artefact (manager/models/coldstart_randomforest.pt)."""
    return AllocatorSizer(ColdStartSizer.load())


def load_model(path: str, *, fallback: Forecaster | None = None, check_interval_s: float = 5.0) -> Any:
    """The hot-reloading forecaster of a configured `manager.model` (None when not configured: the
    default model is loaded in the background, `Daemon._load_default_model`). A configured model
    that does not load stops the start: the operator asked for it. Imports torch only when there is
    a model."""
    choice = resolve_model(path)
    if not choice.configured:
        return None
    forecaster = open_forecaster(choice, fallback or default_baseline(), check_interval_s=check_interval_s)
    if not forecaster.serving_model:
        raise PermanentStartupError(f"manager.model {choice.path}: {forecaster.last_error} (check it with `vgpu doctor`)")
    return forecaster


# --- the socket -------------------------------------------------------------------------------------------
def _socket_alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


# The mode of a directory the daemon creates for its socket, as the unit's RuntimeDirectoryMode: every
# user may pass through to the socket, whose own mode and group decide who may connect.
SOCKET_DIR_MODE = 0o755


def prepare_socket_path(path: Path) -> None:
    """Create the socket's missing directories (SOCKET_DIR_MODE whatever the umask: under a umask of
    077 they would shut out the socket's group); refuse a path where another daemon is listening;
    remove a stale socket file left by a crash."""
    missing = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise StartupError(f"cannot listen on {path}: cannot create its directory {directory} "
                               f"({exc.strerror or exc}); choose another --socket (server.socket)") from exc
        os.chmod(directory, SOCKET_DIR_MODE)
    if path.exists() or path.is_symlink():
        if not path.is_socket():
            raise StartupError(f"{path} exists and is not a socket; remove it or choose another --socket")
        if _socket_alive(path):
            raise StartupError(f"another daemon is listening on {path}")
        path.unlink()


def prepare_inapp_dir(path: Path, *, euid: int | None = None) -> str:
    """Create the in-app directory the client stubs write to (mode 1777, vgpu.client.make_inapp_dir)
    when it is missing: under systemd it lies in the runtime directory, which is removed each time the
    daemon stops, and an application that is not root cannot make it there. Its parent is not
    created. What was found, for the "serving" record: present, created, or why it is missing (the
    stubs then send no in-app counters; nothing else depends on it), and where other users'
    applications cannot write there, why.

    A path that another user controls stops the start (PermanentStartupError): a symbolic link, something
    other than a directory, a directory owned by neither the daemon's user (`euid`, default this
    process's) nor root, or one others may write to without the sticky bit
    (vgpu.daemon.inapp_sweep.inapp_dir_problem). The daemon reads pid proofs there and, as root,
    removes report files there; a user who made the directory first could point it anywhere."""
    try:
        created = make_inapp_dir(path)
        found = os.lstat(path)
    except FileNotFoundError:
        return f"missing: its parent {path.parent} does not exist"
    except OSError as exc:
        return f"missing: {exc.strerror or exc}"
    problem = inapp_dir_problem(found, os.geteuid() if euid is None else euid)
    if problem is not None:
        raise PermanentStartupError(f"server.inapp_dir {path}: {problem}; remove it and let the daemon make it "
                           "(a directory of root's, mode 1777), or choose another --inapp-dir")
    shut = inapp_dir_shuts_out_others(found)
    return ("created" if created else "present") + (f", but {shut}" if shut else "")


def secure_socket(path: Path, *, mode: int, owner: str, group: str) -> None:
    uid = gid = -1
    try:
        if owner:
            uid = pwd.getpwnam(owner).pw_uid
        if group:
            gid = grp.getgrnam(group).gr_gid
    except KeyError:
        # the name went away since the start's check (config.missing_names); the owner is looked up
        # first, so a uid still unset with an owner named means the owner is the one missing
        missing = f"socket owner {owner!r}" if owner and uid == -1 else f"socket group {group!r}"
        raise StartupError(f"{missing} does not exist") from None
    if uid != -1 or gid != -1:
        os.chown(path, uid, gid)
    os.chmod(path, mode)


def bind_unix(path: Path) -> socket.socket:
    """A Unix stream socket bound at `path` (not listening yet: `PeerFront.start` listens once the
    socket has its owner, group and mode). The file's mode comes from the caller's umask."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {path}: {exc.strerror or exc}") from exc
    return sock


@dataclass(frozen=True)
class FrontDir:
    """The front's private directory, held open (`fd`) for the daemon's life, and how socket
    addresses in it are spelled (`names`)."""

    path: Path
    fd: int
    names: peers.RelayNames

    @property
    def upstream(self) -> str:
        return f"{self.names.directory}/{UPSTREAM_SOCKET}"


def prepare_front_dir(path: Path) -> FrontDir:
    """Create the front's private directory afresh: mode 0700 and owned by the daemon's user, so only
    the daemon can connect to gRPC's socket in it or bind a name there (the names the front binds
    carry each caller's credentials: nobody else may make one). It lives in the state directory,
    which the daemon holds locked, so what a previous run left there is removed without a race with
    another daemon. The checks are made on the opened directory itself (no symlink followed)."""
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        path.mkdir(mode=0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.fchmod(fd, 0o700)  # whatever the umask
    except OSError as exc:
        raise StartupError(f"cannot create the front's directory {path}: {exc}; set server.peer_credentials = false "
                           "to let gRPC listen on the socket itself") from exc
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        os.close(fd)
        raise StartupError(f"{path} is not private to the daemon (owner uid {st.st_uid}, mode "
                           f"{oct(stat.S_IMODE(st.st_mode))}); remove it and start again")
    return FrontDir(path, fd, peers.relay_names(path, fd))


def remove_front_dir(front_dir: FrontDir) -> None:
    """Remove the front's directory (gRPC's socket in it) and close the descriptor held on it."""
    shutil.rmtree(front_dir.path, ignore_errors=True)
    os.close(front_dir.fd)


class StateLock:
    """An exclusive flock(2) on the state directory itself, held for the daemon's life, plus
    `daemon.lock` naming the holder's pid for people. The lock is on the directory, not on the file:
    removing or replacing `daemon.lock` cannot let a second daemon in (a lock on a file that is
    unlinked and created again is a lock on another inode)."""

    def __init__(self, dir_fd: int, pid_file: TextIO) -> None:
        self._dir_fd: int | None = dir_fd
        self._pid_file = pid_file

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # releases the flock
            self._dir_fd = None
        self._pid_file.close()


def lock_state_dir(state_dir: Path) -> StateLock:
    """Lock the state directory (see StateLock): two daemons on one state dir would corrupt it."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise StartupError(_unusable_state_dir(state_dir, exc)) from exc
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(dir_fd)
        holder = _lock_holder(state_dir)
        raise StartupError(
            f"another vgpu daemon is using the state directory {state_dir}{holder}: stop it first (one "
            "stopping waits up to server.grace_s for its calls), or give this one another --state-dir "
            "(server.state_dir)"
        ) from None
    try:
        fh = open(state_dir / LOCK_FILE, "w")  # noqa: SIM115 - held until exit
        fh.write(f"{os.getpid()}\n")
        fh.flush()
    except OSError as exc:
        os.close(dir_fd)
        raise StartupError(_unusable_state_dir(state_dir, exc)) from exc
    return StateLock(dir_fd, fh)


def _unusable_state_dir(state_dir: Path, exc: OSError) -> str:
    if isinstance(exc, FileExistsError):  # mkdir's "File exists" for a file at the path
        return (f"state directory {state_dir} is not usable: it is a file, not a directory; give a directory "
                "as --state-dir (server.state_dir)")
    return (f"state directory {state_dir} is not usable ({exc.strerror or exc}): the daemon's user must be "
            "able to create and write it; fix its permissions or give another --state-dir (server.state_dir)")


def _lock_holder(state_dir: Path) -> str:
    """' (pid N)' from the lock file the holder wrote, or '' when it cannot be read."""
    try:
        text = read_capped(state_dir / LOCK_FILE, 64).decode("ascii", errors="replace").strip()
    except OSError:  # FileTooLarge too: no pid is that long
        return ""
    return f" (pid {int(text)})" if text.isdigit() and len(text) <= 10 else ""


def _read(path: str, what: str) -> bytes:
    """A TLS file (key, certificate, CA bundle), at most MAX_TLS_FILE_BYTES of it."""
    try:
        return read_capped(path, MAX_TLS_FILE_BYTES)
    except OSError as exc:  # FileTooLarge too: its strerror says "larger than N bytes ..."
        raise PermanentStartupError(f"cannot read {what} {path}: {exc}") from exc


# --- the daemon -------------------------------------------------------------------------------------------
class Daemon:
    """Everything `vgpu serve` runs, built from a `Config`. `start()` then `stop()`; `run()` does both
    around waiting for a signal."""

    def __init__(
        self,
        cfg: Config,
        *,
        clock: Callable[[], float] = time.time,
        notifier: SdNotifier | None = None,
        registry: CollectorRegistry | None = None,
        logger: structlog.typing.FilteringBoundLogger | None = None,
        backend: Backend | None = None,
        load_sizer: Callable[[], Sizer] | None = None,
        reset_state: bool = False,
        loader_join_s: float = LOADER_JOIN_S,
    ) -> None:
        self.cfg = cfg
        self._reset_state = reset_state
        self._loader_join_s = loader_join_s  # how long stop() waits for the background loads
        self._load_sizer = load_sizer or default_sizer
        self.clock = clock
        self.notifier = notifier or SdNotifier()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.log = logger or log.get_logger("vgpu.daemon")
        self._backend_override = backend
        self.state_dir = Path(cfg.server.state_dir)
        self.socket_path = Path(cfg.server.socket)
        self.server: Server | None = None
        self.front: PeerFront | None = None
        self._front_dir: FrontDir | None = None
        self._listener: socket.socket | None = None
        self._public_inode: tuple[int, int] | None = None
        self.metrics_server: Any = None
        self._lock: StateLock | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._idle_release: asyncio.Task[None] | None = None
        self._refreeze: asyncio.Task[None] | None = None
        # reports left in the in-app directory by processes killed without closing (vgpu/daemon/inapp_sweep.py)
        self.inapp_sweeper = InAppSweeper(Path(cfg.server.inapp_dir))
        self.inapp_sweep_every_s = INAPP_SWEEP_EVERY_S
        self._inapp_sweep: asyncio.Task[None] | None = None
        self._stream_end_timers: set[asyncio.TimerHandle] = set()  # _stream_ended's, cancelled on stop
        self._stopping = False
        self.stop_failures: list[str] = []  # the stop's steps that failed, "<step>: <error>" (`_stop_step`)
        self.model_loader: threading.Thread | None = None
        self.mixture: MixtureForecaster | None = None
        self.history: NodeHistory | None = None
        self.learner: BackgroundLearner | None = None
        self.trees_watcher: LocalModelWatcher | None = None  # the node-local trees' file, with the learner
        self.stopped = asyncio.Event()

    def _save(self, ledger: Ledger) -> None:
        """Store the ledger's changes since the last save (O(1) rows per change). When they cannot
        be stored, StateNotSaved: the allocator undoes them in memory and the call that made them
        is answered UNAVAILABLE; reads keep working."""
        try:
            self.store.apply_changes(ledger.changes())
        except (StoreError, ValueError) as exc:
            self.log.error("state_not_saved", path=str(self.store.path), error=str(exc))
            raise StateNotSaved(
                f"the change was not made: the state directory {self.state_dir} is full or failing "
                f"({exc.__cause__ or exc}); free space there (or fix the disk) and retry"
            ) from exc
        ledger.commit_changes()
        metrics: DaemonMetrics | None = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.store_writes.inc()

    def _save_all(self, ledger: Ledger) -> None:
        """Replace the stored ledger with this one (the reconciled ledger at start)."""
        self.store.save_ledger(ledger.to_records())
        ledger.commit_changes()
        metrics: DaemonMetrics | None = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.store_writes.inc()

    def _remove_fresh_state_dir(self) -> None:
        """After a failed start, remove the state directory that start created (it held no state
        before, and nothing was served from it): a mistyped socket, a port in use or a missing
        driver otherwise left a directory of tokens, database and lock behind for each try."""
        try:
            shutil.rmtree(self.state_dir)
        except OSError as exc:
            self.log.warning("state_dir_not_removed", state_dir=str(self.state_dir), error=str(exc))
        else:
            self.log.info("state_dir_removed", state_dir=str(self.state_dir),
                          reason="start-up failed; the directory was made by this start")

    async def start(self) -> None:
        """Start-up's steps, in the order of the module docstring's list."""
        self.cfg = cfg = vconfig.resolve_dry_run(self.cfg)
        if cfg.server.dry_run:
            self.log.warning("dry_run", backend=cfg.server.backend,
                             meaning="decisions are logged, nothing is written to the devices",
                             to_act="set server.dry_run = false (or VGPU_SERVER_DRY_RUN=false, or --no-dry-run)")
        self._open_state()
        self.backend = self._backend_override or open_backend(cfg.server.backend, self.state_dir)
        ledger, rec = reconcile(self.store, self.backend, clock=self.clock)
        cgroup_outcomes = self._build_allocator(ledger)
        self._build_manager()
        self.metrics = DaemonMetrics(self.registry, StateSource(self.allocator, self.manager, cfg.server.backend,
                                                                self.learner.watcher if self.learner else None,
                                                                self.trees_watcher),
                                     max_apps=cfg.metrics.max_apps)
        if self.history is not None:
            self.metrics.watch_history(self.history)
        self._store_reconciled(ledger, rec, cgroup_outcomes)
        interceptor, token_files = self._access_control()
        prepare_socket_path(self.socket_path)
        inapp_state = prepare_inapp_dir(Path(cfg.server.inapp_dir))
        self.server = self._build_server(interceptor)
        # the public socket, born owner-only, gets its configured owner, group and mode before the server starts
        secure_socket(self.socket_path, mode=cfg.socket_mode_bits, owner=cfg.server.socket_owner,
                      group=cfg.server.socket_group)
        tcp_at = self._add_tcp(self.server) if cfg.server.tcp else None
        metrics_at = self._serve_metrics()
        await self.server.start()
        self._start_front()
        # start-up is over: what it built is kept out of the garbage collector's full passes (vgpu/gc_freeze.py)
        frozen = freeze_startup_heap()
        self._log_serving(token_files, inapp_state, tcp_at, metrics_at, frozen)
        # The background loads begin only now: importing torch and loading a model hold the
        # interpreter's lock for long stretches, and begun earlier they delayed `serving` (docs/performance.md).
        self.sizer.start()
        if self.model_loader is not None:
            self.model_loader.start()
        # `systemctl status vgpu-manager` shows STATUS: where to scrape, when the kernel picked the port
        status = f"serving on {self.socket_path}" + (f", metrics on http://{metrics_at}/metrics" if metrics_at else "")
        if not self.notifier.notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}") \
                and self.notifier.error:
            self.log.warning("sd_notify_failed", error=self.notifier.error,
                             to_act="under systemd the unit's Type=notify start will time out; elsewhere unset NOTIFY_SOCKET")
        if self.notifier.watchdog_s:
            self._watchdog = asyncio.create_task(self._ping_watchdog(self.notifier.watchdog_s / 3))
        if cfg.server.idle_release_s > 0 or cfg.server.exit_release_s > 0:
            self._idle_release = asyncio.create_task(
                self._release_vanished(cfg.server.idle_release_s, cfg.server.exit_release_s))
        self._refreeze = asyncio.create_task(self._freeze_after_loads())
        self._inapp_sweep = asyncio.create_task(self._sweep_inapp())

    def _open_state(self) -> None:
        """Lock the state directory, move a damaged database aside with --reset-state, open the store."""
        self._lock = lock_state_dir(self.state_dir)
        if self._reset_state:
            moved = reset_state(self.state_dir, clock=self.clock)
            self.log.warning("state_reset", moved_to=str(moved) if moved else None,
                             reason="--reset-state: the ledger starts empty; the old database is kept beside it")
        try:
            self.store = Store(self.state_dir, clock=self.clock)
        except StoreError as exc:  # damaged, from a newer vgpu, refused WAL: restore, reset or move it first
            raise PermanentStartupError(str(exc)) from exc
        if self.store.upgraded_copy is not None:
            self.log.info("state_upgraded", path=str(self.store.path), from_schema=self.store.schema_found,
                          to_schema=SCHEMA_VERSION, copy=str(self.store.upgraded_copy),
                          to_act="a downgrade to the vgpu that wrote it needs this copy put back in place "
                          "(docs/install.md, Upgrading and downgrading vgpu)")

    def _build_allocator(self, ledger: Ledger) -> list[tuple[str, str, str]]:
        """The Allocator over the reconciled ledger, with its mechanisms, the cold-start sizer (loading
        in a worker thread from here on) and the predictive policy; then the cgroup limits a crashed
        run left are put back. Returns what became of each (device, cgroup, outcome)."""
        cfg = self.cfg
        ledger.max_grants_per_app = cfg.server.max_grants_per_app
        ledger.max_grants_per_uid = cfg.server.max_grants_per_uid
        ledger.max_grants = cfg.server.max_grants_per_node
        (self.state_dir / "mig").mkdir(mode=0o700, exist_ok=True)
        dry_run = vconfig.dry_run_of(cfg.server)  # resolved by start(); said again for the type checker
        mig = MigLayoutMechanism(state_dir=self.state_dir / "mig", dry_run=dry_run)
        self.sizer = BackgroundSizer(self._load_sizer, self.log)
        cgroup_limits = CgroupMemoryLimits(dry_run=dry_run, store=self.store, clock=self.clock)
        if cfg.server.cgroup_memory_limits:
            # a driver or GPU without per-cgroup memory limits is said once now (a warning per
            # device, cgroup_memory_limit_unsupported), not at its first contention
            cgroup_limits.probe(self.backend.devices())
        policy = ForecastPolicy(manage_mig=cfg.server.manage_mig_layout)
        # hard cgroup caps only on a contended device, by the policy's own threshold ("always": 0, everywhere)
        hard_at = hard_limit_at_frac_for(cfg.server.hard_memory_limits, policy.config.hard_limit_at_frac)
        self.allocator = Allocator(self.backend, clock=self.clock, dry_run=dry_run, ledger=ledger,
                                   mig=mig, cgroup_limits=cgroup_limits if cfg.server.cgroup_memory_limits else None,
                                   sizer=self.sizer, policy=policy, hard_limit_at_frac=hard_at,
                                   on_change=self._save, reclaim=cfg.server.reclaim,
                                   reclaim_margin_frac=cfg.server.reclaim_margin_frac,
                                   reclaim_min_mib=cfg.server.reclaim_min_mib,
                                   max_watchers=cfg.server.max_watchers,
                                   max_watchers_per_caller=cfg.server.max_watchers_per_caller,
                                   max_watchers_per_uid=cfg.server.max_watchers_per_uid,
                                   drop_slow_watchers=True)
        # cgroup limits a crashed run left: put back where no grant holds the cgroup now (all of
        # them where the mechanism is now off: nothing would restore them later)
        return (self.allocator.reconcile_cgroup_limits() if cfg.server.cgroup_memory_limits
                else cgroup_limits.reconcile(self.backend, {}))

    def _build_manager(self) -> None:
        """The served forecaster and the Manager that feeds the allocator. A configured model loads
        here (or the start fails); the shipped one loads in a worker thread while the baseline serves."""
        cfg = self.cfg
        baseline = default_baseline()
        interval_s = cfg.manager.model_check_interval_s
        model_forecaster = load_model(cfg.manager.model, fallback=baseline, check_interval_s=interval_s)
        # the served forecast: the expert mixture over the last value, the model (a slot that abstains
        # until the model loads) and the node-local model once one is promoted, or with
        # manager.mixture off the model alone
        self.mixture = None
        if cfg.manager.mixture:
            self._start_mixture(model_forecaster)
        self.observed_pids = ObservedPids(self.backend)
        self.manager = Manager(self.allocator, self.mixture or model_forecaster,
                               clock=self.clock, fallback=baseline,
                               batch_window_s=cfg.manager.batch_window_ms / 1000.0,
                               forecast_duty_max=cfg.manager.forecast_duty_max,
                               device_known=self.allocator.knows_device,
                               device_mem_total_mib=self.allocator.device_mem_total_mib,
                               pid_observed=self.observed_pids,
                               windows=WindowStore(max_span_s=MAX_WINDOW_SPAN_S), max_future_s=MAX_FUTURE_S)
        self.allocator.signature_seen = self.manager.windows.last_seen_s
        model = resolve_model(cfg.manager.model)
        if model.configured:
            self.log.info("forecaster", serving=self.manager.source, model="loaded", path=str(model.path),
                          check_interval_s=interval_s)
        else:
            # the shipped model, when present, loads in the background (from step 11 on, with the
            # cold-start sizer); the mixture serves without it meanwhile (the baseline, mixture off)
            self.model_loader = threading.Thread(target=self._load_default_model, args=(model.path,),
                                                 name="forecaster-load", daemon=True)

    def _start_mixture(self, model_forecaster: Forecaster | None) -> None:
        """The expert mixture over `model_forecaster` (None: the model slot waits for the shipped
        model), with the node history (`manager.history`) and the background learner, started now."""
        cfg = self.cfg
        self.history = (NodeHistory(self.state_dir / "history", horizon_s=cfg.manager.history_horizon_s,
                                    max_bytes=int(cfg.manager.history_max_mib * 2**20))
                        if cfg.manager.history else None)
        self.mixture = make_served(model_forecaster, local=True, history=self.history)
        mixture = self.mixture
        watcher = LocalModelWatcher(self.state_dir, lambda m: mixture.set_expert("local", m))
        trees = self.trees_watcher = None if not cfg.manager.node_trees else LocalModelWatcher(
            self.state_dir, lambda m: mixture.set_expert("trees", m), load_trees, filename=TREES, what="node_trees",
            to_act=f"`vgpu model status --state-dir {self.state_dir}` says why and whether earlier trees that load "
                   "are kept for `vgpu model rollback --trees`; else remove the file (the next learning round fits "
                   "new ones)")
        self.learner = BackgroundLearner(self.state_dir, self.state_dir / "history",
                                         resolve_model(cfg.manager.model).path, watcher,
                                         interval_s=cfg.manager.learn_interval_s if self.history else 0.0,
                                         poll_s=cfg.manager.model_check_interval_s,
                                         housekeeping=self.history.compress_closed if self.history else None,
                                         also_watch=(trees,) if trees is not None else (),
                                         trees=cfg.manager.node_trees)
        self.learner.start()

    def _store_reconciled(self, ledger: Ledger, rec: Reconciliation,
                          cgroup_outcomes: Sequence[tuple[str, str, str]]) -> None:
        """Store the reconciled ledger whole (what a crash from here on must find) and log what
        start-up found as one `reconciled` record."""
        try:
            self._save_all(ledger)
        except StoreError as exc:
            raise StartupError(f"cannot store the reconciled ledger: {exc}") from exc
        self.log.info(
            "reconciled",
            grants_restored=rec.grants_restored,
            released_device_gone=rec.released_gone_device,
            released_process_gone=rec.released_gone_process,
            bad_records=len(rec.bad_records),
            bad_record_reasons=rec.bad_records[:20],
            devices_not_original=rec.devices_not_original,
            originals={k: v.power_limit_mw for k, v in self.store.originals().items()},
            cgroup_originals={f"{dev} {cg}": outcome for dev, cg, outcome in cgroup_outcomes},
        )

    def _access_control(self) -> tuple[auth.AuthInterceptor, dict[str, Path]]:
        """Write the role tokens and each claimed application's token, create the front's private
        directory (with server.peer_credentials), and build the access-control interceptor. Returns
        it and the role token files."""
        cfg = self.cfg
        authority = auth.TokenAuthority(
            auth.token_dir(self.state_dir), operator_group=cfg.auth.operator_group, profiler_group=cfg.auth.profiler_group
        )
        token_files = authority.write_role_tokens()
        for app_id in self.store.claimed_apps():
            try:  # a token file is derived from the secret: one that cannot be written costs only itself
                authority.write_app_token(app_id)
            except auth.AuthSetupError as exc:
                self.log.error("app_token_unwritable", app=app_id, error=str(exc))
        if cfg.server.peer_credentials:
            # the front accepts on the public socket; gRPC listens in the front's private directory
            self._front_dir = prepare_front_dir(self.state_dir / FRONT_DIR)
        access = auth.AccessControl(
            authority,
            self.store,
            LedgerView(self.allocator),
            open_reads=cfg.auth.open_reads,
            app_self_registration=cfg.auth.app_self_registration,
            max_self_registered_apps=cfg.auth.max_self_registered_apps,
            max_self_registered_apps_per_uid=cfg.auth.max_self_registered_apps_per_uid,
            pid_proof=InAppPidProof(Path(cfg.server.inapp_dir), clock=self.clock),
            open_ingest=cfg.auth.open_ingest,
            peer_of=self._front_dir.names.peer if self._front_dir is not None else None,
        )
        return auth.AuthInterceptor(access, on_denied=self.metrics.on_denied), token_files

    def _build_server(self, interceptor: auth.AuthInterceptor) -> Server:
        """The gRPC server with both servicers behind `interceptor`, bound in the front's directory
        (without a front: on the public socket), and, with a front, the public socket bound for it
        (not listening yet). Each socket file is born owner-only (umask 0177); `start` then gives the
        public one its configured owner, group and mode."""
        cfg = self.cfg
        replay = vconfig.accepts_replay(cfg)
        if self._front_dir is not None:
            grpc_address = f"unix:{self._front_dir.upstream}"
        else:
            grpc_address = f"unix:{self.socket_path}"
        old_umask = os.umask(0o177)
        try:
            server = build_server(
                grpc_address,
                allocator_servicer=AllocatorServicer(self.allocator, identify=auth.identify_caller,
                                                     observer=NodeView(self.manager),
                                                     watcher_owner=auth.caller_name, bounded_uid=auth.bounded_uid,
                                                     claims=self.store.claims, forget=interceptor.access.forget,
                                                     claim_uids=self.store.claim_uids,
                                                     backend=cfg.server.backend),
                ingest_servicer=IngestServicer(self.manager, ack_interval_s=cfg.manager.ack_interval_ms / 1000.0,
                                               replay_ok=lambda: replay or auth.caller_name() == "operator",
                                               on_stream_end=self._stream_ended),
                interceptors=[interceptor],
                options=server_options(cfg.server.max_connections, cfg.server.max_streams_per_connection,
                                       cfg.server.max_request_bytes),
            )
            if self._front_dir is not None:
                self._listener = bind_unix(self.socket_path)
                st = os.stat(self.socket_path)
                self._public_inode = (st.st_dev, st.st_ino)
        except StartupError:
            raise  # bind_unix's, which says it already
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {self.socket_path}: {exc}") from exc
        finally:
            os.umask(old_umask)
        return server

    def _add_tcp(self, server: Server) -> str:
        """The TLS listener on server.tcp (the configuration refused it without a certificate and key);
        the address bound, HOST:PORT with the port the kernel picked for HOST:auto."""
        cfg = self.cfg
        creds = grpc.ssl_server_credentials(
            [(_read(cfg.tls.key, "tls.key"), _read(cfg.tls.cert, "tls.cert"))],
            root_certificates=_read(cfg.tls.ca, "tls.ca") if cfg.tls.ca else None,
            require_client_auth=cfg.mutual_tls,
        )
        try:
            port = server.server.add_secure_port(vconfig.bind_address(cfg.server.tcp), creds)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {cfg.server.tcp}: {exc}") from exc
        if not port:  # gRPC versions that do not raise say so with port 0
            raise StartupError(f"cannot listen on {cfg.server.tcp}: the address cannot be bound")
        return f"{cfg.server.tcp.rpartition(':')[0]}:{port}"

    def _serve_metrics(self) -> str | None:
        """Start the Prometheus endpoint; its address as HOST:PORT with the port bound (the one the
        kernel picked for "auto"), or None when metrics.port is 0."""
        cfg = self.cfg
        if cfg.metrics.port == 0:
            return None
        # Operators alert on the scrape: a daemon without its metrics would look down while it
        # serves, so a port that cannot be bound fails the start (metrics.port 0 turns them off).
        try:
            self.metrics_server = start_metrics_server(
                cfg.metrics.address, vconfig.bind_port(cfg.metrics.port), self.registry,
                max_per_address=cfg.metrics.max_connections_per_address, logger=self.log)
            self.metrics.watch_endpoint(self.metrics_server)
        except OSError as exc:
            # the socket is ours (prepare_socket_path checked) and nothing listens on it yet
            self.socket_path.unlink(missing_ok=True)
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
                # no interface of this host has the address (a typo, another host's IP): not the port
                fix = ("give an address of this host with --metrics-address (metrics.address, "
                       "VGPU_METRICS_ADDRESS), e.g. 127.0.0.1 or 0.0.0.0")
            else:
                fix = ("free the port, or set another with --metrics-port (metrics.port, VGPU_METRICS_PORT; "
                       f"{vconfig.ANY_PORT!r}: any free port)")
            raise StartupError(
                f"cannot serve metrics on {vconfig.address_text(cfg.metrics.address, cfg.metrics.port)} "
                f"({exc.strerror or exc}): {fix}; --metrics-port 0 turns metrics off"
            ) from exc
        return vconfig.address_text(cfg.metrics.address, self.metrics_server.port)

    def _start_front(self) -> None:
        """Hand the bound public socket to the front, which listens on it from now on."""
        if self._front_dir is None or self._listener is None:
            return
        cfg = self.cfg
        self.front = PeerFront(self._listener, self._front_dir.upstream, self._front_dir.names,
                               max_connections=cfg.server.max_connections,
                               max_per_uid=cfg.server.max_connections_per_uid,
                               on_refused=self.metrics.on_connection_refused, logger=self.log)
        self._listener = None  # the front's now
        self.front.start()
        self.metrics.watch_connections(lambda: self.front.open_connections if self.front is not None else 0)

    def _log_serving(self, token_files: dict[str, Path], inapp_state: str, tcp_at: str | None,
                     metrics_at: str | None, frozen: int) -> None:
        """The `serving` record: what the daemon listens on (each port as bound: the one the kernel
        picked where the setting says "auto") and how it is set up."""
        cfg = self.cfg
        self.log.info(
            "serving",
            socket=str(self.socket_path),
            socket_mode=oct(os.stat(self.socket_path).st_mode & 0o777),
            tcp=tcp_at,
            mutual_tls=cfg.mutual_tls if cfg.server.tcp else None,
            metrics=metrics_at,
            backend=cfg.server.backend,
            devices=[d.uuid for d in self.backend.devices()],
            dry_run=cfg.server.dry_run,
            accept_replay=vconfig.accepts_replay(cfg),
            peer_credentials=self._front_dir is not None,
            max_connections=cfg.server.max_connections,
            max_connections_per_uid=cfg.server.max_connections_per_uid if self._front_dir is not None else None,
            max_streams_per_connection=cfg.server.max_streams_per_connection,
            max_request_bytes=cfg.server.max_request_bytes,
            operator_token=str(token_files["operator"]),
            inapp_dir=cfg.server.inapp_dir,
            inapp_dir_state=inapp_state,
            pid=os.getpid(),
            heap_frozen_objects=frozen,
        )

    def _stream_ended(self, stream: StreamState) -> None:
        """A profiler stream ended: `_release_after_stream` once server.stream_end_grace_s have passed;
        never where server.idle_release_s is 0 (grants are kept until released)."""
        if self._stopping or self.cfg.server.idle_release_s <= 0:
            return
        ended_s = self.clock()

        def release() -> None:
            self._stream_end_timers.discard(timer)
            try:
                self._release_after_stream(stream, ended_s)
            except Exception as exc:  # noqa: BLE001 - the idle release still applies
                self.log.error("stream_end_release_failed", peer=stream.peer, error=repr(exc))

        timer = asyncio.get_running_loop().call_later(self.cfg.server.stream_end_grace_s, release)
        self._stream_end_timers.add(timer)

    def _release_after_stream(self, stream: StreamState, ended_s: float) -> list[str]:
        """A profiler stream ended at `ended_s` (a replay that stopped, a profiler stopped): release,
        sooner than server.idle_release_s, the grants of each application it sent whose process is
        known to be gone. An application is released only when all of these hold: no stream open now
        sends for it, and none has sent a signature for it since `ended_s`; every grant it holds is one
        the daemon made from its signatures (source "forecast": it never requested, so nothing of it
        talks to the daemon), none names a pid, and no watch of its own is open; its signatures named
        a pid, and that pid runs on none of its grants' GPUs (the driver's process lists, read afresh:
        a replay's made-up pids, a process that exited). A GPU whose process list cannot be read keeps
        the grants. The applications released."""
        still_sent = self.manager.apps_of_open_streams()
        gone = []
        for app_id in sorted(stream.apps - still_sent):
            seen_s = self.manager.windows.last_seen_s(app_id)
            if seen_s is not None and seen_s > ended_s:
                continue  # another stream sent for it since
            grants = self.allocator.ledger.grants(app_id=app_id)
            pids = self.manager.app_pids(app_id)
            if (not grants or not pids or self.allocator.watched(app_id)
                    or any(g.source != "forecast" or g.pid for g in grants)):
                continue
            devices = sorted({g.device_id for g in grants})
            if any(self.observed_pids.runs(d, pid) is not False for d in devices for pid in pids):
                continue  # it runs there, or that GPU cannot say
            reason = (f"its profiler stream ended and its process {', '.join(map(str, pids))} runs on none of "
                      f"its GPUs (a replay that stopped, or a process that exited)")
            self.log.info("app_released_stream_ended", app=app_id, pids=pids, devices=devices, peer=stream.peer,
                          grants=[g.grant_id for g in grants], memory_mib=sum(g.memory_mib for g in grants))
            self.allocator.release_departed(app_id, reason=reason, seen=self.allocator.last_seen_s(app_id))
            gone.append(app_id)
        return gone

    async def _release_vanished(self, idle_s: float, exit_s: float = 0.0) -> None:
        """Release the grants whose process exited (Allocator.release_exited, `exit_s` > 0) and those
        of applications silent for `idle_s` (Allocator.release_vanished, `idle_s` > 0), checked a few
        times per `idle_s` and twice per `exit_s` (at most every 5 s, at least every 1 s)."""
        periods = [5.0, *([idle_s / 4] if idle_s > 0 else []), *([max(1.0, exit_s / 2)] if exit_s > 0 else [])]
        period_s = min(periods)
        while True:
            await asyncio.sleep(period_s)
            try:
                if exit_s > 0:
                    self.allocator.release_exited(exit_s)
                if idle_s > 0:
                    self.allocator.release_vanished(idle_s)
            except Exception as exc:  # noqa: BLE001 - a failed sweep is logged; the next one tries again
                self.log.error("idle_release_failed", error=repr(exc))

    async def _sweep_inapp(self) -> None:
        """Every `inapp_sweep_every_s`, remove the in-app reports of processes that are gone (in a
        worker thread: it lists and stats files); logs `inapp_swept` when it removed any, and
        `inapp_sweep_skipped` (a warning) when the directory is not one to sweep, once for each reason
        in a row (vgpu/daemon/inapp_sweep.py)."""
        skipped: str | None = None
        while True:
            await asyncio.sleep(self.inapp_sweep_every_s)
            try:
                done = await asyncio.to_thread(self.inapp_sweeper.sweep, time.time())
            except Exception as exc:  # noqa: BLE001 - a failed sweep is logged; the next one tries again
                self.log.error("inapp_sweep_failed", error=repr(exc))
                continue
            if done.skipped is not None and done.skipped != skipped:
                self.log.warning("inapp_sweep_skipped", directory=str(self.inapp_sweeper.directory), reason=done.skipped)
            skipped = done.skipped
            if done.removed or done.not_removable:
                self.log.info("inapp_swept", directory=str(self.inapp_sweeper.directory), removed=done.removed,
                              not_removable=done.not_removable, kept_running=done.kept_running)

    def _load_default_model(self, path: Path) -> None:
        """Put the shipped model in service once it loads: as the mixture's model expert, or alone with
        manager.mixture off. Until then, or if it does not load, the mixture serves without it (or the
        baseline alone)."""
        # `serving` names what vgpu_forecaster_serving does (Manager.source): with the mixture on, the
        # mixture serves whether or not the model, one of its experts, loaded; `model` says which.
        if not path.is_file():
            self.log.info("forecaster", serving=self.manager.source, model="absent", reason=f"no checkpoint at {path}")
            return
        interval_s = self.cfg.manager.model_check_interval_s
        try:
            model = open_forecaster(ModelChoice(path, False), self.manager.fallback, check_interval_s=interval_s)
        except Exception as exc:  # noqa: BLE001 - the default model is optional: degrade, say so once
            error = f"{type(exc).__name__}: {exc}"
        else:
            if model.serving_model:
                # one reference store; the next forecast tick uses it
                if self.mixture is not None:
                    self.mixture.set_expert("model", model)
                else:
                    self.manager.forecaster = model
                self.log.info("forecaster", serving=self.manager.source, model="loaded", path=str(path),
                              check_interval_s=interval_s)
                return
            error = model.last_error or "did not load"
        # A shipped model that does not load is a broken install (`vgpu doctor` says WARN): the
        # mixture serves without it (the baseline, mixture off) and the file is not watched.
        self.log.warning("forecaster_unavailable", path=str(path), error=error, serving=self.manager.source)

    async def _freeze_after_loads(self, poll_s: float = 1.0) -> None:
        """Once the background loads are over, freeze the heap again (vgpu/gc_freeze.py): they begin
        after the start-up freeze, and what they leave alive (torch, the forecaster, the sizer: most
        of the process's objects) would otherwise be walked by every full collection."""
        while self.loads_running():
            await asyncio.sleep(poll_s)
        frozen = freeze_startup_heap()
        self.log.info("heap_frozen", after="background loads", heap_frozen_objects=frozen)

    async def _ping_watchdog(self, period_s: float) -> None:
        # Fixed rate on monotonic deadlines; runs on the loop, so a stalled loop stops the pings. A
        # front whose thread has ended accepts nobody on the socket: the pings stop too (said once),
        # so systemd restarts the daemon rather than leave it alive and unreachable.
        deadline = time.monotonic()
        while True:
            if self.front is not None and not self.front.running:
                self.log.error("front_stopped", socket=str(self.socket_path),
                               meaning="nobody can connect; the watchdog pings stop so that systemd restarts the daemon")
                return
            self.notifier.notify("WATCHDOG=1")
            deadline += period_s
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))

    async def stop(self, reason: str = "signal") -> list[dict[str, Any]]:
        """Stop serving, restore the devices, save: the stop's steps, in the order of the module
        docstring. Works from any point of a failed start: each part is undone only if start() got
        to it (attributes it never set are absent). A step that fails is logged and the stop goes on
        with the next (`_stop_step`); `stop_failures` lists those that failed."""
        step = self._stop_step
        self.notifier.notify("STOPPING=1\nSTATUS=restoring device settings")
        self.log.info("stopping", reason=reason)
        for task in (self._watchdog, self._idle_release, self._refreeze, self._inapp_sweep):
            if task is not None:
                task.cancel()
        self._stopping = True  # streams that end from here on are the daemon's doing
        for timer in self._stream_end_timers:
            timer.cancel()
        allocator: Allocator | None = getattr(self, "allocator", None)
        if allocator is not None:  # decided: a call that still reaches it changes nothing (UNAVAILABLE)
            with step("refuse_changes"):
                allocator.refuse_changes()
        await self._stop_serving(allocator)
        actions: list[dict[str, Any]] = []
        store: Store | None = getattr(self, "store", None)
        backend: Backend | None = getattr(self, "backend", None)
        if allocator is not None and store is not None and backend is not None:
            actions = self._restore_and_save(allocator, store, backend)
        with step("inapp_sweeper"):  # after a sweep under way in its thread, if any
            await asyncio.to_thread(self.inapp_sweeper.close)
        if self.metrics_server is not None:
            with step("metrics_server"):
                self.metrics_server.shutdown()
                self.metrics_server.server_close()
        with step("background_loads"):
            await asyncio.to_thread(self._wait_for_loaders, self._loader_join_s)
        if self.learner is not None:
            with step("learner"):
                await asyncio.to_thread(self.learner.stop)
        if self.history is not None:
            with step("history"):
                self.history.close()
        if backend is not None:
            with step("backend"):
                backend.close()
        if store is not None:
            with step("store"):
                store.close()
        (self.log.warning if self.stop_failures else self.log.info)(
            "stopped", devices_restored=len(actions), restore_actions=actions, failed_steps=self.stop_failures)
        if self._lock is not None:
            with step("state_lock"):
                self._lock.close()
        thaw_heap()  # what start-up froze is collectable again for whatever runs on in this process
        self.stopped.set()
        return actions

    @contextlib.contextmanager
    def _stop_step(self, name: str) -> Iterator[None]:
        """One step of the stop: an exception in it is logged (`stop_step_failed`, with its
        traceback) and added to `stop_failures`, and the stop goes on with the next step, so that
        one failure (a full state directory, a device that is lost) leaves no other device
        unrestored, nothing open and the `stopped` record written."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - every later step must still run; the failure is logged here
            error = f"{type(exc).__name__}: {exc}"
            self.stop_failures.append(f"{name}: {error}")
            self.log.error("stop_step_failed", step=name, error=error, exc_info=exc)

    async def _stop_serving(self, allocator: Allocator | None) -> None:
        """Close the doors: the front stops accepting and the public socket goes, the watch streams
        end, the server stops (in-flight calls get server.grace_s), then the front and its directory."""
        step = self._stop_step
        if self.front is not None:  # no new connections; relayed ones stay for the grace period
            with step("front_accepting"):
                await asyncio.to_thread(self.front.stop_accepting)
        self._remove_public_socket()
        if self.server is not None:
            if allocator is not None:
                with step("watch_streams"):
                    allocator.end_watches()  # watch streams never end by themselves: grace_s is for calls
            with step("server"):
                await self.server.stop(self.cfg.server.grace_s)
        if self.front is not None:
            with step("front"):
                await asyncio.to_thread(self.front.stop)
        if self._listener is not None:  # a start that failed before the front took it
            with step("listener"):
                self._listener.close()
            self._listener = None
        if self._front_dir is not None:
            with step("front_dir"):
                remove_front_dir(self._front_dir)
            self._front_dir = None

    def _restore_and_save(self, allocator: Allocator, store: Store, backend: Backend) -> list[dict[str, Any]]:
        """The allocator undoes what it changed, every device still off its recorded original is put
        back (not in a dry run), and the ledger is saved, each whatever became of the one before.
        The restore actions taken."""
        actions: list[dict[str, Any]] = []
        with self._stop_step("allocator"):
            allocator.stop()
        if self.cfg.server.dry_run:
            self.log.info("restore_skipped", reason="dry run: nothing was written to the devices")
        else:
            unrestored: list[str] = []
            with self._stop_step("restore_devices"):
                actions = restore_devices(store, backend, self.log, getattr(self, "metrics", None),
                                          unrestored=unrestored)
            if unrestored:  # the device keeps the daemon's setting: the stop failed at what it is for
                self.stop_failures.append(
                    f"restore_devices: {', '.join(unrestored)} not back at the original settings "
                    "(device_restore_failed says why; the originals stay stored for the next stop)")
        with self._stop_step("save"):
            try:
                self._save(allocator.ledger)
            except StateNotSaved:
                pass  # logged by _save; every acknowledged change is stored already
        return actions

    def _remove_public_socket(self) -> None:
        """Unlink the public socket the front listened on, if the file is still that socket (another
        daemon may have replaced it since the listener closed)."""
        if self._public_inode is None:
            return
        try:
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._public_inode:
                self.socket_path.unlink()
        except OSError:
            pass
        self._public_inode = None

    def _wait_for_loaders(self, timeout_s: float) -> None:
        """Let background loads (forecaster, cold-start sizer, a hot reload) finish before the process
        exits: exiting while one is inside torch or ONNX Runtime aborts the process (SIGABRT,
        "terminate called without an active exception") instead of exiting 0."""
        deadline = time.monotonic() + timeout_s
        waits: list[Callable[[float], object]] = []
        if self.model_loader is not None and self.model_loader.ident is not None:  # started (start-up served)
            waits.append(self.model_loader.join)
        # Either may be missing (start-up failed before it) or be a stand-in without the method.
        sizer_wait = getattr(getattr(self, "sizer", None), "wait", None)
        if sizer_wait is not None:
            waits.append(sizer_wait)
        forecaster = model_of(self.manager.forecaster) if hasattr(self, "manager") else None
        forecaster_wait = getattr(forecaster, "wait_idle", None)
        if forecaster_wait is not None:
            waits.append(forecaster_wait)
        for wait in waits:
            wait(max(0.0, deadline - time.monotonic()))

    def loads_running(self) -> bool:
        """Whether a background load (forecaster, cold-start sizer, a hot reload) is still under way."""
        threads = [self.model_loader, getattr(getattr(self, "sizer", None), "thread", None)]
        forecaster = model_of(self.manager.forecaster) if hasattr(self, "manager") else None
        threads.append(getattr(forecaster, "loading_thread", None))
        return any(isinstance(t, threading.Thread) and t.is_alive() for t in threads)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop_signal: asyncio.Future[str] = loop.create_future()

        def on_signal(sig: signal.Signals) -> None:
            if not stop_signal.done():
                stop_signal.set_result(sig.name)

        def on_hangup() -> None:
            # Python's default for SIGHUP ends the process on the spot (no stop, no device restore,
            # the socket left behind); a `kill -HUP` meant as a reload must not do that.
            self.log.warning("sighup_ignored", detail="vgpu serve reloads nothing on SIGHUP: the model reloads "
                             "itself when its file changes; restart the daemon (SIGTERM) to apply configuration")

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
        fresh_state = not os.path.lexists(self.state_dir)
        try:
            await self.start()
        except BaseException:
            await self.stop("start-up failed")
            if fresh_state:
                self._remove_fresh_state_dir()
            raise
        reason = await stop_signal
        await self.stop(reason)
        return 1 if self.stop_failures else 0  # a stop that failed in part: the unit is marked failed


# --- command line -----------------------------------------------------------------------------------------
def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the vgpu manager and allocator daemon. Flags override /etc/vgpu/vgpu.toml and VGPU_* variables.",
    )
    p.add_argument("--config", type=Path, default=None, help="configuration file (default /etc/vgpu/vgpu.toml if present)")
    p.add_argument("--socket", help=f"Unix socket to listen on (default {vconfig.DEFAULT_SOCKET_PATH})")
    p.add_argument("--socket-mode", help="socket permission bits, octal (default 0660)")
    p.add_argument("--socket-group", help="group that owns the socket")
    p.add_argument("--state-dir", help=f"ledger, tokens and saved device settings (default {vconfig.DEFAULT_STATE_DIR})")
    p.add_argument("--inapp-dir", help="directory the client stubs write their in-app reports to, which the daemon reads "
                   "to prove a process's pid (default /run/vgpu/inapp, server.inapp_dir; made, mode 1777, where its parent "
                   "exists)")
    p.add_argument("--backend", help="nvml (default), sim, or sim:SKU[*N][,SKU[*N]...], e.g. sim:h100-80gb*2")
    p.add_argument("--tcp", metavar="HOST:PORT", help="also listen on TCP (HOST:auto: any free port, logged in "
                   "`serving`); needs --tls-cert and --tls-key")
    p.add_argument("--tls-cert", help="PEM server certificate for --tcp")
    p.add_argument("--tls-key", help="PEM server key for --tcp")
    p.add_argument("--tls-ca", help="PEM CA: TCP clients must present a certificate it signed (mutual TLS)")
    p.add_argument("--metrics-port", metavar="PORT", help="Prometheus endpoint port; 0 disables it, auto binds any "
                   "free port and logs it in `serving` (default 9464)")
    p.add_argument("--metrics-address", help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--model", help="forecaster checkpoint; must load (default: the shipped model when it loads, "
                   "else the baseline forecaster)")
    p.add_argument("--accept-replay", choices=("auto", "yes", "no"),
                   help="take signatures of processes this node does not run (a replay) from the profiler token: "
                   "yes, no (then only the operator token may replay), auto (default: yes on the simulator, no on NVML)")
    p.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=None,
                   help="decide and log, write nothing to devices (default: on for the nvml backend, off for sim:<sku>)")
    p.add_argument("--log-format", choices=("json", "console"), help="log format (default json)")
    p.add_argument("--log-level", help="debug, info, warning or error (default info)")
    p.add_argument("--check-config", action="store_true", help="print the effective configuration and exit")
    p.add_argument("--reset-state", action="store_true",
                   help="move a damaged state database aside (kept as *.damaged-<time>) and start with an empty ledger")
    return p


def _absolute(path: str | None) -> str | None:
    """A path flag as an absolute path: typed at a shell, it is relative to the shell's directory."""
    return os.path.abspath(path) if path else path


def config_from_args(ns: argparse.Namespace, env: dict[str, str] | None = None) -> Config:
    ns.socket = vconfig.socket_flag(ns.socket)  # (`unix:///path` as the clients take it: the same path)
    for name in ("state_dir", "inapp_dir", "tls_cert", "tls_key", "tls_ca"):
        setattr(ns, name, _absolute(getattr(ns, name)))
    overrides = {
        "server.socket": ns.socket,
        "server.socket_mode": ns.socket_mode,
        "server.socket_group": ns.socket_group,
        "server.state_dir": ns.state_dir,
        "server.inapp_dir": ns.inapp_dir,
        "server.backend": ns.backend,
        "server.tcp": ns.tcp,
        "server.dry_run": ns.dry_run,
        "manager.accept_replay": ns.accept_replay,
        "tls.cert": ns.tls_cert,
        "tls.key": ns.tls_key,
        "tls.ca": ns.tls_ca,
        "metrics.port": ns.metrics_port,
        "metrics.address": ns.metrics_address,
        "manager.model": ns.model,
        "log.format": ns.log_format,
        "log.level": ns.log_level,
    }
    return vconfig.load(ns.config, env=env, overrides=overrides)


def main(argv: Sequence[str] | None = None, prog: str = "vgpu serve") -> int:
    ns = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = config_from_args(ns)
    except ConfigError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return EXIT_FIX_FIRST
    problems = vconfig.missing_names(cfg) + vconfig.unreadable_files(cfg)
    for problem in problems:
        print(f"{prog}: configuration error: {problem}", file=sys.stderr)
    if problems:
        return EXIT_FIX_FIRST
    if ns.check_config:
        print(vconfig.to_toml(cfg), end="")
        return 0
    log.configure(cfg.log.format, cfg.log.level)  # type: ignore[arg-type]
    logger = log.get_logger("vgpu.daemon")
    # The process does not wait for the background loads when it stops (the module docstring's Stop).
    daemon = Daemon(cfg, logger=logger, reset_state=ns.reset_state, loader_join_s=0.0)
    try:
        status = asyncio.run(daemon.run())
        if daemon.stop_failures:  # served, and the stop went on past a failure: not a start that failed
            print(f"{prog}: the stop failed in part ({_one_line('; '.join(daemon.stop_failures))}); "
                  "the other steps ran, see `stop_step_failed` in the log", file=sys.stderr)
        if daemon.loads_running():
            end_process_now(status)
        return status
    except (StartupError, auth.AuthSetupError) as exc:
        logger.error("startup_failed", error=str(exc))
        print(f"{prog}: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_status if isinstance(exc, StartupError) else EXIT_START_FAILED
    except Exception as exc:  # noqa: BLE001 - one line with the cause, not a traceback, for the operator
        cause = f"{type(exc).__name__}: {exc}"
        logger.error("startup_failed", error=cause, exc_info=exc)
        print(f"{prog}: cannot start: {_one_line(cause)}", file=sys.stderr)
        return EXIT_START_FAILED


def end_process_now(status: int) -> NoReturn:
    """End the process with `status` at once, the standard streams flushed, without the interpreter's
    exit: a background load is still inside torch or ONNX Runtime, and their C++ destructors, which
    a normal exit runs, would abort the process under it (SIGABRT instead of `status`)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream already closed or gone: nothing to flush
            stream.flush()
    os._exit(status)


def _one_line(text: str) -> str:
    """A message on one line (a library's error may span several)."""
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
