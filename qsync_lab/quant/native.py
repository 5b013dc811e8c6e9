"""Native low-precision operators: what a GPU runs for each precision, with torch's kernels.

The exact emulation (:mod:`~qsync_lab.quant.functions`) reproduces a precision's numerics
in fp32 arithmetic; it is the CPU path and the numerics reference. On CUDA a precision is
worth having only if it is faster, so there the operators call torch's own kernels:

=========  ==========================================================================
precision  native computation (forward; the backward likewise in its own precision)
=========  ==========================================================================
fp16/bf16  operands cast to the dtype, torch's GEMM / convolution in it (tensor cores,
           fp32 accumulation) and an output in the dtype, as ``torch.autocast`` does;
           the gradients in the dtype, cast back to each input's dtype (autograd's
           own backward where both passes share the dtype, so the ops launch what
           autocast's do)
tf32       fp32 operands with torch's TF32 switches (cuBLAS and cuDNN) on for the op's
           GEMM in both passes: autograd's own backward, the switches flipped around the
           forward and, by hooks on its autograd node, the backward; no flipping at all
           where the rank keeps them on (:func:`tf32_throughout`: no fp32 GEMM on the
           rank), so a tf32 plan launches what torch's TF32 mode does and fp32 means fp32
int8       linear ops: per-tensor (input) and per-tensor or per-row (weight) scales
           computed on the device, codes by round-half-even,
           ``torch._int_mm`` (int32 accumulation), dequantized fp32 output; the backward
           in its float precision on the dequantized codes
fp8        linear ops: e4m3 operands with per-tensor scales, ``torch._scaled_mm`` (fp32
           output); gradients in e5m2, ``torch._scaled_mm`` of e5m2 by e4m3
=========  ==========================================================================

No host synchronisation: scales stay on the device. Pairs without a native kernel (the
policy's :func:`~qsync_lab.policy.runs_natively`: int8/fp8 convolutions and batched
matmuls, stochastic rounding, shapes the int8/fp8 GEMMs refuse) run the emulation, which
is correct but slow, and the cost model charges them so.

Which path runs is chosen per call from the operand's device: native on CUDA, emulated on
the CPU. :func:`execution` overrides that, e.g. ``execution("native")`` to run torch's CPU
kernels for a numerics test, or ``execution("emulated")`` for bit-exact emulation on a GPU.

Example::

    >>> import torch
    >>> from qsync_lab.policy import OpPrecision
    >>> from qsync_lab.quant.gemm import LinearKernel
    >>> x, w = torch.randn(4, 8), torch.randn(3, 8, requires_grad=True)
    >>> with execution("native"):
    ...     y = native_bilinear(LinearKernel(), x, w, None, OpPrecision.parse("bf16"))
    >>> y.dtype
    torch.bfloat16
    >>> y.float().sum().backward()
    >>> w.grad.dtype
    torch.float32
"""

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from qsync_lab.errors import QSyncError
from qsync_lab.policy import OpPrecision
from qsync_lab.precision import Precision
from qsync_lab.quant.gemm import BilinearKernel, LinearKernel, cuda_capability

__all__ = ["EXECUTIONS", "HALF_DTYPES", "execution", "fp32_inputs", "native_bilinear",
           "native_cast", "native_embedding", "runs_native", "set_tf32", "tf32_math",
           "tf32_throughout"]

