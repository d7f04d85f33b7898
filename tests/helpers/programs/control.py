"""What a test asks of a training program: ``python PROGRAM MODE ROOT [NAME=VALUE...]``.

MODE: ``run`` trains on (100,000 steps: until killed or interrupted), saving at every step; ``once`` trains one
step and saves; ``resume`` resumes from the newest checkpoint and stops there. Accelerate, in ``once`` and
``resume``, loads the newest checkpoint, then trains one step and saves (it refuses to number over a checkpoint).
The program prints ``START <step>`` when training starts, ``SAVED <name>`` each time a save call returned, and
``READY`` at the save of step 3 (rotation has started).

Settings: from the environment, each overridden by a ``NAME=VALUE`` argument (a run forked from a zygote shares
the zygote's environment). ``SEED``: torch's (0). ``WIDTHS``: the model's hidden layers ("1024,512"). ``KEEP``:
how many checkpoints the framework keeps (all unless set). ``KILL_AT``: SIGKILL from inside, with no scheduling
delay: "saved" once the first save returned, "next step" once the step after it began. ``REFERENCE``: a file for
the state the first save holds, saved natively (the benchmark's kill trials).
"""
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/helpers: toy.py

import toy  # noqa: E402

mode, root = sys.argv[1], sys.argv[2]
settings = {**os.environ, **dict(argument.split("=", 1) for argument in sys.argv[3:])}
assert mode in ("run", "once", "resume"), mode
steps = 1 if mode == "once" else 100000  # a resumed run stops at its start
keep = int(settings["KEEP"]) if settings.get("KEEP") else None
torch.manual_seed(int(settings.get("SEED", "0")))


def model() -> torch.nn.Sequential:
    return toy.body(*(int(width) for width in settings.get("WIDTHS", "1024,512").split(",")))


def die_if_asked(point: str) -> None:
    if settings.get("KILL_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def keep_reference(net, optimizer) -> None:
    if settings.get("REFERENCE"):
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, settings.pop("REFERENCE"))


def announce(step: int) -> None:
    if step == 3:
        print("READY", flush=True)
