"""Operator and application commands over the daemon's socket.

    vgpu available --socket PATH [--device ID] [--json]
    vgpu apps      --socket PATH [--json]
    vgpu request   --socket PATH --app ID --memory-mib N [--sm-pct P] [--device ID] [--priority N] [--pid N] [--json]
    vgpu request   --socket PATH --app ID --model-type NAME --batch-size N [job flags...]   (cold-start sized)
    vgpu release   --socket PATH --grant ID [--json]
    vgpu set-limit --socket PATH --app ID [--max-memory-mib N] [--max-sm-pct P] [--priority N] [--json]
    vgpu top       --socket PATH [--interval-s 1] [--iterations N]

Tokens (vgpu/auth.py). A command sends, in order until one is accepted: the token of `--token-file`
or `$VGPU_TOKEN_FILE` or `$VGPU_TOKEN`; for an application's grants, the application token this
user was handed by an earlier `vgpu request` (kept in `~/.config/vgpu/tokens/`, 0600, per socket)
or found readable in `<state-dir>/tokens/apps/`; the operator token `<state-dir>/tokens/operator.token`
when readable; finally nothing (a new application may claim its id without a token). A token the
daemon rejects as not its own (a new state directory) is dropped from the cache.

Exit status: 0 done, 1 the daemon refused or could not be reached (the message says why), 2 usage
or configuration error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from vgpu import auth
from vgpu import config as vconfig
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

T = TypeVar("T")


class CliError(Exception):
    """A refusal or failure to report as `PROG: message` with exit status 1."""


# --- tokens ----------------------------------------------------------------------------------------------
def token_cache_dir(socket_path: str, env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    base = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME", "~")).expanduser() / ".config")
    key = hashlib.sha256(os.path.realpath(socket_path).encode()).hexdigest()[:16]
    return base / "vgpu" / "tokens" / key


def _read_token(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


class Tokens:
    """Where this command finds tokens (see the module docstring)."""

    def __init__(self, socket_path: str, state_dir: Path, token_file: Path | None, env: dict[str, str] | None = None) -> None:
        self.env = dict(os.environ) if env is None else env
        self.cache = token_cache_dir(socket_path, self.env)
        self.state_dir = state_dir
        explicit = token_file or (Path(self.env["VGPU_TOKEN_FILE"]) if self.env.get("VGPU_TOKEN_FILE") else None)
        self.explicit: str | None = None
        if explicit is not None:
            self.explicit = _read_token(explicit)
            if self.explicit is None:
                raise CliError(f"cannot read a token from {explicit}")
        elif self.env.get("VGPU_TOKEN"):
            self.explicit = self.env["VGPU_TOKEN"].strip()

    def app_cache_path(self, app_id: str) -> Path:
        return self.cache / auth.app_token_filename(app_id)

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
        path = self.app_cache_path(app_id)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        return path


# --- calls -----------------------------------------------------------------------------------------------
class Client:
    def __init__(self, socket_path: str, tokens: Tokens, timeout_s: float) -> None:
        self.socket_path = socket_path
        self.tokens = tokens
        self.timeout_s = timeout_s
        target = socket_path if socket_path.startswith("unix:") else f"unix:{os.path.abspath(socket_path)}"
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.AllocatorStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def call(self, method: str, request: Message, *, app_id: str | None = None, token: bool = True) -> tuple[Any, Any]:
        """(response, call); tries token candidates in order while the daemon answers UNAUTHENTICATED
        or PERMISSION_DENIED for a token that is not the right one."""
        fn = getattr(self.stub, method).with_call
        last: grpc.RpcError | None = None
        candidates = self.tokens.candidates(app_id) if token else iter([(None, None)])
        for tok, cached in candidates:
            md = auth.bearer(tok) if tok else ()
            try:
                # with_call gives (response, call); the response's type depends on `method`.
                answer: tuple[Any, Any] = fn(request, metadata=md, timeout=self.timeout_s)
                return answer
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAVAILABLE and not _unreachable(exc):
                    # the daemon answered: a full state directory, a model still loading
                    raise CliError(f"{code.name}: {exc.details()}") from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise CliError(
                        f"cannot reach the vgpu daemon at {self.socket_path} ({exc.details()}); "
                        "is vgpu-manager running, and may you open its socket?"
                    ) from None
                if code == grpc.StatusCode.UNAUTHENTICATED and cached is not None:
                    cached.unlink(missing_ok=True)  # issued by another daemon instance
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) and tok is not None:
                    last = exc
                    continue
                raise CliError(f"{code.name}: {exc.details()}") from None
        assert last is not None
        raise CliError(f"{last.code().name}: {last.details()}")


def _unreachable(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE because no connection could be made (no socket, refused, no permission), not
    because the daemon answered UNAVAILABLE."""
    text = f"{exc.details()} {getattr(exc, 'debug_error_string', lambda: '')()}".lower()
    return any(s in text for s in ("failed to connect", "connection refused", "no such file", "permission denied"))


