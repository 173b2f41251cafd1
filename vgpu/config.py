"""The daemon's configuration: defaults < `/etc/vgpu/vgpu.toml` < `VGPU_*` environment < CLI flags.

Every key lives in a section of the TOML file and has a documented default here (and in
`systemd/vgpu.toml`, which ships the same defaults with a comment per key). The environment
variable for `[section] key` is `VGPU_SECTION_KEY` (e.g. `VGPU_SERVER_SOCKET`); variables that start
with `VGPU_` but name no section are left alone (tests use `VGPU_SHARED`), while an unknown key
inside a known section, a value of the wrong type or an out-of-range value is a `ConfigError`
that names the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path("/etc/vgpu/vgpu.toml")
# The one default for the daemon's socket and state directory: the daemon, the profiler, the client
# stub, the CLI and the systemd units all take them from here.
DEFAULT_SOCKET_PATH = "/run/vgpu/vgpu.sock"
DEFAULT_SOCKET = "unix://" + DEFAULT_SOCKET_PATH  # as a gRPC target
DEFAULT_STATE_DIR = "/var/lib/vgpu"
# sockaddr_un.sun_path on Linux: 108 bytes with the terminating NUL, so a socket path has at most 107.
MAX_SOCKET_PATH_BYTES = 107
# Settings that name files: a relative path would depend on the daemon's working directory (/ under
# systemd), so the file and the environment must give them absolute (flags are made absolute first).
# server.max_request_bytes's range. A profiler's SignatureBatch is at most MAX_BATCH_BYTES serialised
# (profiler/stream.py), half the smallest limit, so a batch always fits whatever the daemon allows.
MIN_REQUEST_BYTES = 256 * 1024
MAX_REQUEST_BYTES = 64 * 1024 * 1024
MAX_BATCH_BYTES = MIN_REQUEST_BYTES // 2
# server.max_streams_per_connection's range
MIN_STREAMS_PER_CONNECTION = 4
MAX_STREAMS_PER_CONNECTION = 1024
PATH_KEYS = ("server.socket", "server.state_dir", "server.inapp_dir", "tls.cert", "tls.key", "tls.ca")
# server.grace_s's bound. A stop waits up to grace_s for calls in flight and only then puts the
# devices' power limits and MIG layouts back; systemd kills the daemon TimeoutStopSec (60 s in the
# shipped unit) after SIGTERM, so the grace must leave the restore the other half of it.
MAX_GRACE_S = 30.0
# server.idle_release_s's bound, a week (0: never)
MAX_IDLE_RELEASE_S = 7 * 24 * 3600.0
# Connections the metrics endpoint serves at once in all (vgpu/daemon/metrics.py); one address (on
# loopback, one local user) may hold metrics.max_connections_per_address of them.
METRICS_MAX_CONNECTIONS = 64
# The spelling of "any free port the kernel picks" for metrics.port (and the port of server.tcp,
# HOST:auto): the daemon binds port 0 and logs the port it got in its `serving` record. 0 itself
# means off for metrics.port, as it always has, and is refused in server.tcp.
ANY_PORT = "auto"
# A port setting: a number or ANY_PORT
PortSetting = int | str


class ConfigError(ValueError):
    """A configuration file, environment variable or flag is unknown or has a bad value."""


@dataclass(frozen=True)
class ServerConfig:
    # Unix domain socket the daemon listens on (parent directory created if missing).
    socket: str = DEFAULT_SOCKET_PATH
    # Permission bits of the socket, octal ("0660": owner and group may connect).
    socket_mode: str = "0660"
    # Owner and group of the socket; empty = the daemon's own user / group.
    socket_owner: str = ""
    socket_group: str = ""
    # Ledger, tokens and saved device settings live here (systemd: StateDirectory=vgpu).
    state_dir: str = DEFAULT_STATE_DIR
    # "nvml" on a GPU server; "sim:<sku>" (e.g. "sim:h100-80gb") for a simulated device.
    backend: str = "nvml"
    # Optional TCP listener "HOST:PORT"; refused unless tls.cert and tls.key are set.
    tcp: str = ""
    # Decide and log, but write nothing to the device. Unset (None, the default): on for the nvml
    # backend, so a real GPU is changed only once `dry_run = false` says so; off for a simulator.
    dry_run: bool | None = None
    # Cap each application's GPU memory at its grant through NVML's per-cgroup memory limits
    # (nvmlDeviceSetMemoryLimits_v1, driver R615+), for applications whose pid is known; a driver
    # without them turns this off with one log line.
    cgroup_memory_limits: bool = True
    # When those caps apply: "contended" (only on a GPU whose grants reach 90 % of its memory or whose
    # forecast needs exceed it; elsewhere the application keeps to its grant itself, and an overrun
    # fails an allocation instead of ending the process) or "always" (wherever a pid is known).
    hard_memory_limits: str = "contended"
    # On a GPU in MIG mode, let vgpu choose its MIG layout from the forecast needs of the
    # applications on it (created ahead of need; an instance with processes is never destroyed).
    # Off: the operator's layout is left as it is.
    manage_mig_layout: bool = False
    # A request that does not fit in the free room takes it from the policy's own forecast grants,
    # each cut no lower than its application's latest use x (1 + reclaim_margin_frac), at least
    # reclaim_min_mib, lowest priority first (allocator/reclaim.py). false: such a request is refused
    # while the policy holds the room, as a static allocator would.
    reclaim: bool = True
    reclaim_margin_frac: float = 0.10
    reclaim_min_mib: float = 256.0
    # Seconds a graceful stop waits for in-flight RPCs before it restores the devices: 0..30
    # (MAX_GRACE_S), well under the unit's TimeoutStopSec (60 s), which the restore must fit in too.
    grace_s: float = 5.0
    # An application with grants that shows no sign of life for this long (no signature, no live
    # process among its grants' pids, no open watch of its own, no request) has its grants released.
    # 0 keeps grants until they are released; at most a week (MAX_IDLE_RELEASE_S).
    idle_release_s: float = 120.0
    # Grants naming a pid whose process the daemon saw run are released this long after the process
    # exited, once its application shows no other sign of life (no watch of its own, no request or
    # signature; while another of its processes runs, at once). 0 leaves them to idle_release_s.
    exit_release_s: float = 5.0
    # Seconds after a profiler stream ends (a replay that stopped, a profiler stopped or restarted)
    # that its applications whose grants it alone made, and whose processes run on none of their GPUs,
    # are released; far below idle_release_s, long enough to look at a replay's applications (`vgpu
    # apps`) and for a restarted profiler to send for them again. With idle_release_s 0 it never runs.
    stream_end_grace_s: float = 10.0
    # Grant quotas: at most this many grants per application and on the node (RESOURCE_EXHAUSTED
    # naming the quota beyond); they bound the ledger whatever callers pile up. A grant of 0 MiB
    # counts as any other: it costs a stored row, events and listings all the same.
    max_grants_per_app: int = 64
    max_grants_per_node: int = 4096
    # Grants one uid may hold at once, whatever tokens it calls with (with peer_credentials on: the
    # daemon knows each Unix-socket caller's uid), so one user naming its own live processes cannot
    # hold the node's max_grants_per_node and lock the others out: an eighth of it by default, a
    # node's worth of one user's jobs (8 GPUs x 64 grants, max_grants_per_app). Calls with the
    # operator token, and uid 0 (root; every container that runs as root without a user namespace),
    # are bounded by the node's quota only, as for max_connections_per_uid.
    max_grants_per_uid: int = 512
    # WatchAllocations streams at most per caller (one token; callers without a token count as one per
    # uid, or as one in all where the uid is unknown: TCP, peer_credentials off) and in all; a watcher
    # that does not keep up with its events is dropped.
    max_watchers_per_caller: int = 16
    max_watchers: int = 256
    # ... and per uid, whatever tokens it presents: each application id a user self-registers comes
    # with a token of its own, so max_watchers_per_caller alone does not bound a user. A quarter of
    # max_watchers; the operator token and uid 0 are bounded by max_watchers only.
    max_watchers_per_uid: int = 64
    # Connections open at once on the socket (gRPC's grpc.max_allowed_incoming_connections): one
    # beyond it is closed as soon as it is accepted. Each costs the daemon about 13 KiB (17 KiB once
    # it has spoken HTTP/2), so the bound caps that memory; the price is that a caller holding this
    # many connections keeps new clients out (as LimitNOFILE would, at 65536).
    max_connections: int = 4096
    # Connections one uid may hold open on the Unix socket at once (with peer_credentials on): one
    # beyond it is closed as soon as it is accepted, so one user cannot hold the node's
    # max_connections and lock the others out. A process needs one connection per channel (the
    # client stub, the CLI and the profiler each open one), so 256 is a node's worth of one user's
    # ranks and workers (8 GPUs x 32 processes) while 16 such users still fit the total. uid 0 is
    # bounded only by max_connections: root can stop the daemon anyway, and every container that
    # runs as root without a user namespace is uid 0, so a per-uid bound would make them one user.
    max_connections_per_uid: int = 256
    # Calls one connection may have open at once (gRPC's grpc.max_concurrent_streams; a client past it
    # waits for one of its calls to end). Every channel a process opens to the socket with the same
    # options shares one connection, so this bounds a process's open calls: an application's stub
    # holds a few (a request, a WatchAllocations stream), a profiler one stream. gRPC holds a call's
    # request in memory until the whole message has arrived, so what one uid can make the daemon hold
    # with calls it never finishes is max_connections_per_uid x this x max_request_bytes (1 GiB with
    # the defaults; docs/reliability.md).
    max_streams_per_connection: int = 16
    # The largest request message the daemon takes (gRPC's grpc.max_receive_message_length; one
    # larger ends its call with RESOURCE_EXHAUSTED before it is read). A profiler's batch is at most
    # half of the smallest value allowed (MAX_BATCH_BYTES); every other request is a few KiB.
    # Replies are not bounded by it.
    max_request_bytes: int = 256 * 1024
    # Read each Unix-socket caller's uid and pid (SO_PEERCRED) through the daemon's front, which
    # accepts on the socket and relays to gRPC's own socket in <state_dir>/front (vgpu/daemon/front.py):
    # connections are bounded per uid, and a request may name a pid of the caller's own uid. false:
    # gRPC listens on the socket itself, connections are bounded only per node, and a pid needs the
    # operator token or the process's in-app report (for a node where the relay cannot run).
    peer_credentials: bool = True
    # Where client stubs write their in-app reports (vgpu/client.py); a request naming a pid without
    # the operator token, of a process that is not the caller's own, is taken only when that pid's
    # report there, owned by its user, names the app.
    inapp_dir: str = "/run/vgpu/inapp"


@dataclass(frozen=True)
class TlsConfig:
    # PEM server certificate and key for the TCP listener.
    cert: str = ""
    key: str = ""
    # PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).
    ca: str = ""


@dataclass(frozen=True)
class AuthConfig:
    # Group allowed to read the operator token (file mode 0640); empty = owner only (0600).
    operator_group: str = ""
    # Group allowed to read the profiler token; empty = owner only.
    profiler_group: str = ""
    # A client without a token may claim an application id nobody owns yet (and gets its token).
    app_self_registration: bool = True
    # At most this many application ids may be claimed by self-registration (each is a row and a
    # token file that outlive its grants); beyond, RESOURCE_EXHAUSTED naming the bound.
    max_self_registered_apps: int = 10000
    # ... and at most this many by one uid (the claiming uid is stored with the claim), so one user
    # cannot claim them all: a claim outlives its grants, and only `vgpu forget-app` drops one.
    # uid 0 is bounded by the node's bound only.
    max_self_registered_apps_per_uid: int = 1000
    # GetAvailableResources / ListApplications / WatchAllocations need no token.
    open_reads: bool = True
    # Ingest streams need no profiler token (only for profilers that cannot send one yet).
    open_ingest: bool = False


@dataclass(frozen=True)
class MetricsConfig:
    # Prometheus endpoint port; 0 disables it; "auto" binds any free port the kernel picks (the
    # `serving` log record and systemd's STATUS say which).
    port: PortSetting = 9464
    # Address the endpoint binds to.
    address: str = "127.0.0.1"
    # Applications given per-application series (vgpu_app_*) at most: those an operator set limits
    # on, then those with an OOM event, then the largest memory footprint. The rest are summed per
    # device (vgpu_device_unlisted_*) and counted (vgpu_device_apps_unlisted), so that callers who
    # create many applications cannot grow every scrape without bound.
    max_apps: int = 100
    # Connections one peer may hold open on the endpoint at once, of the 64 it serves in all: one
    # beyond is closed at accept (vgpu_metrics_connections_refused_total{reason=
    # "max_connections_per_address"}), so one caller reconnecting all the time cannot take the slots
    # a scrape needs. A peer is the caller's address (an IPv4 address and its IPv4-mapped IPv6 form
    # are one), or on loopback the local user owning the caller's socket (any local user may connect
    # from any loopback address; all loopback callers share one peer where the kernel cannot say).
    # A Prometheus server scrapes over one connection at a time (two while a slow scrape ends), so 8
    # leaves room for a pair of them behind one address; a proxy on the node (kube-rbac-proxy, a TLS
    # front, a Unix-socket relay) brings every scraper behind it as its own user: raise it to 2 per
    # scraper behind the proxy (64: no bound per peer).
    max_connections_per_address: int = 8


@dataclass(frozen=True)
class ManagerConfig:
    # Forecaster checkpoint (vgpu/offline/train.py); empty = the shipped model when it loads, else the
    # baseline forecaster (manager/modelpath.py).
    model: str = ""
    # Seconds between checks of the checkpoint file for a new version (mtime/size), hot-loaded
    # without dropping streams; a new file that does not load is logged and the old model serves.
    # The node-local model (<state_dir>/models/local.pt) is looked at as often.
    model_check_interval_s: float = 5.0
    # Milliseconds the manager waits after a signature batch makes an application due, so that
    # others arriving meanwhile are forecast in the same call (one forecaster call per batch).
    batch_window_ms: float = 1.0
    # Largest share of the time the forecasting thread may be busy, in (0, 1]: it earns that many
    # seconds of CPU per second (keeping at most one second's worth) and each forecast batch spends
    # what it took; with the budget spent, the next batch waits and what becomes due joins it.
    forecast_duty_max: float = 0.25
    # Milliseconds a profiler stream may go without a reply when there is nothing to say (no
    # decision, no rejection): accepted counts wait for the next reply, at most this long. 0: every
    # batch is answered (twice the messages: each one costs the manager CPU).
    ack_interval_ms: float = 1000.0
    # Serve the per-application expert mixture (manager/experts.py: the last value, an EWMA and the
    # model weighed by their recent error, a conformal P90) instead of the model alone.
    mixture: bool = True
    # With the mixture: keep the node's history (every application's 1 s grid) under
    # <state_dir>/history for this many seconds, at most history_max_mib MiB.
    history: bool = True
    history_horizon_s: float = 604800.0
    history_max_mib: float = 512.0
    # Seconds between rounds of node-local learning (a niced child process fine-tunes a copy of the
    # model on the history and promotes it only when it beats the serving one on the most recent
    # held-back hour's worth); 0 = never. `vgpu model status|rollback` shows and undoes promotions.
    learn_interval_s: float = 3600.0
    # With the mixture: learn node-local trees from the history in each round and serve them as an
    # expert (manager/nodetrees.py); false: no trees are fitted or served (the network's round goes on).
    node_trees: bool = True
    # Signatures naming processes this node does not run (a replayed trace's pids) from the profiler
    # token: "yes" takes them, "no" takes only signatures whose pid the node's driver lists as a GPU
    # process on the device named (a replay then needs the operator token), "auto" is "no" on NVML
    # and "yes" on the simulator (whose processes no separate profiler can see).
    accept_replay: str = "auto"


@dataclass(frozen=True)
class LogConfig:
    # "json" (journald) or "console".
    format: str = "json"
    # "debug", "info", "warning" or "error".
    level: str = "info"


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def socket_mode_bits(self) -> int:
        return int(self.server.socket_mode, 8)

    @property
    def mutual_tls(self) -> bool:
        return bool(self.tls.ca)


# Section name -> its dataclass (field types are strings under `from __future__ import annotations`).
_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "tls": TlsConfig,
    "auth": AuthConfig,
    "metrics": MetricsConfig,
    "manager": ManagerConfig,
    "log": LogConfig,
}
_TYPES: dict[str, type] = {"str": str, "bool": bool, "int": int, "float": float, "bool | None": bool}


def _annotation(section: str, key: str) -> str:
    for f in fields(_SECTIONS[section]):
        if f.name == key:
            return str(f.type)
    raise KeyError(key)


def _field_type(section: str, key: str) -> type:
    return _TYPES[_annotation(section, key)]


def _known_keys(section: str) -> list[str]:
    return [f.name for f in fields(_SECTIONS[section])]


def _coerce(section: str, key: str, value: object, source: str, *, parse: bool = True) -> object:
    """`value` as the field's type; strings (from the environment or flags) are parsed when `parse`
    (a TOML file has types of its own, so `port = "9464"` there is an error)."""
    where = f"{section}.{key} ({source})"
    if _annotation(section, key) == "PortSetting":
        return _coerce_port(value, where, parse=parse)
    want = _field_type(section, key)
    if parse and isinstance(value, str) and want is not str:
        text = value.strip().lower()
        if want is bool:
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        try:
            return want(text)
        except ValueError:
            raise ConfigError(f"{where}: expected {want.__name__}, got {value!r}") from None
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {want.__name__}, got {type(value).__name__} {value!r}")
    return value


def _coerce_port(value: object, where: str, *, parse: bool) -> PortSetting:
    """A port setting: a number, or ANY_PORT in any case. A number in a string is read as the number
    when `parse` (the environment, a flag); a TOML file has numbers of its own, so there it is an error."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == ANY_PORT:
            return ANY_PORT
        if parse:
            try:
                return int(text)
            except ValueError:
                pass
    raise ConfigError(f'{where}: expected a port number (0: off) or "{ANY_PORT}" (any free port, logged in '
                      f"`serving`), got {type(value).__name__} {value!r}")


