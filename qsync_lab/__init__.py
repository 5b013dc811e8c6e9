"""qsync_lab: quantization-minimized synchronous data-parallel training across hybrid devices.

The front door is :class:`Study` (one model on one cluster: trace, indicator, plan,
simulate, run); the main types are importable from here too. Importing ``qsync_lab`` is
light: each name loads its module on first use, and nothing imports numba or plotly until
a kernel or a figure is needed.

Example::

    >>> import qsync_lab
    >>> study = qsync_lab.Study("digits_cnn", cluster="local-hybrid", progress=False)
    >>> study.cluster.device_kinds
    ('V100-SXM2-32GB', 'T4')
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Study": "qsync_lab.study",
    "Plan": "qsync_lab.plan",
    "OpPrecision": "qsync_lab.policy",
    "Precision": "qsync_lab.precision",
    "QSyncError": "qsync_lab.errors",
    "Cluster": "qsync_lab.cluster",
    "load_cluster": "qsync_lab.cluster",
    "CostModel": "qsync_lab.costs",
    "load_cost_model": "qsync_lab.costs",
    "trace_graph": "qsync_lab.graph",
    "simulate": "qsync_lab.simulate",
    "apply_plan_": "qsync_lab.quant",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qsync_lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
