"""Cold-start sizing: a job's first grant from its configuration, before it has any history.

The model is the winner of the comparison of bench/paper_table.py on memory (RandomForest, by MSE
and R2; see docs/coldstart.md), trained on the permitted job profiles only (MIGPerf MIT, MISO MIT, GPUMemNet
CC-BY-4.0; never Lucid). It ships as a small artefact, `manager/models/coldstart_randomforest.pt`
(plain tensors and a JSON metadata string, loaded with `torch.load(weights_only=True)`: no pickle
code, no sklearn needed at run time), because the node running the daemon has no ../shared/data to
train from. Rebuild it with

    python -m vgpu.manager.coldstart train --data ../shared/data

What the forest learns for memory (metadata "mem_target"): "log_ratio_to_physics" (shipped), the log
of the measured peak over the physical estimate (vgpu.jobs.physics_estimate: weights, gradients,
optimizer state, activations that grow with the batch and the input, context), a size then being
that estimate times the learned ratio; or "mem_mib", the peak itself (the earlier sizer's target,
still read from older artefacts). A forest predicts a constant outside the points it was fit on and
averages neighbouring rows inside them, so a forest on the peak sizes a job's largest batches like
its smaller ones; the ratio keeps the batch's scaling from the physics and learns only the correction.

The margin comes from the model's measured error on the training part alone: the 95th percentile of
the absolute relative error of peak memory over CV_FOLDS-fold cross-validated predictions of the 70 %
training part of the 70/30 split (per model family where that part holds at least
MIN_FAMILY_TEST_ROWS of it, else over all rows; a family the model never saw gets the largest of
them). The 30 % test part is held out from the model and the margin alike: `heldout_evaluation`
sizes each of its jobs through `ColdStartSizer.size` (metadata "heldout": error, the share of jobs
whose grant is under their measured peak, the slack over it, by batch size). The shipped model is
then refit on all rows with that margin.

Hand-over: `choose_source` says whether a grant comes from the request, the cold-start sizer, or the
time-series forecaster (once the application has enough history).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from vgpu.allocator.errors import NotSupported, Unavailable
from vgpu.allocator.policy.base import Sizer, Sizing
from vgpu.jobs import (
    PhysicsEstimate,
    known_model,
    physics_estimate,
    unknown_model_note,
)
from vgpu.manager.jobprofiles import (
    ENCODING_VERSION,
    FAMILIES,
    FEATURE_NAMES,
    PERMITTED_SOURCES,
    InvalidJobConfig,
    JobConfig,
    JobProfile,
    encode,
    encode_profiles,
    load_permitted,
    profiles_summary,
)
from vgpu.manager.regressors import regression_metrics, split_indices

DEFAULT_ARTEFACT = Path(__file__).resolve().parent / "models" / "coldstart_randomforest.pt"
DEFAULT_CAPACITY_MIB = 40960.0  # a whole A100-40GB, where the caller does not say
MIN_FAMILY_TEST_ROWS = 10
MARGIN_QUANTILE = 0.95  # of the absolute relative memory error
SM_MARGIN_QUANTILE = 0.9  # of the absolute utilization error (points)
MIN_HISTORY_S = 10.0
MODEL_NAME = "RandomForest"
# The target, min_samples_leaf and margin quantile were chosen by nested 5-fold cross-validation on
# the training part only (docs/coldstart.md); the earlier sizer learned the peak ("mem_mib") with
# min_samples_leaf 2 and a 0.9 quantile.
RF_PARAMS: dict[str, Any] = {"n_estimators": 32, "min_samples_leaf": 1}
# The utilization forest keeps the earlier min_samples_leaf: the selection above was about memory.
UTIL_MIN_SAMPLES_LEAF = 2
MEM_TARGETS: tuple[str, ...] = ("log_ratio_to_physics", "mem_mib")
MEM_TARGET = "log_ratio_to_physics"
CV_FOLDS = 5
# Batch-size buckets of the held-out report (inclusive bounds).
BATCH_BUCKETS: tuple[tuple[int, int], ...] = ((1, 16), (17, 64), (65, 128), (129, 1 << 30))


# --------------------------------------------------------------------------------------------
# Hand-over between the request, the cold-start sizer and the forecaster (pure).


def choose_source(
    has_history_s: float,
    *,
    requested_memory_mib: float = 0.0,
    has_job: bool = False,
    min_history_s: float = MIN_HISTORY_S,
) -> str:
    """Where an application's memory grant should come from: "forecast" once it has at least
    `min_history_s` seconds of samples (the time-series forecaster takes over), else "request" when
    it asked for an amount, else "cold_start" when it described its job, else "request" (nothing
    better to go on)."""
    for name, value in (("has_history_s", has_history_s), ("requested_memory_mib", requested_memory_mib), ("min_history_s", min_history_s)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if has_history_s >= min_history_s:
        return "forecast"
    if requested_memory_mib > 0:
        return "request"
    return "cold_start" if has_job else "request"


# --------------------------------------------------------------------------------------------
# Trees as plain arrays (numpy inference, identical to sklearn's).


@dataclass(frozen=True)
class TreeEnsemble:
    """Regression trees as flat arrays, in sklearn's depth-first node order (an inner node's left
    child is the next node, so only the right child is stored); a prediction is the mean of the
    trees' leaf values.

    Thresholds are kept as the largest float32 not above sklearn's float64 threshold: for a float32
    input x (sklearn compares float32 inputs), x <= that value exactly when x <= the original, so
    the routing is sklearn's bit for bit; leaf values are float32 (relative error ~1e-7)."""

    feature: np.ndarray  # int8, -1 at leaves
    threshold: np.ndarray  # float32; go left when x[feature] <= threshold
    right: np.ndarray  # int32, absolute node index of the right child (-1 at leaves)
    value: np.ndarray  # float32
    roots: np.ndarray  # int32, the root node of each tree
    max_depth: int

    @classmethod
    def from_sklearn(cls, model: Any) -> TreeEnsemble:
        feats, thr, rights, vals, roots = [], [], [], [], []
        offset, depth = 0, 0
        for est in model.estimators_:
            t = est.tree_
            inner = t.children_left >= 0
            if not np.array_equal(t.children_left[inner], np.nonzero(inner)[0] + 1):
                raise ValueError("tree is not in depth-first order (left child = next node)")
            roots.append(offset)
            feats.append(np.where(inner, t.feature, -1).astype(np.int8))
            t32 = t.threshold.astype(np.float32)
            too_big = t32.astype(np.float64) > t.threshold
            t32[too_big] = np.nextafter(t32[too_big], np.float32(-np.inf))
            thr.append(np.where(inner, t32, 0).astype(np.float32))
            rights.append(np.where(inner, t.children_right + offset, -1).astype(np.int32))
            vals.append(t.value[:, 0, 0].astype(np.float32))
            depth = max(depth, int(t.max_depth))
            offset += t.node_count
        return cls(
            np.concatenate(feats), np.concatenate(thr), np.concatenate(rights), np.concatenate(vals),
            np.asarray(roots, dtype=np.int32), depth,
        )

    @property
    def node_count(self) -> int:
        return int(self.feature.shape[0])

    def predict(self, x: np.ndarray) -> np.ndarray:
        x32 = np.asarray(x, dtype=np.float32)
        if x32.ndim != 2:
            raise ValueError(f"expected a 2-D array of encoded jobs, got shape {x32.shape}")
        n = x32.shape[0]
        rows = np.arange(n)
        total = np.zeros(n, dtype=np.float64)
        for root in self.roots:
            node = np.full(n, int(root), dtype=np.int64)
            for _ in range(self.max_depth + 1):
                f = self.feature[node].astype(np.int64)
                inner = f >= 0
                if not inner.any():
                    break
                go_left = x32[rows, np.where(inner, f, 0)] <= self.threshold[node]
                node = np.where(inner, np.where(go_left, node + 1, self.right[node]), node)
            total += self.value[node]
        return total / len(self.roots)

    def to_tensors(self, prefix: str) -> dict[str, Any]:
        import torch

        return {
            f"{prefix}.feature": torch.from_numpy(self.feature),
            f"{prefix}.threshold": torch.from_numpy(self.threshold),
            f"{prefix}.right": torch.from_numpy(self.right),
            f"{prefix}.value": torch.from_numpy(self.value),
            f"{prefix}.roots": torch.from_numpy(self.roots),
            f"{prefix}.max_depth": torch.tensor(self.max_depth),
        }

    @classmethod
    def from_tensors(cls, data: dict[str, Any], prefix: str) -> TreeEnsemble:
        def arr(name: str, dtype: Any) -> np.ndarray:
            return np.asarray(data[f"{prefix}.{name}"].numpy(), dtype=dtype)

        ens = cls(
            arr("feature", np.int8), arr("threshold", np.float32), arr("right", np.int32),
            arr("value", np.float32), arr("roots", np.int32), int(data[f"{prefix}.max_depth"].item()),
        )
        n = ens.node_count
        if not (len(ens.threshold) == len(ens.right) == len(ens.value) == n) or len(ens.roots) == 0:
            raise ValueError(f"{prefix}: arrays of different lengths or no trees")
        inner = ens.feature >= 0
        if (ens.right[inner] <= 0).any() or (ens.right[inner] >= n).any() or (ens.roots >= n).any():
            raise ValueError(f"{prefix}: a child index out of range")
        return ens


