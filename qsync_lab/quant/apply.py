"""Apply a precision plan to a model in place, and describe what each op runs in.

Example::

    >>> from qsync_lab.models import get_model
    >>> from qsync_lab.quant import apply_plan_, describe_precisions
    >>> from qsync_lab.errors import QSyncError
    >>> model = get_model("digits_cnn")
    >>> try:
    ...     apply_plan_(model, {"conv1": "int8", "bn1": "bf16"}, device="T4")
    ... except QSyncError as err:
    ...     print(err)
    op 'bn1': T4 does not support bf16; it supports fp32, fp16, int8: use one of those or another device
    >>> plan = {"conv1": "int8", "fc1": {"forward": "fp16"}, "bn1": "fp16"}
    >>> apply_plan_(model, plan, device="T4")
    >>> describe_precisions(model).loc[["conv1", "bn1", "fc1", "fc2"], ["forward", "backward"]]
          forward backward
    fqn
    conv1    int8     fp16
    bn1      fp16     fp16
    fc1      fp16     fp16
    fc2      fp32     fp32
"""

import difflib
import re
from collections.abc import Mapping

import pandas as pd
from torch import nn

from qsync_lab.devices import DeviceSpec, load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.graph.attention import in_proj_name, splits
from qsync_lab.graph.kinds import function_kind, is_leaf_module, module_kind
from qsync_lab.policy import (PLANNABLE_KINDS, OpPrecision, check_op_precision,
                              function_refusal, module_refusal)
from qsync_lab.quant.attention import (InProjectionHandler, attention_modules,
                                       attention_refusal, in_proj_precision,
                                       sync_attention_classes_)
from qsync_lab.quant.functional import functional_precisions
from qsync_lab.quant.modules import LowPrecisionOp
from qsync_lab.quant.registry import OpHandler, current_precision, handler_for

__all__ = ["apply_plan_", "describe_precisions", "restore_rounding_counters",
           "rounding_counters"]

PrecisionSpec = str | OpPrecision | Mapping[str, str]
_IN_PROJECTION = InProjectionHandler()
DESCRIBE_COLUMNS = ["kind", "forward", "backward", "rounding", "granularity"]
_FUNCTIONAL_NAME = re.compile(r"^(?P<op>[A-Za-z]\w*?)(?:_(?P<count>\d+))?$")


def _device_spec(device: str | DeviceSpec | None) -> DeviceSpec | None:
    if device is None or isinstance(device, DeviceSpec):
        return device
    return load_catalog().device(device)


