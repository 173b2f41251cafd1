"""A departed application's per-application forecaster state goes with it: the manager tells a forecaster
that keeps such state (the served mixture, directly or behind a reloading wrapper) when it forgets an
application, so an id that comes back starts afresh; forecasters without state are left alone."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from allocator_fakes import FakeBackend, FakeClock, FakeDevice
from manager_fakes import EwmaMarginForecaster

from vgpu.allocator.core import Allocator
from vgpu.manager.core import Manager
from vgpu.manager.experts import MixtureConfig, MixtureForecaster, make_served
from vgpu.manager.forecast import HORIZONS_S, Forecast, Forecaster, ForgetsApps
from vgpu.manager.predictor import ReloadingForecaster
from vgpu.manager.window import WindowStore
from vgpu.traces import AppTrace
from vgpu.v1 import ingest_pb2
from vgpu.v1 import signature_pb2 as spb

GPU = "GPU-fake-0"
N = len(HORIZONS_S)


class Off:
    """A model that is always 3000 MiB over and 40 % under: the mixture learns to distrust it."""

    name = "model"

    def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
        out = []
        for h in histories:
            mem = float(h.column("mem_used_mib")[-1]) + 3000.0
            sm = max(0.0, float(h.column("sm_util_pct")[-1]) - 40.0)
            out.append(Forecast(HORIZONS_S, (mem,) * N, (mem + 500.0,) * N, (sm,) * N, (sm + 5.0,) * N, self.name))
        return out


def sig(app: str, seq: int, t: float, mem: float, sm: float) -> spb.BehavioralSignature:
    return spb.BehavioralSignature(
        app_id=app, pid=1, device_id=GPU, timestamp_s=t, seq=seq,
        device=spb.DeviceCounters(mem_total_mib=81559.0, power_mw=300_000, power_limit_mw=700_000),
        process=spb.ProcessCounters(gpu_mem_used_mib=mem, sm_util_pct=sm),
    )


def usage(k: int) -> tuple[float, float]:
    return 4000.0 + 400.0 * (k % 5), 30.0 + 20.0 * (k % 3)


def make(forecaster: Forecaster) -> tuple[Manager, FakeClock]:
    clock = FakeClock()
    alloc = Allocator(FakeBackend([FakeDevice(GPU)]), clock=clock)
    return Manager(alloc, forecaster, clock=clock, min_samples=1, windows=WindowStore(idle_evict_s=5)), clock


def run(mgr: Manager, clock: FakeClock, app: str, seconds: int, t0: float, seq0: int = 0) -> list[ingest_pb2.Decision]:
    """`seconds` of `app` at 2 samples a second, one batch each; the decisions of the replies."""
    decisions = []
    for i in range(2 * seconds):
        k = i // 2
        mem, sm = usage(k)
        reply = mgr.ingest(ingest_pb2.SignatureBatch(profiler_id="p", tick=seq0 + i + 1, sent_at_s=1.0,
                                                     signatures=[sig(app, seq0 + i + 1, t0 + i / 2, mem, sm)]))
        decisions += list(reply.decisions)
        clock.advance(0.5)
    return decisions


def prior_weights(mix: MixtureForecaster) -> np.ndarray:
    return np.broadcast_to(mix.prior, (N, len(mix.expert_names)))


@pytest.mark.parametrize("wrapped", [False, True], ids=["mixture", "behind-a-reloading-forecaster"])
def test_a_departed_app_that_comes_back_starts_from_the_prior(wrapped: bool, tmp_path: Path) -> None:
    # without the node prior (a new application's P90 offset and scale from the node's other streams,
    # tested in tests/test_experts.py), so an application that comes back is exactly a fresh mixture's
    no_node_prior = MixtureConfig(node_prior_decay=0.0)
    mix = make_served(Off(), no_node_prior, local=True)
    served: Forecaster = mix
    if wrapped:  # the mixture behind the daemon's reloading wrapper: the manager's forget must reach it
        served = ReloadingForecaster(tmp_path / "none.pt", check_interval_s=math.inf, loader=lambda _: mix,
                                     background=False)
    mgr, clock = make(served)
    run(mgr, clock, "a", 60, t0=100.0)
    learnt = mix.weights("a")
    assert learnt is not None
    model = mix.expert_names.index("model")
    assert (learnt["mem_used_mib"][:, model] < 0.5 * mix.prior[model]).all()  # it learnt to distrust the model
    clock.advance(10.0)  # silent past the windows' idle time: the next batch evicts it
    run(mgr, clock, "b", 1, t0=500.0)
    assert mgr.stats.evicted == 1 and "a" not in mgr.windows
    assert mix.weights("a") is None  # without the manager's forget, the departed app's state stays
    # the id comes back: its first decision is a fresh mixture's on the same window
    decisions = run(mgr, clock, "a", 1, t0=1000.0, seq0=500)
    back = mix.weights("a")
    assert back is not None
    np.testing.assert_allclose(back["mem_used_mib"], prior_weights(mix))
    first = mgr.windows.trace("a")
    first = AppTrace("a", first.t_s[:1], {c: v[:1] for c, v in first.columns.items()}, gpu=first.gpu)
    fresh = make_served(Off(), no_node_prior, local=True).forecast_batch([first])[0]
    # the first decision (a second may follow within the second as the app takes its forecast phase)
    assert decisions and {d.app_id for d in decisions} == {"a"}
    got = decisions[0]
    want_p90 = dict(zip(fresh.horizons_s, fresh.mem_p90_mib, strict=True))
    for h in got.forecasts:
        assert h.mem_p90_mib == pytest.approx(want_p90[h.horizon_s])


def test_forecasters_without_state_are_left_alone() -> None:
    assert isinstance(make_served(None), ForgetsApps)
    assert not isinstance(EwmaMarginForecaster(), ForgetsApps)
    mgr, clock = make(EwmaMarginForecaster())
    run(mgr, clock, "a", 3, t0=100.0)
    clock.advance(10.0)
    run(mgr, clock, "b", 1, t0=200.0)  # the eviction calls nothing on a forecaster without `forget`
    assert mgr.stats.evicted == 1


def test_a_forget_during_a_forecast_waits_for_the_next_call_without_blocking() -> None:
    entered, release = threading.Event(), threading.Event()

    class Slow(Off):
        def forecast_batch(self, histories: Sequence[AppTrace]) -> list[Forecast]:
            entered.set()
            assert release.wait(10.0)
            return super().forecast_batch(histories)

    mix = make_served(Slow())
    t = np.arange(20.0)
    hist = AppTrace("a", t, {"mem_used_mib": np.full(20, 1000.0), "sm_util_pct": np.full(20, 50.0)})
    release.set()
    mix.forecast_batch([hist])
    release.clear()
    worker = threading.Thread(target=mix.forecast_batch, args=([AppTrace("a", t + 1, dict(hist.columns))],))
    worker.start()
    assert entered.wait(10.0)
    mix.forget("a")  # the manager's loop thread: must not wait for the forecast
    assert mix.weights("a") is not None  # the running step's row is not taken from under it
    release.set()
    worker.join(10.0)
    assert mix.weights("a") is not None
    mix.forecast_batch([AppTrace("b", t, dict(hist.columns))])  # the next call drops it first
    assert mix.weights("a") is None and mix.weights("b") is not None
