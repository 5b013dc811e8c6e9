"""``torchrun … -m qsync_lab.runtime --plan plan.json``: train a plan on every rank.

See :mod:`qsync_lab.runtime.trainer`; ``python -m qsync_lab.runtime --help`` lists the
options. ``qsync-lab run`` launches torchrun with this entry for you
(:mod:`qsync_lab.runtime.launch`).
"""

import os
import sys

from qsync_lab.runtime.options import config_from_args, runtime_parser


def main(argv: list[str] | None = None) -> int:
    """Parse, set thread counts (before numba loads), train; errors (a non-finite loss or
    gradient under ``--on-nonfinite stop`` among them) are one line, exit 2."""
    from qsync_lab.errors import QSyncError

    try:
        args = runtime_parser().parse_args(argv)
        config = config_from_args(args)
    except QSyncError as err:
        print(f"qsync_lab.runtime: error: {err}", file=sys.stderr)
        return 2
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_world)
    # the int8 kernels' Numba pool must be sized before numba is imported:
    # numba.set_num_threads in a torchrun worker aborts at exit beside gloo
    # (an explicit --threads sizes it too, over an inherited NUMBA_NUM_THREADS: two Numba
    # threads per rank on two cores made a local run 2-3x slower than its prediction)
    if args.threads:
        os.environ["NUMBA_NUM_THREADS"] = str(threads)
    else:
        os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
    import torch

    from qsync_lab.runtime.trainer import train

    torch.set_num_threads(threads)
    try:
        summary = train(config)
    except QSyncError as err:
        print(f"qsync_lab.runtime: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if summary is not None:  # None: another rank, or a run that was already complete
        from qsync_lab.runtime.metrics import summary_line

        print(f"{summary_line(summary)}; wrote {config.run_dir}/summary.json")
    return 0


if __name__ == "__main__":
    from qsync_lab.runtime.rank_exit import exit_rank

    exit_rank(main())
