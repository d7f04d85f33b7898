"""One sitting of a scenario: its options, its revisions, its children, its order of runs; then its output.

Measurements run in children, fresh processes (``child``): a first call is a real first call, memory
goes back between runs, and a child imports asyncckpt from the revision it measures. A child runs a
function of its scenario's module with keyword arguments and reports a JSON-able dict through a file
(not a pipe: a writer process that outlives a killed child inherits its output).
"""
from __future__ import annotations

import datetime
import importlib
import inspect
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable, Optional, Sequence

from . import report
from .machine import LoadMonitor, facts, measure_limits, wait_quiet
from .revisions import PAGES, REPO, SOURCE_ENV, Revision, check_source, cleanup, git, resolve
from .scenario import Scenario, parse_value
from .util import log, now

RUN = str(REPO / "benchmarks" / "run.py")
ANSWER = "asyncckpt-bench-answer: "  # marks a served child's answers among whatever else it prints


class ChildFailed(RuntimeError):
    pass


@dataclass
class Run:
    """One run of an arm at a revision; ``label`` is the arm, with ``@before`` for the base revision's."""

    arm: str
    revision: Revision

    @property
    def label(self) -> str:
        return self.arm if self.revision.label == "after" else f"{self.arm}@{self.revision.label}"


class Child:
    """A child started with ``Sitting.spawn``: its process, its log and (once written) its report."""

    def __init__(self, process: subprocess.Popen, result_path: str, log_path: str) -> None:
        self.process, self.result_path, self.log_path = process, result_path, log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def report(self) -> Optional[dict]:
        try:
            with open(self.result_path) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


class Served:
    """A child kept running between measurements (``Sitting.serve``): its first answer came when it was
    ready; ``ask()`` makes it take its next measurement and returns that."""

    def __init__(self, process: subprocess.Popen, log_path: str) -> None:
        self.process, self.log_path = process, log_path
        self.ready = self._answer()

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
        raise ChildFailed(f"a served child exited {self.process.wait()}: {Child(self.process, '', self.log_path).log_tail()}")

    def ask(self) -> dict:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(300)


class Sitting:
    """What a scenario's ``measure`` is given."""

    def __init__(self, scenario: Scenario, options: dict, quick: bool, revisions: list[Revision], scratch: str,
                 monitor: LoadMonitor, limits: dict) -> None:
        self.scenario, self.quick, self.revisions, self.scratch = scenario, quick, revisions, scratch
        self.o = SimpleNamespace(**options)
        self.monitor, self.limits = monitor, limits
        self.labels: list[str] = []
        self._children = itertools.count()

    @property
    def after(self) -> Revision:
        return self.revisions[-1]

    def phase(self, name: str):
        return self.monitor.phase(name)

    def log(self, message: str) -> None:
        log(message)

    def directory(self, name: str) -> str:
        path = os.path.join(self.scratch, name)
        os.makedirs(path, exist_ok=True)
        return path

    # ---------------------------------------------------------------------------------- order
    def runs(self, arms: Sequence[str], revisioned: Iterable[str] = ()) -> list[Run]:
        """The arms, each ``revisioned`` one at every revision of the sitting (before next to after)."""
        revisioned = set(revisioned)
        out = [Run(arm, revision) for arm in arms
               for revision in (self.revisions if arm in revisioned else [self.after])]
        self.labels += [r.label for r in out if r.label not in self.labels]
        return out

    @staticmethod
    def abba(items: Sequence, rounds: int) -> list[tuple[int, Any]]:
        """``rounds`` passes over ``items``, every other one reversed (A B B A ...): drift over the sitting
        hits every item alike."""
        return [(r, item) for r in range(rounds) for item in (items if r % 2 == 0 else list(reversed(items)))]

    # ---------------------------------------------------------------------------------- children
    def _start(self, function: str, revision: Optional[Revision], env: Optional[dict], kwargs: dict,
               served: bool = False, **popen) -> tuple[subprocess.Popen, str, str]:
        revision = revision or self.after
        n = next(self._children)
        result_path = os.path.join(self.directory("children"), f"{n}-{function}.json")
        log_path = result_path[:-5] + ".log"
        environment = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false", **revision.env,
                       SOURCE_ENV: revision.source, **(env or {})}
        command = [sys.executable, RUN, "--child", self.scenario.name, function, result_path, json.dumps(kwargs)]
        with open(log_path, "w") as out:
            if served:  # answers on stdout (marked: the frameworks print there too), the rest in the log
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                           env=environment, text=True, **popen)
            else:
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                           env=environment, **popen)
        return process, result_path, log_path

    def child(self, function: str, *, revision: Optional[Revision] = None, env: Optional[dict] = None,
              timeout: float = 3600, **kwargs) -> dict:
        """Run ``function(**kwargs)`` of the scenario's module in a fresh process at ``revision`` (the
        sitting's after by default); its dict, with the load average around it and its wall time."""
        load = os.getloadavg()[0]
        t0 = now()
        process, result_path, log_path = self._start(function, revision, env, kwargs)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        child = Child(process, result_path, log_path)
        result = child.report()
        if process.returncode != 0 or result is None:
            raise ChildFailed(f"{self.scenario.name}.{function}{kwargs} at {(revision or self.after).label} exited "
                              f"{process.returncode}:\n{child.log_tail()}")
        result["_child"] = {"loadavg": [load, os.getloadavg()[0]], "wall_s": now() - t0}
        return result

    def serve(self, function: str, *, revision: Optional[Revision] = None, env: Optional[dict] = None,
              **kwargs) -> Served:
        """Start a generator function of the scenario in a fresh process: it yields once ready, then once
        per ``ask()`` (a measurement that must not pay the process's first-use costs each time)."""
        process, _, log_path = self._start(function, revision, env, kwargs, served=True)
        return Served(process, log_path)

    def spawn(self, function: str, *, revision: Optional[Revision] = None, env: Optional[dict] = None,
              **kwargs) -> Child:
        """Start ``function(**kwargs)`` in a fresh process and return at once (kill trials watch it)."""
        return Child(*self._start(function, revision, env, kwargs, start_new_session=True))