# --------------------------------------------------------------------------------------------
# The sizer.


@dataclass(frozen=True)
class SizeEstimate:
    """A cold-start size: predicted peak memory, utilization, and the margin to grant on top."""

    mem_mib: float  # predicted peak memory
    sm_pct: float  # predicted utilization (0-100)
    margin_mib: float  # from the model's measured error (see margin_rel)
    model: str
    margin_rel: float  # the quantile of absolute relative memory error the margin is taken from
    sm_margin_pct: float  # the same quantile of absolute utilization error, in points
    capacity_mib: float
    capacity_assumed: bool  # True when the caller gave no capacity (DEFAULT_CAPACITY_MIB used)
    family: str
    family_seen: bool  # False: a family absent from the training data (a wider margin is used)
    notes: tuple[str, ...] = field(default=())
    # "high": the learned model, inside its training data's ranges, with every input it needs given;
    # "low": it extrapolates (`extrapolated` names the inputs out of range) or inputs are missing or unknown.
    confidence: str = "high"
    missing: tuple[str, ...] = field(default=())  # inputs not given (and assumed; see notes)
    unknown: tuple[str, ...] = field(default=())  # inputs given but not known (assumed as not given; see notes)
    extrapolated: tuple[str, ...] = field(default=())  # inputs outside the training data's ranges
    method: str = "learned"  # "learned", "learned, raised to the physical floor", or "physics"
    floor_mib: float = 0.0  # what the job needs by construction (vgpu.jobs.physics_estimate)
    physics_mib: float = 0.0  # the physical estimate, activations included
    param_count: int = 0  # the parameters sized with (given, or from the known-model table)

    @property
    def grant_mib(self) -> float:
        return self.mem_mib + self.margin_mib

    @property
    def fits(self) -> bool:
        return self.grant_mib <= self.capacity_mib


