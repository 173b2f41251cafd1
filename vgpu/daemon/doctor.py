"""`vgpu doctor`: what a GPU server is missing for vgpu, one line per check.

    vgpu doctor [--config FILE] [--socket PATH] [--state-dir DIR] [--backend SPEC] [--model FILE] [--max-signature-age-s S] [--json]

Checks, each OK / WARN / FAIL with what to do: the configuration loads and the users and groups it names exist; which backend the driver and
NVML checks are for (`backend`: the one the daemon answering on the socket reports it runs on,
GetAvailableResources' `backend`; the configured one, server.backend, when no daemon answers or it
does not say; `--backend` wins, a daemon on another one is a warning); for `nvml` the NVIDIA driver
is loaded (/proc/driver/nvidia/version) and NVML initialises and lists devices, and whether each
device has per-cgroup memory limits (`memlimits`: WARN naming the GPUs whose driver lacks
nvmlDeviceSetMemoryLimits_v1, where memory grants stay cooperative, and those whose read NVML refused
or failed, which could not be checked: never OK then), for a `sim:` backend
no driver is needed and the simulated devices are listed (the daemon's, else the spec's: a spec
`vgpu serve` would refuse fails); the process may write device
settings (root or CAP_SYS_ADMIN); the daemon's socket exists, has no bits for "other", answers a
health check, and, where it is given a group of its own, every directory above it lets that group
through (`socket_dirs_shutting_out`); the state directory is writable; the in-app directory
(`server.inapp_dir`) is one the daemon accepts and every user's applications can write to (`inapp dir`:
FAIL where the daemon would refuse it, WARN where it is missing or not 1777); the forecaster checkpoint loads;
the node-local model (`<state dir>/models/local.pt`, manager/nodelearn.py) loads as the daemon loads it
(`local model`: WARN when it does not, since the global model serves without it, with what to do), and so do
the node-local trees (`<state dir>/models/trees.json`, manager/nodetrees.py; `node trees`, likewise); a profiler is
streaming to the daemon, and for every GPU how old the newest signature is (`profiler`, one line
per GPU: FAIL when no profiler stream is open, or when applications hold grants on a GPU whose
newest signature is older than `--max-signature-age-s`; an idle GPU has no signature to send). Exit
status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TextIO

from vgpu import config as vconfig

if TYPE_CHECKING:
    from vgpu.device.base import Backend
    from vgpu.v1 import allocator_pb2 as pb

Status = Literal["OK", "WARN", "FAIL"]
CAP_SYS_ADMIN = 21
CAP_SYS_PTRACE = 19


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<10} {self.detail}"


def check_driver(proc_root: Path = Path("/proc"), *, required: bool = True) -> Check:
    path = proc_root / "driver" / "nvidia" / "version"
    try:
        first = path.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return Check("driver", "FAIL" if required else "WARN",
                     f"no NVIDIA driver loaded ({path} is missing): install the driver and `modprobe nvidia`")
    return Check("driver", "OK", first)


def check_nvml(open_backend: Callable[[], Backend] | None = None, *, required: bool = True) -> Check:
    """nvmlInit through the NVML backend (the one module that imports pynvml)."""
    try:
        if open_backend is None:
            from vgpu.device.nvml import NvmlBackend

            open_backend = NvmlBackend
        backend = open_backend()
    except Exception as exc:  # noqa: BLE001 - every failure is the answer
        # the NVML backend lists its devices as it opens: the error names the NVML function that failed
        return Check("nvml", "FAIL" if required else "WARN",
                     f"NVML does not open (nvmlInit and the device listing): {type(exc).__name__}: {exc}")
    try:
        devices = list(backend.devices())
        names = ", ".join(sorted({d.name for d in devices})) or "none"
    except Exception as exc:  # noqa: BLE001 - every failure is the answer
        return Check("nvml", "FAIL" if required else "WARN",
                     f"nvmlInit OK, but listing the devices failed: {type(exc).__name__}: {exc}")
    else:
        return Check("nvml", "OK" if devices else "WARN", f"nvmlInit OK, {len(devices)} device(s): {names}")
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()


def check_memory_limits(open_backend: Callable[[], Backend] | None = None, *, enabled: bool = True) -> Check:
    """Whether each device's driver has per-cgroup memory limits (the daemon's own question at start,
    `CgroupMemoryLimits.probe`: a read of the root cgroup's limits, nothing written). A device without
    them is a fact of the node, not a failure: memory grants there stay cooperative, and the daemon
    exports `vgpu_enforcement_unsupported`, which no alert fires on. A read NVML refuses (NoPermission:
    the doctor runs without privilege) or that fails otherwise says nothing about support: the line is
    a WARN naming what could not be checked, never OK."""
    if not enabled:
        return Check("memlimits", "OK", "off (server.cgroup_memory_limits = false): memory grants are cooperative only")
    from vgpu.device.errors import DeviceError, NoPermission, NotSupported

    try:
        if open_backend is None:
            from vgpu.device.nvml import NvmlBackend

            open_backend = NvmlBackend
        backend = open_backend()
    except Exception as exc:  # noqa: BLE001 - said by the nvml check
        return Check("memlimits", "WARN", f"not checked: NVML does not open ({type(exc).__name__})")
    lacking: dict[str, str] = {}  # GPU -> why it has no limits (NotSupported)
    unknown: dict[str, str] = {}  # GPU -> why its answer says nothing (NoPermission, another error)
    refused = False
    try:
        try:
            devices = list(backend.devices())
        except Exception as exc:  # noqa: BLE001 - said by the nvml check
            return Check("memlimits", "WARN", f"not checked: listing the devices failed ({type(exc).__name__})")
        for dev in devices:
            gpu = f"{dev.index} ({dev.uuid})"
            try:
                dev.memory_limit_mib("/")
            except NotSupported as exc:
                lacking[gpu] = f"{type(exc).__name__}: {exc}"
            except NoPermission as exc:
                refused = True
                unknown[gpu] = f"{type(exc).__name__}: {exc}"
            except DeviceError as exc:
                unknown[gpu] = f"{type(exc).__name__}: {exc}"
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    if lacking:
        reason = next(iter(lacking.values()))
        text = (f"GPU {', '.join(lacking)}: no per-cgroup memory limits ({reason}); memory grants there stay "
                "cooperative (never hard caps). They need a driver and nvidia-ml-py with nvmlDeviceSetMemoryLimits_v1 "
                "(R615 / 13.615 or newer); until then the daemon reports vgpu_enforcement_unsupported = 1, not an alert")
        if unknown:
            text += f"; could not check GPU {', '.join(unknown)} ({next(iter(unknown.values()))})"
        return Check("memlimits", "WARN", text)
    if unknown:
        fix = ("no permission: run `sudo vgpu doctor` (the daemon runs as root)" if refused else
               "NVML answered with an error")
        return Check("memlimits", "WARN", f"could not check GPU {', '.join(unknown)}: {fix} "
                     f"({next(iter(unknown.values()))})")
    return Check("memlimits", "OK", f"per-cgroup memory limits available on {len(devices)} device(s)")


def _cap_eff(status_text: str) -> int:
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privileges(euid: int | None = None, proc_status: str | None = None) -> Check:
    euid = os.geteuid() if euid is None else euid
    if proc_status is None:
        try:
            proc_status = Path("/proc/self/status").read_text()
        except OSError:
            proc_status = ""
    has_cap = bool(_cap_eff(proc_status) & (1 << CAP_SYS_ADMIN))
    if euid == 0 and has_cap:
        return Check("privileges", "OK", "root with CAP_SYS_ADMIN: power limits and MIG can be written")
    if has_cap:
        return Check("privileges", "OK", f"uid {euid} with CAP_SYS_ADMIN")
    return Check("privileges", "WARN",
                 f"uid {euid} without CAP_SYS_ADMIN: NVML refuses power-limit and MIG writes "
                 "(the daemon runs as root under systemd; this only matters for `vgpu serve` run by hand)")


def check_daemon_capabilities(path: Path, proc_root: Path = Path("/proc")) -> Check | None:
    """The running daemon's own capabilities, read from /proc for the process the kernel names at the
    other end of its socket (SO_PEERCRED): without CAP_SYS_PTRACE it cannot read the pid namespace of
    another user's process (or a root container's), so a request from a container naming another of
    its processes is refused. None when the daemon's process cannot be told or read."""
    import socket as sockets

    from vgpu.peers import peer_cred

    try:
        with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as conn:
            conn.settimeout(2.0)
            conn.connect(str(path))
            pid = peer_cred(conn).pid
        status_text = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None
    if pid <= 0 or not any(line.startswith("CapEff:") for line in status_text.splitlines()):
        return None
    if _cap_eff(status_text) & (1 << CAP_SYS_PTRACE):
        return Check("daemon", "OK", f"pid {pid} holds CAP_SYS_PTRACE: it places the pids containers name")
    return Check("daemon", "WARN", f"pid {pid} lacks CAP_SYS_PTRACE: a request from a container (its own pid "
                 "namespace) naming another of its processes is refused; the shipped unit grants it "
                 "(CapabilityBoundingSet, docs/install.md, Applications in containers)")


