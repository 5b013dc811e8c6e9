"""The end of a benchmark's report, shared by the scripts: the machine's load, then print
and (with ``--out``) write the report."""

import os
from pathlib import Path


def load_line(when: str) -> str:
    """``"1/5/15-min load <when>: a b c"``, the machine's load averages."""
    load = os.getloadavg()
    return f"1/5/15-min load {when}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def finish_report(report: list[str], out: Path | None) -> None:
    """Add the load after the run, print the report and write it to ``out`` if given."""
    text = "\n".join([*report, load_line("after")])
    print(text)
    if out:
        out.write_text(text + "\n")
