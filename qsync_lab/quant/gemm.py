"""GEMM-shaped operators (linear, conv2d, matmul) and how each precision computes them.

A :class:`BilinearKernel` is ``out = f(a, b)``, linear in each operand, with its two
gradient products. The functions below run such a product in a precision, choosing the
path at call time from the tensors' device:

=========  =========================================  =======================================
precision  CUDA                                       CPU (exact emulation in fp32)
=========  =========================================  =======================================
int8       ``torch._int_mm`` (linear, matmul; M > 16,  int8 codes as fp32, K split into chunks
           K and N multiples of 8), else float64       of ≤ 1024 so each chunk is exact; chunks
           (exact)                                    summed in int32
fp8        fp32 product of the fp8 values (exact products, fp32 accumulation), rescaled
fp16/bf16  native fp16/bf16 kernels                   operands rounded, fp32 product, output
                                                      rounded (fp32 accumulation, as tensor
                                                      cores do)
tf32       operands rounded to 10 mantissa bits, fp32 product (both devices)
=========  =========================================  =======================================

This is the emulation; on CUDA the operators normally run torch's kernels instead
(:mod:`~qsync_lab.quant.native`), and these paths serve the pairs without one.

int8 results are the exact int32 accumulator converted to fp32, then multiplied by the
product of the operands' scales, on both paths. The slow CPU int8/bf16/fp16 GEMMs are never
called.

Example::

    >>> import torch
    >>> k = LinearKernel()
    >>> a = torch.randint(-127, 128, (4, 2000), dtype=torch.int8)
    >>> b = torch.randint(-127, 128, (3, 2000), dtype=torch.int8)
    >>> exact = (a.long() @ b.long().t()).float()
    >>> bool((k.int8_product(a, b) == exact).all())
    True
"""

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from qsync_lab.precision import Precision
from qsync_lab.quant.encoding import TORCH_DTYPES, Encoded, channel_view, round_f32, widened

#: largest K whose int8 dot products are exact in fp32: K·127² < 2**24 holds up to K = 1040
MAX_EXACT_K = 1024
NATIVE_FLOAT = frozenset({Precision.FP16, Precision.BF16})


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """Compute capability of a CUDA tensor's device, None for a CPU tensor."""
    return _capability(t.device.index or 0) if t.is_cuda else None


def _exact_int_product(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    a_codes: torch.Tensor,
    b_codes: torch.Tensor,
    a_k_axis: int,
    b_k_axis: int,
    k_unit: int = 1,
) -> torch.Tensor:
    """``fn`` over int8 codes, equal to an int32-accumulating kernel's result as fp32.

    ``fn`` is bilinear and sums over axis ``a_k_axis`` of ``a`` and ``b_k_axis`` of ``b``,
    each index of which contributes ``k_unit`` products (kh·kw for a convolution). On CUDA
    the product runs in float64 (exact). On the CPU it runs in fp32 on chunks of at most
    ``MAX_EXACT_K`` products per output, each exact, summed in int32.
    """
    if a_codes.is_cuda:
        return fn(a_codes.double(), b_codes.double()).float()
    a, b = a_codes.float(), b_codes.float()
    k = a.shape[a_k_axis]
    chunks = math.ceil(k * k_unit / MAX_EXACT_K)
    if chunks <= 1:
        return fn(a, b)
    if k_unit > MAX_EXACT_K:
        return fn(a.double(), b.double()).float()
    step = math.ceil(k / chunks)
    acc = None
    for start in range(0, k, step):
        n = min(step, k - start)
        part = fn(a.narrow(a_k_axis, start, n), b.narrow(b_k_axis, start, n)).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc.float()


def _int_mm_fits(m: int, k: int, n: int) -> bool:
    return m > 16 and k % 8 == 0 and n % 8 == 0


