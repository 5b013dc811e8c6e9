"""QSync's bi-directional indicator: how much error an operator adds, forward and backward,
when it runs in a lower precision.

Derivation (one formula for every bilinear op). An op with ``P`` multiply-adds combines
operands ``A`` (``D_a`` elements) and ``B`` (``D_b``); each output element sums ``P/D_out``
products. Rounding ``A`` and ``B`` adds independent zero-mean errors ``ε_A``, ``ε_B``;
to first order the error energy of the result is

    E‖ΔOut‖² = P / (D_a·D_b) · (E‖ε_A‖²·‖B‖² + E‖ε_B‖²·‖A‖²)

(each output's error sums ``P/D_out`` terms of variance σ_A²·mean(B²); summed over outputs).

* forward ``Y = A∘B`` (``A`` the activation, ``B`` the weight or the second activation):
  ``V_f = P/(D_a·D_b)·(E‖ε_A‖²·‖B‖² + E‖ε_B‖²·‖A‖²)``;
* backward, with the output gradient ``G`` rounded to the op's backward format:
  the gradient of ``B`` (``G`` with ``A``): ``P/(D_a·D_g)·(E‖ε_A‖²·‖G‖² + E‖ε_G‖²·‖A‖²)``,
  the gradient of ``A`` (``G`` with ``B``, only if ``A`` needs one):
  ``P/(D_g·D_b)·(E‖ε_G‖²·‖B‖² + E‖ε_B‖²·‖G‖²)``; ``V_b`` is their sum.
  An op without weights (matmul) is scored from both of its operands this way.
* embedding (a row gather): ``V_f = E‖ε_W‖²·D_out/D_W``, ``V_b = E‖ε_G‖²``.
* normalisation ops (batch, layer, group, RMS norm). A planned norm keeps fp32 math and
  fp32 γ, β but reads and writes fp16/bf16: its input ``x`` and output ``y`` are rounded
  forward, the output gradient ``G`` and the input gradient ``dx`` backward
  (:class:`~qsync_lab.quant.modules.PrecisionBoundary`). Per normalised group (a channel
  over batch and space for BatchNorm, a row for LayerNorm) ``y = γ·(x − μ)/σ + β``; to
  first order an input error ``ε_x`` moves ``y`` by ``(γ/σ)·ε_x`` (the error's own effect
  on ``μ`` and ``σ`` is a projection onto two of the group's many directions, dropped),
  so, summing the independent errors element by element,

      V_f = Σ (γ/σ)²·E[ε_x²] + E‖ε_y‖²

  with ``E[ε²]`` each element's rounding variance measured on the actual tensors
  (:func:`~qsync_lab.indicator.formats.noise_variance`; the output term is
  :func:`~qsync_lab.indicator.formats.operand_noise` of ``y``). Backward,
  ``dx = (γ/σ)·(G − mean G − x̂·mean(G·x̂))`` carries ``ε_G`` the same way, and the
  rounding of ``dx`` adds its own energy; the parameter gradients ``dγ = Σ G·x̂`` and
  ``dβ = Σ G`` get ``Σ x̂²·E[ε_G²] + Σ G⊥²·E[ε_x²]/σ²`` and ``Σ E[ε_G²]`` (``G⊥``: ``G``
  projected as in ``dx`` for a BatchNorm, whose ``dγ`` sums the whole normalised group;
  ``G`` itself for the other norms). The saved input is the rounded one too, and with
  batch statistics ``dx`` moves by ``−ε_x/σ²·mean(γG·x̂)``:

      V_b = Σ (γ/σ)²·E[ε_G²] + E‖ε_dx‖² + Σ E[ε_x²]·(mean(γG·x̂)/σ²)²
            + E‖ΔdΓ‖² + E‖ΔdΒ‖²

  (the ``dx`` terms only when the input needs a gradient). ``σ`` is the batch statistics'
  (calibration runs in training mode) or the running variance's for a BatchNorm in eval
  mode. These are error energies of the same outputs and gradients as the bilinear
  terms, so a norm's ω and fisher compare with a conv's. The policy lets norms take only
  floats of at least 16 bits: int8 and fp8 are NaN (no choice for the allocator), tf32
  and fp32 round nothing (0).

The rounding energies ``E‖ε‖²`` are measured per operand and precision
(:mod:`qsync_lab.indicator.formats`): int8 from its step size (the variance constant follows
the rounding mode), float formats from the operand's exponent histogram and the mantissa
width — so bf16 (7 bits) scores above fp16 (10 bits) on the same data, and fp8 e5m2 (2 bits)
above e4m3 (3 bits). INT8 ops run backward in fp16 and fp8 ops round gradients to e5m2, as
the operators do; the saved operands keep their forward rounding.

The combined score weights forward error by what lies downstream and backward error by
what lies upstream (``d`` = the op's forward depth, ``L`` = the graph's largest depth):

    ω = γ·(L − d)·V_f + d·V_b          (γ = 4 by default, as QSync)

A fourth term goes beyond QSync: ``fisher = V_f · ‖G‖² / D_out``, the first-order expected
squared change of the loss caused by the op's forward rounding (each output's error
``δy`` moves the loss by ``g·δy``). Unlike ω it knows how much the loss cares about the
op's output (a query projection feeding a flat softmax matters less than the value
projection beside it; an embedding followed by a LayerNorm matters more than its tiny
weights suggest). ``benchmarks/indicator_quality.py`` compares both against measured damage.

**The allocator's risk.** The ``risk`` column is what the allocator minimizes: ``fisher``
by default, ω with ``risk="omega"`` (to reproduce QSync). Measured one op at a time at int8
(``benchmarks/results/indicator_quality_cpu.txt``), ω ranks the damage well on ResNet-18
(Spearman ρ 0.81 with the KL of the predictions, 0.86 with the gradient deviation) but not
on a BERT-style encoder (−0.12, −0.13), while ``fisher`` reaches 0.85–0.99 on both truths on
ResNet-18, BERT and a GPT-style decoder. Two reasons, both visible in the per-op table
(:attr:`~qsync_lab.indicator.quality.QualityReport.table`) of a trained BERT-mini: ω adds
``V_f``, an activation error energy, to ``V_b``, a gradient error energy, which lie about
10⁴–10⁵ apart (median ratio 3·10⁻⁵), so ω is ``γ·(L−d)·V_f`` in practice; and ``V_f``
counts error energy wherever it lands, while the loss feels it only through the output
gradient — the attention scores, feeding a saturated softmax, carry the largest ``V_f``
(ω's ranks 1–2 of 21) and do middling harm (ranks 7–16 by the two truths); the
embeddings, rescaled by the LayerNorm after them, carry the least ``V_f`` (ω's ranks
18–20) and do the most harm (ranks 1–5). ``fisher`` weighs the same
``V_f`` by that gradient; its backward counterpart (the gradient error's effect on the
next update's loss) is smaller by the learning rate squared and is left out.
"""

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import torch.nn as nn

