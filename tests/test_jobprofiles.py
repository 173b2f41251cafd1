"""Job configuration, the shared feature encoding, and the profile loaders."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from vgpu.manager.jobprofiles import (
    FAMILIES,
    FEATURE_NAMES,
    TOKEN_DIM,
    InvalidJobConfig,
    JobConfig,
    encode,
    encode_tokens,
    load_gpumemnet,
    load_lucid,
    load_migperf,
    load_permitted,
    model_family,
)


def test_proto_round_trip_keeps_every_field() -> None:
    job = JobConfig("bert-base", 110_000_000, 32, 128, 12, "amp", "adamw", "train")
    msg = job.to_proto()
    assert msg.model_type == "bert-base" and msg.batch_size == 32 and msg.precision == "amp"
    assert JobConfig.from_proto(msg) == job
    assert set(msg.DESCRIPTOR.fields_by_name) == set(JobConfig.__dataclass_fields__)


def test_proto_defaults_read_as_not_given() -> None:
    from vgpu.v1 import allocator_pb2

    job = JobConfig.from_proto(allocator_pb2.JobConfig(model_type="resnet50", batch_size=8))
    assert job.precision_norm == "fp32" and job.mode_norm == "train" and job.optimizer_norm == "unknown"
    assert JobConfig("bert", batch_size=1, mode="infer").optimizer_norm == "none"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": -1}, "batch_size must be >= 0"),
        ({"param_count": -5}, "param_count"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"mode": "serve"}, "unknown mode"),
        ({"num_layers": 2.5}, "num_layers must be an integer"),
        ({"batch_size": True}, "batch_size must be an integer"),
    ],
)
def test_impossible_configs_are_refused_clearly(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidJobConfig, match=message):
        JobConfig("resnet50", **kwargs)  # type: ignore[arg-type]


def test_sizable_needs_a_model_and_a_batch() -> None:
    with pytest.raises(InvalidJobConfig, match="model_type is empty"):
        JobConfig("  ", batch_size=4).check_sizable()
    with pytest.raises(InvalidJobConfig, match="batch_size must be >= 1"):
        JobConfig("resnet50", batch_size=0).check_sizable()


@pytest.mark.parametrize(
    "name, family",
    [
        ("resnet50", "cnn"),  # contains "t5" but is no T5
        ("t5-small", "transformer"),
        ("gpt2", "transformer"),
        ("vit_b_16", "vit"),
        ("vision_transformer", "vit"),
        ("cyclegan", "gan"),
        ("deepspeech2", "rnn"),
        ("paraphrase-multilingual-MiniLM-L12-v2", "transformer"),
        ("mlp", "mlp"),
        ("NeuMF", "recsys"),
        ("something-new", "other"),
    ],
)
def test_model_family(name: str, family: str) -> None:
    assert model_family(name) == family


def test_encoding_values_and_order() -> None:
    x = encode(JobConfig("resnet50", 25_600_000, 64, 224, 50, "fp16", "sgd", "train"), 19968.0)
    assert x.shape == (len(FEATURE_NAMES),)
    assert x[FEATURE_NAMES.index("family")] == FAMILIES.index("cnn")
    assert x[FEATURE_NAMES.index("log2_batch")] == pytest.approx(6.0)
    assert x[FEATURE_NAMES.index("log10_params")] == pytest.approx(math.log10(25_600_000))
    assert x[FEATURE_NAMES.index("train")] == 1.0
    assert x[FEATURE_NAMES.index("log2_capacity_mib")] == pytest.approx(math.log2(19968.0))
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(InvalidJobConfig, match="capacity_mib"):
            encode(JobConfig("resnet50", batch_size=1), bad)


def test_tokens_one_per_feature() -> None:
    jobs = [JobConfig("resnet50", 1000, 8, 32, 5), JobConfig("bert", 2000, 16, 64, 12, "amp", "adam", "infer")]
    x = np.stack([encode(j, 4864.0) for j in jobs])
    mean, std = x.mean(axis=0), x.std(axis=0)
    tok = encode_tokens(x, mean, std)
    assert tok.shape == (2, len(FEATURE_NAMES), TOKEN_DIM)
    fam = FEATURE_NAMES.index("family")
    assert tok[0, fam, 1 + FAMILIES.index("cnn")] == 1.0 and tok[0, fam].sum() == 1.0
    batch = FEATURE_NAMES.index("log2_batch")
    assert tok[:, batch, 0] == pytest.approx([-1.0, 1.0])
    cap = FEATURE_NAMES.index("log2_capacity_mib")  # constant column: std 0 must not divide by zero
    assert np.all(tok[:, cap, 0] == 0.0)


def test_loaders_say_where_data_is_missing(tmp_path: Path) -> None:
    for loader in (load_migperf, load_gpumemnet, load_lucid):
        with pytest.raises(FileNotFoundError, match=str(tmp_path)):
            loader(tmp_path)


def test_migperf_profiles_from_the_real_tables(shared_data: Path) -> None:
    profiles = load_migperf(shared_data)
    assert 450 <= len(profiles) <= 520  # ~500 non-failed runs, duplicates across tables kept once
    assert all(p.throughput_per_s and p.throughput_per_s > 0 for p in profiles)  # failed runs dropped
    assert all(p.mem_mean_mib is not None and p.peak_mem_mib >= p.mem_mean_mib for p in profiles)
    assert all(0 <= p.sm_pct <= 100 and p.peak_mem_mib <= p.capacity_mib for p in profiles)
    assert {p.slice_name for p in profiles} >= {"1g.5gb", "7g.40gb", "1g.10gb", "7g.80gb"}
    # MIGPerf's scripts load "bert-base" as bert-base-multilingual-cased and train it with AdamW, and
    # its vision models are torchvision's: the rows say so, as the 40GB tables' total_params do.
    by_name = {p.job.model_type: p.job for p in profiles if p.job.mode_norm == "train"}
    assert (by_name["bert-base"].param_count, by_name["bert-base"].optimizer_norm) == (177_853_440, "adamw")
    assert {p.job.param_count for p in profiles if p.job.model_type == "bert-base-multilingual-cased"} == {177_853_440}
    assert (by_name["resnet50"].param_count, by_name["resnet50"].optimizer_norm) == (25_557_032, "sgd")
    assert {p.job.param_count for p in profiles if p.job.model_type == "vision_transformer"} == {86_567_656}


def test_permitted_profiles_never_include_lucid(shared_data: Path) -> None:
    profiles = load_permitted(shared_data, gpumemnet_rows=50)
    assert {p.source for p in profiles} == {"migperf", "miso", "gpumemnet"}
    assert sum(p.source == "gpumemnet" for p in profiles) == 50
