"""The kind sets other modules read are the policy table's, and the tracer names each
plannable module and call by the kind the table gives it."""

import torch.nn as nn

from qsync_lab.graph.kinds import function_kind, module_kind
from qsync_lab.policy import (GEMM_KINDS, NORM_KINDS, PLANNABLE_KINDS, SCORED_KINDS,
                              WEIGHTED_KINDS)


def test_the_sets_partition_the_table_as_the_kinds_compute():
    assert GEMM_KINDS == {"linear", "conv1d", "conv2d", "conv3d", "matmul"}
    assert SCORED_KINDS == GEMM_KINDS | {"embedding"}
    assert NORM_KINDS == {"batch_norm", "layer_norm", "group_norm", "rms_norm"}
    assert SCORED_KINDS | NORM_KINDS == set(PLANNABLE_KINDS)
    assert not SCORED_KINDS & NORM_KINDS
    # matmul has no weight of its own; norms' affine parameters are not re-encoded
    assert WEIGHTED_KINDS == {"linear", "conv1d", "conv2d", "conv3d", "embedding"}


def test_the_tracer_kinds_are_the_tables():
    for kind, rule in PLANNABLE_KINDS.items():
        if rule.torch_class is not None:
            cls = rule.module_class
            if cls is nn.modules.batchnorm._BatchNorm:
                cls = nn.BatchNorm2d
            args = {"linear": (4, 4), "embedding": (8, 4), "group_norm": (2, 4),
                    "layer_norm": (4,), "rms_norm": (4,), "batch_norm": (4,)}.get(kind, (4, 4, 3))
            assert module_kind(cls(*args)) == kind
        for name in rule.functions:
            assert function_kind(name) == kind
