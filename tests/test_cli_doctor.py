"""vgpu/daemon/doctor.py: each check says OK / WARN / FAIL with what to do; any FAIL exits 1."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

from vgpu.daemon import doctor
from vgpu.device.errors import LibraryNotFound

CAPS_ROOT = "CapEff:\t000001ffffffffff\n"
CAPS_NONE = "CapEff:\t0000000000000000\n"


def test_driver(tmp_path: Path) -> None:
    assert doctor.check_driver(tmp_path).status == "FAIL"
    assert doctor.check_driver(tmp_path, required=False).status == "WARN"
    (tmp_path / "driver" / "nvidia").mkdir(parents=True)
    (tmp_path / "driver" / "nvidia" / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n")
    check = doctor.check_driver(tmp_path)
    assert check.status == "OK" and "550.54.15" in check.detail


def test_nvml() -> None:
    def missing() -> object:
        raise LibraryNotFound("libnvidia-ml.so.1 not found")

    check = doctor.check_nvml(missing)
    assert check.status == "FAIL" and "LibraryNotFound" in check.detail
    from vgpu.device.sim import SimBackend

    check = doctor.check_nvml(lambda: SimBackend(["h100-80gb", "a100-40gb"]))
    assert check.status == "OK" and "2 device(s)" in check.detail


def test_privileges() -> None:
    assert doctor.check_privileges(0, CAPS_ROOT).status == "OK"
    assert doctor.check_privileges(1000, CAPS_NONE).status == "WARN"
    assert doctor.check_privileges(1000, f"CapEff:\t{1 << 21:016x}\n").status == "OK"


def test_socket(tmp_path: Path) -> None:
    assert doctor.check_socket(tmp_path / "none.sock").status == "FAIL"
    (tmp_path / "file").write_text("")
    assert "not a socket" in doctor.check_socket(tmp_path / "file").detail
    dead = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(dead))  # bound, never listening: nothing answers
    check = doctor.check_socket(dead, timeout_s=0.5)
    s.close()
    assert check.status == "FAIL" and "no answer" in check.detail


def test_state_dir(tmp_path: Path) -> None:
    assert doctor.check_state_dir(tmp_path).status == "OK"
    assert doctor.check_state_dir(tmp_path / "new").status == "WARN"
    (tmp_path / "f").write_text("")
    assert doctor.check_state_dir(tmp_path / "f").status == "FAIL"


def test_model(tmp_path: Path) -> None:
    assert doctor.check_model(tmp_path / "none.pt").status == "WARN"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")

    def refuse(path: Path) -> object:
        raise ValueError(f"{path} is not a checkpoint")

    check = doctor.check_model(bad, refuse)
    assert check.status == "FAIL" and "is not a checkpoint" in check.detail
    assert doctor.check_model(bad, lambda p: object()).status == "OK"


def test_main_exits_1_on_failure_and_prints_a_line_per_check(tmp_path: Path) -> None:
    out = io.StringIO()
    rc = doctor.main(["--socket", str(tmp_path / "none.sock"), "--state-dir", str(tmp_path), "--backend", "sim:h100-80gb",
                      "--model", str(tmp_path / "none.pt")], "vgpu doctor", out=out)
    lines = out.getvalue().splitlines()
    assert rc == 1
    names = [line.split()[1] for line in lines]
    assert names == ["config", "backend", "driver", "nvml", "privileges", "socket", "state", "inapp", "model", "local", "node", "profiler"]
    assert all(line.split()[0] in ("OK", "WARN", "FAIL") for line in lines)
    assert lines[5].startswith("FAIL") and "does not exist" in lines[5]
    # the hint names the service and a daemon started by hand
    assert "systemctl status vgpu-manager" in lines[5] and "give its --socket here" in lines[5]
    assert "sim:h100-80gb (checked as --backend asks: no daemon answers" in lines[1]


def test_main_json_and_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "vgpu.toml"
    bad.write_text("[server]\nsocket_mode = 7\n")
    out = io.StringIO()
    rc = doctor.main(["--config", str(bad), "--json", "--model", str(tmp_path / "none.pt")], "vgpu doctor", out=out)
    checks = json.loads(out.getvalue())
    assert rc == 1 and checks[0]["name"] == "config" and checks[0]["status"] == "FAIL"
    assert "server.socket_mode" in checks[0]["detail"]


async def test_socket_ok_against_the_daemon(tmp_path: Path) -> None:
    from daemon_fixtures import sim_daemon

    d = sim_daemon(tmp_path)
    await d.start()
    try:
        import asyncio

        check = await asyncio.to_thread(doctor.check_socket, d.socket_path)
    finally:
        await d.stop("test")
    assert check.status == "OK" and "mode 0660" in check.detail and "serving" in check.detail


async def test_the_daemons_own_capabilities_are_read_through_its_socket(tmp_path: Path) -> None:
    """The process at the other end of the socket (here this one, which runs the daemon) is read from
    /proc: with CAP_SYS_PTRACE it places containers' pids; without it (as under a unit that drops it)
    the line warns of what that refuses. No daemon, or one whose process cannot be read: no line."""
    import asyncio
    import os

    from daemon_fixtures import sim_daemon

    d = sim_daemon(tmp_path / "d")
    await d.start()
    fake = tmp_path / "proc" / str(os.getpid())
    fake.mkdir(parents=True)
    try:
        (fake / "status").write_text(f"Name:\tvgpu\nCapEff:\t{(1 << 21) | (1 << 19):016x}\n")
        held = await asyncio.to_thread(doctor.check_daemon_capabilities, d.socket_path, tmp_path / "proc")
        (fake / "status").write_text(f"Name:\tvgpu\nCapEff:\t{1 << 21:016x}\n")
        lacked = await asyncio.to_thread(doctor.check_daemon_capabilities, d.socket_path, tmp_path / "proc")
        (fake / "status").unlink()
        unread = await asyncio.to_thread(doctor.check_daemon_capabilities, d.socket_path, tmp_path / "proc")
    finally:
        await d.stop("test")
    assert held is not None and held.status == "OK" and f"pid {os.getpid()} holds CAP_SYS_PTRACE" in held.detail
    assert lacked is not None and lacked.status == "WARN" and "lacks CAP_SYS_PTRACE" in lacked.detail
    assert unread is None
    assert doctor.check_daemon_capabilities(tmp_path / "none.sock") is None


def test_a_configured_model_that_is_missing_fails_and_the_default_is_the_shipped_one(tmp_path: Path) -> None:
    from vgpu.manager.modelpath import resolve_model

    assert doctor.check_model(tmp_path / "none.pt", required=True).status == "FAIL"
    out = io.StringIO()
    doctor.main(["--socket", str(tmp_path / "s"), "--state-dir", str(tmp_path), "--backend", "sim:h100-80gb",
                 "--model", str(tmp_path / "none.pt"), "--json"], "vgpu doctor", out=out)
    (model,) = [c for c in json.loads(out.getvalue()) if c["name"] == "model"]
    assert model["status"] == "FAIL" and "configured" in model["detail"]
    # without --model and manager.model, doctor checks what the daemon and the demo would serve
    out = io.StringIO()
    doctor.main(["--socket", str(tmp_path / "s"), "--state-dir", str(tmp_path), "--backend", "sim:h100-80gb",
                 "--json"], "vgpu doctor", out=out)
    (model,) = [c for c in json.loads(out.getvalue()) if c["name"] == "model"]
    assert str(resolve_model(None).path) in model["detail"] and model["status"] in ("OK", "WARN")
    assert resolve_model("").path == resolve_model(None).path and not resolve_model(None).configured
    assert resolve_model(str(tmp_path / "m.pt")).configured


def test_the_default_model_path_is_the_predictors() -> None:
    from vgpu.manager import predictor
    from vgpu.manager.modelpath import FALLBACK_DEFAULT, default_model_path

    # the torch-free answer the daemon starts with is the path the predictor names
    assert default_model_path() == FALLBACK_DEFAULT == predictor.DEFAULT_MODEL_PATH


async def test_the_daemon_degrades_to_the_baseline_when_the_default_model_does_not_load(tmp_path: Path) -> None:
    import structlog
    from daemon_fixtures import sim_daemon
    from structlog.testing import capture_logs

    structlog.reset_defaults()  # another test's `main()` may have configured warning level for the process
    d = sim_daemon(tmp_path)
    await d.start()
    try:
        assert d.model_loader is not None
        d.model_loader.join(60)
        before = d.manager.forecaster
        bad = tmp_path / "default.pt"
        bad.write_bytes(b"not a checkpoint")
        with capture_logs() as logs:
            d._load_default_model(bad)
            d._load_default_model(tmp_path / "absent.pt")
        assert d.manager.forecaster is before
        events = {e["event"]: e for e in logs}
        # what serves, as vgpu_forecaster_serving names it: the mixture (the default), without the model
        assert events["forecaster_unavailable"]["serving"] == "mixture" and str(bad) in events["forecaster_unavailable"]["path"]
        assert "no checkpoint at" in events["forecaster"]["reason"] and events["forecaster"]["serving"] == "mixture"
        assert events["forecaster"]["model"] == "absent"
    finally:
        await d.stop("test")


def test_the_backend_checked_is_the_daemons_unless_given_and_said_when_the_daemon_does_not_say(tmp_path: Path) -> None:
    from vgpu.v1 import allocator_pb2 as pb

    sock = tmp_path / "v.sock"
    sim = pb.GetAvailableResourcesResponse(backend="sim:h100-80gb")
    assert doctor.choose_backend("nvml", given=False, socket_path=sock, answer=(sim, "")).spec == "sim:h100-80gb"
    given = doctor.choose_backend("sim", given=True, socket_path=sock, answer=(sim, ""))
    assert given.spec == "sim:h100-80gb" and given.check.status == "OK"  # the same devices
    other = doctor.choose_backend("nvml", given=True, socket_path=sock, answer=(sim, ""))
    assert other.spec == "nvml" and other.check.status == "WARN" and "runs on sim:h100-80gb" in other.check.detail
    old = doctor.choose_backend("nvml", given=False, socket_path=sock, answer=(pb.GetAvailableResourcesResponse(), ""))
    assert old.spec == "nvml" and old.check.status == "WARN" and "does not say" in old.check.detail
    gone = doctor.choose_backend("nvml", given=False, socket_path=sock, answer=(None, "UNAVAILABLE: down"))
    assert gone.spec == "nvml" and "no daemon answers" in gone.check.detail


def test_a_simulator_spec_is_checked_without_a_daemon() -> None:
    driver, nvml = doctor.check_sim("sim:a100-40gb*2", None)
    assert driver.status == "OK" and nvml.status == "OK" and "2 device(s)" in nvml.detail
    _, bad = doctor.check_sim("sim:nope", None)
    assert bad.status == "FAIL" and "nope" in bad.detail
