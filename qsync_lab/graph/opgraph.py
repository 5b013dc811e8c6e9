"""``OpGraph``: one row per operator of a model, built from a traced forward pass.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> graph = trace_graph(model, (torch.randn(2, 8),))
    >>> print(graph.ops[["kind", "fwd_flops", "depth"]].to_string())
            kind  fwd_flops  depth
    name                              
    0         linear        544      0
    1     activation         32      1
    2         linear        264      2
"""

import dataclasses
import functools
import hashlib
import keyword
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn as nn

from qsync_lab.errors import QSyncError
from qsync_lab.graph.attention import splits
from qsync_lab.graph.fx_tracer import trace_fx
from qsync_lab.graph.hook_tracer import trace_hooks
from qsync_lab.graph.kinds import VIEW_KINDS, gather_kind, module_kind
from qsync_lab.graph.opcount import count_op
from qsync_lab.graph.records import OpRecord
from qsync_lab.modelstate import preserved_state

_LOSS_ATTR = "loss"
#: torch.fx patches ``nn.Module.__call__`` for the whole process while it traces, and the
#: hook tracer hooks every module: traces from several threads (two runs started side by
#: side in a notebook) would record each other's modules, so they run one at a time
_TRACE_LOCK = threading.Lock()
_MODEL_ATTR = "model"


class TracingFallbackWarning(UserWarning):
    """torch.fx could not trace the model; the hook tracer was used instead."""


#: the models this process has warned about (:func:`warn_hooks_fallback`)
_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def warn_hooks_fallback(model: nn.Module, err: BaseException, stacklevel: int) -> None:
    """A :class:`TracingFallbackWarning` that torch.fx cannot trace ``model`` (``err``), once
    per model: its tracing, profiling and training warn no more."""
    if model in _WARNED:
        return
    _WARNED.add(model)
    warnings.warn(f"torch.fx cannot trace {type(model).__name__} ({_one_line(err)}); its ops "
                  "are recorded and timed with module hooks instead", TracingFallbackWarning,
                  stacklevel=stacklevel + 1)


@dataclass(frozen=True)
class OpGraph:
    """Operators, data edges and parameters of one forward pass (plus loss, if given).

    Attributes:
        ops: DataFrame indexed by op FQN (``name``), in execution order, with columns
            ``kind, target, input_shapes, input_dtypes, output_shapes, output_dtypes,
            weight_shapes, weight_dtypes, params, inputs, fwd_flops, bwd_input_flops, bwd_weight_flops,
            bytes_read, bytes_written, saved_bytes, saved_tensors, depth, plan_refusal``
            (``saved_tensors``: the op's row of :func:`saved_tensors`, which activations it
            keeps that other ops may keep too; ``plan_refusal``: why a plan cannot set the
            op, "" when it can, :mod:`qsync_lab.policy`).
        edges: DataFrame ``(src, dst)`` of data edges between ops.
        params: DataFrame indexed by parameter FQN: ``shape, dtype, numel, bytes,
            requires_grad, first_op`` (the first op that reads it), in
            ``model.parameters()`` order.
        traced_with: ``"fx"`` or ``"hooks"``.
        saved_bytes_by_device: bytes autograd keeps for backward, per device type (see
            :meth:`saved_activation_bytes`).
        buffer_bytes: bytes of the model's buffers (BatchNorm statistics, position ids),
            which DDP broadcasts from rank 0 before every forward.
        batch_size: dim 0 of the first example input (None: not known).

    The per-op ``saved_bytes`` column follows CUDA's kernels.
    """

    ops: pd.DataFrame
    edges: pd.DataFrame
    params: pd.DataFrame
    traced_with: str
    saved_bytes_by_device: dict[str, int]
    buffer_bytes: int = 0
    batch_size: int | None = None

    def saved_activation_bytes(self, device_type: str = "cuda") -> int:
        """Bytes autograd keeps for backward in one training step on ``device_type``
        (``"cuda"`` or ``"cpu"``: they differ in dropout's mask), each stored tensor
        counted once even when several ops save it or a view of it."""
        if device_type not in self.saved_bytes_by_device:
            raise QSyncError(f"unknown device type {device_type!r}; choose one of: "
                             f"{', '.join(self.saved_bytes_by_device)}")
        return self.saved_bytes_by_device[device_type]

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def totals(self) -> pd.Series:
        """Sums over all ops of the FLOP and byte columns, plus the parameter count."""
        cols = ["fwd_flops", "bwd_input_flops", "bwd_weight_flops", "bytes_read",
                "bytes_written"]
        out = self.ops[cols].sum()
        out["param_count"] = int(self.params["numel"].sum())
        out["param_bytes"] = int(self.params["bytes"].sum())
        out["saved_activation_bytes"] = self.saved_activation_bytes()
        return out.astype("int64")

    def kind_summary(self) -> pd.DataFrame:
        """Per op kind: count and summed forward/backward GFLOPs."""
        g = self.ops.groupby("kind", sort=True)
        out = pd.DataFrame({
            "ops": g.size(),
            "fwd_gflops": g["fwd_flops"].sum() / 1e9,
            "bwd_gflops": (g["bwd_input_flops"].sum() + g["bwd_weight_flops"].sum()) / 1e9,
        })
        return out.sort_values("fwd_gflops", ascending=False)

    def fingerprint(self) -> str:
        """Hash of op FQNs, kinds and weight shapes: plans record it to detect another model.

        Activation shapes are left out on purpose: the same model traced at another batch
        size (every rank of an uneven plan has its own) has the same fingerprint.
        """
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for name, kind, shapes in zip(self.ops.index, self.ops["kind"], self.ops["weight_shapes"]):
            h.update(f"{name}|{kind}|{shapes}\n".encode())
        return h.hexdigest()[:16]


