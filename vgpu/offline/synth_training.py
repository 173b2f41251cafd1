"""Training-job GPU series composed from measured per-configuration profiles.

Profiles (one per measured configuration; all permissive, see each folder's SOURCE.md):
    migperf-a100-mig  (MIT)        train/finetune result tables: per (model, batch, MIG slice) the step
                                   latency, mean GRACT and mean FB used over a 120 s run
    miso-a100-mig     (MIT)        full A100-40GB: memory, utilization.gpu and power per (model, batch);
                                   step time of the same configuration on the 7g.40gb slice
    gpumemnet-mlp     (CC-BY-4.0)  3,000 MLP configurations: peak memory and mean DCGM utilisation
Supporting measurements, used as distributions:
    dl-throughput-profiles-pollux-gavel/pollux_traces (Apache-2.0)  single-GPU step times: the step time
        of a GPUMemNet profile (which has none) is drawn from them
    zeus-power-limit (Apache-2.0)   training power as a share of the power limit (the rows at each GPU's
        highest limit): drawn for profiles without a power measurement
    alibaba-pai-extras/minibatch-time (CC-BY-4.0)  normalised per-iteration times of real jobs: a worker's
        sequence, divided by its median, multiplies the steady step time (iteration-to-iteration
        variation and stragglers as measured)

A job is a sequence of phases, each sampled every `period_s` (100 ms); every random choice comes from
one `numpy.random.Generator` seeded per job. Distributions (U = uniform, LN = lognormal with the median
and sigma given, Exp = exponential with the mean given, Poisson process with the rate given):
1. **Launch**: the CUDA context appears, memory = context U(300, 600) MiB, SM 0 %, for U(2, 15) s.
2. **Model load**: memory ramps linearly to context + weights (weights = U(0.05, 0.25) of the profile's
   peak above the context) over U(2, 20) s; SM U(0, 5) %.
3. **First iterations** (the memory ramp): the first step takes U(3, 20) x the step time (cuDNN autotune,
   lazy initialisation); after it memory reaches U(0.70, 0.90) of the way to the peak, after the second
   (optimizer state) U(0.92, 0.98), and the peak after U(3, 20) iterations, linearly.
4. **Steady iterations**: step time = the profile's x the PAI multiplier sequence x LN(1, 0.03); SM busy
   per period = the profile's mean utilisation x LN(1, 0.03), clipped to 0-100; memory flat at the peak.
5. **Data-loader stalls**: a Poisson process with rate 1 / U(30, 300) s; each stall lasts Exp(2 s) with
   SM U(0, 20) % and memory unchanged.
6. **Evaluation** every U(60, 300) s of training, lasting U(5, 30) s: SM = U(0.5, 0.9) x the training
   utilisation; the first evaluation raises memory by U(0, 8) % of the activation share (peak less
   context and weights) and it stays there (the caching allocator keeps what it reserved).
7. **Checkpoint** after every U(2, 4)-th evaluation, U(2, 15) s: SM U(0, 5) %.
8. **Teardown** after U(120, 900) s of training: SM 0 % with memory held for U(1, 5) s, then memory 0
   for U(2, 5) s (the process has exited; the device view).
In-app counters while the process lives: `inapp_torch_reserved_mib` = memory less the context (the caching
allocator's reserve, which NVML shows), `inapp_step` = iterations finished.
Power = idle + (training power - idle) x SM / training SM, where idle is 0.15 of the limit (an
assumption: a typical nvidia-smi idle reading) and training power is the profile's measurement, else
the Zeus share x the limit. Memory never exceeds the slice's capacity (a profile whose peak would is
capped at the capacity less 1 %).
"""

from __future__ import annotations

import csv
import gzip
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from vgpu.offline.convert import MIG_SLICE_MIB
from vgpu.traces import AppTrace

