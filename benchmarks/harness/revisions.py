"""Before and after in one sitting: asyncckpt as it was at a git revision, beside the working tree.

This machine's speed drifts by several times within minutes, so a before/after comparison is fair
only inside one sitting, the two revisions' runs alternating. A revision runs from ``git archive REV``
unpacked into a temporary directory: its packages are linked into an ``asyncckpt`` package as the
revision's own ``pyproject.toml`` maps them, and that directory goes first on ``PYTHONPATH`` (before
the editable install's finder; the background writer process inherits the path). The scenario's
code is the same for both revisions: it uses asyncckpt's public API only. A child checks that every
``asyncckpt`` module it imported came from its revision's tree (``check_source``).
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
PAGES = REPO / "docs" / "benchmarks"  # the pages (NAME.md), their plots (img/NAME.png) and the index (README.md)
SOURCE_ENV = "ASYNCCKPT_BENCH_SOURCE"  # the directory a child's asyncckpt modules must come from


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


@dataclass
class Revision:
    """One side of a comparison: ``label`` "before" or "after"; ``ref`` None is the working tree."""

    label: str
    ref: Optional[str] = None
    commit: str = ""
    root: Optional[str] = None  # the unpacked tree's import directory (None: the working tree)
    env: dict = field(default_factory=dict)

    @property
    def source(self) -> str:
        """Where its asyncckpt modules live (the links of ``root`` lead into the unpacked tree beside it)."""
        return str(Path(self.root).parent) if self.root else str(REPO)

    def describe(self) -> str:
        if self.ref is None:
            dirty = git("status", "--short", "--", "core", "adapters")
            return f"the working tree at {git('rev-parse', '--short', 'HEAD')}" + (" + uncommitted changes" if dirty else "")
        return f"{self.commit[:10]} (`git archive {self.ref}`)"

    def summary(self) -> dict:
        return {"label": self.label, "ref": self.ref, "commit": self.commit or git("rev-parse", "HEAD"),
                "describe": self.describe()}


def unpack(ref: str, label: str) -> Revision:
    """``ref``'s packages in a temporary import directory (removed by ``cleanup``)."""
    commit = git("rev-parse", ref)
    base = Path(tempfile.mkdtemp(prefix=f"asyncckpt_{commit[:10]}_"))
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, capture_output=True,
                             check=True).stdout
    tree = base / "tree"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    mapping = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    path = base / "path"
    for package, directory in mapping.items():  # "asyncckpt.adapters.lightning" = "adapters/lightning"
        link = path.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(tree / directory, link)
    return Revision(label, ref, commit, str(path), {"PYTHONPATH": os.pathsep.join(
        p for p in (str(path), os.environ.get("PYTHONPATH")) if p)})


def resolve(before: Optional[str], revisions: Optional[str]) -> list[Revision]:
    """The revisions a sitting runs: the working tree alone; ``before`` and the working tree; or both ends
    of ``BASE..HEAD``, each from its archive."""
    if revisions:
        base, _, head = revisions.partition("..")
        return [unpack(base, "before"), unpack(head or "HEAD", "after")]
    after = Revision("after", commit=git("rev-parse", "HEAD"))
    return [unpack(before, "before"), after] if before else [after]


def cleanup(revisions: list[Revision]) -> None:
    for revision in revisions:
        if revision.root:
            shutil.rmtree(Path(revision.root).parent, ignore_errors=True)


def check_source() -> None:
    """In a child: every asyncckpt module loaded comes from the directory the parent meant."""
    expected = os.environ.get(SOURCE_ENV)
    if not expected:
        return
    expected = os.path.realpath(expected)
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if name.startswith("asyncckpt.") and where and not os.path.realpath(where).startswith(expected + os.sep):
            raise RuntimeError(f"{name} was imported from {where}, not from the revision under test ({expected})")
