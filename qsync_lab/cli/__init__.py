"""The ``qsync-lab`` command line: :func:`main`, over the parser (:mod:`.parser`) and the
command bodies (:mod:`.commands`, :mod:`.lab`).

Every command that takes a plan takes the file ``qsync-lab plan`` writes. Bad input is
one line on stderr and exit status 2, before any process starts.

Example::

    $ qsync-lab graph --model resnet18 --batch 8
    $ qsync-lab plan --model resnet18 --cluster local-hybrid --out local_plan.json
    $ qsync-lab simulate --plan local_plan.json
    $ qsync-lab run --plan local_plan.json --steps 30 --run-dir run
    $ qsync-lab report --plan local_plan.json --out local_report.html
    $ qsync-lab lab --port 8866
"""

import os
import sys
import warnings

from qsync_lab.cli.parser import build_parser
from qsync_lab.errors import QSyncError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input).

    Example::

        >>> main(["cluster", "no-such-cluster"])  # one line on stderr
        2
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _note
            args.run(args)
    except QSyncError as err:
        print(f"qsync-lab: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a run's ranks are stopped by then (launch)
        resume = ("; the ranks were stopped: the same command with --resume continues from "
                  "the last checkpoint") if args.command == "run" else ""
        print(f"\nqsync-lab: interrupted{resume}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (``| head``) left: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


def _note(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings (a plan migrated, a tracer fallback) as one ``note:`` line each."""
    print(f"qsync-lab: note: {message}", file=sys.stderr)
