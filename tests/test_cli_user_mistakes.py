"""Mistakes a new user makes at the command line, run as the user runs them (`vgpu ...` as a
subprocess): each is said, with what to do, and the exit status says it failed where it did."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import ROOT, SKU, Env, Serve, make_env, one_daemon_for_the_module

from vgpu import auth
from vgpu.jobs import MODES, PRECISIONS


def vgpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_model_status_of_a_missing_state_directory_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    for action in ("status", "rollback"):
        r = vgpu("model", action, "--state-dir", str(missing))
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stdout == ""
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and str(missing) in lines[0] and "--state-dir" in lines[0], r.stderr
    assert not missing.exists()  # nothing was created there


def test_size_of_an_unknown_model_type_says_so_and_names_the_nearest(tmp_path: Path) -> None:
    r = vgpu("size", "--model-type", "resnet5O", "--batch-size", "64", "--json")
    assert r.returncode == 0, r.stderr  # a model of one's own is sized all the same
    assert "unknown model type 'resnet5O'" in r.stderr and "did you mean resnet50" in r.stderr
    assert any("unknown model type 'resnet5O'" in n for n in json.loads(r.stdout)["notes"])
    known = vgpu("size", "--model-type", "resnet50", "--batch-size", "64", "--json")
    assert known.returncode == 0 and "unknown model type" not in known.stderr + known.stdout
    # the table says the parameter count is not known, not that the model has none; the size is unchanged
    typed = vgpu("size", "--model-type", "resnett50", "--batch-size", "8")
    first = typed.stdout.splitlines()[0]
    assert typed.returncode == 0 and first.startswith("resnett50 (cnn, parameter count unknown: give --param-count)")
    assert "0 parameters" not in typed.stdout
    sized = json.loads(vgpu("size", "--model-type", "resnett50", "--batch-size", "8", "--json").stdout)
    assert f"= grant {sized['grant_mib']:.0f} MiB" in typed.stdout
    given = vgpu("size", "--model-type", "resnett50", "--batch-size", "8", "--param-count", "25000000")
    assert given.stdout.startswith("resnett50 (cnn, 25,000,000 parameters)"), given.stdout


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One `vgpu serve` for the tests that each ask it about an application id of their own (a start
    is 2-3 s of the suite)."""
    with one_daemon_for_the_module(make_env(tmp_path_factory.mktemp("shared"))) as env:
        yield env


def test_set_limit_without_the_operator_token_says_where_it_is_and_how_to_pass_it(shared: Env) -> None:
    env = shared
    sock = ["--socket", str(env.sock)]
    assert vgpu("request", *sock, "--app", "limited", "--memory-mib", "10", env=env.env).returncode == 0
    r = vgpu("set-limit", *sock, "--app", "limited", "--max-memory-mib", "5", env=env.env)
    assert r.returncode == 1
    # the CLI looked in the default state directory, not the daemon's: it names where it looked
    assert "UNAUTHENTICATED" in r.stderr and "operator.token" in r.stderr, r.stderr
    assert "--state-dir" in r.stderr and "--token-file" in r.stderr and "VGPU_TOKEN_FILE" in r.stderr
    ok = vgpu("set-limit", *sock, "--token-file", str(auth.role_token_file("operator", env.state)),
              "--app", "limited", "--max-memory-mib", "5", env=env.env)
    assert ok.returncode == 0, ok.stderr


def test_a_taken_metrics_port_fails_the_start_naming_port_and_setting(env: Env) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = vgpu("serve", "--socket", str(env.sock), "--state-dir", str(env.state), "--backend", f"sim:{SKU}",
                 "--metrics-port", str(port), env=env.env)
    assert r.returncode == 1, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("vgpu serve:")]
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0] and "--metrics-port" in said[0], r.stderr
    assert "free the port" in said[0], said
    assert not env.sock.exists()  # nothing left serving


