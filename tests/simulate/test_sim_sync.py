"""DDP's synchronisation replay: known answers for the allreduce gating and CPU delays."""

import numpy as np
import pytest

from qsync_lab.devices import load_catalog
from qsync_lab.simulate import replay_allreduces, shares_cores
from qsync_lab.simulate.sync import DdpWork


def test_gpu_classes_are_not_delayed_and_the_slowest_class_gates():
    replay = replay_allreduces([np.array([10.0, 20.0]), np.array([30.0, 60.0])], [25.0, 70.0],
                               [15.0, 15.0], [False, False])
    assert replay.begin_us.tolist() == [30.0, 60.0]
    assert replay.end_us == 75.0
    assert replay.backward_end_us == (25.0, 70.0)
    start, dur = replay.delayed(0, np.array([0.0, 10.0]), np.array([10.0, 10.0]))
    assert start.tolist() == [0.0, 10.0] and dur.tolist() == [10.0, 10.0]


def test_cpu_class_is_delayed_by_each_allreduce_from_its_start():
    # one class: buckets packed at 10 and 30, backward ends at 40, allreduces of 5
    replay = replay_allreduces([np.array([10.0, 30.0])], [40.0], [5.0, 5.0], [True])
    assert replay.begin_us.tolist() == [10.0, 35.0]  # bucket 1: 30 + the first delay
    assert replay.backward_end_us == (50.0,)
    # events [0,10) [10,20) [20,32) [32,40): the one starting at 10 waits for allreduce 0;
    # allreduce 1 starts at 35 (original 30), inside [20,32): that event lasts 5 longer
    start, dur = replay.delayed(0, np.array([0.0, 10.0, 20.0, 32.0]),
                                np.array([10.0, 10.0, 12.0, 8.0]))
    assert start.tolist() == [0.0, 15.0, 25.0, 42.0]
    assert dur.tolist() == [10.0, 10.0, 17.0, 8.0]
    ends = start + dur
    assert np.all(start[1:] >= ends[:-1])


def test_a_cpu_class_waiting_for_a_slower_class_is_delayed_only_after_the_wait():
    # the CPU class is packed at 10 but the GPU class at 50: the allreduce starts at 50,
    # after the CPU class's backward (40): nothing of it moves
    replay = replay_allreduces([np.array([10.0]), np.array([50.0])], [40.0, 55.0], [20.0],
                               [True, False])
    assert replay.begin_us.tolist() == [50.0]
    assert replay.backward_end_us == (40.0, 55.0)
    start, _ = replay.delayed(0, np.array([0.0, 20.0]), np.array([20.0, 20.0]))
    assert start.tolist() == [0.0, 20.0]


def test_only_cpu_devices_share_cores():
    catalog = load_catalog()
    assert shares_cores(catalog.device("cpu"))
    assert not shares_cores(catalog.device("T4"))


def test_a_bucket_is_complete_after_its_lowest_op_or_at_the_end_with_unused_params():
    ddp = DdpWork(None, ((4, 2), (3, None), ()), np.array([8.0, 8.0, 0.0]))
    assert [ddp.last_op(k) for k in range(3)] == [2, None, None]


@pytest.mark.parametrize("n_buckets", [0, 3])
def test_no_buckets_or_no_delay_keeps_the_events(n_buckets):
    replay = replay_allreduces([np.arange(n_buckets, dtype=float)], [10.0], [1.0] * n_buckets,
                               [False])
    start, dur = replay.delayed(0, np.array([1.0]), np.array([2.0]))
    assert (start.tolist(), dur.tolist()) == ([1.0], [2.0])
    assert replay.end_us == float(n_buckets)  # ready at 0, 1, 2; each allreduce 1 long