#: how low-precision ops run: by the operand's device, or forced one way
EXECUTIONS = ("auto", "native", "emulated")
_FLOAT_DTYPES = {Precision.FP32: torch.float32, Precision.TF32: torch.float32,
                 Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
_FP8 = {Precision.FP8_E4M3: (torch.float8_e4m3fn, 448.0),
        Precision.FP8_E5M2: (torch.float8_e5m2, 57344.0)}
_INT8_MAX = 127.0
_current = "auto"


@contextlib.contextmanager
def execution(mode: str) -> Iterator[None]:
    """Run the low-precision ops called inside as ``mode`` says (see :data:`EXECUTIONS`).

    Raises:
        QSyncError: an unknown mode.
    """
    global _current
    if mode not in EXECUTIONS:
        raise QSyncError(f"unknown execution {mode!r}; choose one of {', '.join(EXECUTIONS)}")
    before, _current = _current, mode
    try:
        yield
    finally:
        _current = before


def runs_native(t: torch.Tensor) -> bool:
    """Whether an op whose operand is ``t`` runs its native kernels (CUDA, or forced)."""
    return _current == "native" or (_current == "auto" and t.is_cuda)


class tf32_math:
    """Context manager: let cuBLAS and cuDNN use TF32 for fp32 products (``on``) or not,
    then restore (a class, not a generator: it wraps every native float op). Its
    :meth:`pre_hook` and :meth:`post_hook` do the same around an autograd node."""

    __slots__ = ("on", "before")

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        if self.before != (self.on, self.on):
            set_tf32(self.on)

    def __exit__(self, *exc) -> None:
        if self.before != (self.on, self.on):
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.before

    def pre_hook(self, grad_outputs) -> None:
        """Switch, before the node's backward runs."""
        self.__enter__()

    def post_hook(self, grad_inputs, grad_outputs) -> None:
        """Restore, after it ran."""
        self.__exit__()


def set_tf32(on: bool) -> None:
    """Turn torch's TF32 switches for fp32 products, cuBLAS's and cuDNN's, on or off."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on


def tf32_throughout(configs: Iterable[OpPrecision]) -> bool:
    """Whether a rank whose GEMM ops run ``configs`` keeps the TF32 switches on for its whole
    step: some pass computes in tf32 and none in fp32. Its tf32 ops then flip nothing (they
    launch what torch's TF32 mode does); GEMMs outside the plan use TF32 too, as there.

    Example::

        >>> tf32_throughout([OpPrecision.parse("tf32"), OpPrecision.parse("bf16")])
        True
        >>> tf32_throughout([OpPrecision.parse("tf32"), OpPrecision.parse("fp32")])
        False
    """
    passes = {p for cfg in configs for p in (cfg.forward, cfg.backward_precision)}
    return Precision.TF32 in passes and Precision.FP32 not in passes


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (itself when it already is: no dispatch)."""
    return t if t.dtype == dtype else t.to(dtype)


def fp32_inputs(module, args: tuple) -> tuple:
    """Forward pre-hook: 16-bit float tensor arguments as fp32 (an fp32 op fed by a native
    fp16/bf16 op; a no-op for fp32 tensors)."""
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in HALF_DTYPES else a
                 for a in args)


def native_cast(x: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``x`` in the dtype an op of ``precision`` writes (fp16/bf16; else as it is)."""
    dtype = _FLOAT_DTYPES.get(precision)
    return x.to(dtype) if dtype in HALF_DTYPES else x


def native_bilinear(kernel: BilinearKernel, a: torch.Tensor, b: torch.Tensor,
                    bias: torch.Tensor | None, cfg: OpPrecision) -> torch.Tensor | None:
    """``kernel.forward(a, b, bias)`` with torch's kernels for ``cfg``, or None when the
    pair has none here (the caller then emulates it). See the module docstring."""
    forward = cfg.forward
    if forward is cfg.backward_precision and forward in _FLOAT_DTYPES:
        dtype = _FLOAT_DTYPES[forward]  # autograd's own backward, in the same dtype
        a, b = _cast(a, dtype), _cast(b, dtype)
        bias = None if bias is None else _cast(bias, dtype)
        if dtype in HALF_DTYPES or _tf32_switch(kernel) is (forward is Precision.TF32):
            return kernel.forward(a, b, bias)
        out = _tf32_switched(kernel, a, b, bias, forward is Precision.TF32)
        if out is not None:
            return out
    if forward in _FLOAT_DTYPES and cfg.backward_precision in _FLOAT_DTYPES:
        return _NativeFloat.apply(a, b, bias, kernel, forward, cfg.backward_precision)
    if not isinstance(kernel, LinearKernel) or cfg.rounding != "nearest":
        return None
    m, k, n = a.numel() // max(a.shape[-1], 1), a.shape[-1], b.shape[0]
    if forward is Precision.INT8 and _int8_fits(a, m, k, n) and \
            cfg.backward_precision in _FLOAT_DTYPES:
        return _NativeInt8Linear.apply(a, b, bias, cfg.granularity == "channel",
                                       cfg.backward_precision)
    if forward is Precision.FP8_E4M3 and _fp8_fits(a, k, n) and \
            cfg.backward_precision in (*_FLOAT_DTYPES, Precision.FP8_E5M2):
        return _NativeFp8Linear.apply(a, b, bias, cfg.backward_precision)
    return None


def native_embedding(indices: torch.Tensor, weight: torch.Tensor, cfg: OpPrecision,
                     padding_idx: int | None, scale_grad_by_freq: bool) -> torch.Tensor | None:
    """The gathered rows in fp16/bf16 (the gradient scattered in fp32), or None for the
    precisions an embedding emulates."""
    if cfg.forward not in (Precision.FP16, Precision.BF16) or \
            cfg.backward_precision is not cfg.forward:
        return None
    rows = F.embedding(indices, weight, padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    return rows.to(_FLOAT_DTYPES[cfg.forward])


def _tf32_switch(kernel: BilinearKernel) -> bool:
    """The TF32 switch ``kernel``'s products read now: cuDNN's for a convolution, else
    cuBLAS's."""
    return (torch.backends.cudnn if kernel.cudnn else torch.backends.cuda.matmul).allow_tf32


#: autograd nodes of the products ``BilinearKernel.forward`` makes, and of the reshapes
#: and bias addition it may put after them (names without the version digit)
_PRODUCT_NODES = frozenset({"AddmmBackward", "MmBackward", "BmmBackward", "MvBackward",
                            "DotBackward", "ConvolutionBackward"})
_AFTER_PRODUCT = frozenset({"ViewBackward", "UnsafeViewBackward", "SqueezeBackward",
                            "AddBackward"})


def _product_node(node):
    """The autograd node of the product behind an op's output node, following the
    reshapes after it (their first input); None where the chain is another one."""
    for _ in range(4):
        name = node.name().rstrip("0123456789") if node is not None else ""
        if name in _PRODUCT_NODES:
            return node
        if name not in _AFTER_PRODUCT:
            return None
        node = node.next_functions[0][0]
    return None


def _tf32_switched(kernel: BilinearKernel, a: torch.Tensor, b: torch.Tensor,
                   bias: torch.Tensor | None, on: bool) -> torch.Tensor | None:
    """``kernel.forward`` with the TF32 switches ``on`` around it and, by hooks on its
    product's autograd node, around that node's backward (autograd's own: no autograd
    function); None where the product's node is not found (the caller then runs the op
    again through an autograd function)."""
    with tf32_math(on):
        out = kernel.forward(a, b, bias)
    if out.grad_fn is None:
        return out
    node = _product_node(out.grad_fn)
    if node is None:
        return None
    switch = tf32_math(on)
    node.register_prehook(switch.pre_hook)
    node.register_hook(switch.post_hook)
    return out


def _int8_fits(a: torch.Tensor, m: int, k: int, n: int) -> bool:
    """``torch._int_mm``'s shape rules on CUDA (M > 16, K and N multiples of 8)."""
    return not a.is_cuda or (m > 16 and k % 8 == 0 and n % 8 == 0)


def _fp8_fits(a: torch.Tensor, k: int, n: int) -> bool:
    """``torch._scaled_mm`` needs sm89+ and K, N multiples of 16."""
    capability = cuda_capability(a)
    return (capability is None or capability >= (8, 9)) and k % 16 == 0 and n % 16 == 0


def _float_grads(ctx, kernel: BilinearKernel, g: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor, backward: Precision) -> list:
    """Both operand gradients and the bias gradient in ``backward``, in the inputs'
    dtypes (None where not needed)."""
    dtype = _FLOAT_DTYPES[backward]
    g = _cast(g, dtype)
    with tf32_math(backward is Precision.TF32):
        operands = kernel.grads(g, _cast(a, dtype), _cast(b, dtype), ctx.needs_input_grad[:2])
    grads = [None if grad is None else _cast(grad, want)
             for grad, want in zip(operands, ctx.dtypes)]
    grads.append(_cast(kernel.bias_grad(g), ctx.dtypes[2]) if ctx.needs_input_grad[2] else None)
    return grads


def _remember(ctx, a, b, bias, kernel, backward) -> None:
    ctx.kernel, ctx.backward = kernel, backward
    ctx.shapes = (a.shape, b.shape)
    ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype)


class _NativeFloat(torch.autograd.Function):
    """fp32 / tf32 / bf16 / fp16 forward and backward with torch's kernels."""

    @staticmethod
    def forward(ctx, a, b, bias, kernel, forward, backward):
        dtype = _FLOAT_DTYPES[forward]
        a, b = _cast(a, dtype), _cast(b, dtype)
        with tf32_math(forward is Precision.TF32):
            out = kernel.forward(a, b, None if bias is None else _cast(bias, dtype))
        ctx.save_for_backward(a, b)
        _remember(ctx, a, b, bias, kernel, backward)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        return (*_float_grads(ctx, ctx.kernel, grad_out, a, b, ctx.backward), None, None, None)


def _scale(x: torch.Tensor, fmax: float) -> torch.Tensor:
    """``amax / fmax`` of ``x`` per tensor, as :func:`_scales` computes it."""
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    return amax.div_(fmax).clamp_min_(torch.finfo(torch.float32).tiny)


def _scales(x: torch.Tensor, weight: torch.Tensor, fmax: float,
            per_row: bool = False) -> list[torch.Tensor]:
    """``amax / fmax`` of ``x`` (per tensor) and of ``weight`` (per tensor, or per row with
    ``per_row``) on their device, in fp32, a tiny floor where the amax is 0 (the codes are
    then 0, as the values are). Three launches for both: one multi-tensor norm, one
    division, one floor (a per-row weight takes its own norm)."""
    if per_row:
        amaxes = [torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=dim is not None,
                                           dtype=torch.float32)
                  for t, dim in ((x, None), (weight, 1))]
    else:
        amaxes = list(torch._foreach_norm([x, weight], float("inf"), dtype=torch.float32))
    torch._foreach_div_(amaxes, fmax)
    torch._foreach_clamp_min_(amaxes, torch.finfo(torch.float32).tiny)
    return amaxes


