"""The table: which op kinds a plan may set, in which precisions, through which calls.

=============================  =======================================  ==========================
op kind                        precisions a plan may give it            calls a plan can set
=============================  =======================================  ==========================
linear                         every precision                          modules, ``F.linear``,
                                                                        the in-projection of
                                                                        ``nn.MultiheadAttention``
conv1d, conv2d, conv3d         every precision                          modules
matmul                         every precision                          ``op_kind = "matmul"``
                                                                        modules, ``torch.matmul``,
                                                                        ``mm``, ``bmm``, ``@``
embedding                      every precision but tf32 (no GEMM)       modules
batch/layer/group/rms norm     fp32, fp16, bf16 (16-bit float I/O,      modules
                               fp32 math inside)
=============================  =======================================  ==========================

"Every precision" is fp32, tf32, bf16, fp16, int8 and fp8 e4m3/e5m2. The backward pass must
be one of the kind's precisions too (never int8), and the device must run both
(:meth:`~qsync_lab.devices.DeviceSpec.supports`). Every other kind follows its inputs
(:mod:`qsync_lab.policy.resolve`).

A module of a class this table does not list is an op of the kind it computes
(:mod:`qsync_lab.policy.evidence`: a linear map with its weight stored either way, a layer
or RMS norm), judged by running it.

Skip rules, per call: a module whose class overrides the forward of the torch class of its
kind (a linear, conv or embedding subclass with its own forward: the low-precision
version would replace that forward), a module that declares ``op_kind`` of a kind with a
torch class without being one, an embedding with ``max_norm`` or sparse gradients, and
functional calls of kinds without a functional entry above, all run in fp32.

Example::

    >>> from torch import nn
    >>> from qsync_lab.precision import Precision
    >>> kind_allows("embedding", Precision.TF32), kind_allows("layer_norm", Precision.BF16)
    (False, True)
    >>> module_refusal(nn.Embedding(10, 4, max_norm=1.0), "embedding")
    'an embedding with max_norm or sparse gradients runs in fp32'
    >>> function_refusal("bmm", "matmul") is None, function_refusal("conv2d", "conv2d")
    (True, 'functional conv2d calls run in fp32; use a module to plan it')
"""

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from qsync_lab.errors import QSyncError
from qsync_lab.policy.evidence import computed_kind
from qsync_lab.policy.op_precision import OpPrecision
from qsync_lab.precision import Precision

__all__ = ["GEMM_KINDS", "NORM_KINDS", "PLANNABLE_KINDS", "SCORED_KINDS", "WEIGHTED_KINDS",
           "KindRule", "allowed_precisions", "check_device_precision", "check_op_precision",
           "forward_refusal", "function_refusal", "kind_allows", "module_refusal",
           "runs_natively"]


@dataclass(frozen=True)
class KindRule:
    """How plans may set the ops of one kind.

    Attributes:
        precisions: what the forward and backward passes may run in.
        torch_class: the import path of the kind's torch module class (None: modules
            declare the kind with ``op_kind``, as the zoo's ``MatMul`` does); read when
            first needed, so importing the policy does not import torch.
        replaces_forward: whether a low precision replaces the module's forward (GEMM
            kinds) rather than rounding its inputs and outputs (norms).
        functions: functional calls (operator names) a plan can set too.
        native: the forward precisions a GPU runs with torch's own kernels (cuBLAS, cuDNN,
            ``torch._int_mm``, ``torch._scaled_mm``); the others are emulated there
            (:func:`runs_natively`).
        fp32_inside: for norms (not ``replaces_forward``) run natively in fp16/bf16,
            whether their kernel is given fp32 inputs (and writes the low dtype after)
            or reads the 16-bit inputs itself (batch norm's mixed-dtype kernels, as
            ``torch.autocast`` runs it).
        gemm: whether the op is a matrix product (cuBLAS/cuDNN): its FLOPs follow from the
            shapes, and it saves its operands for backward in the plan's format.
    """

    precisions: frozenset[Precision]
    torch_class: str | None
    replaces_forward: bool
    functions: frozenset[str] = frozenset()
    native: frozenset[Precision] = frozenset()
    fp32_inside: bool = True
    gemm: bool = False

    @property
    def scored(self) -> bool:
        """Whether the indicator scores the op's weight and activation (the GEMMs and
        embeddings); the others are norms, which round their inputs and outputs."""
        return self.replaces_forward

    @property
    def weighted(self) -> bool:
        """Whether the op is a module with its own weight that a plan re-encodes."""
        return self.replaces_forward and self.torch_class is not None

    @property
    def module_class(self) -> type | None:
        """The torch module class of the kind (None for declared kinds)."""
        return None if self.torch_class is None else _import(self.torch_class)


