"""One rank of a user-model run, as a user's own training script would be: a model of
:mod:`qsync_lab.models.families` (or a library model, :mod:`qsync_lab.models.library`) and
random data, trained by ``qsync_lab.runtime.train``.

Run under torchrun (``benchmarks/user_models.py`` does)::

    torchrun --standalone --nproc-per-node=2 benchmarks/train_family.py \\
        --family gpt_decoder --plan plan.json --run-dir run --steps 100
"""

import argparse

from qsync_lab.models.families import FAMILIES, family, family_batch, family_model
from qsync_lab.models.library import LIBRARY
from qsync_lab.runtime.rank_exit import exit_rank
from qsync_lab.runtime.tasks import Task
from qsync_lab.runtime.trainer import TrainConfig, train

TRAIN_SAMPLES, TEST_SAMPLES = 1024, 256


def family_task(name: str) -> Task:
    """Random data for the family ``name`` (the same on every rank)."""
    train_inputs, train_target = family_batch(name, TRAIN_SAMPLES, seed=0)
    test_inputs, test_target = family_batch(name, TEST_SAMPLES, seed=1)
    return Task(name, "", lambda: family_model(name), train_inputs, train_target,
                test_inputs, test_target, loss_fn=family(name).loss_fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted([*FAMILIES, *LIBRARY]), required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    train(TrainConfig(args.plan, args.run_dir, steps=args.steps, checkpoint_every=0,
                      warmup_steps=args.steps // 5), task=family_task(args.family))
    exit_rank()


if __name__ == "__main__":
    main()
