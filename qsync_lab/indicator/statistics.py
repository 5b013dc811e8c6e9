"""Per-operator statistics for the indicator, gathered with hooks over calibration batches.

For every call of a scorable operator (linear, conv, matmul, embedding modules, the
functional matmul and linear calls a plan can set, named as the tracers name them with
:class:`~qsync_lab.graph.ScopedCalls`, and the in- and out-projections of a multi-head
attention module, which runs as its three ops during calibration:
:mod:`qsync_lab.graph.attention`) and every batch,
:func:`collect_statistics` records one row: multiply-adds ``macs``; element counts
``numel_a`` (first operand: the activation input), ``numel_b`` (second operand: the weight,
or the second activation of a matmul) and ``numel_g`` (the output gradient); squared norms
``sumsq_a/b/g``; the squared norm of the weight gradient ``sumsq_wgrad``; and the expected
rounding-noise energy of each operand per precision, ``noise_a[p]``, ``noise_b[p]``,
``noise_g[p]`` (see :mod:`qsync_lab.indicator.formats`).

Normalisation ops of plannable kinds (:data:`NORM_KINDS`: batch, layer, group and RMS
norm) get rows too, with ``macs = 0``, the activation input as operand ``a``, their affine
parameters as ``b`` (never rounded: ``noise_b = 0``) and the extra terms the norm score of
:mod:`qsync_lab.indicator.scores` needs, each per precision the policy lets a norm take
(floats of at least 16 bits; the others are NaN; tf32 and fp32 round nothing and give 0):
``noise_as[p]`` = Σ (γ/σ)²·E[ε_x²] (the input's rounding carried through the
normalisation), ``noise_y[p]`` = E‖ε_y‖² of the output, and backward, per gradient format
``q``, ``noise_gs[q]`` = Σ (γ/σ)²·E[ε_G²], ``noise_dx[q]`` = E‖ε_dx‖² of the input gradient
(computed from the norm's backward formula) and, per forward precision,
``noise_dxsaved[p]``, what the saved input's rounding does to ``dx``, and
``noise_wgrad[p]``, the error energy of the γ and β gradients. ``σ`` is the batch
statistics' (training mode, as calibration runs) or the running variance's (a BatchNorm in
eval mode).

The model runs in fp32, forward and backward, with no optimizer step; its parameters,
buffers, gradients and train/eval flags are left exactly as they were, and the global RNG
state too (dropout draws come from ``seed``).
"""

from collections.abc import Iterable, Sequence

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from qsync_lab.batches import as_input_tuple, call_model
from qsync_lab.errors import QSyncError
from qsync_lab.graph.attention import in_proj_name, projection_weights, split_forward, splits
from qsync_lab.graph.calls import ScopedCalls
from qsync_lab.graph.kinds import function_kind, module_kind
from qsync_lab.graph.records import op_name_of
from qsync_lab.indicator.formats import noise_variance, operand_noise
from qsync_lab.modelstate import preserved_state
from qsync_lab.policy import (DEFAULT_BACKWARD, NORM_KINDS, SCORED_KINDS, function_refusal,
                              kind_allows)
from qsync_lab.policy.evidence import linear_weight
from qsync_lab.precision import Precision

#: precisions whose I/O rounding a norm's boundary applies (fp32 leaves it alone)
_ROUNDING_FLOATS = frozenset({Precision.FP16, Precision.BF16})


