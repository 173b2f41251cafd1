"""LLM-serving GPU series derived from real request traces through an engine model.

Inputs (all in `../shared/data/llm-serving-requests`, all permissive, see its SOURCE.md):
    azure-llm-2023/AzureLLMInferenceTrace_{conv,code}.csv.gz   CC-BY-4.0  arrivals, prompt and output tokens
    mooncake-fast25/conversation_trace.jsonl.gz                 Apache-2.0 arrivals, prompt and output tokens
    splitwise-perf/perf_model.csv.gz                            MIT        measured prefill/decode times, power

The engine model (one serving engine = one tensor-parallel group; the series is its first GPU, the others
show the same):

* **Requests as the trace gives them.** Arrival times and token counts are kept; time is shifted by the
  engine's start-up (and may be scaled by `time_scale`), never reshuffled. With `replicas` N > 1 a load
  balancer hands the requests out in turn (request i to replica i mod N), each replica one series.
* **Architecture -> memory.** Weights per GPU = parameters x 2 bytes (fp16) / TP. KV cache per token per
  GPU = layers x max(1, KV heads / TP) x head size x 2 (K and V) x 2 bytes; it lives in blocks of 16
  tokens (vLLM's default). Activations of a step = tokens in the step x 2 bytes x (4 x hidden +
  2 x intermediate / TP) (one layer's hidden states, residual, QKV and MLP shards: an order-of-magnitude
  assumption, not a measurement). A fixed `context_mib` (1,200 MiB: CUDA context, NCCL buffers, the
  framework) is an assumption too.
* **Continuous batching** (iteration-level scheduling as in Orca/vLLM v0): before each step the scheduler
  admits waiting requests in arrival order while the batch has fewer than `max_batch` (64, the largest
  batch the Splitwise table measured) running, the new prompts total at most `max_prefill_tokens` (8,192,
  the longest measured prompt; one longer prompt runs alone), and the KV cache has free blocks for the
  prompt plus one token. **Admission stops when the cache is full.** If any request was admitted, the
  step is a prefill of the admitted prompts (which also yields each one's first token); otherwise it is
  one decode step of every running request. A decode step that needs a block the cache does not have
  preempts the most recently admitted request (vLLM's recompute preemption: its blocks are freed, it goes
  back to the head of the queue, and its prompt plus the tokens generated so far are prefilled again).
  A request whose prompt can never fit the cache is dropped and counted.
* **Step times from the measured table** (rows of the chosen model, hardware and TP): prefill time of
  T tokens interpolates the table's batch-1 `prompt_time` over prompt size (linear beyond the largest,
  by the last two points; attention's quadratic term is ignored); a decode step of batch b at mean
  context c is the table's `token_time` at prompt 512 interpolated over batch size, times the batch-1
  ratio token_time(c) / token_time(512). Each step time is multiplied by a lognormal jitter (sigma
  `step_jitter`, 0.02), seeded.
* **Power from the measured table** as a fraction of the limit: a prefill step draws the median measured
  `peak_power` (capped at 1), a decode step the `average_power` at prompt 512 interpolated over batch
  size; rows where the table has 0 (not measured) are left out, and where a configuration has no power
  measurement (the H100 rows) `power_w` stays empty. Idle draw between steps is `idle_power_frac`
  (0.15 of the limit: a typical nvidia-smi idle reading on an A100, an assumption).
* **Start-up**, seeded: launch with only the CUDA context for U(3, 10) s, weights loaded at U(1, 2.5)
  GiB/s (memory ramps linearly, SM busy U(0, 5) %), a warm-up of U(2, 8) s (profiling run and CUDA-graph
  capture, SM busy 60 %, the activations of `max_prefill_tokens`), then the first request.

What is emitted every `period_s` (100 ms), as a serving engine's process shows it:
    sm_util_pct   share of the period during which a step ran, x 100 (what utilization.gpu reports)
    power_w       time-weighted mean of the steps' and idle draw, x the limit
    mem_used_mib  memory="dynamic": context + weights + activations of the running step + KV blocks in use;
                  memory="pool" (vLLM's preallocation, gpu_memory_utilization 0.9): context + weights +
                  the preallocated KV pool + the warm-up's activation reserve, flat once serving
    inapp_requests_running, inapp_requests_waiting, inapp_tokens_in_flight (prompt + generated tokens of the
    running requests), inapp_kv_used_mib, inapp_kv_total_mib (the pool; dynamic: what would fit),
    inapp_torch_allocated_mib (weights + KV in use + activations), inapp_torch_reserved_mib (mem_used_mib
    less the context)
Instantaneous values (memory, counters) are read at the end of each period.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from vgpu.traces import AppTrace

FloatArray = npt.NDArray[np.float64]
MIB = 1024 * 1024
GIB = 1024 * MIB
BLOCK_TOKENS = 16
GENERATOR = "vgpu.offline.synth_serving v1"


@dataclass(frozen=True)
class Architecture:
    """What the memory model needs of a model (values from its public config.json)."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