def check_socket(path: Path, *, timeout_s: float = 2.0) -> Check:
    try:
        st = path.stat()
    except FileNotFoundError:
        return Check("socket", "FAIL", f"{path} does not exist: is vgpu-manager running? (systemctl status "
                     "vgpu-manager; for a daemon started by hand, `vgpu serve --socket PATH`, give its --socket here)")
    except PermissionError as exc:
        return Check("socket", "FAIL", f"{path}: {exc}; are you in the socket's group?")
    if not stat.S_ISSOCK(st.st_mode):
        return Check("socket", "FAIL", f"{path} is not a socket")
    mode = stat.S_IMODE(st.st_mode)
    try:
        import grp

        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    desc = f"{path} mode {mode:04o} group {group}"
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"unix:{path}") as ch:
            # types-grpcio-health-checking declares HealthStub without its methods.
            check = health_pb2_grpc.HealthStub(ch).Check  # type: ignore[attr-defined]
            resp: health_pb2.HealthCheckResponse = check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        return Check("socket", "FAIL", f"{desc}: no answer ({exc.code().name}: {exc.details()})")
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return Check("socket", "WARN", f"{desc}: daemon answers but is not serving")
    if mode & 0o060 and st.st_gid != _primary_gid(st.st_uid):
        blocked = socket_dirs_shutting_out(path, st.st_gid)
        if blocked:
            return Check("socket", "WARN",
                         f"{desc}, daemon serving, but its group cannot reach it: {'; '.join(blocked)} "
                         f"lets neither the group {group} nor others through; chmod o+x each (or chgrp {group} "
                         "and chmod g+x), as systemd's RuntimeDirectoryMode=0755 leaves /run/vgpu")
    if mode & 0o007:
        return Check("socket", "WARN", f"{desc}: every local user may connect; use 0660 and a group")
    return Check("socket", "OK", f"{desc}, daemon serving")


