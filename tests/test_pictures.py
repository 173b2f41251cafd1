"""Pictures of forecast against use: `vgpu report` against a real daemon (PNG and HTML, the HTML
opened in headless Chromium), `bench/replay.py --plot`, `vgpu demo --plot`, and the drawing itself
(axes, series, a known point, OOM events and grant changes)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from matplotlib.image import imread

from tests.daemon_fixtures import ROOT, Env, Serve, wait_for
from tests.test_operator_views import cli, start_profiler
from vgpu import plots
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

GRANT_RGB = np.array([0x16, 0xA3, 0x4A]) / 255.0  # plots.COLOURS["granted"]
OOM_RGB = np.array([0xDC, 0x26, 0x26]) / 255.0


def _has_colour(image: np.ndarray, rgb: np.ndarray, tol: float = 0.06) -> bool:
    return bool((np.abs(image[..., :3] - rgb).max(axis=-1) < tol).any())


def _known_timeline() -> plots.Timeline:
    t = np.arange(6, dtype=np.float64)
    used = np.array([100, 100, 300, 300, 150, 150], dtype=np.float64)
    granted = np.array([math.nan, 200, 200, 400, 400, 200], dtype=np.float64)  # in force at t
    p50 = used * 1.0
    p90 = used * 1.1
    return plots.Timeline("app-x", t, used, p50, p90, granted, plots.marks_from_series(t, used, granted))


# --- the drawing ----------------------------------------------------------------------------------------
def test_marks_from_series_finds_grant_changes_and_oom_starts() -> None:
    tl = _known_timeline()
    kinds = [(m.t_s, m.kind) for m in tl.marks]
    assert kinds == [(1.0, "granted"), (2.0, "oom"), (3.0, "grow"), (5.0, "shrink")]


def test_figure_has_axes_series_and_a_known_point() -> None:
    tl = _known_timeline()
    fig = plots.figure([[tl, None]], title="t")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "memory (MiB)" and ax.get_xlabel() == "time (s)"
    assert ax.get_title(loc="left") == "app-x: 1 OOM event, 3 memory grant changes"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert {"used", "forecast P50", "forecast P90", "granted", "OOM event"} <= set(lines)
    used = lines["used"]
    assert (2.0, 300.0) in set(zip(used.get_xdata(), used.get_ydata(), strict=True))  # the known point
    assert list(lines["OOM event"].get_xdata()) == [2.0, 2.0]
    assert not fig.axes[1].axison  # the empty cell
    legend = fig.legends[0]
    assert {t.get_text() for t in legend.get_texts()} >= {"used", "forecast P90", "granted", "OOM event"}


def test_save_refuses_an_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="png"):
        plots.save(plots.figure([[_known_timeline()]], title="t"), tmp_path / "x.jpg", title="t")


def test_from_history_reads_the_rpc_columns() -> None:
    h = pb.AppHistory(app_id="a", device_id="g", t_unix_s=[100.0, 101.0], mem_used_mib=[1.0, 2.0],
                      mem_p50_mib=[1.0, 2.0], mem_p90_mib=[1.5, 2.5], mem_granted_mib=[3.0, 3.0],
                      events=[pb.HistoryEvent(t_unix_s=100.5, kind="resized", detail="4 -> 3 MiB", mem_granted_mib=3),
                              pb.HistoryEvent(t_unix_s=100.6, kind="resized", detail="3 -> 3 MiB", mem_granted_mib=3),
                              pb.HistoryEvent(t_unix_s=100.7, kind="resized", detail="SM 40 -> 23 %", mem_granted_mib=3),
                              pb.HistoryEvent(t_unix_s=100.8, kind="resized",
                                              detail="memory 3 -> 5 MiB, SM 23 -> 40 %", mem_granted_mib=5)])
    tl = plots.from_history(h, 100.0)
    assert list(tl.t_s) == [0.0, 1.0] and list(tl.p90_mib) == [1.5, 2.5]
    assert [(m.kind, m.t_s) for m in tl.marks] == [("shrink", 0.5), ("sm", pytest.approx(0.6)),
                                                   ("sm", pytest.approx(0.7)), ("grow", pytest.approx(0.8))]
    with pytest.raises(ValueError, match="used_mib"):
        plots.Timeline("a", np.zeros(2), np.zeros(3), np.zeros(2), np.zeros(2), np.zeros(2))


# --- vgpu report against a real daemon -----------------------------------------------------------------
def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_report_draws_an_app_and_a_gpu_from_the_daemon(env: Env, serves: list[Serve], tmp_path: Path) -> None:
    serves.append(Serve(env))
    device = json.loads(cli(env, "available", "--json").stdout)["devices"][0]["device_id"]
    prof = start_profiler(env, device)
    try:
        def drawable() -> bool:
            # what the reports below draw: two applications with forecasts and a few points of history,
            # bert-train's grant in force at two of them; waited for, not assumed after a fixed time
            apps = json.loads(cli(env, "apps", "--json").stdout)["apps"]
            if sum(1 for a in apps if a["forecast_mem_p90_mib"] is not None) < 2:  # null until a forecast
                return False
            with grpc.insecure_channel(f"unix:{env.sock}") as ch:
                hist = pb_grpc.AllocatorStub(ch).GetAppHistory(
                    pb.GetAppHistoryRequest(device_id=device, since_s=90), timeout=10)
            granted = [g for h in hist.apps if h.app_id == "bert-train" for g in h.mem_granted_mib if g > 0]
            return sum(1 for h in hist.apps if len(h.t_unix_s) >= 3) >= 2 and len(granted) >= 2

        wait_for("two applications' forecasts and history with a grant", drawable, timeout_s=60, poll_s=0.5)
    finally:
        prof.terminate()
        prof.wait(10)

    png = tmp_path / "app.png"
    out = cli(env, "report", "--app", "bert-train", "--since", "10m", "--out", str(png))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == str(png)
    assert out.stdout.splitlines()[1].startswith("1 application, ")
    image = imread(png)
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert _has_colour(image, GRANT_RGB)  # the grant line is drawn

    gpu = tmp_path / "gpu.png"
    out = cli(env, "report", "--device", "0", "--since", "90s", "--out", str(gpu))
    assert out.returncode == 0, out.stderr
    n = int(out.stdout.splitlines()[1].split()[0])
    assert n >= 2 and imread(gpu).shape[0] > image.shape[0]  # one panel per application

    page = tmp_path / "app.html"
    out = cli(env, "report", "--app", "bert-train", "--out", str(page))
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    assert "<svg" in text and "bert-train" in text and 'id="events"' in text

    missing = cli(env, "report", "--app", "nosuchapp", "--out", str(tmp_path / "x.png"))
    assert missing.returncode == 1 and "no history for application 'nosuchapp'" in missing.stderr
    bad = cli(env, "report", "--app", "bert-train", "--since", "soon", "--out", str(tmp_path / "x.png"))
    assert bad.returncode == 2 and "a duration like" in bad.stderr
    wrong = cli(env, "report", "--app", "bert-train", "--out", str(tmp_path / "x.jpg"))
    assert wrong.returncode == 2 and ".png" in wrong.stderr

    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium to open the HTML report in")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'chr'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert "<svg" in dom.stdout and "<h1>vgpu report: application bert-train" in dom.stdout
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1100,900", page.as_uri()],
                   capture_output=True, timeout=120, check=False)
    rendered = imread(shot)
    assert _has_colour(rendered, GRANT_RGB)  # the browser drew the picture, grant line included


# --- the replay and the demo ----------------------------------------------------------------------------
def test_replay_plot_draws_policy_beside_policy(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "bench/replay.py", "--trace", "vgpu/data/demo_trace.csv.gz", "--split", "all",
         "--max-apps", "2", "--forecaster", "vpa_percentile", "--json", "--plot", str(tmp_path / "plots"),
         "--plot-apps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)  # the JSON stays clean: the paths go to stderr
    (png,) = sorted((tmp_path / "plots").glob("*.png"))
    assert str(png) in out.stderr
    assert imread(png).shape[1] > 1500  # three panels a row


def test_replay_timeline_panels() -> None:
    from bench.replay import POLICIES, pack, prepare, replay
    from bench.replay_plot import timeline
    from vgpu.device.skus import get_sku
    from vgpu.manager.baselines import VpaPercentileForecaster
    from vgpu.traces import read_trace

    trace = read_trace(ROOT / "vgpu" / "data" / "demo_trace.csv.gz")
    apps, _ = prepare([trace.apps[n] for n in sorted(trace.apps)[:1]])
    apps = pack(apps, get_sku("h100-80gb"))
    data: dict[tuple[str, str], list[tuple[float, float, float, float, float]]] = {}
    replay(apps, get_sku("h100-80gb"), VpaPercentileForecaster(), timeline_out=data)
    app = apps[0].app_id
    assert {p for p, _ in data} == set(POLICIES)
    static = timeline("static", data[("static", app)])
    assert math.isnan(static.granted_mib[0]) and static.granted_mib[1] == pytest.approx(float(apps[0].mem.max()))
    assert [m.kind for m in static.marks] == ["granted"]  # a static grant never changes
    vpa = timeline("vpa", data[("vpa", app)])
    assert np.isfinite(vpa.p90_mib[5:]).all()  # the VPA estimator's percentile is drawn as its forecast
    assert list(vpa.used_mib[:3]) == [float(x) for x in apps[0].mem[:3]]


async def test_demo_plot_shows_every_app(tmp_path: Path) -> None:
    from tests.manager_fakes import EwmaMarginForecaster
    from vgpu.daemon.demo import plot_demo, run_demo
    from vgpu.data import demo_trace_path
    from vgpu.traces import read_trace

    result = await run_demo(seconds=4, trace=read_trace(demo_trace_path()), forecaster=EwmaMarginForecaster(),
                            forecaster_label="ewma")
    assert result.history and all(len(s.points) for s in result.history)
    path = plot_demo(result, str(tmp_path / "demo.png"), "h100-80gb")
    assert Path(path).is_file() and imread(path).shape[0] > 300


def test_demo_cli_prints_the_picture_path(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "vgpu.cli", "demo", "--seconds", "3", "--baseline", "--plot",
                          str(tmp_path / "d.png")], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert f"picture: {tmp_path / 'd.png'}" in out.stdout and (tmp_path / "d.png").is_file()
    bad = subprocess.run([sys.executable, "-m", "vgpu.cli", "demo", "--plot", "x.gif"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--plot x.gif: the picture must end in .png, .svg or .html" in bad.stderr


def test_the_grant_line_steps_where_a_change_happened_between_points() -> None:
    t = np.array([0.0, 1.0, 2.0])
    tl = plots.Timeline("a", t, np.full(3, 50.0), np.full(3, 50.0), np.full(3, 60.0), np.array([100.0, 100.0, 80.0]),
                        (plots.Mark(1.4, "shrink", "100 -> 80 MiB", 80.0),))
    st, sv = plots.grant_steps(tl)
    assert list(zip(st, sv, strict=True)) == [(0.0, 100.0), (1.0, 100.0), (1.4, 80.0), (2.0, 80.0)]
    ax = plots.figure([[tl]], title="t").axes[0]
    (grant,) = [line for line in ax.get_lines() if line.get_label() == "granted"]
    assert 1.4 in set(grant.get_xdata())