def _int8_codes(x: torch.Tensor, weight: torch.Tensor,
                scales: list[torch.Tensor]) -> list[torch.Tensor]:
    """``round(t / scale)`` of ``x`` and ``weight`` as int8 (half to even, in fp32; within
    +-127, as the scale puts the amax at 127; one rounding launch for both), row-major
    (cuBLASLt's int8 and fp8 products take row-major operands and transposes of them: a
    transposed view, such as GPT-2's ``Conv1D`` weight, is copied)."""
    quotients = [torch.div(t.float(), scale) for t, scale in zip((x, weight), scales)]
    torch._foreach_round_(quotients)
    return [_row_major(q.to(torch.int8)) for q in quotients]


def _fp8_values(x: torch.Tensor, scale: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``x / scale`` in the fp8 format (the scale puts the amax on the format's largest
    finite value), row-major as :func:`_int8_codes`."""
    return _row_major(torch.div(x.float(), scale).to(_FP8[precision][0]))


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` computed in fp32 and written in ``dtype`` (one launch)."""
    return torch.mul(codes, scale, out=torch.empty(codes.shape, dtype=dtype,
                                                   device=codes.device))


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-d) laid out row-major (itself when it is)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-d) laid out column-major, as ``torch._scaled_mm``'s second operand."""
    return _row_major(t.t()).t()