def test_a_metrics_address_this_host_lacks_is_said_as_an_address_not_a_port(env: Env) -> None:
    """192.0.2.1 (TEST-NET-1, on no interface here) or a name that does not resolve: the line points at
    --metrics-address, not at freeing a port that nothing holds."""
    for address in ("192.0.2.1", "no-such-host.invalid"):
        r = vgpu("serve", "--socket", str(env.sock), "--state-dir", str(env.state), "--backend", f"sim:{SKU}",
                 "--metrics-address", address, "--metrics-port", "19999", env=env.env)
        assert r.returncode == 1, r.stderr
        said = [line for line in r.stderr.splitlines() if line.startswith("vgpu serve:")]
        assert len(said) == 1 and f"cannot serve metrics on {address}:19999" in said[0], r.stderr
        assert "--metrics-address" in said[0] and "free the port" not in said[0], said
        assert not env.sock.exists()


def test_report_labels_an_sm_change_with_its_resource_and_unit(env: Env, serves: list[Serve], tmp_path: Path) -> None:
    serves.append(Serve(env))
    sock = ["--socket", str(env.sock)]
    assert vgpu("request", *sock, "--app", "a", "--memory-mib", "1000", "--sm-pct", "50",
                env=env.env).returncode == 0
    cut = vgpu("set-limit", *sock, "--state-dir", str(env.state), "--app", "a", "--max-sm-pct", "20", env=env.env)
    assert cut.returncode == 0, cut.stderr
    page = tmp_path / "a.html"
    r = vgpu("report", *sock, "--app", "a", "--out", str(page), env=env.env)
    assert r.returncode == 0, r.stderr
    rows = re.findall(r"<tr><td>a on [^<]*</td><td>[^<]*</td><td>([^<]*)</td><td>([^<]*)</td></tr>", page.read_text())
    sm_rows = [detail for kind, detail in rows if kind == "sm"]
    assert sm_rows == ["capped by limits: SM 50 -&gt; 20 %"], rows  # the SM change, not "1000 -> 1000 MiB"


def test_a_gpu_is_named_by_its_index_as_the_tables_show_it_or_by_its_uuid(shared: Env) -> None:
    """`vgpu available` shows each GPU's index under IDX and `vgpu apps` under GPU: `--device 0`
    means that GPU, for `available` and `request` as for `report`; an index no GPU has is said, with
    the GPUs there are."""
    env = shared
    sock = ["--socket", str(env.sock)]
    (device,) = json.loads(vgpu("available", *sock, "--json", env=env.env).stdout)["devices"]
    by_index = vgpu("available", *sock, "--device", "0", "--json", env=env.env)
    assert by_index.returncode == 0, by_index.stderr
    assert [d["device_id"] for d in json.loads(by_index.stdout)["devices"]] == [device["device_id"]]
    r = vgpu("request", *sock, "--app", "by-index", "--memory-mib", "10", "--device", "0", "--json", env=env.env)
    assert r.returncode == 0 and json.loads(r.stdout)["device_id"] == device["device_id"], r.stderr
    for command in (["available"], ["request", "--app", "by-index", "--memory-mib", "10"]):
        r = vgpu(*command, *sock, "--device", "3", env=env.env)
        assert r.returncode == 1 and r.stdout == "", r.stdout
        assert r.stderr.strip() == (f"vgpu {command[0]}: no GPU with index 3 on this daemon "
                                    f"(its GPUs: 0 ({device['device_id']}))"), r.stderr
    by_uuid = vgpu("available", *sock, "--device", device["device_id"], "--json", env=env.env)
    assert by_uuid.returncode == 0 and json.loads(by_uuid.stdout)["devices"][0]["index"] == 0


def test_a_grant_with_no_pid_is_said_to_be_a_lease(shared: Env) -> None:
    """`vgpu request` with no --pid: nothing ties the grant to a process, so the daemon releases it
    after server.idle_release_s unless the application shows signs of life; the request says so, and
    one naming a process (this test's, of this user) does not."""
    sock = ["--socket", str(shared.sock)]
    r = vgpu("request", *sock, "--app", "leased", "--memory-mib", "10", "--json", env=shared.env)
    assert r.returncode == 0 and json.loads(r.stdout)["pid"] == 0, r.stderr  # stdout stays the grant
    assert "vgpu request: note: no --pid, so no process holds this grant: unless 'leased' shows it is alive" in r.stderr
    assert "server.idle_release_s" in r.stderr
    held = vgpu("request", *sock, "--app", "leased", "--memory-mib", "10", "--pid", str(os.getpid()), env=shared.env)
    assert held.returncode == 0 and held.stdout.startswith("granted "), held.stderr
    assert "note: no --pid" not in held.stderr


