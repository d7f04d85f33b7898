"""Every live Checkpointer is drained when the process exits: nothing ``async_save`` accepted is lost.

Also: waiting, from anywhere in the process, for a path still being saved (``wait_for``), and starting a
Checkpointer's writer at the first optimizer step (``start_at_first_step``).

More: docs/MODULES.md, core/api/lifecycle.py.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from multiprocessing import util
from typing import Any, Callable, Optional

from torch.optim.optimizer import register_optimizer_step_pre_hook

from asyncckpt.core.storage.backend import is_url

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
_registered_in: Optional[int] = None
_drained_in: Optional[int] = None


def track(checkpointer: Any) -> None:
    """Drain ``checkpointer`` at exit unless it was closed before (held weakly)."""
    global _registered_in
    _live.add(checkpointer)
    if _registered_in != os.getpid():  # once per process (a fork inherits the parent's atexit list, not its finalizers)
        _registered_in = os.getpid()
        atexit.register(drain_at_exit)
        util.Finalize(None, drain_at_exit, exitpriority=100)


def forget(checkpointer: Any) -> None:
    _live.discard(checkpointer)


def live() -> list[Any]:
    return list(_live)


def wait_for(path: str) -> None:
    """Wait for every save of ``path`` still in flight in this process (any live Checkpointer): a
    framework reading a checkpoint through its own functions right after saving it reads it whole."""
    for checkpointer in live():
        checkpointer.wait_for(path)


def waiting_reader(original: Callable, *, path_at: int = 0) -> Callable:
    """``original``, a framework's reader of a checkpoint (its positional argument ``path_at`` the
    path), made to wait first for a save of that path still in flight in this process (``wait_for``).
    URLs pass through."""
    def read(*args: Any, **kwargs: Any) -> Any:
        path = args[path_at] if len(args) > path_at else None
        if isinstance(path, (str, os.PathLike)) and not is_url(path):
            wait_for(os.path.abspath(os.fspath(path)))
        return original(*args, **kwargs)

    return read


def drain_at_exit() -> None:
    global _drained_in
    if _drained_in == os.getpid():
        return
    _drained_in = os.getpid()
    failed = False
    for checkpointer in list(_live):
        try:
            checkpointer.close()
        except BaseException as e:  # nothing to raise to at exit: report it
            print(f"asyncckpt: at exit: {e}", file=sys.stderr)
            failed = True
    if failed:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        logging.shutdown()
        os._exit(1)


def start_at_first_step(checkpointer: Any) -> Any:
    """Register an optimizer step pre-hook that starts ``checkpointer``'s writer at the first step
    (``Checkpointer.start(at_first_step=True)``) and does nothing after; returns its handle: torch runs the global
    hooks from its dict, which a hook may not change, so ``teardown`` removes it. Held weakly: a Checkpointer that
    is gone starts nothing."""
    target_of = weakref.ref(checkpointer)
    started = False

    def hook(*_: Any) -> None:
        nonlocal started
        target = target_of()
        if not started and target is not None and not target.closed:
            started = True
            target.start()

    return register_optimizer_step_pre_hook(hook)
