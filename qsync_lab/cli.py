"""The ``qsync-lab`` command line.

Example::

    $ qsync-lab graph --model resnet18 --batch 8
    $ qsync-lab cluster qsync-paper
    $ qsync-lab demo
"""

import argparse
import sys
import time

import pandas as pd

from qsync_lab.errors import QSyncError

_OP_COLUMNS = ["kind", "output_shapes", "fwd_gflops", "bwd_gflops", "saved_mb", "depth"]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        args.run(args)
    except QSyncError as err:
        print(f"qsync-lab: error: {err}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qsync-lab", description="Plan and run quantization-minimized synchronous "
        "data-parallel training across hybrid devices.")
    sub = parser.add_subparsers(dest="command")

    graph = sub.add_parser("graph", help="trace a zoo model and print its operator table")
    graph.add_argument("--model", required=True, help="zoo model name (see `qsync-lab models`)")
    graph.add_argument("--batch", type=int, default=2, help="example batch size (default 2)")
    graph.add_argument("--rows", type=int, default=30,
                       help="operator rows to print (default 30; 0 = all)")
    graph.add_argument("--csv", help="also write the full operator table to this CSV file")
    graph.set_defaults(run=_cmd_graph)

    cluster = sub.add_parser("cluster", help="print a cluster's ranks and device summary")
    cluster.add_argument("cluster", help="a shipped cluster name or a path to a TOML file")
    cluster.set_defaults(run=_cmd_cluster)

    sub.add_parser("models", help="list the zoo models").set_defaults(run=_cmd_models)
    sub.add_parser("clusters", help="list the shipped clusters").set_defaults(run=_cmd_clusters)

    demo = sub.add_parser("demo", help="the main job on built-in defaults")
    demo.add_argument("--model", default="bert_base")
    demo.add_argument("--cluster", default="qsync-paper")
    demo.set_defaults(run=_cmd_demo)
    return parser


def _cmd_graph(args) -> None:
    graph, seconds = _trace_zoo_model(args.model, args.batch)
    _print_graph(args.model, graph, seconds, args.rows)
    if args.csv:
        _write_csv(graph.ops, args.csv)
        print(f"\nwrote {len(graph.ops)} operators to {args.csv}")


def _cmd_cluster(args) -> None:
    from qsync_lab.cluster import load_cluster

    cluster = load_cluster(args.cluster)
    print(cluster)
    print()
    print(cluster.summary().to_string())


def _cmd_models(args) -> None:
    from qsync_lab.models import list_models, model_spec

    for name in list_models():
        print(f"{name:12s} {model_spec(name).description}")


def _cmd_clusters(args) -> None:
    from qsync_lab.cluster import list_clusters, load_cluster

    for name in list_clusters():
        cluster = load_cluster(name)
        print(f"{name:14s} {cluster.world_size:3d} ranks  {', '.join(cluster.device_kinds)}")


def _cmd_demo(args) -> None:
    from qsync_lab.cluster import load_cluster
    from qsync_lab.graph import ddp_buckets

    graph, seconds = _trace_zoo_model(args.model, 2)
    _print_graph(args.model, graph, seconds, rows=12)
    buckets = ddp_buckets(graph).groupby("bucket").agg(params=("param", "size"),
                                                       mb=("bytes", "sum"))
    buckets["mb"] = buckets["mb"] / 2**20
    print(f"\nDDP gradient buckets (steady state, default 25 MiB cap): {len(buckets)}")
    print(buckets.round(2).to_string())
    cluster = load_cluster(args.cluster)
    print(f"\n{cluster}\n")
    print(cluster.summary().to_string())


def _trace_zoo_model(name: str, batch: int):
    from qsync_lab.graph import trace_graph
    from qsync_lab.models import example_batch, get_model, model_spec

    if batch < 1:
        raise QSyncError(f"--batch must be a positive integer, got {batch}")
    spec = model_spec(name)
    model = get_model(name)
    inputs, target = example_batch(name, batch)
    start = time.perf_counter()
    graph = trace_graph(model, inputs, target=target, loss_fn=spec.loss_fn())
    return graph, time.perf_counter() - start


def _print_graph(name: str, graph, seconds: float, rows: int) -> None:
    table = graph.ops.assign(
        fwd_gflops=graph.ops["fwd_flops"] / 1e9,
        bwd_gflops=(graph.ops["bwd_input_flops"] + graph.ops["bwd_weight_flops"]) / 1e9,
        saved_mb=graph.ops["saved_bytes"] / 2**20,
    )[_OP_COLUMNS]
    totals = graph.totals()
    print(f"{name}: {graph.num_ops} operators, {totals['param_count']:,} parameters, "
          f"traced with {graph.traced_with} in {seconds:.2f} s")
    shown = table if rows <= 0 else table.head(rows)
    with pd.option_context("display.width", 160, "display.max_colwidth", 40):
        print(shown.round(4).to_string())
    if len(shown) < len(table):
        print(f"... {len(table) - len(shown)} more operators (use --rows 0 to show all)")
    print("\nper operator kind:")
    print(graph.kind_summary().round(4).to_string())
    print(f"\nforward {totals['fwd_flops'] / 1e9:.3f} GFLOP, backward "
          f"{(totals['bwd_input_flops'] + totals['bwd_weight_flops']) / 1e9:.3f} GFLOP, "
          f"activations saved for backward {graph.saved_activation_bytes() / 2**20:.1f} MiB "
          f"(CUDA), parameters {totals['param_bytes'] / 2**20:.1f} MiB")


def _write_csv(frame: pd.DataFrame, path: str) -> None:
    from qsync_lab.io import atomic_write_text

    atomic_write_text(path, frame.to_csv())


if __name__ == "__main__":
    sys.exit(main())
