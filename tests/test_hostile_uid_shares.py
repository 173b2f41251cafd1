"""One unprivileged user cannot take all of what the node bounds, against a real `vgpu serve`: the
daemon knows each Unix-socket caller's uid, so grants, self-registered application ids and watchers
are each bounded per uid as well as per node, whatever tokens the user presents (every id it claims
comes with a token of its own); the operator drops the claims that hold nothing with `vgpu
forget-app`.

The users are `tests/as_user.py` as uid 65534 and 65533 (acting as another user needs root); this
test's own process is root, bounded by the node's quotas only."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

from daemon_fixtures import ROOT, Env, Serve
from hostile import Raw, operator_token
from test_hostile_peers import NOBODY, OTHER, ROOT_ONLY, _as_user, _serve, env, run_as

from vgpu import auth

__all__ = ["env"]  # the fixture, with the socket where every user may reach it


def _forget_app(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    """`vgpu forget-app` as the operator runs it: a subprocess of the real command line."""
    return subprocess.run([sys.executable, "-m", "vgpu.cli", "forget-app", "--socket", str(env.sock), *args],
                          env=env.env, cwd=ROOT, capture_output=True, text=True, timeout=60)


@ROOT_ONLY
def test_one_uid_holds_at_most_its_share_of_the_nodes_grants(env: Env, serves: list[Serve]) -> None:
    """The attack: 0-MiB grants under ids the user claims itself, 64 per id, until the node's quota is
    full. With a share per uid the user stops at it, across a restart too (each grant keeps its uid),
    and the others still get grants."""
    env.env.update({"VGPU_SERVER_MAX_GRANTS_PER_APP": "3", "VGPU_SERVER_MAX_GRANTS_PER_UID": "4",
                    "VGPU_SERVER_MAX_GRANTS_PER_NODE": "10"})
    serves.append(_serve(env))
    out = run_as(env, NOBODY, "grants", "n", "3", "3")
    assert out["granted"] == 4 and out["code"] == "RESOURCE_EXHAUSTED", out
    assert f"uid {NOBODY} holds 4 grants" in out["details"] and "server.max_grants_per_uid = 4" in out["details"]
    other = run_as(env, OTHER, "grants", "o", "1", "3")
    assert other["granted"] == 3 and "code" not in other, other  # another user's share is its own
    client = Raw(env.sock)
    try:
        op = operator_token(env.state)
        for _ in range(3):  # the operator (and root) are bounded by the node's quota only
            client.request("ops", 0, token=op)
        assert sum(len(a.grants) for a in client.apps()) == 10
    finally:
        client.close()
    assert serves[-1].term() == 0
    env.env["VGPU_SERVER_MAX_GRANTS_PER_NODE"] = "20"
    serves.append(_serve(env))
    again = run_as(env, NOBODY, "grants", "m", "1", "1")
    assert again["granted"] == 0 and "server.max_grants_per_uid = 4" in again["details"], again
    assert run_as(env, OTHER, "grants", "p", "1", "1")["granted"] == 1  # its fourth: refused next
    assert "server.max_grants_per_uid" in run_as(env, OTHER, "grants", "q", "1", "1")["details"]
    assert serves[-1].term() == 0


@ROOT_ONLY
def test_claims_are_bounded_per_uid_and_the_operator_forgets_those_that_hold_nothing(env: Env,
                                                                                    serves: list[Serve]) -> None:
    env.env["VGPU_AUTH_MAX_SELF_REGISTERED_APPS_PER_UID"] = "3"
    serves.append(_serve(env))
    assert run_as(env, NOBODY, "grants", "g", "1", "1")["granted"] == 1  # an id that holds a grant
    out = run_as(env, NOBODY, "claims", "c", "5")
    assert out["claimed"] == 2 and out["code"] == "RESOURCE_EXHAUSTED", out
    assert f"uid {NOBODY} has claimed 3" in out["details"] and "max_self_registered_apps_per_uid = 3" in out["details"]
    assert "vgpu forget-app" in out["details"]
    assert run_as(env, OTHER, "claims", "d", "2")["claimed"] == 2  # another user's share is its own
    # the claims keep their uid across a restart
    assert serves[-1].term() == 0
    serves.append(_serve(env))
    assert run_as(env, NOBODY, "claims", "e", "1")["code"] == "RESOURCE_EXHAUSTED"
    # only the operator may forget: an application's token is refused
    app_token = auth.app_token_file("g0", env.state)
    refused = _forget_app(env, "--uid", str(NOBODY), "--token-file", str(app_token))
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, refused
    assert "needs the operator role" in refused.stderr and "--state-dir" in refused.stderr
    done = _forget_app(env, "--uid", str(NOBODY), "--app", "never-claimed", "--state-dir", str(env.state), "--json")
    assert done.returncode == 0, done
    result = json.loads(done.stdout)
    assert result["forgotten"] == ["c0", "c1"], result
    kept = {k["app_id"]: k["reason"] for k in result["kept"]}
    assert kept["never-claimed"] == "not claimed" and kept["g0"].startswith("holds grants"), kept
    assert not auth.app_token_file("c0", env.state).exists() and app_token.exists()
    logged = serves[-1].event("apps_forgotten")  # with who asked, as every change
    assert (logged["forgotten"], logged["claimed_by_uid"], logged["caller"]) == (["c0", "c1"], NOBODY, "operator")
    assert logged["kept_count"] == 2 and logged["caller_uid"] == os.getuid()
    listed = {a["app_id"]: a.get("claimed_by_uid") for a in env.json("apps", "--all")["apps"]}
    assert listed == {"g0": NOBODY, "d0": OTHER, "d1": OTHER}, listed
    # room again for two of its own
    assert run_as(env, NOBODY, "claims", "e", "3")["claimed"] == 2
    assert serves[-1].term() == 0


@ROOT_ONLY
def test_a_uids_watchers_are_bounded_whatever_tokens_it_presents(env: Env, serves: list[Serve]) -> None:
    """The attack: many ids claimed, each a caller of its own with its token, each opening the
    per-caller bound of watchers, until the node's are all taken."""
    env.env.update({"VGPU_SERVER_MAX_WATCHERS_PER_CALLER": "2", "VGPU_SERVER_MAX_WATCHERS_PER_UID": "3",
                    "VGPU_SERVER_MAX_WATCHERS": "8"})
    serves.append(_serve(env))
    holders = [subprocess.Popen(_as_user(env, uid, "watch", prefix, "3", "2"), env=env.env, cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for uid, prefix in ((NOBODY, "w"), (OTHER, "v"))]
    try:
        held = []
        for h in holders:
            assert h.stdout is not None
            held.append(json.loads(h.stdout.readline()))
        for out in held:  # three ids' tokens, two watches each: the uid's share, 3, is open
            assert out["opened"] == 3 and out["code"] == "RESOURCE_EXHAUSTED", out
            assert f"uid {out['uid']} has 3 watchers open" in out["details"]
            assert "server.max_watchers_per_uid = 3" in out["details"]
    finally:
        for h in holders:
            if h.stdin is not None:
                h.stdin.close()
            h.wait(30)
    assert serves[-1].term() == 0


def test_forget_app_needs_something_to_forget(env: Env) -> None:
    out = _forget_app(env, "--state-dir", str(env.state), "--wait-s", "0")
    assert out.returncode == 2 and "give --app ID" in out.stderr, out


@ROOT_ONLY
def test_a_claim_left_without_its_token_is_its_own_uids_after_a_restart(env: Env, serves: list[Serve]) -> None:
    """What a call that failed on a full state directory could leave before: the claim stored, its
    token file gone, nothing about it in the restarted daemon's memory. The uid that claimed it gets
    the id and its token again; another uid does not."""
    serves.append(_serve(env))
    assert serves[-1].term() == 0
    with sqlite3.connect(env.state / "vgpu.sqlite3") as db:
        db.execute("INSERT INTO apps(app_id, claimed_at_s, uid) VALUES ('left0', 1.0, ?)", (NOBODY,))
    serves.append(_serve(env))
    other = run_as(env, OTHER, "grants", "left", "1", "1")
    assert other["granted"] == 0 and other["code"] == "PERMISSION_DENIED", other
    own = run_as(env, NOBODY, "grants", "left", "1", "2")  # "left0" again, the second grant with its token
    assert own["granted"] == 2 and "code" not in own, own
    assert serves[-1].term() == 0
