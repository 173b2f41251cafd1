"""Cold-start sizing: the shipped model, its margin, the hand-over to the forecaster, the comparison."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from vgpu.jobs import physics_estimate
from vgpu.manager.coldstart import (
    DEFAULT_ARTEFACT,
    AllocatorSizer,
    ColdStartSizer,
    TreeEnsemble,
    choose_source,
    heldout_evaluation,
    sizing_report,
    train_sizer,
)
from vgpu.manager.jobprofiles import (
    ENCODING_VERSION,
    FEATURE_NAMES,
    InvalidJobConfig,
    JobConfig,
    JobProfile,
    encode,
)

ROOT = Path(__file__).resolve().parent.parent


# ---- hand-over ---------------------------------------------------------------------------------
def test_no_history_with_a_job_and_no_amount_is_cold_start() -> None:
    assert choose_source(0.0, has_job=True) == "cold_start"
    assert choose_source(9.9, has_job=True, min_history_s=10.0) == "cold_start"


def test_history_hands_over_to_the_forecaster() -> None:
    assert choose_source(10.0, has_job=True, min_history_s=10.0) == "forecast"
    assert choose_source(60.0, requested_memory_mib=4096.0, has_job=True) == "forecast"


def test_an_explicit_amount_wins_before_history() -> None:
    assert choose_source(0.0, requested_memory_mib=2048.0, has_job=True) == "request"
    assert choose_source(0.0) == "request"  # nothing to size from


@pytest.mark.parametrize("kw", [{"has_history_s": -1.0}, {"has_history_s": math.nan}, {"has_history_s": 0.0, "requested_memory_mib": -5.0}])
def test_hand_over_refuses_nonsense(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        choose_source(**kw)  # type: ignore[arg-type]


# ---- a tiny injected model ---------------------------------------------------------------------
def _tiny_sizer(margin_all: float = 0.1, by_family: dict[str, float] | None = None, mem_target: str | None = None,
                falling: bool = False) -> ColdStartSizer:
    from sklearn.ensemble import ExtraTreesRegressor

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, size=(200, len(FEATURE_NAMES)))
    x[:, 0] = rng.integers(0, 3, size=200)  # families 0..2: transformer, vit, cnn
    # the peak grows with log2_batch (0..10, batches up to 1024); the ratio target: peak = physics x 1.1
    mem = 1000 + 300 * x[:, 2] if mem_target is None else np.full(200, np.log(1.1))
    if falling:  # a forest whose output falls as the batch grows, as one fit on noisy neighbours can
        mem = 5000 - 300 * x[:, 2]
    util = 10 + 5 * x[:, 2]
    m = ExtraTreesRegressor(n_estimators=5, random_state=0).fit(x, mem)
    u = ExtraTreesRegressor(n_estimators=5, random_state=0).fit(x, util)
    meta = {
        "model": "RandomForest",
        **({"mem_target": mem_target} if mem_target else {}),
        "encoding_version": ENCODING_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "margin_rel": {"all": margin_all, "by_family": by_family or {}},
        "sm_margin_pct": 3.0,
        "families_seen": ["transformer", "vit", "cnn"],
        # Trusted everywhere: these tests are about the margins, not the training ranges.
        "feature_ranges_by_family": {fam: {
            "ranges": {n: [-1e9, 1e9] for n in FEATURE_NAMES},
            "seen": {n: [float(i) for i in range(12)] for n in ("precision", "optimizer", "train")},
        } for fam in ("transformer", "vit", "cnn")},
    }
    return ColdStartSizer(TreeEnsemble.from_sklearn(m), TreeEnsemble.from_sklearn(u), meta)


def test_tree_arrays_predict_exactly_what_sklearn_predicts() -> None:
    from sklearn.ensemble import ExtraTreesRegressor

    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 4)).astype(np.float32)
    y = x[:, 0] * 3 + np.sin(x[:, 1])
    model = ExtraTreesRegressor(n_estimators=7, min_samples_leaf=2, random_state=0).fit(x, y)
    xt = np.concatenate([rng.normal(size=(200, 4)), x[:50]]).astype(np.float32)  # includes exact training values
    assert TreeEnsemble.from_sklearn(model).predict(xt) == pytest.approx(model.predict(xt), rel=1e-6, abs=1e-6)


def test_margin_is_the_measured_relative_error_times_the_prediction() -> None:
    sizer = _tiny_sizer(margin_all=0.1, by_family={"cnn": 0.25})
    cnn = sizer.size(JobConfig("resnet50", 25_000_000, 64, 224, 50), 19968.0)
    assert cnn.margin_rel == 0.25 and cnn.margin_mib == pytest.approx(0.25 * cnn.mem_mib)
    assert cnn.grant_mib == pytest.approx(cnn.mem_mib * 1.25) and cnn.fits and cnn.family_seen
    vit = sizer.size(JobConfig("vit_b_16", 86_000_000, 8, 224, 12), 19968.0)
    assert vit.margin_rel == 0.1  # no family figure: the overall one


def test_unseen_family_gets_the_widest_margin_and_a_flag() -> None:
    sizer = _tiny_sizer(margin_all=0.1, by_family={"cnn": 0.25, "vit": 0.4})
    est = sizer.size(JobConfig("my-new-net", 1000, 4), None)
    assert not est.family_seen and est.margin_rel == 0.4
    assert est.capacity_assumed and any("not in the training data" in n for n in est.notes)


@pytest.mark.parametrize(
    "job, capacity, error",
    [
        (JobConfig("resnet50", batch_size=0), 4864.0, InvalidJobConfig),
        (JobConfig("", batch_size=8), 4864.0, InvalidJobConfig),
        (JobConfig("resnet50", batch_size=8), -1.0, InvalidJobConfig),
        ({"model_type": "resnet50"}, 4864.0, TypeError),
    ],
)
def test_bad_input_is_refused(job: object, capacity: float, error: type[Exception]) -> None:
    with pytest.raises(error):
        _tiny_sizer().size(job, capacity)  # type: ignore[arg-type]


def test_encoding_mismatch_is_refused() -> None:
    sizer = _tiny_sizer()
    with pytest.raises(ValueError, match="retrain"):
        ColdStartSizer(sizer._mem, sizer._util, {**sizer.metadata, "encoding_version": -1})


def test_a_forest_on_the_ratio_to_physics_scales_with_the_batch_past_its_training_rows() -> None:
    peak, ratio = _tiny_sizer(), _tiny_sizer(mem_target="log_ratio_to_physics")
    assert ratio.mem_target == "log_ratio_to_physics" and peak.mem_target == "mem_mib"  # older artefacts: the peak

    def job(batch: int) -> JobConfig:
        return JobConfig("resnet50", 25_557_032, batch, 224, 50, optimizer="sgd")

    # a forest on the peak is flat past the largest batch it was fit on (log2 1024 = 10): the defect
    x = np.zeros((2, len(FEATURE_NAMES)))
    x[:, FEATURE_NAMES.index("log2_batch")] = (10.0, 12.0)
    flat = peak.predict_raw(x, np.array([1.0, 4.0]))[0]
    assert flat[0] == flat[1]
    sizes = [ratio.size(job(b), 81920.0).mem_mib for b in (1, 8, 64, 128, 256, 1024, 4096)]
    assert sizes == sorted(sizes) and sizes[-1] > 3 * sizes[-2]  # a larger batch is never sized smaller
    assert sizes[4] == pytest.approx(1.1 * physics_estimate(job(256)).estimate_mib, rel=1e-6)
    with pytest.raises(ValueError, match="unknown mem_target"):
        ColdStartSizer(ratio._mem, ratio._util, {**ratio.metadata, "mem_target": "peak_squared"})


def test_a_larger_batch_of_the_same_job_is_never_sized_smaller() -> None:
    sizer = _tiny_sizer(falling=True)
    job = JobConfig("resnet50", 25_557_032, 1, 8, 50, optimizer="sgd")  # 8 px: activations far under the forest's sizes
    sizes = [sizer.size(dataclasses.replace(job, batch_size=b), 19968.0) for b in (1, 2, 3, 4, 8, 16, 33, 64)]
    assert [e.mem_mib for e in sizes] == sorted(e.mem_mib for e in sizes)
    assert [e.grant_mib for e in sizes] == sorted(e.grant_mib for e in sizes)
    assert sizes[-1].mem_mib > sizer.predict_raw(encode(dataclasses.replace(job, batch_size=64), 19968.0)[None, :],
                                                 np.ones(1))[0][0]
    assert any("raised to the learned size of batch" in n for n in sizes[-1].notes) and sizes[-1].method == "learned"


def test_sizing_report_counts_grants_under_the_peak_and_the_slack_of_the_others() -> None:
    sizer = _tiny_sizer(margin_all=0.1, by_family={"cnn": 0.25})
    small, big = JobConfig("resnet50", 25_000_000, 8, 224, 50), JobConfig("resnet50", 25_000_000, 256, 224, 50)
    est_small, est_big = sizer.size(small, 19968.0), sizer.size(big, 19968.0)
    profiles = [  # the small job used half its grant; the big one twice its grant
        JobProfile(small, 19968.0, "A100-40GB", "3g.20gb", "migperf", 0.5 * est_small.grant_mib, 50.0),
        JobProfile(big, 19968.0, "A100-40GB", "3g.20gb", "migperf", 2.0 * est_big.grant_mib, 50.0),
    ]
    report = sizing_report(sizer, profiles)
    assert report["all"]["n"] == 2 and report["all"]["under_frac"] == 0.5
    assert report["all"]["slack_mib"] == pytest.approx(0.5 * est_small.grant_mib, abs=0.1)
    assert report["all"]["slack_pct"] == pytest.approx(100.0, abs=0.1)
    assert report["by_batch"]["1-16"]["under_frac"] == 0.0 and report["by_batch"][">=129"]["under_frac"] == 1.0
    assert report["by_batch"][">=129"]["slack_mib"] is None and report["by_batch"]["17-64"] == {"n": 0}
    assert report["not_mlp"]["n"] == 2 and sum(m["n"] for m in report["by_method"].values()) == 2


def test_save_load_round_trip_and_broken_files(tmp_path: Path) -> None:
    sizer = _tiny_sizer()
    path = tmp_path / "m.pt"
    sizer.save(path)
    job = JobConfig("resnet50", 25_000_000, 64, 224, 50)
    assert ColdStartSizer.load(path).size(job, 4864.0) == sizer.size(job, 4864.0)
    with pytest.raises(FileNotFoundError, match="vgpu.manager.coldstart train"):
        ColdStartSizer.load(tmp_path / "absent.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="unreadable"):
        ColdStartSizer.load(tmp_path / "bad.pt")


# ---- the shipped model (no data needed) ---------------------------------------------------------
def test_shipped_model_is_trained_on_permitted_data_only_and_sizes_a_job() -> None:
    sizer = ColdStartSizer.load(DEFAULT_ARTEFACT)
    assert set(sizer.metadata["trained_on"]) <= {"migperf", "miso", "gpumemnet"}
    assert sizer.metadata["margin_rel"]["all"] > 0
    small = sizer.size(JobConfig("bert-base", 110_000_000, 1, 64, 12, mode="infer"), 9856.0)
    big = sizer.size(JobConfig("bert-base", 110_000_000, 32, 512, 12, mode="train"), 81920.0)
    assert 500 < small.mem_mib < 9856 and 0 <= small.sm_pct <= 100
    assert big.mem_mib > small.mem_mib  # training a long sequence needs more than inferring a short one


@pytest.mark.parametrize("job, capacity_mib", [
    (JobConfig("resnet50", 25_557_032, 1, 224, 50, "fp32", "sgd", "train"), 81559.0),
    (JobConfig("bert-base", 177_853_440, 1, 64, 12, "fp32", "adamw", "train"), 81559.0),
    (JobConfig("paraphrase-multilingual-MiniLM-L12-v2", 117_653_760, 1, 64, 12, mode="infer"), 4864.0),
])
def test_shipped_model_never_sizes_a_larger_batch_smaller(job: JobConfig, capacity_mib: float) -> None:
    sizer = ColdStartSizer.load(DEFAULT_ARTEFACT)
    sizes = [sizer.size(dataclasses.replace(job, batch_size=b), capacity_mib) for b in range(1, 700, 11)]
    assert [e.mem_mib for e in sizes] == sorted(e.mem_mib for e in sizes)
    assert [e.grant_mib for e in sizes] == sorted(e.grant_mib for e in sizes)


def test_shipped_model_grants_resnet50_at_batch_256_its_measured_peak() -> None:
    # MIGPerf's resnet50 training at batch 256 on an A100-80GB (7g.80gb) peaked at 28,102 MiB; a forest
    # on the peak itself sized it 18,036 MiB with a 27,245 MiB grant (docs/demo.md)
    est = ColdStartSizer.load(DEFAULT_ARTEFACT).size(JobConfig("resnet50", 25_557_032, 256, 224, 50, "fp32", "sgd", "train"), 81559.0)
    assert est.method == "learned" and est.grant_mib >= 28_102


# ---- the allocator's sizer protocol -------------------------------------------------------------
def test_allocator_adapter_grants_prediction_plus_margin_and_trims_to_the_device() -> None:
    adapter = AllocatorSizer(_tiny_sizer(margin_all=0.5))
    spec = JobConfig(model_type="resnet50", param_count=25_000_000, batch_size=64, input_size=224, num_layers=50)
    roomy = adapter.size(spec, mem_total_mib=81920.0)
    assert adapter.size(spec.to_proto(), mem_total_mib=81920.0) == roomy  # the proto message is converted
    est = adapter.sizer.size(spec, 81920.0)
    assert roomy.memory_mib == pytest.approx(est.mem_mib * 1.5) and "cold_start" in roomy.reason
    tight_cap = est.mem_mib * 1.2  # the prediction fits, prediction + margin does not
    tight = adapter.size(spec, mem_total_mib=tight_cap)
    assert tight.memory_mib == pytest.approx(tight_cap) and "trimmed" in tight.reason
    with pytest.raises(InvalidJobConfig):
        adapter.size(JobConfig(model_type="resnet50", batch_size=0), mem_total_mib=81920.0)  # not sizable


def test_allocator_grants_a_cold_start_size() -> None:
    from tests.allocator_fakes import FakeBackend, FakeDevice
    from vgpu.allocator.core import AllocationRequest, Allocator
    from vgpu.allocator.errors import InvalidRequest

    alloc = Allocator(FakeBackend([FakeDevice(mem_total_mib=40960.0)]), sizer=AllocatorSizer(_tiny_sizer()))
    grant = alloc.request_allocation(
        AllocationRequest(app_id="a", memory_mib=0.0, job=JobConfig(model_type="resnet50", batch_size=16, input_size=224))
    )
    assert grant.source == "cold_start" and grant.memory_mib > 0
    with pytest.raises(InvalidRequest, match="request.job cannot be sized: batch_size must be >= 1"):
        alloc.request_allocation(AllocationRequest(app_id="b", job=JobConfig(model_type="resnet50", batch_size=0)))
    assert [g.app_id for g in alloc.ledger.grants()] == ["a"]  # the refusal changed nothing


# ---- training and the comparison (need the data) -----------------------------------------------
def test_training_measures_the_margin_on_held_out_rows(shared_data: Path) -> None:
    sizer = train_sizer(shared_data, gpumemnet_rows=150, params={"n_estimators": 4})
    meta = sizer.metadata
    assert meta["split"]["test"] > 0 and meta["margin_rel"]["all"] > 0
    assert "lucid" not in meta["trained_on"]
    fams = meta["margin_rel"]["by_family"]
    assert fams and all(v > 0 for v in fams.values())
    # the margin comes from the training part alone, so the held-out grants are an honest test of it
    assert meta["margin_rel"]["from"] == "5-fold CV of the training part" and meta["refit_on_all_rows"] is True
    held = meta["heldout"]
    assert held["all"]["n"] == meta["split"]["test"] and 0 <= held["all"]["under_frac"] <= 1
    assert set(held["by_batch_not_mlp"]) == {"1-16", "17-64", "65-128", ">=129"}
    assert meta["mem_target"] == "log_ratio_to_physics" and meta["margin_quantile"] == 0.95


def test_heldout_evaluation_of_the_ratio_sizer(shared_data: Path) -> None:
    report = heldout_evaluation(shared_data, gpumemnet_rows=150, params={"n_estimators": 4},
                                mem_target="log_ratio_to_physics", quantile=0.95)
    assert report["mem_target"] == "log_ratio_to_physics" and report["margin_quantile"] == 0.95
    assert report["all"]["n"] == report["split"]["test"] and report["all"]["mape"] > 0
    assert sum(v["n"] for v in report["by_batch"].values()) == report["all"]["n"]


def test_comparison_is_deterministic_on_a_subset(shared_data: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.paper_table import compare
    from vgpu.manager.regressors import BiGRUSettings

    kw = {"subset": 240, "models": ("Transformer-BiGRU", "LightGBM", "DecisionTree"), "bigru": BiGRUSettings(epochs=2)}
    a, b = compare(shared_data, **kw), compare(shared_data, **kw)  # type: ignore[arg-type]
    assert a["rows"] == b["rows"]
    assert a["split"] == "70/30" and a["n_train"] + a["n_test"] == 240 and a["n_train"] == 168
    assert {r["target"] for r in a["rows"]} == {"peak_mem_mib", "sm_util_pct"}
    assert set(a["rows"][0]) == {"model", "target", "mse", "rmse", "mae", "mape", "r2"}
    assert all(r["rmse"] == pytest.approx(math.sqrt(r["mse"]), rel=1e-3) for r in a["rows"])
    json.dumps(a)


# ---- `vgpu size` ---------------------------------------------------------------------------------
def test_vgpu_size_prints_the_shipped_models_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    from vgpu.cli import main as vgpu_main

    args = ["size", "--model-type", "resnet50", "--batch-size", "64", "--input-size", "224", "--capacity-mib", "40960"]
    assert vgpu_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = ColdStartSizer.load().size(JobConfig("resnet50", batch_size=64, input_size=224), 40960.0)
    assert out["grant_mib"] == pytest.approx(want.grant_mib) and out["family"] == "cnn" and out["fits"] is True
    assert out["grant_mib"] == pytest.approx(out["mem_mib"] + out["margin_mib"])
    assert vgpu_main(args) == 0
    text = capsys.readouterr().out
    assert f"grant {want.grant_mib:.0f} MiB" in text and "resnet50 (cnn, " in text
    assert vgpu_main(["size", "--model-type", "resnet50", "--batch-size", "0"]) == 2
    assert "batch_size must be >= 1" in capsys.readouterr().err