def socket_path(value: str) -> str:
    """A socket setting as the path the daemon binds: the gRPC spellings the clients take
    (`unix:///run/vgpu/vgpu.sock`, `unix:/run/...`) name the same path, so they are read as it
    rather than as a relative path whose name begins with `unix:`."""
    text = value.strip()
    for prefix in ("unix://", "unix:"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return value


def socket_flag(value: str | None) -> str | None:
    """A `--socket` flag as an absolute path (`socket_path`, then relative to the shell's directory)."""
    return os.path.abspath(socket_path(value)) if value else value


def bind_port(port: PortSetting) -> int:
    """A port setting as the number to bind: ANY_PORT is 0, for which the kernel picks a free port."""
    return port if isinstance(port, int) else 0


def _validate(cfg: Config) -> None:
    s = cfg.server
    if not s.socket:
        raise ConfigError("server.socket: must not be empty (the daemon always listens on a Unix socket)")
    try:
        mode = int(s.socket_mode, 8)
    except ValueError:
        raise ConfigError(f"server.socket_mode: expected octal permission bits like '0660', got {s.socket_mode!r}") from None
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"server.socket_mode: {s.socket_mode!r} is outside 0000..0777")
    if mode & 0o007:
        raise ConfigError(
            f"server.socket_mode: {s.socket_mode!r} lets every local user connect; use owner/group bits only"
        )
    if not s.state_dir:
        raise ConfigError("server.state_dir: must not be empty")
    for dotted in PATH_KEYS:
        section, _, key = dotted.partition(".")
        value = getattr(getattr(cfg, section), key)
        if value and not os.path.isabs(value):
            raise ConfigError(
                f"{dotted}: {value!r} is a relative path; give an absolute one (the daemon's working "
                f"directory is / under systemd), e.g. {os.path.abspath(value)!r}"
            )
    socket_bytes = len(os.fsencode(s.socket))
    if socket_bytes > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"server.socket: {s.socket!r} is {socket_bytes} bytes; a Unix socket path may have at most "
            f"{MAX_SOCKET_PATH_BYTES} (sun_path): choose a shorter path"
        )
    from vgpu.device import is_nvml_spec, parse_sim_spec

    if not is_nvml_spec(s.backend):

        try:
            parse_sim_spec(s.backend)
        except ValueError as exc:
            raise ConfigError(f"server.backend: expected 'nvml' or 'sim:<sku>', got {s.backend!r} ({exc})") from None
    if not 0 <= s.grace_s <= MAX_GRACE_S:
        raise ConfigError(f"server.grace_s: expected 0..{MAX_GRACE_S:g} seconds (a stop waits this long for calls in "
                          "flight, then restores the devices, and systemd kills the daemon TimeoutStopSec, 60 s, "
                          f"after SIGTERM: keep it well under that), got {s.grace_s}")
    if s.hard_memory_limits not in ("contended", "always"):
        raise ConfigError(f"server.hard_memory_limits: expected 'contended' or 'always', got {s.hard_memory_limits!r}")
    if not 0 <= s.reclaim_margin_frac <= 10:
        raise ConfigError(f"server.reclaim_margin_frac: expected 0..10 (a fraction of the use kept above it), "
                          f"got {s.reclaim_margin_frac}")
    if not 0 <= s.reclaim_min_mib <= 1024 * 1024:
        raise ConfigError(f"server.reclaim_min_mib: expected 0..1048576 MiB, got {s.reclaim_min_mib}")
    if not 0 <= s.idle_release_s <= MAX_IDLE_RELEASE_S:
        raise ConfigError(f"server.idle_release_s: expected 0..{MAX_IDLE_RELEASE_S:g} seconds (a week; 0: never), "
                          f"got {s.idle_release_s}")
    if not 0 <= s.exit_release_s <= 3600:
        raise ConfigError(f"server.exit_release_s: expected 0..3600 seconds (0: off, grants of exited processes "
                          f"wait for server.idle_release_s), got {s.exit_release_s}")
    if not 0 < s.stream_end_grace_s <= 3600:
        raise ConfigError(f"server.stream_end_grace_s: expected more than 0 and at most 3600 seconds (the release "
                          f"after a stream's end is off only with server.idle_release_s 0), got {s.stream_end_grace_s}")
    for name in ("max_grants_per_app", "max_grants_per_node", "max_grants_per_uid", "max_watchers_per_caller",
                 "max_watchers", "max_watchers_per_uid", "max_connections", "max_connections_per_uid"):
        if getattr(s, name) < 1:
            raise ConfigError(f"server.{name}: must be >= 1, got {getattr(s, name)}")
    if not MIN_STREAMS_PER_CONNECTION <= s.max_streams_per_connection <= MAX_STREAMS_PER_CONNECTION:
        raise ConfigError(f"server.max_streams_per_connection: expected {MIN_STREAMS_PER_CONNECTION}.."
                          f"{MAX_STREAMS_PER_CONNECTION} (a process's channels share one connection: its watch, "
                          f"profiler stream and requests need a few), got {s.max_streams_per_connection}")
    if not MIN_REQUEST_BYTES <= s.max_request_bytes <= MAX_REQUEST_BYTES:
        raise ConfigError(f"server.max_request_bytes: expected {MIN_REQUEST_BYTES}..{MAX_REQUEST_BYTES} (twice a "
                          f"profiler's largest batch, {MAX_BATCH_BYTES}, up to 64 MiB), got {s.max_request_bytes}")
    if cfg.manager.accept_replay not in ("auto", "yes", "no"):
        raise ConfigError(f"manager.accept_replay: expected auto, yes or no, got {cfg.manager.accept_replay!r}")
    for name in ("max_self_registered_apps", "max_self_registered_apps_per_uid"):
        if getattr(cfg.auth, name) < 1:
            raise ConfigError(f"auth.{name}: must be >= 1, got {getattr(cfg.auth, name)}")
    if s.tcp:
        parse_host_port(s.tcp)  # raises ConfigError
        if not cfg.tls.cert:
            raise ConfigError(
                f"server.tcp={s.tcp!r}: plaintext TCP is refused; set tls.cert and tls.key "
                "(and tls.ca for mutual TLS), or use the Unix socket"
            )
    if bool(cfg.tls.cert) != bool(cfg.tls.key):
        raise ConfigError("tls.cert and tls.key: set both or neither")
    if cfg.tls.ca and not cfg.tls.cert:
        raise ConfigError("tls.ca: mutual TLS needs tls.cert and tls.key as well")
    if not cfg.manager.model_check_interval_s > 0:
        raise ConfigError(f"manager.model_check_interval_s: must be > 0, got {cfg.manager.model_check_interval_s}")
    if not 0 <= cfg.manager.batch_window_ms <= 1000:
        raise ConfigError(f"manager.batch_window_ms: expected 0..1000 ms, got {cfg.manager.batch_window_ms}")
    if not 0 <= cfg.manager.ack_interval_ms <= 60_000:
        raise ConfigError(f"manager.ack_interval_ms: expected 0..60000 ms, got {cfg.manager.ack_interval_ms}")
    if not cfg.manager.history_horizon_s > 0 or not cfg.manager.history_max_mib > 0:
        raise ConfigError("manager.history_horizon_s and manager.history_max_mib: must be > 0")
    if not cfg.manager.learn_interval_s >= 0:
        raise ConfigError(f"manager.learn_interval_s: must be >= 0 (0: never), got {cfg.manager.learn_interval_s}")
    if not 0 < cfg.manager.forecast_duty_max <= 1:
        raise ConfigError(f"manager.forecast_duty_max: expected a share in (0, 1], got {cfg.manager.forecast_duty_max}")
    port = cfg.metrics.port
    if port != ANY_PORT and not (isinstance(port, int) and not isinstance(port, bool) and 0 <= port <= 65535):
        raise ConfigError(f'metrics.port: expected 0..65535 (0: off) or "{ANY_PORT}" (any free port), got {port!r}')
    if cfg.metrics.max_apps < 0:
        raise ConfigError(f"metrics.max_apps: must be >= 0 (0: operator-limited applications only), "
                          f"got {cfg.metrics.max_apps}")
    if not 1 <= cfg.metrics.max_connections_per_address <= METRICS_MAX_CONNECTIONS:
        raise ConfigError(f"metrics.max_connections_per_address: expected 1..{METRICS_MAX_CONNECTIONS} (the "
                          f"endpoint serves {METRICS_MAX_CONNECTIONS} connections at once in all; "
                          f"{METRICS_MAX_CONNECTIONS}: no bound per address), "
                          f"got {cfg.metrics.max_connections_per_address}")
    if cfg.log.format not in ("json", "console"):
        raise ConfigError(f"log.format: expected 'json' or 'console', got {cfg.log.format!r}")
    if cfg.log.level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log.level: expected debug/info/warning/error, got {cfg.log.level!r}")


