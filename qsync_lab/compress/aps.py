"""APS: a power-of-two scale per parameter shared by all ranks, fp8 codes, summed in fp32.

1. each rank's exponent ``ceil(log2(max |world · g|))`` per parameter (one int32 each) is
   all-reduced (MAX): the largest the sum of the ranks' values can reach;
2. each parameter is multiplied by ``2**shift`` with ``shift = bias(format) - exponent``
   (exact), which puts the sum just under the format's top binade and lifts small values
   away from underflow, and rounded to fp8 (``fp8_e5m2`` or ``fp8_e4m3``, nearest even);
3. the one-byte codes are all-gathered, widened and summed in fp32, then scaled back by
   ``2**-shift`` and divided by the world size.

Rounding to nearest is biased: error feedback (``error_feedback=True``) carries each
parameter's rounding error into its next gradient. APS's reference sums in the low
format; summing the widened codes in fp32 adds no error of its own.
"""

import math

import torch

from qsync_lab.compress.codec import (Encoded, check_finite, compression_error,
                                     cuda_kernels, float_target, into, nonfinite, on_device,
                                     poison, take)
from qsync_lab.kernels import (APS_ZERO_EXPONENT, absmax, aps_shift, float_decode_sum,
                               float_encode, float_quantize)
from qsync_lab.kernels.floats import _code_array, _decode_table
from qsync_lab.kernels.plumbing import _arr, _rows_in_place

__all__ = ["encode", "reduce"]

_FORMATS = {"fp8_e5m2": (5, 2), "fp8_e4m3": (4, 3)}
_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
_NONFINITE_EXPONENT = 2**30  # above any finite exponent: marks a rank's non-finite gradient


def _exponents(x: torch.Tensor, segments, world: int) -> torch.Tensor:
    """Per segment, ``ceil(log2(max |world · x|))`` (APS_ZERO_EXPONENT if all zero)."""
    out = torch.empty(len(segments), dtype=torch.int32)
    for k, (start, numel) in enumerate(segments):
        amax = float(absmax(x[start:start + numel]))  # NaN or Inf when the part holds one
        if not math.isfinite(amax):
            out[k] = _NONFINITE_EXPONENT
        elif amax == 0:
            out[k] = APS_ZERO_EXPONENT
        else:
            mantissa, exponent = math.frexp(amax * world)
            out[k] = exponent if mantissa > 0.5 else exponent - 1
    return out


def _exponents_on_device(x: torch.Tensor, segments, world: int) -> torch.Tensor:
    """:func:`_exponents` as a device int32 tensor, no value read back: ``frexp`` of
    ``max |x| · world`` (exact in float64) taken from its float64 bits."""
    amax = torch.stack([absmax(x[start:start + numel], backend="cuda")
                        for start, numel in segments]) if segments else \
        torch.zeros(0, device=x.device)
    bits = (amax.double() * world).view(torch.int64)
    # ceil(log2 v) of a normal float64 v: its unbiased exponent, plus one unless v is a power
    # of two (what frexp's exponent, less one at mantissa 0.5, is)
    exponent = ((bits >> 52) & 0x7FF) - 1023 + ((bits & ((1 << 52) - 1)) != 0).long()
    exponent = torch.where(amax == 0, APS_ZERO_EXPONENT, exponent)
    return torch.where(torch.isfinite(amax), exponent, _NONFINITE_EXPONENT).to(torch.int32)


def _scales_on_device(exponents: torch.Tensor, fmt) -> torch.Tensor:
    """Per segment the float64 ``2**-aps_shift(exponent)`` (1 for an all-zero parameter), as
    the CPU path's Python numbers, built from its bits on the device."""
    bias = aps_shift(0, fmt)
    power = -(bias - exponents.long()).clamp(-300, 300)  # -aps_shift: in float64's normal range
    scales = ((power + 1023) << 52).view(torch.float64)
    return torch.where(exponents == APS_ZERO_EXPONENT, 1.0, scales)


