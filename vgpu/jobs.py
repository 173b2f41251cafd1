"""What a deep-learning job is: `JobConfig`, the one type for it across vgpu.

It mirrors the `JobConfig` message of proto/vgpu/v1/allocator.proto (`from_proto` / `to_proto`). The
allocator takes it with a request (allocator/core.py `AllocationRequest.job`) and hands it to the
cold-start sizer (manager/coldstart.py), which encodes it for its model (manager/jobprofiles.py); it
lives here, in the core package, because the allocator may not import the manager.

Values that cannot describe a job raise `InvalidJobConfig` (a ValueError; the RPC edge answers
INVALID_ARGUMENT with its message, allocator/errors.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "amp")
MODES: tuple[str, ...] = ("train", "infer")
OPTIMIZERS: tuple[str, ...] = ("unknown", "none", "sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta")
FAMILIES: tuple[str, ...] = ("transformer", "vit", "cnn", "mlp", "rnn", "gan", "gnn", "embedding", "recsys", "rl", "other")

# Keyword -> family, tried in order on the lower-cased model type (first match wins). Keywords of
# four letters or more match anywhere ("cyclegan" has no such one, hence the suffix rule for "gan");
# shorter ones match a whole alphabetic token ("vit_b_16", "gpt2") so that "resnet50" is not "t5".
_FAMILY_KEYWORDS: tuple[tuple[str, str], ...] = (
    ("vision_transformer", "vit"),
    ("vit", "vit"),
    ("deepspeech", "rnn"),
    ("lstm", "rnn"),
    ("gru", "rnn"),
    ("rnn", "rnn"),
    ("gan", "gan"),
    ("gnn", "gnn"),
    ("gcn", "gnn"),
    ("graph", "gnn"),
    ("embedding", "embedding"),
    ("ncf", "recsys"),
    ("neumf", "recsys"),
    ("recommend", "recsys"),
    ("ppo", "rl"),
    ("td3", "rl"),
    ("a3c", "rl"),
    ("bert", "transformer"),
    ("gpt", "transformer"),
    ("llama", "transformer"),
    ("t5", "transformer"),
    ("minilm", "transformer"),
    ("mpnet", "transformer"),
    ("distil", "transformer"),
    ("transformer", "transformer"),
    ("resnet", "cnn"),
    ("resnext", "cnn"),
    ("vgg", "cnn"),
    ("mobilenet", "cnn"),
    ("efficientnet", "cnn"),
    ("shufflenet", "cnn"),
    ("inception", "cnn"),
    ("xception", "cnn"),
    ("densenet", "cnn"),
    ("alexnet", "cnn"),
    ("pointnet", "cnn"),
    ("moco", "cnn"),
    ("yolo", "cnn"),
    ("cnn", "cnn"),
    ("conv", "cnn"),
    ("mlp", "mlp"),
)


def _matches(keyword: str, name: str, tokens: list[str]) -> bool:
    if len(keyword) >= 4:
        return keyword in name
    if keyword == "gan":
        return any(t.endswith("gan") for t in tokens)
    if any(c.isdigit() for c in keyword):  # "t5", "td3", "a3c": delimited by non-alphanumerics
        return re.search(rf"(^|[^a-z0-9]){keyword}($|[^a-z0-9])", name) is not None
    return keyword in tokens


class InvalidJobConfig(ValueError):
    """A job configuration that cannot describe a real job (the RPC edge maps it to INVALID_ARGUMENT)."""


def model_family(model_type: str) -> str:
    """The family of a model type by keyword ("resnet50" -> "cnn"); "other" when nothing matches."""
    name = model_type.strip().lower()
    tokens = re.findall(r"[a-z]+", name)
    for keyword, family in _FAMILY_KEYWORDS:
        if _matches(keyword, name, tokens):
            return family
    return "other"


@dataclass(frozen=True)
class JobConfig:
    """A job's configuration, as in the proto message `vgpu.v1.JobConfig`.

    0 / "" mean "not given" (proto3 defaults) for param_count, input_size, num_layers, optimizer;
    precision "" is read as fp32 and mode "" as train. Impossible values raise `InvalidJobConfig`.
    """

    model_type: str
    param_count: int = 0
    batch_size: int = 1
    input_size: int = 0
    num_layers: int = 0
    precision: str = "fp32"
    optimizer: str = ""
    mode: str = "train"

    def __post_init__(self) -> None:
        for name in ("param_count", "batch_size", "input_size", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidJobConfig(f"{name} must be an integer, got {value!r}")
            if value < 0:
                raise InvalidJobConfig(f"{name} must be >= 0, got {value}")
        if self.precision.strip().lower() not in PRECISIONS + ("",):
            raise InvalidJobConfig(f"unknown precision {self.precision!r}; expected one of {', '.join(PRECISIONS)}")
        if self.mode.strip().lower() not in MODES + ("",):
            raise InvalidJobConfig(f"unknown mode {self.mode!r}; expected 'train' or 'infer'")

    @property
    def precision_norm(self) -> str:
        return self.precision.strip().lower() or "fp32"

    @property
    def mode_norm(self) -> str:
        return self.mode.strip().lower() or "train"

    @property
    def optimizer_norm(self) -> str:
        """The optimizer as one of OPTIMIZERS ("none" for inference, "unknown" when not given or not known)."""
        name = self.optimizer.strip().lower()
        if self.mode_norm == "infer" and name in ("", "none"):
            return "none"
        return name if name in OPTIMIZERS else "unknown"

    @property
    def family(self) -> str:
        return model_family(self.model_type)

    def check_sizable(self) -> None:
        """Raise `InvalidJobConfig` unless the job says enough to be sized (a model type and a batch)."""
        if not self.model_type.strip():
            raise InvalidJobConfig("model_type is empty: a job must name its model to be sized")
        if self.batch_size < 1:
            raise InvalidJobConfig(f"batch_size must be >= 1 to size a job, got {self.batch_size}")

    @classmethod
    def from_proto(cls, msg: Any) -> JobConfig:
        """From a `vgpu.v1.JobConfig` message (or anything with the same fields)."""
        return cls(
            model_type=str(msg.model_type),
            param_count=int(msg.param_count),
            batch_size=int(msg.batch_size),
            input_size=int(msg.input_size),
            num_layers=int(msg.num_layers),
            precision=str(msg.precision),
            optimizer=str(msg.optimizer),
            mode=str(msg.mode),
        )

    def to_proto(self) -> Any:
        from vgpu.v1 import allocator_pb2

        return allocator_pb2.JobConfig(
            model_type=self.model_type,
            param_count=self.param_count,
            batch_size=self.batch_size,
            input_size=self.input_size,
            num_layers=self.num_layers,
            precision=self.precision,
            optimizer=self.optimizer,
            mode=self.mode,
        )


__all__ = ["FAMILIES", "MODES", "OPTIMIZERS", "PRECISIONS", "InvalidJobConfig", "JobConfig", "model_family"]
