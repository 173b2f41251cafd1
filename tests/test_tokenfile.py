"""Token files have one reader and one writer (vgpu/tokenfile.py), used by the daemon (vgpu/auth.py)
and the client stub (vgpu/client.py) alike: what one writes the other reads, with the modes and
the errors each caller expects."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from vgpu import auth, client, tokenfile

TOKEN = "vgpu1.YXBwOmE.0123abcd"


def test_the_client_and_the_daemon_share_one_implementation() -> None:
    assert client.read_token is tokenfile.read_token and client.save_token is tokenfile.save_token
    assert client.check_token is tokenfile.check_token and client.TokenFileError is tokenfile.TokenFileError


def test_what_the_client_saves_the_daemons_reader_reads_and_back(tmp_path: Path) -> None:
    saved = client.save_token(tmp_path / "cache" / "a.token", f"  {TOKEN} ")
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600 and stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
    assert saved.read_text() == TOKEN + "\n"
    assert auth.read_token_file(saved) == TOKEN == client.read_token(saved)
    authority = auth.TokenAuthority(tmp_path / "tokens", secret=b"k" * auth.SECRET_BYTES)
    written = authority.write_app_token("a")
    assert client.read_token(written) == authority.token_for("app:a") == auth.read_token_file(written)
    assert sorted(p.name for p in written.parent.iterdir()) == [written.name]  # nothing left beside it


def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path: Path) -> None:
    path = client.save_token(tmp_path / "a.token", TOKEN)
    with pytest.raises(TypeError):
        tokenfile.write_atomically(path, "not bytes", 0o600)  # type: ignore[arg-type]
    assert path.read_text() == TOKEN + "\n" and os.listdir(tmp_path) == ["a.token"]


@pytest.mark.parametrize(("content", "client_says", "daemon_raises"), [
    (None, None, OSError),  # missing: the client has no token yet; the daemon's reader needs one
    (b"", "is empty", ValueError),
    (b" \n", "is empty", ValueError),
    (b"\xff\xfe", "is not text", ValueError),
    (b"hello", "does not hold a vgpu token", ValueError),
])
def test_each_reader_says_what_is_wrong_naming_the_file(tmp_path: Path, content: bytes | None,
                                                         client_says: str | None,
                                                         daemon_raises: type[Exception]) -> None:
    path = tmp_path / "t.token"
    if content is not None:
        path.write_bytes(content)
    if client_says is None:
        assert client.read_token(path) is None
    else:
        with pytest.raises(client.TokenFileError, match=client_says) as got:
            client.read_token(path)
        assert str(path) in str(got.value)
    with pytest.raises(daemon_raises) as raised:
        auth.read_token_file(path)
    assert str(path) in str(raised.value) and ("cannot read" in str(raised.value) or content is not None)


def test_an_unreadable_file_is_an_oserror_for_the_daemons_reader(tmp_path: Path) -> None:
    path = tmp_path / "t.token"
    path.mkdir()  # reading a directory fails with an OSError other than "not found"
    with pytest.raises(OSError, match="cannot read the token file"):
        auth.read_token_file(path)
    with pytest.raises(client.TokenFileError, match="cannot read the token file") as got:
        client.read_token(path)
    assert isinstance(got.value.__cause__, OSError)