def trace_graph(model: nn.Module, example_inputs, *, target: torch.Tensor | None = None,
                loss_fn: nn.Module | None = None, method: str = "auto") -> OpGraph:
    """Trace ``model`` on ``example_inputs`` into an :class:`OpGraph`.

    Args:
        model: the module to trace; its parameters and buffers are left unchanged.
        example_inputs: a tensor or a tuple of tensors passed to ``model``, or a dict of
            tensors passed as ``model(**example_inputs)``.
        target: with ``loss_fn``, traces ``loss_fn(model(*inputs), target)`` so the graph
            ends in a ``loss`` op.
        loss_fn: a loss module (e.g. ``nn.CrossEntropyLoss()``).
        method: ``"auto"`` (torch.fx, falling back to hooks with a
            :class:`TracingFallbackWarning`, once per model), ``"fx"`` or ``"hooks"``.

    Example::

        >>> import torch, torch.nn as nn
        >>> g = trace_graph(nn.Linear(4, 2), torch.randn(3, 4),
        ...                 target=torch.tensor([0, 1, 1]), loss_fn=nn.CrossEntropyLoss())
        >>> list(g.ops.index), g.traced_with
        (['linear', 'loss'], 'fx')
    """
    if not isinstance(model, nn.Module):
        raise QSyncError(f"expected a torch.nn.Module to trace, got {type(model).__name__}; "
                         "pass the model object itself")
    if method not in ("auto", "fx", "hooks"):
        raise QSyncError(f"unknown tracing method {method!r}; choose auto, fx or hooks")
    inputs, keywords = _as_inputs(example_inputs)
    batch_size = int(inputs[0].shape[0]) if inputs[0].dim() > 0 else None
    if (target is None) != (loss_fn is None):
        raise QSyncError("give both target and loss_fn to trace the loss, or neither")
    root = model
    if loss_fn is not None or keywords or splits(model):  # fx traces a root's forward as is
        root = _with_loss(model, loss_fn, len(inputs), keywords=keywords)
        inputs = (*inputs, target) if loss_fn is not None else inputs
    with _TRACE_LOCK, preserved_state(model), torch.no_grad():
        for module in model.modules():  # judged by running them, before fx patches them
            module_kind(module)
        records, traced_with = _trace(model, root, inputs, method)
    if root is not model:
        records = [_strip_wrapper(rec, model) for rec in records]
    return dataclasses.replace(_build(records, model, traced_with), batch_size=batch_size)


def _trace(model: nn.Module, root: nn.Module, inputs: tuple,
           method: str) -> tuple[list[OpRecord], str]:
    """The records of ``root`` (``model`` or its loss wrapper) and how they were traced."""
    if method == "hooks":
        return trace_hooks(root, inputs), "hooks"
    try:
        return trace_fx(root, inputs), "fx"
    except Exception as err:  # fx raises many types for untraceable code
        if method == "fx":
            raise QSyncError(f"torch.fx cannot trace {type(model).__name__}: "
                             f"{_one_line(err)}; use method='hooks'") from err
        warn_hooks_fallback(model, err, stacklevel=3)
        return trace_hooks(root, inputs), "hooks"


