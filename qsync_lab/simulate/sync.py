"""DDP's gradient synchronisation: what it adds to the compute stream and the allreduce replay.

On several ranks DDP's reducer works on each rank's compute stream as well:

* before the forward, rank 0 broadcasts the model's buffers (``broadcast_buffers=True``);
* once every gradient of a bucket is final, the reducer copies them into the bucket and
  divides the bucket by the world size (two read-write passes of the bucket,
  ``ddp:pack:bucket<k>``), then hands it to the allreduce;
* after the last allreduce it copies the averaged buckets back into the gradients
  (``ddp:unpack``, one pass), before the optimizer step.

Copies are costed as an ``fp32 -> fp32`` conversion (a fitted line where the profile
measured in-place copies, else the roofline).

:func:`replay_allreduces` runs the allreduce stream: bucket ``k`` starts once every class
of ranks has packed it and allreduce ``k-1`` has ended. On a CPU rank the collective runs
on the cores that compute (gloo reduces and copies in the rank's own threads), so there
the allreduce also delays the compute stream: every compute event that starts after the
allreduce starts moves later by its duration (:meth:`AllreduceReplay.delayed`); the event
it interrupts lasts that much longer. A GPU's compute stream is not delayed.

Example::

    >>> import numpy as np
    >>> replay = replay_allreduces([np.array([10.0, 30.0])], [40.0], [5.0, 5.0], [True])
    >>> replay.begin_us.tolist(), replay.end_us, replay.backward_end_us
    ([10.0, 35.0], 40.0, (50.0,))
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qsync_lab.costs import Cost, CostModel
from qsync_lab.devices import DeviceSpec
from qsync_lab.precision import Precision

__all__ = ["AllreduceReplay", "DdpWork", "copy_time_us", "replay_allreduces",
           "shares_cores"]

_FP32_BYTES = 4


@dataclass(frozen=True, eq=False)
class DdpWork:
    """What DDP adds to each rank's compute stream (see the module docstring).

    Attributes:
        broadcast: the buffer broadcast before the forward (None: no buffers).
        bucket_ops: per bucket, the op index whose backward makes each of its gradients
            final (None: an unused parameter, final at the end of the backward).
        bucket_bytes: bytes per bucket, in reduction order.
    """

    broadcast: Cost | None
    bucket_ops: tuple[tuple[int | None, ...], ...]
    bucket_bytes: np.ndarray

    def last_op(self, bucket: int) -> int | None:
        """The op whose backward completes ``bucket`` (the lowest index: the backward runs
        in reverse); None when it waits for the end of the backward."""
        ops = self.bucket_ops[bucket]
        return None if not ops or None in ops else min(ops)


def copy_time_us(nbytes: float, costs: CostModel, device: DeviceSpec) -> Cost:
    """One read-write pass over ``nbytes`` of fp32 (an in-place copy) on ``device``."""
    return costs.cast_time_us(nbytes / _FP32_BYTES, Precision.FP32, Precision.FP32, device)


def shares_cores(device: DeviceSpec) -> bool:
    """True when collectives run on the cores that compute (a CPU rank with gloo)."""
    return device.kind == "cpu"


@dataclass(frozen=True, eq=False)
class AllreduceReplay:
    """When each allreduce runs, and how the CPU classes' compute streams are delayed.

    Attributes:
        begin_us: start of each bucket's allreduce.
        dur_us: their durations.
        end_us: end of the last allreduce (0 without buckets).
        backward_end_us: per class, the end of its backward after the delays.
        delays: per class, (original time, delay) of each allreduce that delays it.
    """

    begin_us: np.ndarray
    dur_us: np.ndarray
    end_us: float
    backward_end_us: tuple[float, ...]
    delays: tuple[tuple[np.ndarray, np.ndarray], ...]

    def delayed(self, index: int, start_us: np.ndarray, dur_us: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """Class ``index``'s compute events (start, duration) with its delays applied."""
        at, delay = self.delays[index]
        if not len(at):
            return start_us, dur_us
        total = np.concatenate(([0.0], np.cumsum(delay)))
        before = total[np.searchsorted(at, start_us, side="right")]  # at or before the start
        inside = total[np.searchsorted(at, start_us + dur_us, side="left")] - before
        return start_us + before, dur_us + np.maximum(inside, 0.0)


def replay_allreduces(ready_us: Sequence[np.ndarray], backward_end_us: Sequence[float],
                      allreduce_us: Sequence[float], shared: Sequence[bool]) -> AllreduceReplay:
    """Replay the allreduce stream over the classes of ranks.

    Args:
        ready_us: per class, when each bucket is packed (its own timeline, no delays).
        backward_end_us: per class, the end of its backward (no delays).
        allreduce_us: each bucket's allreduce duration.
        shared: per class, whether its compute shares the cores with the collectives
            (:func:`shares_cores`).
    """
    at: list[list[float]] = [[] for _ in ready_us]
    delay: list[list[float]] = [[] for _ in ready_us]
    begin = []
    end_us = 0.0
    ready_lists = [r.tolist() for r in ready_us]
    for k, dur in enumerate(allreduce_us):
        ready = max(_shifted(r[k], a, d) for r, a, d in zip(ready_lists, at, delay))
        start = max(ready, end_us)
        for c, is_shared in enumerate(shared):
            if is_shared:
                at[c].append(start - sum(delay[c]))
                delay[c].append(dur)
        begin.append(start)
        end_us = start + dur
    return AllreduceReplay(
        np.array(begin, float), np.array(allreduce_us, float), end_us,
        tuple(_shifted(b, a, d) for b, a, d in zip(backward_end_us, at, delay)),
        tuple((np.array(a, float), np.array(d, float)) for a, d in zip(at, delay)))


def _shifted(t: float, at: list[float], delay: list[float]) -> float:
    """The end of an event that ended at ``t`` before the delays."""
    return t + sum(d for a, d in zip(at, delay) if a < t) if delay else t
