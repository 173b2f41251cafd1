"""vgpu/config.py: layering (defaults < file < environment < flags) and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu import config
from vgpu.config import Config, ConfigError

SHIPPED = Path(__file__).resolve().parent.parent / "systemd" / "vgpu.toml"


def test_shipped_file_documents_exactly_the_defaults() -> None:
    assert config.load(SHIPPED, env={}) == Config()
    # Every key of every section appears in the shipped file, with a comment above it.
    text = SHIPPED.read_text()
    for line in config.to_toml(Config()).splitlines():
        if "=" in line:
            key = line.split("=")[0].strip()
            assert f"\n{key} = " in text, key


def test_layers_in_order(tmp_path: Path) -> None:
    f = tmp_path / "vgpu.toml"
    f.write_text('[server]\nsocket = "/file.sock"\nstate_dir = "/file/state"\n[metrics]\nport = 9000\n')
    cfg = config.load(
        f,
        env={"VGPU_SERVER_STATE_DIR": "/env/state", "VGPU_METRICS_PORT": "9100", "VGPU_SHARED": "not ours"},
        overrides={"metrics.port": 9200, "server.backend": None},
    )
    assert cfg.server.socket == "/file.sock"
    assert cfg.server.state_dir == "/env/state"
    assert cfg.metrics.port == 9200
    assert cfg.server.backend == "nvml"


@pytest.mark.parametrize(("toml", "env", "flag"), [
    ('[metrics]\nport = "auto"\n', {}, None),
    ("", {"VGPU_METRICS_PORT": " Auto "}, None),
    ("[metrics]\nport = 9000\n", {}, "auto"),
])
def test_any_free_port_is_spelled_auto_in_every_layer(tmp_path: Path, toml: str, env: dict[str, str],
                                                      flag: str | None) -> None:
    """"auto" from the file, the environment or a flag; it binds port 0 (the kernel picks) and shows
    as itself in the printed configuration, which loads back to the same."""
    f = tmp_path / "vgpu.toml"
    f.write_text(toml)
    cfg = config.load(f, env=env, overrides={"metrics.port": flag})
    assert cfg.metrics.port == "auto" and config.bind_port(cfg.metrics.port) == 0
    assert 'port = "auto"' in config.to_toml(cfg)
    f.write_text(config.to_toml(cfg))
    assert config.load(f, env={}) == cfg
    # a number stays a number, 0 (off) included: "auto" is not 0
    assert config.load(None, env={"VGPU_METRICS_PORT": "0"}).metrics.port == 0
    assert config.bind_port(9464) == 9464


def test_env_booleans_and_numbers() -> None:
    cfg = config.load(None, env={"VGPU_SERVER_DRY_RUN": "yes", "VGPU_SERVER_GRACE_S": "1.5"})
    assert cfg.server.dry_run is True and cfg.server.grace_s == 1.5
    assert config.load(None, env={"VGPU_MANAGER_MODEL_CHECK_INTERVAL_S": "0.25"}).manager.model_check_interval_s == 0.25


@pytest.mark.parametrize(
    ("toml", "env", "match"),
    [
        ('[server]\nsockett = "/x"\n', {}, r"unknown key server.sockett .*known in \[server\]: socket"),
        ('[serverr]\nsocket = "/x"\n', {}, r"unknown section \[serverr\]"),
        ("socket = 1\n", {}, "must be a \\[section\\]"),
        ('[metrics]\nport = "9464"\n', {}, r'metrics.port .*expected a port number \(0: off\) or "auto" .*got str'),
        ('[metrics]\nport = "any"\n', {}, r'metrics.port .*expected a port number \(0: off\) or "auto" .*got str'),
        ("[metrics]\nport = true\n", {}, r"metrics.port .*expected a port number .*got bool"),
        ("[metrics]\nport = 9464.0\n", {}, r"metrics.port .*expected a port number .*got float"),
        ("[metrics]\nport = 70000\n", {}, r'metrics.port: expected 0..65535 \(0: off\) or "auto"'),
        ("", {"VGPU_METRICS_PORT": "-1"}, r"metrics.port: expected 0..65535 .*got -1"),
        ("", {"VGPU_METRICS_PORT": "auto:9464"}, r"metrics.port \(environment VGPU_METRICS_PORT\): expected a port"),
        ("", {"VGPU_METRICS_MAX_APPS": "-1"}, r"metrics.max_apps: must be >= 0"),
        ("[metrics]\nmax_connections_per_address = 0\n", {}, r"metrics.max_connections_per_address: expected 1..64"),
        ("", {"VGPU_METRICS_MAX_CONNECTIONS_PER_ADDRESS": "65"},
         r"metrics.max_connections_per_address: expected 1..64 .*got 65"),
        ('[metrics]\nmax_connections_per_address = "8"\n', {},
         r"metrics.max_connections_per_address .*expected int, got str"),
        ("[server]\ndry_run = 1\n", {}, r"server.dry_run .*expected bool"),
        ("[server]\nreclaim_margin_frac = -0.1\n", {}, r"server.reclaim_margin_frac: expected 0..10"),
        ("", {"VGPU_SERVER_RECLAIM_MARGIN_FRAC": "nan"}, r"server.reclaim_margin_frac: expected 0..10 .*got nan"),
        ("", {"VGPU_SERVER_RECLAIM_MIN_MIB": "inf"}, r"server.reclaim_min_mib: expected 0..1048576"),
        ("[server]\nexit_release_s = -1.0\n", {}, r"server.exit_release_s: expected 0..3600 seconds .*got -1.0"),
        ("", {"VGPU_SERVER_EXIT_RELEASE_S": "nan"}, r"server.exit_release_s: expected 0..3600 .*got nan"),
        ("", {"VGPU_SERVER_EXIT_RELEASE_S": "inf"}, r"server.exit_release_s: expected 0..3600 .*got inf"),
        ("[server]\nstream_end_grace_s = 0.0\n", {}, r"server.stream_end_grace_s: expected more than 0 .*got 0.0"),
        ("", {"VGPU_SERVER_STREAM_END_GRACE_S": "nan"}, r"server.stream_end_grace_s: expected more than 0 .*got nan"),
        ('[server]\nreclaim = "no"\n', {}, r"server.reclaim .*expected bool"),
        ('[server]\nsocket_mode = "0666"\n', {}, "lets every local user connect"),
        ('[server]\nsocket_mode = "rw"\n', {}, "expected octal"),
        ('[server]\nbackend = "cuda"\n', {}, "expected 'nvml' or 'sim:<sku>'"),
        ("", {"VGPU_SERVER_HARD_MEMORY_LIMITS": "never"}, "server.hard_memory_limits: expected 'contended' or 'always'"),
        ('[log]\nformat = "xml"\n', {}, "log.format"),
        ('[tls]\ncert = "/c.pem"\n', {}, "set both or neither"),
        ("[server\n", {}, "not valid TOML"),
        ("", {"VGPU_SERVER_BOGUS": "1"}, r"unknown key server.bogus \(environment VGPU_SERVER_BOGUS\)"),
        ("", {"VGPU_METRICS_PORT": "lots"}, r"metrics.port \(environment VGPU_METRICS_PORT\): expected a port number"),
        ("", {"VGPU_SERVER_DRY_RUN": "maybe"}, "expected true/false"),
        ("[manager]\nmodel_check_interval_s = 0\n", {}, r"manager.model_check_interval_s: must be > 0"),
        ("", {"VGPU_MANAGER_MODEL_CHECK_INTERVAL_S": "-1"}, r"manager.model_check_interval_s: must be > 0"),
        ("[manager]\nbatch_window_ms = -1.0\n", {}, r"manager.batch_window_ms: expected 0..1000 ms"),
        ("", {"VGPU_MANAGER_BATCH_WINDOW_MS": "5000"}, r"manager.batch_window_ms: expected 0..1000 ms"),
        ('[manager]\nbatch_window_ms = "1"\n', {}, r"manager.batch_window_ms .*expected float, got str"),
        ("[manager]\nforecast_duty_max = 0\n", {}, r"manager.forecast_duty_max: expected a share in \(0, 1\]"),
        ("", {"VGPU_MANAGER_FORECAST_DUTY_MAX": "1.5"}, r"manager.forecast_duty_max: expected a share in \(0, 1\]"),
        ("[server]\nmax_streams_per_connection = 3\n", {}, r"server.max_streams_per_connection: expected 4..1024 .*got 3"),
        ("", {"VGPU_SERVER_MAX_STREAMS_PER_CONNECTION": "1025"}, r"server.max_streams_per_connection: expected 4..1024"),
        ("[server]\nmax_request_bytes = 262143\n", {},
         r"server.max_request_bytes: expected 262144..67108864 \(twice a profiler's largest batch, 131072"),
        ("", {"VGPU_SERVER_MAX_REQUEST_BYTES": "67108865"}, r"server.max_request_bytes: expected 262144..67108864"),
        ("", {"VGPU_SERVER_MAX_REQUEST_BYTES": "4MiB"}, r"server.max_request_bytes .*expected int"),
    ],
)
def test_bad_configuration_is_a_clear_error(tmp_path: Path, toml: str, env: dict[str, str], match: str) -> None:
    f = tmp_path / "vgpu.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=match):
        config.load(f, env=env)


def test_missing_explicit_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml", env={})


@pytest.mark.parametrize("tcp", ["0.0.0.0:50051", "[::]:50051"])
def test_plaintext_tcp_is_refused(tcp: str) -> None:
    with pytest.raises(ConfigError, match="plaintext TCP is refused"):
        config.load(None, env={}, overrides={"server.tcp": tcp})
    cfg = config.load(None, env={}, overrides={"server.tcp": tcp, "tls.cert": "/c", "tls.key": "/k"})
    assert config.parse_host_port(cfg.server.tcp)[1] == 50051


@pytest.mark.parametrize(("tcp", "match"), [
    ("50051", "expected HOST:PORT or HOST:auto"), ("host:", "port must be a number or 'auto'"),
    ("host:port", "port must be a number or 'auto'"), ("host:0", r"port 0 is outside 1..65535 \(HOST:auto: any free port\)"),
])
def test_bad_tcp_address(tcp: str, match: str) -> None:
    with pytest.raises(ConfigError, match="server.tcp: " + match):
        config.load(None, env={}, overrides={"server.tcp": tcp, "tls.cert": "/c", "tls.key": "/k"})


@pytest.mark.parametrize(("tcp", "bind", "shown"), [
    ("127.0.0.1:auto", "127.0.0.1:0", "127.0.0.1:40123"), ("[::]:AUTO", "[::]:0", "[::]:40123"),
    ("0.0.0.0:7443", "0.0.0.0:7443", "0.0.0.0:40123"),
])
def test_a_tcp_address_may_take_any_free_port(tcp: str, bind: str, shown: str) -> None:
    cfg = config.load(None, env={}, overrides={"server.tcp": tcp, "tls.cert": "/c", "tls.key": "/k"})
    assert config.parse_host_port(cfg.server.tcp)[1] == (0 if bind.endswith(":0") else 7443)
    assert config.bind_address(cfg.server.tcp) == bind
    host = config.parse_host_port(cfg.server.tcp)[0]
    assert config.address_text(host, 40123) == shown


def test_replace_validates() -> None:
    cfg = config.replace(Config(), server={"dry_run": True})
    assert cfg.server.dry_run
    with pytest.raises(ConfigError):
        config.replace(Config(), metrics={"port": -1})


def test_one_default_socket_everywhere() -> None:
    """The daemon listens where the client stub, the profiler and the CLI connect by default."""
    from vgpu import client
    from vgpu.profiler.main import build_parser as profiler_parser

    path = Config().server.socket
    assert path == config.DEFAULT_SOCKET_PATH
    assert client.DEFAULT_SOCKET == "unix://" + path
    assert client.grpc_target(client.DEFAULT_SOCKET) == f"unix://{path}"
    assert profiler_parser("p").parse_args(["--no-token"]).manager is None  # found at start, as the stub finds it
    assert client.default_socket({}, Path("/nonexistent/vgpu.toml")) == client.DEFAULT_SOCKET
    assert config.load(SHIPPED, env={}).server.socket == path


async def test_the_daemon_hands_the_manager_knobs_to_the_manager(tmp_path: Path) -> None:
    from daemon_fixtures import sim_daemon

    d = sim_daemon(tmp_path, **{"manager.batch_window_ms": 7.5, "manager.forecast_duty_max": 0.5})  # type: ignore[arg-type]
    await d.start()
    try:
        assert d.manager.batch_window_s == pytest.approx(0.0075)
        assert d.manager.forecast_duty_max == 0.5
    finally:
        await d.stop("test")
    env = {"VGPU_MANAGER_BATCH_WINDOW_MS": "0", "VGPU_MANAGER_FORECAST_DUTY_MAX": "1"}
    cfg = config.load(None, env=env)
    assert (cfg.manager.batch_window_ms, cfg.manager.forecast_duty_max) == (0.0, 1.0)