def _dict(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _print_json(obj: object, out: TextIO) -> None:
    out.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help=f"daemon socket (default: server.socket of the configuration, {vconfig.DEFAULT_SOCKET_PATH})")
    p.add_argument("--state-dir", help=f"daemon state directory, to find readable tokens (default {vconfig.DEFAULT_STATE_DIR})")
    p.add_argument("--token-file", type=Path, help="send the token in this file")
    p.add_argument("--config", type=Path, help="configuration file (default /etc/vgpu/vgpu.toml if present)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="per-call timeout (default 10 s)")


def _run(
    prog: str,
    argv: Sequence[str] | None,
    build: Callable[[argparse.ArgumentParser], None],
    body: Callable[[argparse.Namespace, Client, TextIO], int],
    out: TextIO | None = None,
    env: dict[str, str] | None = None,
) -> int:
    p = argparse.ArgumentParser(prog=prog)
    _common(p)
    build(p)
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
        client = Client(socket_path, Tokens(socket_path, state_dir, ns.token_file, env), ns.timeout_s)
        return body(ns, client, out)
    except CliError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if client is not None:
            client.close()


# --- available -------------------------------------------------------------------------------------------
def _fmt(x: float, unit: str = "") -> str:
    return "-" if not math.isfinite(x) else f"{x:,.0f}{unit}"


def devices_table(resp: pb.GetAvailableResourcesResponse) -> str:
    lines = [f"{'DEVICE':<42} {'NAME':<24} {'TOTAL MiB':>10} {'GRANTED':>10} {'FREE':>10} {'SM FREE':>8} {'POWER W':>8}"]
    for d in resp.devices:
        power = f"{d.power_limit_mw / 1000:.0f}" if d.power_limit_mw else "-"
        lines.append(
            f"{d.device_id:<42} {d.name[:24]:<24} {_fmt(d.mem_total_mib):>10} {_fmt(d.mem_granted_mib):>10} "
            f"{_fmt(d.mem_available_mib):>10} {d.sm_available_pct:>7.0f}% {power:>8}"
        )
        for inst in d.mig_instances:
            lines.append(f"  MIG {inst.profile:<10} start {inst.start} size {inst.size} {inst.mem_total_mib:,.0f} MiB")
    return "\n".join(lines)


def available_main(argv: Sequence[str] | None = None, prog: str = "vgpu available", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", default="", help="one device (UUID)")
        p.add_argument("--json", action="store_true", help="print JSON")

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        resp, _ = c.call("GetAvailableResources", pb.GetAvailableResourcesRequest(device_id=ns.device), token=False)
        if ns.json:
            _print_json(_dict(resp), o)
        else:
            o.write(devices_table(resp) + "\n")
        return 0

    return _run(prog, argv, build, body, out, env)


# --- apps ------------------------------------------------------------------------------------------------
def apps_table(resp: pb.ListApplicationsResponse) -> str:
    lines = [f"{'APP':<24} {'GRANTS':>6} {'GRANTED MiB':>12} {'USED MiB':>10} {'P90 MiB':>10} {'SM %':>6} {'P90 SM %':>8}"]
    for a in resp.apps:
        granted = sum(g.memory_mib for g in a.grants)
        lines.append(
            f"{a.app_id[:24]:<24} {len(a.grants):>6} {granted:>12,.0f} {_fmt(a.mem_used_mib):>10} "
            f"{_fmt(a.forecast_mem_p90_mib):>10} {a.sm_util_pct:>6.0f} {a.forecast_sm_p90_pct:>8.0f}"
        )
    return "\n".join(lines)


def apps_main(argv: Sequence[str] | None = None, prog: str = "vgpu apps", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON")

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        resp, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
        if ns.json:
            _print_json(_dict(resp), o)
        else:
            o.write(apps_table(resp) + "\n")
        return 0

    return _run(prog, argv, build, body, out, env)


# --- request / release -----------------------------------------------------------------------------------
def _nonneg(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def request_main(argv: Sequence[str] | None = None, prog: str = "vgpu request", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--app", required=True, help="application id")
        p.add_argument("--memory-mib", type=_nonneg, default=None,
                       help="memory to grant (MiB); leave out with --model-type to have the cold-start model size the job")
        p.add_argument("--sm-pct", type=_nonneg, default=0.0, help="SM share to grant (%%)")
        p.add_argument("--device", default="", help="device UUID (default: the allocator chooses)")
        p.add_argument("--priority", type=int, default=0)
        p.add_argument("--pid", type=int, default=0, help="process holding the grant (released when it exits)")
        p.add_argument("--json", action="store_true", help="print the grant as JSON")
        job = p.add_argument_group("job (vgpu.v1.JobConfig), for sizing it before it has a history")
        job.add_argument("--model-type", default="", help="e.g. resnet50, bert-base")
        job.add_argument("--batch-size", type=int, default=0)
        job.add_argument("--param-count", type=int, default=0)
        job.add_argument("--input-size", type=int, default=0)
        job.add_argument("--num-layers", type=int, default=0)
        job.add_argument("--precision", default="", help="fp32 (default), fp16, bf16 or amp")
        job.add_argument("--optimizer", default="")
        job.add_argument("--mode", default="", help="train (default) or infer")

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        if ns.memory_mib is None and not ns.model_type:
            raise CliError("give --memory-mib, or describe the job (--model-type, --batch-size, ...) to have it sized")
        req = pb.RequestResourceAllocationRequest(
            request=pb.ResourceRequest(
                app_id=ns.app, memory_mib=ns.memory_mib or 0.0, sm_pct=ns.sm_pct, device_id=ns.device,
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
                      f"<state-dir>/tokens/apps/", file=sys.stderr)
        grant = _dict(resp.grant)
        if ns.json:
            _print_json(grant, o)
        else:
            o.write(f"granted {grant['grant_id']}: {resp.grant.memory_mib:g} MiB, {resp.grant.sm_pct:g} % SM "
                    f"on {resp.grant.device_id} for {resp.grant.app_id}\n")
        if saved is not None:
            print(f"{prog}: application token for {ns.app!r} saved in {saved}", file=sys.stderr)
        return 0

    return _run(prog, argv, build, body, out, env)


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

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        app = ns.app or _owner_of(c, ns.grant)
        resp, _ = c.call("ReleaseResources", pb.ReleaseResourcesRequest(grant_id=ns.grant), app_id=app)
        if ns.json:
            _print_json(_dict(resp.released), o)
        else:
            o.write(f"released {resp.released.grant_id} ({resp.released.memory_mib:g} MiB of {resp.released.app_id})\n")
        return 0

    return _run(prog, argv, build, body, out, env)


# --- set-limit -------------------------------------------------------------------------------------------
def set_limit_main(argv: Sequence[str] | None = None, prog: str = "vgpu set-limit", *, out: TextIO | None = None, env: dict[str, str] | None = None) -> int:
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--app", required=True)
        p.add_argument("--max-memory-mib", type=_nonneg)
        p.add_argument("--max-sm-pct", type=_nonneg)
        p.add_argument("--priority", type=int)
        p.add_argument("--json", action="store_true")

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        lim = pb.AppLimits(app_id=ns.app)
        if ns.max_memory_mib is not None:
            lim.max_memory_mib = ns.max_memory_mib
        if ns.max_sm_pct is not None:
            lim.max_sm_pct = ns.max_sm_pct
        if ns.priority is not None:
            lim.priority = ns.priority
        resp, _ = c.call("SetResourceLimits", pb.SetResourceLimitsRequest(limits=lim))
        if ns.json:
            _print_json(_dict(resp.limits), o)
        else:
            o.write(f"limits of {ns.app}: {json.dumps(_dict(resp.limits), sort_keys=True)}\n")
        return 0

    return _run(prog, argv, build, body, out, env)


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
    def build(p: argparse.ArgumentParser) -> None:
        p.add_argument("--interval-s", type=float, default=1.0, help="refresh period (default 1 s)")
        p.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (default: until Ctrl-C)")

    def body(ns: argparse.Namespace, c: Client, o: TextIO) -> int:
        if ns.interval_s <= 0:
            raise CliError("--interval-s must be > 0")
        clear = "\x1b[H\x1b[2J" if o.isatty() else ""
        n = 0
        deadline = clock()
        while ns.iterations <= 0 or n < ns.iterations:
            devices, _ = c.call("GetAvailableResources", pb.GetAvailableResourcesRequest(), token=False)
            apps, _ = c.call("ListApplications", pb.ListApplicationsRequest(), token=False)
            stamp = time.strftime("%H:%M:%S")
            o.write(f"{clear}vgpu top  {stamp}  {c.socket_path}\n\n{devices_table(devices)}\n\n{apps_table(apps)}\n\n")
            o.flush()
            n += 1
            if ns.iterations > 0 and n >= ns.iterations:
                break
            deadline += ns.interval_s
            sleep(max(0.0, deadline - clock()))
        return 0

    return _run(prog, argv, build, body, out, env)
