"""The client stub: requests, the watch of its grants, the cooperative limit (fake torch), in-app reporting."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from vgpu.client import (
    NOTHING_CHANGED_KEY,
    InAppCounters,
    InAppFormatError,
    InAppReport,
    VgpuClient,
    inapp_path,
    parse_inapp,
    read_inapp,
    write_inapp,
)
from vgpu.v1 import allocator_pb2, allocator_pb2_grpc

GIB = 1024**3
Event = allocator_pb2.AllocationEvent


class FakeCuda:
    def __init__(self, total_bytes: int = 80 * GIB) -> None:
        self.total_bytes = total_bytes
        self.fractions: list[tuple[float, int]] = []
        self.stats = {
            "allocated_bytes.all.current": 1 * GIB,
            "reserved_bytes.all.current": 2 * GIB,
            "active_bytes.all.current": GIB // 2,
            "num_alloc_retries": 3,
            "num_ooms": 1,
        }

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: int) -> Any:
        return types.SimpleNamespace(total_memory=self.total_bytes)

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError("fraction out of range")  # as torch does
        self.fractions.append((fraction, device))

    def memory_stats(self, device: int) -> dict[str, int]:
        return dict(self.stats)


class FakeCudaWithUuids(FakeCuda):
    """Two GPUs that tell their UUIDs, as torch's device properties do (without NVML's "GPU-")."""

    UUIDS = ("5d3a0c1e-0000-4000-8000-00000000000a", "5d3a0c1e-0000-4000-8000-00000000000b")

    def __init__(self, current: int) -> None:
        super().__init__()
        self.current = current

    def current_device(self) -> int:
        return self.current

    def get_device_properties(self, device: int) -> Any:
        return types.SimpleNamespace(total_memory=self.total_bytes, uuid=self.UUIDS[device])


def fake_torch() -> types.ModuleType:
    mod = types.ModuleType("torch")
    mod.cuda = FakeCuda()  # type: ignore[attr-defined]
    return mod


class FakeAllocator(allocator_pb2_grpc.AllocatorServicer):
    """Grants what fits in `capacity_mib`, streams events to watchers."""

    def __init__(self, capacity_mib: float = 40_000.0) -> None:
        self.capacity_mib = capacity_mib
        self.grants: dict[str, allocator_pb2.Grant] = {}
        self.watchers: list[tuple[str, queue.Queue[Event | None]]] = []
        self.lock = threading.Lock()
        self.n = 0
        self.requests: list[allocator_pb2.ResourceRequest] = []

    def _publish(self, kind: int, grant: allocator_pb2.Grant) -> None:
        with self.lock:
            for app, q in self.watchers:
                if not app or app == grant.app_id:
                    q.put(Event(kind=kind, grant=grant, at_s=time.time()))

    def RequestResourceAllocation(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        r = request.request
        self.requests.append(r)
        used = sum(g.memory_mib for g in self.grants.values())
        if used + r.memory_mib > self.capacity_mib:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{r.memory_mib} MiB does not fit")
        self.n += 1
        grant = allocator_pb2.Grant(grant_id=f"g{self.n}", app_id=r.app_id, device_id=r.device_id or "GPU-0",
                                    memory_mib=r.memory_mib, sm_pct=r.sm_pct, source="request")
        self.grants[grant.grant_id] = grant
        self._publish(Event.GRANTED, grant)
        return allocator_pb2.RequestResourceAllocationResponse(grant=grant)

    def ReleaseResources(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        grant = self.grants.pop(request.grant_id, None)
        if grant is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no grant {request.grant_id}")
        self._publish(Event.RELEASED, grant)
        return allocator_pb2.ReleaseResourcesResponse(released=grant)

    def WatchAllocations(self, request, context) -> Iterator[Event]:  # type: ignore[no-untyped-def]  # noqa: N802
        q: queue.Queue[Event | None] = queue.Queue()
        entry = (request.app_id, q)
        with self.lock:
            self.watchers.append(entry)
        context.add_callback(lambda: q.put(None))
        try:
            while context.is_active():
                event = q.get()
                if event is None:
                    return
                yield event
        finally:
            with self.lock:
                self.watchers.remove(entry)

    def resize(self, grant_id: str, memory_mib: float) -> None:
        grant = self.grants[grant_id]
        grant.memory_mib = memory_mib
        self._publish(Event.RESIZED, grant)


def serve(sock: Path, servicer: FakeAllocator) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    allocator_pb2_grpc.add_AllocatorServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    return server


@pytest.fixture
def allocator(tmp_path: Path) -> Iterator[tuple[FakeAllocator, Path]]:
    sock = tmp_path / "vgpu.sock"
    servicer = FakeAllocator()
    server = serve(sock, servicer)
    yield servicer, sock
    server.stop(grace=None)


def wait_until(pred, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    # generous: it ends as soon as `pred()` holds, and a loaded machine can take seconds for it
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_grant_is_applied_as_a_memory_fraction_and_follows_resizes(allocator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    servicer, sock = allocator
    torch = fake_torch()
    job = allocator_pb2.JobConfig(model_type="resnet50", batch_size=64, mode="train")
    with VgpuClient("train-a", socket=str(sock), job=job, inapp_dir=tmp_path / "inapp", torch_module=torch,
                    report_period_s=0.05) as client:
        wait_until(lambda: servicer.watchers)
        grant = client.request(memory_mib=20_480, sm_pct=50, priority=2)
        assert grant.grant_id == "g1" and grant.memory_mib == 20_480
        assert torch.cuda.fractions[-1] == (pytest.approx(0.25), 0)  # 20 GiB of 80 GiB
        assert client.applied_mem_limit_mib == pytest.approx(20_480)

        servicer.resize("g1", 40_960)  # the allocator grows the grant; the watch applies it
        wait_until(lambda: client.applied_mem_limit_mib == pytest.approx(40_960))
        assert torch.cuda.fractions[-1] == (pytest.approx(0.5), 0)

        # the reporter writes what was applied and torch's allocator counters
        def reported() -> InAppReport | None:
            return read_inapp(tmp_path / "inapp", client.pid, now_s=time.time())

        wait_until(lambda: (r := reported()) is not None and r.counters.applied_mem_limit_mib == pytest.approx(40_960))
        c = reported().counters  # type: ignore[union-attr]
        assert (c.torch_allocated_mib, c.torch_reserved_mib, c.torch_active_mib) == (1024.0, 2048.0, 512.0)
        assert (c.alloc_retries, c.oom_count) == (3, 1)

        client.release()
        assert torch.cuda.fractions[-1] == (1.0, 0)  # no grant: no limit
        assert client.applied_mem_limit_mib is None and servicer.grants == {}
    assert not inapp_path(tmp_path / "inapp", client.pid).exists()


def test_a_process_on_one_gpu_is_limited_by_its_grants_on_that_gpu_only(  # type: ignore[no-untyped-def]
        allocator, tmp_path: Path) -> None:
    """An application with grants on two GPUs: the process on the second GPU applies what is granted
    there, not the sum over both; with grants only on GPUs it does not see, the sum (one limit)."""
    servicer, sock = allocator
    on_a, on_b = (f"GPU-{u}" for u in FakeCudaWithUuids.UUIDS)
    torch = types.ModuleType("torch")
    torch.cuda = FakeCudaWithUuids(current=1)  # type: ignore[attr-defined]
    with VgpuClient("sharded", socket=str(sock), inapp_dir=tmp_path, torch_module=torch, report=False) as client:
        wait_until(lambda: servicer.watchers)
        client.request(memory_mib=8_192, device_id=on_a)
        # nothing granted on this process's GPU yet: the one grant counts, and it is said once
        assert client.applied_mem_limit_mib == pytest.approx(8_192)
        client.request(memory_mib=20_480, device_id=on_b)
        assert torch.cuda.fractions[-1] == (pytest.approx(0.25), 1)  # 20 GiB of 80 on device 1, not 28 GiB
        assert client.applied_mem_limit_mib == pytest.approx(20_480)
        client.request(memory_mib=4_096, device_id=on_a)  # more on the other GPU changes nothing here
        assert client.applied_mem_limit_mib == pytest.approx(20_480)


def test_refused_request_changes_nothing(allocator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    servicer, sock = allocator
    torch = fake_torch()
    client = VgpuClient("big", socket=str(sock), inapp_dir=tmp_path, torch_module=torch, watch=False, report=False)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            client.request(memory_mib=1e9)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert torch.cuda.fractions == [] and client.grants == []
        with pytest.raises(grpc.RpcError) as exc:
            client.release("nope")
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        client.close()


def test_works_without_torch(allocator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    servicer, sock = allocator
    client = VgpuClient("cpu-only", socket=str(sock), inapp_dir=tmp_path, torch_module=None, watch=False, report=False)
    try:
        grant = client.request(memory_mib=100)
        assert client.granted_memory_mib == 100 and client.applied_mem_limit_mib is None
        client.step()
        client.step(4)
        c = client.counters()
        assert c == InAppCounters(step=5)
        assert grant.grant_id in servicer.grants
    finally:
        client.close()
    assert servicer.grants == {}  # close releases


def test_torch_from_sys_modules_is_used_only_when_the_app_imported_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    client = VgpuClient("a", socket="/nowhere.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        monkeypatch.delitem(sys.modules, "torch", raising=False)
        assert client.counters().torch_allocated_mib is None
        monkeypatch.setitem(sys.modules, "torch", fake_torch())
        assert client.counters().torch_allocated_mib == 1024.0
    finally:
        client.close()


def test_importing_the_stub_does_not_import_torch() -> None:
    code = "import sys, vgpu.client; assert 'torch' not in sys.modules, 'torch imported'"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})


def test_events_of_other_apps_are_ignored(tmp_path: Path) -> None:
    torch = fake_torch()
    client = VgpuClient("mine", socket="/nowhere.sock", inapp_dir=tmp_path, torch_module=torch, watch=False,
                        report=False)
    try:
        other = allocator_pb2.Grant(grant_id="x", app_id="theirs", memory_mib=1000)
        client.handle_event(Event(kind=Event.GRANTED, grant=other))
        assert torch.cuda.fractions == [] and client.grants == []
        mine = allocator_pb2.Grant(grant_id="y", app_id="mine", memory_mib=8192)
        client.handle_event(Event(kind=Event.GRANTED, grant=mine))
        client.handle_event(Event(kind=Event.RESIZED, grant=mine))  # same size: not applied again
        assert torch.cuda.fractions == [(0.1, 0)] and client.limit_changes == 1
        client.handle_event(Event(kind=Event.RELEASED, grant=mine))
        assert torch.cuda.fractions[-1] == (1.0, 0)
    finally:
        client.close(release=False)


def test_the_limit_kind_kept_is_the_one_of_this_processs_gpu(tmp_path: Path) -> None:
    """The daemon says hard or cooperative per GPU: a process on GPU b of an application that also
    holds grants on GPU a keeps b's word, not whichever GPU's event came last; before any grant names
    its GPU, every GPU's word counts (as its limit does)."""
    on_a, on_b = (f"GPU-{u}" for u in FakeCudaWithUuids.UUIDS)
    torch = types.ModuleType("torch")
    torch.cuda = FakeCudaWithUuids(current=1)  # type: ignore[attr-defined]
    client = VgpuClient("sharded", socket="/nowhere.sock", inapp_dir=tmp_path, torch_module=torch, watch=False,
                        report=False)

    def grant(gid: str, device_id: str) -> allocator_pb2.Grant:
        return allocator_pb2.Grant(grant_id=gid, app_id="sharded", device_id=device_id, memory_mib=1024)

    try:
        client.handle_event(Event(kind=Event.GRANTED, grant=grant("g1", on_a), mem_limit="hard"))
        assert client.memory_limit_kind == "hard"  # no grant on this GPU yet: a's word is the one there is
        client.handle_event(Event(kind=Event.GRANTED, grant=grant("g2", on_b), mem_limit="cooperative"))
        assert client.memory_limit_kind == "cooperative"
        a_only = allocator_pb2.Grant(app_id="sharded", device_id=on_a)  # a LIMITS_CHANGED names its GPU so
        client.handle_event(Event(kind=Event.LIMITS_CHANGED, grant=a_only, mem_limit="hard"))
        client.handle_event(Event(kind=Event.RESIZED, grant=grant("g1", on_a), mem_limit="hard"))
        assert client.memory_limit_kind == "cooperative"  # GPU a's word is not this process's
        b_only = allocator_pb2.Grant(app_id="sharded", device_id=on_b)
        client.handle_event(Event(kind=Event.LIMITS_CHANGED, grant=b_only, mem_limit="hard"))
        assert client.memory_limit_kind == "hard"
        client.handle_event(Event(kind=Event.POWER_LIMIT_CHANGED, grant=b_only))  # no word: kept
        assert client.memory_limit_kind == "hard"
    finally:
        client.close(release=False)