ARCHITECTURES = {
    # meta-llama/Llama-2-70b-hf config.json: 80 layers, 64 heads, 8 KV heads (GQA), hidden 8192, MLP 28672
    "llama2-70b": Architecture("llama2-70b", 68.98e9, 80, 8, 128, 8192, 28672),
    # bigscience/bloom config.json: 70 layers, 112 heads (no GQA), hidden 14336, MLP 4 x hidden
    "bloom-176b": Architecture("bloom-176b", 176.2e9, 70, 112, 128, 14336, 57344),
}
# memory and power limit per hardware of the Splitwise table (SXM parts; vgpu.device.skus for memory)
HARDWARE = {"a100-80gb": (81920.0, 400.0), "h100-80gb": (81559.0, 700.0), "h100-80gb-pcap": (81559.0, 700.0)}

SERVICES = {
    # service -> (request file under llm-serving-requests, default replicas at the defaults below)
    "azure-conv": ("azure-llm-2023/AzureLLMInferenceTrace_conv.csv.gz", 8),
    "azure-code": ("azure-llm-2023/AzureLLMInferenceTrace_code.csv.gz", 4),
    "mooncake": ("mooncake-fast25/conversation_trace.jsonl.gz", 16),
}
LICENSES = {"azure-llm-2023": "CC-BY-4.0", "mooncake-fast25": "Apache-2.0", "splitwise-perf": "MIT"}


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def load_requests(path: str | Path) -> list[Request]:
    """Azure CSV (TIMESTAMP, ContextTokens, GeneratedTokens) or Mooncake JSONL (timestamp ms,
    input_length, output_length), arrivals in seconds from the first; rows that do not parse, or
    with a negative count, are skipped. Sorted by arrival (stable: ties keep the file's order)."""
    path = Path(path)
    out: list[Request] = []
    with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8") as fh:
        if ".jsonl" in path.name:
            for line in fh:
                try:
                    row = json.loads(line)
                    req = Request(float(row["timestamp"]) / 1000.0, int(row["input_length"]), int(row["output_length"]))
                except (ValueError, KeyError, TypeError):
                    continue
                if req.prompt_tokens >= 0 and req.output_tokens >= 0 and math.isfinite(req.arrival_s):
                    out.append(req)
        else:
            for rec in csv.DictReader(fh):
                try:
                    ts = datetime.fromisoformat(rec["TIMESTAMP"].strip()[:26]).timestamp()
                    req = Request(ts, int(rec["ContextTokens"]), int(rec["GeneratedTokens"]))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
                if req.prompt_tokens >= 0 and req.output_tokens >= 0:
                    out.append(req)
    if not out:
        raise ValueError(f"{path}: no request could be read")
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s
    return [Request(r.arrival_s - t0, r.prompt_tokens, r.output_tokens) for r in out]


