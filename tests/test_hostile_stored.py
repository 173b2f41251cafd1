"""Damaged rows in the daemon's state database against a real `vgpu serve`: each is left out (or,
where leaving it out would give something away, kept without its damaged part), counted and named in
the start's `reconciled` record, and every later call works: requests, releases, set-limit,
`vgpu apps`, `vgpu available`, /metrics and `vgpu model status`. The same checks on the ledger's
records alone, for any JSON value in any field, are the hypothesis test at the end (in process).

A real start is the slow part (2-3 s each), so the undamaged state directory is made once by a real
daemon (`stored_state`) and copied by each test, and one start restores all the damaged rows of a
kind at once: each row's own reason is checked, by its id, so a row that is kept, or named for
another's damage, still fails the test."""

from __future__ import annotations

import json
import math
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_fixtures import Env, Serve, make_env, metric_samples
from hostile import Raw, operator_token
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgpu.allocator.errors import InsufficientResources
from vgpu.allocator.ledger import AppLimits, DeviceCapacity, Grant, Ledger
from vgpu.allocator.service import grant_to_pb, limits_to_pb


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


# The applications of the stored state, one grant (pid 0) each: a damaged grant is one of GRANT_APPS';
# LIMIT_APPS have limits too, and a damaged limits entry is one of theirs, next to their good grants.
GRANT_APPS = ("grant-0", "grant-1", "grant-2", "grant-3", "grant-4")
LIMIT_APPS = ("held", "held-2")