from qsync_lab.errors import QSyncError
from qsync_lab.indicator.statistics import NORM_KINDS, collect_statistics
from qsync_lab.policy import DEFAULT_BACKWARD, kind_allows
from qsync_lab.precision import Precision

TERMS = ("V_f", "V_b", "omega", "fisher", "risk")
#: what the ``risk`` column (the allocator's) can be
RISKS = ("fisher", "omega")


def indicator(model: nn.Module, graph, batches: Iterable, *,
              loss_fn: nn.Module, precisions: Sequence["Precision | str"] = tuple(Precision),
              gamma: float = 4.0, rounding: str = "nearest", num_batches: int = 10,
              risk: str = "fisher", seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """Score every linear, conv, matmul, embedding and norm op of ``model`` per precision.

    Args:
        model: the fp32 model; left unchanged (no optimizer step, buffers restored).
        graph: the model's :class:`~qsync_lab.graph.OpGraph` (gives each op's depth).
        batches: calibration batches ``(inputs, target)``; the first ``num_batches`` are used.
        loss_fn: the training loss.
        precisions: precisions to score (fp32 scores 0).
        gamma: weight of the forward term (QSync: 4).
        rounding: int8 rounding mode, ``"nearest"`` or ``"stochastic"``.
        num_batches: K calibration batches (QSync: 10).
        risk: the term copied into the ``risk`` column, which the allocator minimizes:
            ``"fisher"`` (default) or ``"omega"`` (QSync's).
        seed: seeds dropout during calibration.
        progress: show a progress bar.

    Returns:
        DataFrame indexed by op FQN (graph order) with columns ``("op", "kind")``,
        ``("op", "depth")`` and, per precision, ``(p, "V_f")``, ``(p, "V_b")``,
        ``(p, "omega")``, ``(p, "fisher")``, ``(p, "risk")`` — e.g.
        ``scores["int8"]["omega"]``.

    Example::

        >>> import torch, torch.nn as nn
        >>> from qsync_lab.graph import trace_graph
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
        >>> graph = trace_graph(model, x, target=y, loss_fn=nn.CrossEntropyLoss())
        >>> scores = indicator(model, graph, [(x, y)], loss_fn=nn.CrossEntropyLoss(),
        ...                    precisions=["fp16", "int8"], num_batches=1, progress=False)
        >>> bool((scores["int8"]["omega"] > scores["fp16"]["omega"]).all())
        True
    """
    if gamma < 0:
        raise QSyncError(f"gamma must be >= 0, got {gamma}")
    if risk not in RISKS:
        raise QSyncError(f"unknown risk {risk!r}; choose one of: {', '.join(RISKS)}")
    if (graph.ops["plan_refusal"] != "").all():
        raise QSyncError(f"{type(model).__name__} has no op a plan can set (linear, conv, "
                         "matmul, embedding or norm); there is nothing to score")
    stats = collect_statistics(model, batches, loss_fn, precisions=precisions,
                               rounding=rounding, num_batches=num_batches, seed=seed,
                               progress=progress)
    return scores_from_statistics(stats, graph, precisions, gamma=gamma, risk=risk)


def scores_from_statistics(stats: pd.DataFrame, graph, precisions, *,
                           gamma: float = 4.0, risk: str = "fisher") -> pd.DataFrame:
    """The indicator from :func:`~qsync_lab.indicator.collect_statistics` rows: each term
    is computed per calibration batch, then averaged over the batches."""
    missing = sorted(set(stats["op"]) - set(graph.ops.index))
    if missing:
        raise QSyncError(f"op {missing[0]!r} of the statistics is not in the graph; trace the "
                         "graph from the same model")
    wanted = [Precision.parse(p) for p in precisions]
    ops = graph.ops
    needs_input_grad = (ops["bwd_input_flops"] > 0).reindex(stats["op"]).to_numpy()
    columns: dict[tuple[str, str], np.ndarray] = {}
    for p in wanted:
        v_f, v_b = _terms(stats, p, needs_input_grad)
        columns[(str(p), "V_f")] = v_f
        columns[(str(p), "V_b")] = v_b
        columns[(str(p), "fisher")] = v_f * stats["sumsq_g"].to_numpy(float) / stats[
            "numel_g"].to_numpy(float)
    per_batch = pd.DataFrame(columns, index=stats["op"].to_numpy())
    terms = per_batch.groupby(level=0, sort=False).mean()
    order = [name for name in ops.index if name in terms.index]
    terms = terms.loc[order]
    depth = ops.loc[order, "depth"].astype(float)
    total_depth = float(ops["depth"].max())
    kinds = ops.loc[order, "kind"]
    plannable = ops.loc[order, "plan_refusal"] == ""
    out = pd.DataFrame({("op", "kind"): kinds, ("op", "depth"): ops.loc[order, "depth"]},
                       index=order)
    for p in wanted:
        scored = plannable & kinds.map(lambda kind, p=p: kind_allows(kind, p))
        v_f = terms[(str(p), "V_f")].where(scored)
        v_b = terms[(str(p), "V_b")].where(scored)
        out[(str(p), "V_f")] = v_f
        out[(str(p), "V_b")] = v_b
        out[(str(p), "omega")] = gamma * (total_depth - depth) * v_f + depth * v_b
        out[(str(p), "fisher")] = terms[(str(p), "fisher")].where(scored)
        out[(str(p), "risk")] = out[(str(p), risk)]
    out.columns = pd.MultiIndex.from_tuples(out.columns)
    out.index.name = "op"
    return out


def _terms(stats: pd.DataFrame, p: Precision, needs_input_grad: np.ndarray):
    """Per-row forward and backward error energies at precision ``p``."""
    col = lambda name: stats[name].to_numpy(dtype=float)  # noqa: E731
    macs = col("macs")
    n_a, n_b, n_g = col("numel_a"), col("numel_b"), col("numel_g")
    s_a, s_b, s_g = col("sumsq_a"), col("sumsq_b"), col("sumsq_g")
    e_a, e_b = col(f"noise_a[{p}]"), col(f"noise_b[{p}]")
    e_g = col(f"noise_g[{DEFAULT_BACKWARD[p]}]")
    with np.errstate(divide="ignore", invalid="ignore"):
        v_f = macs / (n_a * n_b) * (e_a * s_b + e_b * s_a)
        grad_b = macs / (n_a * n_g) * (e_a * s_g + e_g * s_a)
        grad_a = np.where(needs_input_grad, macs / (n_g * n_b) * (e_g * s_b + e_b * s_g), 0.0)
    v_b = grad_a + grad_b
    embedding = (stats["kind"] == "embedding").to_numpy()
    v_f = np.where(embedding, e_b * n_g / n_b, v_f)
    v_b = np.where(embedding, e_g, v_b)
    norm = stats["kind"].isin(NORM_KINDS).to_numpy()
    if norm.any():
        q = DEFAULT_BACKWARD[p]
        nan = lambda name: (col(name) if name in stats  # noqa: E731
                            else np.full(len(stats), np.nan))
        norm_f = nan(f"noise_as[{p}]") + nan(f"noise_y[{p}]")
        norm_b = (nan(f"noise_gs[{q}]") + nan(f"noise_wgrad[{p}]")
                  + np.where(needs_input_grad,
                             nan(f"noise_dx[{q}]") + nan(f"noise_dxsaved[{p}]"), 0.0))
        v_f = np.where(norm, norm_f, v_f)
        v_b = np.where(norm, norm_b, v_b)
    return v_f, v_b
