"""How well an indicator predicts real damage: the measured quality check.

The ground truth comes from quantizing **one operator at a time** with the real
mixed-precision operators (:func:`qsync_lab.quant.apply_plan_`) and measuring, over held-out
batches, against the fp32 model on the same batches and dropout masks:

* ``kl``: mean over samples of ``KL(p_fp32 ‖ p_quantized)`` between the predicted class
  distributions — the expected loss increase when the targets are drawn from the fp32
  model's own predictions. It is the stable form of the loss increase: never negative,
  and free of the first-order term ``g·δy`` whose sign follows the given labels;
* ``grad_deviation``: ``Σ‖g_quantized − g_fp32‖² / Σ‖g_fp32‖²`` over all parameters;
* ``loss_increase``: mean of ``loss_quantized − loss_fp32`` over the batches, with the
  half-width of its 95 % interval (``loss_ci95``). On trained models one op at int8 moves
  the loss by far less than this interval, so it is reported, not trusted.

Each indicator's quality is its Spearman rank correlation with these, over the operators it
scores (weight-based baselines do not score matmuls; the row says how many ops were used).
Indicators: ``qsync`` (ω), ``fisher`` (the first-order loss term of the same statistics),
``hawq``, ``wvar`` and ``random``.
"""

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from qsync_lab.batches import as_input_tuple, call_model
from qsync_lab.errors import QSyncError
from qsync_lab.indicator.baselines import hawq_scores, random_scores, wvar_scores
from qsync_lab.indicator.scores import indicator
from qsync_lab.modelstate import preserved_state
from qsync_lab.precision import Precision


INDICATORS = ("qsync", "fisher", "hawq", "wvar", "random")
#: correlation column suffix -> truth column of :func:`measure_truth`
TRUTHS = {"kl": "kl", "grad": "grad_deviation", "loss": "loss_increase"}


@dataclass(frozen=True)
class QualityReport:
    """Result of :func:`indicator_quality`.

    Attributes:
        correlations: one row per indicator: ``ops`` (how many were ranked) and
            ``rho_kl``, ``rho_grad``, ``rho_loss`` (Spearman ρ with the KL, the gradient
            deviation and the loss increase).
        table: one row per op: the truth columns and every indicator's score.
    """

    correlations: pd.DataFrame
    table: pd.DataFrame


def measure_truth(model: nn.Module, batches: Sequence, loss_fn: nn.Module, ops: Sequence[str],
                  precision: "Precision | str", *, seed: int = 0,
                  progress: bool = True) -> pd.DataFrame:
    """The damage of quantizing each op of ``ops`` alone, over ``batches``.

    Columns: ``kl``, ``grad_deviation``, ``loss_increase`` and ``loss_ci95`` (the
    half-width of the 95 % Student-t interval of the per-batch loss increases; NaN with
    one batch). ``kl`` is NaN when the model's output is not a tensor of class scores
    (last dimension). Ops the runtime cannot run at ``precision`` (e.g. an int8
    embedding) are left out.
    """
    from scipy.stats import t as student_t

    from qsync_lab.quant import apply_plan_

    reference = [_loss_grads_output(model, batch, loss_fn, seed + i)
                 for i, batch in enumerate(batches)]
    norm = sum(float(r.double().square().sum()) for _, grads, _ in reference for r in grads)
    rows = {}
    for op in tqdm(ops, disable=not progress, desc=f"truth ({precision})"):
        quantized = copy.deepcopy(model)
        try:
            apply_plan_(quantized, {op: str(Precision.parse(precision))})
        except QSyncError:
            continue
        loss_deltas, kl, dev = [], 0.0, 0.0
        for i, batch in enumerate(batches):
            loss, grads, output = _loss_grads_output(quantized, batch, loss_fn, seed + i)
            ref_loss, ref_grads, ref_output = reference[i]
            loss_deltas.append(loss - ref_loss)
            kl += _class_kl(ref_output, output)
            dev += sum(float((g - r).double().square().sum()) for g, r in zip(grads, ref_grads))
        deltas = np.array(loss_deltas)
        half = (student_t.ppf(0.975, len(deltas) - 1) * deltas.std(ddof=1) / len(deltas) ** 0.5
                if len(deltas) > 1 else np.nan)
        rows[op] = {"kl": kl / len(batches), "grad_deviation": dev / norm,
                    "loss_increase": deltas.mean(), "loss_ci95": half}
    return pd.DataFrame.from_dict(rows, orient="index")


