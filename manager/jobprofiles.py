"""Job profiles: what a deep-learning job is (its configuration) and what it was measured to need.

A `JobConfig` (vgpu/jobs.py, re-exported here) mirrors the `JobConfig` message of
proto/vgpu/v1/allocator.proto. `encode` turns a job
and the capacity of the slice or GPU it runs on into the one feature vector every cold-start model
uses (trees take it as is; the Transformer-BiGRU reads it as a sequence, one token per feature, see
`encode_tokens`).

The loaders read measured profiles from ../shared/data (never copied into this repository):

- MIGPerf (MIT): A100-40GB/80GB MIG slices, per run: model, params, batch or sequence length, slice ->
  mean framebuffer use and GRACT, latency, throughput. Peak memory is the maximum of the run's 1 s
  DCGM samples (falls back to the table's mean where the trace has no sample in the run's window).
- MISO (MIT): full A100-40GB memory / nvidia-smi utilization / power per (model, batch) of training.
- GPUMemNet (CC-BY-4.0): 3,000 MLP training configurations -> peak memory and DCGM GPU utilization.
- Lucid (S-Lab, non-commercial): development-time checks only; `load_permitted` never includes it
  and no shipped model may be trained on it.

Utilization is not one metric across sources (DCGM GRACT for MIGPerf, nvidia-smi utilization.gpu
for MISO and Lucid, DCGM GPUTL for GPUMemNet); each profile keeps its `source` so a reader can tell.
Parameter counts of the MISO models and of the MIGPerf models whose tables do not list them are
approximate (the model family's usual size, noted in `KNOWN_MODELS`).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The job type and its vocabularies live in vgpu/jobs.py (the allocator uses them too); re-exported.
from vgpu.jobs import FAMILIES as FAMILIES
from vgpu.jobs import MODES as MODES
from vgpu.jobs import OPTIMIZERS as OPTIMIZERS
from vgpu.jobs import PRECISIONS as PRECISIONS
from vgpu.jobs import InvalidJobConfig as InvalidJobConfig
from vgpu.jobs import JobConfig as JobConfig
from vgpu.jobs import model_family as model_family


@dataclass(frozen=True)
class JobProfile:
    """One measured run: a job on a slice or GPU of `capacity_mib`, and what it used."""

    job: JobConfig
    capacity_mib: float
    gpu: str  # e.g. "A100-40GB"
    slice_name: str  # MIG profile ("3g.20gb") or "full"
    source: str  # "migperf" | "miso" | "gpumemnet" | "lucid"
    peak_mem_mib: float
    sm_pct: float
    mem_mean_mib: float | None = None
    latency_ms: float | None = None
    throughput_per_s: float | None = None
    power_w: float | None = None


# Memory of a MIG slice in MiB (from ../shared/reference/gpu-skus.md); "full" is the whole GPU.
SLICE_MIB: dict[tuple[str, str], float] = {
    ("A100-40GB", "1g.5gb"): 4864.0,
    ("A100-40GB", "2g.10gb"): 9856.0,
    ("A100-40GB", "3g.20gb"): 19968.0,
    ("A100-40GB", "4g.20gb"): 19968.0,
    ("A100-40GB", "7g.40gb"): 40192.0,
    ("A100-40GB", "full"): 40960.0,
    ("A100-80GB", "1g.10gb"): 9856.0,
    ("A100-80GB", "2g.20gb"): 19968.0,
    ("A100-80GB", "3g.40gb"): 40192.0,
    ("A100-80GB", "7g.80gb"): 80384.0,
    ("A100-80GB", "full"): 81920.0,
}
_A100_40_BY_GB = {5: "1g.5gb", 10: "2g.10gb", 20: "3g.20gb", 40: "7g.40gb"}

# name -> (param_count, num_layers, input_size, optimizer); "~" in the note means approximate.
KNOWN_MODELS: dict[str, tuple[int, int, int, str]] = {
    # MIGPerf (tables list total_params for the 40GB NLP models). Its scripts (MIGProfiler
    # utils/common.py, utils/model_hub.py, A100-{cv,nlp}-train_test.py at 47c05f6) load "bert-base" as
    # Hugging Face's bert-base-multilingual-cased and train it with AdamW; "vision_transformer" and
    # "resnet50" are torchvision's vit_b_16 and resnet50 (exact parameter counts), trained with SGD.
    "bert-base": (177_853_440, 12, 64, "adamw"),
    "vision_transformer": (86_567_656, 12, 224, "sgd"),
    "resnet50": (25_557_032, 50, 224, "sgd"),
    "resnet50_moco": (25_557_032, 50, 224, "sgd"),
    "bert-base-multilingual-cased": (177_853_440, 12, 64, "none"),
    "paraphrase-multilingual-MiniLM-L12-v2": (117_653_760, 12, 64, "none"),
    "distiluse-base-multilingual-cased-v1": (134_734_080, 6, 64, "none"),
    "distiluse-base-multilingual-cased-v2": (134_734_080, 6, 64, "none"),
    "paraphrase-multilingual-mpnet-base-v2": (278_043_648, 12, 64, "none"),
    # MISO training scripts (Keras/PyTorch examples; ~ sizes)
    "bert": (110_000_000, 12, 128, "adam"),
    "cyclegan": (28_000_000, 24, 256, "adam"),
    "deepspeech2": (26_000_000, 7, 193, "adam"),
    "embedding": (2_200_000, 5, 200, "rmsprop"),
    "gnn": (60_000, 2, 1433, "adam"),
    "mobilenet": (3_500_000, 53, 224, "sgd"),
    "resnet": (25_600_000, 50, 224, "sgd"),
    "transformer": (19_000_000, 2, 20, "adam"),
}


def _f(value: str) -> float:
    return float(value) if value not in ("", "nan", "NaN") else math.nan


def _read_csv(path: Path) -> Iterator[dict[str, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as fh:
        yield from csv.DictReader(fh)


class _DcgmIndex:
    """All 1 s DCGM samples of one GPU, sorted by time, for max-over-a-window lookups."""

    def __init__(self, files: Iterable[Path]) -> None:
        ts: list[float] = []
        fb: list[float] = []
        for path in files:
            for row in _read_csv(path):
                try:
                    t, used = float(row["TimeStamp"]), float(row["FBUSD"])
                except (KeyError, TypeError, ValueError):
                    continue  # a torn line (the recorder was stopped mid-write)
                ts.append(t)
                fb.append(used)
        order = np.argsort(np.asarray(ts, dtype=np.float64), kind="stable")
        self.ts = np.asarray(ts, dtype=np.float64)[order]
        self.fb = np.asarray(fb, dtype=np.float64)[order]

    def peak(self, start_s: float, end_s: float) -> float | None:
        lo = int(np.searchsorted(self.ts, start_s, side="left"))
        hi = int(np.searchsorted(self.ts, end_s, side="right"))
        return float(self.fb[lo:hi].max()) if hi > lo else None


def _migperf_tables(root: Path) -> list[tuple[str, str, Path]]:
    """(gpu, mode, table) for the MIGPerf result tables that carry memory and GRACT means."""
    out: list[tuple[str, str, Path]] = []
    g40 = root / "data" / "A100-40g"
    for kind in ("infer_bsz", "infer_seq"):
        suffix = "_bsz.csv" if kind == "infer_bsz" else "_seq.csv"
        for model_dir in sorted((g40 / kind).glob("*")):
            if model_dir.is_dir():
                out.append(("A100-40GB", "infer", model_dir / f"{model_dir.name}{suffix}"))
    out.append(("A100-40GB", "train", g40 / "finetune_moco" / "moco_finetune.csv"))
    out.append(("A100-40GB", "train", g40 / "finetune_vit" / "vit_finetune.csv"))
    g80 = root / "data" / "A100-80g"
    for mode_dir, mode in (("infer", "infer"), ("train", "train")):
        out.extend(("A100-80GB", mode, p) for p in sorted((g80 / mode_dir).glob("*/integrated_result*.csv")))
    return [t for t in out if t[2].is_file()]


def load_migperf(data_root: Path) -> list[JobProfile]:
    """MIGPerf runs (failed runs dropped; duplicates across tables kept once)."""
    root = Path(data_root) / "migperf-a100-mig"
    if not root.is_dir():
        raise FileNotFoundError(f"MIGPerf data not found at {root}")
    dcgm = {
        "A100-40GB": _DcgmIndex(sorted((root / "data" / "A100-40g").rglob("dcgm.csv"))),
        "A100-80GB": _DcgmIndex(sorted((root / "data" / "A100-80g").rglob("dcgm.csv"))),
    }
    seen: set[tuple[str, str, int]] = set()
    out: list[JobProfile] = []
    for gpu, mode, table in _migperf_tables(root):
        for row in _read_csv(table):
            start, end = _f(row.get("start_timestamp", "0")), _f(row.get("end_timestamp", "0"))
            if not start or not _f(row.get("throughput", "0")) or math.isnan(start):
                continue  # failed run (OOM on a small slice)
            name = row["model_name"]
            if "mig_profile" in row:
                slice_name = row["mig_profile"]
            else:
                gb = int(float(row.get("instance_memory") or row.get("mig") or 0))
                slice_name = _A100_40_BY_GB[gb]
            key = (gpu, name, int(start))
            if key in seen:
                continue
            seen.add(key)
            params, layers, default_input, optimizer = KNOWN_MODELS[name]
            if row.get("total_params"):
                params = int(float(row["total_params"]))
            seq = row.get("seq_length")
            input_size = int(float(seq)) if seq else default_input
            mean_mib = _f(row["fb_used_mean"])
            peak = dcgm[gpu].peak(start, end)
            job = JobConfig(
                model_type=name,
                param_count=params,
                batch_size=int(float(row["batch_size"])),
                input_size=input_size,
                num_layers=layers,
                precision="fp32",
                optimizer="none" if mode == "infer" else optimizer,
                mode=mode,
            )
            out.append(
                JobProfile(
                    job=job,
                    capacity_mib=SLICE_MIB[(gpu, slice_name)],
                    gpu=gpu,
                    slice_name=slice_name,
                    source="migperf",
                    peak_mem_mib=max(peak, mean_mib) if peak is not None else mean_mib,
                    sm_pct=100.0 * _f(row["gract_mean"]),
                    mem_mean_mib=mean_mib,
                    latency_ms=_f(row["latency"]),
                    throughput_per_s=_f(row["throughput"]),
                )
            )
    return out


def load_miso_full(data_root: Path) -> list[JobProfile]:
    """MISO's full-A100-40GB memory, utilization and power per (model, batch) of training."""
    path = Path(data_root) / "miso-a100-mig" / "derived_full_a100_util_memory_power_by_model_batch.csv"
    if not path.is_file():
        raise FileNotFoundError(f"MISO summary not found at {path}")
    out: list[JobProfile] = []
    for row in _read_csv(path):
        name = row["model"]
        if name not in KNOWN_MODELS:
            continue  # "dummy": a synthetic load, not a job
        params, layers, input_size, optimizer = KNOWN_MODELS[name]
        job = JobConfig(name, params, int(float(row["batch_size"])), input_size, layers, "fp32", optimizer, "train")
        out.append(
            JobProfile(
                job=job,
                capacity_mib=SLICE_MIB[("A100-40GB", "full")],
                gpu="A100-40GB",
                slice_name="full",
                source="miso",
                peak_mem_mib=_f(row["gpu_memory_used_MiB"]),
                sm_pct=_f(row["utilization_gpu_pct"]),
                power_w=_f(row["power_draw_W"]),
            )
        )
    return out


