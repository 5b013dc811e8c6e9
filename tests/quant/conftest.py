"""Shared fixtures of the runtime tests: one compute thread, SQNR, seeded tensors."""

import math

import numba
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Run torch and Numba on one thread: the tensors here are small, and on a 2-core
    machine shared with other test runs, parallel-region barriers of descheduled threads
    made these tests 10-50x slower than on one thread."""
    torch_threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    yield
    torch.set_num_threads(torch_threads)
    numba.set_num_threads(numba_threads)


def _sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """10·log10(‖ref‖² / ‖ref − out‖²) in float64; inf when they are equal."""
    ref, out = ref.detach().double().cpu(), out.detach().double().cpu()
    noise = float((ref - out).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(ref.pow(2).sum()) / noise)


@pytest.fixture
def sqnr():
    return _sqnr_db


@pytest.fixture
def randn():
    def make(*shape, seed=0, device="cpu"):
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)

    return make
