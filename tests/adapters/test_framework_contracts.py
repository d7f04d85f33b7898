"""The framework functions the adapters rely on, pinned: an upgrade that changes one fails here, by name.

The pins live with each adapter (``adapters/*/support.py``, a ``Support`` each), because the adapters
apply the same check at run time to a framework release newer than the newest tested
(``asyncckpt.core.integration.versions``). Two kinds:

* **copied**: the adapter reproduces the function's behaviour (the Trainer's ``_save_checkpoint``
  and ``rotate_checkpoints``, Accelerate's naming and ``total_limit`` in ``save_state``, the sharded
  branch of Lightning's FSDP/ModelParallel ``save_checkpoint``...). Its source is pinned by digest,
  one per variant a tested release had: when it changes, read the new version against the
  adapter's copy (the module named in the failure), update the copy, then add the digest.
* **relied on**: the adapter replaces or calls it, so its parameters must stay.

Also: each supported range is declared once (the ``Support``); pyproject's extras, the README, the
adapters' docs pages and the dev pins must say the same.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import warnings
from importlib.metadata import requires
from pathlib import Path

import pytest

from asyncckpt.core import UnsupportedVersionError
from asyncckpt.core.integration import versions

REPO = Path(__file__).resolve().parents[2]

ADAPTERS = {  # extra -> (support module, docs page)
    "lightning": ("asyncckpt.adapters.lightning.support", "docs/lightning.md"),
    "accelerate": ("asyncckpt.adapters.accelerate.support", "docs/accelerate.md"),
    "transformers": ("asyncckpt.adapters.hf_trainer.support", "docs/hf_trainer.md"),
}


def _support(extra: str) -> versions.Support:
    return importlib.import_module(ADAPTERS[extra][0]).SUPPORT


def _pins(kind: str) -> list:
    """(extra, pinned function) for every adapter whose framework is installed."""
    params = []
    for extra in ADAPTERS:
        try:
            support = _support(extra)
        except ImportError:
            params.append(pytest.param(extra, None, marks=pytest.mark.skip(reason=f"{extra} is not installed")))
            continue
        params += [(extra, target) for target in getattr(support, kind)]
    return params


@pytest.mark.parametrize("extra,target", _pins("copied") + _pins("relied_on"))
def test_each_pinned_framework_function_is_as_the_adapter_was_tested_with(extra, target):
    support = _support(extra)
    alone = dataclasses.replace(support, copied={t: p for t, p in support.copied.items() if t == target},
                                relied_on={t: p for t, p in support.relied_on.items() if t == target})
    assert not versions.changes(alone), (
        f"{target} changed in this {extra} release: {versions.changes(alone)}. Read the new version against the "
        "adapter's copy or call (where the pin says), update the adapter, then the pin")


@pytest.mark.parametrize("extra", list(ADAPTERS))
def test_the_release_check_reads_from_a_release_s_files_what_the_adapter_sees_installed(extra):
    """.ci/new-releases judges a release from its files, without installing it: on the installed release's own
    files it finds every pin it can read as the installed functions are (so the day a release ships, the
    script's verdict is the adapter's)."""
    import importlib.machinery
    import importlib.util

    support = _support(extra)
    loader = importlib.machinery.SourceFileLoader("new_releases", str(REPO / ".ci" / "new-releases"))
    script = importlib.util.module_from_spec(importlib.util.spec_from_loader("new_releases", loader))
    loader.exec_module(script)
    site = Path(importlib.util.find_spec(support.package).origin).parent.parent
    files = script.ReleaseFiles.directory(site)
    read = [t for t in [*support.copied, *support.relied_on] if files.lookup(t) is not None]
    assert set(support.copied) <= set(read)  # every copied function is read from the files
    for target in read:
        source, parameters = files.lookup(target)
        installed_source, installed_parameters = versions.installed_function(target)
        assert versions.code_digest(source) == versions.code_digest(installed_source), target
        assert parameters == installed_parameters, target
    assert versions.changes(support, files.lookup) == {}


def test_framework_attributes_the_adapters_read():
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    assert FSDPStrategy(state_dict_type="sharded")._state_dict_type == "sharded"
    assert ModelParallelStrategy()._save_distributed_checkpoint is True
    assert SingleDeviceStrategy("cpu")._checkpoint_io is None  # read without the lazy default getter
    assert hasattr(ModelCheckpoint(), "_fs")
    assert Accelerator(cpu=True)._optimizers == []
    import accelerate.checkpointing as checkpointing  # the two globals save_state writes files through

    assert callable(checkpointing.save) and checkpointing.torch.save is not None




def _declared_extras() -> dict[str, str]:
    """pyproject's dependency of each extra (and of the core) on its framework, as users get it."""
    declared = {}
    for requirement in requires("asyncckpt"):
        name, _, marker = requirement.partition(";")
        extra = re.search(r'extra == "(\w+)"', marker)
        package = re.match(r"[\w-]+", name)[0]
        if package == "torch" or (extra and package == extra[1]):
            declared[package] = name.strip()
    return declared