class ColdStartSizer:
    """Sizes a job from its configuration with the shipped (or an injected) model."""

    def __init__(self, mem: TreeEnsemble, util: TreeEnsemble, metadata: dict[str, Any]) -> None:
        if metadata.get("encoding_version") != ENCODING_VERSION or list(metadata.get("feature_names", [])) != list(FEATURE_NAMES):
            raise ValueError(
                f"cold-start model was built for feature encoding {metadata.get('encoding_version')!r} "
                f"{metadata.get('feature_names')!r}; this code uses {ENCODING_VERSION} {list(FEATURE_NAMES)}: retrain it"
            )
        self._mem = mem
        self._util = util
        self.metadata = metadata
        self.model = str(metadata.get("model", MODEL_NAME))
        self._margin_all = float(metadata["margin_rel"]["all"])
        self._margin_family = {k: float(v) for k, v in metadata["margin_rel"].get("by_family", {}).items()}
        self._margin_unseen = max([self._margin_all, *self._margin_family.values()])
        self._sm_margin = float(metadata["sm_margin_pct"])
        self._seen = set(metadata.get("families_seen", []))
        self.mem_target = str(metadata.get("mem_target", "mem_mib"))
        if self.mem_target not in MEM_TARGETS:
            raise ValueError(f"cold-start model has an unknown mem_target {self.mem_target!r}; expected one of {MEM_TARGETS}: retrain it")
        # The largest batch of each stretch of batch sizes the memory forest does not tell apart (a
        # split on log2_batch at t: batches up to floor(2**t) go left), for `_smaller_batch_mib`.
        on_batch = mem.feature == FEATURE_NAMES.index("log2_batch")
        self._batch_breaks = np.unique(np.floor(2.0 ** mem.threshold[on_batch].astype(np.float64)))

    @classmethod
    def load(cls, path: Path | str = DEFAULT_ARTEFACT) -> ColdStartSizer:
        import torch

        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"cold-start model not found at {p}; build it with `python -m vgpu.manager.coldstart train`")
        try:
            data = torch.load(p, map_location="cpu", weights_only=True)
            metadata = json.loads(data["metadata"])
            mem, util = TreeEnsemble.from_tensors(data, "mem"), TreeEnsemble.from_tensors(data, "util")
        except (KeyError, ValueError, RuntimeError, TypeError, EOFError, pickle.UnpicklingError) as exc:
            raise ValueError(f"cold-start model at {p} is unreadable ({exc}); rebuild it with `python -m vgpu.manager.coldstart train`") from exc
        return cls(mem, util, metadata)

    def save(self, path: Path | str) -> None:
        import torch

        data = {**self._mem.to_tensors("mem"), **self._util.to_tensors("util"), "metadata": json.dumps(self.metadata, sort_keys=True)}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, Path(path))

    def predict_raw(self, x: np.ndarray, physics_mib: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(peak memory MiB, utilization %) for encoded rows whose physical estimates (MiB,
        `PhysicsEstimate.estimate_mib`) are `physics_mib`; the latter are used only when the forest
        learned the ratio to them."""
        mem = self._mem.predict(x)
        if self.mem_target == "log_ratio_to_physics":
            mem = np.asarray(physics_mib, dtype=np.float64) * np.exp(mem)
        return mem, self._util.predict(x)

    def size(self, job: JobConfig, capacity_mib: float | None = None) -> SizeEstimate:
        """Size `job` on a slice or GPU of `capacity_mib` (None: a whole A100-40GB, flagged)."""
        if not isinstance(job, JobConfig):
            raise TypeError(f"size() takes a JobConfig, got {type(job).__name__}")
        job.check_sizable()
        assumed = capacity_mib is None
        cap = DEFAULT_CAPACITY_MIB if capacity_mib is None else float(capacity_mib)
        phys = physics_estimate(job)
        known = known_model(job.model_type)
        filled = dataclasses.replace(
            job,
            param_count=job.param_count or phys.param_count,
            input_size=job.input_size or (known[1].input_size if known else 0),
            num_layers=job.num_layers or (known[1].num_layers if known else 0),
        )
        x = encode(filled, cap)[None, :]  # raises InvalidJobConfig on a bad capacity
        learned, util = (float(v[0]) for v in self.predict_raw(x, np.array([phys.estimate_mib])))
        family = job.family
        seen = family in self._seen
        notes: list[str] = []
        extrapolated = self._out_of_range(x[0])
        smaller_mib, smaller_batch = self._smaller_batch_mib(x[0], phys, job.batch_size) if seen else (0.0, 0)
        if not seen:
            extrapolated = ("family", *extrapolated)
            notes.append(f"model family {family!r} is not in the training data: widest margin used")
        if known is None:
            notes.append(unknown_model_note(job.model_type))
        if phys.param_source.startswith("known model"):
            notes.append(f"param_count {phys.param_count:,} from the {phys.param_source} table")
        notes.extend(f"assumed {a}" for a in phys.assumed)
        notes.extend(phys.notes)
        if extrapolated:
            mem, method = phys.estimate_mib, "physics"
            rel = self._margin_unseen
            notes.append(
                f"outside the learned model's training data ({', '.join(extrapolated)}): sized from "
                "parameters, precision, optimizer and activations; widest margin used"
            )
            if smaller_mib > mem:
                mem = smaller_mib
                notes.append(f"raised to the learned size of batch {smaller_batch} of the same job ({smaller_mib:.0f} MiB)")
        else:
            rel = self._margin_family.get(family, self._margin_all)
            mem, method = max(learned, 0.0), "learned"
            if smaller_mib > mem:
                mem = smaller_mib
                notes.append(f"raised to the learned size of batch {smaller_batch} of the same job ({smaller_mib:.0f} MiB): "
                             "a larger batch never needs less")
            if mem < phys.floor_mib:
                mem, method = phys.floor_mib, "learned, raised to the physical floor"
                notes.append(f"the learned model's {learned:.0f} MiB is below what the job needs by construction")
        if assumed:
            notes.append(f"no capacity given: assumed {DEFAULT_CAPACITY_MIB:.0f} MiB")
        low = bool(extrapolated or phys.missing or phys.unknown)
        return SizeEstimate(
            mem_mib=mem,
            sm_pct=min(100.0, max(0.0, util)),
            margin_mib=rel * mem,
            model=self.model,
            margin_rel=rel,
            sm_margin_pct=self._sm_margin,
            capacity_mib=cap,
            capacity_assumed=assumed,
            family=family,
            family_seen=seen,
            notes=tuple(notes),
            confidence="low" if low else "high",
            missing=phys.missing,
            unknown=phys.unknown,
            extrapolated=extrapolated,
            method=method,
            floor_mib=phys.floor_mib,
            physics_mib=phys.estimate_mib,
            param_count=phys.param_count,
        )

    def _smaller_batch_mib(self, x: np.ndarray, phys: PhysicsEstimate, batch: int) -> tuple[float, int]:
        """The largest learned size of the same job at a smaller batch inside the training ranges,
        and that batch ((0, 0) where there is none): a job never needs less memory than at a
        smaller batch, and the forest, piecewise constant in the batch, need not agree.

        Between two splits on the batch the forest's output is constant, so the size (that output, or
        the physical estimate times it) is largest at the stretch's largest batch: checking those
        (`_batch_breaks`) below `batch` makes the size non-decreasing in the batch. The physical
        estimate at batch b' is its batch-independent part plus the activations scaled by b'/batch
        (vgpu.jobs.physics_estimate's activations are proportional to the batch)."""
        batch = max(batch, 1)
        others = tuple(n for n in self._out_of_range(x) if n != "batch_size")
        candidates = self._batch_breaks[self._batch_breaks < batch]
        if others or not len(candidates):
            return 0.0, 0
        family = FAMILIES[int(x[0])]
        lo, hi = self.metadata.get("feature_ranges_by_family", {}).get(family, {}).get("ranges", {}).get("log2_batch", (math.inf, -math.inf))
        log2_b = np.log2(candidates)
        candidates = candidates[(log2_b >= lo) & (log2_b <= hi)]
        if not len(candidates):
            return 0.0, 0
        xs = np.repeat(x[None, :], len(candidates), axis=0)
        xs[:, FEATURE_NAMES.index("log2_batch")] = np.log2(candidates)
        static_mib = phys.estimate_mib - phys.activations_mib
        mems, _ = self.predict_raw(xs, static_mib + phys.activations_mib * candidates / batch)
        i = int(np.argmax(mems))
        return float(mems[i]), int(candidates[i])

    def _out_of_range(self, x: np.ndarray) -> tuple[str, ...]:
        """The encoded inputs outside the training data's ranges (metadata "feature_ranges"; a
        categorical one outside the values seen). An artefact without ranges: every input is."""
        family = FAMILIES[int(x[0])]
        by_family: dict[str, Any] = self.metadata.get("feature_ranges_by_family", {}).get(family, {})
        ranges: dict[str, list[float]] = by_family.get("ranges", {})
        seen_values: dict[str, list[float]] = by_family.get("seen", {})
        out = []
        for i, name in enumerate(FEATURE_NAMES):
            if name in ("family", "log2_capacity_mib"):
                continue  # family: by families_seen; capacity: the device's, not the job's
            if name in seen_values:
                if float(x[i]) not in seen_values[name]:
                    out.append(_FEATURE_INPUT.get(name, name))
                continue
            lo, hi = ranges.get(name, (math.inf, -math.inf))
            if not lo <= float(x[i]) <= hi:
                out.append(_FEATURE_INPUT.get(name, name))
        return tuple(out)


# The job input each encoded feature comes from, to name it to a person.
_FEATURE_INPUT = {"log10_params": "param_count", "log2_batch": "batch_size", "log2_input": "input_size",
                  "train": "mode"}


def training_ranges(x: np.ndarray) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per model family of the encoded training rows: "ranges" (numeric feature -> [min, max]) and
    "seen" (categorical feature -> the values seen). The learned model is trusted only inside them."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for fam_index in sorted({int(v) for v in x[:, 0]}):
        rows = x[x[:, 0] == fam_index]
        ranges, seen = {}, {}
        for i, name in enumerate(FEATURE_NAMES):
            col = rows[:, i]
            if name in ("family", "precision", "optimizer", "train"):
                seen[name] = sorted({float(v) for v in col})
            else:
                ranges[name] = [float(col.min()), float(col.max())]
        out[FAMILIES[fam_index]] = {"ranges": ranges, "seen": seen}
    return out


class AllocatorSizer:
    """Adapter to vgpu.allocator.core's `Sizer` protocol: `size(job, *, mem_total_mib) -> Sizing`.

    The job is a `JobConfig` (or a `vgpu.v1.JobConfig` message, converted). The grant is the
    prediction plus its margin, trimmed to the device's memory when the prediction alone fits (the
    trim is stated in the reason); a job predicted to need more than the device is granted its
    prediction, and the allocator's capacity check refuses it."""

    def __init__(self, sizer: ColdStartSizer) -> None:
        self.sizer = sizer
        self._quantile_pct = round(100 * float(sizer.metadata.get("margin_quantile", MARGIN_QUANTILE)))

    def size(self, job: JobConfig | Any, *, mem_total_mib: float) -> Sizing:
        config = job if isinstance(job, JobConfig) else JobConfig.from_proto(job)
        est = self.sizer.size(config, mem_total_mib if mem_total_mib > 0 else None)
        memory = est.grant_mib
        reason = (f"cold_start {est.model} ({est.method}, confidence {est.confidence}): peak {est.mem_mib:.0f} MiB "
                  f"+ margin {est.margin_mib:.0f} MiB (p{self._quantile_pct} rel err {est.margin_rel:.3f})")
        if est.missing:
            reason += f"; missing {', '.join(est.missing)}"
        if est.unknown:
            reason += f"; unknown {', '.join(est.unknown)}"
        if not est.fits and est.mem_mib <= est.capacity_mib:
            memory = est.capacity_mib
            reason += f"; margin trimmed to the device's {est.capacity_mib:.0f} MiB"
        if est.notes:
            reason += "; " + "; ".join(est.notes)
        return Sizing(memory_mib=memory, sm_pct=min(100.0, est.sm_pct + est.sm_margin_pct), reason=reason)


class BackgroundSizer:
    """A `Sizer` whose model loads in a worker thread, so a daemon's start-up does not wait for torch.

    Loading begins at `start()`: the daemon calls it once it serves, because the load (torch's import
    among it) holds the interpreter's lock for long stretches and would slow the rest of the start-up
    down with it. Until `load()` returns, `size` raises `Unavailable` (UNAVAILABLE: retry, or give
    memory_mib); when it failed, one warning is logged and `size` raises `NotSupported`
    (FAILED_PRECONDITION) naming why, for the life of the process: the daemon degrades to requests
    that state their memory."""

    def __init__(self, load: Callable[[], Sizer], logger: structlog.typing.FilteringBoundLogger) -> None:
        self._log = logger
        self._done = threading.Event()
        self._sizer: Sizer | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._load, args=(load,), name="coldstart-load", daemon=True)

    def start(self) -> None:
        """Begin loading in the worker thread (call once)."""
        self.thread.start()

    def _load(self, load: Callable[[], Sizer]) -> None:
        try:
            self._sizer = load()
            self._log.info("coldstart_sizer_loaded")
        except Exception as exc:  # noqa: BLE001 - any failure means no cold-start sizing, said once
            self.error = f"{type(exc).__name__}: {exc}"
            self._log.warning("coldstart_sizer_unavailable", error=self.error,
                              consequence="requests without memory_mib are refused")
        finally:
            self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once loading has finished (loaded or failed), or at once when it never began (a
        start-up that failed before serving has nothing to wait for)."""
        if self.thread.ident is None:
            return True
        return self._done.wait(timeout_s)

    def size(self, job: JobConfig, *, mem_total_mib: float) -> Sizing:
        if not self._done.is_set():
            raise Unavailable("the cold-start model is still loading (seconds after start): retry, or give memory_mib")
        if self._sizer is None:
            raise NotSupported(f"cold-start sizing is unavailable on this daemon ({self.error}): give memory_mib")
        return self._sizer.size(job, mem_total_mib=mem_total_mib)


# --------------------------------------------------------------------------------------------
# Training.


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else math.nan


def _mem_fit_target(mem: np.ndarray, physics_mib: np.ndarray, mem_target: str) -> np.ndarray:
    if mem_target == "log_ratio_to_physics":
        ratio: np.ndarray = np.log(np.maximum(mem, 1.0) / np.maximum(physics_mib, 1.0))
        return ratio
    if mem_target == "mem_mib":
        return mem
    raise ValueError(f"unknown mem_target {mem_target!r}; expected one of {MEM_TARGETS}")


@dataclass(frozen=True)
class _Data:
    """The permitted profiles, encoded, with each job's physical estimate and family."""

    profiles: list[JobProfile]
    x: np.ndarray
    mem: np.ndarray
    util: np.ndarray
    physics_mib: np.ndarray
    families: np.ndarray

    @classmethod
    def load(cls, data_root: Path, gpumemnet_rows: int | None) -> _Data:
        profiles = load_permitted(data_root, gpumemnet_rows)
        x, mem, util = encode_profiles(profiles)
        phys: list[PhysicsEstimate] = [physics_estimate(p.job) for p in profiles]
        return cls(profiles, x, mem, util, np.array([e.estimate_mib for e in phys], dtype=np.float64),
                   np.array([p.job.family for p in profiles]))