def _primary_gid(uid: int) -> int | None:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return None


def socket_dirs_shutting_out(path: Path, gid: int) -> list[str]:
    """The directories above `path`, from the root down, that a member of group `gid` who neither owns
    them nor belongs to their own group may not pass through (no search bit: the group's where the
    directory's group is `gid`, else the others'), each as "DIR (mode 0700, group root)". Such a
    directory makes the socket's group bits moot: the group's users get EACCES on connect. Checked
    only for a socket given a group other than its owner's own (server.socket_group), whose group is
    meant to connect; ACLs are not read. A directory that cannot be read here is left out."""
    import grp

    out = []
    for d in reversed(Path(os.path.abspath(path)).parents):
        try:
            st = d.stat()
        except OSError:
            continue
        if not st.st_mode & (stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH):
            try:
                name = grp.getgrgid(st.st_gid).gr_name
            except KeyError:
                name = str(st.st_gid)
            out.append(f"{d} (mode {stat.S_IMODE(st.st_mode):04o}, group {name})")
    return out


DEFAULT_MAX_SIGNATURE_AGE_S = 10.0


def ask_daemon(socket_path: Path, state_dir: Path, *, timeout_s: float = 2.0
               ) -> tuple[pb.GetAvailableResourcesResponse | None, str]:
    """The daemon's GetAvailableResources answer (sent without a token, then with the operator's when
    it is readable), or (None, why not)."""
    import grpc

    from vgpu import auth
    from vgpu.tokenfile import TokenFileError, read_token
    from vgpu.v1 import allocator_pb2 as pb
    from vgpu.v1 import allocator_pb2_grpc as pb_grpc

    try:  # read with its size cap (vgpu/capped.py); a file that holds no token is tried as none
        operator = read_token(auth.role_token_file("operator", state_dir)) or ""
    except TokenFileError:
        operator = ""
    error = ""
    with grpc.insecure_channel(f"unix:{socket_path}") as ch:
        stub = pb_grpc.AllocatorStub(ch)
        for token in ("", operator) if operator else ("",):
            try:
                resp: pb.GetAvailableResourcesResponse = stub.GetAvailableResources(
                    pb.GetAvailableResourcesRequest(), timeout=timeout_s, metadata=auth.bearer(token) if token else ())
                return resp, ""
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
    return None, error


