"""Fixtures shared by several test modules: the S3 server (started once per session, on first use), and slowed
overlapped snapshots."""
import time

import pytest

from s3_server import s3_root, s3_server  # noqa: F401 - fixtures


@pytest.fixture
def slow_overlapped_snapshots(monkeypatch):
    """The snapshots an adapter leaves to the snapshot thread (``overlap_optimizer``) start 0.3 s late, so that the
    next optimizer step always arrives first: a step that did not wait for them would tear them."""
    from asyncckpt.core.integration import saving

    original = saving.finish

    def slow_finish(checkpointer, tx, *, stage_later=None, **kwargs):
        def slowly():
            time.sleep(0.3)
            stage_later()

        return original(checkpointer, tx, stage_later=slowly if stage_later else None, **kwargs)

    monkeypatch.setattr(saving, "finish", slow_finish)
