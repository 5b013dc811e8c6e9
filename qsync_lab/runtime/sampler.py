"""Per-rank batches of uneven sizes that together form one global batch per step.

Every step takes the next ``sum(batch_sizes)`` indices of a seeded permutation of the
training set (a new permutation per epoch, the last incomplete global batch dropped) and
gives rank ``r`` the slice ``[offset_r, offset_r + batch_sizes[r])``. The position is the
global step alone, so a checkpoint's step is all a resumed run needs to continue exactly.

Example::

    >>> sampler = UnevenBatchSampler(num_samples=10, batch_sizes=(3, 1), seed=0)
    >>> sampler.steps_per_epoch
    2
    >>> [sampler.indices(step=0, rank=r).tolist() for r in (0, 1)]
    [[4, 1, 7], [5]]
    >>> sampler.global_indices(step=0).tolist()
    [4, 1, 7, 5]
"""

from collections.abc import Sequence
from functools import lru_cache

import torch

from qsync_lab.errors import QSyncError

__all__ = ["UnevenBatchSampler", "loss_weight"]


class UnevenBatchSampler:
    """Indices of each rank's batch at each global step (see the module docstring)."""

    def __init__(self, num_samples: int, batch_sizes: Sequence[int], seed: int = 0) -> None:
        if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
            raise QSyncError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
        self.batch_sizes = tuple(int(b) for b in batch_sizes)
        self.global_batch = sum(self.batch_sizes)
        if num_samples < self.global_batch:
            raise QSyncError(f"the training set has {num_samples} samples, fewer than one global "
                             f"batch ({self.global_batch}); use smaller batch sizes or more data")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.offsets = tuple(sum(self.batch_sizes[:r]) for r in range(len(self.batch_sizes)))
        self._permutation = lru_cache(maxsize=2)(self._epoch_permutation)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def _epoch_permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def global_indices(self, step: int) -> torch.Tensor:
        """All ranks' indices at ``step``, in rank order (the global batch)."""
        epoch, within = divmod(int(step), self.steps_per_epoch)
        start = within * self.global_batch
        return self._permutation(epoch)[start:start + self.global_batch]

    def indices(self, step: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s indices at ``step``."""
        offset = self.offsets[rank]
        return self.global_indices(step)[offset:offset + self.batch_sizes[rank]]


def loss_weight(batch_sizes: Sequence[int], rank: int) -> float:
    """Factor on rank ``rank``'s mean loss so that DDP's gradient average over the ranks
    equals the gradient of the mean loss over the global batch.

    DDP averages: ``g = (1/W) Σ_r w_r g_r`` with ``g_r`` the gradient of rank r's mean
    loss; with ``w_r = W b_r / B`` this is ``Σ_r (b_r/B) g_r``, the global-batch gradient.

    Example::

        >>> [loss_weight((3, 1), r) for r in (0, 1)]
        [1.5, 0.5]
    """
    return len(batch_sizes) * batch_sizes[rank] / sum(batch_sizes)
