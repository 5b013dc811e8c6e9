"""The precision policy: the one place that decides what an op may run in.

* :class:`OpPrecision`: how one op computes (forward, backward, rounding, granularity) and
  the default backward of each forward precision (int8 → fp16, fp8 e4m3 → e5m2);
* :mod:`~qsync_lab.policy.kinds`: which op kinds a plan may set, in which precisions,
  through which calls (modules, functions), and the skip rules; the kind sets every other
  module reads (GEMMs, scored kinds, norms, weighted modules) derive from its table;
* :mod:`~qsync_lab.policy.resolve`: what every other op runs in (the follow rules) and what
  each op writes (the storage rules).

The simulator, the operators (:mod:`qsync_lab.quant`), the allocator and the indicator all
read it; nothing else decides.

Example::

    >>> from qsync_lab.policy import allowed_precisions
    >>> sorted(map(str, allowed_precisions("layer_norm")))
    ['bf16', 'fp16', 'fp32']
"""

from qsync_lab.policy.kinds import (GEMM_KINDS, NORM_KINDS, PLANNABLE_KINDS, SCORED_KINDS,
                                    WEIGHTED_KINDS, KindRule, allowed_precisions,
                                    check_device_precision, check_op_precision,
                                    forward_refusal, function_refusal, kind_allows,
                                    module_refusal, runs_natively)
from qsync_lab.policy.op_precision import (DEFAULT_BACKWARD, FP8_PRECISIONS, GRANULARITIES,
                                           ROUNDINGS, OpPrecision)
from qsync_lab.policy.resolve import (ROUNDED_OUTPUTS, KindPlan, PrecisionAssignment,
                                      output_precision, resolve_precisions, storage_precision,
                                      validate_plan)

__all__ = [
    "DEFAULT_BACKWARD", "FP8_PRECISIONS", "GEMM_KINDS", "GRANULARITIES", "NORM_KINDS",
    "PLANNABLE_KINDS", "ROUNDED_OUTPUTS", "ROUNDINGS", "SCORED_KINDS", "WEIGHTED_KINDS",
    "KindPlan", "KindRule", "OpPrecision", "PrecisionAssignment", "allowed_precisions",
    "check_device_precision", "check_op_precision", "forward_refusal", "function_refusal",
    "kind_allows", "module_refusal",
    "output_precision", "resolve_precisions", "runs_natively", "storage_precision",
    "validate_plan",
]