def _fit_sizer(data: _Data, fit_rows: np.ndarray, margin: dict[str, Any], sm_margin_pct: float, mem_target: str,
               rf_params: dict[str, Any], seed: int, quantile: float, metadata: dict[str, Any]) -> ColdStartSizer:
    """A sizer fit on `fit_rows` (its training ranges theirs), with the given margins."""
    from sklearn.ensemble import RandomForestRegressor

    def fit(y: np.ndarray, params: dict[str, Any]) -> TreeEnsemble:
        model = RandomForestRegressor(random_state=seed, n_jobs=1, **params).fit(data.x[fit_rows], y[fit_rows])
        return TreeEnsemble.from_sklearn(model)

    meta = {
        **metadata,
        "model": MODEL_NAME,
        "mem_target": mem_target,
        "params": rf_params,
        "util_params": _util_params(rf_params),
        "seed": seed,
        "encoding_version": ENCODING_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "families_seen": sorted(set(data.families[fit_rows].tolist())),
        "margin_quantile": quantile,
        "sm_margin_quantile": SM_MARGIN_QUANTILE,
        "margin_rel": margin,
        "sm_margin_pct": sm_margin_pct,
        "feature_ranges_by_family": training_ranges(data.x[fit_rows]),
    }
    mem = fit(_mem_fit_target(data.mem, data.physics_mib, mem_target), rf_params)
    return ColdStartSizer(mem, fit(data.util, _util_params(rf_params)), meta)


