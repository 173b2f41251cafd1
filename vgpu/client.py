"""The client stub an application links: ask the allocator for resources, apply the grant, report counters.

    client = VgpuClient("train-resnet", job=JobConfig("resnet50", batch_size=64, mode="train"))  # vgpu.jobs
    grant = client.request()    # sized from the job by the daemon; memory_mib= would override the job
    for batch in loader:
        ...
        client.step()
    client.close()          # releases the app's grants and removes its in-app file

After `close()` (or the `with` block), `request()`, `release()` and `report_now()` raise
ClientClosedError and the in-app file is never written again; `step()`, `report_serving()`,
`counters()` and the properties still answer from memory. An application that exits without closing
has its in-app file removed at interpreter exit (a `weakref.finalize` hook; not in a child it forked),
but its grants stay until the daemon's idle release (`server.idle_release_s` after its last sign of life).

Identity. The daemon knows an application by its id and, once the id is taken, by the application's
token (vgpu/auth.py). A new id needs no token: the first grant comes back with the application's token,
and the stub keeps it (in memory, and in `token_file`, 0600) and sends it on every later call, so
`release()`, `close()` and `with VgpuClient(...)` release the app's grants, and the same app id started
again (a restarted application) finds the token in the same file and goes on. The default
`token_file` is `$XDG_CONFIG_HOME/vgpu/tokens/<hash of the socket>/<hash of the app id>.token`
(`~/.config/...` without XDG_CONFIG_HOME), the same file `vgpu request --app ID` writes and reads, so
an application and its operator's CLI share it (`app_token_path()` says where it is). Pass `token=`
to give a token you were handed (`<state-dir>/tokens/apps/...`, from the operator), or `token_file=`
to keep it elsewhere. A token the daemon rejects as not its own (it was re-keyed) is dropped and the
id claimed anew; an id owned by someone else, with no token here, is refused with PERMISSION_DENIED.

Three things run behind that API:

* **Requests** go to the `Allocator` gRPC service (`RequestResourceAllocation`, `ReleaseResources`). A
  call waits up to `ready_wait_s` (default `NOT_READY_WAIT_S`) for the daemon to listen (an application
  started at boot before vgpu-manager; a daemon restarting): a health check with gRPC's `wait_for_ready`
  goes out first, so the call itself is sent only once the connection is up, and a daemon still not
  listening then fails the call with UNAVAILABLE and the reason. A request the daemon answers "not ready" (UNAVAILABLE marked as having changed nothing:
  its cold-start model still loading just after it starts, its state directory full) is sent again within
  the same budget; any other UNAVAILABLE is raised at once, since it may follow a change. This is the
  CLI's `--wait-s` (vgpu/ctl.py).
* **A watch of its own grants** (`WatchAllocations` filtered by `app_id`, in a daemon thread, reconnecting
  within about a second; each time it is live again the stub lists its grants once, since changes made
  while it was away, as during a daemon restart, send no event) keeps the sum of the app's granted memory on its GPU: grants naming this process's pid
  or no pid (a grant naming another process of the same id is that process's), on the GPU whose UUID torch
  gives for its device (`_grants_here`). When it changes, the stub applies it
  *cooperatively*: for PyTorch, `torch.cuda.set_per_process_memory_fraction(limit / total)`, so an
  allocation beyond the grant fails (torch's OutOfMemoryError) and the application lives. On a device
  whose memory is contended the daemon also caps the process's cgroup at the grant (a hard limit,
  beyond which the process runs out of memory); the grant's reply and every event of the
  application say which is in force (`mem_limit`: "hard" only while the cap is written), kept in
  `memory_limit_kind`. The allocator sees what was applied in the in-app
  counters below.
* **A reporter** (daemon thread, every `report_period_s`) writes the app's in-app counters to a small
  JSON file, `<inapp_dir>/<pid>.json`, that the profiler reads when it samples that pid: PyTorch's
  allocator counters, and a serving engine's (`report_serving`; `serving_counters_from_metrics` reads
  them from a vLLM or SGLang Prometheus text):

      scrape = scrape_serving_metrics("http://127.0.0.1:8000/metrics", kv_total_mib=40_960)
      client.report_serving(scrape.counters)      # every second or so; stale after serving_max_age_s

Why a file and not another RPC: the profiler already visits every GPU process each tick and only needs
the latest value; a per-pid file on tmpfs costs one `open` per sample, needs no connection or server in
the profiler, survives either side restarting, and ties the counters to the pid the profiler sees
(the file records the pid's start time, so a reused pid does not inherit them). It is written to a
temporary name and renamed, so a reader never sees half a file; a file older than `INAPP_MAX_AGE_S` or
whose pid is gone or restarted is ignored. The directory (default `/run/vgpu/inapp`) must be writable by
the applications (mode 1777, like /tmp); the profiler ignores a file whose owner is not the process's user.
Since any user may create `<pid>.json` first (the sticky bit then keeps the stub from writing over it),
a stub that finds that name taken by something it cannot write over writes `<pid>.<token>.json`
instead, the token random (`claim_inapp_path`), and logs that once; the profiler and the daemon's pid
proof find that name by a bounded listing of the directory (`InAppFinder`), counting only files owned
by the process's user (docs/profiler.md, "The in-app protocol").

torch is never imported here: an application that uses PyTorch has imported it already, so the stub
takes it from `sys.modules` when it needs it (or from the `torch_module` argument, for tests). With no
torch, or no CUDA, the stub still requests, watches and reports; the torch counters are absent.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import random
import re
import secrets
import stat
import sys
import threading
import time
import tomllib
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any, TypeGuard, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vgpu import config
from vgpu.ids import app_id_digest
from vgpu.inapp import INAPP_MAX as INAPP_MAX
from vgpu.inapp import INT_COUNTERS as INT_COUNTERS
from vgpu.inapp import MAX_INAPP_COUNT as MAX_INAPP_COUNT
from vgpu.inapp import MAX_INAPP_MIB as MAX_INAPP_MIB
from vgpu.inapp import MAX_INAPP_REQUESTS as MAX_INAPP_REQUESTS
from vgpu.inapp import MAX_INAPP_TOKENS as MAX_INAPP_TOKENS
from vgpu.inapp import inapp_value_problem as inapp_value_problem
from vgpu.jobs import InvalidJobConfig, JobConfig, known_model, unknown_model_note
from vgpu.log import get_library_logger
from vgpu.tokenfile import TokenFileError as TokenFileError
from vgpu.tokenfile import check_token as check_token
from vgpu.tokenfile import read_token as read_token
from vgpu.tokenfile import save_token as save_token
from vgpu.tokenfile import write_atomically
from vgpu.v1 import allocator_pb2, allocator_pb2_grpc

DEFAULT_SOCKET = config.DEFAULT_SOCKET  # the daemon's socket (vgpu/config.py), as a gRPC target
DEFAULT_INAPP_DIR = Path("/run/vgpu/inapp")
# Every application writes its own file in it; sticky, so none may remove or replace another's.
INAPP_DIR_MODE = 0o1777
INAPP_VERSION = 1
# A file not rewritten for this long is stale (the reporter writes every second by default).
INAPP_MAX_AGE_S = 5.0
# The most of an in-app file that is read (vgpu/capped.py): the stub writes a few hundred bytes, and any
# application may write in the directory; a larger file is malformed and is not read whole.
MAX_INAPP_FILE_BYTES = 64 * 1024
# The usual name taken by a file this process cannot own (another user's: a squat, or one left by another
# user's earlier process with this pid; or no regular file), the stub writes `<pid>.<token>.json`
# instead, the token INAPP_TOKEN_BYTES random bytes in lowercase hex: a name nobody can take first.
INAPP_TOKEN_BYTES = 16
_INAPP_FALLBACK_NAME = re.compile(rf"([1-9][0-9]{{0,9}})\.([0-9a-f]{{{2 * INAPP_TOKEN_BYTES}}})\.json")
# Either name of a stub's report (`<pid>.json`, `<pid>.<token>.json`), the pid its first group.
INAPP_REPORT_NAME = re.compile(rf"([1-9][0-9]{{0,9}})(?:\.[0-9a-f]{{{2 * INAPP_TOKEN_BYTES}}})?\.json")
# What one scan of the in-app directory for those names costs at most (`InAppFinder.scan`): the
# directory entries it reads (a directory that holds more is read over several scans, each going on
# where the last stopped), and, of the names it finds for one process, owned by that process's user,
# how many it keeps (the newest by modification time: a stub writes its own every second).
MAX_INAPP_SCAN_ENTRIES = 4096
MAX_INAPP_NAMES_PER_PID = 4
# The processes whose names an `InAppFinder` keeps at once (the oldest forgotten past it).
MAX_INAPP_FINDER_PIDS = 4096
# psutil's create_time has clock-tick resolution; two starts closer than this are "the same process".
PID_START_TOLERANCE_S = 1.0
MIB = 1024 * 1024

_log = get_library_logger("vgpu.client")

# gRPC's default reconnect backoff grows to 120 s: after the daemon restarts, every call (a release on
# close included) would fail with UNAVAILABLE until the channel's next try. The daemon is local (or one
# TCP peer), so trying again every second at most costs nothing and finds a restarted daemon at once.
# gRPC core's min_reconnect_backoff_ms is not set: it is also the least time a connection attempt
# is given to finish its handshake, and at 100 ms a daemon busy for a moment (loading its model, a
# loaded machine) made attempts time out before the server's SETTINGS frame arrived. A daemon that is
# down refuses at once on its socket, so the backoff alone sets how soon the stub tries again.
# How long close() waits for an unreachable daemon to release the grants (a restart takes seconds).
CLOSE_RELEASE_WAIT_S = 5.0
# How long a release (close's, or release() without wait_s) waits when the daemon's Unix socket does not
# exist: the daemon is stopped, not restarting behind a socket that refuses for a moment, and the grants
# are not lost by failing soon (the daemon releases those of a process it sees gone, at its next start
# at the latest), so an application's exit is not held up for ready_wait_s.
ABSENT_SOCKET_WAIT_S = 1.0
# How long request() waits for the daemon to listen and sends a call again that the daemon answered
# "not ready" for (UNAVAILABLE with NOTHING_CHANGED_KEY: e.g. its cold-start model still loading in the
# seconds after it starts): the stub's default `ready_wait_s`, and the CLI's default --wait-s.
NOT_READY_WAIT_S = 10.0
# Before saying that it waits for the daemon to listen: a daemon that listens connects well within it.
LISTEN_NOTICE_AFTER_S = 0.5
NOTHING_CHANGED_KEY = "vgpu-nothing-changed"  # as allocator/service.py sends it
# The largest reply a client takes. gRPC's default (4 MiB) is less than the daemon may send:
# ListApplications lists every claimed id (10,000 anonymous claims of 256-character ids and 4,096
# grants are about 5 MB), and GetAppHistory of every series is up to 56 MiB (256 series of an hour).
MAX_REPLY_BYTES = 128 * 2**20
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
# Each stub has a connection of its own: gRPC shares one among a process's channels with the same
# options, and the daemon bounds the calls open at once on a connection (server.max_streams_per_connection,
# 16), so a process with many stubs, each holding its watch stream, would otherwise wait on its own
# calls. The daemon's per-uid connection bound (server.max_connections_per_uid) counts them.
CHANNEL_OPTIONS = (*RECONNECT_OPTIONS, ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
                   ("grpc.use_local_subchannel_pool", 1))

# The allocation watch is opened again after it ends: at once-ish while the daemon restarts (at most
# about a second between tries, as the channel's reconnect backoff), but at most every 30 s while the
# daemon refuses it (a watcher share used up, a token refused), which a retry does not change soon.
# A watch that lived WATCH_LIVED_S starts the backoff over; one refused at once does not.
WATCH_RETRY_MIN_S = 0.1
WATCH_RETRY_MAX_S = 1.0
WATCH_REFUSED_MAX_S = 30.0
WATCH_LIVED_S = 5.0
_REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)

AUTH_METADATA_KEY = "authorization"  # as vgpu/auth.py: `authorization: Bearer <token>`
APP_TOKEN_TRAILER = "vgpu-app-token"  # the trailer that carries a newly claimed app's token
# as allocator/service.py: the trailer naming the cold-start grant a request was answered with because
# its process already held it for the same job
GRANT_HELD_TRAILER = "vgpu-grant-held"


T = TypeVar("T")


def changed_nothing(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE that the daemon marked as having changed nothing (trailer NOTHING_CHANGED_KEY): the
    same call may be sent again. An UNAVAILABLE without the mark (a connection that broke, a proxy)
    may follow a change the daemon made, so it is not."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not isinstance(exc, grpc.Call):
        return False
    return dict(exc.trailing_metadata() or ()).get(NOTHING_CHANGED_KEY) == "1"


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


def send_when_ready(
    send: Callable[[], T],
    *,
    wait_s: float = NOT_READY_WAIT_S,
    on_wait: Callable[[grpc.RpcError], None] = lambda _exc: None,
    pause: Callable[[float], bool] = _sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`send()`, sent again for up to `wait_s` while the daemon answers that it is not ready and changed
    nothing (`changed_nothing`: a daemon just started, its cold-start model still loading). Any other
    error, or the not-ready answer once `wait_s` is spent, is raised. `on_wait(error)` is called
    before each wait; `pause(seconds)` waits and returns True to stop waiting (the caller is closing),
    which raises the last answer."""
    deadline = clock() + wait_s
    delay_s = 0.2
    while True:
        try:
            return send()
        except grpc.RpcError as exc:
            if not changed_nothing(exc) or clock() + delay_s > deadline:
                raise
            on_wait(exc)
            if pause(delay_s):
                raise
            delay_s = min(delay_s * 2, 1.0)


