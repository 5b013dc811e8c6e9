"""Timeline events of one stream, stored column-wise, and the event-frame schema.

Example::

    >>> import numpy as np
    >>> events = StreamEvents.from_lists(
    ...     ["fc", "cast:fc:weight:fp32->fp16"], ["fc", "fc"], ["op", "cast"],
    ...     ["forward", "forward"], ["fp16", "fp16"], ["fp16", "fp16"], ["roofline"] * 2,
    ...     np.array([0.0, 4.0]), np.array([4.0, 1.0]), np.array([64.0, 96.0]))
    >>> events.to_frame(rank=0, stream="compute")[["op", "start_us", "dur_us"]].values.tolist()
    [['fc', 0.0, 4.0], ['cast:fc:weight:fp32->fp16', 4.0, 1.0]]
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = ["EVENT_COLUMNS", "StreamEvents"]

#: columns of ``SimResult.events``
EVENT_COLUMNS = ("rank", "stream", "op", "fqn", "category", "phase", "precision",
                 "plan_precision", "start_us", "dur_us", "bytes", "source")


@dataclass(frozen=True, eq=False)
class StreamEvents:
    """Events of one stream in start order.

    Attributes:
        op: event name: the op FQN, ``cast:<fqn>:...``, ``allreduce:bucket<k>`` or
            ``optimizer:<name>``.
        fqn: the graph op the event belongs to ("" for allreduces and the optimizer).
        category: ``op``, ``cast``, ``allreduce``, ``optimizer`` or ``framework`` (the
            fitted per-step cost of a rank whose op times are measured).
        phase: ``forward``, ``backward_input``, ``backward_weight``, ``backward`` (a
            backward cast or an allreduce) or ``optimizer``.
        precision: the precision the event computes in (a cast: its target).
        plan_precision: the op's planned precision (an int8 op's backward events say
            ``fp16`` in ``precision`` and ``int8`` here).
        source: where the duration came from.
        start_us, dur_us: timing.
        bytes: bytes the event moves (op: read + written; allreduce: bucket size).
    """

    op: tuple[str, ...]
    fqn: tuple[str, ...]
    category: tuple[str, ...]
    phase: tuple[str, ...]
    precision: tuple[str, ...]
    plan_precision: tuple[str, ...]
    source: tuple[str, ...]
    start_us: np.ndarray
    dur_us: np.ndarray
    bytes: np.ndarray

    @classmethod
    def from_lists(cls, op, fqn, category, phase, precision, plan_precision, source,
                   start_us, dur_us, nbytes) -> "StreamEvents":
        return cls(tuple(op), tuple(fqn), tuple(category), tuple(phase), tuple(precision),
                   tuple(plan_precision), tuple(source), np.asarray(start_us, float),
                   np.asarray(dur_us, float), np.asarray(nbytes, float))

    @classmethod
    def empty(cls) -> "StreamEvents":
        """A stream without events."""
        return cls.from_lists(*[()] * 7, (), (), ())

    def __len__(self) -> int:
        return len(self.op)

    @property
    def end_us(self) -> np.ndarray:
        return self.start_us + self.dur_us

    def to_frame(self, *, rank: int, stream: str) -> pd.DataFrame:
        """The events as rows of :data:`EVENT_COLUMNS` for one rank and stream."""
        n = len(self)
        return pd.DataFrame({
            "rank": np.full(n, rank, dtype=np.int64), "stream": [stream] * n,
            "op": self.op, "fqn": self.fqn, "category": self.category, "phase": self.phase,
            "precision": self.precision, "plan_precision": self.plan_precision,
            "start_us": self.start_us, "dur_us": self.dur_us, "bytes": self.bytes,
            "source": self.source,
        }, columns=list(EVENT_COLUMNS))