def test_a_grant_above_the_device_is_capped_at_the_whole_device(tmp_path: Path) -> None:
    torch = fake_torch()
    client = VgpuClient("a", socket="/nowhere.sock", inapp_dir=tmp_path, torch_module=torch, watch=False, report=False)
    try:
        client.handle_event(Event(kind=Event.GRANTED, grant=allocator_pb2.Grant(grant_id="g", app_id="a", memory_mib=1e6)))
        assert torch.cuda.fractions == [(1.0, 0)] and client.applied_mem_limit_mib == 81920.0
    finally:
        client.close(release=False)


def test_watch_reconnects_after_the_daemon_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vgpu.client as client_module

    said: list[str] = []
    for level in ("info", "warning"):
        monkeypatch.setattr(client_module._log, level, lambda event, **_kw: said.append(event))
    sock = tmp_path / "vgpu.sock"
    first = FakeAllocator()
    server = serve(sock, first)
    torch = fake_torch()
    client = VgpuClient("a", socket=str(sock), inapp_dir=tmp_path, torch_module=torch, report=False)
    try:
        client.request(memory_mib=8192)
        server.stop(grace=None)
        wait_until(lambda: client.watch_errors >= 1)
        second = FakeAllocator()
        second.grants = dict(first.grants)
        server = serve(sock, second)
        wait_until(lambda: second.watchers)
        second.resize("g1", 16384)
        wait_until(lambda: client.applied_mem_limit_mib == pytest.approx(16384))
        # the warning is not the last word once the watch is open again
        watch_lines = [e for e in said if e.startswith("allocation watch")]
        assert watch_lines == ["allocation watch interrupted, opening it again", "allocation watch open again"]
    finally:
        client.close()
        server.stop(grace=None)


