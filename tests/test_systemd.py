"""systemd/: the units verify with systemd-analyze and keep the promises the docs make."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vgpu import config

ROOT = Path(__file__).resolve().parent.parent
UNITS = ("vgpu-manager.service", "vgpu-profiler.service")
VGPU_BIN = Path(sys.executable).parent / "vgpu"


def _settings(unit: str) -> list[tuple[str, str]]:
    out = []
    for line in (ROOT / "systemd" / unit).read_text().splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def _section(unit: str, name: str) -> dict[str, str]:
    """The settings of one [section] of a unit."""
    out, current = {}, ""
    for line in (ROOT / "systemd" / unit).read_text().splitlines():
        if line.startswith("["):
            current = line.strip("[]")
        elif current == name and line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _verify(tmp_path: Path, texts: dict[str, str]) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd provides it)")
    if not VGPU_BIN.exists():
        pytest.skip(f"{VGPU_BIN} is missing: install vgpu into the environment first (pip install -e .)")
    for name, text in texts.items():
        # The units name the installed path; verify them against this environment's entry point.
        (tmp_path / name).write_text(text.replace("/usr/local/bin/vgpu", str(VGPU_BIN)))
    return subprocess.run(
        [analyze, "verify", "--man=no", *[str(tmp_path / n) for n in texts]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_units_verify_without_a_warning(tmp_path: Path) -> None:
    proc = _verify(tmp_path, {u: (ROOT / "systemd" / u).read_text() for u in UNITS})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr


def test_verify_catches_a_typo(tmp_path: Path) -> None:
    """The check above could fail: a misspelt key is reported."""
    text = (ROOT / "systemd" / UNITS[0]).read_text().replace("Type=notify", "Tpye=notify")
    proc = _verify(tmp_path, {UNITS[0]: text})
    assert "Unknown key 'Tpye'" in proc.stderr


def test_manager_unit_promises() -> None:
    s = dict(_settings("vgpu-manager.service"))
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert int(s["WatchdogSec"]) > 0 and s["Restart"] == "on-failure"
    assert s["RuntimeDirectory"] == "vgpu" and s["StateDirectory"] == "vgpu"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert s[key] == "yes", key
    assert s["ProtectSystem"] == "strict" and s["DevicePolicy"] == "closed"
    allowed = [v for k, v in _settings("vgpu-manager.service") if k == "DeviceAllow"]
    assert any("nvidia" in a for a in allowed)


def test_the_manager_may_open_the_socket_families_the_daemon_uses() -> None:
    """RestrictAddressFamilies refuses any other family at socket(): AF_NETLINK is the metrics
    endpoint's sock_diag lookup of a loopback caller's uid (vgpu/daemon/sockdiag.py), which without
    it fails on every accept and leaves all local users one shared bound."""
    families = set(dict(_settings("vgpu-manager.service"))["RestrictAddressFamilies"].split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"} <= families, families
    assert "AF_NETLINK" in (ROOT / "vgpu" / "daemon" / "sockdiag.py").read_text()


def test_the_manager_has_a_memory_cap_with_room_for_what_it_needs() -> None:
    """Half-sent calls from several users together grow the daemon past any one user's bound: the unit
    caps its memory, so an attack ends in a restart instead of the kernel killing other processes on the node. The cap must
    leave room for what the docs measure: the daemon after a day of 64 applications (355 MiB,
    bench/soak.py) plus a learning round's child (460 MiB, bench/node_learn.py), several times over."""
    s = dict(_settings("vgpu-manager.service"))
    value = s["MemoryMax"]
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    cap_bytes = int(value[:-1]) * units[value[-1]] if value[-1] in units else int(value)
    assert cap_bytes >= 4 * (355 + 460) * 2**20, value
    assert s["Restart"] == "on-failure"  # systemd restarts a unit the OOM killer ended on failure


