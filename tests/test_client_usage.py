"""What an application hands the client stub, and what the stub says back: the step counter's
checks, the daemon's socket found as the CLI finds it, the job's type and bounds, a job that a
memory_mib given leaves unsized, an optimizer it does not know, and a release whose daemon is gone.
Against the fake allocator of tests/test_client.py (a real gRPC server on a Unix socket)."""

from __future__ import annotations

import json
import re
import socket as socketlib
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

# the pytest fixture `allocator` (a fake allocator on a Unix socket) and its helpers, from tests/test_client.py:
# imported, the fixture serves this module's tests too (a test parameter named `allocator` takes it)
from tests.test_client import FakeAllocator, allocator, serve  # noqa: F401
from vgpu import client as vclient
from vgpu.client import DEFAULT_SOCKET, INAPP_MAX, VgpuClient, app_token_path, inapp_path, read_inapp
from vgpu.jobs import InvalidJobConfig, JobConfig


def quiet(tmp_path: Path, **kw: object) -> VgpuClient:
    """A client with no threads and its own configuration directory (tokens) and in-app directory."""
    kw.setdefault("env", {"XDG_CONFIG_HOME": str(tmp_path / "config")})
    kw.setdefault("inapp_dir", tmp_path / "inapp")  # None: the node's, as an application gets it
    return VgpuClient("usage", watch=False, report=False, torch_module=None, **kw)  # type: ignore[arg-type]


# --- step() -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "error", "said"), [
    (float("nan"), ValueError, "not finite"),
    (float("inf"), ValueError, "not finite"),
    (2.5, ValueError, "not a whole number"),
    (-1, ValueError, "only grows"),
    (2**53 + 1, ValueError, "bound"),
    ("x", TypeError, "whole number"),
    (True, TypeError, "whole number"),
    (None, TypeError, "whole number"),
])
def test_step_refuses_what_is_no_count_and_keeps_the_count(tmp_path: Path, n: object, error: type,
                                                            said: str) -> None:
    client = quiet(tmp_path, socket=str(tmp_path / "none.sock"))
    try:
        assert client.step(3) == 3
        with pytest.raises(error, match=said) as info:
            client.step(n)  # type: ignore[arg-type]
        assert "step" in str(info.value)
        # the count is as it was, and goes on: one bad call does not spoil every later report
        assert client.step() == 4 and client.step(2.0) == 6
        written = client.report_now()
        data = json.loads(written.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the report"))
        assert data["counters"]["step"] == 6 and isinstance(data["counters"]["step"], int)
    finally:
        client.close(release=False)


def test_step_stops_at_the_profilers_bound(tmp_path: Path) -> None:
    client = quiet(tmp_path, socket=str(tmp_path / "none.sock"))
    try:
        most = int(INAPP_MAX["step"])
        assert client.step(most) == most
        with pytest.raises(ValueError, match="bound"):
            client.step()
        client.report_now()
        report = read_inapp(tmp_path / "inapp", client.pid, now_s=time.time())
        assert report is not None and report.counters.step == most and report.dropped == ()
    finally:
        client.close(release=False)


# --- the daemon's socket ----------------------------------------------------------------------------


def test_the_socket_follows_the_environment_then_the_configuration_file(
        allocator: tuple[FakeAllocator, Path], tmp_path: Path) -> None:  # noqa: F811
    servicer, sock = allocator
    home = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    absent = tmp_path / "no-config.toml"

    # VGPU_SERVER_SOCKET, as `vgpu apps` reads it
    with quiet(tmp_path, env={**home, "VGPU_SERVER_SOCKET": str(sock)}, config_file=absent) as c:
        assert c.request(memory_mib=100).memory_mib == 100
        # the token goes where the CLI looks for this socket's tokens
        assert c.token_file == app_token_path("usage", str(sock), home)

    # server.socket of the configuration file (the gRPC spelling too), when the environment says nothing
    conf = tmp_path / "vgpu.toml"
    conf.write_text(f'[server]\nsocket = "unix://{sock}"\nstate_dir = "/var/lib/vgpu"\n')
    with quiet(tmp_path, env=home, config_file=conf) as c:
        assert c.request(memory_mib=200).memory_mib == 200

    # the environment wins over the file, and socket= over both
    conf.write_text('[server]\nsocket = "/nowhere/vgpu.sock"\n')
    with quiet(tmp_path, env={**home, "VGPU_SERVER_SOCKET": str(sock)}, config_file=conf) as c:
        assert c.request(memory_mib=300).memory_mib == 300
    with quiet(tmp_path, env={**home, "VGPU_SERVER_SOCKET": "/nowhere/else.sock"}, config_file=conf,
               socket=str(sock)) as c:
        assert c.request(memory_mib=400).memory_mib == 400
    assert [r.memory_mib for r in servicer.requests] == [100, 200, 300, 400]


@pytest.mark.parametrize("content", [
    "[server\nsocket = ",  # not TOML
    '[server]\nsocket = "relative/vgpu.sock"\n',
    "[server]\nsocket = 5\n",
    None,  # a directory where the file should be: unreadable
])
def test_an_unusable_configuration_file_gives_the_default_socket_said_once(tmp_path: Path,
                                                                            content: str | None) -> None:
    conf = tmp_path / "vgpu.toml"
    if content is None:
        conf.mkdir()
    else:
        conf.write_text(content)
    vclient._config_warned.difference_update({(str(conf), ""), (str(conf), "socket")})
    home = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    with capture_logs() as logs:
        for _ in range(2):  # a second client, as an application with two, is not told again
            with quiet(tmp_path, env=home, config_file=conf, inapp_dir=None) as c:
                assert c.token_file == app_token_path("usage", DEFAULT_SOCKET, home)
                assert c.inapp_dir == vclient.DEFAULT_INAPP_DIR
    said = [e for e in logs if "configuration file" in e["event"]]
    # one line for the file, whichever settings the stub reads from it; a bad socket value its own line
    assert len(said) == 1, logs
    assert said[0]["config_file"] == str(conf)
    assert said[0].get("default", DEFAULT_SOCKET) == DEFAULT_SOCKET


def test_a_relative_socket_in_the_environment_is_refused_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="VGPU_SERVER_SOCKET"):
        quiet(tmp_path, env={"VGPU_SERVER_SOCKET": "run/vgpu.sock"})


