"""Indicator quality (issue #6): Spearman ρ of QSync's bi-directional indicator, HAWQ, WVAR
and random against the measured damage of quantizing one operator at a time; plus the
indicator's speed on ResNet-50 (target: K = 10 batches of 8 in ≤ 60 s).

Models are briefly trained first, so the loss surface resembles a real run's:
* digits CNN on scikit-learn's digits (real data);
* ResNet-18 on the same digits, upsampled to 3×32×32;
* a 2-layer BERT-style encoder on a synthetic token task (label: are most tokens from the
  lower half of the vocabulary).

Run: ``.venv/bin/python benchmarks/indicator_quality.py [--precision int8] [--steps 100]``
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from qsync_lab.datasets import load_digits_split
from qsync_lab.graph import trace_graph
from qsync_lab.indicator import indicator
from qsync_lab.indicator.quality import indicator_quality
from qsync_lab.models import example_batch, get_model, model_spec

BERT = dict(num_layers=2, hidden=128, heads=4, intermediate=256, vocab_size=100,
            max_positions=32, num_labels=2)


def digits_images(rgb32: bool):
    x_train, y_train, x_test, y_test = load_digits_split(seed=0)
    if rgb32:
        up = lambda x: F.interpolate(x, size=32, mode="bilinear").repeat(1, 3, 1, 1)  # noqa: E731
        x_train, x_test = up(x_train), up(x_test)
    return x_train, y_train, x_test, y_test


def token_task(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, BERT["vocab_size"], (n, 16), generator=g)
    return ids, ((ids < BERT["vocab_size"] // 2).sum(1) > 8).long()


def train(model, x, y, steps: int, lr: float, seed: int = 0):
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,))
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    return model


def batches(x, y, size: int, count: int, start: int = 0):
    return [(x[start + i * size:start + (i + 1) * size], y[start + i * size:start + (i + 1) * size])
            for i in range(count)]


def case(name: str, steps: int):
    if name == "digits_cnn":
        x, y, xt, yt = digits_images(rgb32=False)
        model = train(get_model("digits_cnn"), x, y, steps, 3e-3)
    elif name == "resnet18":
        x, y, xt, yt = digits_images(rgb32=True)
        model = train(get_model("resnet18", num_classes=10), x, y, steps // 2, 1e-3)
    else:
        x, y = token_task(4096, 0)
        xt, yt = token_task(512, 1)
        model = train(get_model("bert_mini", **BERT), x, y, steps, 1e-3)
    with torch.no_grad():
        model.eval()
        accuracy = (model(xt).argmax(1) == yt).float().mean().item()
        model.train()
    return model, batches(xt, yt, 16, 2), batches(xt, yt, 16, 4, start=64), accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hawq-samples", type=int, default=4)
    args = parser.parse_args()
    loss_fn = nn.CrossEntropyLoss()
    print(f"precision {args.precision}; 2 calibration + 4 held-out batches of 16; "
          f"{args.steps} training steps", flush=True)
    print("truth: loss_increase = mean(loss_q - loss_fp32), grad_deviation = "
          "sum|g_q - g|^2 / sum|g|^2 over all parameters\n", flush=True)
    for name in ("digits_cnn", "resnet18", "bert"):
        model, calibration, heldout, accuracy = case(name, args.steps)
        graph = trace_graph(model, calibration[0][0], target=calibration[0][1], loss_fn=loss_fn)
        start = time.perf_counter()
        report = indicator_quality(model, graph, calibration, heldout, args.precision,
                                   loss_fn=loss_fn, hawq_samples=args.hawq_samples,
                                   progress=False)
        print(f"== {name} (test accuracy {accuracy:.3f}, {time.perf_counter() - start:.0f} s)")
        print(report.correlations.round(3).to_string())
        print(flush=True)
    resnet50_speed()


def resnet50_speed() -> None:
    name = "resnet50"
    model = get_model(name)
    calibration = [example_batch(name, 8, seed=s) for s in range(10)]
    loss_fn = model_spec(name).loss_fn()
    graph = trace_graph(model, calibration[0][0], target=calibration[0][1], loss_fn=loss_fn)
    start = time.perf_counter()
    indicator(model, graph, calibration, loss_fn=loss_fn, progress=False)
    seconds = time.perf_counter() - start
    verdict = "ok" if seconds <= 60 else "SLOW"
    print(f"speed: ResNet-50 indicator, K = 10 batches of 8 at 224x224, all precisions: "
          f"{seconds:.1f} s (target <= 60 s: {verdict})")


if __name__ == "__main__":
    main()
