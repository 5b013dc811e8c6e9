"""The ``qsync-lab`` argument parser: one subcommand per job, each bound to its body in
:mod:`qsync_lab.cli.commands` (or :mod:`qsync_lab.cli.lab`) as ``args.run``.

Example::

    >>> args = build_parser().parse_args(["graph", "--model", "resnet18"])
    >>> args.batch, args.run.__name__
    (2, 'graph_command')
"""

import argparse
from pathlib import Path

from qsync_lab.cli import commands
from qsync_lab.cli.lab import LAB_KERNEL_IDLE_S, LAB_NOTEBOOK, LAB_PORT, lab_command
from qsync_lab.optimizers import OPTIMIZER_STATES
from qsync_lab.runtime.options import runtime_parser

__all__ = ["build_parser"]


class _Parser(argparse.ArgumentParser):
    """Usage mistakes as one line (``qsync-lab: error: ...``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"qsync-lab: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``qsync-lab`` command (``args.command`` is None without one)."""
    parser = _Parser(
        prog="qsync-lab", description="Plan and run quantization-minimized synchronous "
        "data-parallel training across hybrid devices.")
    sub = parser.add_subparsers(dest="command")

    graph = sub.add_parser("graph", help="trace a zoo model and print its operator table")
    graph.add_argument("--model", required=True, help="zoo model name (see `qsync-lab models`)")
    graph.add_argument("--batch", type=int, default=2, help="example batch size (default 2)")
    graph.add_argument("--rows", type=int, default=30,
                       help="operator rows to print (default 30; 0 = all)")
    graph.add_argument("--csv", help="also write the full operator table to this CSV file")
    graph.set_defaults(run=commands.graph_command)

    cluster = sub.add_parser("cluster", help="print a cluster's ranks and device summary")
    cluster.add_argument("cluster", help="a shipped cluster name or a path to a TOML file")
    cluster.set_defaults(run=commands.cluster_command)

    sub.add_parser("models", help="list the zoo models").set_defaults(
        run=commands.models_command)
    sub.add_parser("clusters", help="list the shipped clusters").set_defaults(
        run=commands.clusters_command)

    _add_profile_parser(sub)
    _add_plan_parser(sub)
    _add_simulate_parser(sub)
    _add_report_parser(sub)
    _add_lab_parser(sub)
    _add_run_parser(sub)

    demo = sub.add_parser("demo", help="the main job on built-in defaults")
    demo.add_argument("--model", default="bert_base",
                      help="zoo model of the paper-scale plans (default bert_base; the local "
                      "run trains bert_mini)")
    demo.add_argument("--cluster", default="qsync-paper",
                      help="cluster of the paper-scale plans (default qsync-paper)")
    demo.add_argument("--out", default="qsync_demo",
                      help="folder for plans, traces, the profile and the run "
                      "(default ./qsync_demo)")
    demo.add_argument("--steps", type=int, default=30,
                      help="training steps of the local run (default 30)")
    demo.set_defaults(run=commands.demo_command)
    return parser


def _add_profile_parser(sub) -> None:
    profile = sub.add_parser("profile", help="measure this machine: op times per precision, "
                             "casts and gloo allreduces, written as a profile table")
    profile.add_argument("--model", action="append", required=True,
                         help="zoo model to profile (repeatable)")
    profile.add_argument("--batch", type=int, default=16, help="per-rank batch size (16)")
    profile.add_argument("--precisions", default="fp32,bf16,int8",
                         help="comma-separated precisions (default fp32,bf16,int8)")
    profile.add_argument("--threads", type=int, default=1,
                         help="threads per op (= the cores one DDP rank will have; default 1)")
    profile.add_argument("--repeats", type=int, default=10,
                         help="timed repeats (median; default 10)")
    profile.add_argument("--processes", type=int, default=1,
                         help="profile in N processes at once, as N local DDP ranks run "
                         "(they share caches and memory bandwidth; default 1)")
    profile.add_argument("--method", default="in_step", choices=["in_step", "isolated"],
                         help="time ops inside training steps (in_step) or one at a time")
    profile.add_argument("--links", default="ddp", choices=("ddp", "allreduce", "none"),
                         help="fit the allreduce link to real DDP steps of calibration MLPs "
                         "(ddp, the default: about a minute), to the allreduce "
                         "microbenchmark (allreduce), or not at all (none)")
    profile.add_argument("--compress", nargs="*", metavar="SPEC",
                         help="also time gradient compressors' encode and decode through "
                         "the hook: these specs (e.g. global_qsgd:8 cgx:4,error_feedback=true)"
                         ", or without a spec the defaults")
    profile.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                         help="where the ops run: this CPU (default), or this machine's GPU, "
                         "timed with CUDA events, its rows named after its catalog kind "
                         "(links are then not profiled; compressors with --compress are, on the GPU)")
    profile.add_argument("--optimizer", default="sgd_momentum", choices=list(OPTIMIZER_STATES),
                         help="with --device cuda and one --model: the optimizer of the model's "
                         "own steps, timed under a uniform plan of each precision to calibrate "
                         "what its rows miss (default sgd_momentum)")
    profile.add_argument("--out", required=True, help="profile CSV to write")
    profile.set_defaults(run=commands.profile_command)