class _WithLoss(nn.Module):
    """``loss_fn(model(*inputs), target)`` as one module, so the loss is traced too (or
    ``model(**inputs)`` alone, for a model called with keywords)."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module | None) -> None:
        super().__init__()
        setattr(self, _MODEL_ATTR, model)
        if loss_fn is not None:
            setattr(self, _LOSS_ATTR, loss_fn)


def _with_loss(model: nn.Module, loss_fn: nn.Module | None, num_inputs: int, *,
               keywords: tuple[str, ...] = ()) -> nn.Module:
    """A ``_WithLoss`` whose forward takes exactly ``num_inputs`` inputs (and the target,
    with a loss) and passes them on positionally, or by the names in ``keywords`` (torch.fx
    needs named positional arguments; it cannot unpack ``*args``)."""
    names = [f"x{i}" for i in range(num_inputs)]
    passed = ", ".join(f"{k}={n}" for k, n in zip(keywords, names)) if keywords else \
        ", ".join(names)
    call = f"self.{_MODEL_ATTR}({passed})"
    if loss_fn is not None:
        names.append("target")
        call = f"self.{_LOSS_ATTR}({call}, target)"
    source = f"def forward(self, {', '.join(names)}):\n    return {call}\n"
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 - fixed template, no user text
    cls = type("_WithLoss", (_WithLoss,), {"forward": namespace["forward"]})
    return cls(model, loss_fn)


def _loss_root(model: nn.Module, loss_fn: nn.Module, example_inputs) -> tuple[nn.Module, tuple]:
    """``(root, inputs)``: ``root(*inputs, target)`` computes ``loss_fn(model(...), target)``
    for a tuple batch or a dict batch (``model(**batch)``)."""
    inputs, keywords = _as_inputs(example_inputs)
    return _with_loss(model, loss_fn, len(inputs), keywords=keywords), inputs


def _strip_wrapper(rec: OpRecord, model: nn.Module) -> OpRecord:
    """Drop the ``model.`` prefix that tracing through ``_WithLoss`` adds (a model that is
    itself one op module, e.g. a bare ``nn.Linear``, is named after its class)."""
    prefix = f"{_MODEL_ATTR}."

    def strip(name: str | None) -> str | None:
        if name == _MODEL_ATTR:
            return type(model).__name__.lower()
        return name[len(prefix):] if name and name.startswith(prefix) else name

    rec.name = strip(rec.name)
    rec.input_ops = [strip(n) for n in rec.input_ops]
    rec.params = [(strip(n), m) for n, m in rec.params]
    return rec


def _build(records: list[OpRecord], model: nn.Module, traced_with: str) -> OpGraph:
    if not records:
        raise QSyncError(f"{type(model).__name__} ran no operators on the example inputs; "
                         "check that forward() uses its inputs")
    for rec in records:
        rec.kind = gather_kind(rec)
    counts = {rec.name: count_op(rec) for rec in records}
    kept = saved_tensors(records)
    depth = _depths(records)
    rows = []
    for rec in records:
        c = counts[rec.name]
        rows.append({
            "name": rec.name,
            "kind": rec.kind,
            "target": rec.target,
            "input_shapes": tuple(t.shape for t in rec.inputs),
            "input_dtypes": tuple(str(t.dtype).removeprefix("torch.") for t in rec.inputs),
            "output_shapes": tuple(t.shape for t in rec.outputs),
            "output_dtypes": tuple(str(t.dtype).removeprefix("torch.") for t in rec.outputs),
            "weight_shapes": tuple(m.shape for _, m in rec.params),
            "weight_dtypes": tuple(str(m.dtype).removeprefix("torch.") for _, m in rec.params),
            "params": tuple(n for n, _ in rec.params),
            "inputs": tuple(dict.fromkeys(n for n in rec.input_ops if n is not None)),
            "fwd_flops": c.fwd_flops,
            "bwd_input_flops": c.bwd_input_flops,
            "bwd_weight_flops": c.bwd_weight_flops,
            "bytes_read": c.bytes_read,
            "bytes_written": c.bytes_written,
            "saved_bytes": c.saved_bytes,
            "saved_tensors": kept[rec.name],
            "depth": depth[rec.name],
            "plan_refusal": rec.plan_refusal,
        })
    ops = pd.DataFrame(rows).set_index("name")
    edges = pd.DataFrame([(src, dst) for dst, row in ops.iterrows() for src in row["inputs"]],
                         columns=["src", "dst"])
    saved = {device: _saved_activation_bytes(records, device) for device in ("cuda", "cpu")}
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return OpGraph(ops, edges, _param_table(model, records), traced_with, saved, buffer_bytes)


def _depths(records: list[OpRecord]) -> dict[str, int]:
    """Forward depth: the number of non-view ops on the longest path from the inputs.

    QSync uses this to weight forward error by what lies downstream and backward error by
    what lies upstream; view ops (reshape, transpose, getitem) add no depth.
    """
    kind = {rec.name: rec.kind for rec in records}
    depth: dict[str, int] = {}
    for rec in records:  # records are in execution (topological) order
        preds = [p for p in rec.input_ops if p is not None and p in depth]
        depth[rec.name] = max(
            (depth[p] + (0 if kind[p] in VIEW_KINDS else 1) for p in preds), default=0)
    return depth


def saved_tensors(records: list[OpRecord], device_type: str = "cuda") -> dict[str, tuple]:
    """Per op, the activations it keeps for backward that other ops may keep too:
    ``(owner, storage_bytes, view_bytes, is_float)`` per tensor, where ``owner`` is the op
    that wrote the storage, looking through views (None for a graph input: data, labels),
    ``storage_bytes`` that op's output (a saved view keeps its producer's whole output
    alive), ``view_bytes`` the tensor the op reads (what it keeps when it saves a copy in
    another format instead) and ``is_float`` whether it holds floats (not indices). An op
    keeping its own output (ReLU, softmax, attention) lists itself. The rest of an op's
    ``saved_bytes`` (statistics, masks, indices) is its own.

    Example::

        >>> from qsync_lab.graph.records import TensorMeta
        >>> x = TensorMeta((4, 8), torch.float32)
        >>> relu = OpRecord("relu", "activation", "relu", [x], [None], [x])
        >>> fc = OpRecord("fc", "linear", "torch.nn.Linear", [x], ["relu"],
        ...               [TensorMeta((4, 2), torch.float32)],
        ...               [("fc.weight", TensorMeta((2, 8), torch.float32))])
        >>> saved_tensors([relu, fc])
        {'relu': (('relu', 128, 128, True),), 'fc': (('relu', 128, 128, True),)}
    """
    by_name = {rec.name: rec for rec in records}

    def storage_owner(name: str | None) -> str | None:
        while name is not None and by_name[name].kind in VIEW_KINDS and by_name[name].input_ops:
            name = by_name[name].input_ops[0]
        return name

    kept: dict[str, tuple] = {}
    for rec in records:
        c = count_op(rec, device_type)
        tensors = []
        for i in c.saved_inputs:
            owner = storage_owner(rec.input_ops[i]) if i < len(rec.input_ops) else None
            storage = rec.inputs[i].nbytes if owner is None else by_name[owner].outputs[0].nbytes
            tensors.append((owner, storage, rec.inputs[i].nbytes,
                            rec.inputs[i].dtype.is_floating_point))
        if c.saved_output_bytes:
            tensors.append((rec.name, c.saved_output_bytes, c.saved_output_bytes,
                            rec.outputs[0].dtype.is_floating_point))
        kept[rec.name] = tuple(tensors)
    return kept


def _saved_activation_bytes(records: list[OpRecord], device_type: str) -> int:
    """Bytes autograd keeps for backward, a tensor saved by several ops counted once.

    A saved input is identified by the op that stored its data, looking through views:
    a ReLU's output saved by the ReLU and, flattened, by the next Linear is one tensor, and
    a saved view keeps its producer's whole output alive (:func:`saved_tensors`).
    """
    stored: dict[object, int] = {}
    total_extra = sum(count_op(rec, device_type).saved_extra_bytes for rec in records)
    for name, tensors in saved_tensors(records, device_type).items():
        for i, (owner, storage, _, _) in enumerate(tensors):
            stored[(name, i) if owner is None else owner] = storage
    return sum(stored.values()) + total_extra


def _param_table(model: nn.Module, records: list[OpRecord]) -> pd.DataFrame:
    first_op: dict[str, str] = {}
    for rec in records:
        for name, _ in rec.params:
            first_op.setdefault(name, rec.name)
    rows = [{
        "param": name,
        "shape": tuple(p.shape),
        "dtype": str(p.dtype).removeprefix("torch."),
        "numel": p.numel(),
        "bytes": p.numel() * p.element_size(),
        "requires_grad": p.requires_grad,
        "first_op": first_op.get(name),
    } for name, p in model.named_parameters()]
    columns = ["param", "shape", "dtype", "numel", "bytes", "requires_grad", "first_op"]
    return pd.DataFrame(rows, columns=columns).set_index("param")


def _as_inputs(example_inputs) -> tuple[tuple[torch.Tensor, ...], tuple[str, ...]]:
    """The input tensors, and their keywords when the model is called as ``model(**batch)``."""
    keywords: tuple[str, ...] = ()
    if isinstance(example_inputs, Mapping):
        keywords = tuple(example_inputs)
        bad = [k for k in keywords if not (isinstance(k, str) and k.isidentifier()
                                           and not keyword.iskeyword(k))]
        if bad:
            raise QSyncError(f"example input name {bad[0]!r} is not a Python identifier; the "
                             "keys of a dict batch are the names of the forward's arguments")
        example_inputs = tuple(example_inputs.values())
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise QSyncError("example_inputs must be a tensor, a non-empty tuple of tensors or a "
                         f"dict of tensors (model(**batch)), got {type(example_inputs).__name__}")
    return tuple(inputs), keywords


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
