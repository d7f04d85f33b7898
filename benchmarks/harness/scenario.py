"""What a scenario declares, and where the harness finds the scenarios.

A scenario is a module ``benchmarks/scenarios/NAME.py`` that defines ``SCENARIO = Scenario(...)``: its
question, its options (each with a full and a ``--quick`` value), how it measures (``measure``, given a
``Sitting``), how its figures read (``render``, markdown) and look (``plot``). The harness does the
rest: machine facts, load, limits, revisions, children, JSON, page and plot. Modules whose name starts
with ``_`` are helpers of several scenarios, not scenarios.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


@dataclass
class Option:
    """A knob of a scenario: its value for a real sitting and for ``--quick`` (tiny sizes: a smoke run)."""

    default: Any
    quick: Any = None
    help: str = ""

    def value(self, quick: bool) -> Any:
        return self.quick if quick and self.quick is not None else self.default


@dataclass
class Scenario:
    title: str
    question: str  # what is measured, against what: the page's first paragraph
    measure: Callable[..., dict]  # measure(sitting) -> the figures (JSON-able)
    render: Callable[[dict], str]  # render(result) -> the page's body (markdown)
    plot: Callable[[dict, Any], None]  # plot(result, matplotlib Figure)
    options: dict[str, Option] = field(default_factory=dict)
    reps: tuple[int, int] = (3, 1)  # reps of a real sitting, of a --quick one
    limits: tuple[str, ...] = ()  # machine.LIMITS measured at the sitting's start and end
    limits_mib: tuple[int, int] | str = (256, 32)  # the MiB they are measured with (real, --quick), or an option's name
    revisioned: bool = False  # --before / --revisions apply: it runs its asyncckpt arms at each revision
    name: str = ""  # the module's name, set by ``load``


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(SCENARIOS)]) if not m.name.startswith("_"))


def load(name: str) -> Scenario:
    if name not in names():
        raise SystemExit(f"no scenario {name!r}; the scenarios: {', '.join(names())}")
    scenario = importlib.import_module(f"scenarios.{name}").SCENARIO
    scenario.name = name
    return scenario


def parse_value(option: Option, text: str) -> Any:
    kind = type(option.default)
    if kind is bool:
        return text.lower() in ("1", "true", "yes", "on")
    return kind(text) if option.default is not None else text
