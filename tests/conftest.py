"""Shared test set-up.

* CUDA kernels run in Numba's CUDA simulator unless the run asks for a real GPU
  (``--gpu``). The variable must be set before numba is first imported; the README's
  test command sets it, and this file sets it too for a bare ``pytest``.
* Tests marked ``gpu`` need a real CUDA device and run only with ``--gpu``.
* ``fake_cuda`` (:mod:`tests.fake_cuda`): a fake CUDA clock for event timers on the CPU.
* The cache of measured model profiles (``QSYNC_LAB_CACHE``) is a fresh folder per
  session, so no test reads what an earlier run measured (spawned ranks inherit it).
"""

import os
import sys
import tempfile

import pytest

pytest_plugins = ["tests.fake_cuda"]

os.environ.setdefault("QSYNC_LAB_CACHE", tempfile.mkdtemp(prefix="qsync_lab_cache_"))
if "--gpu" not in sys.argv:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    if "numba" in sys.modules:  # imported early by a plugin: make it see the variable
        import numba.core.config

        numba.core.config.reload_config()


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run tests that need a real CUDA GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a real CUDA GPU; runs only with --gpu")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU: run with --gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def graph():
    """A traced MLP (Linear 8->16, ReLU, Linear 16->4) at batch 2: the plan tests' graph."""
    import torch
    from torch import nn

    from qsync_lab.graph import trace_graph

    torch.manual_seed(0)
    return trace_graph(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                       torch.randn(2, 8))
