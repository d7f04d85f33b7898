"""The installed Accelerate, copied and edited the way a new release would change it, installed as 1.99.0 in front of
the real one (tests/test_framework_contracts.py): the version rule judges the functions' code, a real save then shows
what the adapter does. Imports no framework at import time: a rank imports the edited copy first."""
from __future__ import annotations

import ast
import datetime
import os
import shutil
import sys
import warnings
from pathlib import Path

EDITS = {  # variant -> the edits applied to its copy: (file, function, "docstring" or "code")
    "docstrings": [("accelerate/utils/fsdp_utils.py", "save_fsdp_optimizer", "docstring"),
                   ("accelerate/accelerator.py", "save_state", "docstring")],
    "fsdp code": [("accelerate/utils/fsdp_utils.py", "save_fsdp_optimizer", "code")],
    "fsdp code, allowed": [("accelerate/utils/fsdp_utils.py", "save_fsdp_optimizer", "code")],
    "essential code": [("accelerate/accelerator.py", "save_state", "code")],
}


def edited_release(root: Path, edits: list) -> Path:
    """A copy of the installed accelerate as release 1.99.0 under ``root``, with ``edits``: a function's docstring
    rewritten (or added) and a comment added (``docstring``), or a statement added to its body (``code``)."""
    import importlib.util

    installed = Path(importlib.util.find_spec("accelerate").origin).parent
    shutil.copytree(installed, root / "accelerate", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "accelerate-1.99.0.dist-info").mkdir()
    (root / "accelerate-1.99.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: accelerate\n"
                                                                   "Version: 1.99.0\n")
    for file, name, edit in edits:
        path = root / file
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        first = node.body[0]
        indent = " " * first.col_offset
        documented = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        if edit == "docstring":  # reworded, or one where there was none, and a comment
            lines[first.lineno - 1:first.end_lineno if documented else first.lineno - 1] = [
                f'{indent}"""Reworded in this release."""', f"{indent}# a comment this release added"]
        else:
            at = first.end_lineno if documented else first.lineno - 1
            lines.insert(at, f"{indent}_added_in_this_release = None")
        path.write_text("\n".join(lines) + "\n")
    return root


def save_with_the_edited_release(rank: int, world: int, variants: list, root: Path) -> dict:
    """On each rank alone (a world of its own), with its variant: what enabling the adapter warns or raises, and
    whether a DDP save and an FSDP save went through asyncckpt (its commit record) and load back."""
    variant = variants[rank]
    sys.path.insert(0, str(root / variant))
    if variant.endswith("allowed"):
        os.environ["ASYNCCKPT_ALLOW_CHANGED"] = "accelerate"
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root / variant}.store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    import accelerate
    from accelerate import Accelerator

    from asyncckpt.adapters.accelerate import enable_async_checkpointing
    from asyncckpt.core import UnsupportedVersionError
    from test_fsdp import fsdp_accelerator, train

    assert accelerate.__file__.startswith(str(root / variant)), accelerate.__file__
    committed = lambda d: os.path.exists(os.path.join(d, ".asyncckpt-commit.json"))  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator = Accelerator(cpu=True)
        try:
            handle = enable_async_checkpointing(accelerator)
        except UnsupportedVersionError as e:
            return {"refused": str(e)}
        accelerator.save_state(str(root / variant / "ddp"))
        handle.remove()
        accelerator, model, optimizer = fsdp_accelerator("SHARDED_STATE_DICT")
        handle = enable_async_checkpointing(accelerator)
        train(model, optimizer, range(2), 0)
        accelerator.save_state(str(root / variant / "fsdp"))
        handle.wait()
        accelerator.load_state(str(root / variant / "fsdp"))
        handle.remove()
    mine = [str(w.message) for w in caught if "asyncckpt's accelerate adapter" in str(w.message)]
    return {"warnings": mine, "ddp": committed(root / variant / "ddp"), "fsdp": committed(root / variant / "fsdp")}
