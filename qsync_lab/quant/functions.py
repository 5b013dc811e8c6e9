"""Autograd functions of the low-precision operators.

* :func:`bilinear` (linear, conv, matmul): the forward encodes both operands in the forward
  precision, computes (``gemm``), returns fp32-dtype values rounded to the output format,
  and saves the *encoded* operands (int8 codes + scales, fp16/bf16/fp8 values), as QSync
  does. The backward encodes the output gradient in the backward precision, re-encodes
  the saved operands to it (fp8 operands stay as they are under an fp8 backward, per the
  FP8 recipe), computes both gradients there and returns them in the inputs' dtypes, so
  weight gradients land in the fp32 master weights. On the CPU, operands that are not
  saved (the output gradient, re-encoded operands) go straight to the fp32 values the
  emulation reads (fp16/bf16 rounded in fp32, int8 dequantized into fp16 in one pass), and
  the output gradient is widened once for both products.
* :func:`embedding`: rows of the table in the forward precision (int8/fp8 scales come from
  the whole table, or per row); the weight gradient is the scatter-add of the gradient
  rounded to the backward precision.
* :func:`precision_boundary`: rounds values forward and gradients backward; norms, softmax
  and activations sit between two of these (fp16/bf16 I/O, fp32 math inside).

Each function runs torch's native kernels instead where :func:`~qsync_lab.quant.native.
runs_native` says so (CUDA operands) and the pair has one (:mod:`~qsync_lab.quant.native`).

Example::

    >>> import torch
    >>> from qsync_lab.policy import OpPrecision
    >>> from qsync_lab.quant.gemm import LinearKernel
    >>> x, w = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    >>> y = bilinear(LinearKernel(), x, w, None, OpPrecision.parse("int8"), (0, 1))
    >>> y.sum().backward()
    >>> x.grad.shape, w.grad.dtype
    (torch.Size([4, 8]), torch.float32)
"""

import torch
import torch.nn.functional as F

from qsync_lab.kernels import absmax
from qsync_lab.policy import FP8_PRECISIONS, ROUNDED_OUTPUTS, OpPrecision
from qsync_lab.precision import Precision
from qsync_lab.quant.encoding import (
    Encoded,
    decode,
    encode,
    round_f32,
    round_to,
)
from qsync_lab.quant.gemm import BilinearKernel, float_product, fp8_product
from qsync_lab.quant.native import native_bilinear, native_cast, native_embedding, runs_native


def _forward_product(kernel: BilinearKernel, a: Encoded, b: Encoded,
                     bias: torch.Tensor | None, precision: Precision) -> torch.Tensor:
    if precision is Precision.INT8:
        out = kernel.int8_product(a.data, b.data)
        out = out.mul_(kernel.out_scale(a, b, out.dim()))
    elif precision in FP8_PRECISIONS:
        out = fp8_product(kernel.forward, a, b)
    else:
        bias_enc = None if bias is None else encode(bias, precision)
        return float_product(kernel.forward, (a, b, bias_enc), precision)
    return out if bias is None else kernel.add_bias(out, bias.detach().float())


def _backward_product(fn, u: Encoded, v: Encoded, precision: Precision) -> torch.Tensor:
    if precision in FP8_PRECISIONS:
        return fp8_product(fn, u, v)
    return float_product(fn, (u, v), precision)


def _emulated_float(t: torch.Tensor, precision: Precision) -> bool:
    """Whether a ``precision`` product of ``t`` runs as fp16/bf16 values held in fp32."""
    return precision in ROUNDED_OUTPUTS and not t.is_cuda


def _gradient(grad_out: torch.Tensor, backward: Precision) -> Encoded:
    """The output gradient encoded for both gradient products (widened once, not twice)."""
    if _emulated_float(grad_out, backward):
        return Encoded(round_f32(grad_out, backward), None, None)
    return encode(grad_out, backward)


def _backward_operand(saved: Encoded, forward: Precision, backward: Precision) -> Encoded:
    if forward is backward or (forward in FP8_PRECISIONS and backward in FP8_PRECISIONS):
        return saved
    if _emulated_float(saved.data, backward):
        return Encoded(decode(saved, backward), None, None)
    return encode(decode(saved), backward)