def collect_statistics(model: nn.Module, batches: Iterable, loss_fn: nn.Module, *,
                       precisions: Sequence["Precision | str"] = tuple(Precision),
                       rounding: str = "nearest", num_batches: int = 10, seed: int = 0,
                       progress: bool = True) -> pd.DataFrame:
    """Run ``num_batches`` calibration batches and return one row per (batch, op call).

    Args:
        model: the fp32 model (left unchanged).
        batches: iterable of ``(inputs, target)``; ``inputs`` a tensor or tuple of tensors.
        loss_fn: loss module, ``loss_fn(model(*inputs), target)``.
        precisions: forward precisions to measure noise for (their backward gradient
            formats are measured too).
        rounding: int8 rounding, ``"nearest"`` or ``"stochastic"``.
        num_batches: K, the number of calibration batches (QSync uses 10).
        seed: seeds dropout and any other randomness of the forward pass.
        progress: show a tqdm progress bar.

    Example::

        >>> import torch, torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> batches = [(torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1]))]
        >>> stats = collect_statistics(model, batches, nn.CrossEntropyLoss(),
        ...                            precisions=["int8"], num_batches=1, progress=False)
        >>> stats[["op", "kind", "macs", "numel_a", "numel_b", "numel_g"]].values.tolist()
        [['0', 'linear', 60, 20, 12, 15], ['2', 'linear', 30, 15, 6, 10]]
    """
    if num_batches < 1:
        raise QSyncError(f"num_batches must be at least 1, got {num_batches}")
    wanted = sorted({Precision.parse(p) for p in precisions}, key=list(Precision).index)
    grad_formats = sorted({DEFAULT_BACKWARD[p] for p in wanted}, key=list(Precision).index)
    recorder = _Recorder(model, wanted, grad_formats, rounding)
    rows: list[dict] = []
    with preserved_state(model), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.train()
        handles = recorder.attach()
        try:
            taken = 0
            for inputs, target in tqdm(batches, total=num_batches, disable=not progress,
                                       desc="indicator statistics"):
                if taken == num_batches:
                    break
                rows.extend(recorder.run_batch(inputs, target, loss_fn, taken))
                taken += 1
        finally:
            for handle in handles:
                handle.remove()
    if not rows:
        raise QSyncError("no calibration batches were given; pass an iterable of "
                         "(inputs, target) pairs")
    if taken < num_batches:
        raise QSyncError(f"only {taken} calibration batches were given, {num_batches} asked "
                         "for; pass more batches or lower num_batches")
    return pd.DataFrame(rows)