class _WatchRefused(FakeAllocator):
    """A daemon whose watcher share is used up: every WatchAllocations is refused at once."""

    def __init__(self) -> None:
        super().__init__()
        self.watch_calls = 0

    def WatchAllocations(self, request, context) -> Iterator[Event]:  # type: ignore[no-untyped-def]  # noqa: N802
        self.watch_calls += 1
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota: uid 1000 holds 64 watchers")
        yield from ()


def test_a_refused_watch_is_asked_again_ever_less_often_and_the_reason_logged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch the daemon refuses (its per-uid share used up) was asked again ten times a second for
    as long as the stub lived: the backoff started over each time the refused call 'opened'. Now the
    waits double up to 30 s, and the warning carries the daemon's reason."""
    import vgpu.client as client_module

    sock = tmp_path / "vgpu.sock"
    daemon = _WatchRefused()
    server = serve(sock, daemon)
    warnings: list[dict[str, object]] = []
    monkeypatch.setattr(client_module._log, "warning", lambda event, **kw: warnings.append({"event": event, **kw}))
    client = VgpuClient("a", socket=str(sock), inapp_dir=tmp_path, torch_module=None, watch=False, report=False)
    waits: list[float] = []

    def wait(timeout: float) -> bool:  # the watch loop's pause, recorded instead of slept
        waits.append(timeout)
        if len(waits) >= 10:
            client._closed.set()
        return client._closed.is_set()

    try:
        monkeypatch.setattr(client._closed, "wait", wait)
        client._watch_loop()
    finally:
        client._closed.clear()
        client.close(release=False)
        server.stop(grace=None)
    assert daemon.watch_calls == 10
    assert all(b > a for a, b in zip(waits[:8], waits[1:8], strict=False)), waits  # growing
    assert waits[-1] >= 0.8 * 25.6 and max(waits) <= 1.2 * client_module.WATCH_REFUSED_MAX_S
    (warned,) = [w for w in warnings if str(w["event"]).startswith("allocation watch")]  # once, not per refusal
    assert warned["event"] == "allocation watch refused, asking again at most every 30 s"
    assert "holds 64 watchers" in str(warned["details"])


