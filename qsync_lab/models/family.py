"""``Family``: how to build a model, a random batch for it and its loss.

Example::

    >>> import torch
    >>> from torch import nn
    >>> linear = Family(lambda: nn.Linear(4, 2),
    ...                 lambda n, gen: ((torch.randn(n, 4, generator=gen),),
    ...                                 torch.randint(0, 2, (n,), generator=gen)),
    ...                 nn.CrossEntropyLoss)
    >>> (x,), y = linear.batch(3, torch.Generator().manual_seed(0))
    >>> linear.loss_fn()(linear.build()(x), y).shape
    torch.Size([])
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Family"]


@dataclass(frozen=True)
class Family:
    """A model family: how to build it, a batch for it (a tuple of inputs for
    ``model(*inputs)`` or a dict for ``model(**inputs)``, and the target) and its loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple]
    loss_fn: Callable[[], nn.Module]
