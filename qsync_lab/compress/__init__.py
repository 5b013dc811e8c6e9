"""Compressed gradient communication: DDP comm hooks for fp16/bf16, Global-QSGD, APS, CGX, QSGD.

``register_compression(ddp_model, "global_qsgd:8")`` (or a mapping from parameter FQN
patterns to specs) attaches the hook; a plan's compression section does it for a run
(``qsync-lab plan --compress global_qsgd:8``), and the simulator costs it.

=============  =====================================  =========  =================
method         scale                                  unbiased   collective
=============  =====================================  =========  =================
fp16, bf16     none (divided by the world size)       no         allreduce
global_qsgd    one per bucket, shared (MAX)           yes        allreduce of ints
aps            one power of two per parameter, shared no         all-gather of fp8
cgx            per group of values, local (max-min)   stochastic all-gather
qsgd           L2 norm per bucket, local              yes        all-gather
=============  =====================================  =========  =================

Biased methods take ``error_feedback=True``. Each method is one :class:`Method` in
:data:`METHODS` (:mod:`qsync_lab.compress.methods`), which specs, the hook and the simulator
all read. Example::

    >>> from qsync_lab.compress import METHODS, CompressionSpec
    >>> str(CompressionSpec.parse("cgx:4")), CompressionSpec.parse("cgx:4").group_size
    ('cgx:4', 1024)
    >>> list(METHODS)
    ['fp16', 'bf16', 'global_qsgd', 'aps', 'cgx', 'qsgd']
"""

from qsync_lab.compress.methods import METHODS, Method
from qsync_lab.compress.spec import CompressionSettings, CompressionSpec

__all__ = ["METHODS", "CompressionSettings", "CompressionSpec", "CompressionState", "Method",
           "NonFiniteGradient", "register_compression"]


_LAZY = {"CompressionState": "hook", "register_compression": "hook",
         "NonFiniteGradient": "codec"}


def __getattr__(name: str):  # the hooks need torch and the kernels: loaded on first use
    if name not in _LAZY:
        raise AttributeError(f"module 'qsync_lab.compress' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"qsync_lab.compress.{_LAZY[name]}"), name)