def _util_params(rf_params: dict[str, Any]) -> dict[str, Any]:
    """The utilization forest's settings: the memory forest's, at UTIL_MIN_SAMPLES_LEAF."""
    return {**rf_params, "min_samples_leaf": UTIL_MIN_SAMPLES_LEAF}


def _cv_margins(data: _Data, rows: np.ndarray, mem_target: str, rf_params: dict[str, Any], seed: int,
                quantile: float) -> tuple[dict[str, Any], float]:
    """Margins from CV_FOLDS-fold cross-validated errors over `rows` only: (margin_rel, sm_margin_pct)."""
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.model_selection import KFold

    p_mem, p_util = np.zeros(len(rows)), np.zeros(len(rows))
    y_mem = _mem_fit_target(data.mem, data.physics_mib, mem_target)
    folds = KFold(n_splits=min(CV_FOLDS, len(rows)), shuffle=True, random_state=seed)
    for fit_idx, eval_idx in folds.split(rows):
        fit_rows, eval_rows = rows[fit_idx], rows[eval_idx]

        def model(y: np.ndarray, params: dict[str, Any], fit_rows: np.ndarray = fit_rows) -> Any:
            return RandomForestRegressor(random_state=seed, n_jobs=1, **params).fit(data.x[fit_rows], y[fit_rows])

        raw = model(y_mem, rf_params).predict(data.x[eval_rows])
        p_mem[eval_idx] = data.physics_mib[eval_rows] * np.exp(raw) if mem_target == "log_ratio_to_physics" else raw
        p_util[eval_idx] = model(data.util, _util_params(rf_params)).predict(data.x[eval_rows])
    rel = np.abs(p_mem - data.mem[rows]) / np.maximum(data.mem[rows], 1.0)
    fams = data.families[rows]
    by_family = {}
    for fam in sorted(set(fams.tolist())):
        sel = fams == fam
        if sel.sum() >= MIN_FAMILY_TEST_ROWS:
            by_family[fam] = round(_quantile(rel[sel], quantile), 5)
    margin = {"all": round(_quantile(rel, quantile), 5), "by_family": by_family, "from": f"{CV_FOLDS}-fold CV of the training part"}
    return margin, round(_quantile(np.abs(p_util - data.util[rows]), SM_MARGIN_QUANTILE), 4)


