"""How well an indicator predicts real damage: the measured quality check.

The ground truth comes from quantizing **one operator at a time** with the real
mixed-precision operators (:func:`qsync_lab.quant.apply_plan_`) and measuring, over held-out
batches, against the fp32 model on the same batches and dropout masks:

* ``loss_increase``: mean of ``loss_quantized − loss_fp32``;
* ``grad_deviation``: ``Σ‖g_quantized − g_fp32‖² / Σ‖g_fp32‖²`` over all parameters.

Each indicator's quality is its Spearman rank correlation with these, over the operators it
scores (weight-based baselines do not score matmuls; the row says how many ops were used).
Indicators: ``qsync`` (ω), ``fisher`` (the first-order loss term of the same statistics),
``hawq``, ``wvar`` and ``random``.
"""

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from qsync_lab.errors import QSyncError
from qsync_lab.indicator.baselines import hawq_scores, random_scores, wvar_scores
from qsync_lab.indicator.scores import indicator
from qsync_lab.modelstate import preserved_state
from qsync_lab.precision import Precision


INDICATORS = ("qsync", "fisher", "hawq", "wvar", "random")


@dataclass(frozen=True)
class QualityReport:
    """Result of :func:`indicator_quality`.

    Attributes:
        correlations: one row per indicator: ``ops`` (how many were ranked),
            ``rho_loss`` and ``rho_grad`` (Spearman ρ with the loss increase and the
            gradient deviation).
        table: one row per op: the truth columns and every indicator's score.
    """

    correlations: pd.DataFrame
    table: pd.DataFrame


def measure_truth(model: nn.Module, batches: Sequence, loss_fn: nn.Module, ops: Sequence[str],
                  precision: "Precision | str", *, seed: int = 0,
                  progress: bool = True) -> pd.DataFrame:
    """Loss increase and gradient deviation of quantizing each op of ``ops`` alone.

    Ops the runtime cannot run at ``precision`` (e.g. an int8 embedding) are left out.
    """
    from qsync_lab.quant import apply_plan_

    reference = [_loss_and_grads(model, batch, loss_fn, seed + i)
                 for i, batch in enumerate(batches)]
    rows = {}
    for op in tqdm(ops, disable=not progress, desc=f"truth ({precision})"):
        quantized = copy.deepcopy(model)
        try:
            apply_plan_(quantized, {op: str(Precision.parse(precision))})
        except QSyncError:
            continue
        loss_delta, dev, norm = 0.0, 0.0, 0.0
        for i, batch in enumerate(batches):
            loss, grads = _loss_and_grads(quantized, batch, loss_fn, seed + i)
            ref_loss, ref_grads = reference[i]
            loss_delta += loss - ref_loss
            dev += sum(float((g - r).double().square().sum()) for g, r in zip(grads, ref_grads))
            norm += sum(float(r.double().square().sum()) for r in ref_grads)
        rows[op] = {"loss_increase": loss_delta / len(batches), "grad_deviation": dev / norm}
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
        ranked = table[[name, "loss_increase", "grad_deviation"]].dropna()
        rows[name] = {
            "ops": len(ranked),
            "rho_loss": ranked[name].corr(ranked["loss_increase"], method="spearman"),
            "rho_grad": ranked[name].corr(ranked["grad_deviation"], method="spearman"),
        }
    return QualityReport(pd.DataFrame.from_dict(rows, orient="index"), table)


def _loss_and_grads(model: nn.Module, batch, loss_fn: nn.Module, seed: int):
    """Loss and parameter gradients of one batch, with dropout drawn from ``seed``."""
    inputs, target = batch
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    with preserved_state(model), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.train()
        for p in model.parameters():
            p.grad = None
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for p in model.parameters()]
    return float(loss.detach()), grads