def test_the_stubs_channel_tries_a_daemon_that_is_back_again_within_a_second(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """gRPC's default reconnect backoff grows to minutes: a stub whose daemon restarted after a few
    seconds down would then wait many seconds to reach it (its close() could not release in time;
    tests/test_client_daemon.py shows the whole flow, which catches a lost cap only when the
    backoff's jitter falls a certain way). The stub's channel caps the backoff at a second."""
    seen: list[dict[str, object]] = []
    real = grpc.insecure_channel

    def spy(target: str, options: object = None, **kw: object) -> grpc.Channel:
        seen.append(dict(options or ()))  # type: ignore[call-overload]
        return real(target, options=options, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(grpc, "insecure_channel", spy)
    client = VgpuClient("a", socket=str(tmp_path / "absent.sock"), inapp_dir=tmp_path, report=False, watch=False)
    client.close()
    assert seen and all(0 < int(o["grpc.max_reconnect_backoff_ms"]) <= 1000 for o in seen), seen  # type: ignore[call-overload]


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="app_id"):
        VgpuClient(" ", inapp_dir=tmp_path, watch=False, report=False)
    with pytest.raises(ValueError, match="host:port"):
        VgpuClient("a", socket="nonsense", inapp_dir=tmp_path, watch=False, report=False)
    client = VgpuClient("a", socket="/nowhere.sock", inapp_dir=tmp_path, watch=False, report=False)
    try:
        with pytest.raises(ValueError, match="memory_mib"):
            client.request(memory_mib=-1)
        with pytest.raises(ValueError, match="sm_pct"):
            client.request(sm_pct=150)
        # a wrong kind of value is named, not a comparison's TypeError or protobuf's "Value out of range"
        with pytest.raises(TypeError, match=r"memory_mib must be a number, got '100' \(str\)"):
            client.request(memory_mib="100")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"sm_pct must be a number, got None"):
            client.request(memory_mib=10, sm_pct=None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"priority must be a whole number within -2\*\*31..2\*\*31-1.*got 1099511627776"):
            client.request(memory_mib=10, priority=2**40)
        with pytest.raises(ValueError, match="priority must be a whole number"):
            client.request(memory_mib=10, priority=1.5)  # type: ignore[arg-type]
        assert list(tmp_path.iterdir()) == []  # refused before the report that proves the pid
        with pytest.raises(ValueError):
            client.step(-1)
    finally:
        client.close()


