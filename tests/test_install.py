"""The install story of docs/install.md, as an operator follows it: build a wheel from the repository,
install it into a fresh virtual environment, start `vgpu serve` from it and pass `vgpu doctor`.

No download where this environment has setuptools >= 77: the wheel is built without build isolation
and installed with --no-deps; the fresh
environment reaches the already-installed dependencies through a path file (it is the wheel's content
that is under test, not pip's resolver)."""

from __future__ import annotations

import importlib.metadata
import shutil
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, f"{cmd} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def _isolation() -> list[str]:
    """Build with this environment's setuptools when it is new enough (no download); else let pip
    fetch the build requirements, as an operator's pip would."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if major >= 77 else []


def test_wheel_builds_installs_and_serves(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy of the working tree, so the build leaves nothing in the repository
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "runs"))
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", *_isolation(), "-w", dist, ".", cwd=src)
    (wheel,) = dist.glob("vgpu-*.whl")

    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"vgpu"}
    for shipped in ("vgpu/manager/models/default.pt", "vgpu/manager/models/default.pt.json",
                    "vgpu/manager/models/coldstart_randomforest.pt", "vgpu/data/demo_trace.csv.gz",
                    "vgpu/profiler/main.py", "vgpu/allocator/core.py", "vgpu/v1/allocator_pb2.py"):
        assert shipped in names, shipped

    venv = tmp_path / "venv"
    # A clean environment: nothing of this checkout (PYTHONPATH) may stand in for the installed copy.
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    run(getattr(sys, "_base_executable", sys.executable), "-m", "venv", venv, cwd=tmp_path, env=env)
    py = venv / "bin" / "python"
    run(py, "-m", "pip", "install", "--no-deps", "--no-index", wheel, cwd=tmp_path, env=env)
    purelib = run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path, env=env).stdout.strip()
    (Path(purelib) / "deps-of-the-test-runner.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    where = run(py, "-c", "import vgpu, vgpu.manager; from vgpu.data import demo_trace_path; "
                "print(vgpu.__file__); print(demo_trace_path())", cwd=tmp_path, env=env).stdout.split()
    assert all(p.startswith(str(venv)) for p in where), where

    sock, state = tmp_path / "run" / "vgpu.sock", tmp_path / "state"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    serve = subprocess.Popen([venv / "bin" / "vgpu", "serve", "--socket", sock, "--state-dir", state,
                              "--backend", "sim:h100-80gb", "--metrics-port", "0"],
                             cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=log)
    profiler: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 60
        while '"serving"' not in (tmp_path / "serve.log").read_text():
            assert serve.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        # the node as installed runs both units: the profiler streams (doctor checks that it does)
        profiler = subprocess.Popen([venv / "bin" / "vgpu", "profiler", "--backend", "sim:h100-80gb",
                                     "--manager", f"unix://{sock}", "--token-file", state / "tokens" / "profiler.token",
                                     "--inapp-dir", tmp_path / "inapp"],
                                    cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while '"profiler_connected"' not in (tmp_path / "serve.log").read_text():  # the daemon took its stream
            assert profiler.poll() is None and serve.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        doctor = subprocess.run([venv / "bin" / "vgpu", "doctor", "--backend", "sim:h100-80gb", "--socket", sock,
                                 "--state-dir", state], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "FAIL" not in doctor.stdout and "default.pt loads" in doctor.stdout and str(venv) in doctor.stdout
        size = run(venv / "bin" / "vgpu", "size", "--model-type", "resnet50", "--batch-size", "8", "--json",
                   cwd=tmp_path, env=env)
        assert '"fits": true' in size.stdout
    finally:
        for proc in (p for p in (profiler, serve) if p is not None):
            proc.terminate()
            proc.wait(30)
        log.close()


def test_the_stop_events_install_md_names_are_the_ones_the_daemon_writes() -> None:
    """docs/install.md's SIGTERM paragraph names log events; each must be one the code logs."""
    import re

    text = (ROOT / "docs" / "install.md").read_text()
    paragraph = text[text.index("(SIGTERM) logs"):].split("\n\n", 1)[0]
    events = set(re.findall(r"`([a-z][a-z_]+)`", paragraph)) - {"devices_restored", "before_mw", "after_mw", "failed_steps"}
    assert {"stopping", "stopped", "power_limit_restored", "device_restored", "restore_skipped"} <= events
    code = "\n".join(p.read_text() for d in ("vgpu", "allocator") for p in (ROOT / d).rglob("*.py"))
    for event in sorted(events):
        assert f'"{event}"' in code, f"install.md names {event!r}, which nothing logs"
