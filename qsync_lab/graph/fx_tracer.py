"""Record operators with torch.fx: symbolic trace, then shape propagation.

Shapes are propagated with fake tensors (no arithmetic), so tracing BERT-base on a
paper-scale batch costs no more than on a tiny one; ops without a fake kernel fall back
to propagation with the real example inputs. An ``nn.MultiheadAttention`` is traced as
its three ops (:mod:`qsync_lab.graph.attention`).

Example::

    >>> import torch, torch.nn as nn
    >>> recs = trace_fx(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), (torch.randn(2, 4),))
    >>> [(r.name, r.kind) for r in recs]
    [('0', 'linear'), ('1', 'activation')]
"""

import contextlib
import functools

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from qsync_lab.graph import attention
from qsync_lab.graph.flop_count import counted_forward_flops
from qsync_lab.graph.kinds import (COUNTED_KINDS, function_record, is_leaf_module, module_kind,
                                   module_record)
from qsync_lab.graph.records import OpNamer, OpRecord, TensorMeta


class _LeafTracer(fx.Tracer):
    """fx tracer that keeps every op module (see ``kinds.is_leaf_module``) as one node, but
    an ``nn.MultiheadAttention``, which it traces as three
    (:func:`qsync_lab.graph.attention.split_forward`)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_leaf_module(m) and not attention.splits(m)

    def call_module(self, m: nn.Module, forward, args, kwargs):
        if attention.splits(m):
            forward = functools.partial(attention.split_forward, m)
        return super().call_module(m, forward, args, kwargs)


@contextlib.contextmanager
def _traceable_transformers():
    """``nn.TransformerEncoder`` and its layers as torch.fx can trace them: the inference
    fast path off (its eligibility checks branch on tensors; a training graph never takes
    it), and ``_get_seq_len`` (which branches on ``src.is_nested``) answering None: the
    length only serves to detect a causal mask, which then reads it off the mask itself."""
    mha = getattr(torch.backends, "mha", None)
    transformer = nn.modules.transformer
    seq_len = getattr(transformer, "_get_seq_len", None)
    before = mha.get_fastpath_enabled() if mha is not None else None
    if mha is not None:
        mha.set_fastpath_enabled(False)
    if seq_len is not None:
        transformer._get_seq_len = lambda src, batch_first: None
    try:
        yield
    finally:
        if mha is not None:
            mha.set_fastpath_enabled(before)
        if seq_len is not None:
            transformer._get_seq_len = seq_len


class _ConcreteProxy(fx.Proxy):
    """A proxy that also knows its value on the example inputs (:class:`_ConcreteTracer`):
    Python code may read it as a number, take its length or ask its dtype and device. A
    size stays a node, so the ops computed from it are recorded, unless the tracer makes
    sizes concrete (a size passed to a method of a tensor that is no node: fx cannot)."""

    def value(self):
        return self.tracer.values[self.node]

    def __index__(self) -> int:
        return int(self.value())

    __int__ = __index__

    def __len__(self) -> int:
        return len(self.value())

    def __getattr__(self, name: str):
        if name in _CONCRETE_ATTRIBUTES or (name in ("shape", "size")
                                            and self.tracer.concrete_sizes):
            return getattr(self.value(), name)
        return super().__getattr__(name)

    def __float__(self) -> float:
        return float(self.value())


#: tensor attributes a :class:`_ConcreteProxy` answers with its value's, not a node
_CONCRETE_ATTRIBUTES = frozenset({"dtype", "device", "is_nested", "layout", "is_cuda",
                                  "requires_grad"})


class _ConcreteTracer(_LeafTracer):
    """A :class:`_LeafTracer` that runs each op on the example inputs as it records it, so
    the model's Python control flow (branches on shapes, dtypes and masks, ``a, b =
    x.shape``, slices by a length) takes the path those inputs take: the graph holds for
    inputs like them, which is all a trace of one batch needs."""

    def __init__(self, example_inputs: tuple, concrete_sizes: bool) -> None:
        super().__init__()
        self.example_inputs = list(example_inputs)
        self.concrete_sizes = concrete_sizes
        self.values: dict[fx.Node, object] = {}

    def trace(self, root, concrete_args=None) -> fx.Graph:
        try:
            return super().trace(root, concrete_args)
        finally:  # the example's activations, freed now: a trace in a memory window
            self.values.clear()  # would otherwise hold them until a garbage collection

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ConcreteProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None,
                     proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr,
                                     proxy_factory_fn)
        with _maybe_revert_all_patches(), torch.no_grad():  # run the op itself, untraced
            self.values[proxy.node] = self._run(kind, target, *self._values((args, kwargs)))
        return proxy

    def _run(self, kind: str, target, args, kwargs):
        if kind == "placeholder":  # the next example input, else the argument's default
            return self.example_inputs.pop(0) if self.example_inputs else (args or (None,))[0]
        if kind == "get_attr":
            return functools.reduce(getattr, target.split("."), self.root)
        if kind == "call_module":
            return self.root.get_submodule(target)(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)

    def _values(self, value):
        return fx.node.map_aggregate(value, lambda x: self.values[x.node]
                                     if isinstance(x, fx.Proxy) else x)

    def to_bool(self, obj: fx.Proxy) -> bool:
        return bool(obj.value())

    def iter(self, obj: fx.Proxy):
        return iter([obj[i] for i in range(len(obj.value()))])


def symbolic_trace(model: nn.Module, example_inputs: tuple | None = None) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` that keeps every op module as one ``call_module`` node
    (``torch.fx`` alone inlines user modules such as the zoo's ``MatMul``). A model whose
    Python branches on its inputs (a Hugging Face model's shape checks and masks) is traced
    again with ``example_inputs`` given: each op runs as it is recorded and the branches take
    the path those inputs take, so the graph is that of inputs like them (sizes kept as
    nodes where fx allows, else taken as constants too).

    Example::

        >>> import torch, torch.nn as nn
        >>> gm = symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
        >>> [n.op for n in gm.graph.nodes]
        ['placeholder', 'call_module', 'output']
        >>> class Rows(nn.Module):
        ...     def forward(self, x):
        ...         rows, _ = x.shape
        ...         return x[: rows // 2] if rows > 2 else x
        >>> symbolic_trace(Rows(), (torch.randn(6, 3),))(torch.randn(6, 3)).shape
        torch.Size([3, 3])
    """
    for module in model.modules():  # judged by running them, before fx patches them
        module_kind(module)
    tracers = [_LeafTracer]
    if example_inputs is not None:
        tracers += [functools.partial(_ConcreteTracer, example_inputs, concrete_sizes)
                    for concrete_sizes in (False, True)]
    with _traceable_transformers():
        for make_tracer in tracers:
            try:
                with _attributes_kept(model):  # no proxy left on a module
                    return fx.GraphModule(model, make_tracer().trace(model),
                                          type(model).__name__)
            except Exception:  # fx raises many types for untraceable code
                if make_tracer is tracers[-1]:
                    raise


