"""Run one Python program many times without paying its imports each time.

Starting a training program costs its imports (torch and a framework: tens of seconds each on a busy
machine), more than the run itself in a test that starts it only to kill it and look at what is left on
disk. ``Zygote(modules)`` starts a process that imports ``modules`` once and then, for each
``run(script, *args)``, forks a child that runs ``script`` as ``python script *args`` would (or, for
``run(None, *args, module=name)``, as ``python -m name *args`` would): a module ``__main__`` of its own,
``sys.argv``, ``sys.path[0]``, stdin from /dev/null, stderr to a file, and the interpreter's normal exit
(atexit hooks, non-daemon threads) when the script ends. Its stdout is the zygote's, line by line. A run
counts as exited once it and every process it started (a background writer) have exited and been
reaped: the next run never meets a process of the last one, not even a zombie.

Only for tests whose point does not need a fresh interpreter: the child shares the imported modules'
state as it was after import. The zygote refuses to fork if importing started a thread (a fork copies
only the forking thread; locks held by the others would stay held).

Run as a program, this file is the zygote: ``python zygote.py MODULE...``; it reads one JSON request a
line (``{"argv": [...], "module": name or null, "stderr": path, "cwd": path or null, "new_session": bool}``),
answers ``ZYGOTE started PID``, then ``ZYGOTE exited PID CODE`` (CODE as ``Popen.returncode``: negative for a
signal) once that child and what it started have ended.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

READY, STARTED, EXITED = "ZYGOTE ready", "ZYGOTE started", "ZYGOTE exited"
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


class ForkedRun:
    """One run of the program in a forked child: its stdout lines, its kill and its exit code."""

    def __init__(self, zygote: Zygote, pid: int, stderr_path: Path, own_group: bool):
        self.zygote, self.pid, self.stderr_path, self.own_group = zygote, pid, stderr_path, own_group
        self.returncode: int | None = None

    def read_line(self, timeout: float) -> str | None:
        """The child's next stdout line, or None once it has exited."""
        if self.returncode is not None:
            return None
        line = self.zygote.next_line(timeout)
        last, exited, code = line.partition(f"{EXITED} {self.pid} ")  # after a last line without its newline
        if exited:
            self.returncode = int(code)
            return last or None
        return line

    def wait_for_line(self, text: str, timeout: float = 300) -> None:
        """Read the child's stdout up to a line ``text``; fail with its stderr if it exits first."""
        while (line := self.read_line(timeout)) is not None:
            if line == text:
                return
        raise AssertionError(f"the program exited ({self.returncode}) before printing {text!r}:\n"
                             f"{self.stderr()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the child (its process group, where it has one of its own), unless it is known to have
        exited (the zygote reaps it at once)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # exited, not yet read from the zygote
                if self.own_group:
                    os.killpg(self.pid, signal.SIGKILL)
                else:
                    os.kill(self.pid, signal.SIGKILL)

    def remaining_lines(self, timeout: float = 300) -> list[str]:
        """The child's stdout lines up to its exit (then ``returncode`` is set)."""
        lines = []
        while (line := self.read_line(timeout)) is not None:
            lines.append(line)
        return lines

    def wait(self, timeout: float = 300) -> int:
        """The child's exit code, as ``Popen.returncode``; its remaining stdout lines are dropped."""
        self.remaining_lines(timeout)
        return self.returncode

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""


class Zygote:
    """A process that imported ``modules`` and forks one run of a program at a time (a context manager)."""

    def __init__(self, modules: list[str], env: dict[str, str], workdir: Path, timeout: float = 600):
        self.workdir, self._runs, self._last_run = workdir, 0, None
        self._stderr = open(workdir / "zygote.stderr", "w+")
        self._proc = subprocess.Popen([sys.executable, __file__, *modules], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        line = self.next_line(timeout)
        while line != READY:
            line = self.next_line(timeout)

    def _read_stdout(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next_line(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output from the zygote or its child within {timeout:.0f}s") from None
        if line is None:
            self._lines.put(None)  # every later read sees the end too
            self._stderr.seek(0)
            raise AssertionError(f"the zygote exited ({self._proc.wait()}):\n{self._stderr.read()[-3000:]}")
        return line

    def run(self, script: Path | None, *args: str, module: str | None = None, cwd: Path | None = None,
            new_session: bool = False, timeout: float = 300) -> ForkedRun:
        """Fork a child that runs ``script`` with ``args`` (or ``python -m module args`` where ``script`` is
        None), in ``cwd`` (the zygote's where None), in a session and process group of its own with
        ``new_session`` (as ``Popen(start_new_session=True)``); returns once it has started."""
        self._runs += 1
        stderr_path = self.workdir / f"run-{self._runs}.stderr"
        request = {"argv": [str(script or module), *map(str, args)], "module": module, "stderr": str(stderr_path),
                   "cwd": str(cwd) if cwd else None, "new_session": new_session}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self.next_line(timeout)
        while not line.startswith(f"{STARTED} "):
            line = self.next_line(timeout)
        self._last_run = ForkedRun(self, int(line.split()[-1]), stderr_path, new_session)
        return self._last_run

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc_info) -> None:
        if self._last_run is not None:  # a test that failed half way leaves no program running on
            self._last_run.kill()
        self._proc.stdin.close()  # the zygote's loop ends
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()


def _run_as_main(request: dict) -> None:
    """In the forked child: become ``python argv[0] argv[1:]``; ends with SystemExit (the normal exit)."""
    # Ctrl-C raises KeyboardInterrupt, as in a program started from a terminal, however the tests were started:
    # a shell's background job (`cmd &`) ignores SIGINT, and an ignored SIGINT stays ignored in every child (once,
    # a Ctrl-C test's training then ran on for 5,000 steps and filled the disk).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["cwd"]:
        os.chdir(request["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    stderr = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(stderr, 2)
    os.close(devnull)
    os.close(stderr)
    sys.argv = list(request["argv"])
    if request["module"]:
        import runpy

        sys.path[0] = os.getcwd()  # as ``python -m`` has it
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        sys.exit(0)
    script = request["argv"][0]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    main = types.ModuleType("__main__")
    main.__file__ = script
    sys.modules["__main__"] = main
    exec(compile(Path(script).read_text(), script, "exec"), main.__dict__)
    sys.exit(0)


def _serve(modules: list[str]) -> None:
    import ctypes
    import importlib

    for module in modules:
        importlib.import_module(module)
    if threading.active_count() != 1:
        raise RuntimeError(f"importing {modules} started threads, a fork would not copy them: {threading.enumerate()}")
    # What a run leaves behind when it dies (its writer, killed with it) becomes our child, not init's: we reap
    # it, so a run has exited once every process it started has, and the next run finds them gone.
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    # What the imports made is shared with every child until written to: frozen, the children's garbage
    # collections (their exit's above all) do not touch it, so their exit costs no copy of it (1.1 s -> 0.4 s).
    gc.freeze()
    print(READY, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        set_up, tell_set_up = os.pipe()  # the child -> the zygote: its session is made
        go, tell_go = os.pipe()  # the zygote -> the child: STARTED is out, the run's own output may follow
        pid = os.fork()
        if pid == 0:
            os.close(set_up)
            os.close(tell_go)
            if request["new_session"]:
                os.setsid()
            os.close(tell_set_up)
            os.read(go, 1)  # returns at the zygote's close
            os.close(go)
            _run_as_main(request)
        os.close(tell_set_up)
        os.close(go)
        os.read(set_up, 1)  # returns at the child's close: once STARTED is out, its group can be signalled
        os.close(set_up)
        print(f"{STARTED} {pid}", flush=True)
        os.close(tell_go)
        code = None
        with contextlib.suppress(ChildProcessError):  # raised once no child is left
            while True:
                ended, status = os.waitpid(-1, 0)
                if ended == pid:
                    code = os.waitstatus_to_exitcode(status)
        print(f"{EXITED} {pid} {code}", flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])