def _linear_output(ctx, out: torch.Tensor, x, weight, bias, saved: tuple,
                   backward: Precision) -> torch.Tensor:
    """A quantized linear's 2-d fp32 output, in x's leading shape; ``saved`` (codes and
    scales) kept for the backward."""
    ctx.save_for_backward(*saved)
    _remember(ctx, x, weight, bias, LinearKernel(), backward)
    return out.reshape(*x.shape[:-1], -1)


class _NativeInt8Linear(torch.autograd.Function):
    """``F.linear`` as int8 x int8 -> int32 (``torch._int_mm``), backward in a float."""

    @staticmethod
    def forward(ctx, x, weight, bias, per_row, backward):
        x2 = x.reshape(-1, x.shape[-1])
        x_scale, w_scale = _scales(x2, weight, _INT8_MAX, per_row)
        x_codes, w_codes = _int8_codes(x2, weight, [x_scale, w_scale])
        products = torch._int_mm(x_codes, w_codes.t())  # cuBLASLt's layout: B column-major
        scale = x_scale * (w_scale.reshape(1, -1) if per_row else w_scale)
        out = products * scale if bias is None else torch.addcmul(bias, products, scale)
        return _linear_output(ctx, out, x, weight, bias, (x_codes, x_scale, w_codes, w_scale),
                              backward)

    @staticmethod
    def backward(ctx, grad_out):
        x_codes, x_scale, w_codes, w_scale = ctx.saved_tensors
        dtype = _FLOAT_DTYPES[ctx.backward]  # dequantized straight into it
        x = _dequantized(x_codes, x_scale, dtype).reshape(ctx.shapes[0])
        w = _dequantized(w_codes, w_scale, dtype)
        return (*_float_grads(ctx, ctx.kernel, grad_out, x, w, ctx.backward), None, None)


