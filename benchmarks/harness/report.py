"""A sitting's output: the results JSON, the page rendered from it, and its plot.

The page is never edited by hand: its header (date, commit, revisions, machine, load, limits) comes
from the JSON the harness wrote, its body from the scenario's ``render``, its figure from the
scenario's ``plot``; ``run.py SCENARIO --render-only`` renders both again from the JSON.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional

from .machine import LIMITS
from .revisions import REPO
from .util import GiB

HARNESS_VERSION = 1


# ------------------------------------------------------------------------------------------ formatting
def fmt(x: Any, spec: str = ".3f", none: str = "–") -> str:
    if x is None:
        return none
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def pct(x: Optional[float], spec: str = "+.1f") -> str:
    return "–" if x is None else f"{100 * x:{spec}}%"


def each(values: Iterable, spec: str = ".3f") -> str:
    return ", ".join(fmt(v, spec) for v in values)


def cell(summary: Optional[dict], spec: str = ".3f") -> str:
    """``median (min–max)`` of a ``util.spread``."""
    if not summary or summary.get("median") is None:
        return "–"
    if summary.get("n", 0) <= 1:
        return fmt(summary["median"], spec)
    return f"{fmt(summary['median'], spec)} ({fmt(summary['min'], spec)}–{fmt(summary['max'], spec)})"


def table(header: list[str], rows: Iterable[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def arm_name(label: str, names: dict, result: dict) -> str:
    """A run's row title: the arm's name, with the revision when the sitting compared two."""
    arm, _, side = label.partition("@")
    name = names.get(arm, arm)
    revisions = result.get("revisions", [])
    if len(revisions) < 2 or not is_revisioned(arm, result):
        return name
    revision = next(r for r in revisions if r["label"] == (side or "after"))
    return f"{name} — {side or 'after'} ({revision['commit'][:7]})"


def side(label: str, result: dict) -> str:
    """", before (abc1234)" for a run of a sitting that compared revisions; "" otherwise."""
    revisions = result.get("revisions", [])
    if len(revisions) < 2:
        return ""
    which = label.partition("@")[2] or "after"
    return f", {which} ({next(r for r in revisions if r['label'] == which)['commit'][:7]})"


def is_revisioned(arm: str, result: dict) -> bool:
    return any(label.startswith(arm + "@") for label in result.get("labels", []))


# ------------------------------------------------------------------------------------------ plots
def bars(axes, labels: list[str], values: list[Optional[float]], ylabel: str, reference: Optional[float] = None,
         reference_label: str = "") -> None:
    """One bar per label (a missing value leaves a gap), an optional horizontal reference line."""
    xs = range(len(labels))
    axes.bar(xs, [v or 0.0 for v in values], color="#4c72b0")
    axes.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    axes.set_ylabel(ylabel)
    if reference is not None:
        axes.axhline(reference, color="#c44e52", linestyle="--", label=reference_label)
        axes.legend(fontsize=8)


# ------------------------------------------------------------------------------------------ the page
def header(scenario, result: dict, json_shown: str) -> list[str]:
    machine, load = result["machine"], result["load"]
    revisions = result["revisions"]
    options = ", ".join(f"{k} {v}" for k, v in result["options"].items())
    lines = [
        f"# {scenario.title}",
        "",
        f"<!-- Rendered by benchmarks/run.py from {json_shown}: do not edit; run the command again. -->",
        "",
        scenario.question,
        "",
        *table(["sitting", ""], [
            ["command", f"`{result['command']}`"],
            ["date", f"{result['date']} ({result['wall_s'] / 60:.1f} min)"],
            ["asyncckpt", "; ".join(f"{r['label']}: {r['describe']}" for r in revisions)],
            ["machine", f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, Linux "
                        f"{machine['kernel']}, Python {machine['python']}, torch {machine['torch']} "
                        f"({machine['torch_threads']} threads)" + (f", {machine['gpu']}" if machine.get("gpu") else "")],
            ["load", f"load average {load['loadavg_before'][0]:.2f} before, {load['loadavg_after'][0]:.2f} after; "
                     f"other processes used {fmt(load.get('foreign_cores_mean'), '.2f')} cores on average (max "
                     f"{fmt(load.get('foreign_cores_max'), '.2f')})"],
            ["options", f"{options}" + (" (`--quick`: a smoke run, not a measurement)" if result["quick"] else "")],
        ]),
    ]
    return lines


def limits_section(result: dict) -> list[str]:
    lines: list[str] = []
    for when in ("start", "end"):
        limits = result.get("limits", {}).get(when)
        if not limits:
            continue
        if not lines:
            lines += ["## The machine's limits", "",
                      f"The same bytes ({limits['bytes'] / GiB:.3g} GiB), this sitting, GB/s median (min–max):", ""]
            rows = []
            for kind, what in LIMITS.items():
                both = [result["limits"].get(w, {}).get(kind) for w in ("start", "end")]
                if any(both):
                    rows.append([what] + [v.get("error", "") if v and "error" in v else cell(v, ".2f") for v in both])
            lines += table(["limit", "at the start", "at the end"], rows)
    return lines


def phases_section(result: dict) -> list[str]:
    phases = result["load"].get("phases") or {}
    if len(phases) < 2:
        return []
    rows = [[name, fmt(p["wall_s"], ".0f"), fmt(p.get("foreign_cores_mean"), ".2f"), fmt(p.get("foreign_cores_max"), ".2f"),
             f"{p['loadavg'][0]:.2f} → {p['loadavg'][1]:.2f}"] for name, p in phases.items()]
    return ["## Load during each phase", "",
            "CPU of the whole machine not used by this sitting's processes (other jobs on the machine; the kernel's "
            "threads doing our I/O count here too, so a few tenths of a core is normal):", "",
            *table(["phase", "wall s", "other processes, mean cores", "max cores", "load average"], rows)]


def write(scenario, result: dict, json_path: str, page_path: str, image_path: str) -> None:
    """The JSON, the page and the plot."""
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.makedirs(os.path.dirname(image_path), exist_ok=True)
    draw(scenario, result, image_path)
    image = os.path.relpath(image_path, os.path.dirname(page_path))
    body = scenario.render(result).rstrip("\n")
    shown = os.path.relpath(json_path, REPO) if os.path.abspath(json_path).startswith(str(REPO) + os.sep) else json_path
    lines = [*header(scenario, result, shown), *limits_section(result), body, "",
             f"![{scenario.title}]({image})", "", *phases_section(result)]
    with open(page_path, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")


def draw(scenario, result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(9, 4.8))
    scenario.plot(result, figure)
    figure.suptitle(f"{scenario.title} ({result['date'][:10]}, {result['revisions'][-1]['commit'][:7]}"
                    f"{', --quick' if result['quick'] else ''})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