_EVERY = frozenset(Precision)
_NORM = frozenset({Precision.FP32, Precision.FP16, Precision.BF16})
_FLOATS = frozenset({Precision.FP32, Precision.TF32, Precision.BF16, Precision.FP16})
#: GEMMs with a native kernel in every precision a GPU has, but fp8 e5m2 operands
#: (``torch._scaled_mm`` multiplies e4m3 by e4m3 or e5m2; e5m2 is the recipe's gradient)
_GEMM_NATIVE = _FLOATS | {Precision.INT8, Precision.FP8_E4M3}

#: op kind -> its rule; kinds not listed follow their inputs
PLANNABLE_KINDS: Mapping[str, KindRule] = MappingProxyType({
    "linear": KindRule(_EVERY, "torch.nn.Linear", True,
                       frozenset({"linear", "mha_in_projection"}), _GEMM_NATIVE, gemm=True),
    "conv1d": KindRule(_EVERY, "torch.nn.Conv1d", True, native=_FLOATS, gemm=True),
    "conv2d": KindRule(_EVERY, "torch.nn.Conv2d", True, native=_FLOATS, gemm=True),
    "conv3d": KindRule(_EVERY, "torch.nn.Conv3d", True, native=_FLOATS, gemm=True),
    # batched products: torch's int8 and fp8 GEMMs take 2-d operands only
    "matmul": KindRule(_EVERY, None, True, frozenset({"matmul", "mm", "bmm"}), _FLOATS,
                       gemm=True),
    "embedding": KindRule(_EVERY - {Precision.TF32}, "torch.nn.Embedding", True,
                          native=_NORM),
    "batch_norm": KindRule(_NORM, "torch.nn.modules.batchnorm._BatchNorm", False, native=_NORM,
                           fp32_inside=False),
    "layer_norm": KindRule(_NORM, "torch.nn.LayerNorm", False, native=_NORM),
    "group_norm": KindRule(_NORM, "torch.nn.GroupNorm", False, native=_NORM),
    "rms_norm": KindRule(_NORM, "torch.nn.RMSNorm", False, native=_NORM),
})

#: matrix products: their FLOPs follow from the shapes; they save encoded operands
GEMM_KINDS = frozenset(k for k, rule in PLANNABLE_KINDS.items() if rule.gemm)
#: kinds the indicator scores by weight and activation sensitivity
SCORED_KINDS = frozenset(k for k, rule in PLANNABLE_KINDS.items() if rule.scored)
#: normalisations: 16-bit inputs and outputs at most, never scored
NORM_KINDS = frozenset(PLANNABLE_KINDS) - SCORED_KINDS
#: modules with a weight whose precision a plan changes
WEIGHTED_KINDS = frozenset(k for k, rule in PLANNABLE_KINDS.items() if rule.weighted)


def allowed_precisions(kind: str) -> frozenset[Precision]:
    """The precisions a plan may give ops of ``kind`` (empty for kinds that follow)."""
    rule = PLANNABLE_KINDS.get(kind)
    return rule.precisions if rule is not None else frozenset()


def kind_allows(kind: str, precision: "Precision | str") -> bool:
    """Whether a plan may run ops of ``kind`` in ``precision`` (on some device)."""
    return Precision.parse(precision) in allowed_precisions(kind)


def module_refusal(module, kind: str | None) -> str | None:
    """Why a plan cannot set this module (traced as an op of ``kind``), or None if it can."""
    rule = PLANNABLE_KINDS.get(kind)
    if rule is None:
        return _follower_text(kind)
    # a module already in low precision is judged by the class it was made from
    cls = getattr(type(module), "op_float_class", type(module))
    base = rule.module_class
    if base is not None and not isinstance(module, base):
        if computed_kind(module) == kind:  # its forward computes the kind (evidence)
            return None
        return (f"its class {cls.__name__} declares op_kind {kind!r} but is not a "
                f"{base.__name__}; it runs in fp32")
    if rule.replaces_forward and base is not None and cls.forward is not base.forward:
        return (f"its class {cls.__name__} has its own forward, which a low precision would "
                "replace; it runs in fp32")
    if kind == "embedding" and (module.max_norm is not None or module.sparse):
        return "an embedding with max_norm or sparse gradients runs in fp32"
    return None


def function_refusal(op_name: str, kind: str) -> str | None:
    """Why a plan cannot set a functional call of ``kind``, or None if it can.

    ``op_name`` is the call's operator name (``matmul`` for ``torch.matmul``,
    ``Tensor.matmul`` and ``@``; :func:`qsync_lab.graph.records.op_name_of`).
    """
    rule = PLANNABLE_KINDS.get(kind)
    if rule is None:
        return _follower_text(kind)
    if op_name not in rule.functions:
        return f"functional {kind} calls run in fp32; use a module to plan it"
    return None