def profiler_start_hint(socket_path: Path, state_dir: Path, backend: str = "") -> str:
    """How to start a profiler for the daemon at `socket_path`: the packaged service, or by hand with
    this daemon's socket and profiler token (and its backend, when it is not the profiler's default)."""
    from vgpu import auth

    argv = ["vgpu", "profiler", "--manager", str(socket_path),
            "--token-file", str(auth.role_token_file("profiler", state_dir))]
    if backend and backend != "nvml":
        argv += ["--backend", backend]
    return ("systemctl start vgpu-profiler (systemctl status vgpu-profiler says why it stopped), or without "
            f"systemd: {shlex.join(argv)}")


def check_profilers(socket_path: Path, state_dir: Path, *, max_age_s: float = DEFAULT_MAX_SIGNATURE_AGE_S,
                    timeout_s: float = 2.0,
                    answer: tuple[pb.GetAvailableResourcesResponse | None, str] | None = None) -> list[Check]:
    """Whether a profiler streams to the daemon, and per GPU how old its newest signature is (from
    `answer`, ask_daemon's, when given)."""
    resp, error = answer if answer is not None else ask_daemon(socket_path, state_dir, timeout_s=timeout_s)
    if resp is None:
        return [Check("profiler", "WARN", f"not checked: the daemon did not answer ({error})")]
    if not resp.HasField("profiler_streams_open"):
        return [Check("profiler", "WARN", "not checked: this daemon does not report its profiler streams")]
    if resp.profiler_streams_open == 0:
        return [Check("profiler", "FAIL", "no profiler is streaming to the daemon: nothing is forecast and grants do "
                      f"not follow the use; start it: {profiler_start_hint(socket_path, state_dir, resp.backend)}")]
    checks = []
    for d in resp.devices:
        name = f"GPU {d.index} ({d.device_id})"
        streams = f"{d.profiler_streams} stream{'s' if d.profiler_streams != 1 else ''}"
        busy = d.mem_granted_mib > 0
        if not d.HasField("newest_signature_age_s"):
            if busy:
                checks.append(Check("profiler", "FAIL", f"{name}: applications hold {d.mem_granted_mib:,.0f} MiB but "
                                    "no signature has arrived for this GPU: does the profiler see it?"))
            else:
                checks.append(Check("profiler", "OK", f"{name}: idle, no signature yet (the profiler sends for a GPU "
                                    f"once an application runs on it); {resp.profiler_streams_open} stream(s) open"))
            continue
        age = d.newest_signature_age_s
        text = f"{name}: {streams}, newest signature {age:.1f} s ago"
        if age <= max_age_s:
            checks.append(Check("profiler", "OK", text))
        elif busy:
            checks.append(Check("profiler", "FAIL", f"{text} (over {max_age_s:g} s while applications hold grants: "
                                "forecasts are stale)"))
        else:
            checks.append(Check("profiler", "WARN", f"{text} (over {max_age_s:g} s; no grants on it)"))
    return checks or [Check("profiler", "WARN", "the daemon reports no GPU")]


