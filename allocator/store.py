"""Durable state of the daemon: the ledger, the devices' original settings and who owns which app.

One SQLite database, `<state_dir>/vgpu.sqlite3`, in WAL mode with `synchronous=FULL`: every method
that changes something commits before it returns, so a change the daemon acknowledged survives a
`kill -9` (and a power cut). The daemon calls `apply_changes()` after each change and before the RPC
that made it answers: one transaction that writes the rows of the grants and limits that changed
(O(1) rows per change, never the whole ledger), then checkpoints the WAL into the database file, so
the file alone always holds every committed change (a lost or damaged WAL loses nothing, and a copy
of the file is a complete backup).

Damage is refused, never papered over: opening runs `PRAGMA quick_check` and compares the number of
grant rows with the count kept beside them in the same transactions; either failing raises
`StoreDamaged`, which names the file and what to do (`vgpu serve --reset-state` moves the damaged
state aside and starts empty). A write that fails (a full disk, an I/O error) raises
`StoreWriteError` and commits nothing.

What is stored:
- `grants` and `app_limits`: one row per grant and per application's limits (the ledger's records,
  as JSON; a grant's record keeps its job's cold-start size, `cold_start_mib`, since schema 4, and
  whether its SM share is the sizer's estimate, `sm_estimated`, and the uid whose share it takes,
  `uid`, since schema 5, and the digest of the job a cold-start grant was sized for, `job_digest`,
  since schema 6), and
  `meta.grant_rows` / `meta.ledger_generation` kept with them;
- `device_originals`: each device's power limit and MIG layout as found *before* vgpu wrote to it,
  recorded once and kept across crashes until a graceful stop has restored them;
- `cgroup_originals`: the NVML memory limits of each (device, cgroup) as found before vgpu first
  capped that cgroup (allocator/mechanisms/limits.py), on the same terms: the first record wins, and it is
  forgotten once written back (at release, at stop, or by the start-up reconcile after a crash);
- `apps`: application ids that have been claimed (their token has been issued), each with the uid
  that self-registered it (since schema 5; NULL: the operator's, or older).

The schema is versioned (`meta.schema_version`). Opening a database of an older version first writes
a complete copy of it beside it, `vgpu.sqlite3.pre-schema-<old version>` (SQLite's online backup,
fsynced, renamed into place; `Store.upgraded_copy` names it), which the vgpu that wrote it can read
again after a downgrade; a copy that cannot be written refuses the upgrade and changes nothing. Then
it upgrades the database in place, one step per version, each step and its version bump in one
transaction (`_MIGRATIONS`). A database of a newer version, which this vgpu cannot read, is refused,
naming such a copy when there is one.

Not thread-safe: the daemon's asyncio loop owns it (sqlite3 objects stay on their thread).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from vgpu.allocator.ledger import Grant, LedgerChanges
from vgpu.ids import app_id_problem

SCHEMA_VERSION = 6
DB_NAME = "vgpu.sqlite3"
# The copy an upgrade writes first: `<DB_NAME>.pre-schema-<the version it upgrades from>`.
PRE_SCHEMA = DB_NAME + ".pre-schema-"

# Version 1, the tables every database starts from; `_MIGRATIONS` takes it to SCHEMA_VERSION.
_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    records_json TEXT NOT NULL,
    saved_at_s REAL NOT NULL,
    generation INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS device_originals (
    device_id TEXT PRIMARY KEY,
    power_limit_mw INTEGER,
    mig_enabled INTEGER,
    mig_layout_json TEXT NOT NULL,
    saved_at_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS apps (app_id TEXT PRIMARY KEY, claimed_at_s REAL NOT NULL);
"""