def _bucket_name(lo: int, hi: int) -> str:
    return f"{lo}-{hi}" if hi < (1 << 30) else f">={lo}"


def sizing_report(sizer: ColdStartSizer, profiles: Sequence[JobProfile]) -> dict[str, Any]:
    """How `sizer` sizes measured jobs (each through `size`, on its own slice or GPU): MAE and MAPE of
    the size without margin; `under_frac`, the share of jobs whose grant (size + margin) is below the
    measured peak; `slack_mib` / `slack_pct`, the mean of grant - peak over the jobs not under; by
    batch-size bucket, by method, and over the jobs other than the MLPs (3,000 easy rows of one source)."""
    sized = [sizer.size(p.job, p.capacity_mib) for p in profiles]
    mem = np.array([e.mem_mib for e in sized])
    grant = np.array([e.grant_mib for e in sized])
    peak = np.array([p.peak_mem_mib for p in profiles])
    batch = np.array([p.job.batch_size for p in profiles])
    method = np.array([e.method for e in sized])
    mlp = np.array([p.job.family == "mlp" for p in profiles])

    def stats(sel: np.ndarray) -> dict[str, Any]:
        if not sel.any():
            return {"n": 0}
        err, over = mem[sel] - peak[sel], ~(grant[sel] < peak[sel])
        slack = grant[sel] - peak[sel]
        return {
            "n": int(sel.sum()),
            "mae_mib": round(float(np.mean(np.abs(err))), 1),
            "mape": round(float(np.mean(np.abs(err) / peak[sel]) * 100), 2),
            "under_frac": round(float(np.mean(~over)), 4),
            "slack_mib": round(float(np.mean(slack[over])), 1) if over.any() else None,
            "slack_pct": round(float(np.mean(slack[over] / peak[sel][over]) * 100), 1) if over.any() else None,
        }

    everything = np.ones(len(profiles), dtype=bool)
    return {
        "all": stats(everything),
        "not_mlp": stats(~mlp),
        "by_batch": {_bucket_name(lo, hi): stats((batch >= lo) & (batch <= hi)) for lo, hi in BATCH_BUCKETS},
        "by_batch_not_mlp": {_bucket_name(lo, hi): stats((batch >= lo) & (batch <= hi) & ~mlp) for lo, hi in BATCH_BUCKETS},
        "by_method": {m: stats(method == m) for m in sorted(set(method.tolist()))},
    }