def test_no_configuration_file_and_no_variable_is_the_built_in_default(tmp_path: Path) -> None:
    assert vclient.default_socket({}, tmp_path / "none.toml") == DEFAULT_SOCKET
    assert vclient.default_socket({}, None) == vclient.default_socket({}, vclient.config.DEFAULT_CONFIG_PATH)
    assert vclient.default_inapp_dir({}, tmp_path / "none.toml") == vclient.DEFAULT_INAPP_DIR


def test_the_in_app_directory_follows_the_node_as_the_socket_does(tmp_path: Path) -> None:
    """A node whose daemon reads in-app reports elsewhere (server.inapp_dir in the file or the
    environment, as `vgpu serve` reads it): the stub writes there, so its counters and its pid's proof
    reach the daemon; inapp_dir= wins."""
    conf = tmp_path / "vgpu.toml"
    conf.write_text(f'[server]\ninapp_dir = "{tmp_path / "from-file"}"\n')
    home = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    with quiet(tmp_path, env=home, config_file=conf, socket=str(tmp_path / "none.sock"), inapp_dir=None) as c:
        assert c.inapp_dir == tmp_path / "from-file"
    env = {**home, "VGPU_SERVER_INAPP_DIR": str(tmp_path / "from-env")}
    with quiet(tmp_path, env=env, config_file=conf, socket=str(tmp_path / "none.sock"), inapp_dir=None) as c:
        assert c.inapp_dir == tmp_path / "from-env"
    with quiet(tmp_path, env=env, config_file=conf, socket=str(tmp_path / "none.sock"), inapp_dir=tmp_path / "arg") as c:
        assert c.inapp_dir == tmp_path / "arg"
    with pytest.raises(ValueError, match="VGPU_SERVER_INAPP_DIR"):
        vclient.default_inapp_dir({"VGPU_SERVER_INAPP_DIR": "run/inapp"}, conf)