def parse_host_port(text: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port), with port 0 for 'HOST:auto' (any free port the
    kernel picks); ConfigError otherwise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"server.tcp: expected HOST:PORT or HOST:{ANY_PORT}, got {text!r}")
    if port_text.strip().lower() == ANY_PORT:
        return host.strip("[]"), 0
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"server.tcp: port must be a number or {ANY_PORT!r} (any free port), "
                          f"got {port_text!r}") from None
    if not 0 < port <= 65535:
        raise ConfigError(f"server.tcp: port {port} is outside 1..65535 (HOST:{ANY_PORT}: any free port)")
    return host.strip("[]"), port


def bind_address(text: str) -> str:
    """A 'HOST:PORT' setting as the address to bind: 'HOST:auto' becomes 'HOST:0'."""
    host, _, port_text = text.rpartition(":")
    return f"{host}:{0 if port_text.strip().lower() == ANY_PORT else port_text}"


def address_text(host: str, port: PortSetting) -> str:
    """HOST:PORT as an operator types it, an IPv6 address in brackets ([::1]:9464)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _merge(
    layers: dict[str, dict[str, object]], section: str, key: str, value: object, source: str, *, parse: bool = True
) -> None:
    if section not in _SECTIONS:
        raise ConfigError(f"unknown section [{section}] ({source}); known: {', '.join(_SECTIONS)}")
    if key not in _known_keys(section):
        raise ConfigError(
            f"unknown key {section}.{key} ({source}); known in [{section}]: {', '.join(_known_keys(section))}"
        )
    layers.setdefault(section, {})[key] = _coerce(section, key, value, source, parse=parse)


def load(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Defaults, then the TOML file, then `VGPU_SECTION_KEY` variables, then `overrides`
    ({"server.socket": "/tmp/x.sock"}, from CLI flags; None values are skipped).

    `path=None` reads DEFAULT_CONFIG_PATH when it exists; an explicit path that does not exist is
    an error (the operator asked for it).
    """
    env = os.environ if env is None else env
    layers: dict[str, dict[str, object]] = {}

    file_path = path if path is not None else (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None)
    if file_path is not None:
        try:
            raw = tomllib.loads(Path(file_path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {file_path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file_path}: not valid TOML: {exc}") from None
        except RecursionError:  # arrays or tables nested deeper than the parser goes: no vgpu setting is
            raise ConfigError(f"config file {file_path}: not valid TOML: nested too deep") from None
        for section, table in raw.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{file_path}: top-level key {section!r} must be a [section]; known: {', '.join(_SECTIONS)}"
                )
            for key, value in table.items():
                _merge(layers, section, key, value, str(file_path), parse=False)

    for name, value in sorted(env.items()):
        if not name.startswith("VGPU_"):
            continue
        rest = name[len("VGPU_") :].lower()
        section, sep, key = rest.partition("_")
        if not sep or section not in _SECTIONS:
            continue  # not ours (e.g. VGPU_SHARED)
        _merge(layers, section, key, value, f"environment {name}")

    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        _merge(layers, section, key, value, f"flag for {dotted}")

    server = layers.get("server", {})
    given = server.get("socket")
    if isinstance(given, str):
        server["socket"] = socket_path(given)
    sections: dict[str, Any] = {name: cls(**layers.get(name, {})) for name, cls in _SECTIONS.items()}
    cfg = Config(**sections)
    _validate(cfg)
    return cfg


def replace(cfg: Config, **sections: dict[str, object]) -> Config:
    """A copy with some keys changed, validated: `replace(cfg, server={"dry_run": True})`."""
    new_sections: dict[str, Any] = {}
    for name, changes in sections.items():
        for key, value in changes.items():
            _coerce(name, key, value, "replace()")
        new_sections[name] = dataclasses.replace(getattr(cfg, name), **changes)
    out = dataclasses.replace(cfg, **new_sections)
    _validate(out)
    return out


def dry_run_of(server: ServerConfig) -> bool:
    """Whether the daemon writes nothing to the devices: `server.dry_run` when set, else True on the
    nvml backend (a real GPU) and False on a simulator."""
    from vgpu.device import is_nvml_spec

    return is_nvml_spec(server.backend) if server.dry_run is None else server.dry_run


def accepts_replay(cfg: Config) -> bool:
    """Whether the profiler token may stream signatures of processes the node does not run
    (`manager.accept_replay`; "auto": only on the simulator)."""
    if cfg.manager.accept_replay == "auto":
        from vgpu.device import is_nvml_spec

        return not is_nvml_spec(cfg.server.backend)
    return cfg.manager.accept_replay == "yes"


def resolve_dry_run(cfg: Config) -> Config:
    """`cfg` with `server.dry_run` set to what it means for its backend (see `dry_run_of`)."""
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, dry_run=dry_run_of(cfg.server)))