_MLP_INPUT = re.compile(r"input:(\d+)")


def load_gpumemnet(data_root: Path, max_rows: int | None = None) -> list[JobProfile]:
    """GPUMemNet's MLP configurations (GPU assumed 40 GB: the source's notebooks use a 42,000 MiB
    out-of-memory sentinel; the repository does not state the GPU)."""
    path = Path(data_root) / "gpumemnet-mlp" / "mlp_data_step2.csv"
    if not path.is_file():
        raise FileNotFoundError(f"GPUMemNet data not found at {path}")
    out: list[JobProfile] = []
    for row in _read_csv(path):
        m = _MLP_INPUT.search(row["Filename"])
        job = JobConfig(
            model_type="mlp",
            param_count=int(float(row["Total Parameters"])),
            batch_size=int(float(row["Batch Size"])),
            input_size=int(m.group(1)) if m else 0,
            num_layers=int(float(row["Depth"])),
            precision="fp32",
            optimizer="",
            mode="train",
        )
        out.append(
            JobProfile(
                job=job,
                capacity_mib=SLICE_MIB[("A100-40GB", "full")],
                gpu="unknown-40GB",
                slice_name="full",
                source="gpumemnet",
                peak_mem_mib=_f(row["Max GPU Memory (MiB)"]),
                sm_pct=_f(row["Avg GPUTL"]),
            )
        )
        if max_rows is not None and len(out) >= max_rows:
            break
    return out


