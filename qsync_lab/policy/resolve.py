"""What every op of a graph runs in, given one device kind's plan (the follow rules).

A plan names ops of the kinds in :data:`~qsync_lab.policy.kinds.PLANNABLE_KINDS`; every
other op follows QSync's policy:

* ``view`` ops alias their input and take its precision;
* ``softmax``, ``loss``, ``add``, ``attention`` (a softmax inside: scaled dot-product
  attention, the core of ``nn.MultiheadAttention``) and GELU activations run in fp32
  (QSync's deny list), as do plannable ops the plan leaves out;
* the rest (activations, dropout, mul, pooling, ...) inherit their producers' output
  precision when all float producers agree, else run in fp32 (AMP's promote rule).

Storage rules: fp16 and bf16 ops write fp16/bf16 values; int8 and fp8 ops write their
dequantized fp32 result, and tf32 ops fp32 (:func:`output_precision`). Graph inputs are
fp32 data.

The functions read a graph's per-op arrays through any object with ``names``, ``kinds``,
``targets``, ``producers``, ``float_output`` and ``plan_refusals`` (a
:class:`~qsync_lab.costs.OpWork`) and ``index_of(fqn)``.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.costs import op_work
    >>> from qsync_lab.devices import load_catalog
    >>> from qsync_lab.graph import trace_graph
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> work = op_work(trace_graph(model, torch.randn(2, 4)))
    >>> a = resolve_precisions(work, {"0": "fp16"}, load_catalog().device("T4"))
    >>> [str(p) for p in a.precision], [str(p) for p in a.backward]
    (['fp16', 'fp16', 'fp32'], ['fp16', 'fp16', 'fp32'])
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from qsync_lab.errors import QSyncError
from qsync_lab.policy.kinds import PLANNABLE_KINDS, check_device_precision, check_op_precision
from qsync_lab.policy.op_precision import DEFAULT_BACKWARD, OpPrecision
from qsync_lab.precision import Precision

__all__ = ["ROUNDED_OUTPUTS", "KindPlan", "PrecisionAssignment", "output_precision", "re_resolve",
           "resolve_precisions", "storage_precision", "validate_plan"]

_FP32_KINDS = frozenset({"softmax", "loss", "add", "attention"})
_FP32_ACTIVATIONS = ("gelu",)
#: formats whose values an op writes as they are; every other precision writes fp32
ROUNDED_OUTPUTS = frozenset({Precision.FP16, Precision.BF16})

#: one device kind's plan: op FQN (or index) -> precision name, Precision, OpPrecision or
#: mapping ``{"forward": ..., "backward": ..., "rounding": ..., "granularity": ...}``
KindPlan = Mapping["str | int", "str | Precision | OpPrecision | Mapping"]


@dataclass(frozen=True)
class PrecisionAssignment:
    """Per op (in graph order) the precisions of one device kind's plan.

    Attributes:
        precision: what the forward pass computes in.
        output: the storage precision of the output (:func:`output_precision`).
        backward: what the backward passes compute in.
        planned: op index -> config, for the ops the plan names.
    """

    precision: tuple[Precision, ...]
    output: tuple[Precision, ...]
    backward: tuple[Precision, ...]
    planned: Mapping[int, OpPrecision] = field(default_factory=dict)

    def config(self, index: int) -> OpPrecision:
        """What op ``index`` runs: its planned config, or its resolved precision's default."""
        return self.planned.get(index) or OpPrecision.parse(self.precision[index])


def storage_precision(precision: Precision) -> Precision:
    """The precision a tensor encoded in ``precision`` is stored in (tf32 -> fp32)."""
    return Precision.FP32 if precision is Precision.TF32 else precision


def output_precision(precision: Precision) -> Precision:
    """The precision an op computed in ``precision`` writes its output in (fp16/bf16 as
    they are; int8, fp8 and tf32 write fp32)."""
    return precision if precision in ROUNDED_OUTPUTS else Precision.FP32


def validate_plan(plan: Mapping[str, KindPlan], work, device_names: tuple[str, ...],
                  catalog) -> dict[str, dict[int | str, OpPrecision]]:
    """Check ``plan`` against the graph and the cluster's device kinds.

    Without a graph (``work`` None) only the devices are checked, per op: each device kind
    must run the op's forward and backward precisions
    (:func:`~qsync_lab.policy.kinds.check_device_precision`).

    Args:
        plan: device kind -> {op FQN -> precision spec}.
        work: the graph's per-op arrays (:class:`~qsync_lab.costs.OpWork`), or None.
        device_names: the cluster's device kinds (catalog names).
        catalog: the catalog the names refer to.

    Returns:
        catalog device name -> {op index -> config} (op FQN -> config without a graph);
        kinds not in ``plan`` get ``{}``.

    Raises:
        QSyncError: unknown device kind, unknown FQN, an op a plan cannot set, or a
            precision its kind or the device cannot run, in one line.

    Example::

        >>> from qsync_lab.devices import load_catalog
        >>> try:
        ...     validate_plan({"T4": {"fc1": "bf16"}}, None, ("T4",), load_catalog())
        ... except QSyncError as err:
        ...     print(str(err).split(";")[0])
        plan for T4: op 'fc1': T4 does not support bf16
    """
    resolved: dict[str, dict[int | str, OpPrecision]] = {name: {} for name in device_names}
    for device_kind, ops in plan.items():
        device = catalog.device(device_kind)
        if device.name not in resolved:
            raise QSyncError(f"the plan has device kind {device_kind!r}, which the cluster does "
                             f"not have ({', '.join(device_names)}); remove it or fix the name")
        resolved[device.name] = _checked_kind_plan(work, ops, device)
    return resolved


