"""Baseline sensitivity scores the indicator is compared against.

* :func:`wvar_scores` — QSync's weight-error indicator "WVAR":
  ``log2(|Σ|Q(W)| − Σ|W|| / Σ|W| + 1)``.
* :func:`hawq_scores` — HAWQ-V2: the average Hessian trace of the loss with respect to the
  layer's weight (Hutchinson's estimator, ``E[vᵀHv]`` with Rademacher ``v``), times the
  squared weight perturbation ``‖Q(W) − W‖²`` of rounding to the precision.
* :func:`random_scores` — seeded random scores (what no information scores).

All three score weighted ops (linear, conv, embedding); ops without weights (matmul) get NaN.
``Q`` is the real rounding of the kernels: int8 symmetric per tensor, float formats
round-to-nearest-even, fp8 with per-tensor scaling to the format's largest value.
"""

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from qsync_lab.batches import as_input_tuple, call_model
from qsync_lab.errors import QSyncError
from qsync_lab.indicator.statistics import SCORED_KINDS
from qsync_lab.graph.kinds import module_kind
from qsync_lab.modelstate import preserved_state
from qsync_lab.precision import Precision


def rounded(t: torch.Tensor, precision: "Precision | str", rounding: str = "nearest",
            seed: int = 0) -> torch.Tensor:
    """``t`` rounded to ``precision`` and back to float32, exactly as the operators encode
    their operands (:mod:`qsync_lab.quant.encoding`).

    Example::

        >>> import torch
        >>> rounded(torch.tensor([0.1, -1.0]), "bf16").tolist()
        [0.10009765625, -1.0]
    """
    from qsync_lab.quant.encoding import decode, encode

    return decode(encode(t.detach().float(), Precision.parse(precision), rounding=rounding,
                         seed=seed))


def weighted_ops(model: nn.Module) -> dict[str, nn.Module]:
    """Scorable modules that own a weight, by FQN."""
    return {fqn: m for fqn, m in model.named_modules()
            if module_kind(m) in SCORED_KINDS and getattr(m, "weight", None) is not None}


def wvar_scores(model: nn.Module, precisions: Sequence["Precision | str"]) -> pd.DataFrame:
    """QSync's WVAR per weighted op (rows) and precision (columns).

    Example::

        >>> import torch.nn as nn
        >>> scores = wvar_scores(nn.Sequential(nn.Linear(8, 8)), ["fp32", "int8"])
        >>> float(scores.loc["0", "fp32"]), bool(scores.loc["0", "int8"] > 0)
        (0.0, True)
    """
    rows = {}
    for fqn, module in weighted_ops(model).items():
        w = module.weight.detach().float()
        total = float(w.abs().sum())
        rows[fqn] = {str(Precision.parse(p)): np.log2(
            abs(float(rounded(w, p).abs().sum()) - total) / total + 1) if total else 0.0
            for p in precisions}
    return pd.DataFrame.from_dict(rows, orient="index")


def hawq_scores(model: nn.Module, batches: Iterable, loss_fn: nn.Module,
                precisions: Sequence["Precision | str"], *, num_batches: int = 1,
                samples: int = 16, seed: int = 0) -> pd.DataFrame:
    """HAWQ-V2 scores: mean Hessian trace of each weighted op × ``‖Q(W) − W‖²``.

    Args:
        model: the fp32 model (left unchanged).
        batches: ``(inputs, target)`` pairs; the first ``num_batches`` are averaged.
        loss_fn: the training loss.
        precisions: precisions to score.
        num_batches: batches to average the Hessian trace over.
        samples: Rademacher vectors per batch (Hutchinson samples).
        seed: seeds the Rademacher vectors and dropout.

    Returns:
        DataFrame: rows weighted-op FQNs, columns precisions, plus ``hessian_trace``.
    """
    if samples < 1:
        raise QSyncError(f"samples must be at least 1, got {samples}")
    ops = weighted_ops(model)
    weights = [m.weight for m in ops.values()]
    traces = torch.zeros(len(weights), dtype=torch.float64)
    taken = 0
    # the math attention kernel is the one with a double backward (flash has none on CPU)
    with preserved_state(model), torch.random.fork_rng(devices=[]), \
            sdpa_kernel(SDPBackend.MATH):
        torch.manual_seed(seed)
        model.train()
        for inputs, target in batches:
            if taken == num_batches:
                break
            inputs = as_input_tuple(inputs)
            loss = loss_fn(call_model(model, inputs), target)
            grads = torch.autograd.grad(loss, weights, create_graph=True)
            for _ in range(samples):
                vs = [torch.randint_like(w, 2) * 2 - 1 for w in weights]
                hvs = torch.autograd.grad(grads, weights, grad_outputs=vs, retain_graph=True,
                                          allow_unused=True)
                for i, (v, hv) in enumerate(zip(vs, hvs)):
                    if hv is not None:
                        traces[i] += float((v * hv).double().sum())
            taken += 1
    if taken < num_batches:
        raise QSyncError(f"only {taken} batches were given, {num_batches} asked for")
    mean_trace = traces / (taken * samples)
    out = pd.DataFrame(index=list(ops))
    out["hessian_trace"] = mean_trace.numpy()
    for p in precisions:
        error = [float((rounded(w, p) - w.detach().float()).double().square().sum())
                 for w in weights]
        out[str(Precision.parse(p))] = (mean_trace.numpy() / [w.numel() for w in weights]) * error
    return out


def random_scores(ops: Sequence[str], precisions: Sequence["Precision | str"], *,
                  seed: int = 0) -> pd.DataFrame:
    """Uniform random scores per op and precision, reproducible for ``seed``."""
    rng = np.random.default_rng(seed)
    columns = [str(Precision.parse(p)) for p in precisions]
    return pd.DataFrame(rng.random((len(ops), len(columns))), index=list(ops), columns=columns)
