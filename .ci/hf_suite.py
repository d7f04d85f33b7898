#!/usr/bin/env python3
"""Transformers' own trainer tests with and without the callback: what the adapter changes for them.

Runs the given test files of a copy of Transformers' ``tests/`` (not in this repository: the installed release's,
``tests/trainer/test_trainer_checkpointing.py`` and ``test_trainer_callback.py`` with their ``trainer_test_utils.py``
and the ``__init__.py`` files) twice with this venv's Python, offline: as they are, then with an
``AsyncCheckpointCallback`` added to every Trainer they make (its ``callbacks``, as a user adds it): a writer process or
asyncckpt thread still running when a test ends fails it; then every callback it made is closed. Prints every test
whose outcome differs and the counts of both runs. (The Trainer's Hub tests fail in both runs: offline.)

Usage:
    .venv/bin/python .ci/hf_suite.py SUITE_DIR [TEST_FILES...] [-- PYTEST_ARGS]   # e.g. -- -n 2
Exit status: 0 when no test that passes as it is fails with the callback, but those no asynchronous save can pass
(``CANNOT_PASS``); 1 otherwise.

Loaded by pytest as a plugin (``-p hf_suite``) it adds the callback, with ``ASYNCCKPT=1``.
"""
from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

FILES = ("tests/trainer/test_trainer_checkpointing.py", "tests/trainer/test_trainer_callback.py")
# They compare the Trainer's list of callbacks with its defaults: any callback added fails them.
CANNOT_PASS = {f"TrainerCallbackTest::{name}": "compares the list of callbacks" for name in (
    "test_default_callbacks_are_present", "test_custom_callback_added_at_init", "test_printer_callback_when_tqdm_disabled")}

if os.environ.get("ASYNCCKPT") == "1":
    import threading

    import psutil
    from transformers import Trainer

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

    _made: list = []
    _init = Trainer.__init__
    _CALLBACKS_AT = list(inspect.signature(_init).parameters).index("callbacks") - 1  # its position after self

    @functools.wraps(_init)
    def _init_with_callback(self, *args, **kwargs):
        _made.append(AsyncCheckpointCallback())
        if len(args) > _CALLBACKS_AT:
            args = (*args[:_CALLBACKS_AT], [*(args[_CALLBACKS_AT] or []), _made[-1]], *args[_CALLBACKS_AT + 1:])
        else:
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), _made[-1]]
        _init(self, *args, **kwargs)

    Trainer.__init__ = _init_with_callback

    def _ours_running() -> list[str]:
        return ([" ".join(child.cmdline()[:3]) for child in psutil.Process().children(recursive=True)
                 if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
                + [thread.name for thread in threading.enumerate() if thread.name.startswith("asyncckpt")])

    @pytest.fixture(autouse=True)
    def _callbacks_closed():
        yield
        left = _ours_running()  # once every train() returned: nothing
        errors = []
        while _made:
            try:
                _made.pop().close()
            except Exception as error:  # noqa: BLE001 - every callback is closed first
                errors.append(f"{type(error).__name__}: {error}")
        assert not errors, f"a callback's close() raised: {errors}"
        assert not left, f"still running after the test: {left}"


def _outcomes(junit: Path) -> dict[str, str]:
    outcomes = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = [{"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag] for child in case
                 if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = kinds[0] if kinds else "passed"
    return outcomes


def main(argv: list[str]) -> int:
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    if not argv:
        sys.exit(__doc__)
    suite, files = Path(argv[0]).resolve(), argv[1:] or list(FILES)
    runs = {}
    for label, extra in (("native", {}), ("callback", {"ASYNCCKPT": "1"})):
        junit = suite / f"hf_suite-{label}.xml"
        env = {**os.environ, **extra, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "hf_suite", "-p", "no:cacheprovider",
                        f"--junitxml={junit}", *files, *pytest_args], cwd=suite, env=env, check=False)
        runs[label] = _outcomes(junit)
    native, callback = runs["native"], runs["callback"]
    differ = sorted(name for name in native.keys() | callback.keys() if native.get(name) != callback.get(name))
    print(f"\n{'test':<90} {'native':<8} {'callback':<8}")
    for name in differ:
        print(f"{name:<90} {native.get(name, '-'):<8} {callback.get(name, '-'):<8} {CANNOT_PASS.get(name, '')}")
    for label, outcomes in runs.items():
        counts = {kind: list(outcomes.values()).count(kind) for kind in ("passed", "failed", "error", "skipped")}
        print(f"{label}: " + ", ".join(f"{count} {kind}" for kind, count in counts.items()))
    if any(callback.get(name) == "passed" for name in CANNOT_PASS):
        print("the callback was not added (a test comparing the list of callbacks passed)")
        return 1
    regressions = [name for name in differ if native.get(name) == "passed" and callback.get(name) != "skipped"
                   and name not in CANNOT_PASS]
    print(f"failing with the callback only, beyond what no asynchronous save can pass: {len(regressions)}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