# version -> the statements that take a database from version - 1 to it.
_MIGRATIONS: dict[int, str] = {
    # NVML per-cgroup memory limits before vgpu first wrote them; NULL: no limit (NVML's maximum).
    2: """
CREATE TABLE cgroup_originals (
    device_id TEXT NOT NULL,
    cgroup TEXT NOT NULL,
    soft_mib REAL,
    hard_mib REAL,
    saved_at_s REAL NOT NULL,
    PRIMARY KEY (device_id, cgroup)
);
""",
    # One row per grant and per application's limits, moved out of the one-row JSON snapshot.
    3: """
CREATE TABLE grants (grant_id TEXT PRIMARY KEY, record_json TEXT NOT NULL);
CREATE TABLE app_limits (app_id TEXT PRIMARY KEY, record_json TEXT NOT NULL);
INSERT OR IGNORE INTO grants(grant_id, record_json)
    SELECT json_extract(g.value, '$.grant_id'), g.value FROM ledger, json_each(ledger.records_json, '$.grants') AS g
    WHERE json_valid(ledger.records_json);
INSERT OR IGNORE INTO app_limits(app_id, record_json)
    SELECT json_extract(l.value, '$.app_id'), l.value FROM ledger, json_each(ledger.records_json, '$.limits') AS l
    WHERE json_valid(ledger.records_json);
INSERT OR REPLACE INTO meta(key, value) SELECT 'ledger_generation', CAST(generation AS TEXT) FROM ledger;
INSERT OR REPLACE INTO meta(key, value) VALUES ('grant_rows', (SELECT CAST(count(*) AS TEXT) FROM grants));
DELETE FROM ledger;
""",
    # A grant's record may hold `cold_start_mib`, the sizer's size for its job (a vgpu before this
    # cannot read such a record: hence a version). A cold-start grant whose memory never changed
    # still has the size the sizer gave it, which becomes its `cold_start_mib`; one resized since
    # keeps none (its sized value is not known any more). Every row stays.
    4: """
UPDATE grants SET record_json = json_set(record_json, '$.cold_start_mib', json_extract(record_json, '$.memory_mib'))
    WHERE json_valid(record_json) AND json_type(record_json) = 'object'
    AND json_extract(record_json, '$.source') = 'cold_start'
    AND json_type(record_json, '$.mem_updated_at_s') IS 'null'
    AND json_type(record_json, '$.memory_mib') IN ('real', 'integer')
    AND json_extract(record_json, '$.memory_mib') > 0
    AND json_type(record_json, '$.cold_start_mib') IS NULL;
""",
    # A grant's record may hold `sm_estimated` (its SM share is the cold-start sizer's estimate, which
    # another request may take while the application's use is not known; a vgpu before this cannot
    # read such a record: hence a version). Which older grants' shares were estimates is not known,
    # so they stay as they were, every share a commitment: no row changes. A grant's record may also
    # hold `uid`, the uid whose share of the node's grants it takes (older ones: none). A claim keeps
    # the uid that self-registered it (`apps.uid`; NULL: the operator's, or claimed before this), for
    # the per-uid bound on claims.
    5: "ALTER TABLE apps ADD COLUMN uid INTEGER;",
    # A grant's record may hold `job_digest`, the digest of the job a cold-start grant was sized for
    # (a vgpu before this cannot read such a record: hence a version). Older grants' jobs are not
    # known: no row changes, and a declaration of one of their jobs gets a grant of its own.
    6: "SELECT 1;",
}


class StoreError(RuntimeError):
    """The state database cannot be opened, is from another schema, or is corrupt."""


class StoreDamaged(StoreError):
    """The state database fails its checks at open; the message names the file and what to do."""


class StoreWriteError(StoreError):
    """A change could not be committed (a full disk, an I/O error); nothing of it was stored."""


def reset_state(state_dir: Path, *, clock: Callable[[], float] = time.time) -> Path | None:
    """Move the database and its WAL and SHM files aside (`<name>.damaged-<unix time>`) so the
    next open starts empty; the moved files are kept for inspection. The path of the moved database,
    or None when there was none."""
    state_dir = Path(state_dir)
    stamp = int(clock())
    moved = None
    for suffix in ("", "-wal", "-shm"):
        src = state_dir / (DB_NAME + suffix)
        if src.exists():
            dst = state_dir / f"{DB_NAME}{suffix}.damaged-{stamp}"
            os.replace(src, dst)
            if suffix == "":
                moved = dst
    return moved


@dataclass(frozen=True)
class MigSlot:
    """One GPU instance of a saved MIG layout: which profile at which placement."""

    profile_id: int
    start: int
    profile_name: str = ""


@dataclass(frozen=True)
class DeviceOriginal:
    """A device's settings before vgpu first wrote to it. None: the device could not report it."""

    device_id: str
    power_limit_mw: int | None
    mig_enabled: bool | None
    mig_layout: tuple[MigSlot, ...]
    saved_at_s: float


