"""Blocking collectives on the compressors' own process group, timed and counted.

A compressed reduction runs on one sender thread per hook state (:mod:`qsync_lab.compress.hook`),
which issues every collective of every bucket in bucket order, so all ranks issue them in
the same order. :class:`Comm` keeps the spans spent in collectives (marks of its
:attr:`~Comm.timer`: host clock, or the bucket's CUDA events) for the hook to take, and
counts the bytes this rank sends: ``2(n-1)/n`` of the tensor for a ring allreduce, ``n-1``
times it for an all-gather.

Example::

    >>> import torch, torch.distributed as dist, tempfile
    >>> dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}",
    ...                         rank=0, world_size=1)
    >>> comm = Comm(None)
    >>> comm.allreduce_sum(torch.ones(4)).tolist(), comm.world, comm.sent_bytes
    ([1.0, 1.0, 1.0, 1.0], 1, 0.0)
    >>> comm.take_spans()  # one rank: no collective ran
    []
    >>> dist.destroy_process_group()
"""

import torch
import torch.distributed as dist

from qsync_lab.timers import HostTimer

__all__ = ["Comm"]


class Comm:
    """Blocking collectives on ``group`` (None: the default group).

    Attributes:
        world, rank: the group's size and this rank's index in it.
        timer: what marks the collectives' spans (a :mod:`qsync_lab.timers` timer; the hook
            sets its bucket's).
        sent_bytes: bytes this rank sent so far (ring allreduce, ring all-gather).
    """

    def __init__(self, group) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timer = HostTimer()
        self.sent_bytes = 0.0
        self._spans: list[tuple] = []

    def take_spans(self) -> list[tuple]:
        """The (begin, end) marks of the collectives since the last call (one rank: none)."""
        spans, self._spans = self._spans, []
        return spans

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        return self._run(tensor, 2 * (self.world - 1) / self.world, dist.all_reduce, tensor,
                         op=dist.ReduceOp.SUM, group=self.group)

    def allreduce_sum_started(self, tensor: torch.Tensor):
        """Start summing ``tensor`` over the ranks, in place; returns the function that
        waits for it (the span kept is the time spent waiting)."""
        self.sent_bytes += (2 * (self.world - 1) / self.world * tensor.numel()
                            * tensor.element_size())
        if self.world == 1:
            return lambda: tensor
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

        def wait() -> torch.Tensor:
            begin = self.timer.mark()
            work.wait()
            self._spans.append((begin, self.timer.mark()))
            return tensor

        return wait

    def allreduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``tensor`` over the ranks, in place."""
        return self._run(tensor, 2 * (self.world - 1) / self.world, dist.all_reduce, tensor,
                         op=dist.ReduceOp.MAX, group=self.group)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None
                   ) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), in rank order; the
        rows of ``out`` (a contiguous tensor of ``world`` times its elements) where given."""
        if self.world == 1:
            return [tensor]
        if out is None:
            gathered = [torch.empty_like(tensor) for _ in range(self.world)]
        else:
            gathered = [row.view(tensor.shape) for row in out.view(self.world, -1).unbind(0)]
        return self._run(tensor, self.world - 1, dist.all_gather, gathered, tensor,
                         group=self.group)

    def _run(self, tensor: torch.Tensor, sent: float, collective, out, *args, **kwargs):
        """``collective(out, *args, **kwargs)``, timed and counted; ``out``."""
        if self.world > 1:
            begin = self.timer.mark()
            collective(out, *args, **kwargs)
            self._spans.append((begin, self.timer.mark()))
        self.sent_bytes += sent * tensor.numel() * tensor.element_size()
        return out