@pytest.fixture(scope="module")
def stored_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state directory a real daemon left by a clean stop: the grants of GRANT_APPS and LIMIT_APPS,
    the limits of LIMIT_APPS and their claims. Made once; each test copies it (`_stored`)."""
    env = make_env(tmp_path_factory.mktemp("stored"))
    serve = Serve(env)
    client = Raw(env.sock)
    try:
        for app in GRANT_APPS + LIMIT_APPS:
            client.request(app, 1024)
        for app in LIMIT_APPS:
            env.vgpu("set-limit", "--socket", str(env.sock), "--state-dir", str(env.state), "--app", app,
                     "--max-memory-mib", "4096")
        assert serve.term() == 0
    finally:
        client.close()
        serve.stop_now()
    return env.state


def _stored(stored_state: Path, env: Env) -> None:
    """The stored state directory as `env`'s own (a socket is no file to copy: none is left after a
    clean stop, and any would be stale)."""
    def sockets(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if stat.S_ISSOCK(os.lstat(os.path.join(folder, n)).st_mode)]

    shutil.copytree(stored_state, env.state, ignore=sockets)


def _db(env: Env) -> sqlite3.Connection:
    return sqlite3.connect(env.state / "vgpu.sqlite3")


def _edit(env: Env, table: str, key: str, rid: str, damage: dict[str, object]) -> None:
    db = _db(env)
    (body,) = db.execute(f"SELECT record_json FROM {table} WHERE {key}=?", (rid,)).fetchone()  # noqa: S608
    cur = db.execute(f"UPDATE {table} SET record_json=? WHERE {key}=?", (json.dumps({**json.loads(body), **damage}), rid))  # noqa: S608
    assert cur.rowcount == 1, (table, rid)
    db.commit()
    db.close()


def _sql(env: Env, statement: str) -> None:
    db = _db(env)
    assert db.execute(statement).rowcount == 1, statement
    db.commit()
    db.close()


def _everything_works(env: Env, serves: list[Serve], client: Raw, port: int) -> None:
    """Every kind of call a node sees, on the restarted daemon."""
    token = operator_token(env.state)
    fresh = client.request("fresh", 512)
    held = client.request("held", 512, token=token)
    env.vgpu("set-limit", "--socket", str(env.sock), "--state-dir", str(env.state), "--app", "held",
             "--max-memory-mib", "8192")
    apps = env.json("apps")
    assert {"fresh", "held"} <= {a["app_id"] for a in apps["apps"]}, apps
    assert env.json("available")["devices"], "vgpu available lists no device"
    for grant in (fresh, held):
        client.release(grant.grant_id, token=token)
    assert any(name.startswith("vgpu_") for name, _ in metric_samples(port)), "/metrics has no vgpu_ sample"
    status = subprocess.run([sys.executable, "-m", "vgpu.cli", "model", "status", "--state-dir", str(env.state)],
                            capture_output=True, text=True, env=env.env, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    assert serves[-1].term() == 0


# name -> (the table, the damage to one record's JSON); each damages a record of its own
ROW_DAMAGE: dict[str, tuple[str, dict[str, object]]] = {
    # a priority travels as int32: every reply naming the grant (vgpu apps) failed with ValueError
    "grant priority beyond int32": ("grants", {"priority": 2**40}),
    # the policy and every reply do arithmetic on the times: TypeError on each call
    "grant time a string": ("grants", {"created_at_s": "x"}),
    "grant resize time a string": ("grants", {"mem_updated_at_s": "x"}),
    # math.isnan(10**400) raises OverflowError, which stopped the start
    "grant memory 10**400": ("grants", {"memory_mib": 10**400}),
    # a finite 1e308 MiB left the device -1e308 MiB free: every request refused
    "grant memory 1e308": ("grants", {"memory_mib": 1e308}),
    "limits priority beyond int32": ("app_limits", {"priority": 2**40}),
    "limits cap 10**400": ("app_limits", {"max_memory_mib": 10**400}),
}


def test_damaged_ledger_rows_are_each_skipped_and_named_and_every_call_works(
        stored_state: Path, env: Env, serves: list[Serve], client: Raw) -> None:
    """Each damaged grant is one of GRANT_APPS'; each damaged limits entry is one of LIMIT_APPS',
    whose grants stay good (restored next to the damage, as a node has them)."""
    _stored(stored_state, env)
    db = _db(env)
    grant_of = {json.loads(body)["app_id"]: gid for gid, body in db.execute("SELECT grant_id, record_json FROM grants")}
    db.close()
    assert sorted(grant_of) == sorted(GRANT_APPS + LIMIT_APPS)
    grant_cases = sorted(c for c, (table, _) in ROW_DAMAGE.items() if table == "grants")
    limits_cases = sorted(c for c, (table, _) in ROW_DAMAGE.items() if table == "app_limits")
    assert (len(grant_cases), len(limits_cases)) == (len(GRANT_APPS), len(LIMIT_APPS))
    named: dict[str, str] = {}  # case -> how its reason starts: the kind of record and its id
    for case, app in zip(grant_cases, GRANT_APPS, strict=True):
        _edit(env, "grants", "grant_id", grant_of[app], ROW_DAMAGE[case][1])
        named[case] = f"grant {grant_of[app]!r}: "
    for case, app in zip(limits_cases, LIMIT_APPS, strict=True):
        _edit(env, "app_limits", "app_id", app, ROW_DAMAGE[case][1])
        named[case] = f"limits {app!r}: "
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    rec = serves[-1].event("reconciled")
    found = {case: [r for r in rec["bad_record_reasons"] if r.startswith(start)] for case, start in named.items()}
    assert {case: len(reasons) for case, reasons in found.items()} == dict.fromkeys(ROW_DAMAGE, 1), rec
    assert rec["bad_records"] == len(ROW_DAMAGE), rec
    assert rec["grants_restored"] == len(LIMIT_APPS), rec  # every damaged grant left out, the good ones kept
    _everything_works(env, serves, client, port)


# name -> (a statement that damages one row, how the `reconciled` reason starts: the row, what it says)
STORE_DAMAGE: dict[str, tuple[str, str, str]] = {
    # claims() did float('x'): vgpu apps, and set-limit (which lists the apps), failed INTERNAL
    "claim time a string": ("UPDATE apps SET claimed_at_s='x' WHERE app_id='held'", "apps row 'held': ",
                            "the claim is kept"),
    # the start wrote each claimed id's token file with bytes for a name: AttributeError, no start
    "claim id a blob": ("INSERT INTO apps(app_id, claimed_at_s) VALUES (x'00ff', 1.0)", f"apps row {str(bytes([0, 255]))!r}: ", "left out"),
    "claim id the rule refuses": ("INSERT INTO apps(app_id, claimed_at_s) VALUES ('two words', 1.0)",
                                  "apps row 'two words': ", "left out"),
    # a claiming uid that is no uid counts against no uid's share
    "claim uid a string": ("INSERT INTO apps(app_id, claimed_at_s, uid) VALUES ('uid-damaged', 1.0, 'root')",
                           "apps row 'uid-damaged': ", "counted against no uid"),
    # the first change did int('x'): the start failed with a ValueError naming nothing
    "ledger generation a string": ("UPDATE meta SET value='x' WHERE key='ledger_generation'",
                                   "meta ledger_generation 'x': ", "counted afresh"),
}


def test_damaged_store_rows_are_each_named_and_every_call_works(
        stored_state: Path, env: Env, serves: list[Serve], client: Raw) -> None:
    _stored(stored_state, env)
    for statement, _, _ in STORE_DAMAGE.values():
        _sql(env, statement)
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    rec = serves[-1].event("reconciled")
    found = {case: [r for r in rec["bad_record_reasons"] if r.startswith(start) and says in r]
             for case, (_, start, says) in STORE_DAMAGE.items()}
    assert {case: len(reasons) for case, reasons in found.items()} == dict.fromkeys(STORE_DAMAGE, 1), rec
    assert rec["bad_records"] == len(STORE_DAMAGE), rec
    # the claim with a damaged time stands: the id is still refused to anyone without its token
    assert next(a for a in env.json("apps")["apps"] if a["app_id"] == "held")["claimed"]
    _everything_works(env, serves, client, port)


# --- the ledger's records alone (in process) -----------------------------------------------------------
CAPS = [DeviceCapacity("GPU-0", 81559.0)]
GOOD_GRANT = {"grant_id": "g1", "app_id": "a", "device_id": "GPU-0", "memory_mib": 100.0, "sm_pct": 10.0,
              "priority": 0, "created_at_s": 1.0, "updated_at_s": 1.0, "source": "request", "pid": 0,
              "mem_updated_at_s": None, "cold_start_mib": None}
GOOD_LIMITS = {"app_id": "a", "max_memory_mib": 1000.0, "max_sm_pct": None, "priority": None}

# what JSON can hold, and what Python's json reads besides (NaN, inf, ints of any size)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10**300, max_value=10**400)
    | st.floats() | st.sampled_from([1e308, -1e308, 2**31, 2**63, "", "a b", "x" * 300, "y" * 5000, 10**399]) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)


def _damaged(good: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """`good` with some fields replaced, removed or added."""
    return st.builds(
        lambda changes, drop, extra: {**{k: v for k, v in good.items() if k not in drop}, **changes, **extra},
        st.dictionaries(st.sampled_from(sorted(good)), JSON_VALUES, max_size=3),
        st.sets(st.sampled_from(sorted(good)), max_size=1),
        st.dictionaries(st.sampled_from(["extra", "nested"]), JSON_VALUES, max_size=1),
    )


def _use(ledger: Ledger) -> None:
    """What later calls do with what was restored."""
    for g in ledger.grants():
        grant_to_pb(g).SerializeToString()
        assert math.isfinite(g.mem_changed_at_s - 1.0)
    for app_id in ledger.apps():
        limits = ledger.limits(app_id)
        if limits is not None:
            limits_to_pb(limits).SerializeToString()
    ledger.usage("GPU-0")
    for app_id in ("a", "b"):
        try:
            ledger.release(ledger.grant(app_id, 10.0, 1.0).grant_id)
        except InsufficientResources:
            pass  # a cap or a full device: an answer, not a crash
        ledger.set_limits(AppLimits(app_id, max_memory_mib=2048.0))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grant=_damaged(GOOD_GRANT), limits=_damaged(GOOD_LIMITS))
def test_any_damaged_record_is_skipped_and_named_or_kept_and_usable(grant: dict[str, Any], limits: dict[str, Any]) -> None:
    records = {"version": 1, "devices": [], "grants": [grant, {**grant, "grant_id": "g2"}], "limits": [limits]}
    ledger = Ledger.from_records(records, devices=CAPS, skip_bad=True)
    kept = len(ledger.grants()) + sum(ledger.limits(a) is not None for a in ledger.apps())
    assert kept + len(ledger.bad_on_restore) >= 1  # everything is either kept or named
    for reason in ledger.bad_on_restore:
        assert reason.startswith(("grant ", "limits ")) and len(reason) < 500
    _use(ledger)


def test_a_grant_whose_fields_are_all_in_range_is_kept() -> None:
    """The checks refuse damage only: the edges of each range are kept."""
    edge = {**GOOD_GRANT, "priority": 2**31 - 1, "memory_mib": 2.0**40, "app_id": "a" * 256, "mem_updated_at_s": 5}
    ledger = Ledger.from_records({"version": 1, "devices": [], "grants": [edge], "limits": []},
                                 devices=[DeviceCapacity("GPU-0", 2.0**41)], skip_bad=True)
    assert ledger.bad_on_restore == () and ledger.get("g1") == Grant(**edge)  # type: ignore[arg-type]



def test_damaged_device_and_cgroup_originals_are_named_and_every_call_works(
        env: Env, serves: list[Serve], client: Raw) -> None:
    """A crash keeps each device's original settings; a damaged field of them once stopped the start
    with a bare ValueError, JSONDecodeError or KeyError. The field is now read as unknown (that
    setting is not restored: the log says to set it by hand) and the row kept, so no later start
    records the daemon's own settings as the original."""
    serves.append(Serve(env))
    client.request("held", 1024)
    serves[-1].kill9()  # the originals stay recorded, as after a crash
    _sql(env, "UPDATE device_originals SET power_limit_mw='x', mig_enabled=1, mig_layout_json='{{'")
    _sql(env, "INSERT INTO cgroup_originals SELECT device_id, '/vgpu/held', 'x', -5, 'x' FROM device_originals")
    serves.append(Serve(env, "--metrics-port", "auto"))
    port = serves[-1].metrics_port
    reasons = serves[-1].event("reconciled")["bad_record_reasons"]
    assert [(r.split(" ", 1)[0], r.split(": ", 1)[1].split(" ", 1)[0]) for r in reasons] == [
        ("device_originals", "power_limit_mw"), ("device_originals", "mig_layout_json"),
        ("cgroup_originals", "soft_mib"), ("cgroup_originals", "hard_mib"), ("cgroup_originals", "saved_at_s"),
    ], reasons
    _everything_works(env, serves, client, port)


