"""A caller in a container's pid namespace names processes by their pid there; the daemon reads the
pid in its own namespace. Read as it is, `pid=1` from a root container without a user namespace
named the host's init (also root's, so the uid check let it stand) and its cgroup would have been
capped. The daemon now places the pid in the caller's namespace (vgpu.peers.pid_here, from the
kernel's SO_PEERCRED pid and /proc's NSpid): on a fake /proc here, and end to end with a client
stub run under `unshare --pid` (as a container runtime starts a job) against a real `vgpu serve`."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from daemon_fixtures import ROOT, Env, Serve
from hostile import Raw, operator_token

from vgpu.auth import AccessControl, Denied
from vgpu.daemon.serve import InAppPidProof
from vgpu.peers import NamespaceUnreadable, PeerCred, ns_pids, pid_here
from vgpu.v1 import allocator_pb2 as pb

HOST_NS = "pid:[4026531836]"
BOX_NS = "pid:[4026532600]"
OTHER_BOX_NS = "pid:[4026532700]"


class FakeProc:
    """A /proc tree with the two things pid_here reads: each process's status (Uid, NSpid) and its
    ns/pid link."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.add("self", (1,), HOST_NS)

    def add(self, pid: int | str, nspid: tuple[int, ...] | None, ns: str, uid: int = 0) -> None:
        d = self.root / str(pid)
        (d / "ns").mkdir(parents=True)
        lines = [f"Name:\tp{pid}", f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}"]
        if nspid is not None:
            lines.append("NSpid:\t" + "\t".join(str(p) for p in nspid))
        (d / "status").write_text("\n".join(lines) + "\n")
        os.symlink(ns, d / "ns" / "pid")


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    p = FakeProc(tmp_path / "proc")
    p.add(1, (1,), HOST_NS)  # the host's init: root's, like a root container's processes
    p.add(7, (7,), HOST_NS)
    p.add(500, (500,), HOST_NS)  # a process in the daemon's own namespace
    p.add(5000, (5000, 1), BOX_NS)  # a container: its first process ...
    p.add(5001, (5001, 7), BOX_NS)  # ... and another, pid 7 inside
    p.add(6000, (6000, 1), OTHER_BOX_NS)  # another container's pid 1
    p.add(6001, (6001, 7), OTHER_BOX_NS)
    return p


def test_a_caller_in_the_daemon_s_namespace_names_pids_as_they_are(proc: FakeProc) -> None:
    assert pid_here(7, 500, proc.root) == 7
    assert pid_here(12345, 500, proc.root) == 12345  # (whether it exists is the uid check's business)


def test_a_containers_pids_are_read_in_the_container(proc: FakeProc) -> None:
    assert pid_here(1, 5000, proc.root) == 5000  # the caller names itself: its own pid here
    assert pid_here(7, 5000, proc.root) == 5001  # another process of its container, not the host's 7
    assert pid_here(1, 5001, proc.root) == 5000
    assert pid_here(7, 6000, proc.root) == 6001  # the other container's 7
    assert ns_pids(5001, proc.root) == (5001, 7)


def test_a_pid_that_cannot_be_placed_is_none(proc: FakeProc) -> None:
    assert pid_here(500, 5000, proc.root) is None  # a host pid, not one of the container's
    assert pid_here(7, 4242, proc.root) is None  # the caller has exited
    assert pid_here(7, 0, proc.root) is None  # the caller is outside this namespace (the kernel gave pid 0)
    os.unlink(proc.root / "5000" / "ns" / "pid")  # its namespace unreadable (another user's, daemon not root)
    assert pid_here(7, 5000, proc.root) is None


def test_a_kernel_without_nspid_understands_only_its_own_namespace(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(500, None, HOST_NS)
    proc.add(5000, None, BOX_NS)
    assert pid_here(7, 500, proc.root) == 7
    assert pid_here(1, 5000, proc.root) is None


class _NoLedger:
    def grant_owner(self, grant_id: str) -> str | None:
        return None

    def has_app(self, app_id: str) -> bool:
        return False


def _access(proc: FakeProc) -> AccessControl:
    return AccessControl(None, None, _NoLedger(), pid_from_caller=lambda pid, caller: pid_here(pid, caller, proc.root))  # type: ignore[arg-type]


def _req(pid: int) -> pb.RequestResourceAllocationRequest:
    return pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id="job", memory_mib=8, pid=pid))


def test_the_request_carries_the_daemon_s_pid_after_the_edge(proc: FakeProc) -> None:
    access = _access(proc)
    for caller, named, placed in ((5000, 1, 5000), (5000, 7, 5001), (500, 7, 7)):
        req = _req(named)
        access.place_pid(req, PeerCred(pid=caller, uid=0, gid=0))
        assert req.request.pid == placed, (caller, named)
    req = _req(7)
    access.place_pid(req, None)  # TCP: no namespace to place it in; the rules that follow decide
    assert req.request.pid == 7
    req = _req(500)
    with pytest.raises(Denied) as err:
        access.place_pid(req, PeerCred(pid=5000, uid=0, gid=0))
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "pid namespace" in err.value.reason
    assert req.request.pid == 500  # refused: nothing changed