_LUCID_MODELS: dict[str, tuple[int, int, int]] = {
    # ~ usual sizes; input size from the dataset
    "BERT": (110_000_000, 12, 384),
    "DCGAN": (3_600_000, 10, 64),
    "EfficientNet": (5_300_000, 82, 32),
    "LSTM": (28_000_000, 2, 35),
    "MobileNetV2": (3_500_000, 53, 32),
    "MobileNetV3": (5_400_000, 62, 224),
    "NeuMF": (6_000_000, 4, 1),
    "PPO": (40_000, 3, 8),
    "PointNet": (3_500_000, 9, 2500),
    "ResNet18": (11_700_000, 18, 32),
    "ResNet50": (25_600_000, 50, 224),
    "TD3": (200_000, 3, 24),
    "Transformer": (44_000_000, 6, 64),
    "VGG": (138_000_000, 16, 32),
}


def load_lucid(data_root: Path) -> list[JobProfile]:
    """Lucid's single-job profiles. NON-COMMERCIAL: development-time checks only, never training data
    for a shipped model. The GPU is not stated; capacity is taken as 24 GiB (largest gmem 20,162 MiB)."""
    path = Path(data_root) / "lucid-dl-job-profiles" / "single_data.csv"
    if not path.is_file():
        raise FileNotFoundError(f"Lucid data not found at {path}")
    out: list[JobProfile] = []
    for row in _read_csv(path):
        params, layers, input_size = _LUCID_MODELS.get(row["model"], (0, 0, 0))
        job = JobConfig(
            model_type=row["model"],
            param_count=params,
            batch_size=int(float(row["batchsize"])),
            input_size=input_size,
            num_layers=layers,
            precision="amp" if row["amp"].strip() == "1" else "fp32",
            optimizer="",
            mode="train",
        )
        out.append(
            JobProfile(job, 24576.0, "unknown", "full", "lucid", _f(row["gmem"]), _f(row["gpu_util"]))
        )
    return out


