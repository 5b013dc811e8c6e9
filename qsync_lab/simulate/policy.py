"""Which precision every op runs in, given a plan (QSync's policy for the ops it leaves out).

A plan maps, per device kind, op FQN -> precision. Only *plannable* kinds may appear:

==================================  =========================================
linear, conv1d, conv2d, conv3d      any precision the device runs
matmul, embedding                   floating-point precisions (no int8)
batch/layer/group/rms norm          floating-point precisions of >= 16 bits
==================================  =========================================

Every other op follows QSync's policy:

* ``view`` ops alias their input and take its precision;
* ``softmax``, ``loss``, ``add`` and GELU activations run in fp32 (QSync's deny list),
  as do planned kinds the plan leaves out;
* the rest (activations, dropout, mul, pooling, ...) inherit their producers' output
  precision when all float producers agree, else run in fp32 (AMP's promote rule).

Int8 ops compute int8 x int8 -> int32, write fp32 outputs and run their backward pass in
fp16 (QSync); tf32 ops store fp32. Graph inputs are fp32 data.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.costs import op_work
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.graph import trace_graph
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> work = op_work(trace_graph(model, torch.randn(2, 4)))
    >>> a = resolve_precisions(work, {"0": "int8"}, load_catalog().device("T4"))
    >>> [str(p) for p in a.precision], [str(p) for p in a.backward]
    (['int8', 'fp32', 'fp32'], ['fp16', 'fp32', 'fp32'])
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from qsync_lab.costs.work import OpWork
from qsync_lab.devices import DeviceSpec
from qsync_lab.errors import QSyncError
from qsync_lab.precision import Precision

__all__ = ["PLANNABLE_KINDS", "PrecisionAssignment", "backward_precision", "resolve_precisions",
           "storage_precision", "validate_plan"]

_ANY, _FLOAT, _FLOAT16_UP = "any", "float", "float16+"
#: kind -> which precisions a plan may give it
PLANNABLE_KINDS: Mapping[str, str] = MappingProxyType({
    "linear": _ANY, "conv1d": _ANY, "conv2d": _ANY, "conv3d": _ANY,
    "matmul": _FLOAT, "embedding": _FLOAT,
    "batch_norm": _FLOAT16_UP, "layer_norm": _FLOAT16_UP, "group_norm": _FLOAT16_UP,
    "rms_norm": _FLOAT16_UP,
})
_FP32_KINDS = frozenset({"softmax", "loss", "add"})
_FP32_ACTIVATIONS = ("gelu",)
_RULE_TEXT = {_ANY: "any precision the device runs", _FLOAT: "a floating-point precision",
              _FLOAT16_UP: "a floating-point precision of at least 16 bits"}

KindPlan = Mapping[str, "str | Precision"]


@dataclass(frozen=True)
class PrecisionAssignment:
    """Per op (in graph order) the precisions of one device kind's plan.

    Attributes:
        precision: what the forward pass computes in (the plan's precision for planned ops).
        output: the storage precision of the output (int8 and tf32 ops write fp32).
        backward: what the backward passes compute in (int8 ops: fp16).
    """

    precision: tuple[Precision, ...]
    output: tuple[Precision, ...]
    backward: tuple[Precision, ...]


def storage_precision(precision: Precision) -> Precision:
    """The precision a tensor computed in ``precision`` is stored in (tf32 -> fp32)."""
    return Precision.FP32 if precision is Precision.TF32 else precision


def backward_precision(precision: Precision) -> Precision:
    """The precision an op planned in ``precision`` runs its backward in (int8 -> fp16)."""
    return Precision.FP16 if precision is Precision.INT8 else precision


def validate_plan(plan: Mapping[str, KindPlan], work: OpWork, device_names: tuple[str, ...],
                  catalog) -> dict[str, dict[int, Precision]]:
    """Check ``plan`` against the graph and the cluster's device kinds.

    Args:
        plan: device kind -> {op FQN -> precision}.
        work: the graph's :class:`~qsync_lab.costs.OpWork`.
        device_names: the cluster's device kinds (catalog names).
        catalog: the catalog the names refer to.

    Returns:
        catalog device name -> {op index -> precision}; kinds not in ``plan`` get ``{}``.

    Raises:
        QSyncError: unknown device kind, unknown FQN, a kind a plan cannot change, or a
            precision the device cannot run, in one line.
    """
    resolved: dict[str, dict[int, Precision]] = {name: {} for name in device_names}
    for kind_name, ops in plan.items():
        device = catalog.device(kind_name)
        if device.name not in resolved:
            raise QSyncError(f"the plan has device kind {kind_name!r}, which the cluster does "
                             f"not have ({', '.join(device_names)}); remove it or fix the name")
        for fqn, precision in ops.items():
            index = _index(fqn, work, kind_name)
            resolved[device.name][index] = _checked(work.kinds[index], fqn, precision, device)
    return resolved


def resolve_precisions(work: OpWork, planned: Mapping["int | str", "str | Precision"],
                       device: DeviceSpec) -> PrecisionAssignment:
    """Apply the policy of the module docstring to every op.

    Args:
        work: the graph's :class:`~qsync_lab.costs.OpWork`.
        planned: op index or FQN -> precision for this device kind (checked here too).
        device: the device kind.
    """
    by_index: dict[int, Precision] = {}
    for key, precision in planned.items():
        index = key if isinstance(key, int) else work.index_of(key)
        by_index[index] = _checked(work.kinds[index], work.names[index], precision, device)
    precision: list[Precision] = []
    output: list[Precision] = []
    float_output = work.float_output.tolist()
    for i, kind in enumerate(work.kinds):
        if i in by_index:
            p = by_index[i]
        elif kind == "view":
            first = work.producers[i][0] if work.producers[i] else None
            p = output[first] if first is not None else Precision.FP32
        elif kind in PLANNABLE_KINDS or kind in _FP32_KINDS or _is_fp32_activation(work, i):
            p = Precision.FP32
        else:
            float_outs = {output[j] for j in work.producers[i] if float_output[j]}
            p = float_outs.pop() if len(float_outs) == 1 else Precision.FP32
        precision.append(p)
        output.append(p if kind == "view" else _output_precision(p))
    return PrecisionAssignment(tuple(precision), tuple(output),
                               tuple(backward_precision(p) for p in precision))


def _output_precision(precision: Precision) -> Precision:
    return Precision.FP32 if precision is Precision.INT8 else storage_precision(precision)


def _is_fp32_activation(work: OpWork, index: int) -> bool:
    if work.kinds[index] != "activation":
        return False
    name = work.targets[index].rsplit(".", 1)[-1].lower()
    return name.strip("_") in _FP32_ACTIVATIONS


def _checked(kind: str, fqn: str, precision: "str | Precision", device: DeviceSpec) -> Precision:
    rule = PLANNABLE_KINDS.get(kind)
    if rule is None:
        raise QSyncError(f"plan for {device.name}: op {fqn!r} is of kind {kind}, whose precision "
                         "follows its inputs; plan only linear, conv, matmul, embedding and "
                         "norm ops")
    try:
        parsed = device.require(precision)
    except QSyncError as err:
        raise QSyncError(f"plan for {device.name}: op {fqn!r}: {err}") from None
    if (rule != _ANY and not parsed.is_float) or (rule == _FLOAT16_UP and parsed.bits < 16):
        raise QSyncError(f"plan for {device.name}: op {fqn!r} is of kind {kind}, which needs "
                         f"{_RULE_TEXT[rule]}, not {parsed}")
    return parsed


def _index(fqn: str, work: OpWork, kind_name: str) -> int:
    try:
        return work.index_of(fqn)
    except QSyncError as err:
        raise QSyncError(f"plan for {kind_name}: {err}") from None
