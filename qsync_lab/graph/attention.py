"""``nn.MultiheadAttention`` as three operators: in-projection, attention core, out-projection.

torch runs a multi-head attention module as one call, which would leave its projections —
most of an encoder's weights and FLOPs — inside one op that no plan can set. The graph and
the low-precision operators see it as three ops instead, named after the module ``fqn``:

* ``<fqn>.in_proj`` (kind ``linear``): the query, key and value projections, reading
  ``in_proj_weight`` and ``in_proj_bias`` (or ``q_proj_weight``, ``k_proj_weight``,
  ``v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``). It is no submodule:
  its name is the prefix of its parameters' names (``attn.in_proj`` reads
  ``attn.in_proj_weight``), and plans, the indicator and the memory model find it by that
  name. Its inputs are the distinct tensors among query, key and value; its outputs the
  projected queries, keys and values (sequence first, as torch computes them).
* ``<fqn>`` (kind ``attention``, no parameters): masks, scaled scores, softmax, dropout
  and the weighted sum (``F.scaled_dot_product_attention``, or torch's explicit math when
  ``need_weights=True``); it runs in fp32.
* ``<fqn>.out_proj`` (kind ``linear``): the ``out_proj`` submodule, called as a module.

:func:`split_forward` computes the module's forward that way, with torch's own math for
every step (``F.multi_head_attention_forward``), so with fp32 projections it equals
torch's forward to float rounding. torch.fx traces it into one node per op (the
in-projection and the core are wrapped functions, :func:`mha_in_projection` and
:func:`mha_attention`); the hook tracer records the module call and splits it with
:func:`split_records`. A module is split only when :func:`splits` says so: modules with
``add_bias_kv``, ``add_zero_attn`` or a forward of their own stay one ``attention`` op.
A second call of the module names its ops ``attn.in_proj@1``, ``attn@1``,
``attn.out_proj@1``.

Example::

    >>> import torch, torch.nn as nn
    >>> from qsync_lab.graph import trace_graph
    >>> class Block(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
    ...     def forward(self, x):
    ...         return self.attn(x, x, x, need_weights=False)[0]
    >>> ops = trace_graph(Block(), torch.randn(2, 5, 8)).ops
    >>> ops[["kind", "params"]]
                        kind                                      params
    name
    attn.in_proj      linear    (attn.in_proj_weight, attn.in_proj_bias)
    attn           attention                                          ()
    attn.out_proj     linear  (attn.out_proj.weight, attn.out_proj.bias)
"""

import inspect
import math

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from qsync_lab.graph.flop_count import counted_forward_flops
from qsync_lab.graph.kinds import function_record, module_record
from qsync_lab.graph.records import OpNamer, OpRecord, TensorMeta

__all__ = ["CORE_FUNCTION", "IN_PROJECTION_FUNCTION", "core_saved_bytes", "in_proj_name",
           "in_projection", "mha_attention", "mha_in_projection", "packed_in_projection",
           "part_name", "projection_weights", "split_forward", "split_records", "splits"]

_FORWARD = inspect.signature(nn.MultiheadAttention.forward)


def splits(module: nn.Module) -> bool:
    """Whether ``module`` is a multi-head attention the graph splits into three ops: an
    ``nn.MultiheadAttention`` (a low-precision one judged by the class it was made from)
    with torch's forward, no ``add_bias_kv`` and no ``add_zero_attn``.

    Example::

        >>> splits(nn.MultiheadAttention(8, 2))
        True
        >>> splits(nn.MultiheadAttention(8, 2, add_bias_kv=True))
        False
    """
    cls = getattr(type(module), "op_float_class", type(module))
    return (isinstance(module, nn.MultiheadAttention)
            and cls.forward is nn.MultiheadAttention.forward
            and module.bias_k is None and not module.add_zero_attn)


def in_proj_name(fqn: str) -> str:
    """The op FQN of the in-projection of the attention module ``fqn`` (``in_proj`` for a
    model that is itself the attention module)."""
    return f"{fqn}.in_proj" if fqn else "in_proj"


def projection_weights(module: nn.MultiheadAttention) -> tuple[torch.Tensor, ...]:
    """The in-projection's weights: ``(in_proj_weight,)``, or the separate query, key and
    value weights when ``kdim``/``vdim`` differ from ``embed_dim``."""
    if module._qkv_same_embed_dim:
        return (module.in_proj_weight,)
    return module.q_proj_weight, module.k_proj_weight, module.v_proj_weight


