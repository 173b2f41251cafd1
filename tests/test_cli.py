"""vgpu/ctl.py and vgpu/daemon/metrics.py against an in-process daemon (vgpu.daemon.serve.Daemon)."""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_fixtures import bound_port, sim_daemon, start_logging_serving

from vgpu import auth
from vgpu import ctl as cli
from vgpu.daemon.serve import Daemon


def _env(tmp_path: Path) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "HOME": str(tmp_path)}


async def run(fn: Callable[..., int], tmp_path: Path, *argv: str, **kw: object) -> tuple[int, str]:
    out = io.StringIO()
    rc = await asyncio.to_thread(fn, list(argv), "vgpu x", out=out, env=_env(tmp_path), **kw)
    return rc, out.getvalue()


async def test_request_available_apps_release(daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = ["--socket", str(daemon.socket_path)]
    rc, text = await run(cli.request_main, tmp_path, *sock, "--app", "a", "--memory-mib", "4096", "--sm-pct", "20", "--json")
    grant = json.loads(text)
    assert rc == 0 and grant["memory_mib"] == 4096 and grant["sm_pct"] == 20 and len(grant["grant_id"]) > 8
    assert "application token for 'a' saved" in capsys.readouterr().err
    cached = cli.Tokens(str(daemon.socket_path), tmp_path, None, _env(tmp_path)).app_cache_path("a")
    assert cached.stat().st_mode & 0o777 == 0o600

    rc, text = await run(cli.available_main, tmp_path, *sock, "--json")
    (dev,) = json.loads(text)["devices"]
    assert dev["mem_granted_mib"] == 4096 and dev["sm_available_pct"] == 80
    rc, text = await run(cli.available_main, tmp_path, *sock)
    assert "NVIDIA H100" in text and "4,096" in text
    rc, text = await run(cli.apps_main, tmp_path, *sock)
    assert rc == 0 and text.splitlines()[1].split()[0] == "a" and "4,096" in text.splitlines()[1]

    # Metrics read the live state.
    reg = daemon.registry
    mib = 1024 * 1024
    assert reg.get_sample_value("vgpu_app_granted_memory_bytes", {"app": "a", "device": dev["device_id"]}) == 4096 * mib
    assert reg.get_sample_value("vgpu_device_memory_granted_bytes", {"device": dev["device_id"]}) == 4096 * mib
    assert reg.get_sample_value("vgpu_device_power_limit_watts", {"device": dev["device_id"]}) == 700
    assert reg.get_sample_value("vgpu_store_writes_total") >= 2

    rc, text = await run(cli.release_main, tmp_path, *sock, "--grant", grant["grant_id"], "--json")
    assert rc == 0 and json.loads(text)["grant_id"] == grant["grant_id"]
    assert daemon.allocator.ledger.grants() == []
    assert daemon.store.load_ledger()["grants"] == []  # committed before the call answered


async def test_denials_are_counted(daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = ["--socket", str(daemon.socket_path)]
    rc, text = await run(cli.request_main, tmp_path, *sock, "--app", "a", "--memory-mib", "1", "--json")
    gid = json.loads(text)["grant_id"]
    other = tmp_path / "other"
    rc = await asyncio.to_thread(
        cli.release_main, [*sock, "--grant", gid], "vgpu release", out=io.StringIO(), env=_env(other)
    )
    assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
    rc, _ = await run(cli.set_limit_main, tmp_path, *sock, "--app", "a", "--max-memory-mib", "1")
    assert rc == 1 and "UNAUTHENTICATED: this call needs the operator token" in capsys.readouterr().err
    assert daemon.registry.get_sample_value(
        "vgpu_access_denied_total", {"method": "/vgpu.v1.Allocator/SetResourceLimits", "code": "UNAUTHENTICATED"}
    ) == 1
    assert len(daemon.allocator.ledger.grants()) == 1


async def test_stale_cached_token_is_dropped(daemon: Daemon, tmp_path: Path) -> None:
    cached = cli.Tokens(str(daemon.socket_path), tmp_path, None, _env(tmp_path)).app_cache_path("b")
    cached.parent.mkdir(parents=True)
    cached.write_text("vgpu1.YXBwOmI.0000\n")  # from some other daemon
    rc, text = await run(cli.request_main, tmp_path, "--socket", str(daemon.socket_path), "--app", "b",
                         "--memory-mib", "1", "--json")
    assert rc == 0 and json.loads(text)["app_id"] == "b"
    assert daemon.store.app_claimed("b")
    assert cached.read_text().strip() == auth.app_token_file("b", daemon.state_dir).read_text().strip()


async def test_operator_token_from_state_dir(daemon: Daemon, tmp_path: Path) -> None:
    rc, text = await run(cli.set_limit_main, tmp_path, "--socket", str(daemon.socket_path), "--state-dir",
                         str(daemon.state_dir), "--app", "a", "--max-sm-pct", "50", "--priority", "3", "--create",
                         "--json")
    assert rc == 0 and json.loads(text) == {"app_id": "a", "max_sm_pct": 50.0, "priority": 3}


async def test_top_refreshes_until_iterations(daemon: Daemon, tmp_path: Path) -> None:
    now = [100.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s + 0.25  # the refresh itself "takes" 0.25 s of the next period

    rc, text = await run(cli.top_main, tmp_path, "--socket", str(daemon.socket_path), "--iterations", "3",
                         sleep=sleep, clock=lambda: now[0])
    assert rc == 0 and text.count("vgpu top") == 3
    # Fixed rate on deadlines: the first wait is a whole period, later ones make up for the lag.
    assert sleeps == [1.0, 0.75]


def test_unreachable_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.available_main(["--socket", str(tmp_path / "none.sock"), "--wait-s", "0"], "vgpu available", out=io.StringIO(),
                            env=_env(tmp_path))
    assert rc == 1 and "cannot reach the vgpu daemon" in capsys.readouterr().err


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.request_main(["--app", "a", "--memory-mib", "-5"], "vgpu request", out=io.StringIO(), env=_env(tmp_path))
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        cli.request_main(["--memory-mib", "5"], "vgpu request", out=io.StringIO(), env=_env(tmp_path))


def test_missing_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.apps_main(["--socket", str(tmp_path / "s"), "--token-file", str(tmp_path / "nope")], "vgpu apps",
                       out=io.StringIO(), env=_env(tmp_path))
    assert rc == 2 and "cannot read a token" in capsys.readouterr().err  # a usage error


async def test_metrics_endpoint_serves_the_registry(tmp_path: Path) -> None:
    import urllib.request

    d = sim_daemon(tmp_path, **{"metrics.port": "auto"})
    serving = await start_logging_serving(d)
    try:
        port = bound_port(serving, "metrics")
        await run(cli.request_main, tmp_path, "--socket", str(d.socket_path), "--app", "m", "--memory-mib", "64")
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        )
    finally:
        await d.stop("test")
    assert re.search(r'vgpu_app_granted_memory_bytes\{app="m",device="GPU-[^"]+"\} 6\.7108864e\+07', body), body
    assert "vgpu_forecast_batch_seconds_count" in body and "vgpu_enforcement_actions_total" in body


async def test_unwritable_token_cache_keeps_the_grant(daemon: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "cfg"
    blocker.write_text("a file where the cache directory should be")
    rc, text = await run(cli.request_main, tmp_path, "--socket", str(daemon.socket_path), "--app", "c",
                         "--memory-mib", "3", "--json")
    assert rc == 0 and json.loads(text)["memory_mib"] == 3
    said = capsys.readouterr().err
    assert "could not save the application token" in said and "may request for 'c' again" in said


async def test_request_sizes_a_described_job_with_the_cold_start_model(tmp_path: Path) -> None:
    from vgpu.allocator.core import Sizing
    from vgpu.jobs import JobConfig

    class PerSample:
        def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
            return Sizing(50.0 * job.batch_size, 10.0, "test")

    d = sim_daemon(tmp_path, load_sizer=PerSample)
    await d.start()
    try:
        assert d.sizer.wait(10)
        sock = ["--socket", str(d.socket_path)]
        rc, text = await run(cli.request_main, tmp_path, *sock, "--app", "j", "--model-type", "resnet50",
                             "--batch-size", "64", "--json")
        grant = json.loads(text)
        assert rc == 0 and (grant["memory_mib"], grant["source"]) == (3200, "cold_start")
        assert grant["cold_start_mib"] == 3200  # the sizer's size, told beside the grant
        rc, text = await run(cli.request_main, tmp_path, *sock, "--app", "j2", "--model-type", "resnet50",
                             "--batch-size", "8")
        assert rc == 0 and text.endswith(" for j2 (the job sized at 400 MiB)\n"), text
        rc, text = await run(cli.request_main, tmp_path, *sock, "--app", "x", "--memory-mib", "512", "--json")
        assert rc == 0 and "cold_start_mib" not in json.loads(text)  # an amount asked: no size to tell
        rc, _ = await run(cli.request_main, tmp_path, *sock, "--app", "k", "--model-type", "resnet50")
        assert rc == 2  # no batch size: refused at the command line as the daemon would refuse it, nothing granted
        rc, _ = await run(cli.request_main, tmp_path, *sock, "--app", "k")
        assert rc == 2  # neither --memory-mib nor a job: a usage error
        assert sorted(g.app_id for g in d.allocator.ledger.grants()) == ["j", "j2", "x"]
    finally:
        await d.stop("test")
