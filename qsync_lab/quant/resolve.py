"""Apply one device kind's plan as the policy resolves it: planned ops and their followers.

The plan names the ops the allocator chose; the policy (:mod:`qsync_lab.policy.resolve`)
decides what every other op runs in. :func:`apply_resolved_plan_` sets the planned ops
(:func:`~qsync_lab.quant.apply_plan_`, which refuses nothing the policy accepted) and puts
:class:`~qsync_lab.quant.modules.PrecisionBoundary` hooks on activation modules that
inherit a 16-bit precision, so a run computes what the simulator costs. Other followers
(views, pooling, functional activations) pass 16-bit values through unchanged. Natively
(CUDA) fp16/bf16 ops write their dtype, so the fp32 GEMMs and norms of such a plan get
fp32 inputs (a norm's or GEMM's kernels refuse a mix of dtypes).
"""

from torch import nn

from qsync_lab.costs import op_work
from qsync_lab.graph.kinds import function_kind, module_kind
from qsync_lab.graph.records import op_name_of
from qsync_lab.policy import (GEMM_KINDS, PLANNABLE_KINDS, ROUNDED_OUTPUTS, KindPlan,
                              OpPrecision, function_refusal, kind_allows, module_refusal,
                              resolve_precisions)
from qsync_lab.precision import Precision
from qsync_lab.quant.apply import apply_plan_
from qsync_lab.quant.functional import functional_precisions
from qsync_lab.quant.native import fp32_inputs, tf32_throughout
from qsync_lab.quant.registry import handler_for

__all__ = ["apply_op_precision_", "apply_resolved_plan_", "function_runs_in",
           "plan_keeps_tf32_on"]

_GUARDED = "qsync_fp32_inputs"  # set on a module once it has the fp32-inputs hook


def apply_resolved_plan_(model: nn.Module, graph, device_plan: KindPlan,
                         device) -> dict[str, str]:
    """Apply ``device_plan`` (one device kind's ops -> precision) and its followers to ``model`` in place; return what each op
    that does not run in fp32 now runs (op FQN -> config text).

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.devices import load_catalog
        >>> from qsync_lab.graph import trace_graph
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> graph = trace_graph(model, torch.randn(3, 4))
        >>> apply_resolved_plan_(model, graph, {"0": "bf16"}, load_catalog().device("cpu"))
        {'0': 'bf16/bf16 nearest tensor', '1': 'bf16/bf16 nearest tensor'}
    """
    work, assignment = _resolved(graph, device_plan, device)
    planned = {work.names[i]: cfg for i, cfg in assignment.planned.items()}
    apply_plan_(model, planned, device=device)
    modules = dict(model.named_modules())
    applied, fp32_gemms = {}, []
    for i, (name, op_kind) in enumerate(zip(work.names, work.kinds)):
        cfg = assignment.config(i)
        if cfg.is_fp32:
            if op_kind in PLANNABLE_KINDS and op_kind != "embedding":
                fp32_gemms.append(name)
            continue
        if name in planned:
            applied[name] = str(cfg)
        elif op_kind == "activation" and name in modules:
            handler_for(op_kind).apply(modules[name], cfg, name)
            applied[name] = str(cfg)
    if any(p in ROUNDED_OUTPUTS for p in assignment.output):
        _guard_fp32_ops(model, modules, fp32_gemms)
    return applied


def plan_keeps_tf32_on(graph, device_plan: KindPlan, device) -> bool:
    """Whether a rank running ``device_plan`` keeps torch's TF32 switches on for its whole
    step (:func:`~qsync_lab.quant.native.tf32_throughout` of its GEMM ops, as resolved).

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.devices import load_catalog
        >>> from qsync_lab.graph import trace_graph
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> graph = trace_graph(model, torch.randn(3, 4))
        >>> h100 = load_catalog().device("H100-SXM5-80GB")
        >>> plan_keeps_tf32_on(graph, {"0": "tf32", "2": "tf32"}, h100)
        True
        >>> plan_keeps_tf32_on(graph, {"0": "tf32"}, h100)  # "2" computes in fp32
        False
    """
    work, assignment = _resolved(graph, device_plan, device)
    return tf32_throughout(assignment.config(i) for i, kind in enumerate(work.kinds)
                           if kind in GEMM_KINDS)


def _resolved(graph, device_plan: KindPlan, device):
    """The graph's op work and the precisions the policy resolves for ``device_plan``."""
    work = op_work(graph)
    return work, resolve_precisions(work, dict(device_plan), device)


def _guard_fp32_ops(model: nn.Module, modules: dict[str, nn.Module], names: list[str]) -> None:
    """Give the fp32 GEMMs and norms fp32 inputs where a native fp16/bf16 op, which writes
    its dtype, feeds them (:func:`~qsync_lab.quant.native.fp32_inputs`; no-op otherwise)."""
    calls = []
    for name in names:
        module = modules.get(name, modules.get(_attention_of(name)))
        if module is None:
            calls.append(name)
        if module is not None and not getattr(module, _GUARDED, False):
            module.register_forward_pre_hook(fp32_inputs)
            setattr(module, _GUARDED, True)
    if calls:
        controller = functional_precisions(model, create=True)
        controller.fp32_calls.update(calls)


def apply_op_precision_(module: nn.Module, precision: "Precision | str", fqn: str = "") -> bool:
    """Run one op module in ``precision`` as a plan (or, for an activation, the follow rules)
    would, if the policy lets it; return whether it does (the profiler times ops this way).

    Example::

        >>> from torch import nn
        >>> apply_op_precision_(nn.ReLU(), "bf16"), apply_op_precision_(nn.MaxPool2d(2), "bf16")
        (True, False)
    """
    precision = Precision.parse(precision)
    kind = module_kind(module)
    if kind_allows(kind, precision) and module_refusal(module, kind) is None:
        apply_plan_(module, {"": precision})
        return True
    if kind == "activation" and precision in ROUNDED_OUTPUTS:
        handler_for(kind).apply(module, OpPrecision.parse(precision), fqn)
        return True
    return False


def function_runs_in(fn_name: str, precision: "Precision | str") -> bool:
    """Whether a plan can run the functional call ``fn_name`` in ``precision``."""
    kind = function_kind(fn_name)
    return kind_allows(kind, precision) and function_refusal(op_name_of(fn_name), kind) is None


def _attention_of(fqn: str) -> str | None:
    """The attention module an in-projection op (``attn.in_proj``) belongs to, else None."""
    scope, _, name = fqn.rpartition(".")
    return scope if name == "in_proj" else None
