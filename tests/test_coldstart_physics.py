"""`vgpu size` against what jobs are known to need: public model sizes and batch sizes with their
published (or, where marked, computed) memory. The sizer must land within FACTOR of each figure,
respect the physical floor (weights, gradients, optimizer state), say when it extrapolates or lacks
inputs, and say "does not fit" with the figure."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from typing import Any

import pytest

from vgpu.jobs import JobConfig, known_model, physics_estimate
from vgpu.manager.coldstart import size_main

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
FACTOR = 2.0  # the sizer's peak memory must be within [figure / FACTOR, figure * FACTOR]
GIB_MIB = 1024.0

# (args for `vgpu size`, expected peak MiB, where the figure comes from)
KNOWN_JOBS: list[tuple[list[str], float, str]] = [
    (["--model-type", "llama-7b", "--batch-size", "1", "--precision", "fp16", "--mode", "infer"], 14_500,
     "LLaMA-7B fp16 inference: 13.5 GB of weights (6.7 B x 2 B) plus a 2048-token KV cache, ~1 GB"),
    (["--model-type", "llama-13b", "--batch-size", "1", "--precision", "fp16", "--mode", "infer"], 26_500,
     "LLaMA-13B fp16 inference: 26 GB of weights"),
    (["--model-type", "llama-70b", "--param-count", "70000000000", "--batch-size", "1", "--precision", "fp16",
      "--mode", "infer"], 140_000, "70 B parameters in fp16: 140 GB of weights alone"),
    (["--model-type", "mistral-7b", "--batch-size", "1", "--precision", "bf16", "--mode", "infer"], 15_000,
     "Mistral-7B bf16: 14.5 GB of weights (model card)"),
    (["--model-type", "llama-7b", "--batch-size", "1", "--precision", "bf16", "--optimizer", "adamw",
      "--input-size", "512"], 115_000,
     "full fine-tuning of a 7 B model with AdamW in mixed precision: 16 B/parameter = 112 GB (ZeRO paper)"),
    (["--model-type", "gpt2-xl", "--batch-size", "1", "--precision", "fp16", "--mode", "infer"], 4_500,
     "GPT-2 XL fp16 inference: 1.56 B x 2 B = 3.1 GB of weights plus the context"),
    (["--model-type", "resnet50", "--batch-size", "112", "--optimizer", "sgd"], 15_000,
     "ResNet-50 fp32 training: batch 112 is what NVIDIA DeepLearningExamples fits in a 16 GB V100"),
    (["--model-type", "resnet50", "--batch-size", "256", "--precision", "amp", "--optimizer", "sgd"], 15_000,
     "ResNet-50 AMP training: batch 256 in a 16 GB V100 (NVIDIA DeepLearningExamples)"),
    (["--model-type", "bert-base", "--batch-size", "32", "--input-size", "128", "--optimizer", "adam"], 11_000,
     "BERT-Base fine-tuning, seq 128: batch 32 is the most a 12 GB GPU fits (google-research/bert README)"),
    (["--model-type", "bert-base", "--batch-size", "6", "--input-size", "512", "--optimizer", "adam"], 11_000,
     "BERT-Base fine-tuning, seq 512: batch 6 in 12 GB (google-research/bert README)"),
    (["--model-type", "bert-large", "--batch-size", "1", "--input-size", "512", "--optimizer", "adam"], 11_000,
     "BERT-Large, seq 512: batch 1 in 12 GB; 'out of memory' beyond (google-research/bert README)"),
    (["--model-type", "resnet50", "--batch-size", "1", "--mode", "infer"], 1_400,
     "computed: ResNet-50 inference, 100 MB of weights plus a ~1.0-1.5 GB CUDA context"),
    (["--model-type", "vit_b_16", "--batch-size", "1", "--mode", "infer"], 1_500,
     "computed: ViT-B/16 inference, 330 MB of weights plus the context"),
]


def size(*args: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = size_main([*args, "--json"])
    assert rc == 0
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def size_subprocess(*args: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "size", *args, "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("args", "expected_mib", "source"), KNOWN_JOBS, ids=[" ".join(a[1:4]) for a, _, _ in KNOWN_JOBS])
def test_known_jobs_within_a_factor(args: list[str], expected_mib: float, source: str) -> None:
    est = size(*args)
    assert expected_mib / FACTOR <= est["mem_mib"] <= expected_mib * FACTOR, (source, est)
    assert est["mem_mib"] >= est["floor_mib"] - 1e-6


def test_the_cli_sizes_grow_with_the_batch_and_the_job() -> None:
    """As a user runs it: batch, mode and model change the answer (they once all gave 1451 MiB)."""
    b1, b64, b256 = (size_subprocess("--model-type", "resnet50", "--batch-size", str(b), "--optimizer", "sgd")
                     for b in (1, 64, 256))
    assert b1["mem_mib"] < b64["mem_mib"] < b256["mem_mib"]
    assert b256["mem_mib"] > 3 * b64["mem_mib"] / 2
    infer = size("--model-type", "resnet50", "--batch-size", "64", "--mode", "infer")
    assert infer["mem_mib"] < b64["mem_mib"]
    bert, llama = size("--model-type", "bert-base", "--batch-size", "1"), size("--model-type", "llama-70b", "--batch-size", "1")
    assert llama["mem_mib"] > 100 * bert["mem_mib"]


def test_a_70b_model_does_not_fit_and_says_by_how_much() -> None:
    est = size_subprocess("--model-type", "llama-70b", "--param-count", "70000000000", "--batch-size", "1",
                          "--precision", "fp16", "--mode", "infer", "--capacity-mib", "81559")
    assert est["fits"] is False
    assert est["mem_mib"] >= 70e9 * 2 / 2**20  # the weights alone
    assert est["verdict"].startswith("does not fit: needs ") and "81,559 MiB" in est["verdict"]
    assert est["confidence"] == "low" and "param_count" in est["extrapolated"]
    assert est["method"] == "physics"
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "size", "--model-type", "llama-70b", "--batch-size", "1",
                        "--precision", "fp16", "--mode", "infer"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "does not fit: needs" in r.stdout


def test_missing_inputs_are_named_and_lower_the_confidence() -> None:
    est = size("--model-type", "my-own-net", "--batch-size", "8")
    assert est["confidence"] == "low"
    assert "param_count" in est["missing"] and "optimizer" in est["missing"]
    given = size("--model-type", "resnet50", "--batch-size", "64", "--optimizer", "sgd", "--input-size", "224",
                 "--capacity-mib", "81920")
    assert given["confidence"] == "high" and given["missing"] == [] and given["method"].startswith("learned")


@pytest.mark.parametrize(("precision", "optimizer", "bytes_per_param"), [
    ("fp32", "adam", 16.0), ("fp16", "adam", 16.0), ("bf16", "adamw", 16.0), ("fp32", "sgd", 12.0), ("fp32", "none", 8.0),
])
def test_training_floor_counts_gradients_and_optimizer_state(precision: str, optimizer: str, bytes_per_param: float) -> None:
    params = 1_000_000_000
    est = physics_estimate(JobConfig("some-model", params, 1, 0, 0, precision, optimizer, "train"))
    states = est.weights_mib + est.gradients_mib + est.optimizer_mib
    assert states == pytest.approx(params * bytes_per_param / 2**20)


def test_model_names_are_found_however_spelt() -> None:
    for name in ("vit_b_16", "ViT-B/16", "Llama-2-7b-hf", "bert-base-uncased", "gpt2", "resnet50"):
        assert known_model(name) is not None, name
    assert known_model("my-own-net") is None


def test_an_unknown_optimizer_is_said_as_unknown_not_missing_and_sized_as_adam() -> None:
    job = ("--model-type", "resnet50", "--batch-size", "64", "--input-size", "224", "--capacity-mib", "81920")
    typo = size(*job, "--optimizer", "adamw-typo")
    none_given = size(*job)
    assert "optimizer" not in typo["missing"] and typo["unknown"] == ["optimizer"]
    note = ("unknown optimizer 'adamw-typo' (known: none, sgd, adam, adamw, rmsprop, adagrad, adadelta): "
            "assumed Adam (8 bytes of state per parameter)")
    assert note in typo["notes"] and typo["confidence"] == "low"
    # sized as with no optimizer given (Adam's state): the same figures
    assert typo["grant_mib"] == none_given["grant_mib"] and typo["floor_mib"] == none_given["floor_mib"]
    assert none_given["missing"] == ["optimizer"] and none_given["unknown"] == []
    phys = physics_estimate(JobConfig("resnet50", batch_size=64, optimizer="adamw-typo"))
    assert phys.unknown == ("optimizer",) and phys.notes == (note,) and "optimizer" not in phys.missing
    # as the user reads it: a warning on stderr, and "unknown" where "missing" was said
    r = subprocess.run([sys.executable, "-m", "vgpu.cli", "size", *job, "--optimizer", "adamw-typo"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"warning: {note}" in r.stderr, r.stderr
    assert "(unknown: optimizer)" in r.stdout and "missing: optimizer" not in r.stdout, r.stdout