@contextlib.contextmanager
def _attributes_kept(model: nn.Module):
    """Every module's attributes as they were before (a model that caches a size on itself
    while it runs would keep a proxy of the trace)."""
    saved = [(module, dict(module.__dict__)) for module in model.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            for name in set(module.__dict__) - set(attributes):
                del module.__dict__[name]
            module.__dict__.update(attributes)


def trace_fx(model: nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> list[OpRecord]:
    """Trace ``model`` with torch.fx and return one record per operator call.

    Raises whatever torch.fx raises for untraceable code (the caller falls back).
    """
    gm = symbolic_trace(model, example_inputs)
    _propagate_shapes(gm, example_inputs)
    params = {name: p for name, p in model.named_parameters()}
    namer = OpNamer()
    records: list[OpRecord] = []
    producer: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        outputs = _metas(node.meta.get("tensor_meta"))
        if not outputs:  # size(), dim(): shape arithmetic, not an operator
            continue
        rec = _record(node, gm, namer, params, producer)
        rec.outputs = outputs
        if rec.kind in COUNTED_KINDS:
            rec.counted_fwd_flops = _counted_flops(node, gm)
        if node.target is attention.mha_attention:
            rec.saved_bytes = _core_saved_bytes(node)
        producer[node] = rec.name
        records.append(rec)
    return records


def _propagate_shapes(gm: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...]) -> None:
    """Annotate every node with ``tensor_meta``: with fake tensors if possible, else real."""
    try:
        ShapeProp(gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(
            *example_inputs)
    except Exception:  # an op without a fake/meta kernel: compute for real
        ShapeProp(gm).propagate(*example_inputs)


def _record(node: fx.Node, gm: fx.GraphModule, namer: OpNamer,
            params: dict[str, nn.Parameter], producer: dict[fx.Node, str]) -> OpRecord:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        rec = module_record(namer.module(node.target), module)
        rec.params = [(f"{node.target}.{n}", TensorMeta.of(p))
                      for n, p in module.named_parameters()]
    else:
        fn_name = node.target if node.op == "call_method" else node.target.__name__
        part = attention.part_name(node.target, _scope(node))
        name = namer.function(_scope(node), fn_name) if part is None else namer.module(part)
        rec = function_record(name, fn_name)
    for arg in _flat_args(node):
        if not isinstance(arg, fx.Node):
            continue
        if arg.op == "get_attr" and arg.target in params:
            rec.params.append((arg.target, TensorMeta.of(params[arg.target])))
            continue
        metas = _metas(arg.meta.get("tensor_meta"))
        for meta in metas if node.target is attention.mha_attention else metas[:1]:
            rec.inputs.append(meta)  # the core reads each projection its input op made
            rec.input_ops.append(producer.get(arg))
    return rec


def _counted_flops(node: fx.Node, gm: fx.GraphModule) -> int | None:
    """The node's forward FLOPs by torch's counter, on meta tensors of its inputs' shapes."""
    def value(arg: fx.Node):
        if arg.op == "get_attr":
            return functools.reduce(getattr, arg.target.split("."), gm)
        return _meta_value(arg.meta.get("tensor_meta"))

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
    if node.op == "call_module":
        return counted_forward_flops(None, args, kwargs, module=gm.get_submodule(node.target))
    call = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
    return counted_forward_flops(call, args, kwargs)


def _core_saved_bytes(node: fx.Node) -> int:
    """What autograd keeps for a multi-head attention core (one ``mha_attention`` node)."""
    def meta(arg):
        metas = _metas(arg.meta.get("tensor_meta")) if isinstance(arg, fx.Node) else []
        return metas[0] if metas else None

    projections, key_padding_mask, attn_mask, heads, _, need_weights, _, is_causal, _ = node.args
    _, pattern, weights, *_ = projections.args  # the in-projection's call
    return attention.core_saved_bytes(_metas(projections.meta.get("tensor_meta")),
                                      meta(key_padding_mask), meta(attn_mask), heads,
                                      need_weights, is_causal,
                                      attention.packed_in_projection(pattern, weights))


def _meta_value(meta):
    """A meta tensor (or a tuple/list of them) shaped as a node's ShapeProp result."""
    if isinstance(meta, TensorMetadata):
        return torch.empty(tuple(int(s) for s in meta.shape), dtype=meta.dtype, device="meta")
    if isinstance(meta, (tuple, list)):
        return type(meta)(_meta_value(m) for m in meta)
    return meta


def _scope(node: fx.Node) -> str:
    """FQN of the innermost module whose forward made this call ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _flat_args(node: fx.Node) -> list:
    flat: list = []
    fx.node.map_aggregate((node.args, node.kwargs), flat.append)
    return flat


def _metas(meta) -> list[TensorMeta]:
    """Tensor metas of a node's ShapeProp result (tensor, or tuple/list of tensors)."""
    if isinstance(meta, TensorMetadata):
        return [TensorMeta(tuple(int(s) for s in meta.shape), meta.dtype)]
    if isinstance(meta, (tuple, list)):
        return [m for item in meta for m in _metas(item)]
    return []