def test_a_grant_is_printed_rounded_as_the_tables_show_it_and_exact_in_json(shared: Env) -> None:
    sock = ["--socket", str(shared.sock)]
    exact = json.loads(vgpu("request", *sock, "--app", "fractions", "--memory-mib", "1234.56", "--sm-pct", "33.3333",
                            "--json", env=shared.env).stdout)
    assert exact["memory_mib"] == 1234.56 and exact["sm_pct"] == 33.3333
    r = vgpu("request", *sock, "--app", "fractions", "--memory-mib", "1234.56", "--sm-pct", "33.3333", env=shared.env)
    grant_id = r.stdout.split()[1].rstrip(":")
    assert r.stdout == f"granted {grant_id}: 1,235 MiB, 33 % SM on {exact['device_id']} for fractions\n", r.stdout
    released = vgpu("release", *sock, "--grant", grant_id, env=shared.env)
    assert released.stdout == f"released {grant_id} (1,235 MiB of fractions)\n", released.stdout


def test_releasing_a_grant_that_is_gone_says_it_may_have_been_released_already(shared: Env) -> None:
    sock = ["--socket", str(shared.sock)]
    r = vgpu("request", *sock, "--app", "twice", "--memory-mib", "10", "--json", env=shared.env)
    grant_id = json.loads(r.stdout)["grant_id"]
    assert vgpu("release", *sock, "--grant", grant_id, env=shared.env).returncode == 0
    again = vgpu("release", *sock, "--grant", grant_id, env=shared.env)
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr.startswith(f"vgpu release: NOT_FOUND: no grant '{grant_id}': no application holds it now "
                                   "(released already"), again.stderr
    assert again.stderr.rstrip().endswith("`vgpu apps` lists the grants held"), again.stderr


def test_requesting_an_id_another_client_owns_says_where_the_token_was_looked_for(shared: Env, tmp_path: Path) -> None:
    env = shared
    sock = ["--socket", str(env.sock)]
    assert vgpu("request", *sock, "--app", "taken", "--memory-mib", "10", env=env.env).returncode == 0
    other = dict(env.env, XDG_CONFIG_HOME=str(tmp_path / "another-user"))  # its token cache is empty
    r = vgpu("request", *sock, "--app", "taken", "--memory-mib", "10", env=other)
    assert r.returncode == 1
    assert "PERMISSION_DENIED" in r.stderr and "owned by another client" in r.stderr, r.stderr
    assert str(tmp_path / "another-user" / "vgpu" / "tokens") in r.stderr, r.stderr  # the cache it read
    assert "--token-file" in r.stderr and "--state-dir" in r.stderr, r.stderr
    # the daemon's copy, read with --state-dir, lets the operator act for the application
    ok = vgpu("request", *sock, "--state-dir", str(env.state), "--app", "taken", "--memory-mib", "10", env=other)
    assert ok.returncode == 0, ok.stderr


def test_a_word_where_an_amount_is_expected_is_named_as_such(tmp_path: Path) -> None:
    sock = ["--socket", str(tmp_path / "none.sock")]  # never reached: the command line is refused first
    for args, option in ((("request", "--app", "a", "--memory-mib", "abc"), "--memory-mib"),
                         (("request", "--app", "a", "--memory-mib", "1", "--wait-s", "soon"), "--wait-s"),
                         (("set-limit", "--app", "a", "--max-memory-mib", "x"), "--max-memory-mib"),
                         (("request", "--app", "a", "--memory-mib", "1", "--sm-pct", "half"), "--sm-pct")):
        r = vgpu(*args, *sock)
        assert r.returncode == 2, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert f"argument {option}: must be a number, got" in last, r.stderr
        assert "_nonneg" not in r.stderr  # no parser's internal name