def grpc_target(address: str) -> str:
    """A gRPC target from `unix:///abs/path`, `unix:rel`, a bare absolute socket path, or `host:port`."""
    address = address.strip()
    if not address:
        raise ValueError(f"empty address: give a Unix socket path ({DEFAULT_SOCKET}) or host:port")
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return address
    if address.startswith("/"):
        return "unix://" + address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}: expected unix:///path/to.sock, /path/to.sock or host:port")
    return address


# --- the daemon's socket, as the node configures it ----------------------------------------------------

SOCKET_ENV = "VGPU_SERVER_SOCKET"  # the configuration's server.socket in the environment (vgpu/config.py)
INAPP_DIR_ENV = "VGPU_SERVER_INAPP_DIR"  # and its server.inapp_dir
# (configuration file, key) pairs already said to be unusable, each said once per process (however many clients)
_config_warned: set[tuple[str, str]] = set()
_config_warned_lock = threading.Lock()


def _config_unusable(path: Path, key: str | None, why: str, default: str, env_var: str, arg: str) -> str:
    """`default`, after saying once per process why the file (`key` None: the whole file, for every
    setting the stub reads from it) or its `server.key` cannot be used."""
    with _config_warned_lock:
        first = (str(path), key or "") not in _config_warned
        _config_warned.add((str(path), key or ""))
    if first:
        what = "the daemon's settings" if key is None else f"the daemon's server.{key}"
        _log.warning(f"cannot take {what} from the configuration file: using the default",
                     config_file=str(path), error=why, **({} if key is None else {"default": default}),
                     fix=f"make the file readable TOML, set {env_var}, or pass {arg}=" if key is not None else
                         "make the file readable TOML, or set the settings in the environment (VGPU_SERVER_*)")
    return default


def _server_setting(key: str, env_var: str, default: str, arg: str, env: Mapping[str, str] | None,
                    config_file: str | Path | None, *, as_path: Callable[[str], str] = lambda v: v) -> str:
    """`[server] key` as the CLI finds it (vgpu/ctl.py, `vgpu.config.load`): `env_var` in `env`
    (default os.environ), else `key` of `config_file` (default /etc/vgpu/vgpu.toml, read when it
    exists), else `default`. Only that key is read, with the standard library's TOML parser: a file
    that cannot be read, is no TOML, or whose value is no absolute path (`as_path` makes the value a
    path first) gives `default`, said once in the log, and never fails the caller (the CLI,
    stricter, refuses such a file with a configuration error). An environment value that is no
    absolute path raises ValueError, as the CLI refuses it."""
    env = os.environ if env is None else env
    given = env.get(env_var)
    if given is not None and given.strip():
        if not os.path.isabs(as_path(given.strip())):
            # as the CLI, which refuses it: an environment the user set is not passed over in silence
            raise ValueError(f"{env_var}={given!r} is not an absolute path: give the daemon's server.{key} as an "
                             f"absolute path, or pass {arg}=")
        return given.strip()
    path = config.DEFAULT_CONFIG_PATH if config_file is None else Path(config_file)

    def unusable(why: str, of_key: bool = False) -> str:
        return _config_unusable(path, key if of_key else None, why, default, env_var, arg)

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        # no file is the usual case (the CLI, too, reads the default file only when it exists);
        # an explicit file that is missing is said
        return default if config_file is None else unusable("no such file")
    except (OSError, UnicodeDecodeError) as exc:
        return unusable(getattr(exc, "strerror", None) or str(exc))
    try:
        server = tomllib.loads(text).get("server", {})
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        return unusable(f"not valid TOML: {exc}")
    value = server.get(key) if isinstance(server, dict) else None
    if value is None:
        return default
    if not isinstance(value, str) or not os.path.isabs(as_path(value)):
        return unusable(f"server.{key} is not an absolute path: {value!r}", of_key=True)
    return value.strip()


def default_socket(env: Mapping[str, str] | None = None, config_file: str | Path | None = None) -> str:
    """The daemon's socket as the CLI finds it: `VGPU_SERVER_SOCKET`, else `server.socket` of
    `config_file` (default /etc/vgpu/vgpu.toml), else DEFAULT_SOCKET (`_server_setting`)."""
    return _server_setting("socket", SOCKET_ENV, DEFAULT_SOCKET, "socket", env, config_file,
                           as_path=config.socket_path)


def default_inapp_dir(env: Mapping[str, str] | None = None, config_file: str | Path | None = None) -> Path:
    """The directory the daemon reads in-app reports from, as it finds it: `VGPU_SERVER_INAPP_DIR`,
    else `server.inapp_dir` of `config_file` (default /etc/vgpu/vgpu.toml), else DEFAULT_INAPP_DIR
    (`_server_setting`): a stub writing anywhere else sends no in-app counters and cannot prove its pid."""
    return Path(_server_setting("inapp_dir", INAPP_DIR_ENV, str(DEFAULT_INAPP_DIR), "inapp_dir", env, config_file))


# --- the application's token (the file itself: vgpu/tokenfile.py) -------------------------------------


def _socket_key(address: str) -> str:
    """The same key for every spelling of one Unix socket (`unix:///p`, `unix:p`, `/p`); host:port as is."""
    address = address.strip()
    if address.startswith("unix:"):
        return os.path.realpath(config.socket_path(address))
    if "/" in address or not address.rpartition(":")[2].isdigit():
        return os.path.realpath(address)
    return address


def token_cache_dir(socket: str, env: Mapping[str, str] | None = None) -> Path:
    """Where this user keeps application tokens for the daemon at `socket`:
    `$XDG_CONFIG_HOME/vgpu/tokens/<hash of the socket>/` (`~/.config/...` without XDG_CONFIG_HOME)."""
    env = os.environ if env is None else env
    base = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME") or "~").expanduser() / ".config")
    return base / "vgpu" / "tokens" / hashlib.sha256(_socket_key(socket).encode()).hexdigest()[:16]