class _Recorder:
    """Hooks that turn each scored op call into a statistics row."""

    def __init__(self, model, precisions, grad_formats, rounding) -> None:
        self.model = model
        self.precisions = precisions
        self.grad_formats = grad_formats
        self.rounding = rounding
        self.calls: dict[str, int] = {}
        self.rows: list[dict] = []
        self.weight_stats: dict[str, dict] = {}  # weights do not change during calibration

    def attach(self) -> list:
        """Hooks on the scored modules, the split forward of the attention modules, and a
        mode around every forward for the functional matmuls and linears; their handles."""
        handles = []
        for fqn, module in self.model.named_modules():
            kind = module_kind(module)
            if splits(module):
                handles.append(_SplitAttention(self, fqn, module))
            elif kind in SCORED_KINDS:
                handles.append(module.register_forward_hook(
                    lambda m, args, out, fqn=fqn, kind=kind: self._forward(
                        self._name(fqn), kind, *_operands(kind, m, args), out,
                        list(m.parameters()))))
            elif kind in NORM_KINDS:
                handles.append(module.register_forward_hook(
                    lambda m, args, out, fqn=fqn, kind=kind: self._norm_forward(
                        fqn, kind, m, args, out)))
        calls = _FunctionalCalls(self.model, self)
        calls.attach()
        return [*handles, calls]

    def run_batch(self, inputs, target, loss_fn, batch: int) -> list[dict]:
        self.calls.clear()
        self.rows = []
        for p in self.model.parameters():
            p.grad = None
        inputs = as_input_tuple(inputs)
        loss = loss_fn(call_model(self.model, inputs), target)
        if not torch.isfinite(loss):
            raise QSyncError(f"calibration batch {batch} gives a non-finite loss ({loss.item()});"
                             " check the data and the model")
        loss.backward()
        if not self.rows:
            raise QSyncError(f"{type(self.model).__name__} ran no linear, conv, matmul, "
                             "embedding or norm op to score")
        for row in self.rows:
            row["batch"] = batch
            row["sumsq_wgrad"] = sum(_sumsq(p.grad) for p in row.pop("_params")
                                     if p.grad is not None)
        return self.rows

    def _name(self, fqn: str) -> str:
        count = self.calls.get(fqn, 0)
        self.calls[fqn] = count + 1
        return fqn if count == 0 else f"{fqn}@{count}"

    def _forward(self, name, kind, a, b, out, params) -> None:
        """The row of a bilinear op (or embedding) ``name`` with operands ``a``, ``b``."""
        with torch.no_grad():
            row = {"op": name, "kind": kind, "macs": _macs(kind, a, b, out),
                   "numel_a": a.numel(), "numel_b": b.numel(), "numel_g": out.numel(),
                   "_params": params}
            if kind == "embedding":  # indices are not rounded
                row.update({"sumsq_a": 0.0}, **{f"noise_a[{p}]": 0.0 for p in self.precisions})
            else:
                row.update(self._operand_stats("a", a))
            if kind == "matmul":
                row.update(self._operand_stats("b", b))
            else:
                if name not in self.weight_stats:
                    self.weight_stats[name] = self._operand_stats("b", b)
                row.update(self.weight_stats[name])
        self.rows.append(row)
        if out.requires_grad:
            out.register_hook(lambda g, row=row: self._backward(row, g))

    def _backward(self, row: dict, grad: torch.Tensor) -> None:
        with torch.no_grad():
            row.update(_stats("g", grad, self.grad_formats, "nearest"))

    def _in_projection(self, name: str, gemms: list[tuple], params: list) -> None:
        """The row of an attention in-projection from its GEMMs ``(x, weight, out)``: one
        bilinear op whose operands are the distinct inputs and the weights, each flattened
        and concatenated (exact for self-attention's one GEMM), and whose output gradient is
        the outputs' together."""
        inputs = list({id(x): x for x, _, _ in gemms}.values())
        with torch.no_grad():
            a = torch.cat([x.detach().reshape(-1) for x in inputs])
            row = {"op": name, "kind": "linear",
                   "macs": sum(out.numel() * (w.numel() // w.shape[0]) for _, w, out in gemms),
                   "numel_a": a.numel(), "numel_b": sum(w.numel() for _, w, _ in gemms),
                   "numel_g": sum(out.numel() for _, _, out in gemms), "_params": params}
            row.update(self._operand_stats("a", a))
            if name not in self.weight_stats:
                b = torch.cat([w.detach().reshape(-1) for _, w, _ in gemms])
                self.weight_stats[name] = self._operand_stats("b", b)
            row.update(self.weight_stats[name])
        self.rows.append(row)
        for _, _, out in gemms:
            if out.requires_grad:
                out.register_hook(lambda g, row=row: self._add_backward(row, g))

    def _add_backward(self, row: dict, grad: torch.Tensor) -> None:
        """Add one output's gradient statistics to ``row`` (an op with several outputs)."""
        with torch.no_grad():
            for key, value in _stats("g", grad, self.grad_formats, "nearest").items():
                row[key] = row.get(key, 0.0) + value

    def _operand_stats(self, role: str, t: torch.Tensor) -> dict[str, float]:
        return _stats(role, t, self.precisions, self.rounding)

    def _norm_forward(self, fqn, kind, module, args, out) -> None:
        """A norm's row: its input's rounding weighted by (γ/σ)², its output's rounding."""
        name = self._name(fqn)
        x = args[0]
        if not isinstance(out, torch.Tensor) or not x.is_floating_point():
            return
        params = [p for p in module.parameters(recurse=False)]
        allowed = [p for p in self.precisions if kind_allows(kind, p)]
        with torch.no_grad():
            geo = _NormGeometry(kind, module, x)
            row = {"op": name, "kind": kind, "macs": 0, "numel_a": x.numel(),
                   "numel_b": sum(p.numel() for p in params),
                   "numel_g": out.numel(), "sumsq_b": sum(_sumsq(p) for p in params),
                   **{f"noise_b[{p}]": 0.0 for p in self.precisions}, "_params": params}
            row.update(self._operand_stats("a", x))
            y_noise = operand_noise(out, allowed)
            for p in self.precisions:
                if not kind_allows(kind, p):
                    row[f"noise_as[{p}]"] = row[f"noise_y[{p}]"] = float("nan")
                elif p in _ROUNDING_FLOATS:
                    row[f"noise_as[{p}]"] = _dot(geo.scale2, noise_variance(geo.x2d, p))
                    row[f"noise_y[{p}]"] = y_noise[p]
                else:
                    row[f"noise_as[{p}]"] = row[f"noise_y[{p}]"] = 0.0
        self.rows.append(row)
        if out.requires_grad:
            out.register_hook(lambda g, row=row, geo=geo: self._norm_backward(row, geo, g))

    def _norm_backward(self, row: dict, geo: "_NormGeometry", grad: torch.Tensor) -> None:
        with torch.no_grad():
            row.update(_stats("g", grad, self.grad_formats, "nearest"))
            g2d = geo.to2d(grad.float())
            scaled = g2d * geo.gamma
            dx = geo.project(scaled) / geo.sigma
            g_var = {}
            for q in self.grad_formats:
                if q in _ROUNDING_FLOATS:
                    g_var[q] = noise_variance(g2d, q)
                    row[f"noise_gs[{q}]"] = _dot(geo.scale2, g_var[q])
                    row[f"noise_dx[{q}]"] = float(noise_variance(dx, q).double().sum())
                else:
                    row[f"noise_gs[{q}]"] = row[f"noise_dx[{q}]"] = 0.0
            # the saved input's rounding: dx moves by -ε_x/σ²·mean(γG·x̂) (batch statistics),
            # dγ by Σ G·δx̂ (for BatchNorm G projected as dx projects it: δx̂ = P·ε_x/σ)
            if geo.batch_stats:
                dx_weight = ((scaled * geo.xhat).mean(1, keepdim=True)
                             / geo.sigma.square()).square().expand_as(geo.x2d)
            else:
                dx_weight = torch.zeros(1, 1).expand_as(geo.x2d)
            g_seen = geo.project(g2d) if geo.kind == "batch_norm" else g2d
            dgamma_weight = g_seen.square() / geo.sigma.square()
            for p in self.precisions:
                q = DEFAULT_BACKWARD[p]
                if not kind_allows(geo.kind, p):
                    row[f"noise_dxsaved[{p}]"] = row[f"noise_wgrad[{p}]"] = float("nan")
                    continue
                x_var = noise_variance(geo.x2d, p) if p in _ROUNDING_FLOATS else None
                row[f"noise_dxsaved[{p}]"] = _dot(dx_weight, x_var) if x_var is not None else 0.0
                total = 0.0
                if geo.has_weight:  # dγ = Σ G·x̂
                    if q in g_var:
                        total += _dot(geo.xhat.square(), g_var[q])
                    if x_var is not None:
                        total += _dot(dgamma_weight, x_var)
                if geo.has_bias and q in g_var:  # dβ = Σ G
                    total += float(g_var[q].double().sum())
                row[f"noise_wgrad[{p}]"] = total


class _NormGeometry:
    """A norm's input as a 2-D ``(groups, elements)`` view (each row normalised on its own),
    with its ``σ`` per row, ``x̂``, ``γ`` per element and ``(γ/σ)²``."""

    def __init__(self, kind: str, module: nn.Module, x: torch.Tensor) -> None:
        weight = getattr(module, "weight", None)
        bias = getattr(module, "bias", None)
        self.has_weight = isinstance(weight, torch.Tensor)
        self.has_bias = isinstance(bias, torch.Tensor)
        shape = x.shape
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        self.kind = kind
        self.centered = kind != "rms_norm"
        self.batch_stats = True
        if kind == "batch_norm":
            channels = shape[1]
            self.to2d = lambda t: t.transpose(0, 1).reshape(channels, -1)
            gamma = weight.detach().float()[:, None] if self.has_weight else None
            self.batch_stats = module.training or module.running_var is None
        elif kind == "group_norm":
            groups = shape[0] * module.num_groups
            self.to2d = lambda t: t.reshape(groups, -1)
            gamma = (self.to2d(weight.detach().float().view(1, -1, *[1] * (x.dim() - 2))
                               .expand(shape)) if self.has_weight else None)
        else:  # layer_norm, rms_norm: the trailing normalized_shape (a library norm's: its
            size = 1  # weight's)
            for d in getattr(module, "normalized_shape", None) or weight.shape:
                size *= d
            self.to2d = lambda t: t.reshape(-1, size)
            gamma = weight.detach().float().reshape(1, -1) if self.has_weight else None
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        self.x2d = self.to2d(x.detach().float()).clone()
        if self.batch_stats:
            mean = self.x2d.mean(1, keepdim=True) if self.centered else 0.0
            var = (self.x2d - mean).square().mean(1, keepdim=True)
        else:
            mean = module.running_mean.detach().float()[:, None]
            var = module.running_var.detach().float()[:, None]
        self.sigma = torch.sqrt(var + eps)
        self.xhat = (self.x2d - mean) / self.sigma
        self.gamma = gamma if gamma is not None else torch.ones(1, 1)
        self.scale2 = (self.gamma / self.sigma).square().expand_as(self.x2d)

    def project(self, g: torch.Tensor) -> torch.Tensor:
        """``g`` (2-D) less its components along the directions the batch statistics
        remove: ``dx = project(γ·G)/σ`` is the norm's backward formula."""
        if not self.batch_stats:
            return g
        out = g - self.xhat * (g * self.xhat).mean(1, keepdim=True)
        if self.centered:
            out = out - g.mean(1, keepdim=True)
        return out


def _dot(weights: torch.Tensor, values: torch.Tensor) -> float:
    return float((weights.double() * values.double()).sum())


class _SplitAttention:
    """Runs a multi-head attention module as its three ops while attached (its forward:
    :func:`~qsync_lab.graph.attention.split_forward`), so its ``out_proj`` hook sees the
    out-projection and the recorder the in-projection."""

    def __init__(self, recorder: _Recorder, fqn: str, module: nn.Module) -> None:
        self.recorder, self.fqn, self.module = recorder, fqn, module
        module.forward = self.forward

    def forward(self, *args, **kwargs):
        name = self.recorder._name(in_proj_name(self.fqn))
        gemms: list[tuple] = []

        def linear(x, weight, bias):
            out = F.linear(x, weight, bias)
            gemms.append((x, weight, out))
            return out

        result = split_forward(self.module, *args, **kwargs, linear=linear)
        params = [p for p in (*projection_weights(self.module), self.module.in_proj_bias)
                  if p is not None]
        self.recorder._in_projection(name, gemms, params)
        return result

    def remove(self) -> None:
        del self.module.forward


class _FunctionalCalls(ScopedCalls):
    """Turns the model's plannable functional matmul and linear calls into rows."""

    def __init__(self, model: nn.Module, recorder: _Recorder) -> None:
        super().__init__(model)
        self.recorder = recorder

    def on_call(self, name, fn_name, func, args, kwargs):
        out = func(*args, **kwargs)
        kind = function_kind(fn_name)
        if kind in SCORED_KINDS and function_refusal(op_name_of(fn_name), kind) is None:
            a, b = (args[1], args[0]) if fn_name == "__rmatmul__" else args[:2]
            params = [t for t in (*args, *kwargs.values()) if isinstance(t, nn.Parameter)]
            self.recorder._forward(name, kind, a, b, out, params)
        return out

    def remove(self) -> None:
        self.detach()


def _operands(kind: str, module: nn.Module, args) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "matmul":
        return args[0], args[1]
    return args[0], linear_weight(module) if kind == "linear" else module.weight


def _macs(kind: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int:
    """Multiply-adds: each output element sums ``reduce`` products."""
    if kind == "embedding":
        return 0
    if kind == "matmul":
        reduce = a.shape[-1]
    else:  # weighted: in_features, or C_in/groups · prod(kernel)
        reduce = b.numel() // b.shape[0]
    return out.numel() * reduce


def _sumsq(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.detach().float()).item() ** 2


def _stats(role: str, t: torch.Tensor, precisions, rounding) -> dict[str, float]:
    """``sumsq_<role>`` and ``noise_<role>[p]`` for each precision."""
    out = {f"sumsq_{role}": _sumsq(t)}
    out.update({f"noise_{role}[{p}]": e for p, e in operand_noise(t, precisions, rounding).items()})
    return out
