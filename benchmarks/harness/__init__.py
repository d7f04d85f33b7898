"""The benchmark harness: one entry point (``benchmarks/run.py``) for every scenario in ``benchmarks/scenarios/``.

A scenario declares its workload, its arms and its measurements (``Scenario``); the harness provides
the rest once: machine facts and load, the machine's limits, repetitions in ABBA order, before/after
revisions in one sitting, children in fresh processes, and the JSON, the markdown page and the plot.
"""
from .scenario import Option, Scenario
from .sitting import ChildFailed, Run, Sitting, report_now

__all__ = ["ChildFailed", "Option", "Run", "Scenario", "Sitting", "report_now"]