# --- the job ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("job", [{"model_type": "resnet50", "batch_size": 64}, "resnet50", 64])
def test_a_job_that_is_no_jobconfig_is_refused_at_once(tmp_path: Path, job: object) -> None:
    with pytest.raises(TypeError, match=r"VgpuClient\(job=\.\.\.\): expected a vgpu.jobs.JobConfig"):
        quiet(tmp_path, socket=str(tmp_path / "none.sock"), job=job)
    with quiet(tmp_path, socket=str(tmp_path / "none.sock")) as c, \
            pytest.raises(TypeError, match=r"request\(job=\.\.\.\): expected a vgpu.jobs.JobConfig"):
        c.request(job=job)  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "most"), [
    ("batch_size", 2**32 - 1), ("input_size", 2**32 - 1), ("num_layers", 2**32 - 1), ("param_count", 2**64 - 1)])
def test_jobconfig_holds_its_integers_to_the_messages_bounds(field: str, most: int) -> None:
    job = JobConfig(model_type="resnet50", **{field: most})  # type: ignore[arg-type]
    assert getattr(job.to_proto(), field) == most
    with pytest.raises(InvalidJobConfig, match=rf"{field} must be within 0\.\.{most}"):
        JobConfig(model_type="resnet50", **{field: most + 1})  # type: ignore[arg-type]


def test_a_job_with_memory_mib_given_is_said_not_to_be_sized(
        allocator: tuple[FakeAllocator, Path], tmp_path: Path) -> None:  # noqa: F811
    _, sock = allocator
    job = JobConfig(model_type="resnet50", batch_size=64, mode="train", optimizer="sgd")
    with capture_logs() as logs, quiet(tmp_path, socket=str(sock), job=job) as c:
        c.request(memory_mib=1000)
        c.request(memory_mib=2000)  # said once
        c.request(job=JobConfig(model_type="resnet18", batch_size=8, optimizer="sgd"), memory_mib=500)
    said = [e for e in logs if e["event"] == "the job is not sized: memory_mib given"]
    assert len(said) == 1 and said[0]["log_level"] == "warning" and "without memory_mib" in said[0]["fix"]
    with capture_logs() as logs, quiet(tmp_path, socket=str(sock), job=job) as c:
        c.request()  # sized: nothing to say
        c.request(sm_pct=10)
    assert not [e for e in logs if "not sized" in e["event"]], logs


def test_an_unknown_optimizer_is_said_by_the_stub(
        allocator: tuple[FakeAllocator, Path], tmp_path: Path) -> None:  # noqa: F811
    _, sock = allocator
    with capture_logs() as logs, quiet(tmp_path, socket=str(sock)) as c:
        c.request(job=JobConfig(model_type="resnet50", batch_size=64, optimizer="adamw-typo"))
        c.request(job=JobConfig(model_type="resnet50", batch_size=64, optimizer="AdamW"))
        c.request(job=JobConfig(model_type="resnet50", batch_size=64))  # none given: nothing to say here
        # inference keeps no optimizer state: the name is not used, and not warned of
        c.request(job=JobConfig(model_type="resnet50", batch_size=64, optimizer="lion", mode="infer"))
        # nor is it where memory_mib is given: the job is not sized
        c.request(job=JobConfig(model_type="resnet50", batch_size=64, optimizer="lion"), memory_mib=10)
    said = [e["event"] for e in logs if "optimizer" in e["event"]]
    assert len(said) == 1 and said[0].startswith("unknown optimizer 'adamw-typo' (known: none, sgd, adam, adamw"), logs
    assert said[0].endswith("assumed Adam (8 bytes of state per parameter)")


# --- release when the daemon is gone -----------------------------------------------------------------


