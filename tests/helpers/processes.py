"""Programs the kill tests run, with their output in files.

Never in pipes: a training process's background writer inherits its stdout and stderr, so a writer
that outlives its killed training process would hold a pipe open, and a test reading the pipe to its
end would hang instead of failing its check that no writer is left.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import time
from pathlib import Path

_numbers = itertools.count()


class Program(subprocess.Popen):
    """``subprocess.Popen`` of ``argv`` with stdin from /dev/null and stdout and stderr in files
    under ``logs`` (``out_path``, ``err_path``), read back line by line."""

    def __init__(self, argv: list[str], logs: str | os.PathLike, **popen) -> None:
        logs = Path(logs)
        logs.mkdir(parents=True, exist_ok=True)
        number = next(_numbers)
        self.out_path, self.err_path = logs / f"program-{number}.out", logs / f"program-{number}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            super().__init__(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, **popen)
        self._read = 0  # lines already taken by ``next_line``

    def lines(self) -> list[str]:
        """The complete lines it printed so far (a line still being written is not one yet)."""
        text = self.out_path.read_text(errors="replace")
        return [line.rstrip("\r") for line in text.split("\n")[:-1]]

    def error_output(self) -> str:
        return self.err_path.read_text(errors="replace")

    def next_line(self, timeout: float = 180) -> str:
        """The next line it prints; fails if it exits, or prints nothing more within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.poll() is not None  # before reading: what it printed before it exited is read next
            lines = self.lines()
            if len(lines) > self._read:
                self._read += 1
                return lines[self._read - 1]
            if exited:
                raise AssertionError(f"the program ended (exit {self.returncode}) without printing more:\n"
                                     f"{self.error_output()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the program printed nothing more in {timeout:.0f} s")
            time.sleep(0.01)

    def wait_for_line(self, wanted: str, timeout: float = 180) -> None:
        """Read its lines up to one that is ``wanted``."""
        deadline = time.monotonic() + timeout
        while self.next_line(max(0.0, deadline - time.monotonic())).strip() != wanted:
            pass