def _plannable_modules(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """FQN -> (module, kind) of every module a plan can set; an attention module's
    in-projection maps to the attention module, as a linear
    (:mod:`qsync_lab.quant.attention`)."""
    found, unused = {}, set()
    for fqn, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            if splits(module):
                found[in_proj_name(fqn)] = (module, "linear")
            else:  # one attention op: its out_proj's forward never runs
                unused.add(f"{fqn}.out_proj".lstrip("."))
            continue
        kind = module_kind(module)
        if kind in PLANNABLE_KINDS and fqn not in unused and module_refusal(module, kind) is None:
            found[fqn] = (module, kind)
    return found


def _handler(module: nn.Module, kind: str) -> OpHandler:
    """The handler of a plannable op (an attention module planned as a linear is its
    in-projection)."""
    return _IN_PROJECTION if isinstance(module, nn.MultiheadAttention) else handler_for(kind)


def _current_precision(module: nn.Module) -> OpPrecision:
    if isinstance(module, nn.MultiheadAttention):
        return in_proj_precision(module)
    return current_precision(module)


def _module_target(model: nn.Module, fqn: str, plannable: Mapping) -> tuple[nn.Module, str]:
    """The module ``fqn`` names and its kind, or a one-line QSyncError saying why not."""
    if fqn in plannable:
        return plannable[fqn]
    refusal = attention_refusal(model, fqn)
    if refusal:
        raise QSyncError(f"op {fqn!r}: {refusal}")
    module = model.get_submodule(fqn)
    kind = module_kind(module)
    if kind is None:
        raise QSyncError(f"{fqn!r} is a {type(module).__name__} container, not an operator; "
                         "name its operators instead (describe_precisions(model) lists them)")
    raise QSyncError(f"op {fqn!r}: {module_refusal(module, kind)}")


def _functional_target(model: nn.Module, fqn: str, plannable: Mapping) -> str:
    """The kind of the functional call ``fqn`` (``scope.matmul_2``) if a plan can set it."""
    scope, _, name = fqn.rpartition(".")
    match = _FUNCTIONAL_NAME.match(name)
    try:
        if is_leaf_module(model.get_submodule(scope)) and scope:
            match = None  # calls inside an op module are not ops of the model
    except AttributeError:
        match = None
    if match is None or function_kind(match["op"]) == "other":
        close = difflib.get_close_matches(fqn, list(plannable), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise QSyncError(f"unknown op FQN {fqn!r}: the model has no module of that name and "
                         f"it names no functional call{hint} (describe_precisions(model) "
                         "lists the modules a plan can set, graph.ops.index every op)")
    kind = function_kind(match["op"])
    refusal = function_refusal(match["op"], kind)
    if refusal:
        raise QSyncError(f"op {fqn!r}: {refusal}")
    return kind


def apply_plan_(model: nn.Module, precisions: Mapping[str, PrecisionSpec | None], *,
                device: str | DeviceSpec | None = None) -> None:
    """Make each named op of ``model`` run in its precision, in place.

    Every entry is checked against the policy (:mod:`qsync_lab.policy`) before anything
    changes, so a bad plan leaves the model as it was. Ops not named keep their current
    precision (pass ``"fp32"`` to restore one); a value of None leaves that op alone.
    Parameters, buffers and state_dict keys never change, and fp32 ops run the plain torch
    modules, so an all-fp32 plan is bit-identical to the original model.

    Args:
        model: the model. Op FQNs are those of :func:`qsync_lab.graph.trace_graph`: module
            names for module ops, ``scope.fn`` / ``scope.fn_1`` for functional matmuls and
            linears (:mod:`qsync_lab.quant.functional`), ``attn.in_proj`` and
            ``attn.out_proj`` for the projections of an ``nn.MultiheadAttention``
            (:mod:`qsync_lab.quant.attention`).
        precisions: op FQN -> precision name, :class:`~qsync_lab.policy.OpPrecision` or
            mapping (``{"forward": "int8", "backward": "bf16", "rounding": "stochastic",
            "granularity": "channel"}``).
        device: a catalog device name or :class:`DeviceSpec` whose supported precisions
            every op must respect; None skips that check.

    Raises:
        QSyncError: one line naming the op, for an unknown FQN, an op a plan cannot set, a
            precision its kind cannot take, or one the device cannot run.
    """
    if not isinstance(precisions, Mapping):
        raise QSyncError(
            f"precisions must be a mapping op FQN -> precision, got {type(precisions).__name__}"
        )
    spec = _device_spec(device)
    plannable = _plannable_modules(model)
    modules, functions = [], []
    for fqn, value in precisions.items():
        if value is None:
            continue
        try:
            module, kind = _module_target(model, fqn, plannable)
        except AttributeError:
            module, kind = None, _functional_target(model, fqn, plannable)
        try:
            cfg = check_op_precision(kind, value, spec)
        except QSyncError as err:
            raise QSyncError(f"op {fqn!r}: {err}") from None
        (functions if module is None else modules).append((fqn, module, kind, cfg))
    for fqn, module, kind, cfg in modules:
        _handler(module, kind).apply(module, cfg, fqn)
    sync_attention_classes_(model)
    if functions:
        controller = functional_precisions(model, create=True)
        for fqn, _, _, cfg in functions:
            controller.set(fqn, cfg)


def describe_precisions(model: nn.Module) -> pd.DataFrame:
    """One row per module a plan can set and per planned functional call: kind and config.

    Returns:
        DataFrame indexed by op FQN (``fqn``) with columns kind, forward, backward,
        rounding, granularity (strings).
    """
    rows = {fqn: {"kind": kind, **_current_precision(module).to_dict()}
            for fqn, (module, kind) in _plannable_modules(model).items()}
    controller = functional_precisions(model)
    for fqn, cfg in (controller.configs if controller else {}).items():
        kind = function_kind(_FUNCTIONAL_NAME.match(fqn.rpartition(".")[2])["op"])
        rows[fqn] = {"kind": kind, **cfg.to_dict()}
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=DESCRIBE_COLUMNS)
    frame.index.name = "fqn"
    return frame


def rounding_counters(model: nn.Module) -> dict[str, int]:
    """Each low-precision op's stochastic-rounding call counter, by op FQN."""
    counters = {name: module.op_calls for name, module in model.named_modules()
                if isinstance(module, LowPrecisionOp)}
    counters.update({in_proj_name(name): module.in_proj_calls
                     for name, module in attention_modules(model)
                     if hasattr(module, "in_proj_calls")})
    controller = functional_precisions(model)
    counters.update(controller.calls if controller else {})
    return counters


def restore_rounding_counters(model: nn.Module, counters: Mapping[str, int]) -> None:
    """Set the counters saved by :func:`rounding_counters` (same plan, same FQNs)."""
    modules = dict(model.named_modules())
    in_projections = {in_proj_name(name): module for name, module in attention_modules(model)
                      if hasattr(module, "in_proj_calls")}
    controller = functional_precisions(model)
    for name, calls in counters.items():
        if isinstance(modules.get(name), LowPrecisionOp):
            modules[name].op_calls = calls
        elif name in in_projections:
            in_projections[name].in_proj_calls = calls
        elif controller is not None and name in controller.calls:
            controller.calls[name] = calls
        else:
            raise QSyncError(f"checkpoint has a rounding counter for {name!r}, which is not a "
                             "low-precision op of this model; resume with the same plan")