# --- the in-app file ---------------------------------------------------------------------------------


def test_inapp_file_round_trip_is_atomic(tmp_path: Path) -> None:
    report = InAppReport("a", 123, 1000.5, 2000.0, InAppCounters(torch_allocated_mib=1.5, step=9, oom_count=0))
    path = write_inapp(tmp_path, report)
    assert path == tmp_path / "123.json" and os.listdir(tmp_path) == ["123.json"]  # no temporary left behind
    assert read_inapp(tmp_path, 123, now_s=2001.0) == report
    assert read_inapp(tmp_path, 123, now_s=2001.0, pid_start_s=1000.9) == report  # clock-tick jitter
    assert read_inapp(tmp_path, 123, now_s=2010.0) is None  # stale
    assert read_inapp(tmp_path, 123, now_s=2001.0, pid_start_s=1500.0) is None  # another process, same pid
    assert read_inapp(tmp_path, 456, now_s=2001.0) is None  # none
    assert json.loads(path.read_text())["counters"] == {"torch_allocated_mib": 1.5, "step": 9, "oom_count": 0}


def test_a_planted_fifo_symlink_or_huge_file_is_no_report_and_never_blocks(tmp_path: Path) -> None:
    """The in-app directory is writable by every user, so another user may put anything under a
    process's name before its stub writes there. The profiler read `<pid>.json` with a plain open:
    a FIFO held it until a writer came, a symlink to /dev/zero read without end. Now each is a
    malformed report, said at once."""
    os.mkfifo(tmp_path / "1.json")
    (tmp_path / "2.json").symlink_to("/dev/zero")
    (tmp_path / "3.json").write_bytes(b" " * (1 << 20))
    for pid in (1, 2, 3):
        out: queue.Queue[object] = queue.Queue()

        def read(pid: int = pid, out: queue.Queue[object] = out) -> None:
            try:
                out.put(read_inapp(tmp_path, pid, now_s=time.time()))
            except (InAppFormatError, OSError) as exc:
                out.put(exc)

        threading.Thread(target=read, daemon=True).start()
        try:
            got = out.get(timeout=5)
        except queue.Empty:
            got = "blocked"
        finally:
            with contextlib.suppress(OSError):  # let a read that waits on the FIFO return
                os.close(os.open(tmp_path / "1.json", os.O_WRONLY | os.O_NONBLOCK))
        assert isinstance(got, InAppFormatError), (pid, got)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{", "not JSON"),
        ('{"v": 1, "app_id": "a", "pid": 1' + "0" * 5000 + ', "written_at_s": 1}', "not JSON: Exceeds the limit"),
        ("[]", "not a JSON object"),
        ('{"v": 2}', "version"),
        ('{"v": 1, "pid": 1, "written_at_s": 1}', "app_id"),
        ('{"v": 1, "app_id": "a", "pid": -1, "written_at_s": 1}', "pid"),
        ('{"v": 1, "app_id": "a", "pid": 1}', "written_at_s"),
        ('{"v": 1, "app_id": "a", "pid": 1, "written_at_s": 1, "counters": []}', "counters"),
    ],
)
def test_malformed_inapp_files_are_refused_with_a_reason(text: str, reason: str) -> None:
    with pytest.raises(InAppFormatError, match=reason):
        parse_inapp(text)


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("step", '"x"', "not a number"),
        ("step", "true", "not a number"),
        ("oom_count", "-2", "negative"),
        ("kv_used_mib", "-0.5", "negative"),
        ("requests_running", "1e300", "above 1e+07"),
        ("kv_total_mib", "1e9", "above 1.67772e+07"),
        ("tokens_in_flight", "1e400", "not finite"),  # json reads 1e400 as inf
    ],
)
def test_a_bad_counter_is_left_out_with_its_reason_and_the_rest_kept(name: str, value: str, why: str) -> None:
    text = ('{"v": 1, "app_id": "a", "pid": 1, "written_at_s": 1, '
            f'"counters": {{"{name}": {value}, "requests_waiting": 4, "torch_reserved_mib": 512.0}}}}')
    report = parse_inapp(text)
    assert report.dropped == ((name, why),)
    assert getattr(report.counters, name) is None
    assert report.counters.requests_waiting == 4 and report.counters.torch_reserved_mib == 512.0