def app_token_path(app_id: str, socket: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The file that keeps `app_id`'s token for the daemon at `socket` (default: `default_socket`, as
    the stub's) (named by a hash of the id, so any id, however long or odd, gives a short, safe file name)."""
    socket = default_socket(env) if socket is None else socket
    return token_cache_dir(socket, env) / (app_id_digest(app_id) + ".token")


# --- in-app counters: the file protocol -------------------------------------------------------------


class InAppFormatError(ValueError):
    """An in-app counter file that is not valid JSON of the expected shape."""


@dataclass(frozen=True)
class InAppCounters:
    """What an application reports from inside; None where it has nothing to say. The PyTorch
    allocator's counters come from `torch.cuda.memory_stats`; a serving engine's (requests running and
    waiting, KV cache in use and its pool, tokens in flight) from `VgpuClient.report_serving`."""

    torch_allocated_mib: float | None = None
    torch_reserved_mib: float | None = None
    torch_active_mib: float | None = None
    alloc_retries: int | None = None
    oom_count: int | None = None
    step: int | None = None
    applied_mem_limit_mib: float | None = None
    requests_running: int | None = None
    requests_waiting: int | None = None
    kv_used_mib: float | None = None
    kv_total_mib: float | None = None
    tokens_in_flight: int | None = None


SERVING_COUNTERS = ("requests_running", "requests_waiting", "kv_used_mib", "kv_total_mib", "tokens_in_flight")


@dataclass(frozen=True)
class InAppReport:
    app_id: str
    pid: int
    # psutil create_time of the writing process (Unix s); None when unknown.
    pid_start_s: float | None
    written_at_s: float
    counters: InAppCounters
    # (counter, why) for each counter of the file that was left out (`inapp_value_problem`)
    dropped: tuple[tuple[str, str], ...] = ()


def inapp_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"{pid}.json"


def make_inapp_dir(directory: str | Path) -> bool:
    """Create the in-app directory itself, mode INAPP_DIR_MODE whatever this process's umask; True when
    this call created it. Never its parents (FileNotFoundError): a missing parent is the daemon's
    runtime directory, which one application must not create with its own owner and umask."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        return False
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:  # the directory just made, not whatever the name may point to by now
        os.fchmod(fd, INAPP_DIR_MODE)
    finally:
        os.close(fd)
    return True


def _not_own(st: os.stat_result, euid: int) -> str | None:
    """Why a file with status `st` (lstat) is not one that a process of `euid` may write its report
    over, or None when it is: a regular file of its own."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != euid:
        return f"owned by uid {st.st_uid}"
    return None


def _create_exclusive(path: Path) -> None:
    """Create `path` empty, failing (FileExistsError) when anything, a dangling symlink included, is there."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))


@dataclass(frozen=True)
class InAppClaim:
    """The file a process writes its reports to, and why the usual name was passed over (None: it was not)."""

    path: Path
    usual_taken: str | None = None


def claim_inapp_path(
    directory: str | Path,
    pid: int,
    *,
    euid: int | None = None,
    token_hex: Callable[[int], str] = secrets.token_hex,
) -> InAppClaim:
    """The name `pid`'s reports go under. The usual one, `<pid>.json`, when it is free or already a
    regular file of this user's (`euid`, default this process's: an earlier report of this process,
    or of an earlier process of the same user with this pid). Anything else there (another user's
    file: a squat, or one left by another user's earlier process with this pid; a symlink, a
    directory, a FIFO) cannot be written over in the sticky directory, so a new name is made,
    `<pid>.<INAPP_TOKEN_BYTES random bytes in hex>.json`, created here at once, empty, with O_EXCL and
    without following a link, so that nobody holds it before this process does (the temporary file
    of the first write would show the name to anyone listing the directory). A reader takes an empty
    report file for one not written yet. OSError when no name can be created."""
    directory = Path(directory)
    euid = os.geteuid() if euid is None else euid
    usual = inapp_path(directory, pid)
    try:
        why = _not_own(os.lstat(usual), euid)
    except FileNotFoundError:
        # Free: the write's rename creates it. Taken before that rename, the rename fails and the
        # caller claims again (VgpuClient.report_now), finding it taken.
        return InAppClaim(usual)
    if why is None:
        return InAppClaim(usual)
    for _ in range(4):  # 128 random bits: a second try means something is very wrong
        path = directory / f"{pid}.{token_hex(INAPP_TOKEN_BYTES)}.json"
        try:
            _create_exclusive(path)
        except FileExistsError:
            continue
        return InAppClaim(path, why)
    raise FileExistsError(errno.EEXIST, "no unused in-app file name after 4 random tries", str(directory))


def write_inapp(directory: str | Path, report: InAppReport, *, path: str | Path | None = None) -> Path:
    """Write `report` atomically (`write_atomically`: a temporary file in the same directory, then a
    rename) to `path` (default `<directory>/<pid>.json`; `claim_inapp_path` says which name a
    process may use), creating the directory when it is missing as `make_inapp_dir` does."""
    directory = Path(directory)
    if not directory.is_dir():
        make_inapp_dir(directory)
    payload = {
        "v": INAPP_VERSION,
        "app_id": report.app_id,
        "pid": report.pid,
        "pid_start_s": report.pid_start_s,
        "written_at_s": report.written_at_s,
        "counters": {k: v for k, v in asdict(report.counters).items() if v is not None},
    }
    target = inapp_path(directory, report.pid) if path is None else Path(path)
    write_atomically(target, json.dumps(payload, separators=(",", ":")).encode("utf-8"), 0o644)
    return target


def parse_inapp(text: str) -> InAppReport:
    """Parse an in-app file's text; InAppFormatError with the reason when it is not one."""
    try:
        data = json.loads(text)
    except RecursionError:  # arrays nested thousands deep: within the size cap, beyond the decoder
        raise InAppFormatError("not JSON: nested too deep") from None
    except ValueError as exc:  # not JSON, or an integer of more digits than Python converts (4,300)
        raise InAppFormatError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InAppFormatError("not a JSON object")
    if data.get("v") != INAPP_VERSION:
        raise InAppFormatError(f"unknown version {data.get('v')!r} (expected {INAPP_VERSION})")
    app_id, pid, written = data.get("app_id"), data.get("pid"), data.get("written_at_s")
    if not isinstance(app_id, str) or not app_id:
        raise InAppFormatError("app_id missing or not a string")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise InAppFormatError("pid missing or not a positive integer")
    written_at_s = float(written) if _is_number(written) else None
    if written_at_s is None:
        raise InAppFormatError("written_at_s missing or not a number")
    start = data.get("pid_start_s")
    if start is not None and not _is_number(start):
        raise InAppFormatError("pid_start_s not a number")
    raw = data.get("counters", {})
    if not isinstance(raw, dict):
        raise InAppFormatError("counters not an object")
    # A counter that is no usable value is left out, with its reason, and the rest of the report
    # kept: one bad counter (an engine's metric gone wrong) costs only itself.
    values: dict[str, Any] = {}
    dropped: list[tuple[str, str]] = []
    for f in fields(InAppCounters):
        v = raw.get(f.name)
        if v is None:
            continue
        problem = inapp_value_problem(f.name, v)
        if problem is not None:
            dropped.append((f.name, problem))
            continue
        values[f.name] = int(v) if f.name in INT_COUNTERS else float(v)
    return InAppReport(
        app_id=app_id,
        pid=pid,
        pid_start_s=None if start is None else float(start),
        written_at_s=written_at_s,
        counters=InAppCounters(**values),
        dropped=tuple(dropped),
    )