def to_toml(cfg: Config) -> str:
    """The configuration as TOML (used by `vgpu doctor` and to check the shipped file)."""
    lines: list[str] = []
    for name in _SECTIONS:
        lines.append(f"[{name}]")
        for f in fields(getattr(cfg, name)):
            value = getattr(getattr(cfg, name), f.name)
            if value is None:  # unset: TOML has no null, so the key is shown commented out
                lines.append(f"# {f.name} unset")
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(value)
            lines.append(f"{f.name} = {text}")
        lines.append("")
    return "\n".join(lines)


def unreadable_files(cfg: Config) -> list[str]:
    """The files the configuration names for the daemon to read (manager.model; tls.cert, tls.key and
    tls.ca when server.tcp listens) that are missing, not files, or cannot be read, one line each
    naming the key: every start would fail on them alike, so they are checked before anything starts
    (and by --check-config). Whether a model loads or a certificate parses only the start tells."""
    files = [("manager.model", cfg.manager.model.strip())]
    if cfg.server.tcp:
        files += [("tls.cert", cfg.tls.cert), ("tls.key", cfg.tls.key), ("tls.ca", cfg.tls.ca)]
    problems = []
    for key, path in files:
        if not path:
            continue
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a directory, or a FIFO an open would block on
                problems.append(f"{key}: {path} is not a file")
                continue
            with open(path, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            problems.append(f"{key}: cannot read {path} ({exc.strerror or exc})")
    return problems


def missing_names(cfg: Config) -> list[str]:
    """The users and groups the configuration names that this host does not have, one line each
    naming the key: checked before anything starts (and by --check-config), since the daemon would
    otherwise find out only once it has set up its state and bound its socket."""
    problems = []
    for key, name, kind in (("server.socket_owner", cfg.server.socket_owner, "user"),
                            ("server.socket_group", cfg.server.socket_group, "group"),
                            ("auth.operator_group", cfg.auth.operator_group, "group"),
                            ("auth.profiler_group", cfg.auth.profiler_group, "group")):
        if not name:
            continue
        try:
            if kind == "user":
                pwd.getpwnam(name)
            else:
                grp.getgrnam(name)
        except KeyError:
            create = f"useradd --system {name}" if kind == "user" else f"groupadd --system {name}"
            problems.append(f"{key}: there is no {kind} {name!r} on this host (create it: {create}; "
                            "or set another, or \"\" for none)")
    return problems
