"""allocator/store.py: the SQLite state survives a crash and refuses what it cannot read."""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vgpu.allocator.store import SCHEMA_VERSION, CgroupOriginal, DeviceOriginal, MigSlot, Store, StoreError

# Devices are not stored (the backend says what there is at each start).
RECORDS = {
    "version": 1,
    "devices": [],
    "grants": [{"grant_id": "g1", "app_id": "a", "device_id": "GPU-0", "memory_mib": 1024.0}],
    "limits": [],
}


def test_wal_mode_and_private_file(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.save_ledger(RECORDS)
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert (tmp_path / "vgpu.sqlite3").stat().st_mode & 0o077 == 0


def test_ledger_round_trip_and_generations(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        assert store.load_ledger() is None
        assert store.save_ledger(RECORDS) == 1
        changed = {**RECORDS, "grants": []}
        assert store.save_ledger(changed) == 2
    with Store(tmp_path) as store:
        assert store.load_ledger() == changed


def test_nan_is_refused_and_the_old_snapshot_kept(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.save_ledger(RECORDS)
        with pytest.raises(ValueError):
            store.save_ledger({**RECORDS, "grants": [{"memory_mib": float("nan")}]})
        assert store.load_ledger() == RECORDS


def test_first_original_wins_until_forgotten(tmp_path: Path) -> None:
    orig = DeviceOriginal("GPU-0", 700_000, True, (MigSlot(9, 0, "3g.40gb"), MigSlot(19, 6, "1g.10gb")), 1.0)
    with Store(tmp_path) as store:
        assert store.save_original(orig)
        # After a crash the device shows our limit; it must not replace the original.
        assert not store.save_original(DeviceOriginal("GPU-0", 400_000, True, (), 2.0))
    with Store(tmp_path) as store:
        assert store.originals() == {"GPU-0": orig}
        store.forget_original("GPU-0")
        assert store.original("GPU-0") is None
        assert store.save_original(DeviceOriginal("GPU-0", 400_000, None, (), 3.0))


def test_apps_are_claimed_once(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        assert store.claim_app("a")
        assert not store.claim_app("a")
        assert store.app_claimed("a") and not store.app_claimed("b")
        assert store.claimed_apps() == ["a"]


def test_commit_survives_kill_9(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from vgpu.allocator.store import CgroupOriginal, Store
        s = Store(Path({str(tmp_path)!r}))
        s.save_ledger({RECORDS!r})
        s.claim_app("a")
        s.save_cgroup_original(CgroupOriginal("GPU-0", "/jobs/a", 20000.0, float("inf"), 1.0))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, check=False)
    assert proc.returncode == -signal.SIGKILL
    with Store(tmp_path) as store:
        assert store.load_ledger() == RECORDS
        assert store.app_claimed("a")
        assert store.cgroup_originals() == [CgroupOriginal("GPU-0", "/jobs/a", 20000.0, math.inf, 1.0)]


def test_garbage_database_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "vgpu.sqlite3").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="cannot open state database"):
        Store(tmp_path)


def test_other_schema_is_refused(tmp_path: Path) -> None:
    Store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="schema 99"):
        Store(tmp_path)


def test_unwritable_state_dir(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("x")
        with pytest.raises(StoreError, match="cannot create state directory"):
            Store(blocker / "sub")
    else:
        tmp_path.chmod(0o500)
        with pytest.raises(StoreError):
            Store(tmp_path / "sub")


def test_first_cgroup_original_wins_until_forgotten(tmp_path: Path) -> None:
    none = CgroupOriginal("GPU-0", "/jobs/a", math.inf, math.inf, 1.0)  # no limit: stored as NULL
    operator = CgroupOriginal("GPU-0", "/jobs/b", 20_000.0, 30_000.0, 1.5)
    with Store(tmp_path) as store:
        assert store.save_cgroup_original(none) and store.save_cgroup_original(operator)
        # After a crash the cgroup shows our limit; it must not replace the original.
        assert not store.save_cgroup_original(CgroupOriginal("GPU-0", "/jobs/a", 8_000.0, 8_000.0, 2.0))
        assert store.save_cgroup_original(CgroupOriginal("GPU-1", "/jobs/a", 8_000.0, 8_000.0, 2.0))  # per device
    with Store(tmp_path) as store:
        assert store.cgroup_original("GPU-0", "/jobs/a") == none
        assert [(o.device_id, o.cgroup) for o in store.cgroup_originals()] == [
            ("GPU-0", "/jobs/a"), ("GPU-0", "/jobs/b"), ("GPU-1", "/jobs/a")]
        store.forget_cgroup_original("GPU-0", "/jobs/a")
        assert store.cgroup_original("GPU-0", "/jobs/a") is None and store.cgroup_original("GPU-0", "/jobs/b") == operator
        assert store.save_cgroup_original(CgroupOriginal("GPU-0", "/jobs/a", 8_000.0, 8_000.0, 3.0))
        for bad in (0.0, -1.0, math.nan):
            with pytest.raises(ValueError, match="original"):
                store.save_cgroup_original(CgroupOriginal("GPU-0", "/jobs/c", bad, 1.0, 3.0))


def _as_version_1(path: Path, records: dict | None = None) -> None:  # type: ignore[type-arg]
    """What a vgpu of schema 1 left: its tables and data (the ledger as one JSON row), no
    cgroup_originals and no rows per grant."""
    db = sqlite3.connect(path / "vgpu.sqlite3")
    db.executescript(
        "DROP TABLE cgroup_originals; DROP TABLE grants; DROP TABLE app_limits; ALTER TABLE apps DROP COLUMN uid; "
        "DELETE FROM meta WHERE key IN ('grant_rows', 'ledger_generation'); "
        "UPDATE meta SET value='1' WHERE key='schema_version';"
    )
    if records is not None:
        db.execute("INSERT INTO ledger(id, records_json, saved_at_s, generation) VALUES (1, ?, 1.0, 4)",
                   (json.dumps(records),))
        db.commit()
    db.close()


def test_a_version_1_database_is_upgraded_in_place(tmp_path: Path) -> None:
    orig = DeviceOriginal("GPU-0", 700_000, False, (), 1.0)
    with Store(tmp_path) as store:
        store.save_ledger(RECORDS)
        store.save_original(orig)
        store.claim_app("a")
    _as_version_1(tmp_path, RECORDS)
    with Store(tmp_path) as store:
        assert store.load_ledger() == RECORDS and store.originals() == {"GPU-0": orig} and store.app_claimed("a")
        assert store.cgroup_originals() == []
        assert store.save_cgroup_original(CgroupOriginal("GPU-0", "/jobs/a", math.inf, math.inf, 2.0))
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION) == "6"


def test_a_failed_upgrade_changes_nothing(tmp_path: Path) -> None:
    Store(tmp_path).close()
    _as_version_1(tmp_path)
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    db.execute("CREATE VIEW cgroup_originals AS SELECT 1 AS x")  # in the way of the new table
    db.commit()
    with pytest.raises(StoreError, match="cannot upgrade the schema to version 2"):
        Store(tmp_path)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "1"
    db.close()


# What a vgpu of schema 3 wrote (its tables as created by its migrations; rows per grant): frozen
# here, not derived from the code under test.
_SCHEMA_3 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE ledger (id INTEGER PRIMARY KEY CHECK (id = 1), records_json TEXT NOT NULL, saved_at_s REAL NOT NULL,
                     generation INTEGER NOT NULL);
CREATE TABLE device_originals (device_id TEXT PRIMARY KEY, power_limit_mw INTEGER, mig_enabled INTEGER,
                               mig_layout_json TEXT NOT NULL, saved_at_s REAL NOT NULL);
CREATE TABLE apps (app_id TEXT PRIMARY KEY, claimed_at_s REAL NOT NULL);
CREATE TABLE cgroup_originals (device_id TEXT NOT NULL, cgroup TEXT NOT NULL, soft_mib REAL, hard_mib REAL,
                               saved_at_s REAL NOT NULL, PRIMARY KEY (device_id, cgroup));
CREATE TABLE grants (grant_id TEXT PRIMARY KEY, record_json TEXT NOT NULL);
CREATE TABLE app_limits (app_id TEXT PRIMARY KEY, record_json TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '3'), ('ledger_generation', '7'), ('grant_rows', '4');
INSERT INTO apps VALUES ('loading', 1.0);
INSERT INTO app_limits VALUES ('loading', '{"app_id": "loading", "max_memory_mib": 20000.0, "max_sm_pct": null, "priority": null}');
"""


def _grant_v3(grant_id: str, source: str, memory_mib: float, mem_updated_at_s: float | None) -> str:
    return json.dumps({"grant_id": grant_id, "app_id": grant_id.split("-")[0], "device_id": "GPU-0",
                       "memory_mib": memory_mib, "sm_pct": 10.0, "priority": 0, "created_at_s": 1.0,
                       "updated_at_s": 2.0, "source": source, "pid": 0, "mem_updated_at_s": mem_updated_at_s},
                      sort_keys=True)


def test_a_version_3_database_gets_the_cold_start_size_of_grants_not_resized_and_keeps_every_row(
        tmp_path: Path) -> None:
    """Schema 4 keeps the sizer's size with the grant. A cold-start grant whose memory never changed
    still is that size; one resized since gets none (the size is not known any more); every row
    of every table stays, an unreadable one included (it is reported at load, as before)."""
    from vgpu.allocator.ledger import Ledger

    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    db.executescript(_SCHEMA_3)
    rows = [("loading-1", _grant_v3("loading-1", "cold_start", 9188.0, None)),
            ("resized-1", _grant_v3("resized-1", "cold_start", 6000.0, 5.0)),
            ("asked-1", _grant_v3("asked-1", "request", 2048.0, None)),
            ("broken-1", "{not json")]
    db.executemany("INSERT INTO grants VALUES (?, ?)", rows)
    db.commit()
    db.close()
    with Store(tmp_path) as store:
        records = store.load_ledger()
        assert records is not None and [r[:20] for r in store.bad_rows] == ["grants row 'broken-1"]
    ledger = Ledger.from_records(records, devices=[], skip_bad=True)
    assert ledger.dropped_on_restore  # no device given: every grant listed as dropped, with its fields read
    got = {g.grant_id: g.cold_start_mib for g in ledger.dropped_on_restore}
    assert got == {"loading-1": 9188.0, "resized-1": None, "asked-1": None}
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert db.execute("SELECT count(*) FROM grants").fetchone()[0] == 4
    assert db.execute("SELECT record_json FROM grants WHERE grant_id='broken-1'").fetchone()[0] == "{not json"
    for grant_id, body in rows[1:3]:  # untouched, byte for byte
        assert db.execute("SELECT record_json FROM grants WHERE grant_id=?", (grant_id,)).fetchone()[0] == body
    assert db.execute("SELECT value FROM meta WHERE key='ledger_generation'").fetchone()[0] == "7"
    assert db.execute("SELECT count(*) FROM app_limits").fetchone()[0] == 1
    assert db.execute("SELECT count(*) FROM apps").fetchone()[0] == 1
    db.close()


def _v3_database(path: Path) -> list[tuple[str, str]]:
    """A schema-3 database in `path` with the four grants its meta counts; its grant rows."""
    db = sqlite3.connect(path / "vgpu.sqlite3")
    db.execute("PRAGMA journal_mode=WAL")  # as every vgpu wrote it
    db.executescript(_SCHEMA_3)
    rows = [(f"loading-{i}", _grant_v3(f"loading-{i}", "cold_start", 9188.0, None)) for i in range(4)]
    db.executemany("INSERT INTO grants VALUES (?, ?)", rows)
    db.commit()
    db.close()
    return rows


def test_an_upgrade_first_writes_a_complete_copy_that_still_says_its_old_schema(tmp_path: Path) -> None:
    """The copy a downgrade needs: every row as the older vgpu left it, its schema number, a private
    one-file database (no WAL beside it), in place of an older copy of the same name."""
    rows = _v3_database(tmp_path)
    copy = tmp_path / "vgpu.sqlite3.pre-schema-3"
    copy.write_bytes(b"a copy from an earlier upgrade")
    (tmp_path / ".vgpu.sqlite3.pre-schema-3.k2j4x").write_bytes(b"a copy cut short by a crash")
    with Store(tmp_path) as store:
        assert store.upgraded_copy == copy and store.schema_found == 3
        assert len(store.load_ledger()["grants"]) == 4  # type: ignore[index]
    db = sqlite3.connect(copy)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "3"
    assert db.execute("SELECT grant_id, record_json FROM grants ORDER BY grant_id").fetchall() == rows
    assert db.execute("SELECT count(*) FROM app_limits").fetchone()[0] == 1
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    assert copy.stat().st_mode & 0o077 == 0
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    db.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vgpu.sqlite3", "vgpu.sqlite3.pre-schema-3"]


def test_a_version_1_upgrade_keeps_the_ledger_row_in_its_copy(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        store.save_ledger(RECORDS)
    _as_version_1(tmp_path, RECORDS)
    with Store(tmp_path) as store:
        assert store.upgraded_copy == tmp_path / "vgpu.sqlite3.pre-schema-1"
        assert store.load_ledger() == RECORDS
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3.pre-schema-1")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "1"
    assert json.loads(db.execute("SELECT records_json FROM ledger").fetchone()[0]) == RECORDS
    db.close()


def test_nothing_to_upgrade_writes_no_copy(tmp_path: Path) -> None:
    for _ in range(2):  # a new database, then one of this schema
        with Store(tmp_path) as store:
            assert store.upgraded_copy is None
            store.save_ledger(RECORDS)
    assert [p.name for p in tmp_path.iterdir()] == ["vgpu.sqlite3"]


def test_a_copy_that_cannot_be_written_refuses_the_upgrade_and_changes_nothing(tmp_path: Path) -> None:
    _v3_database(tmp_path)
    before = (tmp_path / "vgpu.sqlite3").read_bytes()
    in_the_way = tmp_path / "vgpu.sqlite3.pre-schema-3"
    in_the_way.mkdir()  # the rename over it fails, as a full disk or a read-only directory would fail the copy
    (in_the_way / "x").write_text("x")
    with pytest.raises(StoreError, match=rf"cannot write .*pre-schema-3.* from schema 3 to {SCHEMA_VERSION}: .*nothing was changed"):
        Store(tmp_path)
    assert (tmp_path / "vgpu.sqlite3").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vgpu.sqlite3", "vgpu.sqlite3.pre-schema-3"]
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "3"
    db.close()
    in_the_way.joinpath("x").unlink()
    in_the_way.rmdir()
    with Store(tmp_path) as store:  # once the copy can be written, the upgrade goes ahead
        assert store.upgraded_copy == in_the_way and in_the_way.is_file()


def test_a_newer_schema_says_how_to_go_back(tmp_path: Path) -> None:
    """A downgrade: the newer vgpu's copy of this vgpu's schema is named when it is there, and
    --reset-state either way."""
    Store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    db.execute(f"UPDATE meta SET value='{SCHEMA_VERSION + 1}' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="--reset-state") as got:
        Store(tmp_path)
    assert "there is none" in str(got.value)
    for n in (2, SCHEMA_VERSION, SCHEMA_VERSION + 1):  # the newest this vgpu reads is the one to put back
        (tmp_path / f"vgpu.sqlite3.pre-schema-{n}").write_bytes(b"")
    with pytest.raises(StoreError, match="--reset-state") as got:
        Store(tmp_path)
    assert f"put back {tmp_path / f'vgpu.sqlite3.pre-schema-{SCHEMA_VERSION}'}," in str(got.value)


# (field, a bad stored value, what the grant reads as then, the note's ending)
_BAD_OPTIONAL = [("cold_start_mib", bad, None, "kept without it") for bad in ["lots", -1.0, 0.0, 1e400, True, [9188]]] + [
    ("sm_estimated", bad, False, "kept as not estimated") for bad in ["yes", 1, None, [True]]] + [
    ("job_digest", bad, None, "kept without it") for bad in ["abc", "A" * 64, "g" * 64, 7, ["0" * 64]]]


@pytest.mark.parametrize(("field", "bad", "read_as", "note"), _BAD_OPTIONAL)
def test_a_bad_stored_optional_field_is_dropped_and_counted_and_its_grant_kept(
        tmp_path: Path, field: str, bad: object, read_as: object, note: str) -> None:
    """A bad cold-start size or job digest is forgotten; a bad `sm_estimated` reads as false (the
    share a commitment); either way the grant itself stands, and the operator is told."""
    from vgpu.allocator.ledger import DeviceCapacity, Ledger

    grant = json.loads(_grant_v3("loading-1", "cold_start", 9188.0, None))
    grant[field] = bad
    records = {"version": 1, "devices": [], "grants": [grant], "limits": []}
    ledger = Ledger.from_records(records, devices=[DeviceCapacity("GPU-0", 81_559.0)], skip_bad=True)
    (kept,) = ledger.grants()
    assert kept.grant_id == "loading-1" and (kept.memory_mib, kept.sm_pct) == (9188.0, 10.0)
    assert getattr(kept, field) is read_as
    (why,) = ledger.bad_on_restore
    assert why.startswith(f"grant 'loading-1': {field}") and why.endswith(note)
    with pytest.raises(ValueError, match=field):
        Ledger.from_records(records, devices=[DeviceCapacity("GPU-0", 81_559.0)])


def test_a_version_4_database_is_read_with_every_sm_share_a_commitment_and_no_row_changed(tmp_path: Path) -> None:
    """Schema 5 lets a grant say its SM share is the sizer's estimate. Which shares of an older
    database were is not known: the upgrade changes no row and each grant reads as a commitment;
    a grant written since keeps its flag across a restart."""
    from vgpu.allocator.ledger import DeviceCapacity, Ledger

    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    db.executescript(_SCHEMA_3.replace("('schema_version', '3')", "('schema_version', '4')"))
    body = _grant_v3("loading-1", "cold_start", 9188.0, None)
    db.executemany("INSERT INTO grants VALUES (?, ?)", [("loading-1", body)] + [
        (f"x-{i}", _grant_v3(f"x-{i}", "request", 100.0, None)) for i in range(3)])
    db.commit()
    db.close()
    devices = [DeviceCapacity("GPU-0", 81_559.0)]
    with Store(tmp_path) as store:
        records = store.load_ledger()
        assert records is not None
        ledger = Ledger.from_records(records, devices=devices)
        assert [g.sm_estimated for g in ledger.grants()] == [False] * 4 and ledger.bad_on_restore == ()
        ledger.grant("new", 1_000, 30, device_id="GPU-0", source="cold_start", cold_start_mib=1_000,
                     sm_estimated=True)
        store.apply_changes(ledger.changes())
    db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "6"
    assert db.execute("SELECT record_json FROM grants WHERE grant_id='loading-1'").fetchone()[0] == body
    db.close()
    with Store(tmp_path) as store:
        records = store.load_ledger()
        assert records is not None
        (new,) = Ledger.from_records(records, devices=devices).grants(app_id="new")
        assert new.sm_estimated is True


def test_the_counts_kept_beside_the_rows_follow_every_write(tmp_path: Path) -> None:
    """The grant rows and the claimed ids are counted from each write's own row changes, not by a
    count(*) per write: after grants made, resized (the same row again) and released, a snapshot
    with a repeated id, and claims made twice and undone, the counts are the tables' own, at once
    and at the next open (which checks the grant rows against the committed count)."""
    from vgpu.allocator.ledger import DeviceCapacity, Ledger

    def counted(store: Store) -> tuple[int, int]:
        db = sqlite3.connect(tmp_path / "vgpu.sqlite3")
        rows = int(db.execute("SELECT count(*) FROM grants").fetchone()[0])
        kept = int(db.execute("SELECT value FROM meta WHERE key='grant_rows'").fetchone()[0])
        claimed = int(db.execute("SELECT count(*) FROM apps").fetchone()[0])
        db.close()
        assert kept == rows and store.claimed_count() == claimed
        return rows, claimed

    ledger = Ledger([DeviceCapacity("GPU-0", 80_000.0)])
    with Store(tmp_path) as store:
        a = ledger.grant("a", 1000.0)
        b = ledger.grant("b", 2000.0)
        store.apply_changes(ledger.changes())
        ledger.commit_changes()
        assert counted(store) == (2, 0)
        ledger.resize(a.grant_id, 1500.0, 0.0)
        ledger.grant("c", 100.0)
        store.apply_changes(ledger.changes())
        ledger.commit_changes()
        assert counted(store) == (3, 0)
        ledger.release(b.grant_id)
        store.apply_changes(ledger.changes())
        ledger.commit_changes()
        assert counted(store) == (2, 0)
        assert store.claim_app("x") and not store.claim_app("x") and store.claim_app("y")
        store.unclaim_app("y")
        store.unclaim_app("never-claimed")
        assert counted(store) == (2, 1)
    with Store(tmp_path) as store:
        assert counted(store) == (2, 1)
        grant = {"grant_id": "g1", "app_id": "a", "device_id": "GPU-0", "memory_mib": 1024.0}
        store.save_ledger({**RECORDS, "grants": [grant, grant]})  # one id twice: one row
        assert counted(store) == (1, 1)
    with Store(tmp_path) as store:
        assert counted(store) == (1, 1)


def test_a_stored_change_is_the_grant_record_as_asdict_writes_it(tmp_path: Path) -> None:
    """`apply_changes` writes each changed grant as `asdict` would give it (every field, sorted
    keys), byte for byte, whichever fields are set."""
    from dataclasses import asdict

    from vgpu.allocator.ledger import DeviceCapacity, Ledger

    ticks = iter([100.0, 150.0, 200.5])
    led = Ledger([DeviceCapacity("GPU-0", 80_000.0)], clock=lambda: next(ticks))
    a = led.grant("app-a", 1_000.25, 12.5, device_id="GPU-0", priority=2, source="cold_start", pid=7,
                  cold_start_mib=3_000.0)
    b = led.resize(led.grant("app-b", 10.0, device_id="GPU-0").grant_id, 20.0, 1.0)
    with Store(tmp_path) as store:
        store.apply_changes(led.changes())
        rows = dict(store._db.execute("SELECT grant_id, record_json FROM grants").fetchall())
    assert rows == {g.grant_id: json.dumps(asdict(g), sort_keys=True, allow_nan=False) for g in (a, b)}


def test_claims_keep_the_uid_that_made_them_and_are_counted_per_uid(tmp_path: Path) -> None:
    with Store(tmp_path) as store:
        assert store.claim_app("a", 1000) and store.claim_app("b", 1000) and store.claim_app("op")
        assert not store.claim_app("a", 1001)  # claimed already: the claim stays its first uid's
        assert (store.claimed_count(), store.claimed_count(1000), store.claimed_count(1001)) == (3, 2, 0)
        assert store.claim_uid("a") == 1000 and store.claim_uid("op") is None and store.claim_uid("none") is None
        assert store.unclaim_app("a") and not store.unclaim_app("a")
        assert store.claimed_by(1000) == ["b"]
    with Store(tmp_path) as store:  # counted again at open
        assert (store.claimed_count(), store.claimed_count(1000)) == (2, 1)