def indicator_quality(model: nn.Module, graph, calibration: Sequence, heldout: Sequence,
                      precision: "Precision | str", *, loss_fn: nn.Module, gamma: float = 4.0,
                      hawq_samples: int = 16, seed: int = 0,
                      progress: bool = True) -> QualityReport:
    """Spearman ρ of QSync's indicator, its Fisher term and the baselines (HAWQ, WVAR,
    random) with the measured damage of quantizing one op at a time to ``precision``.

    Args:
        model: the fp32 model (left unchanged).
        graph: its :class:`~qsync_lab.graph.OpGraph`.
        calibration: batches ``(inputs, target)`` for the indicators (all are used).
        heldout: other batches for the ground truth (M of them).
        precision: the precision to check (e.g. ``"int8"``).
        loss_fn: the training loss.
        gamma: the indicator's forward weight.
        hawq_samples: Hutchinson samples per calibration batch.
        seed: seeds dropout and the random baseline.
        progress: show progress bars.
    """
    p = str(Precision.parse(precision))
    if not calibration or not heldout:
        raise QSyncError("give at least one calibration batch and one held-out batch")
    scores = indicator(model, graph, calibration, loss_fn=loss_fn, precisions=[p], gamma=gamma,
                       num_batches=len(calibration), seed=seed, progress=progress)
    truth = measure_truth(model, heldout, loss_fn, list(scores.index), p, seed=seed,
                          progress=progress)
    table = truth.copy()
    table["qsync"] = scores[(p, "omega")]
    table["fisher"] = scores[(p, "fisher")]
    table["hawq"] = hawq_scores(model, calibration, loss_fn, [p], num_batches=len(calibration),
                                samples=hawq_samples, seed=seed)[p]
    table["wvar"] = wvar_scores(model, [p])[p]
    table["random"] = random_scores(list(table.index), [p], seed=seed)[p]
    rows = {}
    for name in INDICATORS:
        ranked = table[table[name].notna()]
        rows[name] = {"ops": len(ranked)} | {
            f"rho_{truth}": ranked[name].corr(ranked[column], method="spearman")
            for truth, column in TRUTHS.items()}
    return QualityReport(pd.DataFrame.from_dict(rows, orient="index"), table)


def _class_kl(reference: torch.Tensor, quantized: torch.Tensor) -> float:
    """Mean KL(softmax(reference) ‖ softmax(quantized)) over the rows of class scores;
    NaN when the outputs are not floating tensors with at least two classes.

    Example::

        >>> x = torch.tensor([[2.0, 0.0]])
        >>> _class_kl(x, x), round(_class_kl(x, torch.zeros(1, 2)), 4)
        (0.0, 0.3278)
    """
    if not (isinstance(reference, torch.Tensor) and reference.is_floating_point()
            and reference.dim() >= 1 and reference.shape[-1] >= 2):
        return float("nan")
    p = reference.double().log_softmax(-1).flatten(0, -2)
    q = quantized.double().log_softmax(-1).flatten(0, -2)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _loss_grads_output(model: nn.Module, batch, loss_fn: nn.Module, seed: int):
    """Loss, parameter gradients and output of one batch, dropout drawn from ``seed``."""
    inputs, target = batch
    inputs = as_input_tuple(inputs)
    with preserved_state(model), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.train()
        for p in model.parameters():
            p.grad = None
        output = call_model(model, inputs)
        loss = loss_fn(output, target)
        loss.backward()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for p in model.parameters()]
    return float(loss.detach()), grads, output.detach() if torch.is_tensor(output) else output
