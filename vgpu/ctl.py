"""Operator and application commands over the daemon's socket.

    vgpu available --socket PATH [--device ID] [--wait-s S] [--json]
    vgpu apps      --socket PATH [--wait-s S] [--json]
    vgpu request   --socket PATH --app ID --memory-mib N [--sm-pct P] [--device ID] [--priority N] [--pid N] [--wait-s S] [--json]
    vgpu request   --socket PATH --app ID --model-type NAME --batch-size N [job flags...]   (cold-start sized)
    vgpu release   --socket PATH --grant ID [--wait-s S] [--json]
    vgpu set-limit --socket PATH --app ID [--max-memory-mib N] [--max-sm-pct P] [--priority N] [--clear] [--create] [--wait-s S] [--json]
    vgpu top       --socket PATH [--interval-s 1] [--iterations N] [--wait-s S]
    vgpu forget-app --socket PATH (--app ID [--app ID ...] | --uid N) [--wait-s S] [--json]

Tokens (vgpu/auth.py). A command sends, in order until one is accepted: the token of `--token-file`
or `$VGPU_TOKEN_FILE` or `$VGPU_TOKEN`; for an application's grants, the application token this
user was handed by an earlier `vgpu request` or client stub (kept in `~/.config/vgpu/tokens/`, 0600, per
socket: vgpu.client.app_token_path)
or found readable in `<state-dir>/tokens/apps/`; the operator token `<state-dir>/tokens/operator.token`
when readable; finally nothing (a new application may claim its id without a token). A token the
daemon rejects as not its own (a new state directory) is dropped from the cache. A call the daemon
takes with the operator token after it refused this user's own (PERMISSION_DENIED: a `--pid` that does
not run as this user, say) is said on stderr with the refusal: it acted on the operator's authority.

Not ready. These commands send a call again for up to `--wait-s` (default 10 s; 0: never; `top`
for its first refresh only) while nothing listens on the socket yet (no socket file,
or one that refuses connections: a daemon starting, or restarting after a crash; the call was never
sent) and while the daemon answers UNAVAILABLE marked as having changed nothing
(vgpu.client.changed_nothing: its cold-start model still loading just after it starts, its state
directory full), saying once on stderr for each that they wait; the second loop is the client
stub's (vgpu.client.send_when_ready). An UNAVAILABLE without the mark may follow a change and is
never sent again. A socket whose directory does not exist is not waited for: no daemon listens
there, and none is starting (the unit's RuntimeDirectory, or `vgpu serve` as it starts, makes it).

Exit status: 0 done, 1 the daemon refused or could not be reached (the message says why), 2 usage
or configuration error (a number outside its field's range, a token file that holds no token).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from vgpu import auth
from vgpu import client as vclient
from vgpu import config as vconfig
from vgpu.jobs import (
    MODES,
    PRECISIONS,
    InvalidJobConfig,
    JobConfig,
    known_model,
    unknown_model_note,
)
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

T = TypeVar("T")


class CliError(Exception):
    """A refusal or failure to report as `PROG: message` with exit status 1."""


class UsageError(CliError):
    """A command line that cannot be carried out as given: `PROG: message`, exit status 2."""


# --- tokens ----------------------------------------------------------------------------------------------
def token_cache_dir(socket_path: str, env: dict[str, str] | None = None) -> Path:
    """Where this user keeps application tokens for the daemon at `socket_path` (shared with the client
    stub, vgpu.client.token_cache_dir)."""
    return vclient.token_cache_dir(socket_path, env)


def _read_token(path: Path) -> str | None:
    """The token in a file this command may or may not be able to read (the daemon's, a cache): None
    when it is missing or unreadable; CliError naming the file when it holds something else."""
    try:
        return vclient.read_token(path)
    except vclient.TokenFileError as exc:
        if isinstance(exc.__cause__, OSError):
            return None
        raise CliError(str(exc)) from None


class Tokens:
    """Where this command finds tokens (see the module docstring)."""

    def __init__(self, socket_path: str, state_dir: Path, token_file: Path | None, env: dict[str, str] | None = None) -> None:
        self.env = dict(os.environ) if env is None else env
        self.socket_path = socket_path
        self.cache = token_cache_dir(socket_path, self.env)
        self.state_dir = state_dir
        explicit = token_file or (Path(self.env["VGPU_TOKEN_FILE"]) if self.env.get("VGPU_TOKEN_FILE") else None)
        self.explicit: str | None = None
        try:
            if explicit is not None:
                self.explicit = vclient.read_token(explicit)
                if self.explicit is None:
                    raise UsageError(f"cannot read a token from {explicit}: no such file")
            elif self.env.get("VGPU_TOKEN"):
                self.explicit = vclient.check_token(self.env["VGPU_TOKEN"], "$VGPU_TOKEN")
        except vclient.TokenFileError as exc:
            raise UsageError(str(exc)) from None  # the token the command line or environment names

    def app_cache_path(self, app_id: str) -> Path:
        return vclient.app_token_path(app_id, self.socket_path, self.env)

    def candidates(self, app_id: str | None) -> Iterator[tuple[str | None, Path | None]]:
        """(token, cache file it came from or None); the last candidate is (None, None)."""
        if self.explicit is not None:
            yield self.explicit, None
            return
        if app_id is not None:
            path = self.app_cache_path(app_id)
            tok = _read_token(path)
            if tok:
                yield tok, path
            tok = _read_token(auth.app_token_file(app_id, self.state_dir))
            if tok:
                yield tok, None
        tok = _read_token(auth.role_token_file("operator", self.state_dir))
        if tok:
            yield tok, None
        yield None, None

    def remember(self, app_id: str, token: str) -> Path:
        return vclient.save_token(self.app_cache_path(app_id), token)


# --- calls -----------------------------------------------------------------------------------------------
class Client:
    """Calls to the daemon at `socket_path`. A call the daemon answers "not ready, nothing changed"
    (vgpu.client.changed_nothing: its cold-start model still loading, its state directory full) is
    sent again for up to `wait_s`, `notice(text)` saying once that it waits; 0 fails at once, and None
    (a command without --wait-s) too."""

    def __init__(self, socket_path: str, tokens: Tokens, timeout_s: float, *, wait_s: float | None = None,
                 notice: Callable[[str], None] = lambda _text: None) -> None:
        self.socket_path = socket_path
        self.tokens = tokens
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self._notice = notice
        self._noticed = False
        self._target = socket_path if socket_path.startswith("unix:") else f"unix:{os.path.abspath(socket_path)}"
        self._socket_file = _socket_file(self._target)
        self._listening_noticed = False
        self._connect()

    def _connect(self) -> None:
        self.channel = grpc.insecure_channel(self._target,
                                             options=(("grpc.max_receive_message_length", vclient.MAX_REPLY_BYTES),))
        self.stub = pb_grpc.AllocatorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def _send(self, method: str, request: Message, metadata: Sequence[tuple[str, str]]) -> tuple[Any, Any]:
        """One call, sent again within `wait_s` while nothing listens on the socket yet (no socket
        file, or one that refuses: a daemon starting, or restarting after a crash; the call was not
        sent) or while the daemon answers "not ready, nothing changed" (vgpu.client.send_when_ready).
        One budget covers both waits."""
        deadline = time.monotonic() + (self.wait_s or 0.0)
        delay_s = 0.1
        while True:
            fn = getattr(self.stub, method).with_call
            try:
                # with_call gives (response, call); the response's type depends on `method`.
                answer: tuple[Any, Any] = vclient.send_when_ready(
                    functools.partial(fn, request, metadata=metadata, timeout=self.timeout_s),
                    wait_s=max(0.0, deadline - time.monotonic()), on_wait=self._waiting)
                return answer
            except grpc.RpcError as exc:
                if not _not_listening(exc) or self._missing_directory() or time.monotonic() + delay_s > deadline:
                    raise
            if not self._listening_noticed:
                self._listening_noticed = True
                self._notice(f"nothing listens on {self.socket_path} yet; waiting up to {self.wait_s or 0:g} s "
                             "for the daemon to start (--wait-s)")
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.5)
            # a fresh channel connects at once (a failed one waits out gRPC's reconnect backoff)
            self.channel.close()
            self._connect()

    def call(self, method: str, request: Message, *, app_id: str | None = None, token: bool = True) -> tuple[Any, Any]:
        """(response, call); tries token candidates in order while the daemon answers UNAUTHENTICATED
        or PERMISSION_DENIED for a token that is not the right one."""
        last: grpc.RpcError | None = None
        candidates = self.tokens.candidates(app_id) if token else iter([(None, None)])
        operator = _read_token(auth.role_token_file("operator", self.tokens.state_dir)) if token else None
        for tok, cached in candidates:
            md = auth.bearer(tok) if tok else ()
            try:
                answer = self._send(method, request, md)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAVAILABLE and not _unreachable(exc):
                    # the daemon answered: a full state directory, a model still loading
                    hint = ""
                    if vclient.changed_nothing(exc) and self.wait_s is not None:
                        hint = (f" (nothing was changed; still not ready after {self.wait_s:g} s: run it again, "
                                "or give a longer --wait-s)" if self.wait_s > 0 else
                                " (nothing was changed; --wait-s N asks again for up to N s)")
                    elif vclient.changed_nothing(exc):
                        hint = " (nothing was changed: run it again)"
                    raise CliError(f"{code.name}: {exc.details()}{hint}") from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise CliError(self._unreachable_text(exc)) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise CliError(self._no_answer(method)) from None
                if code == grpc.StatusCode.UNAUTHENTICATED and cached is not None:
                    cached.unlink(missing_ok=True)  # issued by another daemon instance
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) and tok is not None:
                    last = exc
                    continue
                raise CliError(f"{code.name}: {exc.details()}{self._owner_hint(exc, app_id)}") from None
            if tok is not None and tok == operator and last is not None \
                    and last.code() == grpc.StatusCode.PERMISSION_DENIED:
                # taken on the operator's authority after this user's own was refused: say so, and why
                self._notice(f"sent with the operator token after the daemon refused this user's own "
                             f"({last.details()}); it acted on the operator's authority")
            return answer
        assert last is not None
        raise CliError(f"{last.code().name}: {last.details()}{self._owner_hint(last, app_id)}")

    def _missing_directory(self) -> Path | None:
        """The socket's directory when it does not exist: no daemon listens there, and none is about
        to (the unit's RuntimeDirectory, or `vgpu serve` as it starts, makes it before it listens)."""
        if self._socket_file is None or self._socket_file.parent.exists():
            return None
        return self._socket_file.parent

    def _unreachable_text(self, exc: grpc.RpcError) -> str:
        """No connection to the socket: why, how long this command waited, and where else to look."""
        text = f"cannot reach the vgpu daemon at {self.socket_path} ({exc.details()})"
        missing = self._missing_directory() if _not_listening(exc) else None
        if missing is not None:
            text += f"; its directory {missing} does not exist, so no daemon listens there (not waited for)"
        elif self.wait_s and _not_listening(exc):
            text += f"; nothing listened there within {self.wait_s:g} s (--wait-s)"
        return text + "; " + NO_DAEMON_HINT

    def _no_answer(self, method: str) -> str:
        """No answer within the timeout: a change may have been made all the same (the call reached
        the daemon), and a grant made so leaves its token with the daemon only."""
        text = f"DEADLINE_EXCEEDED: no answer within {self.timeout_s:g} s (--timeout-s)"
        if method not in _CHANGES:
            return text
        text += "; the daemon may have made the change all the same: see `vgpu apps` before running it again"
        if method == "RequestResourceAllocation":
            text += (f" (a grant made so keeps the application's token in "
                     f"{auth.token_dir(self.tokens.state_dir) / 'apps'}/ only: give --state-dir to use it)")
        return text

    def _waiting(self, exc: grpc.RpcError) -> None:
        if not self._noticed:
            self._noticed = True
            self._notice(f"the daemon is not ready: {exc.details()}; asking again for up to {self.wait_s or 0:g} s "
                         "(--wait-s)")

    def _owner_hint(self, exc: grpc.RpcError, app_id: str | None) -> str:
        """For an application id another client owns: where this CLI looked for its token, and how to
        give it."""
        details = exc.details() or ""
        claimed = exc.code() == grpc.StatusCode.PERMISSION_DENIED and "owned by another client" in details
        # a release of a grant whose application's token this command does not have
        owned = exc.code() == grpc.StatusCode.UNAUTHENTICATED and " belongs to " in details
        if app_id is None or self.tokens.explicit is not None or not (claimed or owned):
            return ""
        return (f"; no token of {app_id!r} here: looked in {self.tokens.app_cache_path(app_id)} and "
                f"{auth.app_token_file(app_id, self.tokens.state_dir)}; pass the file of the run that claimed it "
                "with --token-file, or --state-dir (the daemon's) as a user who may read its tokens"
                + (", or use another --app" if claimed else ""))


# What to try when no daemon answers on the socket: the packaged service, or another daemon's socket.
NO_DAEMON_HINT = ("is vgpu-manager running (systemctl status vgpu-manager), and may you open its socket? "
                  "For a daemon on another socket, pass --socket PATH or set VGPU_SERVER_SOCKET")


def _socket_file(target: str) -> Path | None:
    """The socket file of a `unix:` gRPC target (`unix:///abs/path`, `unix:path`), None for others."""
    return Path(os.path.abspath(vconfig.socket_path(target))) if target.startswith("unix:") else None


# The calls that change something (the others only read).
_CHANGES = frozenset({"RequestResourceAllocation", "ReleaseResources", "SetResourceLimits"})


def _unreachable(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE because no connection could be made (no socket, refused, no permission), not
    because the daemon answered UNAVAILABLE."""
    text = f"{exc.details()} {getattr(exc, 'debug_error_string', lambda: '')()}".lower()
    return any(s in text for s in ("failed to connect", "connection refused", "no such file", "permission denied"))


def _not_listening(exc: grpc.RpcError) -> bool:
    """Unreachable because nothing listens on the socket yet (no such file, or a socket file nobody
    accepts on), so the call was never sent; not a socket this user may not open."""
    text = f"{exc.details()} {getattr(exc, 'debug_error_string', lambda: '')()}".lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(s in text for s in ("no such file", "connection refused"))


def _dict(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _print_json(obj: object, out: TextIO) -> None:
    out.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _number(text: str, *, zero_ok: bool) -> float:
    """A finite number, > 0 or, with `zero_ok`, >= 0: the argument types below."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if zero_ok else '>'} 0, got {text}")
    return value


def _positive(text: str) -> float:
    """A finite number > 0 (a timeout, a period)."""
    return _number(text, zero_ok=False)


def _whole(lo: int, hi: int) -> Callable[[str], int]:
    """A whole number within lo..hi, the range of the proto field it goes into (a value outside it
    would stop the command with protobuf's ValueError)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be within {lo}..{hi}, got {value}")
        return value

    return parse


INT32 = _whole(-(2**31), 2**31 - 1)
UINT32 = _whole(0, 2**32 - 1)
UINT64 = _whole(0, 2**64 - 1)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help=f"daemon socket (default: server.socket of the configuration, {vconfig.DEFAULT_SOCKET_PATH})")
    p.add_argument("--state-dir", help="daemon state directory, to find readable tokens (default: server.state_dir of "
                   f"the configuration, {vconfig.DEFAULT_STATE_DIR})")
    p.add_argument("--token-file", type=Path, help="send the token in this file")
    p.add_argument("--config", type=Path, help="configuration file (default /etc/vgpu/vgpu.toml if present)")
    p.add_argument("--timeout-s", type=_positive, default=10.0, help="per-call timeout (default 10 s)")


def _description(prog: str) -> str | None:
    """A command's one-line help from `vgpu --help` (vgpu/cli.py COMMANDS), as its `--help` description."""
    from vgpu.cli import COMMANDS  # noqa: PLC0415 - the dispatcher imports this module lazily

    entry = COMMANDS.get(prog.rsplit(" ", 1)[-1])
    return entry[1][:1].upper() + entry[1][1:] + "." if entry else None


def _run(
    prog: str,
    argv: Sequence[str] | None,
    build: Callable[[argparse.ArgumentParser], None],
    body: Callable[[argparse.Namespace, Client, TextIO], int],
    out: TextIO | None = None,
    env: dict[str, str] | None = None,
) -> int:
    p = argparse.ArgumentParser(prog=prog, description=_description(prog))
    _common(p)
    build(p)  # may set its own, longer description
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = out or sys.stdout
    try:
        cfg = vconfig.load(ns.config, env=env)
    except vconfig.ConfigError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return 2
    socket_path = ns.socket or cfg.server.socket
    state_dir = Path(ns.state_dir or cfg.server.state_dir)
    client = None
    try:
        client = Client(socket_path, Tokens(socket_path, state_dir, ns.token_file, env), ns.timeout_s,
                        wait_s=getattr(ns, "wait_s", None), notice=lambda text: print(f"{prog}: {text}", file=sys.stderr))
        return body(ns, client, out)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except CliError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if client is not None:
            client.close()


# --- available -------------------------------------------------------------------------------------------
NA = "N/A"


def _fmt(x: float, unit: str = "") -> str:
    return "-" if not math.isfinite(x) else f"{x:,.0f}{unit}"


def _opt(msg: Message, name: str, fmt: str = "{:,.0f}", scale: float = 1.0) -> str:
    """An optional field as text, or N/A when the daemon left it unset (the device could not say)."""
    if not msg.HasField(name):
        return NA
    return fmt.format(getattr(msg, name) * scale)


def _mode(d: pb.DeviceResources) -> str:
    return "dry run" if d.dry_run else "live"


def _age(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return NA
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def device_rows(resp: pb.GetAvailableResourcesResponse) -> list[dict[str, str]]:
    """One dict of display strings per device (the columns of `vgpu available` and `vgpu top`)."""
    rows = []
    for d in resp.devices:
        draw = _opt(d, "power_draw_mw", "{:.0f}", 1e-3)
        limit = f"{d.power_limit_mw / 1000:.0f}" if d.power_limit_mw else NA
        profiler = NA
        if d.HasField("profiler_streams"):
            age = _age(d.newest_signature_age_s) if d.HasField("newest_signature_age_s") else "no signature"
            profiler = f"{d.profiler_streams} ({age})"
        rows.append({
            "IDX": str(d.index),
            "NAME": d.name,
            "BUS ID": d.pci_bus_id if d.HasField("pci_bus_id") else NA,
            "USED MiB": _opt(d, "mem_used_mib"),
            "GRANTED MiB": _fmt(d.mem_granted_mib),
            "FREE MiB": _fmt(d.mem_available_mib),
            "TOTAL MiB": _fmt(d.mem_total_mib),
            "SM FREE": f"{d.sm_available_pct:.0f}%",
            "PWR W": f"{draw} / {limit}",
            "TEMP": _opt(d, "temperature_c", "{:.0f}C"),
            "SM MHz": _opt(d, "sm_clock_mhz"),
            "UTIL": _opt(d, "sm_util_pct", "{:.0f}%"),
            "MODE": _mode(d),
            "PROFILERS": profiler,
            "UUID": d.device_id,
        })
    return rows


# C0 controls, DEL and C1 controls: a terminal acts on them (clears the screen, sets the title,
# moves the cursor), and a process's command line or user name is whatever that user wrote.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def printable(text: str) -> str:
    """`text` with every control character written as a visible `\\xNN` escape, for a terminal."""
    return text.translate(_CONTROLS)


def _text_table(rows: Sequence[dict[str, str]], columns: Sequence[str], right: set[str], empty: str) -> str:
    rows = [{c: printable(r[c]) for c in columns} for r in rows]
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in columns}
    head = "  ".join(c.rjust(widths[c]) if c in right else c.ljust(widths[c]) for c in columns)
    lines = [head.rstrip()]
    for r in rows:
        lines.append("  ".join(r[c].rjust(widths[c]) if c in right else r[c].ljust(widths[c]) for c in columns).rstrip())
    if not rows:
        lines.append(empty)
    return "\n".join(lines)


DEVICE_COLUMNS = ("IDX", "NAME", "BUS ID", "USED MiB", "GRANTED MiB", "FREE MiB", "TOTAL MiB", "SM FREE", "PWR W",
                  "TEMP", "SM MHz", "UTIL", "MODE", "PROFILERS", "UUID")
_DEVICE_RIGHT = {"USED MiB", "GRANTED MiB", "FREE MiB", "TOTAL MiB", "SM FREE", "PWR W", "TEMP", "SM MHz", "UTIL"}
MIG_COLUMNS = ("GPU", "GI ID", "PROFILE", "START", "SIZE", "MEM MiB", "UUID")


def mig_rows(resp: pb.GetAvailableResourcesResponse) -> list[dict[str, str]]:
    return [
        {"GPU": str(d.index), "GI ID": str(inst.gpu_instance_id), "PROFILE": inst.profile, "START": str(inst.start),
         "SIZE": str(inst.size), "MEM MiB": _fmt(inst.mem_total_mib), "UUID": inst.instance_id}
        for d in resp.devices for inst in d.mig_instances
    ]


PROCESS_COLUMNS = ("GPU", "GI", "PID", "APP", "USER", "USED MiB", "COMMAND")


def process_rows(resp: pb.GetAvailableResourcesResponse,
                 apps: pb.ListApplicationsResponse | None = None) -> list[dict[str, str]]:
    """Every process with a context on a GPU (nvidia-smi's process table); APP where a vgpu
    application names the pid (its grants or signatures), "-" for a process vgpu does not manage."""
    owner = {p.pid: a.app_id for a in apps.apps for p in a.processes} if apps is not None else {}
    return [
        {"GPU": str(d.index), "GI": str(p.gpu_instance_id) if p.HasField("gpu_instance_id") else "-",
         "PID": str(p.pid), "APP": owner.get(p.pid, "-" if apps is not None else NA), "USER": p.user or NA,
         "USED MiB": _opt(p, "used_mib"), "COMMAND": p.command[:48] or NA}
        for d in resp.devices for p in d.processes
    ]


def devices_table(resp: pb.GetAvailableResourcesResponse, apps: pb.ListApplicationsResponse | None = None) -> str:
    """`vgpu available`: one row per GPU, the MIG instances of GPUs in MIG mode, then every process
    on the GPUs (`apps`: to name the vgpu application of each)."""
    text = _text_table(device_rows(resp), DEVICE_COLUMNS, _DEVICE_RIGHT, "(no devices)")
    mig = mig_rows(resp)
    if mig:
        text += "\n\nMIG instances\n" + _text_table(mig, MIG_COLUMNS, {"GI ID", "START", "SIZE", "MEM MiB"}, "")
    elif any(d.mig_enabled for d in resp.devices):
        text += "\n\nMIG instances: none (MIG mode on)"
    procs = process_rows(resp, apps)
    if procs:
        text += "\n\nProcesses\n" + _text_table(procs, PROCESS_COLUMNS, {"PID", "USED MiB"}, "")
    return text


def _device_arg(c: Client, text: str) -> str:
    """A `--device` as given: a GPU's index is looked up to its UUID (device_of_index); anything else
    (a GPU or MIG UUID) goes to the daemon as it is, which answers NOT_FOUND, with the devices it
    knows, for one it does not."""
    if not vclient.is_device_index(text):
        return text
    devices, _ = c.call("GetAvailableResources", pb.GetAvailableResourcesRequest(), token=False)
    try:
        return vclient.device_of_index(devices, text)
    except LookupError as exc:
        raise CliError(str(exc)) from None


def available_main(argv: Sequence[str] | None = None, prog: str = "vgpu available", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="", help="one GPU: its index (IDX) or UUID")
        p.add_argument("--json", action="store_true", help="print JSON")
        _wait_option(p)

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        device_id = _device_arg(c, ns.device)
        resp, _ = c.call("GetAvailableResources", pb.GetAvailableResourcesRequest(device_id=device_id), token=False)
        if ns.json:
            _print_json(_dict(resp), o)
            return 0
        if resp.dry_run:
            o.write("dry run: the daemon decides and logs, and writes nothing to the devices "
                    "(server.dry_run = false to act)\n")
        apps = None
        if any(d.processes for d in resp.devices):
            apps, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
        o.write(devices_table(resp, apps) + "\n")
        return 0

    return _run(prog, argv, build, body, out, env)


# --- apps ------------------------------------------------------------------------------------------------
APP_COLUMNS = ("APP", "CLAIMED", "PID", "USER", "COMMAND", "GPU", "USED MiB", "P50 MiB", "P90 MiB", "GRANTED MiB",
               "WHY", "ENFORCED", "LIMIT MiB", "SM %", "P90 SM %", "GRANT SM %", "LAST SEEN")
_APP_RIGHT = {"USED MiB", "P50 MiB", "P90 MiB", "GRANTED MiB", "LIMIT MiB", "SM %", "P90 SM %", "GRANT SM %"}


def _known(x: float, forecast_known: bool, fmt: str = "{:,.0f}") -> str:
    return fmt.format(x) if forecast_known and math.isfinite(x) else NA


# ApplicationInfo's use and forecast are doubles without presence: the daemon sends 0 for one it does not
# know (allocator/service.py). They arrive together with a recommendation, so an application with all
# three of use and memory P90 at 0 has none yet; a forecast of 0 is none either.
_USAGE_FIELDS = ("mem_used_mib", "sm_util_pct")
_FORECAST_FIELDS = ("forecast_mem_p50_mib", "forecast_mem_p90_mib", "forecast_sm_p50_pct", "forecast_sm_p90_pct")


def usage_known(a: pb.ApplicationInfo) -> bool:
    """Whether the daemon has a use or forecast for `a` (a recommendation has been made for it)."""
    return a.mem_used_mib > 0 or a.forecast_mem_p90_mib > 0 or a.sm_util_pct > 0


def unknown_fields(a: pb.ApplicationInfo) -> set[str]:
    """The use and forecast fields of `a` that the daemon does not know: `N/A` in the table, null in
    `vgpu apps --json`."""
    if not usage_known(a):
        return {*_USAGE_FIELDS, *_FORECAST_FIELDS}
    return {f for f in _FORECAST_FIELDS if not getattr(a, f) > 0}


def apps_json(resp: pb.ListApplicationsResponse) -> dict[str, Any]:
    """`vgpu apps --json`: the daemon's answer, with null for each use or forecast it does not know
    (`unknown_fields`), where the message can only say 0."""
    out = _dict(resp)
    for a, d in zip(resp.apps, out.get("apps", []), strict=True):
        for name in unknown_fields(a):
            d[name] = None
    return out


def app_rows(resp: pb.ListApplicationsResponse, devices: pb.GetAvailableResourcesResponse | None = None,
             now_s: float | None = None) -> list[dict[str, str]]:
    """One dict of display strings per application. `devices`: to show a GPU's index instead of its
    UUID; `now_s`: the clock to tell how long ago each was seen (default: this host's)."""
    index = {d.device_id: str(d.index) for d in devices.devices} if devices is not None else {}
    now = time.time() if now_s is None else now_s
    rows = []
    for a in resp.apps:
        unknown = unknown_fields(a)
        procs = list(a.processes)
        lim = a.limits
        rows.append({
            "APP": a.app_id,
            "CLAIMED": "yes" if a.claimed else "no",
            "PID": ",".join(str(p.pid) for p in procs) or NA,
            "USER": ",".join(sorted({p.user for p in procs if p.user})) or NA,
            "COMMAND": (procs[0].command if procs and procs[0].command else NA),
            "GPU": index.get(a.device_id, a.device_id or NA),
            "USED MiB": _known(a.mem_used_mib, "mem_used_mib" not in unknown),
            "P50 MiB": _known(a.forecast_mem_p50_mib, "forecast_mem_p50_mib" not in unknown),
            "P90 MiB": _known(a.forecast_mem_p90_mib, "forecast_mem_p90_mib" not in unknown),
            # "none": no grant at all, told apart from a grant of 0 MiB (an SM share alone)
            "GRANTED MiB": f"{sum(g.memory_mib for g in a.grants):,.0f}" if a.grants else NO_GRANT,
            # the rule the latest plan sized its memory by (docs/operations.md lists them)
            "WHY": a.plan_mem_rule or NA,
            "ENFORCED": a.mem_limit or NA,
            "LIMIT MiB": f"{lim.max_memory_mib:,.0f}" if a.HasField("limits") and lim.HasField("max_memory_mib") else "-",
            "SM %": _known(a.sm_util_pct, "sm_util_pct" not in unknown),
            "P90 SM %": _known(a.forecast_sm_p90_pct, "forecast_sm_p90_pct" not in unknown),
            # as GRANTED MiB: "none" without a grant, told apart from a memory grant with no SM share
            "GRANT SM %": f"{sum(g.sm_pct for g in a.grants):.0f}" if a.grants else NO_GRANT,
            "LAST SEEN": _age(now - a.last_seen_s) if a.HasField("last_seen_s") else NA,
        })
    return rows


NO_GRANT = "none"


def holds_nothing(a: pb.ApplicationInfo) -> bool:
    """Whether an application is only remembered: no grant, no process on a GPU, no use or forecast, no
    operator limits. The daemon keeps a claimed id (its token's owner) and its last sign of life after
    its grants are released, for as long as the claim is stored; `vgpu apps` leaves such ids out
    unless `--all`, as `docker ps` leaves out stopped containers."""
    return not a.grants and not a.processes and not usage_known(a) and not a.HasField("limits")


def apps_table(resp: pb.ListApplicationsResponse, devices: pb.GetAvailableResourcesResponse | None = None,
               now_s: float | None = None, *, command_width: int = 32, show_all: bool = True) -> str:
    """The applications as a plain table; `show_all=False` leaves out those that hold nothing
    (`holds_nothing`) and says under the table how many were left out."""
    shown = resp
    hidden = 0
    if not show_all:
        kept = [a for a in resp.apps if not holds_nothing(a)]
        hidden = len(resp.apps) - len(kept)
        shown = pb.ListApplicationsResponse(apps=kept)
    rows = app_rows(shown, devices, now_s)
    for r in rows:
        r["COMMAND"] = r["COMMAND"][:command_width]
    empty = "(no application holds a grant or runs on a GPU)" if hidden else "(no applications)"
    table = _text_table(rows, APP_COLUMNS, _APP_RIGHT, empty)
    if any(g.sm_pct > 0 for a in shown.apps for g in a.grants):
        table += "\n" + SM_NOT_ENFORCED
    if hidden:
        table += (f"\n{hidden} application{'s' if hidden != 1 else ''} holding nothing not listed (no grant, no "
                  "process on a GPU: released or idle, the id kept as claimed); vgpu apps --all lists them")
    return table


# Said under `vgpu apps` wherever an SM share is granted: the daemon does not wire MPS in.
SM_NOT_ENFORCED = ("GRANT SM %: not enforced. The daemon records SM shares and plans with them, but sets no MPS "
                   "limit; applications share the GPU's SMs by time slicing.")


def apps_main(argv: Sequence[str] | None = None, prog: str = "vgpu apps", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("-a", "--all", action="store_true",
                       help="also list the applications that hold nothing now: no grant, no process on a GPU, no "
                            "forecast, no limits (released or idle, their ids kept as claimed); "
                            f"their GRANTED MiB and GRANT SM %% read {NO_GRANT!r}")
        p.add_argument("--json", action="store_true",
                       help="print the daemon's ListApplications answer as JSON: every application, as with --all; "
                            "null for a use or forecast not known yet (N/A in the table)")
        _wait_option(p)

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        resp, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
        if ns.json:
            _print_json(apps_json(resp), o)
            return 0
        devices, _ = c.call("GetAvailableResources", pb.GetAvailableResourcesRequest(), token=False)
        o.write(apps_table(resp, devices, show_all=ns.all) + "\n")
        return 0

    return _run(prog, argv, build, body, out, env)


# --- request / release -----------------------------------------------------------------------------------
def _nonneg(text: str) -> float:
    """A finite number >= 0 (an amount of memory, a share, a wait)."""
    return _number(text, zero_ok=True)


def _share_pct(text: str) -> float:
    """An SM share, 0-100 % (the daemon refuses more; said here, as a usage error)."""
    value = _nonneg(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f"must be a share within 0..100 %, got {text}")
    return value


# How long a command waits for the daemon to listen and asks again while it answers "not ready, nothing
# changed" (the client stub waits as long: vgpu.client.NOT_READY_WAIT_S).
DEFAULT_WAIT_S = vclient.NOT_READY_WAIT_S


def _wait_option(p: argparse.ArgumentParser, *, first_only: bool = False) -> None:
    p.add_argument("--wait-s", type=_nonneg, default=DEFAULT_WAIT_S,
                   help="while nothing listens on the socket yet (the daemon starting) or the daemon answers that it "
                        "is not ready and changed nothing (its cold-start model still loading just after it starts, "
                        "its state directory full), ask again for up to this long; 0 fails at once "
                        f"(default {DEFAULT_WAIT_S:g} s)" + ("; for the first refresh only" if first_only else ""))


def request_main(argv: Sequence[str] | None = None, prog: str = "vgpu request", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--app", required=True, help="application id")
        p.add_argument("--memory-mib", type=_nonneg, default=None,
                       help="memory to grant (MiB); leave out with --model-type to have the cold-start model size the job")
        p.add_argument("--sm-pct", type=_share_pct, default=0.0,
                       help="SM share to grant (%%); recorded and planned with, not enforced (no MPS limit is set)")
        p.add_argument("--device", default="",
                       help="the GPU: its index (as vgpu available shows it) or UUID (default: the allocator chooses)")
        p.add_argument("--priority", type=INT32, default=0,
                       help="under contention lower priorities yield first (negative allowed; default 0)")
        p.add_argument("--pid", type=UINT32, default=0, help="process holding the grant: kept while it runs, released server.exit_release_s (default 5 s) "
                            "after it exits (server.idle_release_s, default 120 s, where the daemon cannot see it run)")
        p.add_argument("--json", action="store_true", help="print the grant as JSON")
        _wait_option(p)
        job = p.add_argument_group("job (vgpu.v1.JobConfig), for sizing it before it has a history")
        job.add_argument("--model-type", default="", help="e.g. resnet50, bert-base")
        job.add_argument("--batch-size", type=UINT32, default=0)
        job.add_argument("--param-count", type=UINT64, default=0)
        job.add_argument("--input-size", type=UINT32, default=0)
        job.add_argument("--num-layers", type=UINT32, default=0)
        job.add_argument("--precision", default="", help=f"one of {', '.join(PRECISIONS)} (default {PRECISIONS[0]})")
        job.add_argument("--optimizer", default="")
        job.add_argument("--mode", default="", help=f"one of {', '.join(MODES)} (default {MODES[0]})")

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        # The job goes to the daemon only with its model type; its other fields alone would be dropped.
        stray = [f"--{name.replace('_', '-')}" for name in _JOB_DETAILS if getattr(ns, name)]
        if stray and not ns.model_type:
            raise UsageError(f"{', '.join(stray)} describe{'s' if len(stray) == 1 else ''} a job only with "
                             "--model-type (e.g. resnet50): give it too, or leave "
                             f"{'it' if len(stray) == 1 else 'them'} out")
        if ns.memory_mib is None and not ns.model_type:
            raise UsageError("give --memory-mib, or describe the job (--model-type, --batch-size, ...) to have it sized")
        job = _check_job(ns) if ns.model_type else None
        if ns.model_type and not ns.param_count and known_model(ns.model_type) is None:
            # a model of one's own is sized all the same (from --param-count, when given: then nothing
            # is said); a typo should not pass unnoticed
            print(f"{prog}: warning: {unknown_model_note(ns.model_type)}", file=sys.stderr)
        said = job.optimizer_note() if job is not None and not ns.memory_mib else None
        if said is not None:
            # sized as Adam, as with no optimizer given; a typo should not pass unnoticed either
            print(f"{prog}: warning: {said}", file=sys.stderr)
        req = pb.RequestResourceAllocationRequest(
            request=pb.ResourceRequest(
                app_id=ns.app, memory_mib=ns.memory_mib or 0.0, sm_pct=ns.sm_pct, device_id=_device_arg(c, ns.device),
                priority=ns.priority, pid=ns.pid,
            )
        )
        if ns.model_type:
            req.request.job.CopyFrom(pb.JobConfig(
                model_type=ns.model_type, batch_size=ns.batch_size, param_count=ns.param_count,
                input_size=ns.input_size, num_layers=ns.num_layers, precision=ns.precision,
                optimizer=ns.optimizer, mode=ns.mode,
            ))
        resp, call = c.call("RequestResourceAllocation", req, app_id=ns.app)
        trailers = dict(call.trailing_metadata() or ())
        token = trailers.get(auth.APP_TOKEN_TRAILER)
        saved = None
        if token:
            try:
                saved = c.tokens.remember(ns.app, token)
            except OSError as exc:  # the grant stands; say where else the token is
                print(f"{prog}: could not save the application token ({exc}); the daemon keeps it in "
                      f"<state-dir>/tokens/apps/ (readable by root); once the application's grants are released, "
                      f"this user may request for {ns.app!r} again and is given the token anew", file=sys.stderr)
        grant = _dict(resp.grant)
        if ns.json:
            _print_json(grant, o)
        else:
            sized = (f" (the job sized at {resp.grant.cold_start_mib:,.0f} MiB)"
                     if resp.grant.HasField("cold_start_mib") else "")
            # the grant the process (--pid) already held for this job: nothing new was granted
            held = (" (already held by this process for this job: no second grant)"
                    if trailers.get(vclient.GRANT_HELD_TRAILER) == resp.grant.grant_id else "")
            # rounded as the tables show them (a sized grant is 12250.8 MiB, 63.8274 %); --json has them exact
            o.write(f"{'held' if held else 'granted'} {grant['grant_id']}: {resp.grant.memory_mib:,.0f} MiB, "
                    f"{resp.grant.sm_pct:.0f} % SM on {resp.grant.device_id} for {resp.grant.app_id}{sized}{held}\n")
        if saved is not None:
            print(f"{prog}: application token for {ns.app!r} saved in {saved}", file=sys.stderr)
        if not ns.pid:
            print(f"{prog}: {LEASE_NOTE.format(app=ns.app)}", file=sys.stderr)
        return 0

    return _run(prog, argv, build, body, out, env)


# Said after a grant asked for with no --pid: nothing ties it to a process, so it lasts only while the
# application shows other signs of life (docs/allocation.md, "idle release"); a new user would otherwise
# find it gone two minutes later with no word why.
LEASE_NOTE = ("note: no --pid, so no process holds this grant: unless {app!r} shows it is alive (a profiler "
              "sees it, or a client stub of it watches its grants), the daemon releases it after "
              "server.idle_release_s (default 120 s) without a sign of life; --pid ties it to a running process")


# The job's fields besides its model type (`vgpu request`'s options of the same names).
_JOB_DETAILS = ("batch_size", "param_count", "input_size", "num_layers", "precision", "optimizer", "mode")


def _check_job(ns: argparse.Namespace) -> JobConfig:
    """UsageError for a job the daemon would refuse INVALID_ARGUMENT, checked as it checks it: every
    job by vgpu.jobs.JobConfig (its precision and mode among PRECISIONS and MODES), and a job to be
    sized (no --memory-mib) by JobConfig.check_sizable (a batch of at least 1)."""
    try:
        job = JobConfig(ns.model_type, ns.param_count, ns.batch_size, ns.input_size, ns.num_layers, ns.precision,
                        ns.optimizer, ns.mode)
        if not ns.memory_mib:
            job.check_sizable()
        return job
    except InvalidJobConfig as exc:
        # the message names the job's field; the option of the same name says it as typed
        field = next((f for f in ("model_type", *_JOB_DETAILS) if re.search(rf"\b{f}\b", str(exc))), None)
        flag = f"--{field.replace('_', '-')}: " if field else ""
        raise UsageError(f"{flag}the job cannot be {'sent' if ns.memory_mib else 'sized'}: {exc}") from None


def _owner_of(c: Client, grant_id: str) -> str | None:
    try:
        resp, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
    except CliError:
        return None
    for a in resp.apps:
        if any(g.grant_id == grant_id for g in a.grants):
            return str(a.app_id)
    return None


def release_main(argv: Sequence[str] | None = None, prog: str = "vgpu release", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--grant", required=True, help="grant id (from vgpu request / vgpu apps)")
        p.add_argument("--app", help="the grant's application, to pick its token (default: looked up)")
        p.add_argument("--json", action="store_true", help="print the released grant as JSON")
        _wait_option(p)

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        app = ns.app or _owner_of(c, ns.grant)
        try:
            resp, _ = c.call("ReleaseResources", pb.ReleaseResourcesRequest(grant_id=ns.grant), app_id=app)
        except CliError as exc:
            if str(exc).startswith("NOT_FOUND"):
                # the usual cause: it is gone already, and the daemon's reply cannot say how
                raise CliError(f"{exc}: no application holds it now (released already: by a release, by its "
                               "application's close, or by the daemon once the application went idle or its "
                               "process ended); `vgpu apps` lists the grants held") from None
            raise
        if ns.json:
            _print_json(_dict(resp.released), o)
        else:
            o.write(f"released {resp.released.grant_id} ({resp.released.memory_mib:,.0f} MiB of {resp.released.app_id})\n")
        return 0

    return _run(prog, argv, build, body, out, env)


# --- set-limit -------------------------------------------------------------------------------------------
SET_LIMIT_HELP = """Cap an application (needs the operator token).

A cap covers every grant of the application, the grants it holds now included: the daemon cuts grants
over a new memory or SM cap down to it at once (largest first) and logs every change (limits_set). The
flags given change those values; the others keep their current ones. An application the daemon does not
know (vgpu apps --all) is refused unless --create, so a typo does not leave a limit behind for an app that
will never come. --clear removes the memory and SM caps (the priority stays; --priority 0 resets it)."""


def set_limit_main(argv: Sequence[str] | None = None, prog: str = "vgpu set-limit", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.description = SET_LIMIT_HELP
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.add_argument("--app", required=True, help="application id (as vgpu apps lists it)")
        p.add_argument("--max-memory-mib", type=_nonneg,
                       help="most GPU memory (MiB) all the application's grants may hold together")
        p.add_argument("--max-sm-pct", type=_share_pct, help="most SM share (%%) all its grants may hold together")
        p.add_argument("--priority", type=INT32,
                       help="the application's priority: under contention lower priorities yield first (negative "
                            "allowed); it overrides what its requests ask for and applies to the grants it holds")
        p.add_argument("--clear", action="store_true", help="remove the memory and SM caps")
        p.add_argument("--create", action="store_true",
                       help="set limits for an application the daemon does not list yet (one that has not started)")
        p.add_argument("--json", action="store_true", help="print the application's limits as JSON")
        _wait_option(p)

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        changes = {k: v for k, v in (("max_memory_mib", ns.max_memory_mib), ("max_sm_pct", ns.max_sm_pct),
                                     ("priority", ns.priority)) if v is not None}
        if ns.clear and (ns.max_memory_mib is not None or ns.max_sm_pct is not None):
            raise UsageError("--clear removes the caps: give it alone (or with --priority)")
        if not changes and not ns.clear:
            raise UsageError("nothing to set: give --max-memory-mib, --max-sm-pct or --priority "
                             "(--clear removes the caps)")
        listed, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
        current = next((a for a in listed.apps if a.app_id == ns.app), None)
        if current is None and not ns.create:
            known = ", ".join(a.app_id for a in listed.apps) or "none"
            raise CliError(f"NOT_FOUND: no application {ns.app!r} on this daemon (it lists: {known}); "
                           "--create sets limits for one that has not started yet")
        lim = pb.AppLimits(app_id=ns.app)
        if current is not None and current.HasField("limits") and not ns.clear:
            lim.CopyFrom(current.limits)  # the flags not given keep their values
        if ns.clear:
            lim.ClearField("max_memory_mib")
            lim.ClearField("max_sm_pct")
        for key, value in changes.items():
            setattr(lim, key, value)
        try:
            resp, _ = c.call("SetResourceLimits", pb.SetResourceLimitsRequest(limits=lim))
        except CliError as exc:
            if not str(exc).startswith("UNAUTHENTICATED"):
                raise
            raise CliError(f"{exc}; {_operator_token_hint(c.tokens)}") from None
        after, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
        app = next((a for a in after.apps if a.app_id == ns.app), None)
        if ns.json:
            _print_json(_dict(resp.limits), o)
        else:
            o.write(f"limits of {ns.app}: {json.dumps(_dict(resp.limits), sort_keys=True)}\n")
        if app is not None and resp.limits.HasField("max_memory_mib"):
            cap = resp.limits.max_memory_mib
            granted = sum(g.memory_mib for g in app.grants)
            if current is not None and sum(g.memory_mib for g in current.grants) > granted:
                print(f"{prog}: {ns.app}'s grants were cut to {granted:g} MiB to fit the cap", file=sys.stderr)
            if app.mem_used_mib > cap:
                print(f"{prog}: warning: {ns.app} uses {app.mem_used_mib:,.0f} MiB now, above its cap of "
                      f"{cap:,.0f} MiB; it may run out of memory", file=sys.stderr)
        return 0

    return _run(prog, argv, build, body, out, env)


# --- forget-app ------------------------------------------------------------------------------------------
FORGET_APP_HELP = """Drop the claims of application ids that hold nothing (needs the operator token).

An application id is claimed by its first request (or the operator's first grant for it) and stays
claimed after its grants are gone, across restarts too; claims count against
auth.max_self_registered_apps and, per claiming uid, auth.max_self_registered_apps_per_uid. This
drops the claims of the ids named (--app), and of every id a uid self-registered (--uid), that hold no
grant and no limits (`vgpu apps --all` lists them, claimed); the others are kept and said why. A
dropped id may be claimed again by anyone; its old token is then valid for it again, so forget the
ids of a user you do not trust only where nobody else will use the same ids."""


def forget_app_main(argv: Sequence[str] | None = None, prog: str = "vgpu forget-app", *, out: TextIO | None = None,
                    env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.description = FORGET_APP_HELP
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.add_argument("--app", action="append", default=[], help="an application id to forget (repeat for more)")
        p.add_argument("--uid", type=_whole(0, 2**32 - 1),
                       help="forget every id this uid self-registered that holds nothing")
        p.add_argument("--json", action="store_true", help="print what was forgotten and kept as JSON")
        _wait_option(p)

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        if not ns.app and ns.uid is None:
            raise UsageError("nothing to forget: give --app ID (repeat for more) or --uid N")
        req = pb.ForgetApplicationsRequest(app_ids=ns.app)
        if ns.uid is not None:
            req.claimed_by_uid = ns.uid
        try:
            resp, _ = c.call("ForgetApplications", req)
        except CliError as exc:
            if not str(exc).startswith(("UNAUTHENTICATED", "PERMISSION_DENIED")):
                raise
            raise CliError(f"{exc}; {_operator_token_hint(c.tokens)}") from None
        if ns.json:
            _print_json(_dict(resp), o)
        else:
            o.write(f"forgot {len(resp.forgotten)} application id(s)" + (": " + ", ".join(resp.forgotten) if
                                                                          resp.forgotten else "") + "\n")
            for k in resp.kept:
                o.write(f"kept {k.app_id}: {k.reason}\n")
        return 0

    return _run(prog, argv, build, body, out, env)


def _operator_token_hint(tokens: Tokens) -> str:
    """Where the operator token was looked for and how to pass it, for a refused operator call."""
    path = auth.role_token_file("operator", tokens.state_dir)
    if tokens.explicit is not None:
        found = "the token given (--token-file, $VGPU_TOKEN_FILE or $VGPU_TOKEN) is not the operator's"
    elif path.exists():
        found = f"the operator token {path} is not readable by this user"
    else:
        found = f"no operator token at {path}"
    return (f"{found}: pass the daemon's state directory with --state-dir (it holds tokens/operator.token), "
            "or the token file with --token-file or $VGPU_TOKEN_FILE, as a user who may read it")


# --- top -------------------------------------------------------------------------------------------------
def top_main(
    argv: Sequence[str] | None = None,
    prog: str = "vgpu top",
    *,
    out: TextIO | None = None,
    env: dict[str, str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """On a terminal, the full-screen view of vgpu/top.py (`q` quits); otherwise plain tables every
    interval (`--iterations` of them, or until interrupted)."""
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--interval-s", type=_positive, default=1.0, help="refresh period (default 1 s)")
        p.add_argument("--iterations", type=_whole(0, 2**31 - 1), default=0,
                       help="stop after N refreshes (default 0: until q or Ctrl-C)")
        p.add_argument("--plain", action="store_true", help="plain tables even on a terminal")
        p.add_argument("-a", "--all", action="store_true",
                       help="also list the applications that hold nothing now (as vgpu apps --all)")
        _wait_option(p, first_only=True)

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        if not ns.plain and o is sys.stdout and o.isatty() and sys.stdin.isatty():
            return _top_screen(ns, c)
        n = 0
        deadline = clock()
        while ns.iterations <= 0 or n < ns.iterations:
            devices, _ = c.call("GetAvailableResources", pb.GetAvailableResourcesRequest(), token=False)
            apps, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
            stamp = time.strftime("%H:%M:%S")
            o.write(f"vgpu top  {stamp}  {c.socket_path}\n\n{devices_table(devices, apps)}\n\n"
                    f"{apps_table(apps, devices, show_all=ns.all)}\n\n")
            o.flush()
            c.wait_s = 0.0  # --wait-s covers the first refresh: a daemon that goes away later is said at once
            n += 1
            if ns.iterations > 0 and n >= ns.iterations:
                break
            deadline += ns.interval_s
            sleep(max(0.0, deadline - clock()))
        return 0

    return _run(prog, argv, build, body, out, env)


def _top_screen(ns: argparse.Namespace, c: Client) -> int:
    from vgpu import top

    last: list[top.Snapshot] = []

    def fetch() -> top.Snapshot:
        try:
            devices, _ = c.call("GetAvailableResources", pb.GetAvailableResourcesRequest(), token=False)
            apps, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
            if not ns.all:  # as `vgpu apps`: what holds resources
                apps = pb.ListApplicationsResponse(apps=[a for a in apps.apps if not holds_nothing(a)])
            history, _ = c.call("GetAppHistory", pb.GetAppHistoryRequest(since_s=top.SPARK_WINDOW_S), token=False)
        except CliError as exc:
            if not last:
                raise
            snap = top.Snapshot(last[-1].devices, last[-1].apps, last[-1].history, time.time(), str(exc))
        else:
            snap = top.Snapshot(devices, apps, history, history.now_unix_s or time.time())
            c.wait_s = 0.0  # --wait-s covers the first refresh: later ones show a daemon gone at once
        last[:] = [snap]
        return snap

    return top.run(fetch, interval_s=ns.interval_s, socket=c.socket_path, iterations=ns.iterations,
                   stdin_fd=sys.stdin.fileno())
