"""The test suite's time against an earlier revision's, test by test.

Run both suites at once on the same machine (so both see the same load), each writing a
JUnit XML file, then compare them::

    PYTEST_ADDOPTS="--junitxml=/tmp/old.xml" .venv/bin/python -m pytest   # in a checkout of the earlier revision
    PYTEST_ADDOPTS="--junitxml=/tmp/new.xml" .venv/bin/python -m pytest   # here, at the same time
    .venv/bin/python benchmarks/suite_times.py /tmp/old.xml /tmp/new.xml [--out FILE]

It prints both totals, the tests both have (old against new time), what the new tests
cost by module, and the modules whose common tests grew or shrank most.
"""

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from reporting import finish_report


def test_times(path: Path) -> dict[str, float]:
    """Seconds per test id (``classname::name``) of a pytest JUnit XML file."""
    return {f"{case.get('classname')}::{case.get('name')}": float(case.get("time", 0))
            for case in ET.parse(path).getroot().iter("testcase")}


def by_module(times: dict[str, float], ids) -> dict[str, float]:
    """Seconds per test module of the tests ``ids``."""
    totals: dict[str, float] = defaultdict(float)
    for test_id in ids:
        totals[test_id.split("::")[0]] += times[test_id]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    old, new = test_times(args.old), test_times(args.new)
    common, added = old.keys() & new.keys(), new.keys() - old.keys()
    old_common, new_common = by_module(old, common), by_module(new, common)
    change = sorted((new_common[m] - old_common[m], m) for m in old_common)
    added_by_module = sorted(by_module(new, added).items(), key=lambda kv: -kv[1])

    def listed(rows) -> str:
        return ", ".join(f"{m} {d:+.0f} s ({old_common[m]:.0f} -> {new_common[m]:.0f})"
                         for d, m in rows)
    report = [
        f"old ({args.old.name}): {len(old)} tests, {sum(old.values()):.0f} s; "
        f"new ({args.new.name}): {len(new)} tests, {sum(new.values()):.0f} s",
        f"the {len(common)} tests both have: old {sum(old[t] for t in common):.0f} s, "
        f"new {sum(new[t] for t in common):.0f} s",
        f"{len(added)} new tests: {sum(new[t] for t in added):.0f} s ("
        + ", ".join(f"{m} {s:.0f} s" for m, s in added_by_module[:6]) + ")",
        f"{len(old.keys() - new.keys())} tests gone: "
        f"{sum(old[t] for t in old.keys() - new.keys()):.0f} s",
        "common tests, grew most: " + listed(change[::-1][:6]),
        "common tests, shrank most: " + listed(change[:6])]
    finish_report(report, args.out)


if __name__ == "__main__":
    main()
