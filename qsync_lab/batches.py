"""A batch's inputs: a tuple of tensors (``model(*inputs)``) or a dict of them
(``model(**inputs)``, as Hugging Face models take a tokenizer's batch).

Example::

    >>> import torch
    >>> call_model(lambda input_ids: input_ids.sum(), {"input_ids": torch.arange(4)})
    tensor(6)
"""

from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["Inputs", "as_input_tuple", "call_model", "map_inputs"]

Inputs = "tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]"


def map_inputs(inputs, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` applied to every input tensor, keeping the tuple or dict.

    Example::

        >>> map_inputs({"ids": torch.arange(6)}, lambda t: t[:2])
        {'ids': tensor([0, 1])}
    """
    if isinstance(inputs, Mapping):
        return {name: fn(t) for name, t in inputs.items()}
    return tuple(fn(t) for t in inputs)


def call_model(model: nn.Module, inputs):
    """``model(*inputs)``, or ``model(**inputs)`` for a dict batch."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)


def as_input_tuple(inputs) -> "tuple | Mapping":
    """A single tensor as a 1-tuple; a tuple, list or dict as it is."""
    return inputs if isinstance(inputs, (tuple, list, Mapping)) else (inputs,)