def in_projection(sources: tuple[torch.Tensor, ...], pattern: tuple[int, int, int],
                  weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
                  batch_first: bool, linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projected queries, keys and values, sequence first, as torch computes them, with
    ``linear(x, weight, bias)`` for every GEMM.

    Args:
        sources: the distinct tensors among query, key and value.
        pattern: which source is the query, the key and the value (self-attention
            ``(0, 0, 0)``: one GEMM with the packed weight, as torch does).
        weights: :func:`projection_weights`.
        bias: ``in_proj_bias`` (None without bias).
        batch_first: the module's layout; batched inputs are made sequence first.
        linear: the GEMM (``F.linear``, or a low-precision one).
    """
    if batch_first and sources[0].dim() == 3:
        sources = tuple(s.transpose(1, 0) for s in sources)
    query, key, value = (sources[i] for i in pattern)
    biases = (None,) * 3 if bias is None else bias.chunk(3)
    if len(weights) == 3:
        return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    (weight,) = weights
    embed_dim = query.size(-1)
    if packed_in_projection(pattern, weights):
        packed = _unpacked(linear(query, weight, bias), 3, embed_dim)
        return packed[0], packed[1], packed[2]
    if pattern[1] == pattern[2]:  # key is value: one GEMM for both
        w_q, w_kv = weight.split([embed_dim, 2 * embed_dim])
        b_q, b_kv = (None, None) if bias is None else bias.split([embed_dim, 2 * embed_dim])
        q = linear(query, w_q, b_q)
        kv = _unpacked(linear(key, w_kv, b_kv), 2, embed_dim)
        return q, kv[0], kv[1]
    return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weight.chunk(3),
                                                    biases))


def _unpacked(packed: torch.Tensor, parts: int, embed_dim: int) -> torch.Tensor:
    """torch's split of a packed projection ``(..., parts·E)`` into ``parts`` contiguous
    ``(..., E)`` tensors stacked on dim 0."""
    return (packed.unflatten(-1, (parts, embed_dim)).unsqueeze(0).transpose(0, -2)
            .squeeze(-2).contiguous())


def mha_in_projection(sources: tuple[torch.Tensor, ...], pattern: tuple[int, int, int],
                      weights: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
                      batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`in_projection` with ``F.linear``: the ``<fqn>.in_proj`` op (one fx node)."""
    return in_projection(sources, pattern, weights, bias, batch_first, F.linear)


def mha_attention(projections: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                  num_heads: int, dropout_p: float, need_weights: bool,
                  average_attn_weights: bool, is_causal: bool, batch_first: bool):
    """The attention core, the ``<fqn>`` op (one fx node): torch's
    ``F.multi_head_attention_forward`` from the projections to the input of the output
    projection, returned in the module's layout (with the attention weights when
    ``need_weights``)."""
    q, k, v = projections
    batched = q.dim() == 3
    if not batched:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = q.shape
    src_len, head_dim = k.shape[0], embed_dim // num_heads
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask", target_type=q.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                           "Transformer module method `generate_square_subsequent_mask` to "
                           "create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA takes the causal hint itself
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                      other_name="", target_type=q.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(src_len, bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(src_len, bsz * num_heads, head_dim).transpose(0, 1)
    if key_padding_mask is not None:
        key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len)
                            .expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len))
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    weights = None
    if need_weights:
        scores = q * math.sqrt(1.0 / float(head_dim))
        scores = (torch.baddbmm(attn_mask, scores, k.transpose(-2, -1)) if attn_mask is not None
                  else torch.bmm(scores, k.transpose(-2, -1)))
        weights = F.softmax(scores, dim=-1)
        if dropout_p > 0.0:  # torch returns the weights after dropout
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            weights = weights.squeeze(0)
    else:
        if attn_mask is not None:
            attn_mask = (attn_mask.unsqueeze(0) if attn_mask.size(0) == 1
                         else attn_mask.view(bsz, num_heads, -1, src_len))
        out = F.scaled_dot_product_attention(
            q.view(bsz, num_heads, tgt_len, head_dim), k.view(bsz, num_heads, src_len, head_dim),
            v.view(bsz, num_heads, src_len, head_dim), attn_mask, dropout_p, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = out.view(tgt_len, bsz, embed_dim)
    if not batched:
        out = out.squeeze(1)
    elif batch_first:
        out = out.transpose(1, 0)
    return (out, weights) if need_weights else out


def core_saved_bytes(projections, key_padding_mask, attn_mask, num_heads: int,
                     need_weights: bool, is_causal: bool, packed: bool) -> int:
    """Bytes autograd keeps for the core of one call (the tensors are :class:`TensorMeta`),
    as torch's math goes: without weights, the three projections,
    ``F.scaled_dot_product_attention``'s log-sum-exp rows and the mask it reads (the
    padding mask merged into the attention mask); with weights, the keys, values, scaled
    queries and softmax probabilities (and the queries when ``packed``: one storage with
    the keys, as self-attention's packed projection makes them). Its output, which the
    out-projection saves, is counted there; dropout inside the attention is not counted.

    Example::

        >>> import torch
        >>> q = TensorMeta((32, 8, 64), torch.float32)  # (L, N, E), 4 heads of 16
        >>> core_saved_bytes([q, q, q], None, None, 4, False, False, True) / q.nbytes
        3.0625
    """
    q, k, _ = projections
    embed_dim, tgt_len, src_len = q.shape[-1], q.shape[0], k.shape[0]
    rows = q.numel // embed_dim * num_heads  # batch x heads x target positions
    kept = sum(p.nbytes for p in projections)
    itemsize = q.dtype.itemsize
    if need_weights:
        return kept + (q.nbytes if packed else 0) + rows * src_len * itemsize
    kept += 4 * rows  # fp32 log-sum-exp per row
    if key_padding_mask is not None:
        kept += rows // tgt_len * (tgt_len if attn_mask is not None else 1) * src_len * itemsize
    elif attn_mask is not None and not is_causal:
        kept += attn_mask.numel * itemsize
    return kept


#: the call targets of the in-projection and the core (their op kinds:
#: :mod:`qsync_lab.graph.kinds`; the in-projection's plans: :mod:`qsync_lab.policy`)
IN_PROJECTION_FUNCTION = mha_in_projection.__name__
CORE_FUNCTION = mha_attention.__name__
torch.fx.wrap(IN_PROJECTION_FUNCTION)
torch.fx.wrap(CORE_FUNCTION)
_PART_SUFFIX = {mha_in_projection: ".in_proj", mha_attention: ""}


def part_name(target, scope: str) -> str | None:
    """The base op FQN of an fx call of :func:`mha_in_projection` or :func:`mha_attention`
    made inside the attention module ``scope``; None for other calls."""
    suffix = _PART_SUFFIX.get(target)
    if suffix is None:
        return None
    return in_proj_name(scope) if suffix else scope


def _sources(query, key, value) -> tuple[tuple, tuple[int, int, int]]:
    """The distinct tensors among query, key and value, and which one each is."""
    sources: list = []
    pattern = []
    for t in (query, key, value):
        index = next((i for i, s in enumerate(sources) if s is t), None)
        if index is None:
            sources.append(t)
            index = len(sources) - 1
        pattern.append(index)
    return tuple(sources), tuple(pattern)


def split_forward(module: nn.MultiheadAttention, query, key, value, key_padding_mask=None,
                  need_weights: bool = True, attn_mask=None, average_attn_weights: bool = True,
                  is_causal: bool = False, *, linear=None, call=None):
    """``module(query, key, value, ...)`` as three ops (see the module docstring).

    Args:
        module: an attention module that :func:`splits`.
        linear: the in-projection's GEMM ``linear(x, weight, bias)``; None runs
            :func:`mha_in_projection` (``F.linear``, one fx node when traced). The
            out-projection is ``module.out_proj`` called as a module, in whatever precision
            it has.
        call: runs the in-projection (without ``linear``) and the core as
            ``call(fn, *args)``, ``fn`` being :func:`mha_in_projection` or
            :func:`mha_attention` (the in-step timer times them so); None calls them.

    Example::

        >>> import torch
        >>> mha = torch.nn.MultiheadAttention(8, 2).eval()
        >>> x = torch.randn(5, 3, 8)
        >>> torch.allclose(split_forward(mha, x, x, x)[0], mha(x, x, x)[0], atol=1e-6)
        True
    """
    sources, pattern = _sources(query, key, value)
    weights = projection_weights(module)
    call = call or _call
    if linear is None:
        projections = call(mha_in_projection, sources, pattern, weights, module.in_proj_bias,
                           module.batch_first)
    else:
        projections = in_projection(sources, pattern, weights, module.in_proj_bias,
                                    module.batch_first, linear)
    dropout_p = module.dropout if module.training else 0.0
    attended = call(mha_attention, projections, key_padding_mask, attn_mask, module.num_heads,
                    dropout_p, need_weights, average_attn_weights, is_causal,
                    module.batch_first)
    if not need_weights:
        return module.out_proj(attended), None
    return module.out_proj(attended[0]), attended[1]


def _call(fn, *args):
    return fn(*args)


def split_records(namer: OpNamer, fqn: str, module: nn.MultiheadAttention, args: tuple,
                  kwargs: dict, input_op) -> list[OpRecord]:
    """The three records of one call of ``module`` (at ``fqn``), as torch.fx traces them,
    for a tracer that saw the call as a whole (the hook tracer).

    Args:
        namer: the trace's op namer.
        args, kwargs: the call's arguments.
        input_op: ``tensor -> name of the op that produced it`` (None for graph inputs).

    Returns:
        The in-projection, core and out-projection records, outputs filled in; the core's
        output meta is that of the attention weights too when the call returns them.
    """
    call = _FORWARD.bind(module, *args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    sources, pattern = _sources(a["query"], a["key"], a["value"])
    weights = projection_weights(module)
    meta = _meta_tensor
    with torch.no_grad():
        projections = mha_in_projection(tuple(map(meta, sources)), pattern,
                                        tuple(map(meta, weights)), meta(module.in_proj_bias),
                                        module.batch_first)
    in_proj = function_record(namer.module(in_proj_name(fqn)), IN_PROJECTION_FUNCTION)
    in_proj.inputs = [TensorMeta.of(s) for s in sources]
    in_proj.input_ops = [input_op(s) for s in sources]
    in_proj.outputs = [TensorMeta.of(p) for p in projections]
    in_proj.params = [(_param_name(fqn, n), TensorMeta.of(p))
                      for n, p in _in_proj_params(module)]
    masks = [m for m in (a["key_padding_mask"], a["attn_mask"]) if isinstance(m, torch.Tensor)]
    core_args = (projections, meta(a["key_padding_mask"]), meta(a["attn_mask"]),
                 module.num_heads, module.dropout if module.training else 0.0,
                 a["need_weights"], a["average_attn_weights"], a["is_causal"],
                 module.batch_first)
    with torch.no_grad():
        core_out = mha_attention(*core_args)
    attended = core_out[0] if a["need_weights"] else core_out
    core = function_record(namer.module(fqn), CORE_FUNCTION)
    core.inputs = [*in_proj.outputs, *(TensorMeta.of(m) for m in masks)]
    core.input_ops = [in_proj.name] * 3 + [input_op(m) for m in masks]
    core.outputs = [TensorMeta.of(attended)]
    if a["need_weights"]:
        core.outputs.append(TensorMeta.of(core_out[1]))
    core.counted_fwd_flops = counted_forward_flops(mha_attention, core_args, {})
    mask_metas = [None if m is None else TensorMeta.of(m)
                  for m in (a["key_padding_mask"], a["attn_mask"])]
    core.saved_bytes = core_saved_bytes(in_proj.outputs, *mask_metas, module.num_heads,
                                        a["need_weights"], a["is_causal"],
                                        packed_in_projection(pattern, weights))
    out_name = f"{fqn}.out_proj" if fqn else "out_proj"
    out_proj = module_record(namer.module(out_name), module.out_proj)
    out_proj.inputs, out_proj.input_ops = [TensorMeta.of(attended)], [core.name]
    out_proj.outputs = [TensorMeta.of(attended)]  # out_proj maps embed_dim to embed_dim
    out_proj.params = [(f"{out_name}.{n}", TensorMeta.of(p))
                       for n, p in module.out_proj.named_parameters()]
    return [in_proj, core, out_proj]


def packed_in_projection(pattern: tuple[int, int, int], weights: tuple) -> bool:
    """Whether the in-projection makes its three outputs as views of one tensor (one GEMM:
    self-attention with the packed weight)."""
    return pattern == (0, 0, 0) and len(weights) == 1


def _in_proj_params(module: nn.MultiheadAttention) -> list[tuple[str, torch.Tensor]]:
    names = (["in_proj_weight"] if module._qkv_same_embed_dim
             else ["q_proj_weight", "k_proj_weight", "v_proj_weight"])
    if module.in_proj_bias is not None:
        names.append("in_proj_bias")
    return [(n, getattr(module, n)) for n in names]


def _param_name(fqn: str, name: str) -> str:
    return f"{fqn}.{name}" if fqn else name


def _meta_tensor(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
    return value
