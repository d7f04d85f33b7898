"""Fixtures shared by several test modules: the S3 server (started once per session, on first use), and slowed
overlapped snapshots; and, for the suite's worker processes (pytest-xdist, ``--dist loadgroup``: pyproject.toml),
the tests of a module that share a module-scoped fixture kept on one worker, which makes that fixture once."""
import time

import pytest

from s3_server import s3_root, s3_server  # noqa: F401 - fixtures


@pytest.fixture
def slow_overlapped_snapshots(monkeypatch):
    """The snapshots an adapter leaves to the staging thread (``overlap_optimizer``) start 0.3 s late, so that the
    next optimizer step always arrives first: a step that did not wait for them would tear them."""
    from asyncckpt.core.integration import saving

    original = saving.finish

    def slow_finish(checkpointer, tx, *, stage_later=None, **kwargs):
        def slowly():
            time.sleep(0.3)
            stage_later()

        return original(checkpointer, tx, stage_later=slowly if stage_later else None, **kwargs)

    monkeypatch.setattr(saving, "finish", slow_finish)


def pytest_collection_modifyitems(config, items):
    """Every test that uses a fixture of module scope (an expensive setup its module's tests share) goes with the
    other tests of its module to one worker (``xdist_group``); the other tests go to whichever worker is free. (A
    test that asks for one with ``request.getfixturevalue`` names its group itself.)"""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        if any(definition.scope == "module" for name in info.names_closure
               for definition in info.name2fixturedefs.get(name, ())):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