class _Bilinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, kernel, cfg, seeds):
        channel = cfg.granularity == "channel"
        encoded = [
            encode(t, cfg.forward, axis=axis if channel else None, rounding=cfg.rounding,
                   seed=seed)
            for t, axis, seed in ((a, kernel.a_axis, seeds[0]), (b, kernel.b_axis, seeds[1]))
        ]
        out = _forward_product(kernel, *encoded, bias, cfg.forward)
        ctx.save_for_backward(*(t for e in encoded for t in (e.data, e.scale)))
        ctx.axes = tuple(e.axis for e in encoded)
        ctx.shapes = (a.shape, b.shape)
        ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype)
        ctx.kernel, ctx.cfg = kernel, cfg
        return out.to(a.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        a_data, a_scale, b_data, b_scale = ctx.saved_tensors
        kernel, cfg = ctx.kernel, ctx.cfg
        forward, backward = cfg.forward, cfg.backward_precision
        g = _gradient(grad_out, backward)
        grads = [None, None, None]
        if ctx.needs_input_grad[0]:
            b = _backward_operand(Encoded(b_data, b_scale, ctx.axes[1]), forward, backward)
            grad_a = _backward_product(
                lambda u, v: kernel.grad_a(u, v, ctx.shapes[0]), g, b, backward)
            grads[0] = grad_a.to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            a = _backward_operand(Encoded(a_data, a_scale, ctx.axes[0]), forward, backward)
            grad_b = _backward_product(
                lambda u, v: kernel.grad_b(u, v, ctx.shapes[1]), g, a, backward)
            grads[1] = grad_b.to(ctx.dtypes[1])
        if ctx.needs_input_grad[2]:
            grads[2] = round_to(kernel.bias_grad(decode(g)), backward).to(ctx.dtypes[2])
        return (*grads, None, None, None)


def bilinear(kernel: BilinearKernel, a: torch.Tensor, b: torch.Tensor,
             bias: torch.Tensor | None, cfg: OpPrecision, seeds: tuple[int, int]) -> torch.Tensor:
    """``kernel.forward(a, b, bias)`` computed as ``cfg`` says (see the module docstring).

    Args:
        kernel: the operator (``gemm.LinearKernel``, ``ConvKernel``, ``MatMulKernel``).
        a, b: operands (input and weight, or the two matmul inputs).
        bias: optional bias, added in the output precision.
        cfg: forward/backward precisions, rounding and scale granularity.
        seeds: stochastic-rounding streams of ``a`` and ``b``.
    """
    if runs_native(a):
        out = native_bilinear(kernel, a, b, bias, cfg)
        if out is not None:
            return out
    return _Bilinear.apply(a, b, bias, kernel, cfg, seeds)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, weight, cfg, padding_idx, scale_grad_by_freq, seed):
        rows = F.embedding(indices, weight.detach())
        if cfg.granularity == "channel":
            enc = encode(rows.reshape(-1, rows.shape[-1]), cfg.forward, axis=0,
                         rounding=cfg.rounding, seed=seed)
        else:
            scaled = cfg.forward is Precision.INT8 or cfg.forward in FP8_PRECISIONS
            amax = absmax(weight.detach()) if scaled else None
            enc = encode(rows, cfg.forward, rounding=cfg.rounding, seed=seed, amax=amax)
        ctx.save_for_backward(indices)
        ctx.cfg, ctx.num_weights, ctx.dtype = cfg, weight.shape[0], weight.dtype
        ctx.padding_idx, ctx.scale_grad_by_freq = padding_idx, scale_grad_by_freq
        return decode(enc).reshape(rows.shape).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (indices,) = ctx.saved_tensors
        backward = ctx.cfg.backward_precision
        grad = torch.ops.aten.embedding_dense_backward(
            decode(encode(grad_out, backward)), indices, ctx.num_weights, ctx.padding_idx,
            ctx.scale_grad_by_freq,
        )
        rows = indices.unique()  # the other rows are zero: rounding them is a no-op
        grad[rows] = round_to(grad[rows], backward)
        return None, grad.to(ctx.dtype), None, None, None, None


def embedding(indices: torch.Tensor, weight: torch.Tensor, cfg: OpPrecision, *,
              padding_idx: int | None = None, scale_grad_by_freq: bool = False,
              seed: int = 0) -> torch.Tensor:
    """``F.embedding(indices, weight)`` with the table read in ``cfg.forward``.

    int8/fp8 scales are per tensor (the whole table's abs-max) or, with
    ``granularity="channel"``, per embedding row.
    """
    if runs_native(weight):
        rows = native_embedding(indices, weight, cfg, padding_idx, scale_grad_by_freq)
        if rows is not None:
            return rows
    return _Embedding.apply(indices, weight, cfg, -1 if padding_idx is None else padding_idx,
                            scale_grad_by_freq, seed)


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward = backward
        y = round_to(x, forward)
        return x.clone() if y is x else y

    @staticmethod
    def backward(ctx, grad):
        return round_to(grad, ctx.backward), None, None


def precision_boundary(x: torch.Tensor, forward: Precision, backward: Precision) -> torch.Tensor:
    """Round x to ``forward``'s format; round the gradient flowing back to ``backward``'s.

    Example::

        >>> import torch
        >>> x = torch.tensor([1 / 3], requires_grad=True)
        >>> y = precision_boundary(x, Precision.FP16, Precision.BF16)
        >>> y.backward(torch.tensor([1 / 3]))
        >>> y.item(), x.grad.item()
        (0.333251953125, 0.333984375)
    """
    if runs_native(x):
        return native_cast(x, forward)
    return _Boundary.apply(x, forward, backward)
