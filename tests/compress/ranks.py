"""Run a function on several ranks (gloo unless asked) in spawned processes and collect what
they return."""

import multiprocessing
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist

TIMEOUT_S = 300


def run_ranks(fn, world: int, *args, backend: str = "gloo"):
    """``fn(rank, world, *args)`` on ``world`` spawned ranks of ``backend`` (one thread each);
    the ranks' results in rank order. A rank's exception fails the call with its traceback."""
    context = multiprocessing.get_context("spawn")
    init = f"file://{tempfile.mktemp(prefix='qsync-ranks-')}"
    results = context.Queue()
    workers = [context.Process(target=_worker, args=(fn, rank, world, init, results, args, backend),
                               daemon=True) for rank in range(world)]
    for worker in workers:
        worker.start()
    out: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=TIMEOUT_S)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    except queue.Empty:
        raise AssertionError(f"the ranks did not finish in {TIMEOUT_S} s") from None
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    return [out[rank] for rank in range(world)]


def _worker(fn, rank, world, init, results, args, backend):
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