def test_one_uid_s_half_sent_calls_stay_well_under_the_memory_cap() -> None:
    """What one uid can make the daemon hold with calls it never finishes, with the shipped settings:
    its connections x calls per connection x (the request limit + gRPC's own, about 30 KiB a call,
    bench/halfsent.py), at most a quarter of the unit's cap."""
    cfg = config.load(ROOT / "systemd" / "vgpu.toml", env={}).server
    value = dict(_settings("vgpu-manager.service"))["MemoryMax"]
    cap_bytes = int(value[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[value[-1]]
    per_uid = cfg.max_connections_per_uid * cfg.max_streams_per_connection * (cfg.max_request_bytes + 32 * 2**10)
    assert per_uid <= cap_bytes / 4, (per_uid / 2**30, value)


def test_every_capability_is_commented() -> None:
    """CAP_SYS_PTRACE among them: without it the daemon may not read the pid namespace of another
    user's process or a root container's, and a caller in a container naming a pid other than its
    own was refused (tests/test_hostile_pidns.py)."""
    text = (ROOT / "systemd" / "vgpu-manager.service").read_text()
    caps = dict(_settings("vgpu-manager.service"))["CapabilityBoundingSet"].split()
    assert caps and "CAP_SYS_ADMIN" in caps and "CAP_SYS_PTRACE" in caps
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for cap in caps:
        assert re.search(rf"#\s*{cap}:", comments), f"{cap} has no comment saying why"


def test_the_longest_stop_grace_leaves_the_restore_half_the_stop_timeout() -> None:
    """A stop waits up to server.grace_s for calls in flight and only then restores the devices;
    systemd kills the daemon TimeoutStopSec after SIGTERM, so the largest grace the configuration
    takes must leave the restore at least as long again."""
    timeout_s = float(dict(_settings("vgpu-manager.service"))["TimeoutStopSec"])
    assert 2 * config.MAX_GRACE_S <= timeout_s, (config.MAX_GRACE_S, timeout_s)


def test_profiler_is_unprivileged() -> None:
    s = dict(_settings("vgpu-profiler.service"))
    assert s["CapabilityBoundingSet"] == "" and (s.get("DynamicUser") == "yes" or s.get("User"))
    assert s["NoNewPrivileges"] == "yes"


def test_the_profiler_may_read_the_mig_monitor_capability_and_nothing_more() -> None:
    """On MIG GPUs, per-process NVML reads of the whole GPU need the mig-monitor capability device
    (/dev/nvidia-caps/nvidia-cap2), which DevicePolicy=closed denies unless allowed: read-only, with the
    documentation it rests on named beside it; never the manager's read-write access."""
    allowed = [v.split() for k, v in _settings("vgpu-profiler.service") if k == "DeviceAllow"]
    assert ["char-nvidia-caps", "r"] in allowed
    assert not any(a[0] == "char-nvidia-caps" and "w" in a[1] for a in allowed)
    text = (ROOT / "systemd" / "vgpu-profiler.service").read_text()
    assert "mig-user-guide/device-nodes-and-capabilities" in text and "mig-monitor" in text
    assert "char-nvidia-caps r" in (ROOT / "docs" / "install.md").read_text()


def test_exec_start_parses_with_our_cli() -> None:
    from vgpu.daemon.serve import build_parser

    argv = shlex.split(dict(_settings("vgpu-manager.service"))["ExecStart"])
    assert argv[:2] == ["/usr/local/bin/vgpu", "serve"]
    ns = build_parser("vgpu serve").parse_args(argv[2:])
    assert ns.config == Path("/etc/vgpu/vgpu.toml")


def test_profiler_exec_start_names_the_daemons_socket_and_token() -> None:
    from vgpu import auth, config
    from vgpu.profiler.main import build_parser

    argv = shlex.split(dict(_settings("vgpu-profiler.service"))["ExecStart"])
    assert argv[:2] == ["/usr/local/bin/vgpu", "profiler"]
    ns = build_parser("vgpu profiler").parse_args(argv[2:])
    assert ns.manager == config.DEFAULT_SOCKET == "unix://" + config.Config().server.socket
    assert ns.token_file == auth.role_token_file("profiler", config.Config().server.state_dir)
    assert not ns.no_token


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    return subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(tmp_path / "v.sock"), "--state-dir",
         str(tmp_path / "state"), "--metrics-port", "0", *args],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120, check=False,
    )