@dataclass(frozen=True)
class BackendChoice:
    """The backend whose driver and NVML `vgpu doctor` checks, and the line that says why it."""

    spec: str
    check: Check


def _same_backend(a: str, b: str) -> bool:
    """Whether two backend specs name the same devices ("sim" and "sim:h100-80gb" do)."""
    from vgpu.device import parse_sim_spec

    if a.strip().lower() == b.strip().lower():
        return True
    try:
        return parse_sim_spec(a) == parse_sim_spec(b)
    except ValueError:
        return False


def choose_backend(configured: str, *, given: bool, socket_path: Path,
                   answer: tuple[pb.GetAvailableResourcesResponse | None, str] | None) -> BackendChoice:
    """The backend to check: the one the daemon on `socket_path` reports it runs on; `configured`
    (--backend, else server.backend) when no daemon answers or it does not say, or when --backend was
    `given` (then a daemon on another backend is a warning)."""
    resp = answer[0] if answer is not None else None
    running = resp.backend if resp is not None else ""
    source = "as --backend asks" if given else "as configured"
    if resp is None:
        return BackendChoice(configured, Check("backend", "OK", f"{configured} (checked {source}: no daemon "
                                               f"answers at {socket_path} to say which it runs on)"))
    if not running:
        return BackendChoice(configured, Check("backend", "WARN", f"{configured} (checked {source}: the daemon "
                                               f"at {socket_path} does not say which backend it runs on)"))
    if given and not _same_backend(configured, running):
        return BackendChoice(configured, Check("backend", "WARN", f"{configured} (checked as --backend asks), but "
                                               f"the daemon at {socket_path} runs on {running}"))
    return BackendChoice(running, Check("backend", "OK", f"{running}, the daemon's at {socket_path} (checked for it)"))


def check_sim(spec: str, answer: pb.GetAvailableResourcesResponse | None) -> list[Check]:
    """Driver and NVML lines for a simulated backend: no driver is needed; the devices are the
    daemon's (when it answered) or those the spec describes (a spec the daemon would refuse fails)."""
    driver = Check("driver", "OK", f"not needed: {spec} simulates its GPUs")
    if answer is not None:
        names = ", ".join(sorted({d.name for d in answer.devices})) or "none"
        return [driver, Check("nvml", "OK", f"not used: the daemon simulates {len(answer.devices)} device(s): {names}")]
    from vgpu.device import parse_sim_spec
    from vgpu.device.sim import SimBackend

    try:
        backend = SimBackend(parse_sim_spec(spec))
    except (KeyError, ValueError) as exc:
        return [driver, Check("nvml", "FAIL", f"backend {spec!r}: {exc} (vgpu serve refuses it)")]
    try:
        devices = list(backend.devices())
        names = ", ".join(sorted({d.name for d in devices}))
        return [driver, Check("nvml", "OK", f"not used: {spec} simulates {len(devices)} device(s): {names}")]
    finally:
        backend.close()


