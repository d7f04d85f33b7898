"""The background writer processes started by given training processes (found by their command line,
which names the training process's pid), whether those still live or died: kill tests look for
writers left behind, or kill a writer too."""
from __future__ import annotations

import os
import time


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


def wait_until_gone(*pids: int, timeout: float = 60, what: str = "a writer outlived its training process") -> None:
    """Wait until no writer of ``pids`` runs (a killed training process's writer finishes or gives up its last
    work first); fail with ``what`` if one still runs after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while writers_of(*pids):
        assert time.monotonic() < deadline, f"{what}: {writers_of(*pids)}"
        time.sleep(0.1)


def limit_file_size(checkpointer, limit: int) -> None:
    """Give ``checkpointer``'s writer (started now if it is not running) a real ``RLIMIT_FSIZE`` of ``limit``
    bytes: its writes beyond it fail with EFBIG, as on a full disk (Python ignores SIGXFSZ, and the writer
    inherits that). Set from outside (``prlimit``) while the writer has no request, so it alone is limited,
    from its first write on; the training process, whose snapshot buffers are files too, is not."""
    import resource

    checkpointer.start()
    resource.prlimit(checkpointer.writer_pid(), resource.RLIMIT_FSIZE, (limit, limit))
