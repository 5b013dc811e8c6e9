"""simulate refuses bad plans with one-line errors."""

import pytest
from tests.simulate.conftest import FAST, SLOW

from qsync_lab.costs import CostModel
from qsync_lab.errors import QSyncError
from qsync_lab.simulate import simulate


@pytest.mark.parametrize("plan, message", [
    ({SLOW: {"fc9": "fp16"}}, "unknown op 'fc9'"),
    ({FAST: {"0": "int8"}}, "V100-SXM2-32GB does not support int8"),
    ({SLOW: {"1": "fp16"}}, "op '1': activation ops follow their inputs' precision"),
    ({"A100-SXM4-80GB": {"0": "fp16"}}, "which the cluster does not have"),
    ({"B300": {"0": "fp16"}}, "unknown device 'B300'"),
    ({SLOW: {"0": "fp12"}}, "unknown precision 'fp12'"),
])
def test_bad_plans_raise_one_line_errors(graph, make_cluster, plan, message):
    with pytest.raises(QSyncError, match=message) as info:
        simulate(graph, plan, make_cluster([FAST, SLOW]), CostModel())
    assert "\n" not in str(info.value)
