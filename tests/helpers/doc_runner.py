"""Runs the docs' code blocks for ``test_docs.py``, all in this one process, one after the other.

One process so that torch, Lightning and Transformers are imported once for every block, not once
per block. Each block still gets what a user copying it into a fresh script would have: an empty
working directory of its own, a fresh namespace, and the environment as it was (its setup's changes
undone afterwards).

    python doc_runner.py BLOCKS.json RESULTS.json

BLOCKS.json: a list of {"where", "language", "setup", "setup_line", "code", "code_line"}. Code is
compiled under the markdown file's name, with its own line numbers, so a traceback points into the
doc. RESULTS.json: {where: null (it ran) or the error (a traceback, or the command that failed)}.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
import traceback
from importlib.metadata import entry_points


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compile(source: str, where: str, first_line: int):
    """``source`` as code of the markdown file ``where`` names, its first line numbered ``first_line``
    (so a traceback shows the doc's own lines)."""
    return compile("\n" * (first_line - 1) + source, os.path.join(ROOT, where.rsplit(":", 1)[0]), "exec")


def _run_cli(code: str) -> str | None:
    """A block of ``asyncckpt`` commands, each run as the console script would run it (the function
    the installed package names for ``asyncckpt``), here rather than in a process of its own: every
    CLI process imports torch, which is most of its time. The first command that does not exit 0
    fails the block, as under ``bash -e``."""
    (script,) = entry_points(group="console_scripts", name="asyncckpt")
    asyncckpt = script.load()
    for line in code.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                status = asyncckpt(argv[1:])
            except SystemExit as e:  # argparse refusing the arguments
                status = e.code
        if status:
            return f"`{line.strip()}` exited with status {status}:\n{output.getvalue()}"
    return None


def run(block: dict) -> str | None:
    """Run one block in a fresh temporary directory; its error, or None."""
    namespace = {"__name__": "__main__"}
    try:
        if block["setup"]:
            exec(_compile(block["setup"], block["where"], block["setup_line"]), namespace)
        if block["language"] == "python":
            exec(_compile(block["code"], block["where"], block["code_line"]), namespace)
            return None
        return _run_cli(block["code"])
    except BaseException:  # noqa: B036 - a block's SystemExit or KeyboardInterrupt is its failure, not ours
        return traceback.format_exc()


def main(blocks_json: str, results_json: str) -> None:
    with open(blocks_json) as f:
        blocks = json.load(f)
    results = {}
    for block in blocks:
        environ, cwd = dict(os.environ), os.getcwd()
        with tempfile.TemporaryDirectory(prefix="doc-block-", ignore_cleanup_errors=True) as directory:
            os.chdir(directory)
            try:
                results[block["where"]] = run(block)
            finally:
                os.chdir(cwd)
                os.environ.clear()
                os.environ.update(environ)
    with open(results_json, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