def test_a_damaged_gzip_segment_of_the_history_is_skipped(tmp_path: Path) -> None:
    """A closed segment whose deflate data is damaged raised zlib.error out of NodeHistory.read,
    so every node-learning round failed for as long as the file stayed."""
    import gzip

    import numpy as np

    from vgpu.manager.history import HEADER, NodeHistory

    h = NodeHistory(tmp_path, segment_s=100)
    n = 50
    h.add(["a"] * n, ["GPU-0"] * n, np.arange(0.0, n), np.tile([100.0, 50.0], (n, 1)), [40960.0] * n)
    h.close()
    body = gzip.compress((HEADER + "\n" + "".join(f"{t},b,GPU-0,1,1,1\n" for t in range(200, 260))).encode())
    (tmp_path / "seg-2.csv.gz").write_bytes(body[:12] + b"\xff" * 24 + body[36:])
    (back,) = h.read()
    assert back.app == "a" and len(back.t_s) == n


def test_a_promotion_log_line_nested_too_deep_is_skipped(env: Env) -> None:
    """`json.loads` raises RecursionError, not ValueError, on a line of 100,000 '[': `vgpu model
    status` failed with a traceback, and so did every node-learning round."""
    models = env.state / "models"
    models.mkdir(parents=True)
    (models / "promotions.jsonl").write_text('{"event": "rejected"}\n' + "[" * 100_000 + "\n")
    status = subprocess.run([sys.executable, "-m", "vgpu.cli", "model", "status", "--state-dir", str(env.state)],
                            capture_output=True, text=True, env=env.env, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["rejections"] == 1