def _refusing(*pids: int) -> Callable[[Path], str]:
    """os.readlink as the kernel answers a daemon without CAP_SYS_PTRACE: the ns/pid link of another
    user's process (here: of `pids`) is refused with EACCES."""
    def readlink(path: Path) -> str:
        if path.name == "pid" and path.parent.name == "ns" and path.parent.parent.name in {str(p) for p in pids}:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return os.readlink(path)
    return readlink


def test_a_namespace_the_kernel_will_not_show_is_said_as_such(proc: FakeProc) -> None:
    """Under the unit's capabilities without CAP_SYS_PTRACE, root may not read the ns/pid link of a
    container process of another uid: the refusal said "no process of that pid the daemon can see, or
    has exited", as if the caller had named a wrong pid."""
    caller_refused = _refusing(5000, 5001)
    assert pid_here(1, 5000, proc.root, caller_refused) == 5000  # naming itself needs no namespace read
    with pytest.raises(NamespaceUnreadable) as err:
        pid_here(7, 5000, proc.root, caller_refused)
    assert err.value.pid == 5000 and err.value.error.errno == errno.EACCES
    with pytest.raises(NamespaceUnreadable) as err:  # the caller's is readable, the candidate's is not
        pid_here(7, 5000, proc.root, _refusing(5001))
    assert err.value.pid == "5001"
    # another user's process that is not the one named changes nothing
    assert pid_here(7, 5000, proc.root, _refusing(6001)) == 5001
    assert pid_here(500, 5000, proc.root, _refusing(6001)) is None

    access = AccessControl(None, None, _NoLedger(),  # type: ignore[arg-type]
                           pid_from_caller=lambda pid, caller: pid_here(pid, caller, proc.root, caller_refused))
    req = _req(7)
    with pytest.raises(Denied) as denied:
        access.place_pid(req, PeerCred(pid=5000, uid=65534, gid=65534))
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
    reason = denied.value.reason
    assert "CAP_SYS_PTRACE" in reason and "Permission denied" in reason and "/proc/<pid>/ns/pid" in reason, reason
    assert "or has exited" not in reason and req.request.pid == 7


# --- end to end: a stub in a new pid namespace, as a container runtime starts a job ---------------

_BOXED = textwrap.dedent("""
    import json, os, subprocess, sys, time
    import grpc
    from vgpu.client import VgpuClient
    from vgpu.v1 import allocator_pb2 as pb, allocator_pb2_grpc as pb_grpc
    sock, inapp = sys.argv[1], sys.argv[2]
    out = {"pid": os.getpid()}
    sleeper = subprocess.Popen(["sleep", "120"])
    out["sleeper"] = sleeper.pid
    with VgpuClient("boxed", socket=sock, inapp_dir=inapp) as client:
        grant = client.request(memory_mib=64)
        out.update(grant_pid=grant.pid, grant_id=grant.grant_id, held=[g.grant_id for g in client.grants])
        report = client.report_now()  # the in-app report, moved to the name the daemon knows
        out.update(report=report.name, report_pid=json.loads(report.read_text())["pid"],
                   inapp=sorted(os.listdir(inapp)))
        stub = pb_grpc.AllocatorStub(grpc.insecure_channel(f"unix:{sock}"))
        def ask(app, pid):
            msg = pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id=app, memory_mib=8, pid=pid))
            return stub.RequestResourceAllocation(msg, timeout=10).grant
        out["launcher_pid"] = ask("launcher", sleeper.pid).pid
        try:
            ask("ghost", 4000)
        except grpc.RpcError as exc:
            out["ghost"] = [exc.code().name, exc.details()]
        print(json.dumps(out), flush=True)
        sys.stdin.readline()  # the test looks from the host, and releases the grant as the operator
        deadline = time.monotonic() + 20
        while client.grants and time.monotonic() < deadline:
            time.sleep(0.05)  # the watch's RELEASED event names the process by the daemon's pid
        print(json.dumps({"held": [g.grant_id for g in client.grants]}), flush=True)
    sleeper.kill()
""")


def _can_unshare() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture
def boxed(env: Env, serves: list[Serve]) -> Iterator[tuple[subprocess.Popen[str], dict]]:  # type: ignore[type-arg]
    serves.append(Serve(env))
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _BOXED,
                             str(env.sock), str(env.tmp / "inapp")],
                            cwd=ROOT, env=env.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the boxed client printed nothing (exit {proc.poll()})"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.skipif(not _can_unshare(), reason="a new pid namespace needs root and unshare(1)")
