"""`vgpu set-limit` as an operator uses it, against a real `vgpu serve`: a cap covers the grants the
application holds already, an unknown application needs --create, no flags is an error, --clear
clears, flags not given keep their values, every change is logged, and the limit shows in `vgpu apps`."""

from __future__ import annotations

import json
import subprocess
import sys

from daemon_fixtures import ROOT, Env, Serve

DEMO = ROOT / "vgpu" / "data" / "demo_trace.csv.gz"


def op(env: Env, *args: str, check: bool = True):  # type: ignore[no-untyped-def]
    return env.vgpu("set-limit", "--socket", str(env.sock), "--state-dir", str(env.state), *args, check=check)


def app(env: Env, app_id: str) -> dict:  # type: ignore[type-arg]
    return next(a for a in env.json("apps")["apps"] if a["app_id"] == app_id)


def test_set_limit_semantics(env: Env, serves: list[Serve]) -> None:
    serve = Serve(env)
    serves.append(serve)
    sock = ["--socket", str(env.sock)]
    env.vgpu("request", *sock, "--app", "big", "--memory-mib", "4096", "--sm-pct", "40")
    env.vgpu("request", *sock, "--app", "big", "--memory-mib", "1024", "--sm-pct", "10")

    # A cap covers the grants the app holds already.
    r = op(env, "--app", "big", "--max-memory-mib", "2048", "--max-sm-pct", "30")
    assert "grants were cut to 2048 MiB" in r.stderr
    big = app(env, "big")
    assert sum(g["memory_mib"] for g in big["grants"]) == 2048
    assert sum(g["sm_pct"] for g in big["grants"]) == 30
    assert big["limits"] == {"app_id": "big", "max_memory_mib": 2048.0, "max_sm_pct": 30.0}  # shown
    assert env.json("available")["devices"][0]["mem_granted_mib"] == 2048
    logged = serve.event("limits_set")
    assert logged["app"] == "big" and logged["after"] == "max 2048 MiB, max 30 % SM" and len(logged["grants_capped"]) >= 1
    # ... and further requests stay within it.
    refused = env.vgpu("request", *sock, "--app", "big", "--memory-mib", "100", check=False)
    assert refused.returncode == 1 and "RESOURCE_EXHAUSTED" in refused.stderr

    # Flags not given keep their values.
    op(env, "--app", "big", "--priority", "3")
    assert app(env, "big")["limits"] == {"app_id": "big", "max_memory_mib": 2048.0, "max_sm_pct": 30.0, "priority": 3}

    # No flags is an error, not a silent clear; --clear clears the caps.
    none = op(env, "--app", "big", check=False)
    assert none.returncode == 2 and "nothing to set" in none.stderr
    assert app(env, "big")["limits"]["max_memory_mib"] == 2048
    op(env, "--app", "big", "--clear")
    assert app(env, "big")["limits"] == {"app_id": "big", "priority": 3}
    assert serve.event("limits_set")["before"] == "max 2048 MiB, max 30 % SM, priority 3"

    # An unknown application is an error unless --create.
    typo = op(env, "--app", "bgi", "--max-memory-mib", "100", check=False)
    assert typo.returncode == 1 and "NOT_FOUND: no application 'bgi'" in typo.stderr and "--create" in typo.stderr
    assert "bgi" not in {a["app_id"] for a in env.json("apps")["apps"]}
    op(env, "--app", "later", "--max-memory-mib", "100", "--create")
    assert app(env, "later")["limits"]["max_memory_mib"] == 100