def read_inapp_file(path: str | Path) -> tuple[str, os.stat_result]:
    """The text of an in-app file and its status, read through one descriptor. The directory is
    writable by every user, so anything may lie under a process's name: the file is opened without
    following a symlink (one to /dev/zero would read without end) and without waiting (a FIFO would
    hold the reader until some writer came), and must be a regular file of at most MAX_INAPP_FILE_BYTES;
    anything else raises InAppFormatError. FileNotFoundError (or NotADirectoryError) when absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InAppFormatError("a symbolic link, not a file the client stub wrote") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InAppFormatError("not a regular file")
        data = os.read(fd, MAX_INAPP_FILE_BYTES + 1) if st.st_size <= MAX_INAPP_FILE_BYTES else b""
        if st.st_size > MAX_INAPP_FILE_BYTES or len(data) > MAX_INAPP_FILE_BYTES:
            raise InAppFormatError(f"larger than {MAX_INAPP_FILE_BYTES} bytes, the most an in-app file may hold")
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8"), st
    except UnicodeDecodeError as exc:
        raise InAppFormatError(f"not UTF-8: {exc}") from exc


def read_inapp(
    directory: str | Path,
    pid: int,
    *,
    now_s: float,
    pid_start_s: float | None = None,
    max_age_s: float = INAPP_MAX_AGE_S,
) -> InAppReport | None:
    """The fresh report of `pid`, or None when there is none, it is older than `max_age_s`, or it was
    written by an earlier process with the same pid. A malformed file (or a symlink, a FIFO, anything
    but a regular file of at most MAX_INAPP_FILE_BYTES: `read_inapp_file`) raises InAppFormatError."""
    try:
        text, _ = read_inapp_file(inapp_path(directory, pid))
    except (FileNotFoundError, NotADirectoryError):
        return None
    report = parse_inapp(text)
    if report.pid != pid:
        raise InAppFormatError(f"file for pid {pid} names pid {report.pid}")
    if now_s - report.written_at_s > max_age_s:
        return None
    if (
        pid_start_s is not None
        and report.pid_start_s is not None
        and abs(report.pid_start_s - pid_start_s) > PID_START_TOLERANCE_S
    ):
        return None
    return report


class InAppFinder:
    """Where each process's in-app report may be: its usual name, `<pid>.json`, and the names
    `<pid>.<token>.json` (`claim_inapp_path`) of that pid found by scanning the directory. A name
    cannot be guessed, so it is found by listing; the directory is every user's, so the listing is
    bounded: one `scan` reads at most `scan_entries` entries (a directory that holds more is read over
    several scans, each going on where the last stopped, so every name is found within
    entries / scan_entries scans), looks at the status (lstat, no link followed) only of names of
    the pids asked for, and keeps, for each pid, at most `names_per_pid` of them: regular files owned
    by one of that pid's owners, the newest by modification time. Another user's files under a
    process's pid are passed over at the scan, and names kept for an earlier owner of the pid dropped
    when a name of the new owner's is found, so they cannot push the process's own out. At most
    `max_pids` pids are remembered (the oldest forgotten first). Thread-safe."""

    def __init__(
        self,
        directory: str | Path,
        *,
        scan_entries: int = MAX_INAPP_SCAN_ENTRIES,
        names_per_pid: int = MAX_INAPP_NAMES_PER_PID,
        max_pids: int = MAX_INAPP_FINDER_PIDS,
    ) -> None:
        if scan_entries < 1 or names_per_pid < 1 or max_pids < 1:
            raise ValueError("scan_entries, names_per_pid and max_pids must be >= 1")
        self.directory = Path(directory)
        self._scan_entries = scan_entries
        self._names_per_pid = names_per_pid
        self._max_pids = max_pids
        self._lock = threading.Lock()
        self._entries: Iterator[os.DirEntry[str]] | None = None
        # pid -> file name -> (modification time, owner uid)
        self._known: dict[int, dict[str, tuple[float, int]]] = {}
        # what the scans cost: directory entries read, files whose status was read, whole passes
        self.entries_read = 0
        self.stats_read = 0
        self.passes = 0

    def paths(self, pid: int) -> list[Path]:
        """The usual name of `pid`, then the names found for it, newest first."""
        with self._lock:
            names = sorted(self._known.get(pid, {}).items(), key=lambda kv: -kv[1][0])
        return [inapp_path(self.directory, pid), *(self.directory / name for name, _ in names)]

    def scan(self, wanted: Mapping[int, Collection[int] | None]) -> None:
        """Read the next at most `scan_entries` directory entries, keeping the report names of the
        pids in `wanted` whose owner is one of `wanted[pid]` (None: any owner). OSError when the
        directory cannot be listed (FileNotFoundError: there is none yet)."""
        with self._lock:
            fresh = self._entries is None
            if self._entries is None:
                self._entries = os.scandir(self.directory)
            entries, read = self._entries, 0
            try:
                while read < self._scan_entries:
                    entry = next(entries, None)
                    if entry is None:
                        self._end_pass()
                        if read == 0 and not fresh:
                            # the last scan stopped on the directory's last entry: start the next
                            # pass now rather than spend this scan on reading the end alone
                            fresh = True
                            self._entries = entries = os.scandir(self.directory)
                            continue
                        break
                    read += 1
                    match = _INAPP_FALLBACK_NAME.fullmatch(entry.name)
                    if match is None or int(match.group(1)) not in wanted:
                        continue
                    pid = int(match.group(1))
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    self.stats_read += 1
                    owners = wanted[pid]
                    if stat.S_ISREG(st.st_mode) and (owners is None or st.st_uid in owners):
                        self._keep(pid, entry.name, st.st_mtime, st.st_uid, owners)
            except OSError:
                self._end_pass()
                raise
            finally:
                self.entries_read += read

    def forget(self, pid: int, path: Path | None = None) -> None:
        """Forget one name of `pid` (a file that is gone), or all of them. A name never found by a scan
        (the usual `<pid>.json`) changes nothing."""
        with self._lock:
            names = self._known.get(pid)
            if names is not None and path is not None:
                names.pop(path.name, None)
            if names is not None and (path is None or not names):
                del self._known[pid]

    def retain(self, pids: Collection[int]) -> None:
        """Forget the names of every pid not in `pids` (processes that are gone)."""
        with self._lock:
            for pid in [p for p in self._known if p not in pids]:
                del self._known[pid]

    def close(self) -> None:
        with self._lock:
            self._end_pass()

    def _end_pass(self) -> None:
        if self._entries is not None:
            close = getattr(self._entries, "close", None)
            if close is not None:
                close()
            self._entries = None
            self.passes += 1

    def _keep(self, pid: int, name: str, mtime: float, uid: int, owners: Collection[int] | None) -> None:
        names = self._known.get(pid)
        if names is None:
            if len(self._known) >= self._max_pids:
                del self._known[next(iter(self._known))]
            names = self._known[pid] = {}
        elif owners is not None:
            # names kept while the pid was another user's process (pid reuse) are not this one's: with
            # mtimes their owner set at will, they would push this process's own out of the bound
            for other in [n for n, (_, u) in names.items() if u not in owners]:
                del names[other]
        names[name] = (mtime, uid)
        if len(names) > self._names_per_pid:
            del names[min(names, key=lambda n: names[n][0])]


@dataclass(frozen=True)
class InAppFound:
    """What `read_inapp_reports` found for one pid: the usable reports, newest first, and what was
    passed over, each as (kind, file name, why), kind one of "owner" (owned by nobody allowed),
    "malformed" (InAppFormatError) or "error" (an OSError reading it)."""

    reports: tuple[InAppReport, ...] = ()
    skipped: tuple[tuple[str, str, str], ...] = ()


def read_inapp_reports(
    paths: Iterable[Path],
    pid: int,
    *,
    now_s: float,
    pid_start_s: float | None = None,
    owners: Collection[int] | None = None,
    max_age_s: float = INAPP_MAX_AGE_S,
    gone: Callable[[Path], None] = lambda _path: None,
) -> InAppFound:
    """The fresh reports of `pid` among `paths` (`InAppFinder.paths`): each read as `read_inapp_file`
    does (no link followed, no waiting, capped), owned by one of `owners` (None: anyone), not empty
    (a name claimed and not yet written), naming `pid`, no older than `max_age_s` and, where both
    are known, written by a process that started at `pid_start_s`. `gone(path)` is called for each
    path that no longer exists."""
    reports: list[InAppReport] = []
    skipped: list[tuple[str, str, str]] = []
    for path in paths:
        try:
            text, st = read_inapp_file(path)
        except (FileNotFoundError, NotADirectoryError):
            gone(path)
            continue
        except InAppFormatError as exc:
            skipped.append(("malformed", path.name, str(exc)))
            continue
        except OSError as exc:
            skipped.append(("error", path.name, exc.strerror or str(exc)))
            continue
        if owners is not None and st.st_uid not in owners:
            skipped.append(("owner", path.name, f"owned by uid {st.st_uid}"))
            continue
        if not text:
            continue
        try:
            report = parse_inapp(text)
            if report.pid != pid:
                raise InAppFormatError(f"file for pid {pid} names pid {report.pid}")
        except InAppFormatError as exc:
            skipped.append(("malformed", path.name, str(exc)))
            continue
        if now_s - report.written_at_s > max_age_s:
            continue
        if (pid_start_s is not None and report.pid_start_s is not None
                and abs(report.pid_start_s - pid_start_s) > PID_START_TOLERANCE_S):
            continue
        reports.append(report)
    reports.sort(key=lambda r: -r.written_at_s)
    return InAppFound(tuple(reports), tuple(skipped))


def _is_number(v: object) -> TypeGuard[int | float]:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    # an int of more digits than a double holds (JSON allows any) would raise OverflowError as a float
    return abs(v) <= sys.float_info.max if isinstance(v, int) else math.isfinite(v)


# --- a serving engine's counters -----------------------------------------------------------------------


@dataclass(frozen=True)
class ServingCounters:
    """What a serving engine knows about its own load, the leading signals of its memory and compute:
    requests running (being prefilled or decoded) and waiting for admission, the KV cache in use and
    its pool (MiB), and the tokens the running requests hold. None where the engine does not say."""

    requests_running: int | None = None
    requests_waiting: int | None = None
    kv_used_mib: float | None = None
    kv_total_mib: float | None = None
    tokens_in_flight: int | None = None

    def problems(self) -> list[str]:
        """`counter: why` for each value that is no usable counter value (`inapp_value_problem`)."""
        out = []
        for name in SERVING_COUNTERS:
            v = getattr(self, name)
            why = None if v is None else inapp_value_problem(name, v)
            if why is None and name in INT_COUNTERS and isinstance(v, float) and not v.is_integer():
                why = "not a whole number"  # a count of requests or tokens (sent as an integer)
            if why is not None:
                out.append(f"{name}: {why} ({v!r})")
        if not out and self.kv_used_mib is not None and self.kv_total_mib is not None \
                and self.kv_used_mib > self.kv_total_mib * (1 + 1e-9):
            out.append(f"kv_used_mib: {self.kv_used_mib:g} is more than the pool, kv_total_mib {self.kv_total_mib:g}")
        return out


@dataclass(frozen=True)
class ServingScrape:
    """What `serving_counters_from_metrics` read: the counters, which engine's metrics they were
    ("vllm", "sglang", or None when the text has neither), the KV cache in use as a fraction of its pool
    as the engine reports it, and the metrics that were present but unusable, with the reason."""

    counters: ServingCounters
    engine: str | None
    kv_used_frac: float | None
    skipped: tuple[str, ...] = ()


# Prometheus metric names of the engines (their /metrics text): requests running, requests waiting,
# the KV cache in use as a fraction of the pool (0-1; both vLLM names, the older first), tokens held.
_ENGINE_METRICS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_frac": ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        "tokens": (),
    },
    "sglang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_frac": ("sglang:token_usage",),
        "tokens": ("sglang:num_used_tokens",),
    },
}


def serving_counters_from_metrics(
    text: str, *, kv_total_mib: float | None = None, labels: Mapping[str, str] | None = None
) -> ServingScrape:
    """A vLLM or SGLang server's Prometheus `/metrics` text as serving counters, parsed with
    prometheus_client's text parser.

    vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:gpu_cache_usage_perc` (or
    `vllm:kv_cache_usage_perc`). SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
    `sglang:token_usage`, `sglang:num_used_tokens` (tokens in flight). The engines report the KV cache
    as a fraction of its pool, not in MiB: give the pool's size as `kv_total_mib` (what the engine
    logs at start, e.g. vLLM's "KV cache size" / "# GPU blocks" times the block's bytes) to get
    `kv_used_mib` and `kv_total_mib`; without it only `kv_used_frac` is filled. `labels` keeps only
    the samples with those label values (one engine of several, e.g. {"model_name": "m"}); the
    samples left are summed (requests, tokens) or averaged (fractions). ValueError when the text is
    not Prometheus text or `kv_total_mib` is no usable pool size."""
    from prometheus_client.parser import text_string_to_metric_families

    if kv_total_mib is not None and (inapp_value_problem("kv_total_mib", kv_total_mib) or not kv_total_mib > 0):
        raise ValueError(f"kv_total_mib must be a positive number of MiB, got {kv_total_mib!r}")
    want = dict(labels or {})
    found: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if all(sample.labels.get(k) == v for k, v in want.items()):
                    found.setdefault(sample.name, []).append(float(sample.value))
    except (ValueError, TypeError, IndexError) as exc:  # the parser's errors on malformed text
        raise ValueError(f"not Prometheus text format: {exc}") from exc
    engine = next((e for e, names in _ENGINE_METRICS.items()
                   if any(n in found for group in names.values() for n in group)), None)
    if engine is None:
        return ServingScrape(ServingCounters(), None, None)
    names = _ENGINE_METRICS[engine]
    skipped: list[str] = []

    def first(group: str) -> tuple[str, list[float]] | None:
        for name in names[group]:
            if name in found:
                return name, found[name]
        return None

    def count(group: str, counter: str) -> int | None:
        hit = first(group)
        if hit is None:
            return None
        total = sum(hit[1])
        why = inapp_value_problem(counter, total)
        if why is not None:
            skipped.append(f"{hit[0]}: {why}")
            return None
        return int(round(total))

    frac: float | None = None
    hit = first("kv_frac")
    if hit is not None:
        mean = sum(hit[1]) / len(hit[1])
        if math.isfinite(mean) and 0.0 <= mean <= 1.0:
            frac = mean
        else:
            skipped.append(f"{hit[0]}: not a fraction in 0-1 ({mean!r})")
    counters = ServingCounters(
        requests_running=count("running", "requests_running"),
        requests_waiting=count("waiting", "requests_waiting"),
        kv_used_mib=None if frac is None or kv_total_mib is None else frac * kv_total_mib,
        kv_total_mib=None if kv_total_mib is None else float(kv_total_mib),
        tokens_in_flight=count("tokens", "tokens_in_flight"),
    )
    return ServingScrape(counters, engine, frac, tuple(skipped))


def scrape_serving_metrics(
    url: str, *, kv_total_mib: float | None = None, labels: Mapping[str, str] | None = None, timeout_s: float = 2.0,
) -> ServingScrape:
    """`serving_counters_from_metrics` of the text at `url` (an engine's `http://host:port/metrics`).
    OSError when it cannot be fetched, ValueError when it is not Prometheus text."""
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"expected an http(s) URL of a /metrics endpoint, got {url!r}")
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - scheme checked above
        text = resp.read(16 * 2**20).decode("utf-8", errors="replace")
    return serving_counters_from_metrics(text, kv_total_mib=kv_total_mib, labels=labels)


# --- the client --------------------------------------------------------------------------------------

_FROM_SYS_MODULES: Any = object()


class GrantList(list[allocator_pb2.Grant]):
    """`VgpuClient.grants`: the grants held when it was read, a plain list. Calling it, the spelling
    of the time `grants` was a method (`client.grants()`), still works: it returns a copy of the list
    and warns (DeprecationWarning)."""

    def __call__(self) -> list[allocator_pb2.Grant]:
        warnings.warn("VgpuClient.grants is a property now, like granted_memory_mib: write client.grants, "
                      "not client.grants()", DeprecationWarning, stacklevel=2)
        return list(self)


def is_device_index(text: str) -> bool:
    """Whether a device flag names a GPU by its index (IDX in `vgpu available`, GPU in `vgpu apps`)
    rather than by a GPU or MIG UUID."""
    return re.fullmatch(r"[0-9]{1,9}", text) is not None


def device_of_index(devices: allocator_pb2.GetAvailableResourcesResponse, text: str) -> str:
    """The UUID of the GPU whose index is `text`, from the daemon's GetAvailableResources answer;
    LookupError naming the GPUs it has when none has that index. Shared by every command that takes
    a device flag (`--device`, `vgpu profiler --device-id`)."""
    for d in devices.devices:
        if d.index == int(text):
            return str(d.device_id)
    known = ", ".join(f"{d.index} ({d.device_id})" for d in devices.devices) or "none"
    raise LookupError(f"no GPU with index {text} on this daemon (its GPUs: {known})")


def _checked_job(job: object, where: str) -> JobConfig | allocator_pb2.JobConfig | None:
    """`job` when it is a job (vgpu.jobs.JobConfig or the proto message) or None; else TypeError
    saying what to pass, at once rather than as an AttributeError at the first request."""
    if job is None or isinstance(job, JobConfig | allocator_pb2.JobConfig):
        return job
    raise TypeError(f"{where}: expected a vgpu.jobs.JobConfig (from vgpu.jobs import JobConfig; "
                    f"JobConfig(model_type='resnet50', batch_size=64)), got {type(job).__name__} {job!r:.80}")


def _job_config(job: JobConfig | allocator_pb2.JobConfig | None) -> JobConfig | None:
    """`job` as a JobConfig; None for none, or for a proto message that is no valid job (the daemon
    answers that one INVALID_ARGUMENT with the reason)."""
    if job is None or isinstance(job, JobConfig):
        return job
    try:
        return JobConfig.from_proto(job)
    except InvalidJobConfig:
        return None


def _refused_pid(exc: grpc.RpcError) -> bool:
    """Whether the daemon refused a request for the pid it named (vgpu/auth.py `_pid_refusal`)."""
    return bool(exc.code() == grpc.StatusCode.PERMISSION_DENIED and "name process" in (exc.details() or ""))


class ClientClosedError(RuntimeError):
    """A call that would reach the daemon or write the in-app report, made after `VgpuClient.close()`."""


class _ReportFile:
    """This process's in-app report file: its name once claimed, and whether reporting has ended.
    Shared by the client and its finalizer (`weakref.finalize`), which removes the file when the
    client is collected or the interpreter exits without `close()`; holds no reference to the client."""

    def __init__(self, owner_pid: int) -> None:
        self.lock = threading.Lock()  # held while the name is claimed and the file written
        self.path: Path | None = None
        self.named_pid = 0  # the pid the file at `path` names
        self.ended = False
        # The process that made the client: a child forked from it inherits the finalizer, and must
        # not remove the parent's file when it exits.
        self.owner_pid = owner_pid

    def end(self) -> None:
        """No report is written from now on, and the one written is removed (this process's own only:
        a file of another user's under the usual name was never claimed)."""
        with self.lock:
            self.ended = True
            path, self.path = self.path, None
        if path is None or os.getpid() != self.owner_pid:
            return
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("cannot remove in-app file", path=str(path), error=str(exc))


class VgpuClient:
    """One application's link to vgpu. Thread-safe; `close()` (or a `with` block) ends it.

    Arguments beyond `app_id` are optional: `socket` is the daemon's address (Unix socket path or
    host:port; by default the node's, found as the CLI finds it: `VGPU_SERVER_SOCKET`, else
    `server.socket` of `config_file`, default /etc/vgpu/vgpu.toml, else /run/vgpu/vgpu.sock:
    `default_socket`), `job` the job's configuration (`vgpu.jobs.JobConfig` or the proto message,
    anything else a TypeError; with `request()` and no memory_mib the daemon's cold-start model
    sizes the grant from it, while a memory_mib given is granted as asked), `inapp_dir`
    where in-app counters go (by default the node's, found as the socket is: `VGPU_SERVER_INAPP_DIR`,
    else `server.inapp_dir` of `config_file`, else /run/vgpu/inapp: `default_inapp_dir`; the
    profiler's `--inapp-dir` and the daemon's `server.inapp_dir` must
    be the same directory: the daemon reads this process's report there as the proof of its pid,
    and refuses a request naming a pid it cannot verify), `token` / `token_file` the application's identity (module docstring,
    "Identity"; `env` stands in for os.environ when finding the default socket and token file). `channel`,
    `torch_module`, `clock`, `pid` and `sleep` exist for tests. `ready_wait_s` is how long `request()`
    and `release()` wait for a daemon that does not listen yet, or answers that it is not ready, before
    failing with UNAVAILABLE (0: at once; as the CLI's `--wait-s`). `serving_max_age_s` is how long a
    `report_serving` stays in the reports. `on_event` is called, on the watch thread, with each
    `AllocationEvent` of this process's own grants after the stub has applied it (GRANTED, RESIZED
    with `detail` saying why, e.g. "reclaimed for ...", RELEASED, LIMITS_CHANGED); an exception it
    raises is logged and does not stop the watch. `watch=False` / `report=False` turn the
    background threads off. A token file that holds no token raises TokenFileError naming it.
    """

    def __init__(
        self,
        app_id: str,
        *,
        socket: str | None = None,
        job: JobConfig | allocator_pb2.JobConfig | None = None,
        inapp_dir: str | Path | None = None,
        report_period_s: float = 1.0,
        watch: bool = True,
        report: bool = True,
        torch_device: int | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        rpc_timeout_s: float = 10.0,
        channel: grpc.Channel | None = None,
        torch_module: ModuleType | None = _FROM_SYS_MODULES,
        clock: Callable[[], float] = time.time,
        pid: int | None = None,
        pid_start_s: float | None = None,
        rng: random.Random | None = None,
        token: str | None = None,
        token_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        serving_max_age_s: float = INAPP_MAX_AGE_S,
        ready_wait_s: float = NOT_READY_WAIT_S,
        on_event: Callable[[allocator_pb2.AllocationEvent], None] | None = None,
        config_file: str | Path | None = None,
    ) -> None:
        if not app_id or not app_id.strip():
            raise ValueError("app_id must be a non-empty string")
        if not (math.isfinite(ready_wait_s) and ready_wait_s >= 0):
            raise ValueError(f"ready_wait_s must be a finite number >= 0, got {ready_wait_s}")
        if report_period_s <= 0:
            raise ValueError(f"report_period_s must be positive, got {report_period_s}")
        self.app_id = app_id
        self.job = _checked_job(job, "VgpuClient(job=...)")
        socket = default_socket(env, config_file) if socket is None else socket
        self._on_event = on_event
        self.inapp_dir = default_inapp_dir(env, config_file) if inapp_dir is None else Path(inapp_dir)
        self._report_period_s = report_period_s
        self._torch_device = torch_device
        self._metadata = tuple(metadata)
        self._timeout_s = rpc_timeout_s
        self._ready_wait_s = ready_wait_s
        self._socket = socket
        self._torch_arg = torch_module
        self._clock = clock
        self.pid = os.getpid() if pid is None else pid
        self._pid_start_s = pid_start_s if pid_start_s is not None else _own_start_time(self.pid)
        # This process's pid as the daemon names it: in a container's pid namespace the daemon turns
        # the pid a request names into its own (vgpu.peers.pid_here), learnt from the first reply.
        self._daemon_pid = self.pid
        self._unproven_pid = False  # the last request named the pid without an in-app report to prove it
        self._rng = rng or random.Random()
        self.token_file = Path(token_file) if token_file is not None else app_token_path(app_id, socket, env)
        self._token: str | None = (
            check_token(token, "the token argument") if token is not None else read_token(self.token_file)
        )
        self._token_from_file = token is None and self._token is not None
        self._own_channel = channel is None
        self._channel = (channel if channel is not None
                         else grpc.insecure_channel(grpc_target(socket), options=CHANNEL_OPTIONS))
        self._stub = allocator_pb2_grpc.AllocatorStub(self._channel)

        self._lock = threading.Lock()
        self._apply_lock = threading.Lock()
        # The report's file name, claimed at the first write; removed by close(), or at the latest
        # when the client is collected or the interpreter exits (an application that never closes).
        self._report_file = _ReportFile(os.getpid())
        self._report_finalizer = weakref.finalize(self, self._report_file.end)
        self._target_mib: float | None = None
        self._grants: dict[str, allocator_pb2.Grant] = {}
        self._grants_changes = 0  # counts changes to `_grants`, so a catch-up knows it read a stale list
        self._step = 0
        self._applied_limit_mib: float | None = None
        self._mem_limit_kind = ""
        self._serving: ServingCounters | None = None
        self._serving_at_s = -math.inf
        self._serving_max_age_s = serving_max_age_s
        self._warned: set[str] = set()
        self._closed = threading.Event()
        self._watch_call: Any = None
        self.limit_changes = 0  # how many times a different limit was applied
        self.watch_errors = 0
        self._watch_failing = False  # the last watch ended in an error and none has opened since
        self.report_errors = 0

        self._threads: list[threading.Thread] = []
        if report:
            self._ensure_inapp_dir()
        if watch:
            self._start(self._watch_loop, "vgpu-client-watch")
        if report:
            self._start(self._report_loop, "vgpu-client-report")

    # --- API -----------------------------------------------------------------------------------------
    def request(
        self,
        *,
        memory_mib: float = 0.0,
        sm_pct: float = 0.0,
        priority: int = 0,
        job: JobConfig | allocator_pb2.JobConfig | None = None,
        device_id: str = "",
        deadline_s: float = 0.0,
        critical: bool = False,
    ) -> allocator_pb2.Grant:
        """Ask for resources; the allocator's grant, or grpc.RpcError (RESOURCE_EXHAUSTED when it does
        not fit, INVALID_ARGUMENT on bad values). The granted memory is applied at once.
        ClientClosedError after `close()`."""
        self._check_open("request")
        for name, value in (("memory_mib", memory_mib), ("sm_pct", sm_pct)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
            raise ValueError(f"priority must be a whole number within -2**31..2**31-1 (a 32-bit integer; "
                             f"lower yields first under contention), got {priority!r}")
        if memory_mib < 0 or not math.isfinite(memory_mib):
            raise ValueError(f"memory_mib must be a non-negative number, got {memory_mib}")
        if not 0 <= sm_pct <= 100:
            raise ValueError(f"sm_pct must be within 0-100, got {sm_pct}")
        job = _checked_job(job, "request(job=...)") if job is not None else self.job
        if job is None and memory_mib == 0 and sm_pct == 0:
            # nothing to size and nothing asked: the daemon would grant 0 MiB, which no job wants
            raise ValueError("request() asks for nothing: give memory_mib (and/or sm_pct), or a job "
                             "(VgpuClient(..., job=JobConfig(...)) or request(job=...)) to have it sized")
        if job is not None and job.model_type and not job.param_count and known_model(job.model_type) is None:
            # a model of one's own is sized all the same (from its parameter count, when given: then
            # the name is the application's own and nothing is said); a typo should not pass unnoticed
            self._warn_once(f"unknown_model:{job.model_type}",
                            unknown_model_note(job.model_type, param_count_arg="JobConfig(param_count=...)"))
        config_job = _job_config(job)
        said = config_job.optimizer_note() if config_job is not None and memory_mib == 0 else None
        if said is not None and config_job is not None:
            # sized all the same, as with no optimizer given; a typo should not pass unnoticed
            self._warn_once(f"unknown_optimizer:{config_job.optimizer}", said)
        if job is not None and memory_mib > 0:
            # the daemon sizes a job only for a request of memory_mib 0: given both, the job is sent
            # (and kept with the grant) but the grant is memory_mib
            self._warn_once("job_not_sized", "the job is not sized: memory_mib given", memory_mib=memory_mib,
                            fix="call request() without memory_mib to have the job's cold-start size granted")
        req = allocator_pb2.ResourceRequest(
            app_id=self.app_id,
            device_id=device_id,
            memory_mib=memory_mib,
            sm_pct=sm_pct,
            priority=priority,
            deadline_s=deadline_s,
            critical=critical,
            pid=self._provable_pid(),
        )
        if job is not None:
            req.job.CopyFrom(job.to_proto() if isinstance(job, JobConfig) else job)
        message = allocator_pb2.RequestResourceAllocationRequest(request=req)
        try:
            try:
                resp, call = self._request_when_ready(message)
            except grpc.RpcError as exc:
                if not (req.pid and self._unproven_pid and _refused_pid(exc)):
                    raise
                # the daemon cannot tell this caller's user (its socket front off) and no report proves
                # the pid: the grant without it, as over TCP
                self._warn_once("pid_refused", "the daemon did not take this process's pid without its in-app "
                                "report: the grant names no process", inapp_dir=str(self.inapp_dir))
                req.pid = message.request.pid = 0  # (the message holds a copy of req)
                resp, call = self._request_when_ready(message)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED and self._token_from_file:
                # A token from another key (the daemon's secret was replaced): drop it, claim anew.
                _log.warning("stored application token refused; claiming the id again",
                             app_id=self.app_id, token_file=str(self.token_file), reason=exc.details())
                with self._lock:
                    self._token, self._token_from_file = None, False
                self.token_file.unlink(missing_ok=True)
                resp, call = self._stub.RequestResourceAllocation.with_call(
                    message, timeout=self._timeout_s, metadata=self._call_metadata()
                )
            else:
                if req.pid and _refused_pid(exc):
                    # A daemon that cannot tell the caller's uid (its socket front off, or TCP) takes
                    # this process's pid only on its in-app report, read from the daemon's own
                    # server.inapp_dir: a stub writing elsewhere is refused for that.
                    self._warn_once("pid_proof", "the daemon could not verify this process's pid",
                                    inapp_dir=str(self.inapp_dir),
                                    fix="give the stub the daemon's server.inapp_dir (default /run/vgpu/inapp) "
                                        "as inapp_dir=, or leave it at the default")
                elif exc.code() == grpc.StatusCode.PERMISSION_DENIED and self._token is None:
                    self._warn_once("no_token", "application id taken and no token for it here",
                                    token_file=str(self.token_file),
                                    fix="run with the token file of the first run, pass token= (the daemon keeps a "
                                        f"copy: <state-dir>/tokens/apps/{app_id_digest(self.app_id)}.token, "
                                        "readable by its operator), or use another app_id")
                elif exc.code() == grpc.StatusCode.UNAVAILABLE:
                    # gRPC's own text names the socket and the errno but not what to do about it
                    _log.warning("cannot reach the vgpu daemon", app_id=self.app_id, socket=self._socket,
                                 waited_s=self._ready_wait_s,
                                 fix="is vgpu-manager running (`systemctl status vgpu-manager`), is this the "
                                     "daemon's socket (socket=), and may this user open it? ready_wait_s= "
                                     "waits longer for a daemon that is starting")
                raise
        self._keep_token(call)
        if dict(call.trailing_metadata() or ()).get(GRANT_HELD_TRAILER) == resp.grant.grant_id:
            # the daemon answered with the cold-start grant this process already holds for this job
            self._warn_once(f"held:{resp.grant.grant_id}", "this process already holds a cold-start grant for this "
                            "job: the daemon answered with it, and no second grant was made",
                            grant=resp.grant.grant_id, memory_mib=round(resp.grant.memory_mib))
        if req.pid == self.pid and resp.grant.pid:
            with self._lock:
                self._daemon_pid = resp.grant.pid
        self._on_grant(resp.grant, released=False)
        if resp.mem_limit in ("hard", "cooperative") and self._kind_is_for_here(resp.grant.device_id):
            # Known from the reply itself: an event may come later, or not at all.
            with self._lock:
                self._mem_limit_kind = resp.mem_limit
        return resp.grant

    def _wait_until_listening(self, wait_s: float, *, notice: bool = True) -> None:
        """Wait up to `wait_s` for the daemon to listen on its socket: a health check sent with gRPC's
        `wait_for_ready`, which goes out only once the connection is up (it reads nothing and changes
        nothing, so the call that follows is sent once, as without the wait). Any answer means the
        daemon listens. When it does not listen in time this returns all the same, and the call that
        follows fails with UNAVAILABLE and the reason (no socket, refused, no permission). `notice`:
        say (once) that it waits, when it has waited LISTEN_NOTICE_AFTER_S."""
        if wait_s <= 0:
            return
        check = health_pb2_grpc.HealthStub(self._channel).Check  # type: ignore[attr-defined]

        def listens(timeout_s: float) -> bool:
            try:
                check(health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True)
            except grpc.RpcError as exc:
                return bool(exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED)
            return True

        if listens(min(wait_s, LISTEN_NOTICE_AFTER_S)) or wait_s <= LISTEN_NOTICE_AFTER_S:
            return
        if not notice:
            listens(wait_s - LISTEN_NOTICE_AFTER_S)
            return
        self._warn_once("not_listening", f"the daemon does not listen yet; waiting up to {wait_s:g} s (ready_wait_s)",
                        socket=self._socket)
        if listens(wait_s - LISTEN_NOTICE_AFTER_S):
            _log.info("the daemon listens; sending", app_id=self.app_id, socket=self._socket)

    def _request_when_ready(
        self, message: allocator_pb2.RequestResourceAllocationRequest
    ) -> tuple[allocator_pb2.RequestResourceAllocationResponse, Any]:
        """RequestResourceAllocation once the daemon listens (`_wait_until_listening`), sent again while
        the daemon answers that it is not ready and changed nothing (a daemon just started: its
        cold-start model loads in the seconds after it serves), both within `ready_wait_s`. Any other
        error, or one that may have changed something, is raised at once."""
        deadline = time.monotonic() + self._ready_wait_s
        self._wait_until_listening(self._ready_wait_s)
        def send() -> tuple[allocator_pb2.RequestResourceAllocationResponse, Any]:
            answer: tuple[allocator_pb2.RequestResourceAllocationResponse, Any] = (
                self._stub.RequestResourceAllocation.with_call(
                    message, timeout=self._timeout_s, metadata=self._call_metadata()))
            return answer

        def waiting(exc: grpc.RpcError) -> None:
            self._warn_once("not_ready", "the daemon is not ready yet; asking again", reason=exc.details())

        return send_when_ready(send, wait_s=max(0.0, deadline - time.monotonic()), on_wait=waiting,
                               pause=self._closed.wait)

    @property
    def token(self) -> str | None:
        """The application's token (None until the first grant of a new app id)."""
        with self._lock:
            return self._token

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        with self._lock:
            token = self._token
        bearer = ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        return self._metadata + bearer

    def _keep_token(self, call: Any) -> None:
        """Keep the token a first grant came back with, in memory and in `token_file`."""
        trailers = dict(call.trailing_metadata() or ())
        token = trailers.get(APP_TOKEN_TRAILER)
        if not isinstance(token, str) or not token:
            return
        with self._lock:
            self._token, self._token_from_file = token, True
        try:
            save_token(self.token_file, token)
        except OSError as exc:
            _log.warning("cannot save the application token: a restarted application will not find it",
                         app_id=self.app_id, token_file=str(self.token_file), error=str(exc))
            return
        _log.info("application token saved", app_id=self.app_id, token_file=str(self.token_file))

    def release(self, grant_id: str | None = None, *, wait_s: float | None = None) -> list[allocator_pb2.Grant]:
        """Release one grant, or every grant this client holds; the released grants. The call waits up
        to `wait_s` for a daemon that does not listen (one starting or restarting) before failing
        with UNAVAILABLE; by default `ready_wait_s`, or at most ABSENT_SOCKET_WAIT_S when the
        daemon's Unix socket does not exist (a stopped daemon). A daemon it cannot reach is said
        in one warning, as `request()` does, saying what becomes of the grants, and the
        grpc.RpcError (UNAVAILABLE) is raised. ClientClosedError after `close()`."""
        self._check_open("release")
        return self._release(grant_id, self._ready_wait_s if wait_s is None else wait_s, bounded=wait_s is None)

    def _socket_absent(self) -> bool:
        """Whether the daemon's address is a Unix socket path on which nothing exists."""
        target = grpc_target(self._socket)
        if not target.startswith("unix:"):
            return False  # host:port, or an abstract socket: nothing to look at
        return not os.path.exists(config.socket_path(target))

    def _release(self, grant_id: str | None, wait_s: float, *, bounded: bool) -> list[allocator_pb2.Grant]:
        """ReleaseResources for `grant_id`, or every grant held, all within one wait of `wait_s` for
        the daemon to listen (ABSENT_SOCKET_WAIT_S at most when `bounded` and its socket is absent)."""
        with self._lock:
            ids = [grant_id] if grant_id is not None else list(self._grants)
        if not ids:
            return []
        absent = bounded and self._socket_absent()
        if absent:
            wait_s = min(wait_s, ABSENT_SOCKET_WAIT_S)
        deadline = time.monotonic() + wait_s
        released: list[allocator_pb2.Grant] = []
        for gid in ids:
            self._wait_until_listening(max(0.0, deadline - time.monotonic()), notice=not absent)
            try:
                resp = self._stub.ReleaseResources(
                    allocator_pb2.ReleaseResourcesRequest(grant_id=gid),
                    timeout=self._timeout_s,
                    metadata=self._call_metadata(),
                )
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._warn_unreachable_release([i for i in ids if i not in {g.grant_id for g in released}],
                                                   wait_s, absent, exc)
                raise
            self._on_grant(resp.released, released=True, grant_id=gid)
            released.append(resp.released)
        return released

    def _warn_unreachable_release(self, ids: list[str], waited_s: float, absent: bool, exc: grpc.RpcError) -> None:
        """Say once what becomes of grants a release could not reach the daemon for."""
        with self._lock:
            no_pid = any(not self._grants[i].pid for i in ids if i in self._grants)
        fate = ("they stay held until the daemon sees this process gone and releases them (at its next start "
                "at the latest)")
        if no_pid:
            fate += "; a grant that names no process stays until server.idle_release_s passes without a sign of life"
        extra = ({"socket_absent": f"nothing at the socket: the daemon is stopped; waited {waited_s:g} s for it, "
                                   "not ready_wait_s"} if absent else {"waited_s": waited_s})
        self._warn_once("release_unreachable", f"cannot reach the vgpu daemon to release the grants: {fate}",
                        socket=self._socket, grants=ids, reason=exc.details(), **extra)

    def report_serving(self, counters: ServingCounters) -> None:
        """Report a serving engine's counters (requests running and waiting, KV cache in use and its
        pool, tokens in flight; `serving_counters_from_metrics` reads them from a vLLM or SGLang
        `/metrics` text). They go out with every report for `serving_max_age_s` after this call and
        are dropped after that, so an engine whose scraper stopped is reported as silent, not as
        frozen: call it at least that often (every second suits the profiler's 100 ms ticks). A
        counter left None is not reported. ValueError naming the counter for a value that is not
        finite, negative or implausibly large, and for KV in use beyond the pool."""
        problems = counters.problems()
        if problems:
            raise ValueError("unusable serving counters: " + "; ".join(problems))
        with self._lock:
            self._serving = counters
            self._serving_at_s = self._clock()

    def step(self, n: int | float = 1) -> int:
        """Mark `n` finished steps (training iterations or inference batches); the new step count.
        `n` is a whole number >= 0 (an int, or a float with no fraction); the count stays within the
        profiler's bound for it (`INAPP_MAX["step"]`, 2**53, beyond which a double no longer counts
        exactly). TypeError for anything but a number, ValueError for a fraction, a NaN or infinity,
        a negative `n` or a count past the bound: the count is left as it was, so one bad call never
        spoils every later report."""
        if isinstance(n, bool) or not isinstance(n, int | float):
            raise TypeError(f"step(n): n must be a whole number of steps, got {n!r} ({type(n).__name__})")
        if isinstance(n, float) and not n.is_integer():
            # NaN and infinity included: is_integer() is False for them
            why = "not finite" if not math.isfinite(n) else "not a whole number"
            raise ValueError(f"step(n): n is {why} ({n!r}); give a whole number of steps")
        if n < 0:
            raise ValueError(f"step(n): the step count only grows, got n={n!r}")
        most = INAPP_MAX["step"]
        with self._lock:
            if self._step + n > most:
                raise ValueError(f"step(n): the step count would pass {most:.0f}, the profiler's bound for it "
                                 f"(now {self._step}, n={n!r})")
            self._step += int(n)
            return self._step

    @property
    def granted_memory_mib(self) -> float:
        """The memory of `grants`, summed (MiB)."""
        with self._lock:
            return sum(g.memory_mib for g in self._grants.values())

    @property
    def memory_limit_kind(self) -> str:
        """How the daemon enforces this application's memory grant on this process's GPU, from its
        latest reply or event there: "hard" (its cgroup holds the daemon's cap too: the device is
        contended), "cooperative" (only this stub's own limit), "" before any grant or event."""
        with self._lock:
            return self._mem_limit_kind

    @property
    def applied_mem_limit_mib(self) -> float | None:
        """The memory limit this stub applied through torch (MiB, `granted_memory_mib` of this GPU
        capped at its size); None when none is in force: no grant, or no torch with CUDA."""
        with self._lock:
            return self._applied_limit_mib

    @property
    def grants(self) -> GrantList:
        """This process's grants now (a copy: it does not follow later changes). A property, as
        `granted_memory_mib`; `client.grants()` still works and warns (GrantList)."""
        with self._lock:
            return GrantList(self._grants.values())

    def counters(self) -> InAppCounters:
        """The in-app counters now: torch's allocator statistics where torch has CUDA initialised,
        and the serving counters of the last `report_serving` while they are fresh."""
        with self._lock:
            step, limit = self._step, self._applied_limit_mib
            serving, at_s = self._serving, self._serving_at_s
        stats = self._torch_stats()
        if serving is not None and self._clock() - at_s <= self._serving_max_age_s:
            stats.update({k: v for k, v in asdict(serving).items() if v is not None})
        return InAppCounters(step=step, applied_mem_limit_mib=limit, **stats)

    def _provable_pid(self) -> int:
        """The pid to name in a request, or 0 for none. The daemon takes a pid from a caller without the
        operator token when the caller's uid runs the process (its socket front reads the uid), or
        else when that process's fresh in-app report names the application (over TCP, or with the
        front off), so the report is written first. Where it cannot be written, the pid is still named
        over a Unix socket (the uid decides there; a daemon with its front off refuses it, and the
        request is then sent again without it: `request`), and not over TCP (nothing could prove it);
        without a pid the grant still holds, but it is not enforced on this process's cgroup nor
        released when the process exits. Either is said once."""
        try:
            self.report_now()
        except OSError as exc:
            if grpc_target(self._socket).startswith("unix"):
                self._warn_once(
                    "pid_report",
                    "cannot write the in-app report: the profiler sees no in-app counters of this process, "
                    "and the daemon must take this process's pid on the socket's word for its user",
                    dir=str(self.inapp_dir), error=exc.strerror or str(exc),
                    fix="give the stub the daemon's server.inapp_dir as inapp_dir= (default /run/vgpu/inapp)",
                )
                self._unproven_pid = True
                return self.pid
            self._warn_once(
                "pid",
                "cannot write the in-app report that proves this process's pid: requests name no pid, "
                "so the daemon cannot attach the grant to this process",
                dir=str(self.inapp_dir), error=exc.strerror or str(exc),
            )
            return 0
        self._unproven_pid = False
        return self.pid

    def report_now(self) -> Path:
        """Write the in-app file now (the reporter thread does this every `report_period_s`); a missing
        directory is created as `make_inapp_dir` does (mode 1777, not its parents), and OSError when
        it cannot be (its parent missing, no permission). After `close()` it raises ClientClosedError
        and writes nothing: close removed the file, and nothing would remove a new one."""
        self._check_open("report_now")
        # Named by the daemon's pid for this process: the profiler and the daemon look for the report
        # of the process they see (in a container, its pid on the host), not the pid seen inside.
        pid = self._daemon_pid
        report = InAppReport(
            app_id=self.app_id,
            pid=pid,
            pid_start_s=self._pid_start_s,
            written_at_s=self._clock(),
            counters=self.counters(),
        )
        rf = self._report_file
        with rf.lock:
            if rf.ended:  # close() (or the exit) ended reporting while the counters were read
                raise ClientClosedError(self._closed_message("report_now"))
            if rf.path is not None and rf.named_pid != pid:
                # the daemon named this process otherwise (a container's pid namespace): the file
                # under the pid seen inside goes, and the report moves to the daemon's name
                with contextlib.suppress(OSError):
                    rf.path.unlink()
                rf.path = None
            for attempt in (1, 2):
                if rf.path is None:
                    # kept from the claim on, whether or not this write works: a name claimed anew at
                    # each failed write (a full file system) would leave an empty file behind each time
                    rf.path, rf.named_pid = self._claim_inapp_name(pid), pid
                path = rf.path
                try:
                    written = write_inapp(self.inapp_dir, report, path=path)
                except (PermissionError, IsADirectoryError):
                    # the name was taken since it was claimed (between the look and the rename): claim again
                    rf.path = None
                    if attempt == 2:
                        raise
                    continue
                rf.path = written
                return written
        raise AssertionError("unreachable")

    @property
    def closed(self) -> bool:
        """Whether `close()` has been called (or the `with` block left)."""
        return self._closed.is_set()

    def _closed_message(self, call: str) -> str:
        what = "writes the in-app report" if call == "report_now" else "calls the daemon"
        return (f"VgpuClient({self.app_id!r}) is closed: {call}() {what}, which close() ended; "
                "make a new VgpuClient to go on")

    def _check_open(self, call: str) -> None:
        if self._closed.is_set():
            raise ClientClosedError(self._closed_message(call))

    def _claim_inapp_name(self, pid: int) -> Path:
        """The name of the report of this process, known to the daemon as `pid` (`claim_inapp_path`);
        said once when the usual one was taken, since the profiler and the daemon then find the report
        only by listing the directory."""
        if not self.inapp_dir.is_dir():
            make_inapp_dir(self.inapp_dir)
        claim = claim_inapp_path(self.inapp_dir, pid)
        if claim.usual_taken is not None:
            usual = inapp_path(self.inapp_dir, pid)
            self._warn_once(
                "inapp_name_taken",
                "the in-app report's usual file name is taken by a file this user cannot write over "
                "(another user's: squatted, or left by another user's earlier process with this pid): "
                "reporting under an unpredictable name instead, which the profiler and the daemon find "
                "by listing the directory",
                usual=str(usual), taken_by=claim.usual_taken, report=str(claim.path),
            )
        return claim.path

    def handle_event(self, event: allocator_pb2.AllocationEvent) -> None:
        """Apply one WatchAllocations event (the watch thread calls this; public for tests)."""
        if event.grant.app_id and event.grant.app_id != self.app_id:
            return
        if event.grant.pid and not self._is_this_process(event.grant.pid):
            # Another process of the same application id: its grant is neither this process's limit
            # nor this client's to release on close.
            return
        kind = event.kind
        if kind in (allocator_pb2.AllocationEvent.GRANTED, allocator_pb2.AllocationEvent.RESIZED):
            self._on_grant(event.grant, released=False)
        elif kind == allocator_pb2.AllocationEvent.RELEASED:
            self._on_grant(event.grant, released=True)
        if event.mem_limit in ("hard", "cooperative") and self._kind_is_for_here(event.grant.device_id):
            with self._lock:
                self._mem_limit_kind = event.mem_limit
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception as exc:  # the application's callback: its bug must not end the watch
                _log.warning("on_event raised; the watch goes on", app_id=self.app_id, error=repr(exc))

    def _kind_is_for_here(self, device_id: str) -> bool:
        """Whether the daemon's word for `device_id` is this process's (`memory_limit_kind`): the
        daemon judges each GPU on its own, so the word of another GPU the application holds grants
        on is not this one's. As `_grants_here`: where this process's GPU is not known, or no grant
        names it, every GPU's word counts."""
        uuid = self._device_uuid()
        if uuid is None or not device_id or device_id == uuid:
            return True
        with self._lock:
            return not any(g.device_id == uuid for g in self._grants.values())

    def close(self, *, release: bool = True) -> None:
        """Stop the threads, release the grants (best effort: waiting up to CLOSE_RELEASE_WAIT_S for a
        daemon that does not listen, ABSENT_SOCKET_WAIT_S when its socket does not exist, and saying in
        one warning what becomes of grants it could not release), remove the in-app file, close the channel.
        A second call does nothing. After it, `request()`, `release()` and `report_now()` raise
        ClientClosedError and no in-app file is written again; `step()`, `report_serving()`,
        `counters()` and the properties go on answering from memory. An application that exits without
        closing has its in-app file removed at interpreter exit (its grants are not released then: the
        daemon releases them `server.idle_release_s` after the application's last sign of life)."""
        if self._closed.is_set():
            return
        self._closed.set()
        call = self._watch_call
        if call is not None:
            call.cancel()
        if release:
            try:
                # A daemon in the middle of a restart is waited for briefly: otherwise the grants
                # would stay until its idle release.
                self._release(None, CLOSE_RELEASE_WAIT_S, bounded=True)
            except grpc.RpcError as exc:
                # UNAVAILABLE was said by _release, with what becomes of the grants
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    _log.warning("release on close failed", app_id=self.app_id, code=str(exc.code()),
                                 reason=exc.details())
        for t in self._threads:
            t.join(timeout=5.0)
        # Under the report's lock: a report being written now finishes first and is removed, and none
        # is written after (report_now raises ClientClosedError).
        self._report_finalizer()
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> VgpuClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- grants and the cooperative limit -----------------------------------------------------------
    def _is_this_process(self, pid: int) -> bool:
        """Whether a grant's pid is this process's: its own pid, or the daemon's name for it."""
        return pid in (self.pid, self._daemon_pid)

    def _on_grant(self, grant: allocator_pb2.Grant, *, released: bool, grant_id: str | None = None) -> None:
        gid = grant.grant_id or grant_id or ""
        with self._lock:
            if released:
                self._grants.pop(gid, None)
            elif gid:
                self._grants[gid] = grant
            self._grants_changes += 1
        self._sync_limit()

    def _catch_up(self) -> None:
        """Take this application's grants as the daemon lists them now (the watch thread calls this
        once its watch is live): events from before the watch, as while the daemon restarted, are
        not sent again, and a resize or release missed then would leave a stale limit. Events from
        the live watch are applied after this, so a change that raced the listing lands last."""
        for _ in range(3):
            with self._lock:
                seen = self._grants_changes
            try:
                reply = self._stub.ListApplications(allocator_pb2.ListApplicationsRequest(),
                                                    metadata=self._call_metadata(), timeout=10)
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
                    raise  # the daemon is away again: the watch loop retries
                self._warn_once("catch_up", "cannot list this application's grants: changes made while "
                                "the watch was away are not seen", code=str(exc.code()))
                return
            now = {g.grant_id: g for a in reply.apps if a.app_id == self.app_id for g in a.grants
                   if g.grant_id and (not g.pid or self._is_this_process(g.pid))}
            with self._lock:
                if self._grants_changes != seen:
                    continue  # a request or release of this process ran meanwhile: list again
                if now.keys() == self._grants.keys() and all(
                        self._grants[k].SerializeToString() == g.SerializeToString() for k, g in now.items()):
                    return
                self._grants = now
                self._grants_changes += 1
            _log.info("grants caught up with the daemon", app_id=self.app_id, grants=len(now))
            self._sync_limit()
            return

    def _sync_limit(self) -> None:
        """Bring the applied limit to the sum of the grants on this process's device; serialised so the
        caller of `request()` and the watch thread never apply out of order, and a caller returns only
        once it is applied."""
        with self._apply_lock:
            with self._lock:
                grants = list(self._grants.values())
            target = self._grants_here(grants)
            if target == self._target_mib:
                return
            if self._apply_limit(target):
                self._target_mib = target

    def _grants_here(self, grants: list[allocator_pb2.Grant]) -> float | None:
        """The memory granted on the device the limit applies to (None: no grant). A grant names its
        GPU by UUID; torch gives its devices' UUIDs, so a grant on another GPU of a multi-GPU process
        is not counted against this one. Where the UUID cannot be read (an old torch, no CUDA), or no
        grant names this device (grants on GPUs this process does not see, as from a simulated
        daemon), every grant counts, as one limit."""
        if not grants:
            return None
        uuid = self._device_uuid()
        here = [g for g in grants if uuid is not None and g.device_id == uuid]
        if uuid is not None and not here:
            self._warn_once("grant_device", "no grant names this process's GPU: the limit is the sum of every grant",
                            device=uuid, granted_on=sorted({g.device_id for g in grants}))
        return sum(g.memory_mib for g in (here or grants))

    def _device_uuid(self) -> str | None:
        """The UUID of the device the limit applies to, spelled as NVML spells it ("GPU-..."), or None."""
        torch = self._torch()
        if torch is None or not _cuda_available(torch):
            return None
        try:
            uuid = getattr(torch.cuda.get_device_properties(self._device_index(torch)), "uuid", None)
        except Exception:  # noqa: BLE001 - torch raises RuntimeError/AssertionError without a device
            return None
        if uuid is None:
            return None
        text = str(uuid)
        return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"

    def _apply_limit(self, limit_mib: float | None) -> bool:
        """Apply `limit_mib` (None: no limit) through torch where torch has CUDA; record what applied.
        False when torch refused it (it is tried again at the next change)."""
        torch = self._torch()
        applied: float | None = None
        if torch is None or not _cuda_available(torch):
            self._warn_once("no_torch_cuda", "no torch with CUDA: the granted memory limit is not applied")
        else:
            try:
                device = self._device_index(torch)
                total_mib = torch.cuda.get_device_properties(device).total_memory / MIB
                if limit_mib is None or limit_mib <= 0:
                    fraction = 1.0
                else:
                    fraction = min(1.0, limit_mib / total_mib)
                    applied = fraction * total_mib
                torch.cuda.set_per_process_memory_fraction(fraction, device)
            except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/ValueError/AssertionError
                _log.warning("cannot apply memory limit", app_id=self.app_id, limit_mib=limit_mib, error=repr(exc))
                return False
            _log.info("memory limit applied", app_id=self.app_id, limit_mib=applied, fraction=round(fraction, 4))
        with self._lock:
            if applied != self._applied_limit_mib:
                self.limit_changes += 1
            self._applied_limit_mib = applied
        return True

    def _torch(self) -> Any:
        if self._torch_arg is _FROM_SYS_MODULES:
            return sys.modules.get("torch")
        return self._torch_arg

    def _device_index(self, torch: Any) -> int:
        return int(self._torch_device if self._torch_device is not None else torch.cuda.current_device())

    def _torch_stats(self) -> dict[str, Any]:
        torch = self._torch()
        if torch is None or not _cuda_available(torch):
            return {}
        try:
            initialized = getattr(torch.cuda, "is_initialized", lambda: True)()
            if not initialized:  # never create a CUDA context from the reporter thread
                return {}
            stats: Mapping[str, Any] = torch.cuda.memory_stats(self._device_index(torch))
        except Exception as exc:  # noqa: BLE001
            self._warn_once("memory_stats", "torch.cuda.memory_stats failed", error=repr(exc))
            return {}
        out: dict[str, Any] = {}
        for key, name, scale in (
            ("allocated_bytes.all.current", "torch_allocated_mib", MIB),
            ("reserved_bytes.all.current", "torch_reserved_mib", MIB),
            ("active_bytes.all.current", "torch_active_mib", MIB),
        ):
            if key in stats:
                out[name] = stats[key] / scale
        if "num_alloc_retries" in stats:
            out["alloc_retries"] = int(stats["num_alloc_retries"])
        if "num_ooms" in stats:
            out["oom_count"] = int(stats["num_ooms"])
        return out

    def _ensure_inapp_dir(self) -> None:
        """Create the in-app directory (`make_inapp_dir`: mode 1777, shared by every application; never
        its parents) when it is missing and may be created; say once, under the reporter's warning
        key, when it cannot: the reporter keeps trying, and writes once the directory appears."""
        if self.inapp_dir.is_dir():
            return
        try:
            created = make_inapp_dir(self.inapp_dir)
        except OSError as exc:
            missing_parent = isinstance(exc, FileNotFoundError)
            self._warn_once(
                "report",
                "in-app counter directory missing and cannot be created: the profiler gets no in-app "
                "counters from this application",
                dir=str(self.inapp_dir),
                error=(f"its parent {self.inapp_dir.parent} does not exist (the daemon's runtime directory: "
                       "is the daemon running?)" if missing_parent else exc.strerror or str(exc)),
                fix=f"as root: install -d -m 1777 {self.inapp_dir}; or pass inapp_dir= (and the profiler --inapp-dir)",
            )
            return
        if created:
            _log.info("in-app counter directory created", dir=str(self.inapp_dir))

    def _warn_once(self, key: str, message: str, **kw: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(message, app_id=self.app_id, **kw)

    # --- threads ------------------------------------------------------------------------------------
    def _start(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _watch_loop(self) -> None:
        delay_s = WATCH_RETRY_MIN_S
        while not self._closed.is_set():
            opened = time.monotonic()
            cap_s = WATCH_RETRY_MAX_S
            try:
                call = self._stub.WatchAllocations(
                    allocator_pb2.WatchAllocationsRequest(app_id=self.app_id), metadata=self._call_metadata()
                )
                self._watch_call = call
                if self._closed.is_set():
                    call.cancel()
                # the watch is live: every change from here on is an event (a refused call returns
                # here too, and raises on reading)
                call.initial_metadata()
                # open (a refusal comes with its headers, ended: reading it raises); the call is also a
                # grpc.Future at run time, which the stubs' iterator type does not say
                if not call.done():  # type: ignore[attr-defined]
                    if self._watch_failing:
                        _log.info("allocation watch open again", app_id=self.app_id, errors=self.watch_errors)
                        self._watch_failing = False
                    self._catch_up()
                for event in call:
                    self.handle_event(event)
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                self.watch_errors += 1
                refused = exc.code() in _REFUSALS
                if refused:
                    cap_s = WATCH_REFUSED_MAX_S
                if not self._watch_failing or self.watch_errors % 50 == 0:
                    self._watch_failing = True
                    _log.warning("allocation watch refused, asking again at most every 30 s" if refused else
                                 "allocation watch interrupted, opening it again", app_id=self.app_id,
                                 code=str(exc.code()), details=exc.details(), errors=self.watch_errors,
                                 meaning="until it is open this process does not hear its grants' changes; "
                                 "it catches up on them once it is")
            self._watch_call = None
            if time.monotonic() - opened >= WATCH_LIVED_S:
                delay_s = WATCH_RETRY_MIN_S
            self._closed.wait(delay_s * self._rng.uniform(0.8, 1.2))
            delay_s = min(delay_s * 2, cap_s)

    def _report_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self.report_now()
            except ClientClosedError:
                return
            except OSError as exc:
                self.report_errors += 1
                self._warn_once("report", "cannot write in-app counters", dir=str(self.inapp_dir), error=str(exc))
            self._closed.wait(self._report_period_s)


def _cuda_available(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _own_start_time(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - no psutil or no such process: the profiler then skips the check
        return None