def encode(x, segments, spec, comm, seed, error: bool = False, workspace=None) -> Encoded:
    if on_device(x):
        return _encode_on_device(x, segments, spec, comm, error, workspace)
    exponents = comm.allreduce_max(_exponents(x, segments, comm.world))
    check_finite(torch.where(exponents == _NONFINITE_EXPONENT, float("inf"), 0.0),
                 "an aps bucket")
    fmt, dtype = _FORMATS[spec.format], _DTYPES[spec.format]
    codes = take(workspace, "payload", x.numel(), torch.uint8, x.device)
    # the codes' values too where the error is wanted, in the same pass
    values = take(workspace, "values", x.numel(), torch.float32, x.device) if error else None
    scales = []
    for (start, numel), exponent in zip(segments, exponents.tolist()):
        # an all-zero parameter on every rank has nothing to scale (its shift would
        # underflow a float32 scale)
        scale = 1.0 if exponent == APS_ZERO_EXPONENT else 2.0 ** -aps_shift(exponent, fmt)
        part, out = x[start:start + numel], codes[start:start + numel].view(dtype)
        if error:
            float_quantize(part, spec.format, scale=scale, out=(out, values[start:start + numel]))
        else:
            float_encode(part, spec.format, scale=scale, out=out)
        scales.append(scale)
    context = (segments, scales)
    return Encoded(codes, context, compression_error(x, _scaled(values, context), workspace)
                   if error else None)


def _encode_on_device(x, segments, spec, comm, error, workspace) -> Encoded:
    """:func:`encode` without a host read: exponents, mark and scales stay on the device and
    the kernels read each segment's scale there (float32, as the CPU path rounds it)."""
    exponents = comm.allreduce_max(_exponents_on_device(x, segments, comm.world))
    bad = nonfinite(torch.where(exponents == _NONFINITE_EXPONENT, float("inf"), 0.0),
                    "an aps bucket", workspace, True)
    fmt, dtype = _FORMATS[spec.format], _DTYPES[spec.format]
    scales = _scales_on_device(exponents, fmt)  # float64
    scales32 = scales.float()
    codes = take(workspace, "payload", x.numel(), torch.uint8, x.device)
    values = take(workspace, "values", x.numel(), torch.float32, x.device) if error else None
    for k, (start, numel) in enumerate(segments):
        part, out = x[start:start + numel], codes[start:start + numel].view(dtype)
        scale = scales32[k:k + 1]
        if error:
            float_quantize(part, spec.format, scale=scale, out=(out, values[start:start + numel]),
                           backend="cuda")
            values[start:start + numel] *= scale[0]
        else:
            float_encode(part, spec.format, scale=scale, out=out, backend="cuda")
    # the decode's scales: 2**-shift over the world size in float64, then float32 (as the
    # CPU path's Python numbers are), NaN for a marked bucket
    world = torch.full((), comm.world, dtype=torch.float64, device=x.device)
    decode = (scales / world).float() * poison(bad)
    return Encoded(codes, (segments, decode),
                   compression_error(x, values, workspace) if error else None)


def _scaled(values: torch.Tensor, context) -> torch.Tensor:
    """``values`` times each segment's ``2**-shift``, in place."""
    segments, scales = context
    for (start, numel), scale in zip(segments, scales):
        values[start:start + numel] *= scale
    return values


def reduce(encoded: Encoded, spec, comm, out=None, workspace=None) -> torch.Tensor:
    """The ranks' codes widened and summed in fp32, then scaled (the shifts are shared), in
    one pass over the mean per segment."""
    payload = encoded.payload
    gathered = take(workspace, "gathered", comm.world * payload.numel(), payload.dtype,
                    payload.device)
    rows = comm.all_gather(payload, out=gathered)
    codes = (gathered.view(comm.world, -1) if comm.world > 1
             else rows[0].view(1, -1)).view(_DTYPES[spec.format])
    total = float_target(out, payload.numel(), workspace, payload.device)
    flat = total.view(-1)
    if on_device(payload):
        segments, scales = encoded.context
        table = _decode_table(codes.dtype, codes.device)
        for k, (start, numel) in enumerate(segments):
            if numel:  # float_decode_sum, its scale read on the device
                part, stride = _rows_in_place(codes[:, start:start + numel])
                cuda_kernels().float_decode_sum_dev(_code_array(part), comm.world, stride,
                                                    _arr(table), _arr(scales[k:k + 1]),
                                                    _arr(flat[start:start + numel]))
        return total if total is out else into(out, total)
    for (start, numel), scale in zip(*encoded.context):
        float_decode_sum(codes[:, start:start + numel], scale=scale / comm.world,
                         out=flat[start:start + numel])
    return total if total is out else into(out, total)