@pytest.mark.parametrize("extra", [*ADAPTERS, "torch"])
def test_each_range_is_declared_once_and_everywhere_the_same(extra):
    support = versions.TORCH if extra == "torch" else _support(extra)
    assert _declared_extras()[support.package] == support.requirement, (
        f"pyproject.toml's {support.package} dependency is not {support.requirement} (the adapter's Support): "
        "no upper bound unless a known incompatibility is named")
    pages = {"README.md": (REPO / "README.md").read_text()}
    if extra != "torch":
        pages[ADAPTERS[extra][1]] = (REPO / ADAPTERS[extra][1]).read_text()
    for page, text in pages.items():
        assert f"`{support.requirement}`" in text, f"{page} does not state {support.requirement}"
        assert f"{support.oldest} to {support.newest}" in text, f"{page} does not state the tested range"
        stale = [r for r in re.findall(rf"`{support.package}(?:>=|<|~=)[^`]*`", text) if r != f"`{support.requirement}`"]
        assert not stale, f"{page} states another range: {stale}"
    pins = (REPO / ".ci" / "requirements-dev.txt").read_text()
    if extra != "torch":  # the dev/test pins follow the newest release tested (torch: the CPU wheel on disk)
        assert re.search(rf"^{support.package}=={re.escape(support.newest)}$", pins, re.M), \
            f".ci/requirements-dev.txt does not pin {support.package}=={support.newest}"


def _lightning_adapter(monkeypatch, **changes):
    """Lightning's adapter module with its Support replaced as ``changes`` say (a new object: checked afresh)."""
    pytest.importorskip("lightning")
    from asyncckpt.adapters.lightning import checkpoint_io

    monkeypatch.setattr(checkpoint_io, "SUPPORT", dataclasses.replace(checkpoint_io.SUPPORT, **changes))
    return checkpoint_io


def test_an_older_framework_release_than_the_oldest_tested_is_refused_at_construction(monkeypatch):
    io = _lightning_adapter(monkeypatch, oldest="9.0.0", newest="9.1.0")
    with pytest.raises(UnsupportedVersionError, match=r"supports lightning>=9\.0\.0 \(tested 9\.0\.0 to 9\.1\.0\); "
                                                      r"lightning 2\.\d+\.\d+ is installed and older"):
        io.AsyncCkptIO()
    with pytest.raises(UnsupportedVersionError, match="not installed"):
        versions.require(versions.Support(package="no-such-framework", extra="lightning", oldest="1", newest="1"))


def test_a_newer_release_whose_pinned_functions_are_unchanged_works_with_one_warning(monkeypatch):
    io = _lightning_adapter(monkeypatch, oldest="2.0.0", newest="2.0.0")  # as if the installed release were newer
    with pytest.warns(UserWarning, match=r"tested with lightning up to 2\.0\.0; the functions asyncckpt relies on are "
                                         r"unchanged in 2\.\d+\.\d+") as caught:
        io.AsyncCkptIO().teardown()
        io.AsyncCkptIO().teardown()
    assert len([w for w in caught if "tested with lightning" in str(w.message)]) == 1


def test_a_newer_release_that_changed_a_pinned_function_is_refused_naming_it(monkeypatch):
    pytest.importorskip("lightning")
    from asyncckpt.adapters.lightning.support import SUPPORT

    copied_target, relied_target = next(iter(SUPPORT.copied)), next(iter(SUPPORT.relied_on))
    copied = {**SUPPORT.copied, copied_target: versions.Copied("somewhere.py", ("0000000000000000",))}
    relied_on = {**SUPPORT.relied_on, relied_target: versions.Called("(self, something_else)")}
    io = _lightning_adapter(monkeypatch, oldest="2.0.0", newest="2.0.0", copied=copied, relied_on=relied_on)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not warned
        with pytest.raises(UnsupportedVersionError) as refused:
            io.AsyncCkptIO()
    message = str(refused.value)
    assert f"{copied_target} (code changed" in message and "reproduced in somewhere.py" in message
    assert f"{relied_target} (parameters (self), tested (self, something_else))" in message
    assert message.count("(code changed") + message.count("(parameters") == 2  # only those two
    assert f"{versions.ALLOW_CHANGED_ENV}=lightning" in message  # the way to go ahead at one's own risk


def test_a_newer_release_is_judged_by_code_and_feature_and_can_be_allowed(tmp_path):
    """An edited docstring or comment is accepted (one warning); a changed FSDP-only function refuses FSDP alone
    (DDP saves stay asynchronous, FSDP saves are Accelerate's own, with one warning naming it), unless
    ASYNCCKPT_ALLOW_CHANGED allows it (one warning naming it); a changed essential function refuses the adapter."""
    pytest.importorskip("accelerate")
    from dist_helper import run_on_ranks
    from edited_release import EDITS, edited_release, save_with_the_edited_release

    variants = list(EDITS)
    for variant in variants:
        edited_release(tmp_path / variant, EDITS[variant])
    docstrings, fsdp, allowed, essential = run_on_ranks(save_with_the_edited_release, len(variants), variants,
                                                        tmp_path, init_process_group=False, timeout=300)
    assert docstrings["ddp"] and docstrings["fsdp"]
    assert len(docstrings["warnings"]) == 1 and "unchanged in 1.99.0" in docstrings["warnings"][0]
    assert fsdp["ddp"] and not fsdp["fsdp"]
    assert len(fsdp["warnings"]) == 1 and "its FSDP support" in fsdp["warnings"][0]
    assert "save_fsdp_optimizer (code changed" in fsdp["warnings"][0] and "synchronously" in fsdp["warnings"][0]
    assert allowed["ddp"] and allowed["fsdp"]
    assert len(allowed["warnings"]) == 1 and "at your own risk" in allowed["warnings"][0]
    assert "save_fsdp_optimizer (code changed" in allowed["warnings"][0]
    assert "Accelerator.save_state (code changed" in essential["refused"]
    assert f"{versions.ALLOW_CHANGED_ENV}=accelerate" in essential["refused"]