@dataclass(frozen=True)
class CgroupOriginal:
    """A cgroup's NVML memory limits on a device before vgpu first capped it; `math.inf`: no limit."""

    device_id: str
    cgroup: str
    soft_mib: float
    hard_mib: float
    saved_at_s: float


class Store:
    """The daemon's SQLite state under `state_dir`."""

    def __init__(self, state_dir: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / DB_NAME
        self._clock = clock
        self.bad_rows: list[str] = []
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists()
            self._db = sqlite3.connect(self.path, isolation_level=None)  # explicit transactions
            if fresh:
                os.chmod(self.path, 0o600)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"{self.path}: SQLite refused WAL mode (got {mode!r}); is the state dir on NFS?")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA_V1)
            self._db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', '1')")
            version = int(self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
        except (sqlite3.DatabaseError, ValueError) as exc:  # ValueError: a schema_version that is no number
            raise StoreDamaged(
                f"cannot open state database {self.path}: {exc}; restore {self.state_dir} from a backup, or start "
                "with `vgpu serve --reset-state` to move it aside and begin empty (its grants are lost)"
            ) from exc
        except OSError as exc:
            raise StoreError(f"cannot create state directory {self.state_dir}: {exc}") from exc
        if not 1 <= version <= SCHEMA_VERSION:
            self._db.close()
            raise StoreError(self._newer(version))
        self._quick_check()  # before an upgrade writes to a damaged file
        # the copy that a downgrade back to the vgpu that wrote this database needs; None: no upgrade
        self.schema_found = version
        self.upgraded_copy = self._copy_before_upgrade(version) if version < SCHEMA_VERSION and not fresh else None
        for step in range(version + 1, SCHEMA_VERSION + 1):
            self._migrate(step)
        self.writes = 0
        self._check_grant_rows()
        # what open found damaged but could leave out; `load_ledger` reports it with its bad rows
        self._open_notes = self._check_meta() + self._check_claims() + self._check_originals()
        self._checkpoint()

    def _newer(self, version: int) -> str:
        """What to do about a database of a schema this vgpu does not read: a newer vgpu's, as a rule."""
        copies = sorted((int(m), p.name) for p in self.state_dir.glob(PRE_SCHEMA + "*")
                        if (m := p.name[len(PRE_SCHEMA):]).isdigit() and 1 <= int(m) <= SCHEMA_VERSION)
        back = (f"put back {self.state_dir / copies[-1][1]}, the copy the newer vgpu wrote before it upgraded (grants "
                f"made since are lost): stop vgpu, move {DB_NAME} and its -wal and -shm files aside, copy it to "
                f"{self.path}, start" if copies else
                f"restore {self.state_dir} from a backup made before the upgrade (a newer vgpu leaves one beside it "
                f"as {PRE_SCHEMA}<N>; there is none)")
        return (f"{self.path} has schema {version}; this vgpu reads schemas 1 to {SCHEMA_VERSION} (a newer vgpu wrote "
                f"it?): install that vgpu again, or, to run this one, {back}; or start with `vgpu serve --reset-state` "
                "to move it aside and begin empty (its grants are lost)")

    def _copy_before_upgrade(self, version: int) -> Path:
        """Write a complete copy of the database, still at schema `version`, to
        `<DB_NAME>.pre-schema-<version>` before an upgrade changes it: SQLite's online backup (a
        consistent copy, the WAL's committed pages included) into a new private file beside it, made a
        one-file database (journal_mode DELETE), fsynced, renamed over an older copy of that name and the
        directory fsynced (a new file that a crash cut short is removed first). StoreError, with nothing
        changed, when it cannot be written."""
        copy = self.state_dir / f"{PRE_SCHEMA}{version}"
        tmp: Path | None = None
        try:
            for stale in self.state_dir.glob(f".{copy.name}.*"):  # a copy cut short by a crash
                stale.unlink(missing_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=f".{copy.name}.", dir=self.state_dir)  # mode 0600
            tmp = Path(tmp_name)
            os.close(fd)
            dst = sqlite3.connect(tmp, isolation_level=None)
            try:
                self._db.backup(dst)
                dst.execute("PRAGMA journal_mode=DELETE")
            finally:
                dst.close()
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, copy)
            dir_fd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except (OSError, sqlite3.Error) as exc:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            self._db.close()
            raise StoreError(
                f"cannot write {copy}, the copy of {self.path} kept before upgrading it from schema {version} to "
                f"{SCHEMA_VERSION}: {exc}; nothing was changed: free space in (or make writable) {self.state_dir}, "
                "or start the vgpu that wrote it again") from exc
        return copy

    def _damaged(self, what: str) -> StoreDamaged:
        return StoreDamaged(
            f"the state database {self.path} is damaged ({what}); restore {self.state_dir} from a backup, "
            f"or start with `vgpu serve --reset-state` to move it aside and begin empty (its grants are lost)"
        )

    def _quick_check(self) -> None:
        try:
            rows = self._db.execute("PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._damaged(str(exc)) from exc
        if [r[0] for r in rows] != ["ok"]:
            raise self._damaged("; ".join(str(r[0]) for r in rows[:5]))

    def _check_grant_rows(self) -> None:
        """The grant rows against the count committed with them (a row deleted behind our back)."""
        try:
            n = self._db.execute("SELECT count(*) FROM grants").fetchone()[0]
            row = self._db.execute("SELECT value FROM meta WHERE key='grant_rows'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise self._damaged(str(exc)) from exc
        if row is not None and str(n) != row[0]:
            raise self._damaged(f"{n} grant rows where {row[0]} were committed")
        # From here on both counts are kept here, by each write's own row changes, instead of a
        # count(*) (a scan of the table) per write or per claim.
        self._grant_rows = int(n)
        self._claimed = int(self._db.execute("SELECT count(*) FROM apps").fetchone()[0])
        self._claimed_by_uid: dict[int, int] = {
            uid: int(n) for uid, n in self._db.execute("SELECT uid, count(*) FROM apps GROUP BY uid")
            if _claim_uid(uid) is not None}

    def _check_meta(self) -> list[str]:
        """The ledger generation is a counter each change bumps and nothing else reads: one that is
        not a number restarts from 0 (`_transaction`) instead of failing every change."""
        row = self._db.execute("SELECT value FROM meta WHERE key='ledger_generation'").fetchone()
        if row is None or _generation(row[0]) is not None:
            return []
        return [f"meta ledger_generation {str(row[0])[:80]!r}: not a number; counted afresh from 0"]

    def _check_claims(self) -> list[str]:
        """Claims whose id the app-id rule refuses (no call can name them, so leaving them out loses
        nothing) are left out of `claimed_apps` and `claims`; a claim whose time is not a number is
        kept, with no time. Each is described once, here."""
        notes = []
        for app_id, at_s, uid in self._db.execute("SELECT app_id, claimed_at_s, uid FROM apps ORDER BY rowid"):
            if not _claim_id_ok(app_id):
                why = app_id_problem(app_id) if isinstance(app_id, str) else f"a {type(app_id).__name__}, not text"
                notes.append(f"apps row {str(app_id)[:80]!r}: {why}; left out")
                continue
            if _claim_time(at_s) is None:
                notes.append(f"apps row {app_id!r}: claimed_at_s {str(at_s)[:80]!r} is not a time; the claim is kept")
            if uid is not None and _claim_uid(uid) is None:
                notes.append(f"apps row {app_id!r}: uid {str(uid)[:80]!r} is not a uid; the claim is kept, "
                             "counted against no uid")
        return notes

    def _check_originals(self) -> list[str]:
        """Device and cgroup originals with a damaged field, each described once (they are read
        with that field as unknown: `_original_from_row`, `_cgroup_original_from_row`)."""
        notes = []
        for row in self._db.execute("SELECT device_id, power_limit_mw, mig_enabled, mig_layout_json, saved_at_s "
                                    "FROM device_originals ORDER BY device_id"):
            notes += [f"device_originals row {str(row[0])[:80]!r}: {d}" for d in original_damage(row)]
        for row in self._db.execute("SELECT device_id, cgroup, soft_mib, hard_mib, saved_at_s FROM cgroup_originals "
                                    "ORDER BY device_id, cgroup"):
            notes += [f"cgroup_originals row {str(row[0])[:80]!r} {str(row[1])[:80]!r}: {d}"
                      for d in cgroup_original_damage(row)]
        return notes

    def _checkpoint(self) -> None:
        """Copy the WAL into the database file (then a lost WAL loses nothing)."""
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StoreWriteError(f"{self.path}: cannot checkpoint: {exc}") from exc

    def _migrate(self, version: int) -> None:
        """Take the database to `version`: the step's statements and the version bump commit together."""
        try:
            self._db.executescript(
                f"BEGIN IMMEDIATE;\n{_MIGRATIONS[version]}\n"
                f"UPDATE meta SET value='{version}' WHERE key='schema_version';\nCOMMIT;"
            )
        except sqlite3.DatabaseError as exc:
            if self._db.in_transaction:
                self._db.rollback()
            raise StoreError(f"{self.path}: cannot upgrade the schema to version {version}: {exc}") from exc

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, sql: str, params: tuple[Any, ...]) -> None:
        # autocommit mode: one statement is one committed transaction.
        self._db.execute(sql, params)
        self.writes += 1

    # --- ledger ----------------------------------------------------------------------------------
    def _transaction(self, write: Callable[[sqlite3.Connection], int]) -> int:
        """Run `write` (its statements; it returns the number of grant rows after them) and bump the
        ledger generation in one transaction, with the grant rows kept beside them, then checkpoint;
        the new generation. StoreWriteError (and nothing committed) when it fails."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                grant_rows = write(self._db)
                row = self._db.execute("SELECT value FROM meta WHERE key='ledger_generation'").fetchone()
                generation = ((_generation(row[0]) if row else 0) or 0) + 1
                self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('ledger_generation', ?)", (str(generation),))
                self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('grant_rows', ?)", (str(grant_rows),))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreWriteError(f"cannot write the state database {self.path}: {exc}") from exc
        self._grant_rows = grant_rows
        self.writes += 1
        try:
            self._checkpoint()
        except StoreWriteError:
            pass  # committed in the WAL all the same; the next checkpoint copies it
        return generation

    def apply_changes(self, changes: LedgerChanges) -> int:
        """Store what changed in the ledger (`Ledger.changes()`): its rows only, in one transaction
        (committed on return). The new generation; ValueError for a value JSON cannot hold (NaN)
        and StoreWriteError when the disk refuses, with nothing stored in either case."""
        grants = [(g.grant_id, _grant_json(g)) for g in changes.grants]  # ValueError before any write
        limits = [(lim.app_id, _json(asdict(lim))) for lim in changes.limits]

        def write(db: sqlite3.Connection) -> int:
            rows = self._grant_rows
            for grant_id, record in grants:
                # what INSERT OR REPLACE does (the row moves to the end of the rowid order), with the
                # row it replaced counted
                rows -= db.execute("DELETE FROM grants WHERE grant_id=?", (grant_id,)).rowcount
                db.execute("INSERT INTO grants(grant_id, record_json) VALUES (?, ?)", (grant_id, record))
                rows += 1
            for grant_id in changes.grants_removed:
                rows -= db.execute("DELETE FROM grants WHERE grant_id=?", (grant_id,)).rowcount
            db.executemany("INSERT OR REPLACE INTO app_limits(app_id, record_json) VALUES (?, ?)", limits)
            db.executemany("DELETE FROM app_limits WHERE app_id=?", [(a,) for a in changes.limits_removed])
            return rows

        return self._transaction(write)

    def save_ledger(self, records: Mapping[str, Any]) -> int:
        """Replace every stored grant and limit with `records` (`Ledger.to_records()`), committed
        on return: for the reconciled ledger at start. The new generation."""
        grants = [(str(g.get("grant_id", "")), _json(g)) for g in records.get("grants", [])]
        limits = [(str(lim.get("app_id", "")), _json(lim)) for lim in records.get("limits", [])]

        def write(db: sqlite3.Connection) -> int:
            db.execute("DELETE FROM grants")
            db.execute("DELETE FROM app_limits")
            db.executemany("INSERT OR REPLACE INTO grants(grant_id, record_json) VALUES (?, ?)", grants)
            db.executemany("INSERT OR REPLACE INTO app_limits(app_id, record_json) VALUES (?, ?)", limits)
            return len({grant_id for grant_id, _ in grants})  # a repeated id is one row

        return self._transaction(write)

    def load_ledger(self) -> dict[str, Any] | None:
        """The stored grants and limits as `Ledger.from_records()` reads them (devices come from the
        backend), or None when nothing was ever saved. A row that is not a JSON object is left out
        and described in `bad_rows`, with what open found damaged and left out (`_open_notes`)."""
        self.bad_rows = list(self._open_notes)
        if self._db.execute("SELECT value FROM meta WHERE key='ledger_generation'").fetchone() is None:
            return None
        out: dict[str, Any] = {"version": 1, "devices": [], "grants": [], "limits": []}
        for table, key, kind in (("grants", "grant_id", "grants"), ("app_limits", "app_id", "limits")):
            for rid, body in self._db.execute(f"SELECT {key}, record_json FROM {table} ORDER BY rowid"):  # noqa: S608
                try:
                    record = json.loads(body)
                    if not isinstance(record, dict):
                        raise ValueError(f"a {type(record).__name__}, not an object")
                except ValueError as exc:
                    self.bad_rows.append(f"{table} row {str(rid)[:80]!r}: {exc}")
                    continue
                out[kind].append(record)
        return out

    # --- device originals --------------------------------------------------------------------------
    def save_original(self, original: DeviceOriginal) -> bool:
        """Record a device's original settings unless some are already recorded (the first record
        wins: after a crash the device shows *our* settings, not the original). True if stored."""
        if self.original(original.device_id) is not None:
            return False
        layout = [{"profile_id": s.profile_id, "start": s.start, "profile_name": s.profile_name} for s in original.mig_layout]
        self._write(
            "INSERT INTO device_originals(device_id, power_limit_mw, mig_enabled, mig_layout_json, saved_at_s) "
            "VALUES (?, ?, ?, ?, ?)",
            (
                original.device_id,
                original.power_limit_mw,
                None if original.mig_enabled is None else int(original.mig_enabled),
                json.dumps(layout),
                original.saved_at_s,
            ),
        )
        return True

    def original(self, device_id: str) -> DeviceOriginal | None:
        row = self._db.execute(
            "SELECT device_id, power_limit_mw, mig_enabled, mig_layout_json, saved_at_s "
            "FROM device_originals WHERE device_id=?",
            (device_id,),
        ).fetchone()
        return None if row is None else _original_from_row(row)

    def originals(self) -> dict[str, DeviceOriginal]:
        rows = self._db.execute(
            "SELECT device_id, power_limit_mw, mig_enabled, mig_layout_json, saved_at_s FROM device_originals "
            "ORDER BY device_id"
        ).fetchall()
        return {r[0]: _original_from_row(r) for r in rows}

    def forget_original(self, device_id: str) -> None:
        """After the original has been written back: the next start records the device afresh."""
        self._write("DELETE FROM device_originals WHERE device_id=?", (device_id,))

    # --- cgroup memory-limit originals -------------------------------------------------------------
    def save_cgroup_original(self, original: CgroupOriginal) -> bool:
        """Record a cgroup's original limits unless some are already recorded for that (device,
        cgroup): the first record wins, as for devices. True if stored."""
        for what, mib in (("soft", original.soft_mib), ("hard", original.hard_mib)):
            if not mib > 0:  # NaN too
                raise ValueError(f"{original.cgroup}: an original {what} limit must be > 0 MiB (inf: none), not {mib}")
        cur = self._db.execute(
            "INSERT OR IGNORE INTO cgroup_originals(device_id, cgroup, soft_mib, hard_mib, saved_at_s) "
            "VALUES (?, ?, ?, ?, ?)",
            (original.device_id, original.cgroup, _mib_or_null(original.soft_mib), _mib_or_null(original.hard_mib),
             original.saved_at_s),
        )
        self.writes += 1
        return cur.rowcount == 1

    def cgroup_original(self, device_id: str, cgroup: str) -> CgroupOriginal | None:
        row = self._db.execute(
            "SELECT device_id, cgroup, soft_mib, hard_mib, saved_at_s FROM cgroup_originals "
            "WHERE device_id=? AND cgroup=?",
            (device_id, cgroup),
        ).fetchone()
        return None if row is None else _cgroup_original_from_row(row)

    def cgroup_originals(self) -> list[CgroupOriginal]:
        rows = self._db.execute(
            "SELECT device_id, cgroup, soft_mib, hard_mib, saved_at_s FROM cgroup_originals ORDER BY device_id, cgroup"
        ).fetchall()
        return [_cgroup_original_from_row(r) for r in rows]

    def forget_cgroup_original(self, device_id: str, cgroup: str) -> None:
        """After the original has been written back (or its cgroup is gone)."""
        self._write("DELETE FROM cgroup_originals WHERE device_id=? AND cgroup=?", (device_id, cgroup))

    # --- application ownership -----------------------------------------------------------------------
    def claim_app(self, app_id: str, uid: int | None = None) -> bool:
        """Mark `app_id` as owned (its token issued), self-registered by `uid` (None: by the
        operator, or the uid is unknown). True if this call claimed it, False if it was already
        claimed (the claim stays as it was)."""
        cur = self._db.execute(
            "INSERT OR IGNORE INTO apps(app_id, claimed_at_s, uid) VALUES (?, ?, ?)", (app_id, self._clock(), uid)
        )
        self.writes += 1
        self._claimed += cur.rowcount
        if cur.rowcount and uid is not None:
            self._claimed_by_uid[uid] = self._claimed_by_uid.get(uid, 0) + 1
        return cur.rowcount == 1

    def unclaim_app(self, app_id: str) -> bool:
        """Forget a claim (the call that made it failed, or the operator drops it): True if there
        was one. sqlite3.Error (nothing forgotten) when the disk refuses."""
        # a SELECT, then the DELETE: RETURNING needs SQLite 3.35, which some supported systems lack;
        # the connection is the loop's alone, so nothing comes between the two
        row = self._db.execute("SELECT uid FROM apps WHERE app_id=?", (app_id,)).fetchone()
        self.writes += 1
        if row is None:
            return False
        self._db.execute("DELETE FROM apps WHERE app_id=?", (app_id,))
        self._claimed -= 1
        uid = _claim_uid(row[0])
        if uid is not None:
            left = self._claimed_by_uid.get(uid, 0) - 1
            if left > 0:
                self._claimed_by_uid[uid] = left
            else:
                self._claimed_by_uid.pop(uid, None)
        return True

    def claimed_count(self, uid: int | None = None) -> int:
        """Claimed application ids, or those `uid` self-registered (counted at open and by each
        claim and unclaim since)."""
        return self._claimed if uid is None else self._claimed_by_uid.get(uid, 0)

    def app_claimed(self, app_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM apps WHERE app_id=?", (app_id,)).fetchone() is not None

    def claim_uid(self, app_id: str) -> int | None:
        """The uid that self-registered a claimed id; None when it is not claimed, or the operator
        claimed it, or the claim is older than the column."""
        row = self._db.execute("SELECT uid FROM apps WHERE app_id=?", (app_id,)).fetchone()
        return None if row is None else _claim_uid(row[0])

    def claim_uids(self) -> dict[str, int]:
        """The uid that self-registered each claim that has one, by id (`claim_uid` for all of them)."""
        rows = self._db.execute("SELECT app_id, uid FROM apps WHERE uid IS NOT NULL").fetchall()
        return {app_id: u for app_id, uid in rows if _claim_id_ok(app_id) and (u := _claim_uid(uid)) is not None}

    def claimed_by(self, uid: int) -> list[str]:
        """The ids `uid` self-registered, sorted (a stored one the app-id rule refuses is left out)."""
        rows = self._db.execute("SELECT app_id FROM apps WHERE uid=? ORDER BY app_id", (uid,)).fetchall()
        return [r[0] for r in rows if _claim_id_ok(r[0])]

    def claimed_apps(self) -> list[str]:
        """The claimed application ids (a stored one the app-id rule refuses is left out)."""
        return [r[0] for r in self._db.execute("SELECT app_id FROM apps ORDER BY app_id").fetchall() if _claim_id_ok(r[0])]

    def claims(self) -> dict[str, float | None]:
        """Every claimed application id and when it was claimed (Unix s; None: the stored time is
        damaged), by id. A stored id the app-id rule refuses is left out."""
        rows = self._db.execute("SELECT app_id, claimed_at_s FROM apps ORDER BY app_id").fetchall()
        return {app_id: _claim_time(at_s) for app_id, at_s in rows if _claim_id_ok(app_id)}


def _generation(value: object) -> int | None:
    """A stored ledger generation, or None when it is not an integer."""
    try:
        return int(str(value))
    except ValueError:
        return None


def _claim_id_ok(app_id: object) -> bool:
    return isinstance(app_id, str) and app_id_problem(app_id) is None


def _claim_uid(uid: object) -> int | None:
    """A stored claiming uid, or None when there is none or it is not a uid."""
    if isinstance(uid, int) and not isinstance(uid, bool) and 0 <= uid < 2**32:
        return uid
    return None


def _claim_time(at_s: object) -> float | None:
    """A stored claim time (Unix s), or None when it is not a finite number."""
    if isinstance(at_s, int | float) and not isinstance(at_s, bool) and math.isfinite(at_s):
        return float(at_s)
    return None


def _json(record: Mapping[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, allow_nan=False)


_GRANT_FIELDS = tuple(f.name for f in fields(Grant))


def _grant_json(grant: Grant) -> str:
    """`_json(asdict(grant))`, without `asdict`'s deep copy of each field: a grant's fields are
    immutable scalars, so the record is the same (an apply stores most of a device's grants)."""
    return _json({name: getattr(grant, name) for name in _GRANT_FIELDS})


def _original_from_row(row: tuple[Any, ...]) -> DeviceOriginal:
    """A stored device original, read field by field: a damaged field is read as "not reported"
    (None, or no layout), so the device is neither compared nor restored on it (`original_damage`
    says which, once, at open); the row stays, so no later start records vgpu's own settings over it."""
    device_id, power, mig, layout_json, saved = row
    layout = _layout(layout_json)
    mig_enabled = None if mig not in (0, 1) or (mig == 1 and layout is None) else bool(mig)
    return DeviceOriginal(
        device_id=str(device_id),
        power_limit_mw=_int_or_none(power),
        mig_enabled=mig_enabled,
        mig_layout=layout or (),
        saved_at_s=_claim_time(saved) or 0.0,
    )


def original_damage(row: tuple[Any, ...]) -> list[str]:
    """What of a stored device original is damaged (empty when nothing is)."""
    device_id, power, mig, layout_json, saved = row
    out = []
    if power is not None and _int_or_none(power) is None:
        out.append(f"power_limit_mw {str(power)[:80]!r}: not restored, set it by hand")
    if mig is not None and mig not in (0, 1):
        out.append(f"mig_enabled {str(mig)[:80]!r}: MIG not restored, set it by hand")
    elif mig == 1 and _layout(layout_json) is None:
        out.append("mig_layout_json is not a list of instances: MIG not restored, set it by hand")
    if _claim_time(saved) is None:
        out.append(f"saved_at_s {str(saved)[:80]!r} is not a time")
    return out


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _layout(layout_json: object) -> tuple[MigSlot, ...] | None:
    """A stored MIG layout, or None when it is not a JSON list of {profile_id, start[, profile_name]}."""
    try:
        raw = json.loads(layout_json) if isinstance(layout_json, str) else None
        if not isinstance(raw, list):
            return None
        return tuple(MigSlot(_int(s["profile_id"]), _int(s["start"]), str(s.get("profile_name", ""))[:64])
                     for s in raw)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise ValueError(f"{value!r} is not a small integer")
    return value


def _mib_or_null(mib: float) -> float | None:
    return None if math.isinf(mib) else mib


def _limit_mib(value: object) -> float | None:
    """A stored original cgroup limit (NULL: none, inf), or None when it is not a number > 0."""
    if value is None:
        return math.inf
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def _cgroup_original_from_row(row: tuple[Any, ...]) -> CgroupOriginal:
    """A stored cgroup original; a damaged limit is read as none (NVML's default, what a cgroup has
    before anything caps it), and said once at open (`cgroup_original_damage`)."""
    device_id, cgroup, soft, hard, saved = row
    return CgroupOriginal(
        device_id=str(device_id),
        cgroup=str(cgroup),
        soft_mib=_limit_mib(soft) or math.inf,
        hard_mib=_limit_mib(hard) or math.inf,
        saved_at_s=_claim_time(saved) or 0.0,
    )


def cgroup_original_damage(row: tuple[Any, ...]) -> list[str]:
    device_id, cgroup, soft, hard, saved = row
    out = [f"{what}_mib {str(v)[:80]!r}: written back as no limit" for what, v in (("soft", soft), ("hard", hard))
           if _limit_mib(v) is None]
    if _claim_time(saved) is None:
        out.append(f"saved_at_s {str(saved)[:80]!r} is not a time")
    return out