@dataclass(frozen=True)
class PerfModel:
    """Step times (ms) and power (fraction of the limit) of one (model, hardware, TP) of the table."""

    prefill_x: FloatArray  # prompt tokens
    prefill_ms: FloatArray
    decode_b: FloatArray  # batch size
    decode_ms: FloatArray
    ctx_x: FloatArray  # prompt size (context) at batch 1
    ctx_decode_ms: FloatArray
    prefill_power: float | None
    decode_power_b: FloatArray
    decode_power: FloatArray

    def prefill_time_s(self, tokens: int) -> float:
        return _interp_extrapolate(float(tokens), self.prefill_x, self.prefill_ms) / 1000.0

    def decode_time_s(self, batch: int, mean_ctx: float) -> float:
        base = float(np.interp(batch, self.decode_b, self.decode_ms))
        ratio = float(np.interp(mean_ctx, self.ctx_x, self.ctx_decode_ms)) / float(np.interp(512, self.ctx_x, self.ctx_decode_ms))
        return base * ratio / 1000.0

    def decode_power_frac(self, batch: int) -> float | None:
        if not len(self.decode_power):
            return None
        return float(np.interp(batch, self.decode_power_b, self.decode_power))


def _interp_extrapolate(x: float, xs: FloatArray, ys: FloatArray) -> float:
    if x <= xs[-1] or len(xs) < 2:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (x - xs[-1]))


def _mean_by(rows: Sequence[tuple[float, float]]) -> tuple[FloatArray, FloatArray]:
    groups: dict[float, list[float]] = {}
    for x, y in rows:
        groups.setdefault(x, []).append(y)
    xs = np.array(sorted(groups), dtype=np.float64)
    return xs, np.array([float(np.mean(groups[x])) for x in xs], dtype=np.float64)