def runs_natively(kind: str, precision: "Precision | str", device) -> bool:
    """Whether ``device`` runs ops of ``kind`` in ``precision`` with torch's native kernels.

    False on a device that emulates every precision (the CPU) and for the pairs a GPU
    emulates (int8 and fp8 convolutions, batched matmuls and embeddings): the cost model
    charges those as fp32 work plus the operands' encoding, so the allocator never picks
    them to go faster.

    Example::

        >>> from qsync_lab.devices import load_catalog
        >>> t4 = load_catalog().device("T4")
        >>> runs_natively("linear", "int8", t4), runs_natively("conv2d", "int8", t4)
        (True, False)
    """
    rule = PLANNABLE_KINDS.get(kind)
    return (not device.emulated and rule is not None
            and Precision.parse(precision) in rule.native)


def check_op_precision(kind: str, spec: "str | Precision | OpPrecision | Mapping",
                       device=None) -> OpPrecision:
    """The config of ``spec`` if ops of ``kind`` may run it (on ``device`` when given).

    Example::

        >>> try:
        ...     check_op_precision("layer_norm", "int8")
        ... except QSyncError as err:
        ...     print(err)
        layer_norm ops cannot run int8; they take fp32, bf16, fp16

    Raises:
        QSyncError: one line: the kind follows its inputs, the kind cannot take the forward
            or backward precision, or the device cannot run one of them
            (:func:`check_device_precision`).
    """
    cfg = OpPrecision.parse(spec)
    rule = PLANNABLE_KINDS.get(kind)
    if rule is None:
        raise QSyncError(_follower_text(kind) + "; remove it from the plan")
    for precision in dict.fromkeys((cfg.forward, cfg.backward_precision)):
        if precision not in rule.precisions:
            allowed = ", ".join(p for p in Precision if p in rule.precisions)
            raise QSyncError(f"{kind} ops cannot run {precision}; they take {allowed}")
    return cfg if device is None else check_device_precision(cfg, device)


def check_device_precision(spec: "str | Precision | OpPrecision | Mapping",
                           device) -> OpPrecision:
    """The config of ``spec`` if ``device`` runs its forward and backward precisions
    (:meth:`~qsync_lab.devices.DeviceSpec.require`) and its forward pass
    (:func:`forward_refusal`), whatever the op's kind.

    Example::

        >>> from qsync_lab.devices import load_catalog
        >>> catalog = load_catalog()
        >>> str(check_device_precision("int8", catalog.device("T4")).backward_precision)
        'fp16'
        >>> try:
        ...     check_device_precision("fp8_e5m2", catalog.device("H100-SXM5-80GB"))
        ... except QSyncError as err:
        ...     print(str(err).split(" (")[0])
        H100-SXM5-80GB has no fp8_e5m2 x fp8_e5m2 GEMM

    Raises:
        QSyncError: one line: the device cannot run the forward or backward precision, or
            has no kernel for the forward pass.
    """
    cfg = OpPrecision.parse(spec)
    for precision in dict.fromkeys((cfg.forward, cfg.backward_precision)):
        device.require(precision)
    refusal = forward_refusal(cfg.forward, device)
    if refusal:
        raise QSyncError(refusal)
    return cfg


def forward_refusal(precision: "Precision | str", device) -> str | None:
    """Why ``device`` cannot run a forward pass in ``precision`` (a precision it supports),
    or None if it can: a GPU has no fp8_e5m2 x fp8_e5m2 GEMM.

    Example::

        >>> from qsync_lab.devices import load_catalog
        >>> catalog = load_catalog()
        >>> forward_refusal("fp8_e5m2", catalog.device("cpu")) is None
        True
        >>> forward_refusal("fp8_e5m2", catalog.device("H100-SXM5-80GB")).split(" (")[0]
        'H100-SXM5-80GB has no fp8_e5m2 x fp8_e5m2 GEMM'
    """
    if device.emulated or Precision.parse(precision) is not Precision.FP8_E5M2:
        return None
    return (f"{device.name} has no fp8_e5m2 x fp8_e5m2 GEMM (torch._scaled_mm multiplies "
            "e4m3 operands; e5m2 is the FP8 recipe's gradient format): use fp8_e4m3, whose "
            "backward runs in e5m2")


def _follower_text(kind: str | None) -> str:
    planned = ", ".join(PLANNABLE_KINDS)
    return (f"{kind or 'this'} ops follow their inputs' precision (a plan sets only "
            f"{planned})")


@functools.cache
def _import(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
