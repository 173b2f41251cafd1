"""Token files: the one reader and the one writer of the files that hold secrets and vgpu tokens
(the daemon's, under `<state-dir>/tokens/`, vgpu/auth.py; the client stub's cache, vgpu/client.py),
and the shape of a token. The writer (`write_atomically`) serves the client's in-app counter files too.

Standard library only, so that the client stub uses it without the daemon's dependencies.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from vgpu.capped import read_capped

# A token's shape (vgpu/auth.py `TokenAuthority.token_for`): `vgpu1.<base64url scope>.<hex HMAC>`.
# Checked where a token is read, so a wrong file is named at once rather than sent (gRPC refuses
# most bytes in metadata with a bare "Invalid metadata").
TOKEN_RE = re.compile(r"vgpu1\.[A-Za-z0-9_=-]{1,2048}\.[0-9a-fA-F]{1,128}")
# The most a token file is read of (vgpu/capped.py): a token is at most about 2.2 KB, so a larger file
# holds none, and is refused without being read whole.
MAX_TOKEN_FILE_BYTES = 4096


class TokenFileError(ValueError):
    """A token file that cannot be read or does not hold a token; the message names the file (an
    unreadable one: the OSError is its `__cause__`)."""


def check_token(text: str, source: str) -> str:
    """`text` stripped, if it looks like a token; TokenFileError naming `source` otherwise."""
    token = text.strip()
    if not token:
        raise TokenFileError(f"{source} is empty; it should hold one vgpu token (vgpu1.<scope>.<mac>)")
    if not TOKEN_RE.fullmatch(token):
        raise TokenFileError(
            f"{source} does not hold a vgpu token (vgpu1.<scope>.<mac>, one line of letters, digits and dots); "
            "replace it with the token file the daemon wrote, or delete it"
        )
    return token


def read_token(path: str | Path) -> str | None:
    """The token in `path`; None when there is no such file; TokenFileError naming the file when it
    cannot be read or holds something else."""
    path = Path(path)
    try:
        data = read_capped(path, MAX_TOKEN_FILE_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TokenFileError(f"cannot read the token file {path}: {exc.strerror or exc}") from exc
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise TokenFileError(f"the token file {path} is not text; it should hold one vgpu token") from None
    return check_token(text, f"the token file {path}")


def write_atomically(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = False) -> None:
    """Write `data` to `path` atomically, with `mode` from the start (a private file is never
    briefly readable by others): a new file beside it (mkstemp: mode 0600, a name no other writer
    uses), renamed over it; nothing is left behind when that fails. `durable`: fsync before the
    rename (for a secret that cannot be derived again; a token file the daemon rewrites at each
    start needs none, and an fsync can stall for seconds on a busy disk). The client stub's in-app
    counter files are written with it too."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        try:
            os.fchmod(fd, mode)
            os.write(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def save_token(path: str | Path, token: str) -> Path:
    """Write `token` to `path` (mode 0600, directory 0700), atomically."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomically(path, (token.strip() + "\n").encode("ascii"))
    return path
