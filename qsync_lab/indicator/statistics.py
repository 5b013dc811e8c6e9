"""Per-operator statistics for the indicator, gathered with hooks over calibration batches.

For every call of a scorable operator (linear, conv, matmul, embedding) and every batch,
:func:`collect_statistics` records one row: multiply-adds ``macs``; element counts
``numel_a`` (first operand: the activation input), ``numel_b`` (second operand: the weight,
or the second activation of a matmul) and ``numel_g`` (the output gradient); squared norms
``sumsq_a/b/g``; the squared norm of the weight gradient ``sumsq_wgrad``; and the expected
rounding-noise energy of each operand per precision, ``noise_a[p]``, ``noise_b[p]``,
``noise_g[p]`` (see :mod:`qsync_lab.indicator.formats`).

The model runs in fp32, forward and backward, with no optimizer step; its parameters,
buffers, gradients and train/eval flags are left exactly as they were, and the global RNG
state too (dropout draws come from ``seed``).
"""

from collections.abc import Iterable, Sequence

import pandas as pd
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from qsync_lab.errors import QSyncError
from qsync_lab.graph.kinds import module_kind
from qsync_lab.indicator.formats import BACKWARD_PRECISION, operand_noise
from qsync_lab.modelstate import preserved_state
from qsync_lab.precision import Precision

SCORED_KINDS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "matmul", "embedding"})


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
    grad_formats = sorted({BACKWARD_PRECISION[p] for p in wanted}, key=list(Precision).index)
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
        handles = []
        for fqn, module in self.model.named_modules():
            kind = module_kind(module)
            if kind in SCORED_KINDS:
                handles.append(module.register_forward_hook(
                    lambda m, args, out, fqn=fqn, kind=kind: self._forward(fqn, kind, m, args,
                                                                           out)))
        if not handles:
            raise QSyncError(f"{type(self.model).__name__} has no linear, conv, matmul or "
                             "embedding modules to score")
        return handles

    def run_batch(self, inputs, target, loss_fn, batch: int) -> list[dict]:
        self.calls.clear()
        self.rows = []
        for p in self.model.parameters():
            p.grad = None
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        loss = loss_fn(self.model(*inputs), target)
        if not torch.isfinite(loss):
            raise QSyncError(f"calibration batch {batch} gives a non-finite loss ({loss.item()});"
                             " check the data and the model")
        loss.backward()
        for row in self.rows:
            row["batch"] = batch
            module = row.pop("_module")
            row["sumsq_wgrad"] = sum(_sumsq(p.grad) for p in module.parameters()
                                     if p.grad is not None)
        return self.rows

    def _forward(self, fqn, kind, module, args, out) -> None:
        count = self.calls.get(fqn, 0)
        self.calls[fqn] = count + 1
        name = fqn if count == 0 else f"{fqn}@{count}"
        with torch.no_grad():
            a, b = _operands(kind, module, args)
            row = {"op": name, "kind": kind, "macs": _macs(kind, a, b, out),
                   "numel_a": a.numel(), "numel_b": b.numel(), "numel_g": out.numel(),
                   "_module": module}
            if kind == "embedding":  # indices are not rounded
                row.update({"sumsq_a": 0.0}, **{f"noise_a[{p}]": 0.0 for p in self.precisions})
            else:
                row.update(self._operand_stats("a", a))
            if kind == "matmul":
                row.update(self._operand_stats("b", b))
            else:
                if fqn not in self.weight_stats:
                    self.weight_stats[fqn] = self._operand_stats("b", b)
                row.update(self.weight_stats[fqn])
        self.rows.append(row)
        if out.requires_grad:
            out.register_hook(lambda g, row=row: self._backward(row, g))

    def _backward(self, row: dict, grad: torch.Tensor) -> None:
        with torch.no_grad():
            row.update(_stats("g", grad, self.grad_formats, "nearest"))

    def _operand_stats(self, role: str, t: torch.Tensor) -> dict[str, float]:
        return _stats(role, t, self.precisions, self.rounding)


def _operands(kind: str, module: nn.Module, args) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "matmul":
        return args[0], args[1]
    return args[0], module.weight


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