def _add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="allocate a quantization-minimized plan for a zoo model")
    plan.add_argument("--model", required=True, help="zoo model name (see `qsync-lab models`)")
    plan.add_argument("--cluster", default="qsync-paper",
                      help="a shipped cluster name or a path to a TOML file")
    plan.add_argument("--memory-gb", action="append", default=[], metavar="KIND=GIB",
                      help="per-rank memory budget of a device kind (repeatable)")
    plan.add_argument("--throughput", type=float, help="least samples/s (default: the fastest "
                      "kind at fp32 sets the pace)")
    plan.add_argument("--strategy", default="qsync",
                      help="qsync (default), uniform-low, dynamic-batching, joint or fp32")
    plan.add_argument("--optimizer", default="sgd_momentum", choices=list(OPTIMIZER_STATES),
                      help="what the run will train with (its state counts in memory)")
    plan.add_argument("--compress", metavar="SPEC",
                      help="compress gradient communication, e.g. global_qsgd:8, cgx:4, aps, "
                      "qsgd:8, fp16 (the allocation costs it; the run registers it)")
    _add_calibration_option(plan)
    _add_profile_option(plan)
    plan.add_argument("--out", required=True, help="write the plan JSON here")
    plan.set_defaults(run=commands.plan_command)


def _add_profile_option(parser) -> None:
    parser.add_argument("--profile", action="append", default=[], metavar="CSV",
                        help="measured profile table(s) overriding the roofline")


def _add_calibration_option(parser) -> None:
    parser.add_argument("--calibration-batches", type=int, default=2,
                        help="batches for the sensitivity indicator (default 2)")


def _add_simulate_parser(sub) -> None:
    simulate = sub.add_parser("simulate", help="simulate one DDP iteration of a plan, or of a "
                              "zoo model under a uniform precision")
    simulate.add_argument("--plan", help="plan JSON (qsync-lab plan --out): its model, cluster, "
                          "batches and optimizer")
    simulate.add_argument("--model", help="zoo model name (default: the plan's)")
    simulate.add_argument("--cluster", help="a shipped cluster name or a TOML path (default: "
                          "the plan's, else qsync-paper)")
    simulate.add_argument("--batch", type=int, default=2, help="batch size to trace the model "
                          "at (ranks run their cluster batch sizes; default 2)")
    simulate.add_argument("--uniform", action="append", default=[], metavar="DEVICE=PRECISION",
                          help="without --plan: run every linear and conv op of DEVICE in "
                          "PRECISION, e.g. T4=fp16 (repeatable)")
    _add_profile_option(simulate)
    simulate.add_argument("--optimizer", choices=list(OPTIMIZER_STATES),
                          help="default: the plan's, else sgd_momentum")
    simulate.add_argument("--compress", metavar="SPEC",
                          help="gradient compression, e.g. global_qsgd:8 (default: the plan's, "
                          "else none)")
    simulate.add_argument("--trace", help="write the Chrome/Perfetto trace JSON here")
    simulate.set_defaults(run=commands.simulate_command)


def _add_report_parser(sub) -> None:
    report = sub.add_parser("report", help="write a plan's report: one self-contained HTML "
                            "file with its summary, the strategies compared and the figures")
    report.add_argument("--plan", required=True, help="plan JSON (qsync-lab plan --out)")
    report.add_argument("--out", required=True, help="HTML file to write")
    _add_calibration_option(report)
    _add_profile_option(report)
    report.set_defaults(run=commands.report_command)


def _add_lab_parser(sub) -> None:
    lab = sub.add_parser("lab", help="serve the plan tuner as an app (Voila) on 127.0.0.1, "
                         "behind a fresh token; prints its URL")
    lab.add_argument("--port", type=int, default=LAB_PORT, help=f"port (default {LAB_PORT})")
    lab.add_argument("--model", default="resnet18", help="zoo model to plan (resnet18)")
    lab.add_argument("--cluster", default="local-hybrid",
                     help="shipped cluster or TOML path to plan for (local-hybrid: this "
                     "machine's emulated V100 + T4, so an exported plan runs here)")
    lab.add_argument("--root", type=Path, default=Path.cwd(),
                     help="folder exports are written into (default: the current one)")
    lab.add_argument("--notebook", type=Path, default=LAB_NOTEBOOK,
                     help="notebook to serve instead of the lab app (e.g. a tutorial)")
    lab.add_argument("--idle-s", type=int, default=LAB_KERNEL_IDLE_S,
                     help="stop a closed page's kernel after it sat idle this many seconds "
                     f"(default {LAB_KERNEL_IDLE_S}; 0: never)")
    lab.set_defaults(run=lab_command)


def _add_run_parser(sub) -> None:
    run = sub.add_parser("run", parents=[runtime_parser(add_help=False)],
                         help="train a plan on DDP ranks (torchrun): checks first, then a "
                         "progress bar and measured against predicted step time")
    run.add_argument("--nproc-per-node", type=int,
                     help="ranks on this node (default: the plan's world size / --nnodes)")
    run.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    run.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (several nodes)")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restarts after a worker fails (use with --resume)")
    run.add_argument("--oversubscribe", action="store_true",
                     help="start the ranks even when they are more than twice this machine's "
                     "cores (each step then takes many times its prediction)")
    run.add_argument("--verbose", action="store_true",
                     help="show torchrun's and the ranks' output (default: in run-dir/launch.log)")
    run.set_defaults(run=commands.run_command)
