"""Configuration mistakes an operator makes, run as `vgpu serve` runs them (a subprocess): each is one
line naming the setting or path and what to do, and the daemon does not start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from daemon_fixtures import ROOT, SKU, Env, Serve


def serve(env: Env, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", "serve", "--backend", f"sim:{SKU}",
                           "--metrics-port", "0", *args],
                          cwd=cwd, env=env.env, capture_output=True, text=True, timeout=120)


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    """The one line for the operator (the JSON log records beside it are for the journal)."""
    lines = [line for line in r.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_a_relative_path_in_the_config_file_names_the_key_and_an_absolute_form(env: Env) -> None:
    f = env.tmp / "vgpu.toml"
    f.write_text('[server]\nstate_dir = "rel/state"\n')
    r = serve(env, "--config", str(f), "--socket", str(env.sock), "--check-config", cwd=env.tmp)
    assert r.returncode == 2
    line = one_line(r)
    assert "server.state_dir" in line and "relative" in line and str(env.tmp / "rel" / "state") in line, line
    assert not (env.tmp / "rel").exists()  # nothing was created relative to the working directory


def test_a_relative_path_flag_is_taken_from_the_shells_directory(env: Env) -> None:
    r = serve(env, "--socket", "v.sock", "--state-dir", "st", "--inapp-dir", "inapp", "--check-config", cwd=env.tmp)
    assert r.returncode == 0, r.stderr
    assert f'socket = "{env.tmp / "v.sock"}"' in r.stdout
    assert f'state_dir = "{env.tmp / "st"}"' in r.stdout
    assert f'inapp_dir = "{env.tmp / "inapp"}"' in r.stdout


def test_a_socket_given_as_the_clients_give_it_is_that_path(env: Env) -> None:
    """`unix:///abs/path` (what the clients and `vgpu profiler --manager` take) names the path: before,
    `vgpu serve` listened on `<cwd>/unix:/abs/path` and `vgpu doctor` called it relative and checked
    the default socket instead."""
    for given in (f"unix://{env.sock}", f"unix:{env.sock}"):
        r = serve(env, "--socket", given, "--state-dir", str(env.state), "--check-config", cwd=env.tmp)
        assert r.returncode == 0, r.stderr
        assert f'socket = "{env.sock}"' in r.stdout, given
    assert not (env.tmp / "unix:").exists()
    doctor = subprocess.run([sys.executable, "-m", "vgpu.cli", "doctor", "--socket", f"unix://{env.sock}",
                             "--state-dir", str(env.state), "--json"],
                            cwd=env.tmp, env=env.env, capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["config"]["status"] == "OK", checks["config"]
    assert checks["socket"]["detail"].startswith(f"{env.sock} "), checks["socket"]  # the socket given, not the default
    env.env["VGPU_SERVER_SOCKET"] = f"unix://{env.sock}"  # the environment likewise
    r = serve(env, "--state-dir", str(env.state), "--check-config", cwd=env.tmp)
    assert r.returncode == 0 and f'socket = "{env.sock}"' in r.stdout, r.stderr


def test_a_socket_path_longer_than_sun_path_names_its_length_and_the_limit(env: Env) -> None:
    long_sock = env.tmp / ("s" * 120 + ".sock")
    r = serve(env, "--socket", str(long_sock), "--state-dir", str(env.state))
    assert r.returncode == 2
    line = one_line(r)
    assert "server.socket" in line and f"{len(str(long_sock).encode())} bytes" in line, line
    assert "at most 107" in line and "shorter path" in line, line
    assert not env.state.exists()  # refused before anything was created


def test_a_second_daemon_on_one_state_directory_names_the_holder_and_what_to_do(
        env: Env, serves: list[Serve]) -> None:
    first = Serve(env)
    serves.append(first)
    r = serve(env, "--socket", str(env.tmp / "second.sock"), "--state-dir", str(env.state))
    assert r.returncode == 1
    line = one_line(r)
    assert f"state directory {env.state} (pid {first.proc.pid})" in line, line
    assert "stop it first" in line and "--state-dir" in line, line


def test_a_state_directory_that_cannot_be_created_names_the_path_and_the_setting(env: Env) -> None:
    blocker = env.tmp / "not-a-dir"
    blocker.write_text("")
    r = serve(env, "--socket", str(env.sock), "--state-dir", str(blocker / "state"))
    assert r.returncode == 1
    line = one_line(r)
    assert f"state directory {blocker / 'state'} is not usable (Not a directory)" in line, line
    assert "--state-dir (server.state_dir)" in line, line


def test_a_user_or_group_the_host_lacks_is_named_with_its_key_before_anything_starts(env: Env) -> None:
    """A group from install.md's list that was not created, or a typo of one: `--check-config` and
    `vgpu serve` name the key and how to create it (exit 2, which the unit does not restart on), before
    the state directory or the socket is made; `vgpu doctor` fails its config line with the same words.
    Before, --check-config passed and the start failed only after setting up, with
    `socket owner/group "getgrnam(): name not found: 'vpgu'" does not exist`."""
    f = env.tmp / "vgpu.toml"
    f.write_text('[server]\nsocket_group = "vpgu-no-such"\n[auth]\noperator_group = "root"\n')
    r = serve(env, "--config", str(f), "--check-config")
    assert r.returncode == 2
    line = one_line(r)
    assert line == ("vgpu serve: configuration error: server.socket_group: there is no group 'vpgu-no-such' on "
                    "this host (create it: groupadd --system vpgu-no-such; or set another, or \"\" for none)"), line
    r = serve(env, "--socket", str(env.sock), "--state-dir", str(env.state), "--socket-group", "vpgu-no-such")
    assert r.returncode == 2 and "server.socket_group: there is no group 'vpgu-no-such'" in one_line(r)
    assert not env.state.exists() and not env.sock.parent.exists()  # refused before anything was created
    f.write_text('[server]\nsocket_owner = "nobody-no-such"\n[auth]\nprofiler_group = "vgpu-profiler-no-such"\n')
    r = serve(env, "--config", str(f), "--check-config")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert len(lines) == 2 and "server.socket_owner: there is no user 'nobody-no-such'" in lines[0], lines
    assert "useradd --system nobody-no-such" in lines[0] and "auth.profiler_group" in lines[1], lines
    doctor = subprocess.run([sys.executable, "-m", "vgpu.cli", "doctor", "--config", str(f), "--socket",
                             str(env.sock), "--state-dir", str(env.state), "--backend", f"sim:{SKU}",
                             "--model", str(env.tmp / "none.pt"), "--json"],
                            cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=120)
    config_check = json.loads(doctor.stdout)[0]
    assert doctor.returncode == 1 and config_check["status"] == "FAIL", doctor.stdout
    assert "auth.profiler_group: there is no group 'vgpu-profiler-no-such'" in config_check["detail"], config_check
    # groups that exist pass
    f.write_text('[server]\nsocket_group = "root"\n[auth]\noperator_group = "root"\nprofiler_group = "daemon"\n')
    assert serve(env, "--config", str(f), "--check-config").returncode == 0


def test_a_socket_name_gone_since_the_check_is_named_alone(tmp_path: Path) -> None:
    """A user or group removed between the start's check and the socket's chown: the error names the
    one that is missing, not both (an unset group read as `group ''`)."""
    import pytest

    from vgpu.daemon.serve import StartupError, secure_socket

    sock = tmp_path / "s"
    sock.touch()
    with pytest.raises(StartupError) as group_gone:
        secure_socket(sock, mode=0o660, owner="", group="vgpu-no-such-group")
    assert str(group_gone.value) == "socket group 'vgpu-no-such-group' does not exist"
    with pytest.raises(StartupError) as owner_gone:
        secure_socket(sock, mode=0o660, owner="vgpu-no-such-user", group="root")
    assert str(owner_gone.value) == "socket owner 'vgpu-no-such-user' does not exist"


def test_a_metrics_share_per_address_out_of_range_names_the_key_and_the_range(env: Env) -> None:
    """metrics.max_connections_per_address 0 would refuse every scrape, and above the endpoint's 64
    it bounds nothing: from the file or the environment, one line naming the key and its range
    (exit 2, which the unit does not restart on), before anything is created. A value in range is
    taken and shown by --check-config."""
    f = env.tmp / "vgpu.toml"
    f.write_text("[metrics]\nmax_connections_per_address = 0\n")
    r = serve(env, "--config", str(f), "--socket", str(env.sock), "--state-dir", str(env.state))
    assert r.returncode == 2
    assert one_line(r) == ("vgpu serve: configuration error: metrics.max_connections_per_address: expected 1..64 "
                           "(the endpoint serves 64 connections at once in all; 64: no bound per address), got 0")
    assert not env.state.exists() and not env.sock.parent.exists()  # refused before anything was created
    env.env["VGPU_METRICS_MAX_CONNECTIONS_PER_ADDRESS"] = "65"
    r = serve(env, "--check-config")
    del env.env["VGPU_METRICS_MAX_CONNECTIONS_PER_ADDRESS"]
    assert r.returncode == 2
    assert one_line(r).startswith("vgpu serve: configuration error: metrics.max_connections_per_address: "
                                  "expected 1..64 "), r.stderr
    assert one_line(r).endswith("got 65"), r.stderr
    f.write_text("[metrics]\nmax_connections_per_address = 64\n")
    r = serve(env, "--config", str(f), "--check-config")
    assert r.returncode == 0 and "max_connections_per_address = 64" in r.stdout, r.stderr


def test_a_port_that_is_neither_a_number_nor_auto_names_the_key_and_the_choices(env: Env) -> None:
    """metrics.port takes a number 0..65535 (0: off) or "auto" in any case (any free port, named in
    `serving`): anything else from a flag or the file is one line naming the key, where it came from
    and the choices (exit 2), before anything is created; in the file a quoted number is refused too.
    The TLS listener takes HOST:auto, and HOST:0 (which could read as off) names it."""
    choices = 'expected a port number (0: off) or "auto" (any free port, logged in `serving`)'
    r = serve(env, "--metrics-port", "any", "--socket", str(env.sock), "--state-dir", str(env.state))
    assert r.returncode == 2
    assert one_line(r) == (f"vgpu serve: configuration error: metrics.port (flag for metrics.port): {choices}, "
                           "got str 'any'")
    assert not env.state.exists() and not env.sock.parent.exists()
    r = serve(env, "--metrics-port", "65536", "--check-config")
    assert r.returncode == 2
    assert one_line(r) == ('vgpu serve: configuration error: metrics.port: expected 0..65535 (0: off) or "auto" '
                           "(any free port), got 65536")
    f = env.tmp / "vgpu.toml"
    f.write_text('[metrics]\nport = "9464"\n')
    r = serve(env, "--config", str(f), "--check-config")
    assert r.returncode == 2
    assert one_line(r) == f"vgpu serve: configuration error: metrics.port ({f}): {choices}, got str '9464'"
    r = serve(env, "--metrics-port", "AUTO", "--check-config")
    assert r.returncode == 0 and '\nport = "auto"\n' in r.stdout, r.stderr
    r = serve(env, "--tcp", "127.0.0.1:0", "--check-config")
    assert r.returncode == 2
    assert one_line(r) == ("vgpu serve: configuration error: server.tcp: port 0 is outside 1..65535 "
                           "(HOST:auto: any free port)")


def test_a_stop_grace_that_would_outlast_the_units_stop_timeout_is_refused(env: Env) -> None:
    """server.grace_s nan, inf or 1e9 passed: a stop waits that long for calls in flight before it
    restores the devices, and systemd kills the daemon TimeoutStopSec (60 s) after SIGTERM, restore
    or not. Each is now one line naming the key, its range and why (exit 2, --check-config says it);
    idle_release_s inf (which acted as 0, never) is refused too. Values in range still pass."""
    f = env.tmp / "vgpu.toml"
    for value in ("nan", "inf", "1e9", "30.5", "-1.0"):
        f.write_text(f"[server]\ngrace_s = {value}\n")
        r = serve(env, "--config", str(f), "--check-config")
        assert r.returncode == 2, (value, r.stdout)
        assert one_line(r).startswith("vgpu serve: configuration error: server.grace_s: expected 0..30 seconds "), r.stderr
        assert "TimeoutStopSec" in one_line(r) and one_line(r).endswith(f"got {float(value)}"), r.stderr
    env.env["VGPU_SERVER_IDLE_RELEASE_S"] = "inf"
    r = serve(env, "--check-config")
    assert r.returncode == 2
    assert one_line(r) == ("vgpu serve: configuration error: server.idle_release_s: expected 0..604800 seconds "
                           "(a week; 0: never), got inf")
    env.env["VGPU_SERVER_IDLE_RELEASE_S"] = "0"
    f.write_text("[server]\ngrace_s = 30\n")
    r = serve(env, "--config", str(f), "--check-config")
    assert r.returncode == 0 and "\ngrace_s = 30.0\n" in r.stdout and "\nidle_release_s = 0.0\n" in r.stdout, r.stderr


def test_a_config_file_nested_deeper_than_the_parser_goes_is_one_line(env: Env) -> None:
    """Arrays or inline tables nested thousands deep: before, a 1,000-frame RecursionError traceback."""
    for i, body in enumerate(("a = " + "[" * 100_000 + "]" * 100_000, "x = " + "{a = " * 2000 + "1" + "}" * 2000)):
        f = env.tmp / f"deep-{i}.toml"
        f.write_text(body + "\n")
        r = serve(env, "--config", str(f), "--check-config")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert one_line(r).endswith(f"config file {f}: not valid TOML: nested too deep")