class _NativeFp8Linear(torch.autograd.Function):
    """``F.linear`` of e4m3 operands (``torch._scaled_mm``); gradients in e5m2 (or a
    float precision)."""

    @staticmethod
    def forward(ctx, x, weight, bias, backward):
        x2 = x.reshape(-1, x.shape[-1])
        x_scale, w_scale = _scales(x2, weight, _FP8[Precision.FP8_E4M3][1])
        x8 = _fp8_values(x2, x_scale, Precision.FP8_E4M3)
        w8 = _fp8_values(weight, w_scale, Precision.FP8_E4M3)
        out = torch._scaled_mm(x8, w8.t(), x_scale, w_scale, out_dtype=torch.float32)
        if bias is not None:
            out = out.add_(bias)
        return _linear_output(ctx, out, x, weight, bias, (x8, x_scale, w8, w_scale), backward)

    @staticmethod
    def backward(ctx, grad_out):
        x8, x_scale, w8, w_scale = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.backward is not Precision.FP8_E5M2 or (x8.is_cuda and x8.shape[0] % 16):
            x = (x8.float() * x_scale).reshape(ctx.shapes[0])
            backward = Precision.FP32 if ctx.backward is Precision.FP8_E5M2 else ctx.backward
            return (*_float_grads(ctx, ctx.kernel, grad_out, x, w8.float() * w_scale,
                                  backward), None)
        g_scale = _scale(g2, _FP8[Precision.FP8_E5M2][1])
        g8 = _fp8_values(g2, g_scale, Precision.FP8_E5M2)
        grads = [None, None, None]
        if ctx.needs_input_grad[0]:
            grad_x = torch._scaled_mm(g8, _column_major(w8), g_scale, w_scale,
                                      out_dtype=torch.float32)
            grads[0] = grad_x.reshape(ctx.shapes[0]).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            grad_w = torch._scaled_mm(_row_major(g8.t()), _column_major(x8), g_scale, x_scale,
                                      out_dtype=torch.float32)
            grads[1] = grad_w.to(ctx.dtypes[1])
        if ctx.needs_input_grad[2]:
            grads[2] = g2.float().sum(0).to(ctx.dtypes[2])
        return (*grads, None)
