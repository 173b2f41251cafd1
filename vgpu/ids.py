"""The one rule for application ids, checked where an id enters the daemon (an RPC, a signature).

An application id ends up in the ledger and its SQLite rows, log records, Prometheus labels, token
scopes and (hashed) token file names, and operators read it in `vgpu apps`. One conservative rule
fits every one of those uses, so nothing downstream has to re-check or escape it:

- 1 to `MAX_APP_ID_BYTES` bytes of UTF-8, which is also the limit in characters: only ASCII is
  allowed, so bytes and characters agree;
- ASCII letters, digits and `. _ - : @ # + = /`, starting with an ASCII letter or a digit (`é`
  and `ü` are letters, but not ASCII ones).

So ids that differ only by a trailing space, a zero-width character or a homoglyph cannot exist:
they are refused with a reason. Case is kept (`Trainer` and `trainer` are two applications, both
visible as such), as in file names and Kubernetes labels.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

MAX_APP_ID_BYTES = 256
# The largest pid: pid_t is a signed 32-bit integer (Linux's pid_max is far lower, at most 2**22).
MAX_PID = 2**31 - 1
APP_ID_CHARS = "ASCII letters (A-Z, a-z), digits and . _ - : @ # + = /"
_APP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-:@#+=/]*")
# Anything outside the rule, for `sanitize_app_id_part`.
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._\-:@#+=/]")


def app_id_problem(app_id: str, name: str = "app_id") -> str | None:
    """Why `app_id` is not a valid application id (a sentence a person can act on), or None."""
    if not app_id:
        return f"{name} is empty: give the application's identifier"
    n_bytes = len(app_id.encode("utf-8", "surrogatepass"))
    if n_bytes > MAX_APP_ID_BYTES or len(app_id) > MAX_APP_ID_BYTES:
        return f"{name} is {len(app_id)} characters ({n_bytes} bytes) long; at most {MAX_APP_ID_BYTES} bytes are allowed"
    if _APP_ID.fullmatch(app_id) is None:
        bad = next((c for c in app_id if _NOT_ALLOWED.match(c)), app_id[0])
        return (
            f"{name} {_shown(app_id)} has the character {bad!r} (U+{ord(bad):04X}) "
            f"where only {APP_ID_CHARS} are allowed, starting with an ASCII letter or a digit"
        )
    return None


# Many ids at once, each on its own line: the rule above, the length bound included (only ASCII
# matches, so characters and bytes agree).
_ONE_ID = rf"[A-Za-z0-9][A-Za-z0-9._\-:@#+=/]{{0,{MAX_APP_ID_BYTES - 1}}}"
_APP_ID_LINES = re.compile(rf"{_ONE_ID}(?:\n{_ONE_ID})*")


def all_app_ids_valid(app_ids: Sequence[str]) -> bool:
    """Whether `app_id_problem` finds nothing in every one of `app_ids`: one regular-expression pass
    over them all (a batch names hundreds), for the common case where they all are; False for an
    empty sequence."""
    if not app_ids:
        return False
    joined = "\n".join(app_ids)
    # an id holding a newline would split in two; none that keeps to the rule has one
    return joined.count("\n") == len(app_ids) - 1 and _APP_ID_LINES.fullmatch(joined) is not None


def sanitize_app_id_part(text: str) -> str:
    """`text` with every character the rule refuses replaced by '_' (for ids built from process
    names, which may hold spaces or anything else)."""
    return _NOT_ALLOWED.sub("_", text)


def app_id_digest(app_id: str) -> str:
    """A fixed-length, file-name-safe key for an application id (token files are named by it)."""
    return hashlib.sha256(app_id.encode("utf-8", "surrogatepass")).hexdigest()


def _shown(app_id: str) -> str:
    """The id quoted for a message, cut to a readable length."""
    return repr(app_id if len(app_id) <= 64 else app_id[:64] + "...")


__all__ = ["APP_ID_CHARS", "MAX_APP_ID_BYTES", "MAX_PID", "app_id_digest", "app_id_problem", "sanitize_app_id_part"]