def _int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cuBLASLt int8 GEMM of (M, K) by (K, N); both made contiguous (torchao: a strided
    ``mat2`` silently gives wrong results)."""
    return torch._int_mm(a.contiguous(), b.contiguous()).float()


class BilinearKernel(ABC):
    """``out = f(a, b)``, linear in each operand, with its gradient products.

    Attributes:
        a_axis, b_axis: operand axes whose per-channel scales factor out of ``f``
            (None: per-tensor only).
        a_out_axis, b_out_axis: the output axes those channels become.
        cudnn: whether its products are cuDNN's (whose TF32 switch is its own) or cuBLAS's.
    """

    a_axis: int | None = None
    b_axis: int | None = None
    a_out_axis: int = -1
    b_out_axis: int = -1
    cudnn: bool = False

    @abstractmethod
    def forward(self, a: torch.Tensor, b: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """``f(a, b)`` (plus ``bias`` broadcast over the output channels)."""

    @abstractmethod
    def grad_a(self, g: torch.Tensor, b: torch.Tensor, a_shape: torch.Size) -> torch.Tensor:
        """Gradient of ``f`` with respect to ``a`` for output gradient ``g``."""

    @abstractmethod
    def grad_b(self, g: torch.Tensor, a: torch.Tensor, b_shape: torch.Size) -> torch.Tensor:
        """Gradient of ``f`` with respect to ``b`` for output gradient ``g``."""

    def grads(self, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              needs: Sequence[bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both operand gradients from the operands themselves (None where ``needs`` says
        no): what the native path's backward computes."""
        return (self.grad_a(g, b, a.shape) if needs[0] else None,
                self.grad_b(g, a, b.shape) if needs[1] else None)

    @abstractmethod
    def int8_product(self, a_codes: torch.Tensor, b_codes: torch.Tensor) -> torch.Tensor:
        """``f`` over int8 codes: the int32 accumulator, as fp32 (exact on every path)."""

    def add_bias(self, out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Add ``bias`` to a freshly computed output, in place."""
        return out.add_(bias)

    def bias_grad(self, g: torch.Tensor) -> torch.Tensor:
        return g.reshape(-1, g.shape[-1]).sum(0)

    def out_scale(self, a: Encoded, b: Encoded, out_ndim: int) -> torch.Tensor:
        """Product of the operands' scales, shaped to broadcast over the output."""
        sa = channel_view(a.scale, None if a.axis is None else self.a_out_axis, out_ndim)
        sb = channel_view(b.scale, None if b.axis is None else self.b_out_axis, out_ndim)
        return sa * sb


class LinearKernel(BilinearKernel):
    """``F.linear(x, W)``: x (..., K), W (N, K); per-channel scales on W's output rows."""

    b_axis = 0

    def forward(self, a, b, bias=None):
        return F.linear(a, b, bias)

    def grad_a(self, g, b, a_shape):
        return g @ b

    def grad_b(self, g, a, b_shape):
        return g.reshape(-1, g.shape[-1]).t() @ a.reshape(-1, a.shape[-1])

    def int8_product(self, a_codes, b_codes):
        k = a_codes.shape[-1]
        a2 = a_codes.reshape(-1, k)
        if cuda_capability(a_codes) is not None and _int_mm_fits(a2.shape[0], k, b_codes.shape[0]):
            return _int_mm(a2, b_codes.t()).reshape(*a_codes.shape[:-1], -1)
        return _exact_int_product(F.linear, a_codes, b_codes, -1, -1)



class MatMulKernel(BilinearKernel):
    """``torch.matmul(a, b)`` of (..., M, K) by (..., K, N), batch dims broadcast.

    Per-channel scales: one per row of ``a`` and one per column of ``b`` (shared over the
    batch dims).
    """

    a_axis = -2
    b_axis = -1
    a_out_axis = -2
    b_out_axis = -1

    def forward(self, a, b, bias=None):
        return torch.matmul(a, b)

    def grad_a(self, g, b, a_shape):
        return (g @ b.transpose(-1, -2)).sum_to_size(a_shape)

    def grad_b(self, g, a, b_shape):
        return (a.transpose(-1, -2) @ g).sum_to_size(b_shape)

    def int8_product(self, a_codes, b_codes):
        m, k, n = a_codes.shape[-2], a_codes.shape[-1], b_codes.shape[-1]
        if cuda_capability(a_codes) is not None and _int_mm_fits(m, k, n):
            batch = torch.broadcast_shapes(a_codes.shape[:-2], b_codes.shape[:-2])
            a3 = a_codes.expand(*batch, m, k).reshape(-1, m, k)
            b3 = b_codes.expand(*batch, k, n).reshape(-1, k, n)
            out = torch.stack([_int_mm(x, y) for x, y in zip(a3, b3)])
            return out.reshape(*batch, m, n)
        return _exact_int_product(torch.matmul, a_codes, b_codes, -1, -2)


class ConvKernel(BilinearKernel):
    """N-d convolution (``torch.convolution``, not transposed) with a module's geometry.

    Per-channel scales on the weight's output channels. For int8 the input channels are
    split so each partial convolution is exact in fp32 (groups > 1 needs
    C_in/groups·prod(kernel) ≤ 1024, else it runs in float64).
    """

    b_axis = 0
    cudnn = True

    def __init__(self, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                 groups: int) -> None:
        self.stride, self.padding, self.dilation = list(stride), list(padding), list(dilation)
        self.groups = groups
        self.b_out_axis = -1 - len(self.stride)

    def forward(self, a, b, bias=None):
        return torch.convolution(a, b, bias, self.stride, self.padding, self.dilation,
                                 False, [0] * len(self.stride), self.groups)

    def _backward(self, g, a, b, mask):
        return torch.ops.aten.convolution_backward(
            g, a, b, None, self.stride, self.padding, self.dilation, False,
            [0] * len(self.stride), self.groups, mask,
        )

    def grad_a(self, g, b, a_shape):
        return self._backward(g, g.new_empty(1).expand(a_shape), b, [True, False, False])[0]

    def grad_b(self, g, a, b_shape):
        return self._backward(g, a, g.new_empty(1).expand(b_shape), [False, True, False])[1]

    def grads(self, g, a, b, needs):
        """One ``convolution_backward`` for both, as autograd's own backward calls it."""
        grad_a, grad_b, _ = self._backward(g, a, b, [needs[0], needs[1], False])
        return grad_a, grad_b

    def add_bias(self, out, bias):
        return out.add_(channel_view(bias, self.b_out_axis, out.dim()))

    def bias_grad(self, g):
        return g.sum([d for d in range(g.dim()) if d != 1])

    def int8_product(self, a_codes, b_codes):
        k_unit = math.prod(b_codes.shape[2:])
        if self.groups == 1:
            return _exact_int_product(self.forward, a_codes, b_codes, 1, 1, k_unit)
        if a_codes.is_cuda or b_codes.shape[1] * k_unit > MAX_EXACT_K:
            return self.forward(a_codes.double(), b_codes.double()).float()
        return self.forward(a_codes.float(), b_codes.float())


def float_product(fn: Callable[..., torch.Tensor], operands: Sequence[Encoded | None],
                  precision: Precision) -> torch.Tensor:
    """Run ``fn`` on operands encoded in ``precision``'s format; fp32 result, rounded.

    CUDA runs fp16/bf16 natively; otherwise ``fn`` runs in fp32 (exact products of the
    rounded operands, fp32 accumulation) and the result is rounded to the output format.
    """
    if operands[0].data.is_cuda and precision in NATIVE_FLOAT:
        dtype = TORCH_DTYPES[precision]
        return fn(*(None if e is None else e.data.to(dtype) for e in operands)).float()
    out = fn(*(None if e is None else widened(e) for e in operands))
    return round_f32(out, precision, inplace=True)


def fp8_product(fn: Callable[..., torch.Tensor], u: Encoded, v: Encoded) -> torch.Tensor:
    """Emulated fp8 product: ``fn`` over the fp8 values in fp32, times both (per-tensor)
    scales. fp8 values have at most 3 mantissa bits, so every product is exact."""
    return fn(widened(u), widened(v)).mul_(u.scale * v.scale)
