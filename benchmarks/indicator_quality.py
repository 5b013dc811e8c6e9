"""Indicator quality: Spearman ρ of QSync's bi-directional indicator (ω), its Fisher term,
HAWQ, WVAR and random against the measured damage of quantizing one operator at a time
(KL of the predictions, gradient deviation, loss increase with its 95 % interval); plus the
indicator's speed on ResNet-50 (target: K = 10 batches of 8 in ≤ 60 s).

Models are briefly trained first, so the loss surface resembles a real run's:
* ResNet-18 on scikit-learn's digits (real data), upsampled to 3×32×32;
* a 2-layer BERT-style encoder on a synthetic token task (label: are most tokens from the
  lower half of the vocabulary);
* a 4-layer GPT-style decoder (causal SDPA, tied embedding) on next-token prediction of
  period-4 sequences with 10 % random tokens.

Calibration batches come from the training data, the truth from held-out data.

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
from qsync_lab.models.families import GPTDecoder, SequenceCrossEntropy

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


def periodic_tokens(n: int, seed: int, vocab: int = 64, period: int = 4, length: int = 32,
                    noise: float = 0.1):
    """Next-token pairs of sequences that repeat ``period`` random tokens, a ``noise``
    fraction of positions replaced by random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, period), generator=g).repeat(1, length // period + 1)
    ids = ids[:, :length + 1]
    noisy = torch.rand(ids.shape, generator=g) < noise
    ids = torch.where(noisy, torch.randint(0, vocab, ids.shape, generator=g), ids)
    return ids[:, :-1], ids[:, 1:]


def train(model, x, y, steps: int, lr: float, loss_fn: nn.Module, seed: int = 0):
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,))
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    return model


def batches(x, y, size: int, count: int):
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(count)]


def case(name: str, steps: int):
    """The trained model, its loss, 2 calibration batches of 16 (training data), 8
    held-out batches of 32 and the held-out fp32 loss."""
    torch.manual_seed(0)  # the initial weights
    loss_fn = nn.CrossEntropyLoss()
    if name == "resnet18":
        x, y, xt, yt = digits_images(rgb32=True)
        model = train(get_model("resnet18", num_classes=10), x, y, steps // 2, 1e-3, loss_fn)
    elif name == "bert":
        x, y = token_task(4096, 0)
        xt, yt = token_task(512, 1)
        model = train(get_model("bert_mini", **BERT), x, y, steps, 1e-3, loss_fn)
    else:
        x, y = periodic_tokens(4096, 0)
        xt, yt = periodic_tokens(512, 1)
        loss_fn = SequenceCrossEntropy()
        model = train(GPTDecoder(vocab=64, layers=4), x, y, 6 * steps, 3e-3, loss_fn)
    with torch.no_grad():
        model.eval()
        heldout_loss = loss_fn(model(xt), yt).item()
        model.train()
    return model, loss_fn, batches(x, y, 16, 2), batches(xt, yt, 32, 8), heldout_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hawq-samples", type=int, default=4)
    args = parser.parse_args()
    print(f"precision {args.precision}; 2 calibration batches of 16 (training data), 8 "
          f"held-out batches of 32; {args.steps} training steps (ResNet-18 half, GPT 6x)",
          flush=True)
    print("truth: kl = mean KL(p_fp32 || p_q) of the predictions; grad_deviation = "
          "sum|g_q - g|^2 / sum|g|^2 over all parameters; loss = mean(loss_q - loss_fp32)\n",
          flush=True)
    for name in ("resnet18", "bert", "gpt_decoder"):
        model, loss_fn, calibration, heldout, heldout_loss = case(name, args.steps)
        graph = trace_graph(model, calibration[0][0], target=calibration[0][1], loss_fn=loss_fn)
        start = time.perf_counter()
        report = indicator_quality(model, graph, calibration, heldout, args.precision,
                                   loss_fn=loss_fn, hawq_samples=args.hawq_samples,
                                   progress=False)
        table = report.table
        resolved = int((table["loss_increase"].abs() > table["loss_ci95"]).sum())
        print(f"== {name} (held-out loss {heldout_loss:.3f}, {time.perf_counter() - start:.0f} s)")
        print(report.correlations.round(3).to_string())
        print(f"loss increase outside its 95 % interval for {resolved} of {len(table)} ops; "
              f"median |increase| {table['loss_increase'].abs().median():.2g}, median "
              f"interval +-{table['loss_ci95'].median():.2g}\n", flush=True)
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