def heldout_evaluation(data_root: Path, seed: int = 0, gpumemnet_rows: int | None = None, params: dict[str, Any] | None = None,
                       mem_target: str = MEM_TARGET, quantile: float = MARGIN_QUANTILE) -> dict[str, Any]:
    """The sizer as `train_sizer` builds it, but fit (model, ranges and margin) on the 70 % training
    part only, sizing the 30 % test part: see `sizing_report`."""
    rf_params = {**RF_PARAMS, **(params or {})}
    data = _Data.load(data_root, gpumemnet_rows)
    train, test = split_indices(len(data.profiles), 0.7, seed)
    margin, sm_margin = _cv_margins(data, train, mem_target, rf_params, seed, quantile)
    sizer = _fit_sizer(data, train, margin, sm_margin, mem_target, rf_params, seed, quantile, {})
    return {"mem_target": mem_target, "params": rf_params, "margin_quantile": quantile, "split": {"train": int(len(train)), "test": int(len(test)), "frac": 0.7},
            "margin_rel": margin, **sizing_report(sizer, [data.profiles[i] for i in test])}


def train_sizer(data_root: Path, seed: int = 0, gpumemnet_rows: int | None = None, params: dict[str, Any] | None = None,
                mem_target: str = MEM_TARGET, quantile: float = MARGIN_QUANTILE) -> ColdStartSizer:
    """Fit on the permitted profiles: margin from cross-validation on the 70 % training part, error
    measured on the 30 % held-out part (model and margin fit without it), then refit on all rows."""
    rf_params = {**RF_PARAMS, **(params or {})}
    data = _Data.load(data_root, gpumemnet_rows)
    train, test = split_indices(len(data.profiles), 0.7, seed)
    margin, sm_margin = _cv_margins(data, train, mem_target, rf_params, seed, quantile)
    held = _fit_sizer(data, train, margin, sm_margin, mem_target, rf_params, seed, quantile, {})
    p_mem, p_util = held.predict_raw(data.x[test], data.physics_mib[test])
    report = sizing_report(held, [data.profiles[i] for i in test])
    metadata: dict[str, Any] = {
        "trained_on": {src: {"rows": n, "license": PERMITTED_SOURCES[src]} for src, n in profiles_summary(data.profiles).items()},
        "split": {"train": int(len(train)), "test": int(len(test)), "frac": 0.7},
        "test_metrics": {
            "peak_mem_mib": {k: round(v, 4) for k, v in regression_metrics(data.mem[test], p_mem).items()},
            "sm_util_pct": {k: round(v, 4) for k, v in regression_metrics(data.util[test], p_util).items()},
        },
        "heldout": {k: report[k] for k in ("all", "not_mlp", "by_batch_not_mlp")},
        "refit_on_all_rows": True,
    }
    return _fit_sizer(data, np.arange(len(data.profiles)), margin, sm_margin, mem_target, rf_params, seed, quantile, metadata)