FloatArray = npt.NDArray[np.float64]
GENERATOR = "vgpu.offline.synth_training v1"
IDLE_POWER_FRAC = 0.15
_SLICE_OF_GB_40 = {"5": "1g.5gb", "10": "2g.10gb", "20": "3g.20gb", "40": "7g.40gb"}
_POWER_LIMIT_W = {"a100-40gb": 400.0, "a100-80gb": 400.0}


@dataclass(frozen=True)
class Profile:
    """One measured configuration."""

    source: str  # dataset folder
    license: str
    name: str  # model/batch[/slice]
    gpu: str
    mem_total_mib: float
    peak_mem_mib: float
    sm_util_pct: float
    step_s: float | None  # None: drawn from the Pollux step times
    power_w: float | None  # None: Zeus share x the limit
    power_limit_w: float


def _read_csv(path: Path) -> list[dict[str, str]]:
    opener = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")
    with opener as fh:
        return list(csv.DictReader(fh))


def _num(row: dict[str, str], key: str) -> float | None:
    try:
        v = float(row[key])
    except (KeyError, TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def migperf_profiles(data: Path) -> list[Profile]:
    """Train and finetune runs of the MIGPerf result tables (failed runs, latency 0, left out)."""
    root = data / "migperf-a100-mig/data"
    out: list[Profile] = []
    files = sorted(root.glob("A100-80g/train/*/integrated_result*.csv")) + sorted(root.glob("A100-40g/finetune_*/*_finetune.csv"))
    for path in files:
        for row in _read_csv(path):
            lat, gract, fb = _num(row, "latency"), _num(row, "gract_mean"), _num(row, "fb_used_mean")
            if not lat or not gract or not fb:
                continue
            slice_ = row.get("mig_profile") or _SLICE_OF_GB_40.get(str(row.get("mig", "")).split(".")[0], "")
            if slice_ not in MIG_SLICE_MIB:
                continue
            seq = f"-seq{row['seq_length']}" if row.get("seq_length") else ""
            out.append(Profile("migperf-a100-mig", "MIT", f"{row['model_name']}/bs{row['batch_size']}{seq}/{slice_}",
                               slice_, MIG_SLICE_MIB[slice_], fb, 100.0 * gract, lat / 1000.0, None, 400.0))
    return _dedupe(out)


def miso_profiles(data: Path) -> list[Profile]:
    """Full A100-40GB measurements joined with the 7g.40gb step time of the same (model, batch)."""
    root = data / "miso-a100-mig"
    steps = {(r["model"], r["batch_size"]): _num(r, "iter_time_median_s")
             for r in _read_csv(root / "derived_mig_iteration_time_summary.csv") if r["mig_slice"] == "7g.40gb"}
    out = []
    for r in _read_csv(root / "derived_full_a100_util_memory_power_by_model_batch.csv"):
        mem, util, power = _num(r, "gpu_memory_used_MiB"), _num(r, "utilization_gpu_pct"), _num(r, "power_draw_W")
        step = steps.get((r["model"], r["batch_size"]))
        if not mem or util is None or not step:
            continue
        out.append(Profile("miso-a100-mig", "MIT", f"{r['model']}/bs{r['batch_size']}", "a100-40gb", 40960.0,
                           mem, util, step, power, 400.0))
    return out


def gpumemnet_profiles(data: Path, limit: int = 200) -> list[Profile]:
    """The first `limit` rows of mlp_data_step2 (file order, deterministic)."""
    out: list[Profile] = []
    for i, r in enumerate(_read_csv(data / "gpumemnet-mlp/mlp_data_step2.csv")):
        if len(out) >= limit:
            break
        mem, util = _num(r, "Max GPU Memory (MiB)"), _num(r, "Avg GPUTL")
        if not mem or util is None:
            continue
        out.append(Profile("gpumemnet-mlp", "CC-BY-4.0", f"mlp{i:04d}/bs{r.get('Batch Size', '?')}", "gpu-40gb",
                           40960.0, mem, util, None, None, 400.0))
    return out


def _dedupe(profiles: list[Profile]) -> list[Profile]:
    seen: dict[str, Profile] = {}
    for p in profiles:
        seen.setdefault(p.name, p)
    return list(seen.values())


def pollux_step_times(data: Path) -> FloatArray:
    """Single-GPU (placement "1") step times of every Pollux model, seconds."""
    out = []
    for path in sorted((data / "dl-throughput-profiles-pollux-gavel/pollux_traces").glob("*/placements.csv")):
        for r in _read_csv(path):
            v = _num(r, "step_time")
            if r.get("placement") == "1" and v and v > 0:
                out.append(v)
    return np.asarray(out, dtype=np.float64)


def zeus_power_shares(data: Path) -> FloatArray:
    """average_power / power_limit of every row at its GPU's highest power limit."""
    out = []
    for path in sorted((data / "zeus-power-limit").glob("summary_power_*.csv")):
        rows = _read_csv(path)
        top = max((_num(r, "power_limit") or 0.0) for r in rows)
        for r in rows:
            pl, p = _num(r, "power_limit"), _num(r, "average_power")
            if pl == top and p and pl:
                out.append(min(p / pl, 1.0))
    return np.asarray(out, dtype=np.float64)


def pai_multipliers(data: Path) -> list[FloatArray]:
    """Per (job, worker): batch_time_norm in iteration order divided by its median."""
    out = []
    for path in sorted((data / "alibaba-pai-extras/minibatch-time").glob("job_*_norm.csv.gz")):
        by_worker: dict[str, list[tuple[float, float]]] = {}
        for r in _read_csv(path):
            t, v = _num(r, "time"), _num(r, "batch_time_norm")
            if t is not None and v and v > 0:
                by_worker.setdefault(r["worker"], []).append((t, v))
        for w in sorted(by_worker):
            seq = np.array([v for _, v in sorted(by_worker[w])], dtype=np.float64)
            if len(seq) >= 50:
                out.append(seq / float(np.median(seq)))
    return out


@dataclass(frozen=True)
class Catalogue:
    profiles: list[Profile]
    step_times_s: FloatArray
    power_shares: FloatArray
    multipliers: list[FloatArray]

    @classmethod
    def load(cls, data_dir: str | Path, sources: Sequence[str] = ("migperf", "miso", "gpumemnet")) -> Catalogue:
        data = Path(data_dir)
        loaders = {"migperf": migperf_profiles, "miso": miso_profiles, "gpumemnet": gpumemnet_profiles}
        profiles: list[Profile] = []
        for s in sources:
            if s not in loaders:
                raise ValueError(f"unknown profile source {s!r}; known: {', '.join(loaders)}")
            profiles += loaders[s](data)
        if not profiles:
            raise ValueError(f"{data}: no profile could be read")
        steps, shares, mults = pollux_step_times(data), zeus_power_shares(data), pai_multipliers(data)
        if not len(steps) or not len(shares) or not mults:
            raise ValueError(f"{data}: Pollux step times, Zeus power or PAI mini-batch times missing")
        return cls(profiles, steps, shares, mults)


class _Series:
    """Accumulates 100 ms samples."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.t = 0.0
        self.mem: list[float] = []
        self.sm: list[float] = []
        self.step: list[float] = []
        self.iters: list[float] = []  # iterations completed by the end of each sample
        self._iters_total = 0.0

    def emit(self, seconds: float, mem: float, sm: float, step: float = math.nan, iters: float = 0.0) -> None:
        """`seconds` (rounded to whole periods) at `mem` and `sm`, during which `iters` iterations
        complete, evenly."""
        n = max(int(round(seconds / self.period_s)), 1)
        self.mem += [mem] * n
        self.sm += [sm] * n
        self.step += [step] * n
        self.iters += [self._iters_total + iters * (i + 1) / n for i in range(n)]
        self._iters_total += iters
        self.t += n * self.period_s

    def emit_ramp(self, seconds: float, mem0: float, mem1: float, sm: float) -> None:
        n = max(int(round(seconds / self.period_s)), 1)
        self.mem += list(np.linspace(mem0, mem1, n + 1)[1:])
        self.sm += [sm] * n
        self.step += [math.nan] * n
        self.iters += [self._iters_total] * n
        self.t += n * self.period_s


def compose_job(app: str, profile: Profile, cat: Catalogue, seed: int, period_s: float = 0.1) -> tuple[AppTrace, dict[str, Any]]:
    """One job's series; see the module docstring for the phases and their distributions."""
    rng = np.random.default_rng(seed)
    cap = profile.mem_total_mib * 0.99
    ctx = rng.uniform(300, 600)
    peak = min(max(profile.peak_mem_mib, ctx + 64), cap)
    weights = rng.uniform(0.05, 0.25) * (peak - ctx)
    step_s = profile.step_s if profile.step_s else float(rng.choice(cat.step_times_s))
    util = float(np.clip(profile.sm_util_pct, 1.0, 100.0))
    limit = profile.power_limit_w
    train_power = profile.power_w if profile.power_w else float(rng.choice(cat.power_shares)) * limit
    mults = cat.multipliers[int(rng.integers(len(cat.multipliers)))]
    m0 = int(rng.integers(len(mults)))

    s = _Series(period_s)
    s.emit(rng.uniform(2, 15), ctx, 0.0)
    s.emit_ramp(rng.uniform(2, 20), ctx, ctx + weights, rng.uniform(0, 5))
    base = ctx + weights
    ramp_iters = int(rng.integers(3, 21))
    after1 = base + rng.uniform(0.70, 0.90) * (peak - base)
    after2 = base + rng.uniform(0.92, 0.98) * (peak - base)
    # first iterations: memory per iteration, in 100 ms samples; a step shorter than a period is
    # accumulated so the series advances by whole periods
    first = step_s * rng.uniform(3, 20)
    s.emit(first, after1, util, iters=1)
    mem = after2
    it = 2
    clock = 0.0
    pending = 0
    while it < ramp_iters:
        clock += step_s
        pending += 1
        mem = after2 + (peak - after2) * (it - 1) / max(ramp_iters - 2, 1)
        if clock >= period_s:
            s.emit(clock, min(mem, peak), util, iters=pending)
            clock, pending = 0.0, 0
        it += 1
    mem = peak
    train_s = rng.uniform(120, 900)
    eval_every = rng.uniform(60, 300)
    ckpt_every = int(rng.integers(2, 5))
    stall_rate = 1.0 / rng.uniform(30, 300)
    eval_extra = rng.uniform(0, 0.08) * (peak - base)
    evals = 0
    trained = 0.0
    next_eval = eval_every
    next_stall = rng.exponential(1.0 / stall_rate)
    k = 0
    while trained < train_s:
        # one period of steady training: steps in it follow the PAI multipliers
        mult = float(mults[(m0 + k) % len(mults)]) * float(np.exp(rng.normal(0, 0.03)))
        k += 1
        sm = float(np.clip(util * np.exp(rng.normal(0, 0.03)), 0, 100))
        # a straggling iteration (multiplier > 1) leaves the GPU idle for part of the period
        sm = float(np.clip(sm / max(mult, 1.0), 0, 100))
        s.emit(period_s, mem, sm, step_s * mult, iters=period_s / (step_s * mult))
        trained += period_s
        if trained >= next_stall:
            s.emit(rng.exponential(2.0), mem, rng.uniform(0, 20))
            next_stall = trained + rng.exponential(1.0 / stall_rate)
        if trained >= next_eval:
            if evals == 0:
                mem = min(mem + eval_extra, cap)
            s.emit(rng.uniform(5, 30), mem, util * rng.uniform(0.5, 0.9))
            evals += 1
            if evals % ckpt_every == 0:
                s.emit(rng.uniform(2, 15), mem, rng.uniform(0, 5))
            next_eval = trained + eval_every
    s.emit(rng.uniform(1, 5), mem, 0.0)
    s.emit(rng.uniform(2, 5), 0.0, 0.0)

    n = len(s.mem)
    t = np.arange(n, dtype=np.float64) * period_s
    sm_arr = np.asarray(s.sm)
    idle_w = IDLE_POWER_FRAC * limit
    power = idle_w + (max(train_power, idle_w) - idle_w) * np.clip(sm_arr / util, 0, 1.5)
    power = np.minimum(power, limit)
    columns = {
        "mem_used_mib": np.asarray(s.mem),
        "sm_util_pct": sm_arr,
        "mem_total_mib": np.full(n, profile.mem_total_mib),
        "power_w": power,
        "power_limit_w": np.full(n, limit),
    }
    # in-app counters while the process lives: the caching allocator's reserve is what NVML shows
    # less the CUDA context; the step counter counts finished iterations
    alive = np.asarray(s.mem) > 0
    columns["inapp_torch_reserved_mib"] = np.where(alive, np.maximum(np.asarray(s.mem) - ctx, 0.0), np.nan)
    columns["inapp_step"] = np.where(alive, np.floor(np.asarray(s.iters) + 1e-9), np.nan)
    facts = {"app": app, "profile": profile.name, "source": profile.source, "seed": seed,
             "peak_mem_mib": round(peak, 1), "step_s": round(step_s, 5), "train_s": round(train_s, 1),
             "evals": evals}
    return AppTrace(app, t, columns, gpu=profile.gpu), facts


def synthesize(
    data_dir: str | Path,
    jobs: int,
    *,
    seed: int = 0,
    sources: Sequence[str] = ("migperf", "miso", "gpumemnet"),
    period_s: float = 0.1,
) -> tuple[list[AppTrace], dict[str, Any]]:
    """`jobs` jobs, each on a profile drawn uniformly from the catalogue (per source first, so the
    200 GPUMemNet MLPs do not crowd out the others), and the metadata."""
    if jobs < 1:
        raise ValueError("jobs must be at least 1")
    cat = Catalogue.load(data_dir, sources)
    rng = np.random.default_rng(seed)
    by_source: dict[str, list[Profile]] = {}
    for p in cat.profiles:
        by_source.setdefault(p.source, []).append(p)
    names = sorted(by_source)
    apps, facts = [], []
    for j in range(jobs):
        src = names[int(rng.integers(len(names)))]
        prof = by_source[src][int(rng.integers(len(by_source[src])))]
        app = f"training/{src}/{prof.name}/job{j:03d}"
        trace, f = compose_job(app, prof, cat, seed=seed * 100_000 + j, period_s=period_s)
        apps.append(trace)
        facts.append(f)
    used = sorted({p.source for p in cat.profiles})
    licences = {"migperf-a100-mig": "MIT", "miso-a100-mig": "MIT", "gpumemnet-mlp": "CC-BY-4.0"}
    meta = {
        "derived": True,
        "generator": GENERATOR,
        "kind": "training",
        "clock": "per-app",  # each job from its own launch
        "seed": seed,
        "inputs": [{"path": u, "license": licences[u]} for u in used] + [
            {"path": "dl-throughput-profiles-pollux-gavel/pollux_traces/*/placements.csv", "license": "Apache-2.0"},
            {"path": "zeus-power-limit/summary_power_*.csv", "license": "Apache-2.0"},
            {"path": "alibaba-pai-extras/minibatch-time/job_*_norm.csv.gz", "license": "CC-BY-4.0"},
        ],
        "jobs": facts,
        "assumptions": "see vgpu/offline/synth_training.py docstring",
    }
    return apps, meta
