"""Apply a precision plan to a model in place, and describe what each op runs in.

Example::

    >>> from qsync_lab.models import get_model
    >>> from qsync_lab.runtime import apply_plan_, describe_precisions
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
from collections.abc import Mapping

import pandas as pd
from torch import nn

from qsync_lab.devices import DeviceSpec, load_catalog
from qsync_lab.errors import QSyncError
from qsync_lab.graph.kinds import module_kind
from qsync_lab.precision import Precision
from qsync_lab.runtime.config import OpPrecision
from qsync_lab.runtime.registry import (
    OpHandler,
    addressable_kinds,
    current_precision,
    handler_for,
)

PrecisionSpec = str | Precision | OpPrecision | Mapping[str, str]
DESCRIBE_COLUMNS = ["kind", "forward", "backward", "rounding", "granularity"]


def _device_spec(device: str | DeviceSpec | None) -> DeviceSpec | None:
    if device is None or isinstance(device, DeviceSpec):
        return device
    return load_catalog().device(device)


def _addressable(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """FQN -> (module, kind) of every module a plan can address."""
    found = {}
    for fqn, module in model.named_modules():
        kind = module_kind(module)
        if handler_for(kind) is not None:
            found[fqn] = (module, kind)
    return found


def _unknown_fqn(fqn: str, model: nn.Module, addressable: Mapping[str, object]) -> QSyncError:
    try:
        module = model.get_submodule(fqn)
    except AttributeError:
        close = difflib.get_close_matches(fqn, list(addressable), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return QSyncError(
            f"unknown op FQN {fqn!r}: the model has no module of that name{hint} "
            "(describe_precisions(model) lists the ops a plan can set)"
        )
    kind = module_kind(module)
    if kind is None:
        return QSyncError(
            f"{fqn!r} is a {type(module).__name__} container, not an operator; name its "
            "operators instead (describe_precisions(model) lists them)"
        )
    return QSyncError(
        f"op {fqn!r} is a {kind}, which a plan cannot set (its precision follows its "
        f"inputs); remove it from the plan (settable kinds: {', '.join(addressable_kinds())})"
    )


def _resolve(fqn: str, kind: str, module: nn.Module, handler: OpHandler, spec: PrecisionSpec,
             device: DeviceSpec | None) -> OpPrecision:
    """The config the op will run in, or a one-line QSyncError naming the op."""
    try:
        cfg = handler.normalize(OpPrecision.parse(spec))
        for precision in (cfg.forward, cfg.backward_precision):
            if precision not in handler.precisions:
                allowed = ", ".join(p for p in Precision if p in handler.precisions)
                raise QSyncError(f"{kind} ops cannot run {precision}; they take {allowed}")
        reason = None if cfg.is_fp32 else handler.unsupported(module)
        if reason:
            raise QSyncError(f"it cannot run {cfg.forward}: {reason}; run it in fp32")
        if device is not None:
            device.require(cfg.forward)
            device.require(cfg.backward_precision)
    except QSyncError as err:
        raise QSyncError(f"op {fqn!r}: {err}") from None
    return cfg


def apply_plan_(model: nn.Module, precisions: Mapping[str, PrecisionSpec | None], *,
                device: str | DeviceSpec | None = None) -> None:
    """Make each named op of ``model`` run in its precision, in place.

    Every entry is checked before anything changes, so a bad plan leaves the model as it
    was. Ops not named keep their current precision (pass ``"fp32"`` to restore one); a
    value of None leaves that op alone. Parameters, buffers and state_dict keys never
    change, and fp32 ops run the plain torch modules, so an all-fp32 plan is bit-identical
    to the original model.

    Args:
        model: the model; op FQNs are module names (``model.named_modules()``), the same
            as ``qsync_lab.graph`` op FQNs for module ops.
        precisions: op FQN -> precision name, :class:`Precision`, :class:`OpPrecision` or
            mapping (``{"forward": "int8", "backward": "bf16", "rounding": "stochastic",
            "granularity": "channel"}``).
        device: a catalog device name or :class:`DeviceSpec` whose supported precisions
            every op must respect; None skips that check.

    Raises:
        QSyncError: one line naming the op, for an unknown FQN, an op kind a plan cannot
            set, a precision the kind cannot take, or one the device cannot run.
    """
    if not isinstance(precisions, Mapping):
        raise QSyncError(
            f"precisions must be a mapping op FQN -> precision, got {type(precisions).__name__}"
        )
    spec = _device_spec(device)
    addressable = _addressable(model)
    resolved = []
    for fqn, value in precisions.items():
        if value is None:
            continue
        if fqn not in addressable:
            raise _unknown_fqn(fqn, model, addressable)
        module, kind = addressable[fqn]
        handler = handler_for(kind)
        resolved.append((module, handler, _resolve(fqn, kind, module, handler, value, spec), fqn))
    for module, handler, cfg, fqn in resolved:
        handler.apply(module, cfg, fqn)


def describe_precisions(model: nn.Module) -> pd.DataFrame:
    """One row per op a plan can address: kind and the precisions it runs in.

    Returns:
        DataFrame indexed by op FQN (``fqn``) with columns kind, forward, backward,
        rounding, granularity (strings).
    """
    rows = {}
    for fqn, (module, kind) in _addressable(model).items():
        cfg = current_precision(module).to_dict()
        rows[fqn] = {"kind": kind, **cfg}
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=DESCRIBE_COLUMNS)
    frame.index.name = "fqn"
    return frame
