"""Tracing time per zoo model (issue #2 target: BERT-base and ResNet-50 each < 2 s).

Traces each model with its loss on its example batch (full-size inputs: 224×224 images,
BERT sequences of 128 tokens), after one warm-up trace, and prints the median of the
repeats beside the target.

Run: ``.venv/bin/python benchmarks/graph.py [--repeats 5] [--batch 2]``
"""

import argparse
import statistics
import time

import torch

from qsync_lab.graph import trace_graph
from qsync_lab.models import example_batch, get_model, list_models, model_spec

TARGET_S = 2.0
TARGET_MODELS = ("bert_base", "resnet50")


def time_trace(name: str, batch: int, repeats: int) -> tuple[float, float, object]:
    model = get_model(name)
    inputs, target = example_batch(name, batch)
    loss_fn = model_spec(name).loss_fn()
    trace_graph(model, inputs, target=target, loss_fn=loss_fn)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        graph = trace_graph(model, inputs, target=target, loss_fn=loss_fn)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), min(seconds), graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"median of {args.repeats} traces after a warm-up\n")
    header = f"{'model':10s} {'ops':>5s} {'params':>13s} {'fwd GFLOP':>10s} " \
             f"{'median s':>9s} {'min s':>7s} {'target':>8s}"
    print(header)
    print("-" * len(header))
    for name in list_models():
        median, fastest, graph = time_trace(name, args.batch, args.repeats)
        totals = graph.totals()
        verdict = ("ok" if median < TARGET_S else "SLOW") if name in TARGET_MODELS else ""
        print(f"{name:10s} {graph.num_ops:5d} {totals['param_count']:13,d} "
              f"{totals['fwd_flops'] / 1e9:10.2f} {median:9.3f} {fastest:7.3f} "
              f"{verdict:>8s}")
    print(f"\ntarget: {', '.join(TARGET_MODELS)} trace in < {TARGET_S:.0f} s each")


if __name__ == "__main__":
    main()
