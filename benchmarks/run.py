#!/usr/bin/env python
"""Run a benchmark scenario: measure, then write its JSON, its page and its plot.

    python benchmarks/run.py SCENARIO [--quick] [--reps N] [--set OPTION=VALUE ...]
                             [--before REV | --revisions BASE..HEAD] [--out DIR] [--name NAME]
    python benchmarks/run.py SCENARIO --render-only     # the page and plot again, from the JSON
    python benchmarks/run.py --list                     # the scenarios, their options
    python benchmarks/run.py --index                    # docs/benchmarks/README.md, the list of pages

Results go to benchmarks/results/NAME.json, the page to docs/benchmarks/NAME.md and the plot to
docs/benchmarks/img/NAME.png (NAME: the scenario's, ``SCENARIO_before_after`` with a revision to
compare; ``--out DIR`` puts all three under DIR). See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import scenario as scenarios  # noqa: E402
from harness.sitting import child_main, run  # noqa: E402


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return child_main(*argv[1:5])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", nargs="?", help="one of: " + ", ".join(scenarios.names()))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 rep: a smoke run, not a measurement")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default: the scenario's)")
    parser.add_argument("--set", action="append", metavar="OPTION=VALUE", help="a scenario option (see --list)")
    parser.add_argument("--before", metavar="REV", help="also run the asyncckpt arms at REV, alternating with the tree")
    parser.add_argument("--revisions", metavar="BASE..HEAD", help="compare two revisions, both from git archive")
    parser.add_argument("--out", help="write the JSON, page and plot under this directory instead")
    parser.add_argument("--name", help="output name (default: the scenario's, or SCENARIO_before_after)")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk under test (default: the temp dir)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, help="first wait up to this many s for an idle machine")
    parser.add_argument("--render-only", action="store_true", help="render the page and plot again from the JSON")
    parser.add_argument("--list", action="store_true", help="list the scenarios and their options")
    parser.add_argument("--index", action="store_true", help="write docs/benchmarks/README.md, the index of the pages")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.list:
        for name in scenarios.names():
            s = scenarios.load(name)
            print(f"{name}: {s.title}{' (--before)' if s.revisioned else ''}")
            for option, o in s.options.items():
                print(f"    {option} = {o.default!r} (quick {o.value(True)!r}){': ' + o.help if o.help else ''}")
        return 0
    if args.index:
        from harness.index import write_index

        write_index()
        return 0
    if not args.scenario:
        parser.error("which scenario? (--list)")
    return run(scenarios.load(args.scenario), args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
