"""Writers that outlived their training process: the log they keep, and waiting for them.

More: docs/MODULES.md, core/storage/orphans.py.
"""
from __future__ import annotations

import logging
import os
import re
import time
from typing import Optional

from asyncckpt.core.storage import owners

LOG_NAME = ".asyncckpt-writer.log"
_LINE = re.compile(r"^\S+ writer (?P<token>\S+): (?P<event>finishing|committed|not committed|exiting|gave up)\b"
                   r"(?: (?P<what>[^\s:]+))?")
logger = logging.getLogger("asyncckpt.core")


def log_path(parent: str) -> str:
    return os.path.join(parent, LOG_NAME)


def note(parent: str, token: str, text: str) -> None:
    """Append one line to the log in ``parent`` (one ``write`` of a line opened for appending: lines
    of several writers never interleave), creating ``parent``: an orphan announces the first save
    into a new directory before that save has made it. Never raises: the log must not fail a save."""
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} writer {token}: {text}\n"
    try:
        os.makedirs(parent, exist_ok=True)
        fd = os.open(log_path(parent), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def at_work(parent: str) -> dict[str, list[str]]:
    """The orphaned writers still alive that said they are finishing something in ``parent``:
    token -> the names they are finishing."""
    try:
        with open(log_path(parent), encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return {}
    working: dict[str, list[str]] = {}
    for line in lines:
        match = _LINE.match(line.rstrip("\n"))
        if match is None:
            continue
        token, event = match["token"], match["event"]
        if event == "finishing":
            working.setdefault(token, []).append(match["what"] or "")
        elif event in ("exiting", "gave up"):
            working.pop(token, None)
    return {token: what for token, what in working.items() if owners.owner_alive(token) is True}


def wait_for_orphans(parent: str, timeout: float, poll_interval: float = 0.1) -> None:
    """Return once no orphaned writer is at work in ``parent`` (or after ``timeout`` seconds; each
    orphan bounds its own work by its save's timeout, so the wait is bounded twice). Logs one line
    when it has to wait."""
    working = at_work(parent)
    if not working:
        return
    names = sorted({name for what in working.values() for name in what})
    logger.warning("asyncckpt: waiting for %d background writer(s) of a previous run finishing %s in %s",
                   len(working), ", ".join(names), parent)
    deadline = time.monotonic() + timeout
    while working and time.monotonic() < deadline:
        time.sleep(poll_interval)
        working = at_work(parent)


def finishing(parent: str, name: str) -> Optional[str]:
    """The token of a live orphan finishing ``name`` in ``parent``, if there is one (``asyncckpt ls``)."""
    for token, what in at_work(parent).items():
        if name in what:
            return token
    return None
