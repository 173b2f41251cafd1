"""What a deep-learning job is: `JobConfig`, the one type for it across vgpu.

It mirrors the `JobConfig` message of proto/vgpu/v1/allocator.proto (`from_proto` / `to_proto`). The
allocator takes it with a request (allocator/core.py `AllocationRequest.job`) and hands it to the
cold-start sizer (manager/coldstart.py), which encodes it for its model (manager/jobprofiles.py); it
lives here, in the core package, because the allocator may not import the manager.

Values that cannot describe a job raise `InvalidJobConfig` (a ValueError; the RPC edge answers
INVALID_ARGUMENT with its message, allocator/errors.py).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "amp")
MODES: tuple[str, ...] = ("train", "infer")
OPTIMIZERS: tuple[str, ...] = ("unknown", "none", "sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta")
# The longest text a job's field may hold, in characters: model names ("meta-llama/Llama-2-70b-chat-hf")
# are far shorter. Each field ends up in log records, sizing notes and error messages, and the
# sizer's name matching reads it whole, so a longer one is refused before anything reads it.
MAX_JOB_TEXT_CHARS = {"model_type": 256, "precision": 32, "optimizer": 32, "mode": 32}
# The largest value of each integer field: the proto's types (allocator.proto JobConfig: uint64
# param_count, uint32 the others), beyond which the message cannot carry the job at all.
JOB_INT_MAX = {"param_count": 2**64 - 1, "batch_size": 2**32 - 1, "input_size": 2**32 - 1, "num_layers": 2**32 - 1}
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
        for name, most in MAX_JOB_TEXT_CHARS.items():
            text = getattr(self, name)
            if not isinstance(text, str):
                raise InvalidJobConfig(f"{name} must be text, got {type(text).__name__}")
            if len(text) > most:
                raise InvalidJobConfig(f"{name} is {len(text)} characters long; at most {most} are allowed")
        for name, most in JOB_INT_MAX.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidJobConfig(f"{name} must be an integer, got {value!r}")
            if value < 0:
                raise InvalidJobConfig(f"{name} must be >= 0, got {value}")
            if value > most:
                bits = 64 if most == 2**64 - 1 else 32
                raise InvalidJobConfig(f"{name} must be within 0..{most} (the message's {bits}-bit field), got {value}")
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
    def optimizer_unknown(self) -> bool:
        """Whether an optimizer was given that is not one of OPTIMIZERS (a typo, or one the sizer
        does not know): sized as one not given, but said as unknown, not as missing."""
        return self.optimizer.strip().lower() not in (*OPTIMIZERS, "")

    def optimizer_note(self) -> str | None:
        """What sizing this job says of its optimizer: `unknown_optimizer_note` where a training job
        gives one that is not known (sized as one not given), else None (inference has no optimizer)."""
        train = self.mode_norm == "train"
        return unknown_optimizer_note(self.optimizer) if train and self.optimizer_unknown else None

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


# --- what physics says a job needs ------------------------------------------------------------------------
#
# A job's memory is its weights, and in training their gradients and the optimizer's state, plus the
# activations its batch keeps alive, plus the CUDA context of the process. The first three follow from the
# parameter count and the precision; activations from the architecture, the batch and the input size.
# These figures bound the learned cold-start model from below and stand in for it outside the ranges its
# training data covers (manager/coldstart.py).

MIB = 1024 * 1024
# A PyTorch process's CUDA context and allocator slack (about 0.5-1.5 GB measured on A100/H100; the
# smallest job in the sizer's training data peaks at 1443 MiB).
CUDA_CONTEXT_MIB = 1000.0
# Bytes per weight as stored for the forward pass. AMP (autocast) keeps fp32 weights.
WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "amp": 4.0}
# Training, per parameter, on top of the weights: gradients (the weights' precision), and for 16-bit
# weights an fp32 master copy (mixed-precision training: 2 + 2 + 4 + Adam's 8 = 16 bytes, as in ZeRO).
TRAIN_EXTRA_BYTES = {"fp32": 4.0, "fp16": 2.0 + 4.0, "bf16": 2.0 + 4.0, "amp": 4.0}
# Optimizer state per parameter, fp32: Adam/AdamW keep two moments (8 B), momentum SGD, RMSprop and
# Adagrad one (4 B). Not given: Adam is assumed (the most common, and the largest), and said.
OPTIMIZER_BYTES = {"adam": 8.0, "adamw": 8.0, "adadelta": 8.0, "sgd": 4.0, "rmsprop": 4.0, "adagrad": 4.0,
                   "none": 0.0, "unknown": 8.0}
# Bytes per activation value.
ACTIVATION_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "amp": 2.0}
# Inference keeps only the live layers' activations, not every layer's for the backward pass.
INFER_ACTIVATION_FRACTION = 0.1


@dataclass(frozen=True)
class KnownModel:
    """A public model's size. CNNs: `act_mib_per_sample`, the activations one sample keeps for the
    backward pass in fp32 at `input_size` (scaled by the input's area); transformers: layers, hidden
    size and heads, whose activations follow Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", eq. 2)."""

    param_count: int
    input_size: int  # image side (px) or sequence length (tokens) the model is usually run at
    num_layers: int = 0
    hidden: int = 0
    heads: int = 0
    act_mib_per_sample: float = 0.0  # CNNs, fp32 training, at input_size
    decoder: bool = False  # keeps a KV cache when it generates
    patch: int = 0  # ViT: tokens = (input / patch)^2 + 1


# Parameter counts from the models' papers and model cards (torchvision, Hugging Face). CNN activations
# per sample from the batch sizes NVIDIA's DeepLearningExamples fit in 16 GB (ResNet-50 fp32: 112) and
# the feature-map sizes of each architecture relative to ResNet-50.
KNOWN_MODELS: dict[str, KnownModel] = {
    "resnet18": KnownModel(11_689_512, 224, 18, act_mib_per_sample=35.0),
    "resnet34": KnownModel(21_797_672, 224, 34, act_mib_per_sample=50.0),
    "resnet50": KnownModel(25_557_032, 224, 50, act_mib_per_sample=105.0),
    "resnet101": KnownModel(44_549_160, 224, 101, act_mib_per_sample=160.0),
    "resnet152": KnownModel(60_192_808, 224, 152, act_mib_per_sample=220.0),
    "vgg16": KnownModel(138_357_544, 224, 16, act_mib_per_sample=150.0),
    "vgg19": KnownModel(143_667_240, 224, 19, act_mib_per_sample=165.0),
    "alexnet": KnownModel(61_100_840, 224, 8, act_mib_per_sample=8.0),
    "mobilenetv2": KnownModel(3_504_872, 224, 53, act_mib_per_sample=55.0),
    "mobilenetv3large": KnownModel(5_483_032, 224, 62, act_mib_per_sample=40.0),
    "efficientnetb0": KnownModel(5_288_548, 224, 82, act_mib_per_sample=80.0),
    "densenet121": KnownModel(7_978_856, 224, 121, act_mib_per_sample=130.0),
    "inceptionv3": KnownModel(27_161_264, 299, 48, act_mib_per_sample=120.0),
    "vitb16": KnownModel(86_567_656, 224, 12, 768, 12, patch=16),
    "vitb32": KnownModel(88_224_232, 224, 12, 768, 12, patch=32),
    "vitl16": KnownModel(304_326_632, 224, 24, 1024, 16, patch=16),
    "vith14": KnownModel(632_045_800, 224, 32, 1280, 16, patch=14),
    "bertbase": KnownModel(110_000_000, 128, 12, 768, 12),
    "bertlarge": KnownModel(340_000_000, 128, 24, 1024, 16),
    "distilbert": KnownModel(66_000_000, 128, 6, 768, 12),
    "robertabase": KnownModel(125_000_000, 128, 12, 768, 12),
    "robertalarge": KnownModel(355_000_000, 128, 24, 1024, 16),
    "t5small": KnownModel(60_000_000, 512, 12, 512, 8),
    "t5base": KnownModel(220_000_000, 512, 24, 768, 12),
    "t5large": KnownModel(770_000_000, 512, 48, 1024, 16),
    "gpt2": KnownModel(124_000_000, 1024, 12, 768, 12, decoder=True),
    "gpt2medium": KnownModel(355_000_000, 1024, 24, 1024, 16, decoder=True),
    "gpt2large": KnownModel(774_000_000, 1024, 36, 1280, 20, decoder=True),
    "gpt2xl": KnownModel(1_558_000_000, 1024, 48, 1600, 25, decoder=True),
    "llama7b": KnownModel(6_738_000_000, 2048, 32, 4096, 32, decoder=True),
    "llama13b": KnownModel(13_016_000_000, 2048, 40, 5120, 40, decoder=True),
    "llama30b": KnownModel(32_529_000_000, 2048, 60, 6656, 52, decoder=True),
    "llama65b": KnownModel(65_286_000_000, 2048, 80, 8192, 64, decoder=True),
    "llama70b": KnownModel(68_977_000_000, 4096, 80, 8192, 64, decoder=True),
    "mistral7b": KnownModel(7_242_000_000, 4096, 32, 4096, 32, decoder=True),
}
_ALIASES = {
    "bert": "bertbase", "bertbaseuncased": "bertbase", "bertbasecased": "bertbase",
    "bertlargeuncased": "bertlarge", "bertlargecased": "bertlarge", "distilbertbaseuncased": "distilbert",
    "vitbase16": "vitb16", "vitbasepatch16224": "vitb16", "vitlarge16": "vitl16", "gpt2small": "gpt2",
    "llama27b": "llama7b", "llama213b": "llama13b", "llama270b": "llama70b", "llama38b": "llama7b",
    "mobilenet": "mobilenetv2", "efficientnet": "efficientnetb0", "resnet": "resnet50", "vgg": "vgg16",
}


def known_model(model_type: str) -> tuple[str, KnownModel] | None:
    """The table entry for a model type, by its name without case, dashes, dots or underscores
    ("vit_b_16", "ViT-B/16" -> vitb16; "Llama-2-7b-hf" -> llama7b); None when it is not in the table."""
    key = re.sub(r"[^a-z0-9]", "", model_type.lower())
    key = re.sub(r"(hf|chat|instruct)$", "", key)
    key = _ALIASES.get(key, key)
    entry = KNOWN_MODELS.get(key)
    return None if entry is None else (key, entry)


def nearest_known_models(model_type: str, n: int = 3) -> list[str]:
    """The table's model names closest to an unknown `model_type` (difflib; a typo such as
    "resnet5O" gives resnet50 first), at most `n`, possibly none."""
    key = re.sub(r"[^a-z0-9]", "", model_type.lower())
    return difflib.get_close_matches(key, [*KNOWN_MODELS, *_ALIASES], n=n, cutoff=0.6)



def unknown_model_note(model_type: str, *, param_count_arg: str = "--param-count") -> str:
    """What is said of a model type the table does not know, with the nearest names it does
    (`param_count_arg`: how the caller's interface names the parameter count)."""
    near = nearest_known_models(model_type)
    hint = f"did you mean {', '.join(near)}?" if near else "no known type is close."
    return (f"unknown model type {model_type!r} (not in vgpu.jobs.KNOWN_MODELS): {hint} "
            f"Sized from its family's defaults; give {param_count_arg} for a model of your own")


def unknown_optimizer_note(optimizer: str) -> str:
    """What is said of an optimizer given but not known (sized as Adam, as one not given)."""
    known = ", ".join(o for o in OPTIMIZERS if o != "unknown")
    return f"unknown optimizer {optimizer!r} (known: {known}): assumed Adam (8 bytes of state per parameter)"


# For a model not in the table: the input size its family usually runs at.
_FAMILY_INPUT = {"cnn": 224, "vit": 224, "transformer": 512, "gan": 256}


@dataclass(frozen=True)
class PhysicsEstimate:
    """What a job needs by construction, in MiB. `floor_mib` holds what cannot be avoided (weights,
    gradients, optimizer state, context, and half the estimated activations); `estimate_mib` the
    full figure. `missing` names the inputs that were not given and were assumed (see `assumed`);
    `unknown` those that were given but not known, and were assumed as if not given (`notes` says
    what was assumed for them)."""

    weights_mib: float
    gradients_mib: float  # gradients and fp32 master weights
    optimizer_mib: float
    activations_mib: float
    context_mib: float
    param_count: int
    param_source: str  # "given", "known model <name>" or "none"
    missing: tuple[str, ...]
    assumed: tuple[str, ...]
    unknown: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def estimate_mib(self) -> float:
        return self.weights_mib + self.gradients_mib + self.optimizer_mib + self.activations_mib + self.context_mib

    @property
    def floor_mib(self) -> float:
        return self.weights_mib + self.gradients_mib + self.optimizer_mib + 0.5 * self.activations_mib + self.context_mib


def physics_estimate(job: JobConfig) -> PhysicsEstimate:
    """The memory `job` needs from its parameters, precision, mode, optimizer, batch and input size."""
    missing: list[str] = []
    assumed: list[str] = []
    unknown: list[str] = []
    notes: list[str] = []
    found = known_model(job.model_type)
    entry = found[1] if found else None
    family = job.family
    if job.param_count > 0:
        params, source = job.param_count, "given"
    elif entry is not None:
        params, source = entry.param_count, f"known model {found[0]}"  # type: ignore[index]
    else:
        params, source = 0, "none"
        missing.append("param_count")
    precision, train = job.precision_norm, job.mode_norm == "train"
    weights = params * WEIGHT_BYTES[precision] / MIB
    grads = params * TRAIN_EXTRA_BYTES[precision] / MIB if train else 0.0
    optimizer = 0.0
    if train:
        opt = job.optimizer_norm
        said = job.optimizer_note()
        if said is not None:
            unknown.append("optimizer")
            notes.append(said)
        elif opt == "unknown":
            missing.append("optimizer")
            assumed.append("Adam (8 bytes of state per parameter)")
        optimizer = params * OPTIMIZER_BYTES[opt] / MIB

    if job.input_size > 0:
        size = job.input_size
    elif entry is not None:
        size = entry.input_size
        assumed.append(f"input_size {size} ({found[0]}'s usual)")  # type: ignore[index]
    else:
        size = _FAMILY_INPUT.get(family, 0)
        missing.append("input_size")
        if size:
            assumed.append(f"input_size {size} (usual for {family})")
    act_bytes = ACTIVATION_BYTES[precision]
    batch = max(job.batch_size, 1)
    activations = 0.0
    transformer = family in ("transformer", "vit") or (entry is not None and entry.hidden > 0)
    if transformer and params > 0 and size > 0:
        layers = job.num_layers or (entry.num_layers if entry else 0)
        hidden = entry.hidden if entry and entry.hidden else 0
        if not hidden:
            if layers:
                hidden = int(math.sqrt(params / (12 * layers)))
            else:  # the usual aspect ratio, hidden ~ 128 x layers: params ~ 12 L h^2
                hidden = int((params * 128 / 12) ** (1 / 3))
                layers = max(1, hidden // 128)
                missing.append("num_layers")
                assumed.append(f"{layers} layers of hidden size {hidden} (from param_count)")
        heads = entry.heads if entry and entry.heads else max(1, hidden // 64)
        seq = size
        if family == "vit" or (entry is not None and entry.patch):
            patch = entry.patch if entry and entry.patch else 16
            seq = (size // patch) ** 2 + 1
        # Korthikanti et al. eq. 2 counts 16-bit activations: s*b*h*(34 + 5*a*s/h) bytes per layer.
        per_layer = seq * batch * hidden * (34 + 5 * heads * seq / hidden) * act_bytes / 2
        if train:
            activations = layers * per_layer / MIB
        else:
            activations = per_layer / MIB  # one layer live at a time
            if entry is not None and entry.decoder:
                activations += 2 * layers * seq * batch * hidden * act_bytes / MIB  # the KV cache
    elif family in ("cnn", "gan") and size > 0:
        per_sample = entry.act_mib_per_sample if entry and entry.act_mib_per_sample else 0.0
        if not per_sample:
            per_sample = KNOWN_MODELS["resnet50"].act_mib_per_sample
            assumed.append("ResNet-50's activations per sample")
        ref = entry.input_size if entry else 224
        activations = batch * per_sample * (size / ref) ** 2 * act_bytes / 4.0
        if not train:
            activations *= INFER_ACTIVATION_FRACTION
    elif params == 0 or size == 0:
        missing.append("architecture (a known model_type)")
    return PhysicsEstimate(
        weights_mib=weights,
        gradients_mib=grads,
        optimizer_mib=optimizer,
        activations_mib=activations,
        context_mib=CUDA_CONTEXT_MIB,
        param_count=params,
        param_source=source,
        missing=tuple(dict.fromkeys(missing)),
        assumed=tuple(assumed),
        unknown=tuple(unknown),
        notes=tuple(notes),
    )


__all__ = [
    "FAMILIES",
    "KNOWN_MODELS",
    "MODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "InvalidJobConfig",
    "JobConfig",
    "KnownModel",
    "PhysicsEstimate",
    "known_model",
    "model_family",
    "physics_estimate",
    "unknown_optimizer_note",
]
