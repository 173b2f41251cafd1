"""Start failures that every later start would meet too exit 2, as a configuration error does, so that
the unit (`RestartPreventExitStatus=2`) stays failed with the message instead of starting the daemon
every few seconds for ever; `--check-config` finds the configured files among them without starting
anything. Each case runs `vgpu serve` as the unit does, a subprocess, with the mistake an operator
makes: before, each exited 1 and `--check-config` passed the configured files."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_fixtures import ROOT, SKU, Env

from vgpu.allocator.store import SCHEMA_VERSION, Store
from vgpu.manager.modelpath import FALLBACK_DEFAULT


def serve(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(env.sock), "--state-dir", str(env.state),
         "--backend", f"sim:{SKU}", "--metrics-port", "0", *args],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=120, check=False,
    )


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    """The one line for the operator (the JSON log records beside it are for the journal)."""
    lines = [line for line in r.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def _missing_model(env: Env) -> list[str]:
    return ["--model", str(env.tmp / "nonexist.pt")]


def _truncated_model(env: Env) -> list[str]:
    bad = env.tmp / "bad.pt"
    bad.write_bytes(FALLBACK_DEFAULT.read_bytes()[:1000])  # a copy cut short
    return ["--model", str(bad)]


def _model_is_a_directory(env: Env) -> list[str]:
    (env.tmp / "models").mkdir()
    return ["--model", str(env.tmp / "models")]


def _missing_tls_key(env: Env) -> list[str]:
    cert = env.tmp / "server.crt"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    return ["--tcp", "127.0.0.1:auto", "--tls-cert", str(cert), "--tls-key", str(env.tmp / "no.key")]


# (mistake, the flags that make it, what the one line says, whether --check-config finds it)
FILE_CASES: list[tuple[str, Callable[[Env], list[str]], str, bool]] = [
    ("missing-model", _missing_model, "manager.model: cannot read {tmp}/nonexist.pt (No such file or directory)", True),
    ("model-is-a-directory", _model_is_a_directory, "manager.model: {tmp}/models is not a file", True),
    ("truncated-model", _truncated_model, "manager.model {tmp}/bad.pt: ", False),
    ("missing-tls-key", _missing_tls_key, "tls.key: cannot read {tmp}/no.key (No such file or directory)", True),
]


@pytest.mark.parametrize(("mistake", "flags", "said", "checked"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_a_configured_file_that_cannot_be_used_exits_2(env: Env, mistake: str, flags: Callable[[Env], list[str]],
                                                      said: str, checked: bool) -> None:
    args = flags(env)
    expected = said.format(tmp=env.tmp)
    check = serve(env, *args, "--check-config")
    if checked:
        assert check.returncode == 2 and expected in one_line(check), check.stderr
        assert not env.state.exists() and not env.sock.parent.exists()  # nothing was started
    else:  # whether a model loads only the start tells (it imports torch)
        assert check.returncode == 0, check.stderr
    started = serve(env, *args)
    assert started.returncode == 2 and expected in one_line(started), started.stderr
    assert "Traceback" not in started.stderr


def _newer_schema(state: Path) -> None:
    with sqlite3.connect(state / "vgpu.sqlite3") as db:
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))


def _damaged(state: Path) -> None:
    """1000 bytes of 0xff written into the middle of the file, as a failing disk leaves it."""
    path = state / "vgpu.sqlite3"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 1000] = b"\xff" * 1000
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "said"), [
    (_newer_schema, f"has schema {SCHEMA_VERSION + 1}; this vgpu reads schemas 1 to {SCHEMA_VERSION}"),
    (_damaged, "--reset-state"),
], ids=["newer-schema", "damaged"])
def test_a_state_database_no_start_can_use_exits_2(env: Env, damage: Callable[[Path], None], said: str) -> None:
    Store(env.state).close()  # a state database as a stopped daemon leaves it
    damage(env.state)
    failed = serve(env)
    assert failed.returncode == 2, failed.stderr
    line = one_line(failed)
    assert str(env.state / "vgpu.sqlite3") in line and said in line, line
