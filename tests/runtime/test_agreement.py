"""Ranks agree or nobody trains: the disagreement message, and a real 2-rank gloo group in
which one rank has another plan, so that both ranks refuse."""

import subprocess
import sys

import pytest

from qsync_lab.runtime.agreement import check_ranks_agree, disagreement

from .conftest import LAUNCH_TIMEOUT_S

RANK_SCRIPT = """
import sys
import torch.distributed as dist
from qsync_lab.errors import QSyncError
from qsync_lab.runtime.agreement import check_ranks_agree

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
check_ranks_agree({"plan": "same", "data": "same"})  # agreeing ranks pass
try:
    check_ranks_agree({"plan": f"sha256-of-plan-{rank}", "data": "same"})
except QSyncError as err:
    print(f"refused: {err}")
else:
    print("trained")
dist.destroy_process_group()
"""


def test_ranks_with_different_plans_both_refuse(tmp_path):
    store = tmp_path / "store"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), str(store)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=LAUNCH_TIMEOUT_S) for rank in ranks]
    expected = ("refused: ranks disagree before the first step: plan differs (ranks 0 vs 1); "
                "start every rank with the same plan and options\n")
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-2000:]
        assert out == expected


@pytest.mark.parametrize("gathered, message", [
    ([{"plan": "a", "model": "m"}] * 3, None),
    ([{"plan": "a"}, {"plan": "b"}], "plan differs (ranks 0 vs 1)"),
    ([{"plan": "a", "data": "x"}, {"plan": "b", "data": "x"}, {"plan": "a", "data": "y"}],
     "plan differs (ranks 0,2 vs 1), data differs (ranks 0-1 vs 2)"),
    ([{"plan": "a"}] * 5 + [{"plan": "b"}] + [{"plan": "a"}] * 2,
     "plan differs (ranks 0-4,6-7 vs 5)"),
    ([{"plan": "a", "seed": "1"}, {"plan": "a"}], "seed differs (ranks 0 vs 1)"),
])
def test_the_message_names_each_differing_field_and_its_ranks(gathered, message):
    found = disagreement(gathered)
    if message is None:
        assert found is None
        return
    assert found == (f"ranks disagree before the first step: {message}; start every rank with "
                     "the same plan and options")


def test_without_a_process_group_there_is_nothing_to_compare():
    assert check_ranks_agree({"plan": "anything"}) is None
