"""``torchrun … -m qsync_lab.runtime --plan plan.json``: train a plan on every rank.

See :mod:`qsync_lab.runtime.trainer`; ``python -m qsync_lab.runtime --help`` lists the
options. ``qsync-lab run`` launches torchrun with this entry for you.
"""

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qsync_lab.runtime",
                                     description="Train a qsync_lab plan on this rank "
                                     "(start it with torchrun or `qsync-lab run`).")
    parser.add_argument("--plan", required=True, help="plan JSON (qsync-lab plan --out)")
    parser.add_argument("--run-dir", default="qsync_run",
                        help="metrics, checkpoints and summary go here (default qsync_run)")
    parser.add_argument("--model", help="zoo model (default: the plan's)")
    parser.add_argument("--model-kwargs", help="JSON dict of the model's keyword arguments")
    parser.add_argument("--data", help="bundled task: digits, mnist1d, tokens, synthetic "
                        "(default: the model's)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--optimizer", choices=["sgd", "sgd_momentum", "adam", "adamw"],
                        help="default: the plan's (its memory prediction counts it)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9, help="sgd_momentum's (0.9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--resume", action="store_true",
                        help="continue from --run-dir's checkpoint when there is one")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True)")
    parser.add_argument("--warmup-steps", type=int,
                        help="steps left out of the step-time median (default: the first "
                        "fifth, at least 3)")
    parser.add_argument("--profile", action="append", default=[], metavar="CSV",
                        help="measured profile(s) for the prediction (default: shipped cpu.csv)")
    parser.add_argument("--threads", type=int,
                        help="intra-op threads per rank (default: cores / local ranks)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse, set thread counts (before numba loads), train; errors are one line, exit 2."""
    args = _parser().parse_args(argv)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_world)
    # the int8 kernels' Numba pool must be sized before numba is imported:
    # numba.set_num_threads in a torchrun worker aborts at exit beside gloo
    os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
    import torch

    from qsync_lab.errors import QSyncError
    from qsync_lab.runtime.trainer import TrainConfig, train

    torch.set_num_threads(threads)
    try:
        kwargs = json.loads(args.model_kwargs) if args.model_kwargs else None
        config = TrainConfig(
            plan=args.plan, run_dir=args.run_dir, model=args.model, model_kwargs=kwargs,
            data=args.data, steps=args.steps, optimizer=args.optimizer, lr=args.lr,
            momentum=args.momentum,
            seed=args.seed, checkpoint_every=args.checkpoint_every, resume=args.resume,
            deterministic=args.deterministic, warmup_steps=args.warmup_steps,
            profiles=tuple(args.profile))
        summary = train(config)
    except (QSyncError, json.JSONDecodeError) as err:
        print(f"qsync_lab.runtime: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if summary is not None:
        print(f"test accuracy {summary['test_accuracy']:.4f}; step time measured "
              f"{summary['measured_step_ms']:.2f} ms, predicted {summary['predicted_step_ms']:.2f}"
              f" ms ({summary['step_error_pct']:+.1f} %); wrote {args.run_dir}/summary.json")
    return 0


if __name__ == "__main__":
    status = main()
    # Everything is written (atomically) and the process group destroyed by now. Skip the
    # interpreter's teardown: destroying gloo's and OpenMP's thread pools in static
    # destructors intermittently aborts a finished worker ("terminate called without an
    # active exception", exit -6), which torchrun reports as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