def check_state_dir(path: Path, serving_on: Path | None = None) -> Check:
    """`serving_on`: the socket a daemon answers on, when one does (it then has a state directory)."""
    if path.is_dir():
        if os.access(path, os.W_OK | os.X_OK):
            return Check("state dir", "OK", f"{path} is writable")
        return Check("state dir", "FAIL", f"{path} is not writable by uid {os.geteuid()} (the daemon runs as root)")
    if path.exists():
        return Check("state dir", "FAIL", f"{path} exists and is not a directory")
    if serving_on is not None:
        # "the daemon will create it" would be wrong: it runs, with its state somewhere else
        return Check("state dir", "WARN", f"{path} does not exist, yet a daemon answers on {serving_on}: it keeps its "
                     "state in another directory; give its server.state_dir with --state-dir (or its --config)")
    parent = next((p for p in path.parents if p.exists()), Path("/"))
    if os.access(parent, os.W_OK | os.X_OK):
        return Check("state dir", "WARN", f"{path} does not exist yet; the daemon will create it")
    return Check("state dir", "FAIL", f"{path} does not exist and {parent} is not writable")


def check_inapp_dir(path: Path) -> Check:
    """The directory the client stubs write their in-app reports to (`server.inapp_dir`): FAIL where
    the daemon would refuse to start on it, WARN where it is missing (no in-app counters: the
    daemon makes it at start) or where other users' applications cannot write there."""
    from vgpu.daemon.inapp_sweep import inapp_dir_problem, inapp_dir_shuts_out_others

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Check("inapp dir", "WARN", f"{path} does not exist: the daemon makes it at start (mode 1777); until "
                     "then applications send no in-app counters (a daemon started with another --inapp-dir: give "
                     "doctor the same)")
    except OSError as exc:
        return Check("inapp dir", "WARN", f"{path}: {exc.strerror or exc}")
    problem = inapp_dir_problem(st, os.geteuid())  # as a daemon of this user would judge it
    if problem is not None:
        return Check("inapp dir", "FAIL", f"{path}: {problem}: the daemon refuses to start on it; remove it and "
                     "let the daemon make it")
    shut = inapp_dir_shuts_out_others(st)
    if shut is not None:
        return Check("inapp dir", "WARN", f"{path}: {shut}: `chmod 1777 {path}`")
    return Check("inapp dir", "OK", f"{path} (mode 1777): every user's applications can report in-app counters")


def check_model(path: Path, load: Callable[[Path], object] | None = None, *, required: bool = False) -> Check:
    """`required`: the operator configured this model, so the daemon will not start without it."""
    if not path.exists():
        if required:
            return Check("model", "FAIL", f"the configured forecaster {path} does not exist: the daemon will not start")
        return Check("model", "WARN", f"no forecaster checkpoint at {path}: the manager forecasts with the baseline")
    try:
        if load is None:
            from vgpu.manager.predictor import load_forecaster

            load = load_forecaster
        load(path)
    except Exception as exc:  # noqa: BLE001 - any failure means it cannot be served
        return Check("model", "FAIL", f"{path} does not load: {type(exc).__name__}: {exc}")
    return Check("model", "OK", f"{path} loads")


def check_local_model(state_dir: Path, load: Callable[[Path], object] | None = None) -> Check:
    """The node-local model the daemon serves beside the global one, loaded as it loads it, and when it
    does not load, whether the model a rollback would put back does. WARN, never FAIL: without it the
    daemon serves the global model."""
    from vgpu.manager import nodelearn

    try:
        state = nodelearn.status(state_dir, load or nodelearn.load_local)
    except OSError as exc:
        return Check("local model", "WARN", f"cannot read {nodelearn.models_dir(state_dir)}: {exc} (the daemon runs as "
                     "root: run this as root)")
    if state["local_model"] is None:
        return Check("local model", "OK", f"none at {nodelearn.models_dir(state_dir) / nodelearn.LOCAL}: the global "
                     "model serves alone")
    if state["local_model_loads"]:
        return Check("local model", "OK", f"{state['local_model']} loads")
    todo = nodelearn.unusable_local_model_advice(state, state_dir)
    return Check("local model", "WARN", f"{state['local_model']} does not load ({state['local_model_problem']}): "
                 f"the daemon serves the global model without it; {todo}")