def _add_size_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model-type", required=True, help="e.g. resnet50, bert-base, vit_b_16")
    s.add_argument("--batch-size", type=int, required=True)
    s.add_argument("--param-count", type=int, default=0,
                   help="parameters (default: from the table of known models, vgpu.jobs.KNOWN_MODELS)")
    s.add_argument("--input-size", type=int, default=0, help="image side (px) or sequence length (tokens)")
    s.add_argument("--num-layers", type=int, default=0)
    s.add_argument("--precision", default="fp32", help="fp32, fp16, bf16 or amp")
    s.add_argument("--optimizer", default="", help="adam, adamw, sgd, ... (training; default: Adam assumed)")
    s.add_argument("--mode", default="train", help="train or infer")
    s.add_argument("--capacity-mib", type=float, default=None,
                   help=f"memory of the GPU or MIG slice (default: a whole A100-40GB, {DEFAULT_CAPACITY_MIB:.0f} MiB)")
    s.add_argument("--model", type=Path, default=DEFAULT_ARTEFACT, help="sizer artefact (default: the shipped one)")


def _size(args: argparse.Namespace, prog: str, *, as_json: bool) -> int:
    try:
        job = JobConfig(args.model_type, args.param_count, args.batch_size, args.input_size, args.num_layers,
                        args.precision, args.optimizer, args.mode)
        sizer = ColdStartSizer.load(args.model)
        est = sizer.size(job, args.capacity_mib)
    except (InvalidJobConfig, FileNotFoundError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if known_model(job.model_type) is None:
        # a custom model is sized all the same (from --param-count); a typo should not go unnoticed
        print(f"{prog}: warning: {unknown_model_note(job.model_type)}", file=sys.stderr)
    said = job.optimizer_note()
    if said is not None:
        print(f"{prog}: warning: {said}", file=sys.stderr)
    verdict = "fits" if est.fits else (
        f"does not fit: needs {est.grant_mib:,.0f} MiB ({est.mem_mib:,.0f} MiB without the margin), "
        f"the device has {est.capacity_mib:,.0f} MiB"
    )
    if as_json:
        print(json.dumps({**dataclasses.asdict(est), "grant_mib": est.grant_mib, "fits": est.fits, "verdict": verdict}))
        return 0
    # 0: neither --param-count nor the known-model table gave one (the sizer then goes by the family)
    params = (f"{est.param_count:,} parameters" if est.param_count > 0 else
              "parameter count unknown: give --param-count")
    print(f"{job.model_type} ({est.family}, {params}), batch {job.batch_size}, "
          f"{job.mode_norm}, {job.precision_norm} on {est.capacity_mib:.0f} MiB:")
    print(f"  peak memory  {est.mem_mib:8.0f} MiB + margin {est.margin_mib:.0f} MiB "
          f"(p{round(100 * float(sizer.metadata.get('margin_quantile', MARGIN_QUANTILE)))} relative error "
          f"{est.margin_rel:.1%}) = grant {est.grant_mib:.0f} MiB")
    print(f"  {verdict}")
    print(f"  method {est.method}, confidence {est.confidence}"
          + "".join(f" ({what}: {', '.join(names)})" for what, names in (("missing", est.missing),
                                                                          ("unknown", est.unknown)) if names))
    print(f"  utilization  {est.sm_pct:8.0f} %   (+ {est.sm_margin_pct:.0f} points)   model {est.model}")
    for note in est.notes:
        print(f"  note: {note}")
    return 0


def size_main(argv: Sequence[str] | None = None, prog: str = "vgpu size") -> int:
    """`vgpu size`: a job's cold-start size from the command line."""
    parser = argparse.ArgumentParser(prog=prog, description="Size a job before it has a history (the cold-start model).")
    _add_size_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the estimate as one JSON object")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    return _size(args, prog, as_json=args.json)


def main(argv: Sequence[str] | None = None, prog: str = "python -m vgpu.manager.coldstart") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="cold-start sizer: train the model or size a job")
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train on ../shared/data and write the artefact")
    t.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    t.add_argument("--out", type=Path, default=DEFAULT_ARTEFACT)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--mem-target", choices=MEM_TARGETS, default=MEM_TARGET,
                   help="what the forest learns for memory: the peak, or its log ratio to the physical estimate")
    t.add_argument("--min-samples-leaf", type=int, default=RF_PARAMS["min_samples_leaf"])
    t.add_argument("--margin-quantile", type=float, default=MARGIN_QUANTILE)
    _add_size_arguments(sub.add_parser("size", help="size one job with the shipped model (JSON; see `vgpu size`)"))
    args = parser.parse_args(argv)
    if args.cmd == "train":
        if not args.data.is_dir():
            print(f"{prog}: data directory {args.data} not found", file=sys.stderr)
            return 2
        if not 0.5 <= args.margin_quantile < 1 or args.min_samples_leaf < 1:
            print(f"{prog}: --margin-quantile must be in [0.5, 1) and --min-samples-leaf >= 1", file=sys.stderr)
            return 2
        sizer = train_sizer(args.data, args.seed, params={"min_samples_leaf": args.min_samples_leaf},
                            mem_target=args.mem_target, quantile=args.margin_quantile)
        sizer.save(args.out)
        print(json.dumps({"out": str(args.out), **sizer.metadata}))
        return 0
    return _size(args, prog, as_json=True)


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "DEFAULT_ARTEFACT",
    "FAMILIES",
    "AllocatorSizer",
    "BackgroundSizer",
    "ColdStartSizer",
    "SizeEstimate",
    "TreeEnsemble",
    "choose_source",
    "heldout_evaluation",
    "sizing_report",
    "train_sizer",
]