def test_report_to_a_file_it_cannot_draw_is_a_usage_error_before_the_daemon_is_asked(tmp_path: Path) -> None:
    out = tmp_path / "picture.txt"
    r = vgpu("report", "--socket", str(tmp_path / "none.sock"), "--app", "a", "--out", str(out))
    assert r.returncode == 2, r.stderr  # a command line that cannot be carried out, not a refusal (1)
    assert r.stderr.strip() == f"vgpu report: --out {out}: the picture must end in .png, .svg or .html", r.stderr
    assert not out.exists()


def test_a_picture_goes_only_into_a_directory_that_exists_said_before_the_work(tmp_path: Path) -> None:
    """A mistyped directory is not created (with this user's owner and umask, as root anywhere): the
    command says so with exit status 2, before the daemon is asked and before the demo runs."""
    missing = tmp_path / "no-such-dir" / "deeper"
    afile = tmp_path / "a-file"
    afile.write_text("")
    adir = tmp_path / "pic.png"
    adir.mkdir()
    sock = ["--socket", str(tmp_path / "none.sock")]  # never reached
    for out, said in ((missing / "x.png", f"the directory {missing} does not exist (create it first)"),
                      (afile / "x.svg", f"the directory {afile} is not a directory"),
                      (Path("/proc/self/x.html"), "no permission to write in /proc/self"),
                      (adir, f"{adir} is a directory")):
        r = vgpu("report", *sock, "--app", "a", "--out", str(out))
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == f"vgpu report: --out {out}: {said}", r.stderr
        began = time.monotonic()
        r = vgpu("demo", "--seconds", "30", "--plot", str(out))
        assert r.returncode == 2 and time.monotonic() - began < 20, r.stderr  # not after a 30 s run
        assert f"--plot {out}: {said}" in r.stderr and r.stdout == "", r.stdout + r.stderr
    assert not (tmp_path / "no-such-dir").exists()


def test_doctor_with_no_daemon_says_the_backend_it_checked_came_from_the_flag(tmp_path: Path) -> None:
    common = ["doctor", "--socket", str(tmp_path / "none.sock"), "--state-dir", str(tmp_path), "--json"]
    given = vgpu(*common, "--backend", "sim:h100-80gb")
    assert given.returncode == 1, given.stderr  # the socket check fails: no daemon
    (line,) = [c for c in json.loads(given.stdout) if c["name"] == "backend"]
    assert line["detail"].startswith("sim:h100-80gb (checked as --backend asks: no daemon answers at "), line
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
    configured = vgpu(*common, env=dict(env, VGPU_SERVER_BACKEND="sim:a100-40gb"))
    (line,) = [c for c in json.loads(configured.stdout) if c["name"] == "backend"]
    assert line["detail"].startswith("sim:a100-40gb (checked as configured: no daemon answers at "), line


def test_a_job_detail_without_its_model_type_is_refused_not_dropped(tmp_path: Path) -> None:
    sock = ["--socket", str(tmp_path / "none.sock")]  # never reached: the command line is refused first
    alone = vgpu("request", *sock, "--app", "a", "--batch-size", "64")
    assert alone.returncode == 2, alone.stderr
    assert alone.stderr.strip() == ("vgpu request: --batch-size describes a job only with --model-type "
                                    "(e.g. resnet50): give it too, or leave it out"), alone.stderr
    # with a memory amount the job was sent without these fields before: now it is said, not dropped
    beside = vgpu("request", *sock, "--app", "a", "--memory-mib", "10", "--batch-size", "64", "--precision", "fp16")
    assert beside.returncode == 2, beside.stderr
    assert "--batch-size, --precision describe a job only with --model-type" in beside.stderr, beside.stderr


