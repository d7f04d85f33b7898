"""Run a benchmark mode with asyncckpt as it was at another git revision, in the same benchmark run.

The machine these benchmarks run on is shared and its speed drifts by several times within minutes,
so a before/after comparison is only fair inside one run. The adapter benchmarks therefore accept a
mode ``asyncckpt_base``: the same program, with ``asyncckpt`` imported from ``git archive REV`` (core
and adapters) placed first on ``PYTHONPATH`` (the editable install's finder comes after it; the
background writer process inherits the path).
"""
from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_ADAPTERS = ("lightning", "accelerate", "hf_trainer")


def revision_pythonpath(revision: str) -> str:
    """A directory holding package ``asyncckpt`` (core, adapters) as of ``revision``."""
    root = Path(tempfile.mkdtemp(prefix=f"asyncckpt_{revision[:12]}_"))
    archive = subprocess.run(["git", "archive", "--format=tar", revision, "core", "adapters"], cwd=REPO,
                             capture_output=True, check=True).stdout
    tree = root / "tree"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    package = root / "path" / "asyncckpt"
    (package / "adapters").mkdir(parents=True)
    os.symlink(tree / "core", package / "core")
    for adapter in _ADAPTERS:
        if (tree / "adapters" / adapter).is_dir():
            os.symlink(tree / "adapters" / adapter, package / "adapters" / adapter)
    return str(root / "path")


def env_for_mode(mode: str, base_revision: str, cache: dict) -> dict:
    """Extra environment for a child running ``mode``: ``asyncckpt_base`` imports ``base_revision``."""
    if not mode.endswith("_base"):
        return {}
    if base_revision not in cache:
        cache[base_revision] = revision_pythonpath(base_revision)
    return {"PYTHONPATH": os.pathsep.join(p for p in (cache[base_revision], os.environ.get("PYTHONPATH")) if p)}
