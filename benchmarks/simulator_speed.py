"""Speed of the DDP timeline simulator on BERT-base.

Run: ``.venv/bin/python benchmarks/simulator_speed.py [--repeats 20]``

1. BERT-base (traced once at batch 2) on the 32-rank ``qsync-paper`` cluster (16 V100 +
   16 T4, batch 32 per rank) with the T4s running every linear in fp16: median ms per
   ``simulate`` call, from the graph (``cold``: derives per-op arrays and DDP buckets
   each call) and from ``prepare_graph``'s result (``prepared``). Target: <= 50 ms.
2. The same plan on synthetic clusters of 2 .. 1024 ranks (half V100, half T4, 8 GPUs per
   node, 100 GbE between nodes): median ms per call and ms per rank, to show the cost
   grows at most linearly with the ranks.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from qsync_lab.cluster import load_cluster
from qsync_lab.costs import CostModel
from qsync_lab.graph import trace_graph
from qsync_lab.models import example_batch, get_model, model_spec
from qsync_lab.simulate import prepare_graph, simulate

RANK_COUNTS = (2, 8, 32, 128, 512, 1024)
GPUS_PER_NODE = 8
TARGET_MS = 50.0


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _synthetic_cluster(ranks: int, folder: Path):
    """Half V100 (NVLink nodes), half T4 (PCIe nodes), 8 per node, batch 32."""
    lines = [f'name = "synthetic-{ranks}"', "batch_size = 32", 'inter_node_link = "eth_100g"']
    for device, link, count in (("V100-SXM2-32GB", "nvlink2", ranks // 2),
                                ("T4", "pcie3_x16", ranks - ranks // 2)):
        for node in range(0, count, GPUS_PER_NODE):
            lines += ["", "[[node]]", f'name = "{device.lower()}-{node // GPUS_PER_NODE}"',
                      f'intra_node_link = "{link}"',
                      f'devices = [{{ kind = "{device}", count = {min(GPUS_PER_NODE, count - node)} }}]']
    path = folder / f"synthetic-{ranks}.toml"
    path.write_text("\n".join(lines) + "\n")
    return load_cluster(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case")
    args = parser.parse_args()

    start = time.perf_counter()
    inputs, target = example_batch("bert_base", 2)
    graph = trace_graph(get_model("bert_base"), inputs, target=target,
                        loss_fn=model_spec("bert_base").loss_fn())
    print(f"traced bert_base ({len(graph.ops)} ops) in {time.perf_counter() - start:.2f} s")
    plan = {"T4": {op: "fp16" for op, kind in graph.ops["kind"].items() if kind == "linear"}}
    costs = CostModel()
    prepared = prepare_graph(graph)

    paper = load_cluster("qsync-paper")
    sim = simulate(prepared, plan, paper, costs)
    cold_ms = _median_ms(lambda: simulate(graph, plan, paper, costs), args.repeats)
    warm_ms = _median_ms(lambda: simulate(prepared, plan, paper, costs), args.repeats)
    print(f"\nqsync-paper (32 ranks), T4 linears in fp16: iteration {sim.iteration_us / 1e3:.1f} ms "
          f"simulated, {sim.throughput_samples_per_s:.0f} samples/s")
    print(f"  simulate(graph)    median {cold_ms:6.2f} ms per call "
          f"({'meets' if cold_ms <= TARGET_MS else 'MISSES'} the {TARGET_MS:g} ms target)")
    print(f"  simulate(prepared) median {warm_ms:6.2f} ms per call")

    print(f"\n{'ranks':>6} {'ms/call':>9} {'ms/rank':>9} {'iteration ms':>13}")
    with tempfile.TemporaryDirectory() as folder:
        for ranks in RANK_COUNTS:
            cluster = _synthetic_cluster(ranks, Path(folder))
            ms = _median_ms(lambda: simulate(prepared, plan, cluster, costs), args.repeats)
            iteration_ms = simulate(prepared, plan, cluster, costs).iteration_us / 1e3
            print(f"{ranks:>6} {ms:>9.2f} {ms / ranks:>9.4f} {iteration_ms:>13.1f}")


if __name__ == "__main__":
    main()
