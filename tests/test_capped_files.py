"""Files the daemon and its tools read whole are read with a size cap (vgpu/capped.py): a huge or
damaged one gives a clear error, or is skipped with one log line, without being read into memory.
Each huge file here is sparse (no disk is used), and the memory Python allocated while it was refused
is measured (tracemalloc): reading it whole would allocate its size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_fixtures import ROOT, SKU, Env
from structlog.testing import capture_logs

from vgpu import capped
from vgpu.auth import SECRET_BYTES, AuthSetupError, TokenAuthority
from vgpu.capped import FileTooLarge, read_capped, read_tail
from vgpu.client import MAX_INAPP_FILE_BYTES, InAppFormatError, inapp_path, read_inapp
from vgpu.daemon.serve import MAX_TLS_FILE_BYTES, SIM_STATE_FILE, StartupError, _read
from vgpu.device.simstate import MAX_STATE_BYTES, SimStateError, read_state
from vgpu.manager import nodelearn
from vgpu.tokenfile import MAX_TOKEN_FILE_BYTES, TokenFileError, read_token

HUGE = 512 * 1024 * 1024  # sparse: reading it whole would allocate this much


def huge(path: Path, size: int = HUGE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


@pytest.fixture
def peak_mib() -> Iterator[Callable[[], float]]:
    tracemalloc.start()
    try:
        yield lambda: tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def refused(fn: Callable[[], Any], exc: type[BaseException], peak_mib: Callable[[], float]) -> str:
    """fn() raises `exc` having allocated under 32 MiB; its message."""
    with pytest.raises(exc) as err:
        fn()
    assert peak_mib() < 32, f"{peak_mib():.0f} MiB allocated to refuse a file"
    return str(err.value)


# --- the reader itself ---------------------------------------------------------------------------------
def test_read_capped_reads_up_to_the_cap_and_refuses_one_byte_more(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10)
    assert read_capped(p, 10) == b"x" * 10
    with pytest.raises(FileTooLarge) as err:
        read_capped(p, 9)
    assert isinstance(err.value, OSError) and "larger than 9 bytes" in str(err.value)
    with pytest.raises(FileNotFoundError):
        read_capped(tmp_path / "none", 10)


def test_read_tail_keeps_whole_lines_of_the_newest_bytes(tmp_path: Path) -> None:
    p = tmp_path / "log"
    p.write_bytes(b"aaa\nbbb\nccc\n")
    assert read_tail(p, 100) == (b"aaa\nbbb\nccc\n", 0)
    assert read_tail(p, 8) == (b"bbb\nccc\n", 4)  # the window starts on a line: kept whole
    assert read_tail(p, 6) == (b"ccc\n", 8)  # "b\n" is the end of a line cut short: left out
    assert read_tail(p, 3) == (b"", 12)  # no whole line in the window



def test_read_tail_of_a_log_that_grew_past_the_window_while_read_keeps_its_newest_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size is taken before the read; a writer appending in between (the learner adds a
    promotion while `vgpu model status` reads) makes the file longer than the window: its newest
    lines are what is read, not its oldest."""
    p = tmp_path / "log"
    p.write_bytes(b"aaa\nbbb\nccc\nddd\n")
    real_fstat = capped.os.fstat
    calls = []

    def fstat_before_the_append(fd: int) -> Any:
        st = real_fstat(fd)
        calls.append(st.st_size)
        if len(calls) == 1:  # the size as it was before another writer appended "ccc\nddd\n"
            return os.stat_result((*st[:6], 8, *st[7:]))
        return st

    monkeypatch.setattr(capped.os, "fstat", fstat_before_the_append)
    assert read_tail(p, 8) == (b"ccc\nddd\n", 8)


# --- each file -----------------------------------------------------------------------------------------
def test_a_huge_token_secret_is_refused_without_being_read(tmp_path: Path, peak_mib: Callable[[], float]) -> None:
    huge(tmp_path / "tokens" / "secret")
    why = refused(lambda: TokenAuthority(tmp_path / "tokens"), AuthSetupError, peak_mib)
    assert f"holds more than {SECRET_BYTES} bytes" in why and "delete it" in why