# -------------------------------------------------------------------------------------- a sitting
def resolve_options(scenario: Scenario, quick: bool, settings: list[str], reps: Optional[int]) -> dict:
    options = {name: option.value(quick) for name, option in scenario.options.items()}
    for setting in settings:
        name, _, text = setting.partition("=")
        if name not in scenario.options:
            raise SystemExit(f"{scenario.name} has no option {name!r}; its options: {', '.join(scenario.options)}")
        options[name] = parse_value(scenario.options[name], text)
    options["reps"] = reps if reps is not None else scenario.reps[1 if quick else 0]
    return options


def paths(scenario: Scenario, name: str, out: Optional[str]) -> tuple[str, str, str]:
    """Where the JSON, the page and the plot go: the project's folders, or all under ``out``."""
    if out:
        return (os.path.join(out, f"{name}.json"), os.path.join(out, f"{name}.md"),
                os.path.join(out, "img", f"{name}.png"))
    return (str(REPO / "benchmarks" / "results" / f"{name}.json"), str(PAGES / f"{name}.md"),
            str(PAGES / "img" / f"{name}.png"))


def run(scenario: Scenario, args) -> int:
    revisions_wanted = args.before or args.revisions
    if revisions_wanted and not scenario.revisioned:
        raise SystemExit(f"{scenario.name} measures one revision (it has no before/after)")
    name = args.name or (f"{scenario.name}_before_after" if revisions_wanted else scenario.name)
    json_path, page_path, image_path = paths(scenario, name, args.out)
    if args.render_only:
        with open(json_path) as f:
            result = json.load(f)
        if result.get("harness") != report.HARNESS_VERSION:
            raise SystemExit(f"{json_path} predates the harness: nothing to render it with")
        report.write(scenario, result, json_path, page_path, image_path)
        log(f"rendered {page_path}")
        return 0
    options = resolve_options(scenario, args.quick, args.set or [], args.reps)
    started = datetime.datetime.now()
    revisions = resolve(args.before, args.revisions)
    scratch = tempfile.mkdtemp(prefix=f"bench_{scenario.name}_", dir=args.dir)
    quiet = wait_quiet(args.wait_quiet) if args.wait_quiet else None
    monitor = LoadMonitor()
    limits: dict = {}
    t0 = now()
    try:
        mib = scenario.limits_mib
        nbytes = (options[mib] if isinstance(mib, str) else mib[1 if args.quick else 0]) << 20
        if scenario.limits:
            with monitor.phase("limits"):
                limits["start"] = measure_limits(scenario.limits, nbytes, scratch, options["reps"])
        sitting = Sitting(scenario, options, args.quick, revisions, scratch, monitor, limits)
        figures = scenario.measure(sitting)
        if scenario.limits:
            with monitor.phase("limits at the end"):
                limits["end"] = measure_limits(scenario.limits, nbytes, scratch, options["reps"])
    finally:
        load = monitor.stop()
        cleanup(revisions)
        shutil.rmtree(scratch, ignore_errors=True)
    dirty = git("status", "--short", "--", "core", "adapters", "benchmarks")
    result = {
        "harness": report.HARNESS_VERSION, "scenario": scenario.name, "name": name,
        "command": " ".join(["python benchmarks/run.py", *args.argv]),
        "date": started.isoformat(timespec="seconds"), "wall_s": now() - t0, "quick": args.quick,
        "commit": git("rev-parse", "HEAD"), "uncommitted": dirty.replace("\n", "; "),
        "revisions": [r.summary() for r in revisions], "labels": sitting.labels,
        "machine": facts(), "load": load, "wait_quiet": quiet, "options": options, "limits": limits,
        "figures": figures,
    }
    report.write(scenario, result, json_path, page_path, image_path)
    log(f"wrote {json_path}, {page_path}, {image_path}")
    return 0


_report_path: list[str] = []


def report_now(result: dict) -> None:
    """In a child: report ``result`` at once (a child about to kill itself reports before it does)."""
    partial = _report_path[0] + ".partial"
    with open(partial, "w") as f:
        json.dump(result, f, default=str)
    os.replace(partial, _report_path[0])


def child_main(scenario: str, function: str, result_path: str, kwargs: str) -> int:
    """In a child: run the function, check where asyncckpt came from, report through the file."""
    _report_path.append(result_path)
    try:
        result = getattr(importlib.import_module(f"scenarios.{scenario}"), function)(**json.loads(kwargs))
        if inspect.isgenerator(result):  # served: one answer when ready, then one per "go"
            print(ANSWER + json.dumps(next(result), default=str), flush=True)
            for line in sys.stdin:
                if line.strip() != "go":
                    break
                print(ANSWER + json.dumps(next(result), default=str), flush=True)
            check_source()
            return 0
        check_source()
    except BaseException:
        traceback.print_exc()
        return 1
    report_now(result)
    return 0
