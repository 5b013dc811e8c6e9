"""What a module of a class the kind table does not list computes, found by evidence.

Libraries write their own layers: a GPT-2 ``Conv1D`` is a linear map whose weight is stored
transposed (``addmm(bias, x, weight)``), a T5 ``LayerNorm`` is an RMS norm. A module is
judged by what it computes, not by its name: one whose own parameters are a 2-d ``weight``
(and a 1-d ``bias``) is a **linear** op when its forward, run on a small random input with its
own parameters, equals ``F.linear`` with that weight or its transpose; one whose parameters
are a 1-d scale ``weight`` (and ``bias``) is a **layer_norm** or **rms_norm** op when its
forward equals that normalisation. Modules with children or buffers, and any forward that
fails or differs, are not judged (they follow their inputs, or are traced through).

The probe calls the class's ``forward`` directly (no hooks), with torch-function modes
disabled (a tracer records nothing) and a private generator (the global random state is
untouched), once per module.

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Conv1D(nn.Module):  # GPT-2's layout: weight is (in, out)
    ...     def __init__(self, n_in, n_out):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.randn(n_in, n_out))
    ...         self.bias = nn.Parameter(torch.zeros(n_out))
    ...     def forward(self, x):
    ...         return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    >>> class ScaleNorm(nn.Module):  # T5's layer norm
    ...     def __init__(self, d):
    ...         super().__init__()
    ...         self.weight = nn.Parameter(torch.ones(d))
    ...     def forward(self, x):
    ...         return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    >>> computed_kind(Conv1D(8, 4)), linear_layout(Conv1D(8, 4)), computed_kind(ScaleNorm(8))
    ('linear', 'transposed', 'rms_norm')
    >>> computed_kind(nn.PReLU(8)) is None  # a 1-d weight, but no normalisation
    True
"""

import weakref

__all__ = ["computed_kind", "linear_layout", "linear_weight"]

_PROBE_ROWS = 3
_SEED = 20_250_101
_RTOL, _ATOL = 1e-3, 1e-4
_EPSILONS = (1e-5, 1e-6, 1e-12)

#: module -> (kind, linear layout) found by its probe
_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def computed_kind(module) -> str | None:
    """``"linear"``, ``"layer_norm"`` or ``"rms_norm"`` when the probe shows ``module``
    computes it (see the module docstring), else None."""
    return _judged(module)[0]


def linear_layout(module) -> str | None:
    """``"weight"`` (``weight`` is ``(out, in)``, as ``nn.Linear``'s) or ``"transposed"``
    (``(in, out)``) for a module judged linear, else None."""
    return _judged(module)[1]


def linear_weight(module):
    """The ``(out, in)`` weight a linear op multiplies by: ``module.weight``, transposed
    where the module stores it ``(in, out)``."""
    return module.weight.t() if linear_layout(module) == "transposed" else module.weight


def _judged(module) -> tuple[str | None, str | None]:
    declared = getattr(type(module), "op_linear_layout", None)  # a low-precision class
    if declared is not None:
        return "linear", declared
    found = _FOUND.get(module)
    if found is None:
        found = _probe(module)
        _FOUND[module] = found
    return found


def _probe(module) -> tuple[str | None, str | None]:
    import torch

    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if (weight is None or set(params) - {"weight", "bias"} or weight.is_meta
            or next(module.children(), None) is not None
            or next(module.buffers(recurse=False), None) is not None
            or (bias is not None and bias.dim() != 1)):
        return None, None
    if weight.dim() not in (1, 2) or not weight.is_floating_point():
        return None, None
    generator = torch.Generator(device=weight.device).manual_seed(_SEED)
    with torch.no_grad(), torch._C.DisableTorchFunction():
        if weight.dim() == 2:
            return _probe_linear(module, weight, bias, generator)
        return _probe_norm(module, weight, bias, generator), None


def _probe_linear(module, weight, bias, generator):
    import torch
    import torch.nn.functional as F

    for layout, matrix in (("weight", weight), ("transposed", weight.t())):
        out_features, in_features = matrix.shape
        if bias is not None and bias.numel() != out_features:
            continue
        x = torch.randn(_PROBE_ROWS, in_features, generator=generator, device=weight.device,
                        dtype=weight.dtype)
        if _same(_forward(module, x), F.linear(x, matrix, bias)):
            return "linear", layout
    return None, None


def _probe_norm(module, weight, bias, generator):
    import torch
    import torch.nn.functional as F

    if bias is not None and bias.shape != weight.shape:
        return None
    width = weight.numel()
    # an offset mean tells a layer norm (which subtracts it) from an RMS norm
    x = 1.0 + torch.randn(2, _PROBE_ROWS, width, generator=generator, device=weight.device,
                          dtype=weight.dtype)
    y = _forward(module, x)
    for eps in dict.fromkeys((*_own_epsilons(module), *_EPSILONS)):
        if _same(y, F.layer_norm(x, (width,), weight, bias, eps)):
            return "layer_norm"
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        if _same(y, rms if bias is None else rms + bias):
            return "rms_norm"
    return None


def _own_epsilons(module) -> list[float]:
    return [v for name in ("eps", "variance_epsilon", "epsilon")
            if isinstance(v := getattr(module, name, None), float)]


def _forward(module, x):
    try:
        return type(module).forward(module, x)
    except Exception:  # a forward that needs other inputs computes something else
        return None


def _same(y, reference) -> bool:
    import torch

    return (isinstance(y, torch.Tensor) and y.shape == reference.shape
            and bool(torch.allclose(y, reference, rtol=_RTOL, atol=_ATOL)))
