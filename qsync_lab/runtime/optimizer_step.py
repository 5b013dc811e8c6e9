"""The end of a training step, after the backward: loss scaling, the finite check, the step.

The trainer and ``benchmarks/gpu_training.py`` end their steps with these, so a benchmark
times what a run does.

* :func:`loss_scaler`: fp16 gradients on a GPU underflow without loss scaling, so a model
  with fp16 backward ops on CUDA gets torch's ``GradScaler`` (the CPU emulation keeps its
  exact numerics: a disabled scaler);
* :func:`first_nonfinite_gradient`: the first parameter whose gradient holds NaN or Inf;
* :func:`finish_step`: unscale, check, step. With a scaler, a step whose gradients
  overflowed (a finite loss) is skipped by the scaler, which halves its scale, and is no
  finding; otherwise the optimizer steps only when every gradient is finite.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    >>> loss = layer(torch.ones(1, 2)).sum()
    >>> loss.backward()
    >>> finish_step(loss, optimizer, loss_scaler(layer, cuda=False), layer) is None
    True
"""

import math

import torch
from torch import nn

from qsync_lab.optimizers import gradient_sums_finite
from qsync_lab.quant import describe_precisions

__all__ = ["finish_step", "first_nonfinite_gradient", "loss_scaler", "needs_loss_scaling"]


def needs_loss_scaling(model: nn.Module, *, cuda: bool) -> bool:
    """Whether ``model`` (planned) computes fp16 gradients on CUDA."""
    return bool(cuda and (describe_precisions(model)["backward"] == "fp16").any())


def loss_scaler(model: nn.Module, *, cuda: bool) -> torch.amp.GradScaler:
    """A ``GradScaler``, enabled where :func:`needs_loss_scaling`."""
    return torch.amp.GradScaler("cuda", enabled=needs_loss_scaling(model, cuda=cuda))


def first_nonfinite_gradient(model: nn.Module) -> str | None:
    """The first parameter (in module order) whose gradient holds NaN or Inf, or None.

    A NaN or Inf makes its gradient's sum non-finite, so the sums (one cheap pass, much
    cheaper on the CPU than a max) clear a finite step; only then is each gradient looked
    at (a sum that merely overflowed is no finding)."""
    named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    if gradient_sums_finite([g for _, g in named]):
        return None
    return next((name for name, g in named if not bool(torch.isfinite(g).all())), None)


def finish_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler, model: nn.Module) -> str | None:
    """Unscale, check and step (see the module docstring); the first parameter with a
    non-finite gradient the run must hear of, else None."""
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    nonfinite = first_nonfinite_gradient(model)
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
        if nonfinite is not None and math.isfinite(float(loss.detach())):
            return None  # an overflow: the scale halves, the run goes on
    elif nonfinite is None:
        optimizer.step()
    return nonfinite