def check_node_trees(state_dir: Path, *, enabled: bool = True) -> Check:
    """The node-local trees the daemon serves in the mixture (`<state dir>/models/trees.json`), loaded
    as it loads them; where they do not load, whether a rollback has earlier trees that do. WARN, never
    FAIL: without them the mixture serves its other experts."""
    from vgpu.manager import nodetrees

    if not enabled:
        return Check("node trees", "OK", "off (manager.node_trees = false): none are fitted or served")
    try:
        state = nodetrees.trees_status(state_dir)
    except OSError as exc:
        return Check("node trees", "WARN", f"cannot read {nodetrees.trees_paths(state_dir)[0].parent}: {exc} (the "
                     "daemon runs as root: run this as root)")
    if state["trees"] is None:
        kept = (f"; earlier ones that load are kept: `vgpu model rollback --trees --state-dir {state_dir}` serves "
                "them again" if state["trees_rollback_to_loads"] else "")
        return Check("node trees", "OK", f"none at {nodetrees.trees_paths(state_dir)[0]}: a learning round promotes "
                     f"them once they forecast the node's history better than the last value{kept}")
    if state["trees_loads"]:
        info = state.get("trees_info") or {}
        fitted = f" (fitted on {info['train_apps']} applications)" if isinstance(info.get("train_apps"), int) else ""
        return Check("node trees", "OK", f"{state['trees']} loads{fitted}")
    return Check("node trees", "WARN", f"{state['trees_problem']}: the daemon serves without the trees; "
                 f"{nodetrees.unusable_trees_advice(state, state_dir)}")


def default_model() -> Path:
    """The forecaster the daemon serves when none is configured (manager/modelpath.py)."""
    from vgpu.manager.modelpath import resolve_model

    return resolve_model(None).path


def run_checks(
    cfg: vconfig.Config,
    *,
    model: Path | None = None,
    model_required: bool = False,
    proc_root: Path = Path("/proc"),
    open_nvml: Callable[[], Backend] | None = None,
    euid: int | None = None,
    proc_status: str | None = None,
    load_model: Callable[[Path], object] | None = None,
    max_signature_age_s: float = DEFAULT_MAX_SIGNATURE_AGE_S,
    backend_given: bool = False,
) -> list[Check]:
    """The checks after `config`. The driver and NVML are checked for the backend the daemon at
    server.socket reports it runs on, else for server.backend (`backend_given`: --backend was given,
    and wins); the `backend` line says which and why."""
    socket_path, state_dir = Path(cfg.server.socket), Path(cfg.server.state_dir)
    sock = check_socket(socket_path)
    answer = ask_daemon(socket_path, state_dir) if sock.status != "FAIL" else None
    choice = choose_backend(cfg.server.backend, given=backend_given, socket_path=socket_path, answer=answer)
    from vgpu.device import is_nvml_spec

    if is_nvml_spec(choice.spec):
        device_checks = [check_driver(proc_root), check_nvml(open_nvml),
                         check_memory_limits(open_nvml, enabled=cfg.server.cgroup_memory_limits)]
    else:
        resp = answer[0] if answer is not None else None
        runs_it = resp is not None and bool(resp.backend) and _same_backend(choice.spec, resp.backend)
        device_checks = check_sim(choice.spec, resp if runs_it else None)
    caps = check_daemon_capabilities(socket_path, proc_root) if answer is not None else None
    checks = [
        choice.check,
        *device_checks,
        check_privileges(euid, proc_status),
        sock,
        *([caps] if caps is not None else []),
        check_state_dir(state_dir, socket_path if answer is not None and answer[0] is not None else None),
        check_inapp_dir(Path(cfg.server.inapp_dir)),
        check_model(model if model is not None else default_model(), load_model, required=model_required),
        check_local_model(state_dir, load_model),
        check_node_trees(state_dir, enabled=cfg.manager.node_trees),
    ]
    if answer is None:
        checks.append(Check("profiler", "WARN", "not checked: the daemon does not answer (see socket)"))
    else:
        checks += check_profilers(socket_path, state_dir, max_age_s=max_signature_age_s, answer=answer)
    return checks