@pytest.mark.parametrize(("args", "said"), [
    (("--batch-size", "0"), "--batch-size: the job cannot be sized: batch_size must be >= 1"),
    (("--batch-size", "8", "--precision", "fp8"),
     f"--precision: the job cannot be sized: unknown precision 'fp8'; expected one of {', '.join(PRECISIONS)}"),
    (("--batch-size", "8", "--mode", "inference"),
     f"--mode: the job cannot be sized: unknown mode 'inference'; expected {' or '.join(map(repr, MODES))}"),
    (("--memory-mib", "10", "--batch-size", "8", "--mode", "inference"), "--mode: the job cannot be sent: unknown mode"),
])
def test_a_job_the_daemon_would_refuse_is_a_usage_error_naming_the_allowed_values(
        shared: Env, args: tuple[str, ...], said: str) -> None:
    """A job that cannot be sized (batch 0) or that names a precision or mode the sizer does not know
    is refused at the command line, exit 2, as the daemon's own check words it (vgpu.jobs.JobConfig),
    and the daemon hears nothing of it; the spellings it accepts still reach it."""
    sock = ["--socket", str(shared.sock)]
    r = vgpu("request", *sock, "--app", "badjob", "--model-type", "resnet50", *args, env=shared.env)
    assert r.returncode == 2 and r.stderr.startswith(f"vgpu request: {said}") and r.stderr.count("\n") == 1, r.stderr
    assert "badjob" not in {a["app_id"] for a in shared.json("apps")["apps"]}
    fixed = [{"0": "8", "fp8": "FP16", "inference": "infer"}.get(a, a) for a in args]
    ok = vgpu("request", *sock, "--app", "goodjob", "--model-type", "resnet50", *fixed, "--json", env=shared.env)
    assert ok.returncode == 0, ok.stderr
    assert vgpu("release", *sock, "--grant", json.loads(ok.stdout)["grant_id"], env=shared.env).returncode == 0


def test_an_sm_share_above_100_is_a_usage_error_before_the_daemon_is_asked(tmp_path: Path) -> None:
    sock = ["--socket", str(tmp_path / "none.sock")]  # never reached: the command line is refused first
    for args, option in ((("request", "--app", "a", "--memory-mib", "1", "--sm-pct", "150"), "--sm-pct"),
                         (("set-limit", "--app", "a", "--max-sm-pct", "101"), "--max-sm-pct")):
        r = vgpu(*args, *sock)
        assert r.returncode == 2, r.stderr  # the daemon would refuse it INVALID_ARGUMENT, exit 1
        assert r.stderr.strip().splitlines()[-1].endswith(f"argument {option}: must be a share within 0..100 %, "
                                                          f"got {args[-1]}"), r.stderr


def test_doctor_refuses_a_signature_age_no_signature_can_be_under(tmp_path: Path) -> None:
    for age in ("-1", "0", "nan", "soon"):
        r = vgpu("doctor", "--socket", str(tmp_path / "none.sock"), "--state-dir", str(tmp_path),
                 "--max-signature-age-s", age)
        assert r.returncode == 2, r.stdout + r.stderr  # a usage error, not a FAIL line (1)
        assert r.stdout == "" and "argument --max-signature-age-s: must be a" in r.stderr, r.stderr


def _without_an_answer_in_time(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`vgpu *args` until a run gets no answer within its deadline (at most 5 runs): no answer comes
    within 1 us, but gRPC's deadline is a timer, and on a loaded machine the reply can be read before
    it fires."""
    for _ in range(5):
        r = vgpu(*args, env=env)
        if r.returncode != 0:
            return r
    raise AssertionError(f"5 runs of vgpu {args[0]} were all answered within their deadline")


def test_a_change_with_no_answer_in_time_says_it_may_have_been_made(shared: Env) -> None:
    env = shared
    sock = ["--socket", str(env.sock), "--timeout-s", "0.000001"]  # no answer can come that fast
    r = _without_an_answer_in_time("request", *sock, "--app", "slow", "--memory-mib", "10", env=env.env)
    assert r.returncode == 1, r.stderr
    said = r.stderr.strip()
    assert said.startswith("vgpu request: DEADLINE_EXCEEDED: no answer within 1e-06 s (--timeout-s); the daemon "
                           "may have made the change all the same: see `vgpu apps`"), said
    assert "/var/lib/vgpu/tokens/apps/" in said and "--state-dir" in said, said  # where its token would be
    # a read changes nothing: it only says there was no answer in time
    read = _without_an_answer_in_time("available", *sock, env=env.env)
    assert read.returncode == 1
    assert read.stderr.strip() == "vgpu available: DEADLINE_EXCEEDED: no answer within 1e-06 s (--timeout-s)"