def test_a_stub_in_a_container_gets_its_own_process_capped_not_the_host_s(
        boxed: tuple[subprocess.Popen[str], dict], env: Env) -> None:  # type: ignore[type-arg]
    proc, out = boxed
    assert out["pid"] == 1  # inside, the stub is its namespace's first process and names pid 1
    stub_here = psutil.Process(proc.pid).children()[0]  # unshare's child: the stub's python, seen from here
    assert stub_here.pid != 1
    # the grant names the stub's own process, which the host knows by another pid (before: pid 1, init)
    assert out["grant_pid"] == stub_here.pid
    assert out["held"] == [out["grant_id"]]  # the stub knows the grant as its own
    # its in-app report is named by the pid the profiler and the daemon see (NVML's on the host), and
    # the one under the pid seen inside is gone
    assert out["report"] == f"{stub_here.pid}.json" and out["report_pid"] == stub_here.pid
    assert out["inapp"] == [out["report"]]
    # ... and it passes the daemon's own checks for that process (owner, freshness, start time)
    assert InAppPidProof(env.tmp / "inapp")(stub_here.pid, "boxed")
    # another process of the container, named by its pid there
    assert out["launcher_pid"] != out["sleeper"]
    assert psutil.Process(out["launcher_pid"]).cmdline() == ["sleep", "120"]
    assert ns_pids(out["launcher_pid"])[-1] == out["sleeper"]  # type: ignore[index]
    # a pid that is no process of the container is refused, whatever runs at that pid here
    assert out["ghost"][0] == "PERMISSION_DENIED" and "pid namespace" in out["ghost"][1]
    client = Raw(env.sock)
    try:
        apps = {a.app_id: a for a in client.apps()}
        assert [g.pid for g in apps["boxed"].grants] == [stub_here.pid]
        assert "ghost" not in apps
        # the operator releases it: the stub's watch takes the event for its own process, although
        # the daemon names the process otherwise (before, the stub went on counting the grant)
        client.release(out["grant_id"], token=operator_token(env.state))
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"held": []}
        assert proc.wait(30) == 0
    finally:
        client.close()


# --- end to end under the unit's capabilities: a launcher in a container names its child --------------

_LAUNCHER = textwrap.dedent("""
    import json, subprocess, sys
    import grpc
    from vgpu.v1 import allocator_pb2 as pb, allocator_pb2_grpc as pb_grpc
    child = subprocess.Popen(["sleep", "120"])
    stub = pb_grpc.AllocatorStub(grpc.insecure_channel(f"unix:{sys.argv[1]}"))
    msg = pb.RequestResourceAllocationRequest(request=pb.ResourceRequest(app_id="launched", memory_mib=8, pid=child.pid))
    try:
        out = {"child": child.pid, "grant_pid": stub.RequestResourceAllocation(msg, timeout=10).grant.pid}
    except grpc.RpcError as exc:
        out = {"child": child.pid, "refused": [exc.code().name, exc.details()]}
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # the test looks at the child from the host
    child.kill()
""")


def _unit_capabilities() -> list[str]:
    for line in (ROOT / "systemd" / "vgpu-manager.service").read_text().splitlines():
        if line.startswith("CapabilityBoundingSet="):
            return line.partition("=")[2].split()
    raise AssertionError("the unit has no CapabilityBoundingSet")


@pytest.mark.skipif(not _can_unshare() or shutil.which("setpriv") is None,
                    reason="a new pid namespace and a reduced bounding set need root, unshare(1) and setpriv(1)")
@pytest.mark.parametrize("ptrace", [True, False], ids=["unit", "unit-without-ptrace"])
def test_under_the_units_capabilities_a_launcher_in_a_container_may_name_its_child(
        env: Env, serves: list[Serve], ptrace: bool) -> None:
    """The daemon run as the unit runs it, root reduced to its CapabilityBoundingSet (setpriv), and a
    launcher in a container (root, its own pid namespace) requesting for its child by the child's pid
    there. Placing that pid reads the container's ns/pid links, which the kernel shows a process whose
    capabilities do not cover the target's only with CAP_SYS_PTRACE: under the unit's set before it
    had that capability, the request was refused as if the pid named nothing."""
    caps = [c for c in _unit_capabilities() if ptrace or c != "CAP_SYS_PTRACE"]
    bounding = ",".join(["-all", *("+" + c.removeprefix("CAP_").lower() for c in caps)])
    serves.append(Serve(env, prefix=["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all"]))
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _LAUNCHER,
                             str(env.sock)], cwd=ROOT, env=env.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        out = json.loads(proc.stdout.readline())
        if ptrace:  # granted for the child, named by its pid here
            assert "refused" not in out, out
            assert ns_pids(out["grant_pid"])[-1] == out["child"] != out["grant_pid"], out  # type: ignore[index]
            assert psutil.Process(out["grant_pid"]).cmdline() == ["sleep", "120"]
        else:  # refused, saying what the daemon lacks
            code, details = out["refused"]
            assert code == "PERMISSION_DENIED" and "lacks CAP_SYS_PTRACE" in details, out
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