def test_a_cap_below_usage_is_flagged(env: Env, serves: list[Serve]) -> None:
    serve = Serve(env)
    serves.append(serve)
    device = env.json("available")["devices"][0]["device_id"]
    subprocess.run(
        [sys.executable, "-m", "vgpu.cli", "profiler", "--manager", f"unix://{env.sock}", "--replay", str(DEMO),
         "--speed", "20", "--seconds", "2", "--device-id", device,
         "--token-file", str(env.state / "tokens" / "profiler.token")],
        cwd=ROOT, env=env.env, capture_output=True, text=True, timeout=90, check=True,
    )
    used = {a["app_id"]: a["mem_used_mib"] for a in env.json("apps")["apps"] if a["mem_used_mib"] > 100}
    app_id, mem = next(iter(used.items()))
    r = op(env, "--app", app_id, "--max-memory-mib", str(int(mem / 2)), "--json")
    assert json.loads(r.stdout)["max_memory_mib"] == int(mem / 2)
    assert f"warning: {app_id} uses" in r.stderr and "above its cap" in r.stderr
    assert serve.event("limit_below_usage")["app"] == app_id


def test_every_flag_has_help() -> None:
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "set-limit", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=True)
    blocks: dict[str, str] = {}  # option -> its help text (what follows the flag and its metavar)
    current = ""
    for line in r.stdout.splitlines():
        if line.startswith("  -"):
            flag, *rest = line.split()
            current = flag.rstrip(",")
            blocks[current] = " ".join(w for w in rest if not w.isupper())
        elif current and line.startswith("     "):
            blocks[current] += " " + line.strip()
        else:
            current = ""
    for flag in ("--app", "--max-memory-mib", "--max-sm-pct", "--priority", "--clear", "--create", "--json"):
        assert len(blocks.get(flag, "").split()) >= 3, (flag, blocks.get(flag))
    assert "grants it holds now included" in r.stdout


def test_the_operators_priority_reaches_the_grants_held_and_to_come(env: Env, serves: list[Serve]) -> None:
    # The policy decides who yields first from the grants' priorities: the operator's priority must
    # be there, over whatever the application asked for, and survive a restart.
    serves.append(Serve(env))
    sock = ["--socket", str(env.sock)]
    env.vgpu("request", *sock, "--app", "batch", "--memory-mib", "1024", "--priority", "3")
    op(env, "--app", "batch", "--priority", "-2")
    assert [g["priority"] for g in app(env, "batch")["grants"]] == [-2]
    env.vgpu("request", *sock, "--app", "batch", "--memory-mib", "512", "--priority", "9")
    assert [g["priority"] for g in app(env, "batch")["grants"]] == [-2, -2]
    assert serves[-1].term() == 0
    serves.append(Serve(env))
    assert [g["priority"] for g in app(env, "batch")["grants"]] == [-2, -2]


def test_each_change_is_logged_with_who_asked_for_it(env: Env, serves: list[Serve]) -> None:
    """An operator on a shared node reads from the journal who took a grant, capped an application or
    released a grant: the role, how it proved it, and the kernel's uid and pid of the calling process."""
    import os

    serve = Serve(env)
    serves.append(serve)
    sock = ["--socket", str(env.sock)]
    grant = json.loads(env.vgpu("request", *sock, "--app", "audited", "--memory-mib", "1024", "--json").stdout)
    op(env, "--app", "audited", "--max-memory-mib", "512")
    env.vgpu("release", *sock, "--grant", grant["grant_id"], "--app", "audited")
    me = {"caller_uid": os.getuid(), "caller_pid": os.getpid()}  # the CLI ran in this process
    granted = serve.event("granted")
    assert {k: granted.get(k) for k in ("caller", "caller_via", *me)} == {"caller": "anonymous", "caller_via": "none", **me}
    capped = serve.event("limits_set")
    assert {k: capped.get(k) for k in ("caller", "caller_via", *me)} == {"caller": "operator", "caller_via": "token", **me}
    released = serve.event("released")
    assert released["caller"] in ("anonymous", "app:audited") and released["caller_pid"] == os.getpid()
    # the policy's own work is no call: it names no caller
    assert all("caller" not in e for e in serve.events() if e.get("event") in ("serving", "stopped"))
