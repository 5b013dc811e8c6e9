"""Timers chosen by device: they time spans of work between marks and sum them per key.

* :class:`HostTimer` (CPU, synchronous work): a mark is ``time.perf_counter_ns()``, and a
  span is added as soon as it ends;
* :class:`CudaEventTimer` (CUDA, asynchronous work): a mark is a CUDA event recorded on the
  device's current stream (``torch.cuda.Event(enable_timing=True)``), and nothing is read
  until :meth:`CudaEventTimer.totals_ns`, which synchronises the device once and resolves
  every span with ``elapsed_time``: timing never stalls the stream in between.

:func:`timer_for` picks one by the device the work runs on. A CUDA span times what the
stream did between its events: the kernels, and any wait for the host to launch them. A
span added with ``sign=-1`` is taken off its key's total (a collective inside an encode).
The profiler (:mod:`qsync_lab.profile`) and the compression hook
(:mod:`qsync_lab.compress.hook`) time with them.

Example::

    >>> timer = timer_for("cpu")
    >>> begin = timer.mark(); _ = sum(range(100)); timer.add("sum", begin, timer.mark())
    >>> list(timer.totals_ns()), timer.totals_ns()["sum"] > 0
    (['sum'], True)
    >>> type(timer_for("cuda:0")).__name__
    'CudaEventTimer'
"""

import time

import torch

__all__ = ["CudaEventTimer", "HostTimer", "timer_for"]

_NS_PER_MS = 1e6


class HostTimer:
    """Spans read off the host clock as they end (synchronous work: the CPU)."""

    def __init__(self) -> None:
        self._ns: dict = {}

    def mark(self) -> int:
        """Now, in ns (``time.perf_counter_ns``)."""
        return time.perf_counter_ns()

    def add(self, key, begin: int, end: int, sign: int = 1) -> None:
        """Add the span from mark ``begin`` to mark ``end`` to ``key``'s total (take it
        off with ``sign=-1``)."""
        self._ns[key] = self._ns.get(key, 0) + sign * (end - begin)

    def totals_ns(self) -> dict:
        """Each key's summed spans, ns."""
        return dict(self._ns)


class CudaEventTimer:
    """Spans between CUDA events on ``device``'s current stream, all resolved at once by
    :meth:`totals_ns` after one synchronise (asynchronous work: a GPU).

    Spans kept unread beyond ``pending_limit`` are resolved as their events complete
    (``Event.query``, which never waits), so a timer that is seldom read stays small; the
    next such pass waits until the unread spans have doubled (a held stream completes none).
    """

    def __init__(self, device: "torch.device | str", pending_limit: int = 4096) -> None:
        self.device = torch.device(device)
        self.pending_limit = pending_limit
        self._fold_at = pending_limit
        self._spans: list = []
        self._ns: dict = {}

    def mark(self):
        """A timing event recorded now on the device's current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, key, begin, end, sign: int = 1) -> None:
        """Keep the span from event ``begin`` to event ``end`` for ``key`` (read later;
        ``sign=-1`` takes it off the total)."""
        self._spans.append((key, begin, end, sign))
        if len(self._spans) > self._fold_at:
            self._spans = [span for span in self._spans if not self._resolved(span)]
            self._fold_at = max(self.pending_limit, 2 * len(self._spans))

    def totals_ns(self) -> dict:
        """Synchronise the device, then each key's summed spans, ns."""
        torch.cuda.synchronize(self.device)
        for span in self._spans:
            self._resolved(span)
        self._spans = []
        return dict(self._ns)

    def _resolved(self, span) -> bool:
        """Add ``span`` to its total if its end event has completed (always after a
        synchronise); whether it was."""
        key, begin, end, sign = span
        if not end.query():
            return False
        self._ns[key] = self._ns.get(key, 0.0) + sign * begin.elapsed_time(end) * _NS_PER_MS
        return True


def timer_for(device: "torch.device | str") -> "HostTimer | CudaEventTimer":
    """A :class:`CudaEventTimer` for a CUDA device, else a :class:`HostTimer`."""
    device = torch.device(device)
    return CudaEventTimer(device) if device.type == "cuda" else HostTimer()
