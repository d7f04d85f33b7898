"""The background writer processes started by given training processes (found by their command line,
which names the training process's pid), whether those still live or died: kill tests look for
writers left behind, or kill a writer too."""
from __future__ import annotations

import os


def writers_of(*pids: int) -> list[int]:
    wanted = {str(pid).encode() for pid in pids}
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"asyncckpt.core.writer.process" in argv and wanted & set(argv):
            found.append(int(entry))
    return found
