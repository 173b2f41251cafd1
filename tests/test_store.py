"""allocator/store.py: the SQLite state survives a crash and refuses what it cannot read."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from allocator.store import DeviceOriginal, MigSlot, Store, StoreError

RECORDS = {
    "version": 1,
    "devices": [{"device_id": "GPU-0", "mem_total_mib": 81559.0, "sm_total_pct": 100.0, "name": "H100"}],
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
        from allocator.store import Store
        s = Store(Path({str(tmp_path)!r}))
        s.save_ledger({RECORDS!r})
        s.claim_app("a")
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, check=False)
    assert proc.returncode == -signal.SIGKILL
    with Store(tmp_path) as store:
        assert store.load_ledger() == RECORDS
        assert store.app_claimed("a")


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