def test_a_huge_token_file_is_refused_without_being_read(tmp_path: Path, peak_mib: Callable[[], float]) -> None:
    path = huge(tmp_path / "op.token")
    why = refused(lambda: read_token(path), TokenFileError, peak_mib)
    assert str(path) in why and f"larger than {MAX_TOKEN_FILE_BYTES} bytes" in why
    (tmp_path / "ok.token").write_text("vgpu1." + "A" * 2048 + "." + "f" * 128 + "\n")  # the longest a token is
    assert read_token(tmp_path / "ok.token") is not None


def test_huge_simulated_gpu_settings_are_refused_without_being_read(tmp_path: Path,
                                                                     peak_mib: Callable[[], float]) -> None:
    path = huge(tmp_path / SIM_STATE_FILE)
    why = refused(lambda: read_state(path), SimStateError, peak_mib)
    assert f"larger than {MAX_STATE_BYTES} bytes" in why and "remove the file" in why


def test_a_huge_in_app_file_is_malformed_without_being_read(tmp_path: Path, peak_mib: Callable[[], float]) -> None:
    huge(inapp_path(tmp_path, 4242))
    why = refused(lambda: read_inapp(tmp_path, 4242, now_s=0.0), InAppFormatError, peak_mib)
    assert f"larger than {MAX_INAPP_FILE_BYTES} bytes" in why


def test_a_huge_tls_file_is_refused_without_being_read(tmp_path: Path, peak_mib: Callable[[], float]) -> None:
    path = huge(tmp_path / "ca.pem")
    why = refused(lambda: _read(str(path), "tls.ca"), StartupError, peak_mib)
    assert f"cannot read tls.ca {path}" in why and f"larger than {MAX_TLS_FILE_BYTES} bytes" in why


def test_the_promotion_log_is_read_from_its_newest_bytes_with_one_line_for_the_rest(
        tmp_path: Path, peak_mib: Callable[[], float]) -> None:
    models = nodelearn.models_dir(tmp_path)
    models.mkdir(parents=True)
    log = models / nodelearn.LOG
    entries = [{"at": float(i), "event": "rejected", "n": i} for i in range(100)]
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    line = len(json.dumps(entries[-1])) + 1
    with capture_logs() as logs:
        newest = nodelearn.read_log(tmp_path, max_bytes=10 * line)
    assert [e["n"] for e in newest][-5:] == [95, 96, 97, 98, 99] and 8 <= len(newest) <= 10
    said = [e for e in logs if e["event"] == "promotion_log_skipped"]
    assert len(said) == 1 and said[0]["skipped_bytes"] > 0
    with capture_logs() as logs:
        assert len(nodelearn.read_log(tmp_path)) == 100  # under the cap: all of it, nothing said
    assert not [e for e in logs if e["event"] == "promotion_log_skipped"]

    huge(log)  # damaged into half a gigabyte of zeros: the newest 8 MiB are read, no entry in them
    tracemalloc.reset_peak()
    with capture_logs() as logs:
        assert nodelearn.read_log(tmp_path) == []
    assert peak_mib() < 4 * nodelearn.MAX_LOG_BYTES / 2**20
    assert [e["event"] for e in logs] == ["promotion_log_skipped"]


def test_vgpu_serve_names_huge_simulated_gpu_settings_and_does_not_start(env: Env) -> None:
    """Through a real `vgpu serve`: the state directory's sim-devices.json damaged into half a
    gigabyte; the daemon exits at once naming the file and what to do, its memory untouched by it."""
    huge(env.state / SIM_STATE_FILE)
    r = subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "serve", "--socket", str(env.sock), "--state-dir", str(env.state),
         "--backend", f"sim:{SKU}", "--metrics-port", "0"],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert str(env.state / SIM_STATE_FILE) in r.stderr and f"larger than {MAX_STATE_BYTES} bytes" in r.stderr, r.stderr
    assert not env.sock.exists()
