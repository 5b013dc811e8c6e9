"""Measured op times and host times of a device, looked up in profile tables: per op, the
first table with a row for it (by FQN, else by shape key; host times also by the median of
the op's kind, :meth:`~qsync_lab.costs.ProfileTable.op_host_us`) wins.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> from qsync_lab.costs import op_work, read_profile
    >>> from qsync_lab.resources import data_file
    >>> work = op_work(trace_graph(nn.Linear(256, 256), torch.randn(16, 32, 256)))
    >>> table = read_profile(data_file("profiles", "cpu.csv"))
    >>> found = measured_op_times([table], work, "cpu", ["fp32"], phase="forward",
    ...                           batch_size=16, ops=[0])
    >>> found[0][1]
    'profile:cpu.csv'
    >>> measured_host_times([table], work, "cpu", ["fp32"], phase="forward",
    ...                     batch_size=16).tolist()   # the table has no host times
    [nan]
"""

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from qsync_lab.costs.profiles import ProfileTable
from qsync_lab.costs.work import OpWork, shape_key
from qsync_lab.precision import Precision

__all__ = ["measured_host_times", "measured_op_times"]


def measured_op_times(profiles: Sequence[ProfileTable], work: OpWork, device: str,
                      plan_precisions: Sequence["Precision | str"], *, phase: str,
                      batch_size: int, ops: Iterable[int]) -> dict[int, tuple[float, str]]:
    """Op index -> (measured time, table source) of the ops ``ops`` of ``work`` in
    ``phase`` on device ``device``, keyed by the precision their plan gives them; ops no
    table measured are left out."""
    tables = [t for t in profiles if any(k[0] == device for k in t.by_op)
              or any(k[0] == device for k in t.by_shape)]
    return _first_found(tables, ProfileTable.op_time_us, work, ops, device, plan_precisions,
                        phase, batch_size)


def measured_host_times(profiles: Sequence[ProfileTable], work: OpWork, device: str,
                        plan_precisions: Sequence["Precision | str"], *, phase: str,
                        batch_size: int) -> np.ndarray:
    """Per op of ``work``, the host's measured time to issue ``phase`` on ``device``; NaN
    where no table has one."""
    host = np.full(len(work), np.nan)
    tables = [t for t in profiles if any(k[0] == device for k in t.host_by_kind)]
    for i, (us, _) in _first_found(tables, ProfileTable.op_host_us, work, range(len(work)),
                                   device, plan_precisions, phase, batch_size).items():
        host[i] = us
    return host


def _first_found(tables: Sequence[ProfileTable], lookup: Callable[..., float | None],
                 work: OpWork, ops: Iterable[int], device: str,
                 plan_precisions: Sequence["Precision | str"], phase: str,
                 batch_size: int) -> dict[int, tuple[float, str]]:
    """Op index -> (value, source) of the first of ``tables`` whose ``lookup`` finds one."""
    found: dict[int, tuple[float, str]] = {}
    for i in ops if tables else ():
        key, plan = shape_key(work, i, batch_size), str(Precision.parse(plan_precisions[i]))
        for table in tables:
            value = lookup(table, device, work.names[i], plan, phase, batch_size, key)
            if value is not None:
                found[i] = (value, table.source)
                break
    return found