def test_file_naming_another_pid_is_refused(tmp_path: Path) -> None:
    (tmp_path / "5.json").write_text('{"v": 1, "app_id": "a", "pid": 6, "written_at_s": 1}')
    with pytest.raises(InAppFormatError, match="names pid 6"):
        read_inapp(tmp_path, 5, now_s=1.0)


def test_unwritable_inapp_dir_is_counted_not_fatal(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    client = VgpuClient("a", socket="/nowhere.sock", inapp_dir=blocker / "inapp", watch=False, report_period_s=0.01)
    try:
        wait_until(lambda: client.report_errors >= 2)
        assert client.step() == 1
    finally:
        client.close()


def test_the_job_goes_with_the_request_as_the_one_job_type(allocator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from vgpu.jobs import JobConfig

    servicer, sock = allocator
    job = JobConfig("resnet50", batch_size=64, input_size=224)
    with VgpuClient("sized", socket=str(sock), job=job, inapp_dir=tmp_path, torch_module=None, watch=False,
                    report=False) as client:
        client.request()  # memory 0: the daemon sizes it from the job
        client.request(memory_mib=10, job=JobConfig("bert", batch_size=8, mode="infer").to_proto())
    first, second = servicer.requests
    assert JobConfig.from_proto(first.job) == job and first.memory_mib == 0
    assert (second.job.model_type, second.job.mode) == ("bert", "infer")


class NotReadyAllocator(FakeAllocator):
    """Answers the first `not_ready` requests UNAVAILABLE, with the daemon's nothing-changed trailer
    when `marked` (as a daemon whose cold-start model still loads), then grants."""

    def __init__(self, not_ready: int, *, marked: bool) -> None:
        super().__init__()
        self.not_ready = not_ready
        self.marked = marked
        self.calls = 0

    def RequestResourceAllocation(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        if self.calls <= self.not_ready:
            if self.marked:
                context.set_trailing_metadata(((NOTHING_CHANGED_KEY, "1"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "the cold-start model is still loading")
        return super().RequestResourceAllocation(request, context)


@pytest.mark.parametrize("marked", [True, False])
def test_a_request_the_daemon_was_not_ready_for_is_sent_again_only_when_nothing_changed(
        tmp_path: Path, marked: bool) -> None:
    sock = tmp_path / "vgpu.sock"
    servicer = NotReadyAllocator(2, marked=marked)
    server = serve(sock, servicer)
    try:
        with VgpuClient("job", socket=str(sock), inapp_dir=tmp_path / "inapp", torch_module=fake_torch(),
                        watch=False, report=False) as client:
            if marked:
                assert client.request(memory_mib=100).memory_mib == 100
                assert servicer.calls == 3  # two "not ready" answers, then the grant
            else:
                # an UNAVAILABLE that may have come after the daemon acted: never sent again
                with pytest.raises(grpc.RpcError) as err:
                    client.request(memory_mib=100)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and servicer.calls == 1
    finally:
        server.stop(grace=None)
