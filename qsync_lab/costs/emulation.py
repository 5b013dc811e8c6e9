"""What a GPU pays for an op it cannot run in its plan precision
(:func:`~qsync_lab.policy.runs_natively` is False): the op's fp32 work, plus encoding its
operands to the plan's precision. A device marked ``emulated`` in the catalog (the CPU,
which runs every precision's numerics in software) is never costed as emulating: its ops
cost what it takes to run them.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.costs import op_work
    >>> from qsync_lab.devices import load_catalog
    >>> work = op_work(trace_graph(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(),
    ...                                          nn.Linear(16, 2)), torch.randn(2, 1, 4, 4)))
    >>> emulated_on_gpu(work, ["int8"] * len(work), load_catalog().device("T4")).tolist()
    [True, False, False]
"""

from collections.abc import Callable, Sequence

import numpy as np

from qsync_lab.costs.roofline import Roofline
from qsync_lab.costs.work import OpWork, batch_scales, phase_work
from qsync_lab.devices import DeviceSpec
from qsync_lab.policy import PLANNABLE_KINDS, runs_natively
from qsync_lab.precision import Precision

__all__ = ["emulated_on_gpu", "emulated_times_us"]

#: ``(numel, src, dst, device) -> (times, source)``, as ``CostModel.cast_times_us``
CastTimes = Callable[[np.ndarray, Precision, Precision, DeviceSpec], tuple[np.ndarray, str]]


def emulated_on_gpu(work: OpWork, precisions: Sequence["Precision | str"],
                    device: DeviceSpec) -> np.ndarray:
    """Per op, whether ``device`` (a GPU) emulates it in its plan precision."""
    if device.emulated:
        return np.zeros(len(work), bool)
    native = {}
    for kind, precision in zip(work.kinds, precisions):
        pair = (kind, Precision.parse(precision))
        if pair not in native:
            native[pair] = (pair[1] is Precision.FP32 or pair[0] not in PLANNABLE_KINDS
                            or runs_natively(*pair, device))
    return np.array([not native[(k, Precision.parse(p))]
                     for k, p in zip(work.kinds, precisions)], bool)


def emulated_times_us(work: OpWork, precisions: Sequence["Precision | str"],
                      device: DeviceSpec, *, batch_size: int, phase: str, roofline: Roofline,
                      cast_times_us: CastTimes) -> np.ndarray:
    """Per op of ``work``, what ``device``'s emulation of ``phase`` in the plan's
    ``precisions`` costs: the fp32 work on ``roofline``, plus the cast of its fp32 operands
    to its precision (``cast_times_us``)."""
    fp32 = [Precision.FP32] * len(work)
    flops, nbytes = phase_work(work, fp32, phase, batch_size=batch_size)
    times = roofline.times_us(flops, nbytes, work.kinds, device, fp32)
    operands = (work.act_read_bytes * batch_scales(work, batch_size)
                + work.weight_read_bytes) / 4
    for precision in set(map(Precision.parse, precisions)) - {Precision.FP32}:
        mask = np.array([Precision.parse(p) is precision for p in precisions])
        encode, _ = cast_times_us(operands[mask], Precision.FP32, precision, device)
        times[mask] += encode
    return times
