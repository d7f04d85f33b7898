"""``docs/benchmarks/README.md``: the list of the scenarios and their pages, rendered from the scenarios and their
results (``run.py --index``), so that it names every scenario there is and no other, with the date and revision of
its latest sitting as the results record it."""
from __future__ import annotations

import json

from . import report, scenario
from .revisions import PAGES, REPO


def write_index() -> None:
    rows = []
    for name in scenario.names():
        s = scenario.load(name)
        results = REPO / "benchmarks" / "results" / f"{name}.json"
        sitting = "–"
        if results.is_file():
            with open(results) as f:
                found = json.load(f)
            sitting = (f"{found['date'][:10]} at {found['commit'][:7]}" if found.get("harness") == report.HARNESS_VERSION
                       else "before the harness")
        rows.append([f"[{s.title}]({name}.md)" if (PAGES / f"{name}.md").is_file() else s.title, f"`{name}`",
                     "yes" if s.revisioned else "", sitting])
    lines = [
        "# Benchmarks",
        "",
        "<!-- Rendered by `python benchmarks/run.py --index` from benchmarks/scenarios/: do not edit. -->",
        "",
        "Every figure of these pages comes from one sitting of a scenario of the benchmark harness, on the machine and "
        "under the load its page states, against that machine's own limits measured in the same sitting: "
        "`python benchmarks/run.py SCENARIO` measures, then writes `benchmarks/results/SCENARIO.json`, renders "
        "`docs/benchmarks/SCENARIO.md` from it and draws `docs/benchmarks/img/SCENARIO.png`; `--before REV` runs the "
        "scenario's asyncckpt arms at REV too, alternating with the working tree, in the same sitting "
        "(`SCENARIO_before_after`). How to run them, and how to add one: `benchmarks/README.md`.",
        "",
        *report.table(["scenario", "name", "before/after", "latest sitting"], rows),
    ]
    others = sorted(p.stem for p in PAGES.glob("*.md") if p.stem != "README" and p.stem not in scenario.names())
    if others:
        lines += ["Other pages: a scenario's sitting under its own name (`--name`), or a record of a sitting from before "
                  "the harness, which its page describes: " + ", ".join(f"[{p}]({p}.md)" for p in others) + ".", ""]
    (PAGES / "README.md").write_text("\n".join(lines))