def resolve_precisions(work, planned: KindPlan, device) -> PrecisionAssignment:
    """Apply the follow rules of the module docstring to every op.

    Args:
        work: the graph's per-op arrays.
        planned: op index or FQN -> precision spec for this device kind (checked here too).
        device: the device kind (:class:`~qsync_lab.devices.DeviceSpec`).
    """
    by_index = _checked_kind_plan(work, planned, device)
    precision: list[Precision] = []
    output: list[Precision] = []
    float_output = work.float_output.tolist()
    for i, kind in enumerate(work.kinds):
        p = _forward_precision(work, i, by_index, output, float_output)
        precision.append(p)
        output.append(p if kind == "view" else output_precision(p))
    backward = tuple(by_index[i].backward_precision if i in by_index else DEFAULT_BACKWARD[p]
                     for i, p in enumerate(precision))
    return PrecisionAssignment(tuple(precision), tuple(output), backward,
                               MappingProxyType(by_index))


def re_resolve(work, base: PrecisionAssignment, changes: Mapping[int, "OpPrecision | None"],
               device) -> tuple[PrecisionAssignment, set[int]]:
    """:func:`resolve_precisions` of ``base``'s plan with ``changes`` (op index -> config,
    checked here; None: the op leaves the plan): only the changed ops and those that
    follow them are resolved again.

    Returns:
        the assignment, and the ops whose precisions, or whose producers' outputs, differ
        from ``base``'s.
    """
    by_index = dict(base.planned)
    for op in changes:
        by_index.pop(op, None)
    by_index.update(_checked_kind_plan(
        work, {op: cfg for op, cfg in changes.items() if cfg is not None}, device))
    precision, output, backward = list(base.precision), list(base.output), list(base.backward)
    float_output = work.float_output.tolist()
    dirty, touched = set(changes), set()
    for i in range(min(dirty, default=len(work)), len(work)):
        if i not in dirty:
            continue
        p = _forward_precision(work, i, by_index, output, float_output)
        q = by_index[i].backward_precision if i in by_index else DEFAULT_BACKWARD[p]
        if (p, q) != (precision[i], backward[i]):
            precision[i], backward[i] = p, q
            touched.add(i)
        out = p if work.kinds[i] == "view" else output_precision(p)
        if out is not output[i]:
            output[i] = out
            dirty.update(work.consumers[i])
            touched.update(work.consumers[i])
    return PrecisionAssignment(tuple(precision), tuple(output), tuple(backward),
                               MappingProxyType(by_index)), touched


def _forward_precision(work, i: int, by_index: Mapping[int, OpPrecision],
                       output: list[Precision], float_output: list[bool]) -> Precision:
    """What op ``i`` computes in, given the outputs of the ops before it."""
    if i in by_index:
        return by_index[i].forward
    kind, producers = work.kinds[i], work.producers[i]
    if kind == "view":
        return output[producers[0]] if producers else Precision.FP32
    if kind in PLANNABLE_KINDS or kind in _FP32_KINDS or _is_fp32_activation(work, i):
        return Precision.FP32
    float_outs = {output[j] for j in producers if float_output[j]}
    return float_outs.pop() if len(float_outs) == 1 else Precision.FP32


def _checked_kind_plan(work, ops: KindPlan, device) -> dict[int | str, OpPrecision]:
    """Op index -> config of ``ops`` on ``device``; without a graph (``work`` None), the
    plan's key -> config, checked against the device only."""
    checked: dict[int | str, OpPrecision] = {}
    allowed: set[tuple[str, OpPrecision]] = set()  # each (op kind, config) checked once
    for key, spec in ops.items():
        try:
            index = key if work is None or isinstance(key, int) else work.index_of(key)
        except QSyncError as err:
            raise QSyncError(f"plan for {device.name}: {err}") from None
        fqn = key if work is None else work.names[index]
        try:
            if work is None:
                checked[key] = check_device_precision(spec, device)
                continue
            if work.plan_refusals[index]:
                raise QSyncError(work.plan_refusals[index])
            pair = (work.kinds[index], OpPrecision.parse(spec))
            if pair not in allowed:
                check_op_precision(*pair, device)
                allowed.add(pair)
            checked[index] = pair[1]
        except QSyncError as err:
            raise QSyncError(f"plan for {device.name}: op {fqn!r}: {err}") from None
    return checked


def _is_fp32_activation(work, index: int) -> bool:
    if work.kinds[index] != "activation":
        return False
    name = work.targets[index].rsplit(".", 1)[-1].lower()
    return name.strip("_") in _FP32_ACTIVATIONS
