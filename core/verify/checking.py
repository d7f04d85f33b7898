"""A checkpoint checked against its checksums before anything is loaded from it, on one rank or on every rank.

``require_intact`` checks it alone; ``load_while_checking`` checks it on a thread while the framework's own load
reads the same pages, so the disk is read once. Either way a problem found on any rank raises on every rank
(``everywhere``), naming the damaged files (``integrity``; docs/DESIGN.md, "Verified resumes").
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, TypeVar

from asyncckpt.core.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.core.snapshot.collectives import any_rank
from asyncckpt.core.snapshot.dist_env import rank_and_world
from asyncckpt.core.storage import file_checksums
from asyncckpt.core.storage import object_store as object_store_module
from asyncckpt.core.verify import integrity

T = TypeVar("T")


def require_intact(path: str, *, group: Any, object_store: Any, everywhere: bool = False,
                   check_file: integrity.FileCheck = file_checksums.problem) -> integrity.Report:
    """Check a checkpoint against its checksums (``integrity``) before anything is loaded from
    it; raise ``CorruptCheckpointError`` naming the files (and keys) that are damaged. With
    ``everywhere`` (a collective: every rank calls it), the ranks check the data files of a
    sharded checkpoint side by side, and a problem found on any rank raises on every rank.
    ``check_file`` checks each file that has a checksum (a resume's loads the file for the
    framework while hashing it: ``asyncckpt.core.integration.resume``)."""
    report, error = _check(path, group, object_store, everywhere, check_file)
    _raise_if_damaged(path, error, group, everywhere)
    return report


def load_while_checking(path: str, load: Callable[[], T], *, group: Any, object_store: Any, everywhere: bool = False,
                        after_load: Callable[[], None] = lambda: None) -> T:
    """``load()`` (a framework's own load of the checkpoint ``path`` into its objects, in place) while a
    thread checks ``path`` as ``require_intact`` does, over the pages the load reads: the disk is read
    once and the two overlap. Its result, or ``CorruptCheckpointError`` once the load is over (what it
    loaded in place is then not to be trained on: the error ends the resume). With ``everywhere``, the
    ranks' outcomes are agreed after the load, on the calling thread, after the framework's collectives.
    ``after_load`` runs once the load and the check are over, before the ranks agree."""
    outcome: list[Optional[BaseException]] = []

    def check() -> None:
        try:
            outcome.append(_check(path, group, object_store, everywhere, file_checksums.problem)[1])
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread, as require_intact would
            outcome.append(e)

    thread = threading.Thread(target=check, name="asyncckpt-resume-check", daemon=True)
    thread.start()
    try:
        result = load()
    except Exception:
        thread.join()
        if isinstance(outcome[0], CheckpointError):  # the load failed on damaged bytes: say which
            raise outcome[0] from None
        raise
    finally:
        thread.join()
        after_load()
    _raise_if_damaged(path, outcome[0], group, everywhere)
    return result


def _check(path: str, group: Any, object_store: Any, everywhere: bool, check_file: integrity.FileCheck
           ) -> tuple[Optional[integrity.Report], Optional[CheckpointError]]:
    """This rank's share of the check of ``path``: (its report, or the error naming what is damaged)."""
    rank, world = rank_and_world(group) if everywhere else (0, 1)
    try:
        with object_store_module.using(object_store):
            return integrity.require_intact(path, share=(rank, world), check_file=check_file), None
    except CheckpointError as e:
        return None, e


def _raise_if_damaged(path: str, error: Optional[BaseException], group: Any, everywhere: bool) -> None:
    """Raise ``error``; with ``everywhere`` (a collective), on every rank if any rank has one."""
    if everywhere and any_rank(error is not None, group) and error is None:
        error = CorruptCheckpointError(f"checkpoint {path} is damaged (found on another rank: its error names "
                                       "the files)", path=path)
    if error is not None:
        raise error