PERMITTED_SOURCES: dict[str, str] = {"migperf": "MIT", "miso": "MIT", "gpumemnet": "CC-BY-4.0"}


def load_permitted(data_root: Path, gpumemnet_rows: int | None = None) -> list[JobProfile]:
    """Every profile a shipped model may be trained on (MIGPerf, MISO, GPUMemNet), in a fixed order."""
    profiles = load_migperf(data_root) + load_miso_full(data_root) + load_gpumemnet(data_root, gpumemnet_rows)
    return [p for p in profiles if math.isfinite(p.peak_mem_mib) and math.isfinite(p.sm_pct)]


# ---------------------------------------------------------------------------------------------
# The one feature encoding.

FEATURE_NAMES: tuple[str, ...] = (
    "family",
    "log10_params",
    "log2_batch",
    "log2_input",
    "num_layers",
    "precision",
    "optimizer",
    "train",
    "log2_capacity_mib",
)
# Categorical features and their category lists (their value in the vector is the index).
CATEGORICAL: dict[str, tuple[str, ...]] = {"family": FAMILIES, "precision": PRECISIONS, "optimizer": OPTIMIZERS}
TOKEN_DIM = 1 + max(len(v) for v in CATEGORICAL.values())
ENCODING_VERSION = 1


def encode(job: JobConfig, capacity_mib: float) -> np.ndarray:
    """The feature vector of a job on a slice or GPU of `capacity_mib` (float64, FEATURE_NAMES order)."""
    if not (capacity_mib > 0 and math.isfinite(capacity_mib)):
        raise InvalidJobConfig(f"capacity_mib must be a positive number, got {capacity_mib!r}")
    return np.array(
        [
            FAMILIES.index(job.family),
            math.log10(job.param_count) if job.param_count > 0 else 0.0,
            math.log2(job.batch_size) if job.batch_size > 0 else 0.0,
            math.log2(job.input_size) if job.input_size > 0 else 0.0,
            float(job.num_layers),
            PRECISIONS.index(job.precision_norm),
            OPTIMIZERS.index(job.optimizer_norm),
            1.0 if job.mode_norm == "train" else 0.0,
            math.log2(capacity_mib),
        ],
        dtype=np.float64,
    )


def encode_profiles(profiles: Iterable[JobProfile]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X (N, n_features), peak memory MiB (N,), utilization % (N,))."""
    rows = list(profiles)
    x = np.stack([encode(p.job, p.capacity_mib) for p in rows]) if rows else np.zeros((0, len(FEATURE_NAMES)))
    mem = np.array([p.peak_mem_mib for p in rows], dtype=np.float64)
    util = np.array([p.sm_pct for p in rows], dtype=np.float64)
    return x, mem, util


def encode_tokens(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """The sequence view of feature vectors for the Transformer-BiGRU: (N, n_features, TOKEN_DIM).

    Token i stands for feature i. A numeric feature puts its standardized value (by `mean`/`std`,
    the training set's) in slot 0; a categorical feature puts a one-hot of its category in slots
    1..; which feature a token is comes from its position (the network's position embedding)."""
    x = np.asarray(x, dtype=np.float64)
    n, f = x.shape
    out = np.zeros((n, f, TOKEN_DIM), dtype=np.float32)
    for i, name in enumerate(FEATURE_NAMES):
        if name in CATEGORICAL:
            idx = x[:, i].astype(np.int64)
            out[np.arange(n), i, 1 + idx] = 1.0
        else:
            out[:, i, 0] = (x[:, i] - mean[i]) / (std[i] if std[i] > 0 else 1.0)
    return out


def profiles_summary(profiles: Iterable[JobProfile]) -> dict[str, int]:
    """Row count per source (for metadata and reports)."""
    counts: dict[str, int] = {}
    for p in profiles:
        counts[p.source] = counts.get(p.source, 0) + 1
    return dict(sorted(counts.items()))


def dumps_summary(profiles: Iterable[JobProfile]) -> str:
    return json.dumps(profiles_summary(profiles))
