"""The model registry: names, builders, example batches and losses.

Keyword arguments are shared by :func:`get_model` and :func:`example_batch`, so one dict
serves both; each call uses the arguments that concern it (``get_model`` accepts and ignores
data-shape ones such as ``image_size`` and ``seq_len``).

Example::

    >>> from qsync_lab.models import example_batch, get_model, model_spec
    >>> model = get_model("resnet18", num_classes=10)
    >>> inputs, target = example_batch("resnet18", 2, num_classes=10, image_size=32)
    >>> loss = model_spec("resnet18").loss_fn()(model(*inputs), target)
    >>> tuple(inputs[0].shape), tuple(target.shape)
    ((2, 3, 32, 32), (2,))
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qsync_lab.errors import QSyncError
from qsync_lab.models.bert import bert_base, bert_mini
from qsync_lab.models.checks import positive_int
from qsync_lab.models.resnet import resnet18, resnet50
from qsync_lab.models.small import DIGITS_IMAGE_SIZE, digits_cnn, digits_mlp
from qsync_lab.models.vgg import vgg16_bn

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]
MIN_IMAGE_SIZE = 32
IMAGE_TASK = "image_classification"
SEQUENCE_TASK = "sequence_classification"
VECTOR_TASK = "vector_classification"


@dataclass(frozen=True)
class ModelSpec:
    """One registered model.

    Attributes:
        name: registry name.
        description: one line for listings.
        task: kind of data and target, e.g. ``"image_classification"``.
        build: ``build(**model_kwargs) -> nn.Module``.
        make_batch: ``make_batch(batch_size, generator, **batch_kwargs) -> (inputs, target)``.
        loss_fn: ``loss_fn() -> nn.Module`` computing ``loss(model(*inputs), target)``.
    """

    name: str
    description: str
    task: str
    build: Callable[..., nn.Module]
    make_batch: Callable[..., Batch]
    loss_fn: Callable[[], nn.Module] = nn.CrossEntropyLoss

    @property
    def defaults(self) -> dict[str, Any]:
        """Every keyword argument the model or its batches accept, with its default."""
        defaults = _keyword_defaults(self.build)
        for name, value in _keyword_defaults(self.make_batch).items():
            defaults.setdefault(name, value)
        return defaults


def _keyword_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    parameters = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _labels(batch_size: int, num_classes: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(positive_int("num_classes", num_classes), (batch_size,), generator=generator)


def imagenet_batch(
    batch_size: int, generator: torch.Generator, *, num_classes: int = 1000, image_size: int = 224
) -> Batch:
    """Standard-normal RGB images (B, 3, image_size, image_size) and class labels (B,)."""
    if positive_int("image_size", image_size) < MIN_IMAGE_SIZE:
        raise QSyncError(
            f"image_size must be at least {MIN_IMAGE_SIZE}, got {image_size}; pass a larger image_size"
        )
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    return (images,), _labels(batch_size, num_classes, generator)


def digits_image_batch(batch_size: int, generator: torch.Generator, *, num_classes: int = 10) -> Batch:
    """Standard-normal 8x8 one-channel images (B, 1, 8, 8) and class labels (B,)."""
    images = torch.randn(batch_size, 1, DIGITS_IMAGE_SIZE, DIGITS_IMAGE_SIZE, generator=generator)
    return (images,), _labels(batch_size, num_classes, generator)


def vector_batch(
    batch_size: int, generator: torch.Generator, *, in_features: int = 40, num_classes: int = 10
) -> Batch:
    """Standard-normal feature vectors (B, in_features) and class labels (B,)."""
    features = torch.randn(batch_size, positive_int("in_features", in_features), generator=generator)
    return (features,), _labels(batch_size, num_classes, generator)


def token_batch(
    batch_size: int,
    generator: torch.Generator,
    *,
    vocab_size: int = 30522,
    max_positions: int = 512,
    num_labels: int = 2,
    seq_len: int = 128,
) -> Batch:
    """Uniform token ids (B, seq_len) in [0, vocab_size) and class labels (B,)."""
    if positive_int("seq_len", seq_len) > positive_int("max_positions", max_positions):
        raise QSyncError(
            f"seq_len {seq_len} exceeds max_positions {max_positions}; "
            f"use seq_len <= {max_positions} or raise max_positions"
        )
    vocab_size = positive_int("vocab_size", vocab_size)
    input_ids = torch.randint(vocab_size, (batch_size, seq_len), generator=generator)
    return (input_ids,), _labels(batch_size, num_labels, generator)


_SPECS = (
    ModelSpec("resnet18", "ResNet-18, ImageNet-style (11.7M params)", IMAGE_TASK, resnet18, imagenet_batch),
    ModelSpec("resnet50", "ResNet-50 v1.5 (25.6M params)", IMAGE_TASK, resnet50, imagenet_batch),
    ModelSpec("vgg16_bn", "VGG-16 with BatchNorm (138.4M params)", IMAGE_TASK, vgg16_bn, imagenet_batch),
    ModelSpec("bert_base", "BERT-base (109.5M params) + head", SEQUENCE_TASK, bert_base, token_batch),
    ModelSpec("bert_mini", "BERT-mini: 4 layers, hidden 256, 4 heads", SEQUENCE_TASK, bert_mini, token_batch),
    ModelSpec("digits_cnn", "Small CNN for 8x8 digits", IMAGE_TASK, digits_cnn, digits_image_batch),
    ModelSpec("digits_mlp", "MLP for 8x8 digits or MNIST-1D", VECTOR_TASK, digits_mlp, vector_batch),
)
_REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}


def list_models() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_REGISTRY)


def model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` called ``name`` (case-insensitive), or QSyncError listing the choices."""
    spec = _REGISTRY.get(str(name).strip().lower())
    if spec is None:
        raise QSyncError(f"unknown model {name!r}; choose one of: {', '.join(list_models())}")
    return spec


def _resolve(spec: ModelSpec, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Defaults overridden by ``kwargs``; QSyncError on a name the model does not take."""
    defaults = spec.defaults
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        choices = ", ".join(sorted(defaults))
        raise QSyncError(f"unknown argument {unknown[0]!r} for model {spec.name!r}; choose from: {choices}")
    return {**defaults, **kwargs}


def _call_with_own_kwargs(fn: Callable[..., Any], values: dict[str, Any], *args: Any) -> Any:
    own = _keyword_defaults(fn)
    return fn(*args, **{name: values[name] for name in own})


def get_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the model ``name`` with freshly initialised weights (seed with ``torch.manual_seed``).

    Example::

        >>> from qsync_lab.models import get_model
        >>> get_model("digits_mlp", in_features=40).fc1.in_features
        40
    """
    spec = model_spec(name)
    return _call_with_own_kwargs(spec.build, _resolve(spec, kwargs))


def example_batch(name: str, batch_size: int = 2, *, seed: int = 0, **kwargs: Any) -> Batch:
    """A random ``(inputs, target)`` batch for ``get_model(name, **kwargs)``, the same for a seed.

    Example::

        >>> from qsync_lab.models import example_batch
        >>> (input_ids,), target = example_batch("bert_mini", 4, seq_len=16)
        >>> tuple(input_ids.shape), target.dtype
        ((4, 16), torch.int64)
    """
    spec = model_spec(name)
    values = _resolve(spec, kwargs)
    batch_size = positive_int("batch_size", batch_size)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise QSyncError(f"seed must be an integer, got {seed!r}; pass e.g. seed=0")
    generator = torch.Generator().manual_seed(seed)
    return _call_with_own_kwargs(spec.make_batch, values, batch_size, generator)