def _fallback_config(path: Path | None, where: dict[str, str | None]) -> vconfig.Config:
    """For the other checks when the configuration does not load: the socket and state directory
    given on the command line (`where`) still hold, over the file when it loads without the other
    flags (a bad --backend), else over the defaults."""
    for source in (path, None):
        try:
            return vconfig.load(source, overrides=where)
        except vconfig.ConfigError:
            continue
    return vconfig.Config()


def _age_s(text: str) -> float:
    """A finite number of seconds > 0 (an age no signature could be under otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def main(argv: Sequence[str] | None = None, prog: str = "vgpu doctor", *, out: TextIO | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description="Check what vgpu needs on this machine.")
    p.add_argument("--config", type=Path, help="configuration file (default /etc/vgpu/vgpu.toml if present)")
    p.add_argument("--socket", help="daemon socket to check (default: from the configuration)")
    p.add_argument("--state-dir", help="state directory to check (default: from the configuration)")
    p.add_argument("--inapp-dir", help="in-app directory to check, as the daemon's --inapp-dir (default: from the "
                                       "configuration)")
    p.add_argument("--backend", help="check driver and NVML for this backend: nvml, sim, or sim:SKU[*N][,...] (default: the "
                   "one the daemon on the socket runs on, else server.backend of the configuration)")
    p.add_argument("--model", type=Path, help="forecaster checkpoint (default: manager.model, else the shipped model)")
    p.add_argument("--max-signature-age-s", type=_age_s, default=DEFAULT_MAX_SIGNATURE_AGE_S,
                   help=f"oldest newest-signature age that passes on a GPU with grants (default {DEFAULT_MAX_SIGNATURE_AGE_S:g})")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    ns.socket = vconfig.socket_flag(ns.socket)  # as `vgpu serve` reads it
    ns.inapp_dir = str(Path(ns.inapp_dir).absolute()) if ns.inapp_dir else None  # likewise made absolute
    out = out or sys.stdout
    try:
        cfg = vconfig.load(
            ns.config,
            overrides={"server.socket": ns.socket, "server.state_dir": ns.state_dir, "server.backend": ns.backend,
                       "server.inapp_dir": ns.inapp_dir},
        )
        backend_given = ns.backend is not None  # a --backend that does not load is not taken
        missing = vconfig.missing_names(cfg)  # the daemon refuses to start on these
        checks = [Check("config", "FAIL", "; ".join(missing)) if missing else
                  Check("config", "OK", f"{ns.config or vconfig.DEFAULT_CONFIG_PATH} "
                        + ("loads" if (ns.config or vconfig.DEFAULT_CONFIG_PATH.exists()) else "absent: defaults in use"))]
    except vconfig.ConfigError as exc:
        cfg = _fallback_config(ns.config, {"server.socket": ns.socket, "server.state_dir": ns.state_dir,
                                           "server.inapp_dir": ns.inapp_dir})
        backend_given = False
        checks = [Check("config", "FAIL", str(exc))]
    from vgpu.manager.modelpath import resolve_model

    choice = resolve_model(ns.model or cfg.manager.model)
    checks += run_checks(cfg, model=choice.path, model_required=choice.configured,
                         max_signature_age_s=ns.max_signature_age_s, backend_given=backend_given)
    if ns.json:
        out.write(json.dumps([asdict(c) for c in checks], indent=2) + "\n")
    else:
        out.write("\n".join(c.line() for c in checks) + "\n")
    return 1 if any(c.status == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
