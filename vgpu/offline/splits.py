"""A deterministic train / val / test split by application, shared by training and evaluation.

The rule: an application's *run family* is hashed (SHA-256, stable across machines and Python
versions, unlike `hash()`), and the hash's first 8 bytes, scaled to [0, 1), pick the split:
below 0.70 -> "train", below 0.85 -> "val", else "test".

The run family is the application id without a trailing MIG slice component. MIGPerf benchmarks
every (model, batch size[, sequence length]) on four slices; those four runs share their memory
footprint almost exactly and differ mainly in compute share, so putting one slice in training and
another in the test split would leak the answer. The family keeps the whole sweep of one
configuration in one split (`migperf/A100-80g/train-cv/resnet50/bs64/3g.40gb` ->
`migperf/A100-80g/train-cv/resnet50/bs64`). A repeated run (`.../<slice>/run2`) joins its family.
Ids of other sources (pods, GPUs) are their own family.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Literal, TypeVar

Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")
TRAIN_FRACTION = 0.70
VAL_FRACTION = 0.15  # the rest (0.15) is test

_MIG_TAIL = re.compile(r"/\d+g\.\d+gb(\+me)?(/run\d+)?$")

T = TypeVar("T")


def run_family(app_id: str) -> str:
    """The group an application is split with (see the module docstring)."""
    return _MIG_TAIL.sub("", app_id)


def split_fraction(app_id: str) -> float:
    """The family's stable position in [0, 1)."""
    digest = hashlib.sha256(run_family(app_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(app_id: str) -> Split:
    u = split_fraction(app_id)
    if u < TRAIN_FRACTION:
        return "train"
    if u < TRAIN_FRACTION + VAL_FRACTION:
        return "val"
    return "test"


def select(apps: Mapping[str, T], split: Split | Literal["all"]) -> dict[str, T]:
    """The entries of `apps` (keyed by app id) that fall in `split` ("all" keeps every one)."""
    if split == "all":
        return dict(apps)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS} or 'all'")
    return {k: v for k, v in apps.items() if split_of(k) == split}


def split_ids(app_ids: Iterable[str]) -> dict[Split, list[str]]:
    """Every id in its split, each list sorted."""
    out: dict[Split, list[str]] = {s: [] for s in SPLITS}
    for app in app_ids:
        out[split_of(app)].append(app)
    for ids in out.values():
        ids.sort()
    return out