def test_release_when_the_daemons_socket_is_gone_is_said_once_and_quick(tmp_path: Path) -> None:
    sock = tmp_path / "vgpu.sock"
    servicer = FakeAllocator()
    server = serve(sock, servicer)
    client = quiet(tmp_path, socket=str(sock))
    try:
        client.request(memory_mib=1000)
        client.request(memory_mib=2000)
    finally:
        server.stop(grace=None)
    sock.unlink(missing_ok=True)  # a daemon stopped: its socket removed

    with capture_logs() as logs:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            client.release()  # default ready_wait_s is 10 s: bounded where nothing is at the socket
        release_s = time.monotonic() - started
        started = time.monotonic()
        client.close()  # the `with` block's exit: no raise, bounded likewise
        close_s = time.monotonic() - started
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert release_s < 5.0 and close_s < 5.0, (release_s, close_s)
    said = [e for e in logs if e["log_level"] == "warning"]
    assert len(said) == 1, logs
    assert said[0]["event"].startswith("cannot reach the vgpu daemon to release the grants")
    assert "sees this process gone" in said[0]["event"] and "next start" in said[0]["event"]
    assert len(said[0]["grants"]) == 2 and "daemon is stopped" in said[0]["socket_absent"]
    assert not inapp_path(tmp_path / "inapp", client.pid).exists()


# --- the docs' serving example -------------------------------------------------------------------------

VLLM_METRICS = b"vllm:num_requests_running 4\nvllm:num_requests_waiting 2\nvllm:gpu_cache_usage_perc 0.25\n"


def docs_example(marker: str) -> str:
    text = (Path(__file__).resolve().parent.parent / "docs" / "profiler.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if marker in b)


def test_the_docs_serving_example_goes_on_through_a_metrics_outage(tmp_path: Path) -> None:
    """The vLLM example of docs/profiler.md, run as written against an engine whose /metrics is down
    for its first scrape: it skips that report and goes on, holding its grant, rather than leaving
    the `with` block (which would release the serving engine's grant)."""
    sock = tmp_path / "vgpu.sock"
    servicer = FakeAllocator(capacity_mib=100_000)
    server = serve(sock, servicer)
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there until the engine is "up"
    scrapes: list[str] = []

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            scrapes.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(VLLM_METRICS)

        def log_message(self, *args: object) -> None:
            pass

    engine: list[HTTPServer] = []
    reports: list[float] = []

    class Serving:
        """`serving` of the example: true for four turns; the engine's /metrics comes up at the third."""

        turns = 0

        def __bool__(self) -> bool:
            self.turns += 1
            if self.turns == 3:
                engine.append(HTTPServer(("127.0.0.1", port), Metrics))
                threading.Thread(target=engine[0].serve_forever, daemon=True).start()
            if servicer.grants:
                reports.append(sum(g.memory_mib for g in servicer.grants.values()))
            return self.turns <= 4

    code = (docs_example("scrape_serving_metrics(")
            .replace("http://127.0.0.1:8000/metrics", f"http://127.0.0.1:{port}/metrics")
            .replace('VgpuClient("llama-8b-serve")',
                     f'VgpuClient("llama-8b-serve", socket={str(sock)!r}, inapp_dir={str(tmp_path / "inapp")!r})')
            .replace("time.sleep(1.0)", "time.sleep(0.01)"))
    try:
        exec(compile(code, "docs/profiler.md", "exec"), {"serving": Serving()})  # noqa: S102 - the docs' own example
    finally:
        server.stop(grace=None)
        for e in engine:
            e.shutdown()
            e.server_close()
    # the grant was held through the outage, and the engine's counters were read once it was up
    assert reports[:4] == [60_000.0] * 4 and len(scrapes) == 2, (reports, scrapes)
    assert servicer.grants == {}  # released when the loop ended, not before


def test_a_fraction_of_a_request_or_token_is_refused_where_a_whole_count_is_fine(tmp_path: Path) -> None:
    from vgpu.client import ServingCounters

    assert ServingCounters(requests_running=2.5, kv_used_mib=10.5).problems() == [  # type: ignore[arg-type]
        "requests_running: not a whole number (2.5)"]  # MiB may be fractional, a count may not
    assert ServingCounters(requests_running=2.0, tokens_in_flight=300).problems() == []  # type: ignore[arg-type]
    with quiet(tmp_path, socket=str(tmp_path / "none.sock")) as c, \
            pytest.raises(ValueError, match=r"tokens_in_flight: not a whole number \(0\.5\)"):
        c.report_serving(ServingCounters(tokens_in_flight=0.5))  # type: ignore[arg-type]