def load_perf(path: str | Path, model: str, hardware: str, tp: int) -> PerfModel:
    """The Splitwise rows of (model, hardware, tensor_parallel) as a `PerfModel`; ValueError when the
    table has none."""
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8") as fh:
        for rec in csv.DictReader(fh):
            try:
                if rec["model"] == model and rec["hardware"] == hardware and int(rec["tensor_parallel"]) == tp:
                    rows.append({k: float(rec[k]) for k in ("prompt_size", "batch_size", "token_size", "peak_power",
                                                            "average_power", "prompt_time", "token_time")})
            except (ValueError, KeyError):
                continue
    if not rows:
        raise ValueError(f"{path}: no measured rows for {model} on {hardware} with TP {tp}")
    b1 = [r for r in rows if r["batch_size"] == 1]
    p512 = [r for r in rows if r["prompt_size"] == 512]
    prefill_x, prefill_ms = _mean_by([(r["prompt_size"], r["prompt_time"]) for r in b1])
    decode_b, decode_ms = _mean_by([(r["batch_size"], r["token_time"]) for r in p512])
    ctx_x, ctx_ms = _mean_by([(r["prompt_size"], r["token_time"]) for r in b1])
    peaks = [min(r["peak_power"], 1.0) for r in rows if r["peak_power"] > 0]
    dpb, dp = _mean_by([(r["batch_size"], r["average_power"]) for r in p512 if r["average_power"] > 0]) if any(
        r["average_power"] > 0 for r in p512) else (np.zeros(0), np.zeros(0))
    return PerfModel(prefill_x, prefill_ms, decode_b, decode_ms, ctx_x, ctx_ms,
                     float(np.median(peaks)) if peaks else None, dpb, dp)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "llama2-70b"
    hardware: str = "a100-80gb"
    tp: int = 2
    memory: Literal["dynamic", "pool"] = "dynamic"
    max_batch: int = 64
    max_prefill_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    context_mib: float = 1200.0
    idle_power_frac: float = 0.15
    step_jitter: float = 0.02
    period_s: float = 0.1

    def __post_init__(self) -> None:
        if self.model not in ARCHITECTURES:
            raise ValueError(f"unknown model {self.model!r}; known: {', '.join(ARCHITECTURES)}")
        if self.hardware not in HARDWARE:
            raise ValueError(f"unknown hardware {self.hardware!r}; known: {', '.join(HARDWARE)}")
        if self.memory not in ("dynamic", "pool"):
            raise ValueError(f"memory must be 'dynamic' or 'pool', got {self.memory!r}")
        if self.tp < 1 or self.max_batch < 1 or self.max_prefill_tokens < 1 or not self.period_s > 0:
            raise ValueError("tp, max_batch, max_prefill_tokens and period_s must be positive")

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.model]

    @property
    def mem_total_mib(self) -> float:
        return HARDWARE[self.hardware][0]

    @property
    def power_limit_w(self) -> float:
        return HARDWARE[self.hardware][1]

    @property
    def weights_mib(self) -> float:
        return self.arch.params * 2 / self.tp / MIB

    @property
    def kv_bytes_per_token(self) -> float:
        a = self.arch
        return a.layers * max(1.0, a.kv_heads / self.tp) * a.head_dim * 2 * 2

    def activation_mib(self, tokens: int) -> float:
        a = self.arch
        return tokens * 2 * (4 * a.hidden + 2 * a.intermediate / self.tp) / MIB

    @property
    def kv_pool_mib(self) -> float:
        """What the cache may hold: vLLM's rule (utilisation x capacity, less context, weights and the
        profiled activation peak), in both memory modes."""
        return (self.gpu_memory_utilization * self.mem_total_mib - self.context_mib - self.weights_mib
                - self.activation_mib(self.max_prefill_tokens))

    @property
    def kv_blocks(self) -> int:
        return int(self.kv_pool_mib * MIB // (self.kv_bytes_per_token * BLOCK_TOKENS))


@dataclass
class _Running:
    idx: int
    prompt: int
    generated: int
    output: int
    blocks: int

    @property
    def context(self) -> int:
        """Tokens in the cache (and prefilled again after a preemption)."""
        return self.prompt + self.generated


@dataclass
class EngineStats:
    requests: int = 0
    finished: int = 0
    dropped: int = 0
    preemptions: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    cache_full_steps: int = 0  # steps before which a waiting request did not fit the cache
    max_waiting: int = 0
    busy_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class _Steps:
    """Step log: start, end, power fraction, memory during the step and after it, counters at start."""

    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    power: list[float] = field(default_factory=list)
    kv_during: list[int] = field(default_factory=list)
    kv_after: list[int] = field(default_factory=list)
    act_mib: list[float] = field(default_factory=list)
    running_after: list[int] = field(default_factory=list)
    waiting_after: list[int] = field(default_factory=list)
    tokens_after: list[int] = field(default_factory=list)


def _blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def simulate_engine(
    requests: Sequence[Request], cfg: EngineConfig, perf: PerfModel, start_s: float, rng: np.random.Generator
) -> tuple[_Steps, EngineStats, FloatArray]:
    """Run the scheduler over `requests` (arrivals shifted by `start_s`). Returns the step log, the
    counts and the arrival times used."""
    arrivals = np.array([r.arrival_s for r in requests], dtype=np.float64) + start_s
    steps = _Steps()
    stats = EngineStats(requests=len(requests))
    total_blocks = cfg.kv_blocks
    free = total_blocks
    waiting: deque[_Running] = deque()
    running: list[_Running] = []
    nxt = 0
    t = start_s
    while nxt < len(requests) or waiting or running:
        while nxt < len(requests) and arrivals[nxt] <= t:
            r = requests[nxt]
            waiting.append(_Running(nxt, r.prompt_tokens, 0, max(r.output_tokens, 1), 0))
            nxt += 1
        if not waiting and not running:
            t = float(arrivals[nxt])
            continue
        admitted: list[_Running] = []
        prefill_tokens = 0
        while waiting and len(running) + len(admitted) < cfg.max_batch:
            req = waiting[0]
            need = _blocks_for(req.context + 1)
            if need > total_blocks:
                waiting.popleft()
                stats.dropped += 1
                continue
            if admitted and prefill_tokens + req.context > cfg.max_prefill_tokens:
                break
            if need > free:
                stats.cache_full_steps += 1
                break
            waiting.popleft()
            free -= need
            req.blocks = need
            prefill_tokens += req.context
            admitted.append(req)
        jitter = float(np.exp(rng.normal(0.0, cfg.step_jitter))) if cfg.step_jitter > 0 else 1.0
        kv_during = total_blocks - free
        if admitted:
            dur = perf.prefill_time_s(prefill_tokens) * jitter
            power = perf.prefill_power
            act = cfg.activation_mib(prefill_tokens)
            for req in admitted:
                req.generated += 1
            running.extend(admitted)
            stats.prefill_steps += 1
        else:
            # one decode step; grow each request by a token, preempting the newest when out of blocks
            k = 0
            while k < len(running):
                req = running[k]
                if _blocks_for(req.context + 1) > req.blocks:
                    while free == 0 and len(running) - 1 > k:
                        victim = running.pop()
                        free += victim.blocks
                        victim.blocks = 0
                        waiting.appendleft(victim)
                        stats.preemptions += 1
                    if free == 0:  # the request itself is the newest: it goes back
                        running.pop()
                        free += req.blocks
                        req.blocks = 0
                        waiting.appendleft(req)
                        stats.preemptions += 1
                        continue
                    free -= 1
                    req.blocks += 1
                k += 1
            kv_during = total_blocks - free
            b = len(running)
            mean_ctx = float(np.mean([r.context for r in running])) if running else 0.0
            dur = perf.decode_time_s(b, mean_ctx) * jitter
            power = perf.decode_power_frac(b)
            act = cfg.activation_mib(b)
            for req in running:
                req.generated += 1
            stats.decode_steps += 1
        for fin in running:
            if fin.generated >= fin.output:
                free += fin.blocks
                stats.finished += 1
        running = [x for x in running if x.generated < x.output]
        steps.start.append(t)
        steps.end.append(t + dur)
        steps.power.append(math.nan if power is None else power)
        steps.kv_during.append(kv_during)
        steps.kv_after.append(total_blocks - free)
        steps.act_mib.append(act)
        steps.running_after.append(len(running))
        steps.waiting_after.append(len(waiting))
        steps.tokens_after.append(sum(r.context for r in running))
        stats.max_waiting = max(stats.max_waiting, len(waiting) + int(np.searchsorted(arrivals, t + dur, side="right")) - nxt)
        stats.busy_s += dur
        t += dur
    return steps, stats, arrivals


def _cumulative(starts: FloatArray, ends: FloatArray, rate: FloatArray, at: FloatArray) -> FloatArray:
    """Integral up to each time of `at` of a function equal to `rate[i]` on [starts[i], ends[i]) and 0
    elsewhere (steps do not overlap)."""
    if not len(starts):
        return np.zeros(len(at))
    xs = np.empty(2 * len(starts))
    xs[0::2], xs[1::2] = starts, ends
    seg = rate * (ends - starts)
    cum = np.concatenate([[0.0], np.cumsum(seg)])
    ys = np.empty(2 * len(starts))
    ys[0::2], ys[1::2] = cum[:-1], cum[1:]
    return np.interp(at, xs, ys, left=0.0, right=float(cum[-1]))


def serve_series(
    app: str,
    requests: Sequence[Request],
    cfg: EngineConfig,
    perf: PerfModel,
    *,
    seed: int | Sequence[int],
    duration_s: float | None = None,
    gpu: str | None = None,
) -> tuple[AppTrace, EngineStats]:
    """One engine's series at `cfg.period_s`: start-up, then `requests`. `duration_s` (default: the
    last arrival + 60 s after start-up) bounds the series."""
    rng = np.random.default_rng(seed)
    launch_s = rng.uniform(3.0, 10.0)
    load_s = cfg.weights_mib / 1024 / rng.uniform(1.0, 2.5)
    warm_s = rng.uniform(2.0, 8.0)
    load_util = rng.uniform(0.0, 5.0)
    start_s = launch_s + load_s + warm_s
    if cfg.kv_blocks <= 0:
        raise ValueError(f"{cfg.model} with TP {cfg.tp} leaves no room for a KV cache on {cfg.hardware}")
    steps, stats, arrivals = simulate_engine(requests, cfg, perf, start_s, rng)
    end_s = start_s + (duration_s if duration_s is not None else (float(arrivals[-1]) - start_s if len(arrivals) else 0) + 60.0)
    n = int(math.floor(end_s / cfg.period_s))
    t = (np.arange(n, dtype=np.float64) + 1) * cfg.period_s  # sample at the end of each period
    lo = t - cfg.period_s
    starts, ends = np.asarray(steps.start), np.asarray(steps.end)
    power_frac = np.asarray(steps.power)
    busy = _cumulative(starts, ends, np.ones(len(starts)), t) - _cumulative(starts, ends, np.ones(len(starts)), lo)
    sm = np.clip(busy / cfg.period_s, 0.0, 1.0) * 100.0
    has_power = perf.prefill_power is not None and len(perf.decode_power) > 0  # measured for this configuration
    excess = np.nan_to_num(power_frac, nan=cfg.idle_power_frac) - cfg.idle_power_frac
    energy = _cumulative(starts, ends, excess, t) - _cumulative(starts, ends, excess, lo)
    power = (cfg.idle_power_frac + energy / cfg.period_s) * cfg.power_limit_w if has_power else np.full(n, np.nan)

    # instantaneous state at each sample time
    kv_block_mib = cfg.kv_bytes_per_token * BLOCK_TOKENS / MIB
    i = np.searchsorted(starts, t, side="right") - 1  # last step started at or before t
    in_step = (i >= 0) & (t < ends[np.maximum(i, 0)]) if len(starts) else np.zeros(n, dtype=bool)
    ii = np.maximum(i, 0)

    def pick(values: list[int] | list[float], default: float = 0.0) -> FloatArray:
        arr = np.asarray(values, dtype=np.float64) if values else np.zeros(1)
        return np.where(i >= 0, arr[ii] if values else default, default)

    kv_blocks_now = np.where(in_step, pick(steps.kv_during), pick(steps.kv_after))
    kv_mib = kv_blocks_now * kv_block_mib
    act = np.where(in_step, pick(steps.act_mib), 0.0)
    running = pick(steps.running_after)
    tokens = pick(steps.tokens_after)
    # waiting: the queue after the last step began, plus the arrivals since then
    started_at = np.where(i >= 0, starts[ii] if len(starts) else 0.0, 0.0)
    arrived_by_t = np.searchsorted(arrivals, t, side="right")
    arrived_by_start = np.searchsorted(arrivals, started_at, side="right")
    waiting = np.where(i >= 0, pick(steps.waiting_after) + (arrived_by_t - arrived_by_start), arrived_by_t)

    # start-up: context only, then the weights ramp, then warm-up
    weights = np.clip((t - launch_s) / load_s, 0.0, 1.0) * cfg.weights_mib
    warm = (t >= launch_s + load_s) & (t < start_s)
    act = np.where(warm, cfg.activation_mib(cfg.max_prefill_tokens), act)
    sm = np.where(t < launch_s + load_s, np.where(t >= launch_s, load_util, 0.0), np.where(warm, 60.0, sm))
    if has_power:
        power = np.where(t < start_s, np.where(warm, 0.6, cfg.idle_power_frac) * cfg.power_limit_w, power)
    allocated = weights + kv_mib + act
    if cfg.memory == "pool":
        pool = np.where(t >= launch_s + load_s, cfg.kv_pool_mib + cfg.activation_mib(cfg.max_prefill_tokens), 0.0)
        reserved = weights + pool
    else:
        reserved = allocated
    mem = cfg.context_mib + reserved
    serving = t >= start_s
    columns: dict[str, FloatArray] = {
        "mem_used_mib": mem,
        "sm_util_pct": sm,
        "mem_total_mib": np.full(n, cfg.mem_total_mib),
        "power_w": power,
        "power_limit_w": np.full(n, cfg.power_limit_w),
        "inapp_requests_running": np.where(serving, running, np.nan),
        "inapp_requests_waiting": np.where(serving, waiting, np.nan),
        "inapp_tokens_in_flight": np.where(serving, tokens, np.nan),
        "inapp_kv_used_mib": np.where(serving, kv_mib, np.nan),
        "inapp_kv_total_mib": np.where(serving, cfg.kv_blocks * kv_block_mib, np.nan),
        "inapp_torch_allocated_mib": allocated,
        "inapp_torch_reserved_mib": reserved,
    }
    if not has_power:
        del columns["power_w"]
    stats.extra = {"start_s": start_s, "launch_s": launch_s, "load_s": load_s, "warm_s": warm_s}
    return AppTrace(app, t, columns, gpu=gpu or f"{cfg.hardware}-tp{cfg.tp}"), stats


def cut_segments(trace: AppTrace, segment_s: float) -> list[AppTrace]:
    """`trace` cut into consecutive pieces of `segment_s` (the last may be shorter; pieces under
    30 s are dropped), named `<app>/seg<k>`; times stay on the engine's clock."""
    if segment_s <= 0:
        return [trace]
    k = np.floor((trace.t_s - trace.t_s[0]) / segment_s).astype(np.int64)
    out = []
    for seg in range(int(k.max()) + 1 if len(k) else 0):
        sel = k == seg
        if sel.sum() == 0 or float(trace.t_s[sel][-1] - trace.t_s[sel][0]) < 30.0:
            continue
        out.append(AppTrace(f"{trace.app}/seg{seg:02d}", trace.t_s[sel],
                            {c: v[sel] for c, v in trace.columns.items()}, gpu=trace.gpu))
    return out


def synthesize(
    data_dir: str | Path,
    service: str,
    cfg: EngineConfig,
    *,
    replicas: int | None = None,
    seed: int = 0,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    duration_s: float | None = None,
    segment_s: float = 0.0,
) -> tuple[list[AppTrace], dict[str, Any]]:
    """Series of every replica of `service`, and the metadata (provenance, configuration, counts)."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    if not time_scale > 0:
        raise ValueError("time_scale must be positive")
    data_dir = Path(data_dir)
    rel, default_replicas = SERVICES[service]
    n_rep = replicas if replicas is not None else default_replicas
    if n_rep < 1:
        raise ValueError("replicas must be at least 1")
    req_path = data_dir / rel
    perf_path = data_dir / "splitwise-perf/perf_model.csv.gz"
    requests = load_requests(req_path)
    if max_requests is not None:
        requests = requests[:max_requests]
    requests = [Request(r.arrival_s * time_scale, r.prompt_tokens, r.output_tokens) for r in requests]
    perf = load_perf(perf_path, cfg.model, cfg.hardware, cfg.tp)
    apps: list[AppTrace] = []
    per_replica = []
    for rep in range(n_rep):
        mine = requests[rep::n_rep]
        name = f"serving/{service}/{cfg.model}-tp{cfg.tp}-{cfg.memory}/r{rep:02d}"
        # one stream per (seed, service, replica): services do not share start-ups
        stream = [seed, list(SERVICES).index(service), rep]
        trace, stats = serve_series(name, mine, cfg, perf, seed=stream, duration_s=duration_s)
        apps += cut_segments(trace, segment_s)
        per_replica.append({"app": name, "requests": stats.requests, "finished": stats.finished,
                            "dropped": stats.dropped, "preemptions": stats.preemptions,
                            "cache_full_steps": stats.cache_full_steps, "max_waiting": stats.max_waiting,
                            "busy_share": round(stats.busy_s / max(float(trace.t_s[-1]) - stats.extra["start_s"], 1e-9), 4),
                            "start_s": round(stats.extra["start_s"], 3)})
    meta = {
        "derived": True,
        "generator": GENERATOR,
        "kind": "serving",
        "clock": "shared",  # every replica on the hour's one clock
        "service": service,
        "seed": seed,
        "inputs": [
            {"path": f"llm-serving-requests/{rel}", "license": LICENSES[rel.split("/")[0]]},
            {"path": "llm-serving-requests/splitwise-perf/perf_model.csv.gz", "license": "MIT"},
        ],
        "engine": {"model": cfg.model, "hardware": cfg.hardware, "tp": cfg.tp, "memory": cfg.memory,
                   "max_batch": cfg.max_batch, "max_prefill_tokens": cfg.max_prefill_tokens,
                   "kv_bytes_per_token_per_gpu": cfg.kv_bytes_per_token, "kv_pool_mib": round(cfg.kv_pool_mib, 1),
                   "weights_mib": round(cfg.weights_mib, 1), "context_mib": cfg.context_mib,
                   "idle_power_frac": cfg.idle_power_frac, "step_jitter": cfg.step_jitter, "period_s": cfg.period_s},
        "replicas": n_rep,
        "time_scale": time_scale,
        "max_requests": max_requests,
        "segment_s": segment_s,
        "per_replica": per_replica,
        "assumptions": "see vgpu/offline/synth_serving.py docstring",
    }
    return apps, meta