def test_a_configuration_error_is_not_restarted_but_a_start_failure_is(tmp_path: Path) -> None:
    """`Restart=on-failure` alone starts a daemon with a typo in vgpu.toml again every RestartSec,
    for ever (each start takes longer than the start limit's pace): the exit status `vgpu serve` gives
    a configuration error must be one the unit does not restart on, and the status of a failure that a
    later start may get past (no NVML yet at boot) must not be."""
    s = _settings("vgpu-manager.service")
    assert dict(s)["Restart"] == "on-failure"
    prevent = {int(v) for k, line in s if k == "RestartPreventExitStatus" for v in line.split()}
    typo = tmp_path / "vgpu.toml"
    typo.write_text('[server]\nsocket_grup = "vgpu"\n')
    bad_config = _serve(tmp_path, "--config", str(typo), "--backend", "sim:h100-80gb")
    assert "unknown key server.socket_grup" in bad_config.stderr
    assert bad_config.returncode in prevent, (bad_config.returncode, prevent)
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("an NVIDIA driver is loaded here: `vgpu serve --backend nvml` would start")
    started = time.monotonic()
    no_nvml = _serve(tmp_path, "--backend", "nvml")
    failed_start_s = time.monotonic() - started
    assert "NVML" in no_nvml.stderr and no_nvml.returncode not in (0, *prevent), no_nvml.stderr
    # such a start, failing for ever, is retried only up to the start limit
    _assert_a_restart_loop_reaches_the_start_limit(failed_start_s)


def _assert_a_restart_loop_reaches_the_start_limit(failed_start_s: float) -> None:
    unit, service = _section("vgpu-manager.service", "Unit"), _section("vgpu-manager.service", "Service")
    interval_s, burst = float(unit["StartLimitIntervalSec"]), int(unit["StartLimitBurst"])
    loop_s = burst * (float(service["RestartSec"]) + failed_start_s)
    assert loop_s < interval_s, (loop_s, interval_s)
    assert loop_s >= 20, loop_s  # a driver still loading at boot gets more than a few seconds


def test_a_start_that_keeps_failing_ends_in_the_failed_state() -> None:
    """A failed start took about 1.6 s and RestartSec=2 waited 2 s more: one start every 3.6 s, which
    never reached systemd's default start limit (5 in 10 s), so a daemon that could not start was
    started again for ever. The unit's own limit, in [Unit] where systemd reads it, is reached by
    such a loop (with a failed start taking up to 2 s here; the test above measures one)."""
    _assert_a_restart_loop_reaches_the_start_limit(2.0)


def test_the_documentation_the_units_name_is_installed_by_install_md() -> None:
    """`systemctl help vgpu-manager` opens the units' Documentation=; a file: path there that no step of
    docs/install.md puts in place is a dead link on every server."""
    steps = (ROOT / "docs" / "install.md").read_text()
    for unit in UNITS:
        for key, value in _settings(unit):
            if key == "Documentation":
                for uri in value.split():
                    if uri.startswith("file:"):
                        assert uri[len("file:"):] in steps, (unit, uri)


def test_the_daemons_paths_lie_where_the_unit_lets_it_write_and_the_config_says_so() -> None:
    """Under ProtectSystem=strict the manager writes only in its RuntimeDirectory, StateDirectory and
    ReadWritePaths: every default path of the configuration lies there, and the shipped vgpu.toml
    tells an operator who moves one what else to change (a drop-in's ReadWritePaths=, the profiler
    unit's --manager and --token-file), since the daemon would otherwise fail to start on a
    read-only file system."""
    from vgpu import config

    s = _settings("vgpu-manager.service")
    assert dict(s)["ProtectSystem"] == "strict"
    writable = [Path("/run") / v for k, v in s if k == "RuntimeDirectory"]
    writable += [Path("/var/lib") / v for k, v in s if k == "StateDirectory"]
    writable += [Path(p) for k, v in s if k == "ReadWritePaths" for p in v.split()]
    server = config.Config().server
    for path in (Path(server.socket).parent, Path(server.state_dir), Path(server.inapp_dir)):
        assert any(path == w or w in path.parents for w in writable), (path, writable)
    shipped = (ROOT / "systemd" / "vgpu.toml").read_text()
    server_comments = shipped[shipped.index("[server]"):shipped.index('socket = "')]
    for needed in ("ProtectSystem=strict", "ReadWritePaths=", "--manager", "--token-file"):
        assert needed in server_comments, needed
