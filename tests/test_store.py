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
        "DROP TABLE cgroup_originals; DROP TABLE grants; DROP TABLE app_limits; "
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
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION) == "3"


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
