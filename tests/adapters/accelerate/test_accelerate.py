"""The Accelerate adapter with the real ``accelerate.Accelerator`` (CPU).

Subprocess tests run real training programs (the example, a kill -9, two processes with
torchrun's env:// rendezvous); in-process tests cover the rest. Everything is small: the whole file takes
about 1.5 minutes on 2 busy shared cores.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from asyncckpt.adapters.accelerate import enable_async_checkpointing  # noqa: E402
from asyncckpt.core import CheckpointWriteError, is_complete  # noqa: E402
from asyncckpt.core.integration import saving  # noqa: E402
from writers import limit_file_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "accelerate_min.py"
ADDED = "# <- the only added"  # how the example marks its two lines: the plain program is the example without them


def _plain_example() -> str:
    """The plain Accelerate program the example was made from: its two added lines commented out."""
    return "\n".join(f"# {line}" if ADDED in line else line for line in EXAMPLE.read_text().splitlines()) + "\n"
COMMIT_RECORD = ".asyncckpt-commit.json"


# ------------------------------------------------------------------------------------------ helpers
def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _run(args: list, cwd: Path, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=_env(**env), capture_output=True,
                            text=True, timeout=timeout)
    return result


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-4000:]}"
    return result.stdout


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flat(value, f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flat(value, f"{prefix}/{i}")
    else:
        yield prefix, obj


def assert_same_state(a: Path, b: Path) -> None:
    """Weights (model*.safetensors) and optimizer state (optimizer*.bin) bitwise equal."""
    for name in sorted(p.name for p in a.iterdir() if p.name.startswith("model") and p.suffix == ".safetensors"):
        wa, wb = load_file(a / name), load_file(b / name)
        assert wa.keys() == wb.keys(), name
        for key in wa:
            assert torch.equal(wa[key], wb[key]), f"{name}:{key} differs"
    optimizers = sorted(p.name for p in a.iterdir() if p.name.startswith("optimizer"))
    assert optimizers, f"no optimizer file in {a}"
    for name in optimizers:
        oa, ob = dict(_flat(torch.load(a / name))), dict(_flat(torch.load(b / name)))
        assert oa.keys() == ob.keys(), name
        for key, x in oa.items():
            y = ob[key]
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), f"{name}:{key} differs"


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def _fresh_accelerator(project_dir: Path, **config) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    config.setdefault("automatic_checkpoint_naming", True)
    return Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project_dir), **config))


def _train_objects(acc: Accelerator, width: int = 16, seed: int = 0):
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    model, opt, sched = acc.prepare(model, opt, sched)

    def step():
        x = torch.randn(16, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()

    return model, opt, step


@pytest.fixture
def handles():
    """Collects adapter handles and removes them at the end of a test (drains the writers)."""
    made = []
    yield made
    for handle in made:
        try:
            handle.remove()
        except Exception:
            pass


# ------------------------------------------------------------------------------- the example
def test_example_is_a_plain_program_with_two_lines_added():
    added = [line for line in EXAMPLE.read_text().splitlines() if ADDED in line]
    assert len(added) == 2 and added[0].startswith("from asyncckpt.adapters.accelerate import enable_async_checkpointing")
    assert added[1].startswith("enable_async_checkpointing(acc)")
    assert "asyncckpt" not in "".join(line for line in _plain_example().splitlines() if not line.startswith("#"))


def test_example_resumes_and_matches_native_bitwise(tmp_path):
    """accelerate_min.py 2 then 4 with the adapter == the plain program 2 then 4: weights and optimizer
    bitwise, same files, same printed losses (resume fidelity against an uninterrupted run: below)."""
    plain = tmp_path / "plain_example.py"
    plain.write_text(_plain_example())

    def chain(name):
        (tmp_path / name).mkdir()
        return [_ok(_run([EXAMPLE if name == "async" else plain, n], tmp_path / name)) for n in (2, 4)]

    with ThreadPoolExecutor(2) as pool:
        native = pool.submit(chain, "native")
        ours_out = chain("async")
        native_out = native.result()
    assert "epoch 2" in ours_out[1] and "epoch 0" not in ours_out[1]  # the 2nd run resumed
    assert ours_out == native_out  # same losses, printed to 4 digits
    ours, theirs = tmp_path / "async" / "accrun", tmp_path / "native" / "accrun"
    assert listing(ours / "checkpoints") == listing(theirs / "checkpoints") == ["checkpoint_2", "checkpoint_3"]
    assert listing(ours) == ["checkpoints"]  # no staging directory left anywhere
    for ckpt in ("checkpoint_2", "checkpoint_3"):
        assert is_complete(str(ours / "checkpoints" / ckpt))
        assert set(listing(ours / "checkpoints" / ckpt)) - {COMMIT_RECORD} == set(listing(theirs / "checkpoints" / ckpt))
    assert_same_state(ours / "checkpoints" / "checkpoint_3", theirs / "checkpoints" / "checkpoint_3")


@pytest.mark.parametrize("options, overlapped", [({}, False), ({"inline_bytes": 512}, True),
                                                  ({"overlap_optimizer": False, "inline_bytes": 512}, False)],
                         ids=["default", "overlap", "no-overlap"])  # default: optimizer.bin below inline_bytes
def test_resume_fidelity_n_then_2n_equals_2n_uninterrupted(tmp_path, handles, options, overlapped):
    """N steps + save (async) + a new run that loads and continues to 2N == 2N steps uninterrupted (native),
    bitwise: weights, Adam state, scheduler, and the data (drawn from the global RNG, restored from the
    per-process RNG file)."""
    n = 4

    def build(project, seed, adapter):
        acc = _fresh_accelerator(project, total_limit=2)
        if adapter:
            handles.append(enable_async_checkpointing(acc, **options))
        _, _, step = _train_objects(acc, seed=seed)
        return acc, step

    acc, step = build(tmp_path / "straight", 0, adapter=False)
    for _ in range(2 * n):
        step()
    acc.save_state()

    acc, step = build(tmp_path / "resumed", 0, adapter=True)
    for _ in range(n):
        step()
    acc.save_state()
    assert handles[-1].checkpointer.snapshot_thread.busy == overlapped  # overlap: optimizer.bin is snapshot after the call
    acc, step = build(tmp_path / "resumed", 123, adapter=True)  # different init and RNG until load_state
    acc.load_state()
    checkpointer = handles[-1].checkpointer
    assert checkpointer.writer_pid() is None  # its start-up would have shared the cores with the load: it starts at the first step
    for _ in range(n):
        step()
        assert checkpointer.writer_pid() is not None
    acc.save_state()
    handles[-1].wait()
    assert_same_state(tmp_path / "resumed" / "checkpoints" / "checkpoint_1",
                      tmp_path / "straight" / "checkpoints" / "checkpoint_0")
    sched = [torch.load(tmp_path / p, weights_only=False) for p in
             ("resumed/checkpoints/checkpoint_1/scheduler.bin", "straight/checkpoints/checkpoint_0/scheduler.bin")]
    assert sched[0] == sched[1]


# --------------------------------------------------------------------------------- kill -9 mid-save
KILL_SCRIPT = textwrap.dedent("""
    import glob, os, sys, signal, threading, time, torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from asyncckpt.adapters.accelerate import enable_async_checkpointing
    set_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir="run", automatic_checkpoint_naming=True,
                                                                   total_limit=2))
    handle = enable_async_checkpointing(acc)
    model = torch.nn.Sequential(torch.nn.Linear(1448, 1448), torch.nn.Linear(1448, 4))   # ~25 MB with Adam
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    def step():
        loss = model(torch.randn(4, 1448)).square().mean(); acc.backward(loss); opt.step(); opt.zero_grad()
    if sys.argv[1] == "crash":
        step(); acc.save_state(); handle.wait()            # checkpoint_0 committed
        # The writer is fast (~2 GB/s here): freeze it once the first file of checkpoint_1 is complete, so
        # that the kill lands mid-save every time. Both processes die (a writer outlives its training
        # process and would finish the save: this is the loss of both, as when a node goes down).
        writer, frozen = handle.checkpointer.writer_pid(), threading.Event()
        def freeze_writer_mid_save():
            while True:
                for staging in glob.glob("run/.checkpoint_1.asyncckpt-staging-*"):
                    if "model.safetensors" in os.listdir(staging):
                        os.kill(writer, signal.SIGSTOP); frozen.set(); return
                time.sleep(0.0005)
        threading.Thread(target=freeze_writer_mid_save, daemon=True).start()
        step(); acc.save_state()                           # checkpoint_1: snapshot taken, write in flight
        assert frozen.wait(60)
        print("KILL", flush=True)
        os.kill(writer, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    acc.load_state()                                       # the newest *complete* checkpoint
    print("RESUMED iteration", acc.project_configuration.iteration, flush=True)
    w = acc.unwrap_model(model)[0].weight.detach().clone()
    step(); acc.save_state(); acc.end_training()
    torch.save(w, "loaded_weight.pt")
""")


def test_kill9_of_trainer_and_writer_mid_save_then_resume_from_last_complete(tmp_path):
    (tmp_path / "kill.py").write_text(KILL_SCRIPT)
    crashed = _run(["kill.py", "crash"], tmp_path)
    assert crashed.returncode == -9 and "KILL" in crashed.stdout, crashed.stderr[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    # The torn save is invisible: checkpoints/ holds only the committed checkpoint_0; the torn one is a
    # hidden staging directory next to checkpoints/ (outside anything Accelerate or the user lists).
    assert listing(ckpts) == ["checkpoint_0"] and is_complete(str(ckpts / "checkpoint_0"))
    torn = [n for n in listing(tmp_path / "run") if n.startswith(".checkpoint_1.asyncckpt-staging-")]
    assert len(torn) == 1 and "model.safetensors" in listing(tmp_path / "run" / torn[0]), listing(tmp_path / "run")
    assert COMMIT_RECORD not in listing(tmp_path / "run" / torn[0])
    out = _ok(_run(["kill.py", "resume"], tmp_path))
    assert "RESUMED iteration 1" in out  # #3306 fix: continues after checkpoint_0, no "already exists"
    loaded = torch.load(tmp_path / "loaded_weight.pt")
    assert torch.equal(loaded, load_file(ckpts / "checkpoint_0" / "model.safetensors")["0.weight"])
    assert listing(ckpts) == ["checkpoint_0", "checkpoint_1"] and is_complete(str(ckpts / "checkpoint_1"))
    assert not any(n.startswith(".") for n in listing(tmp_path / "run"))  # the stale staging dir was removed


# ------------------------------------------------------------------------------------ 2 processes
TWO_PROC_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader, TensorDataset
    epochs, mode = int(sys.argv[1]), sys.argv[2]
    set_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir="run", automatic_checkpoint_naming=True,
                                                                   total_limit=2))
    if mode == "async":
        from asyncckpt.adapters.accelerate import enable_async_checkpointing
        handle = enable_async_checkpointing(acc, inline_bytes=4096)   # so that this small model's files spread
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(128, 64); dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    model, opt, dl = acc.prepare(model, opt, dl)
    start = 0
    if os.path.isdir("run/checkpoints") and os.listdir("run/checkpoints"):
        acc.load_state()
        start = max(int(d.rsplit("_", 1)[1]) for d in os.listdir("run/checkpoints")) + 1
        assert mode == "native" or acc.project_configuration.iteration == start   # the adapter's #3306 fix
        acc.project_configuration.iteration = start      # natively by hand, as in the shared example
    for epoch in range(start, epochs):
        for xb, yb in dl:
            loss = torch.nn.functional.mse_loss(model(xb), yb); acc.backward(loss); opt.step(); opt.zero_grad()
        acc.save_state()
        if mode == "async":
            print(f"RANK {acc.process_index} EPOCH {epoch} WROTE {','.join(handle.last_written)}", flush=True)
    acc.end_training()
""")


def _launch_two(script: Path, cwd: Path, *args) -> str:
    """What torchrun does for 2 local processes (env:// rendezvous), without its agent process."""
    from dist_helper import free_port

    port, procs, logs = str(free_port()), [], []
    for rank in range(2):
        out, err = (open(cwd / f"rank{rank}.{kind}", "w+") for kind in ("out", "err"))
        logs.append((out, err))
        procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], cwd=cwd, text=True,
                                      stdout=out, stderr=err,
                                      env=_env(ACCELERATE_USE_CPU="true", RANK=str(rank), LOCAL_RANK=str(rank),
                                               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=port)))
    try:
        for proc in procs:
            proc.wait(timeout=180)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    outputs = []
    for proc, (out, err) in zip(procs, logs):
        out.seek(0), err.seek(0)
        outputs.append(_ok(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())))
        out.close(), err.close()
    return "".join(outputs)


def test_two_processes_resume_matches_native(tmp_path):
    """2 CPU processes (DDP, as under torchrun), the adapter: 2 epochs, then resume to 4 == 4 epochs uninterrupted
    without the adapter, bitwise. (No shuffling: Accelerate does not save the synchronised shuffling
    generator of a multi-process dataloader, so even natively a shuffled resumed run differs.)"""
    script = tmp_path / "two.py"
    script.write_text(TWO_PROC_SCRIPT)
    (tmp_path / "async").mkdir()
    (tmp_path / "native").mkdir()
    with ThreadPoolExecutor(1) as pool:
        native = pool.submit(_launch_two, script, tmp_path / "native", 4, "native")
        first = _launch_two(script, tmp_path / "async", 2, "async")
        second = _launch_two(script, tmp_path / "async", 4, "async")
        native.result()
    # Per-process RNG files from each process; the big replicated files spread over both processes.
    assert re.search(r"RANK 0 EPOCH 0 WROTE .*optimizer\.bin", first), first
    assert re.search(r"RANK 1 EPOCH 0 WROTE model\.safetensors,random_states_1\.pkl$", first, re.M), first
    assert "EPOCH 2" in second and "EPOCH 0" not in second  # resumed
    ours = tmp_path / "async" / "run" / "checkpoints"
    assert listing(ours) == ["checkpoint_2", "checkpoint_3"]
    native_files = set(listing(tmp_path / "native" / "run" / "checkpoints" / "checkpoint_3"))
    assert set(listing(ours / "checkpoint_3")) - {COMMIT_RECORD} == native_files
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= native_files
    assert_same_state(ours / "checkpoint_3", tmp_path / "native" / "run" / "checkpoints" / "checkpoint_3")
    for rank in (0, 1):
        a = torch.load(ours / "checkpoint_3" / f"random_states_{rank}.pkl", weights_only=False)
        b = torch.load(tmp_path / "native" / "run" / "checkpoints" / "checkpoint_3" / f"random_states_{rank}.pkl",
                       weights_only=False)
        assert torch.equal(a["torch_manual_seed"], b["torch_manual_seed"]) and a["step"] == b["step"]


# -------------------------------------------------------------------------------------- in-process
def test_resume_with_total_limit_without_setting_iteration(tmp_path, handles):
    """accelerate #3306: natively, a resumed run restarts at checkpoint_0, deletes newer checkpoints and
    fails with "already exists". With the adapter's load hook it continues at checkpoint_3."""
    acc = _fresh_accelerator(tmp_path / "p", total_limit=2)
    handles.append(enable_async_checkpointing(acc))
    _, _, step = _train_objects(acc)
    for _ in range(3):
        step()
        acc.save_state()
    handles[-1].wait()
    ckpts = tmp_path / "p" / "checkpoints"
    assert listing(ckpts) == ["checkpoint_1", "checkpoint_2"]

    acc = _fresh_accelerator(tmp_path / "p", total_limit=2)  # a new run, iteration back at 0
    handles.append(enable_async_checkpointing(acc))
    _, _, step = _train_objects(acc)
    acc.load_state()
    assert acc.project_configuration.iteration == 3
    step()
    assert acc.save_state() == ckpts / "checkpoint_3"
    handles[-1].wait()
    assert listing(ckpts) == ["checkpoint_2", "checkpoint_3"]  # the oldest went, after checkpoint_3 committed

    # The same resume natively (what the issue is about): checkpoint_2 (newer) deleted, then the error.
    acc = _fresh_accelerator(tmp_path / "p", total_limit=2)
    _, _, step = _train_objects(acc)
    acc.load_state()
    assert acc.project_configuration.iteration == 0
    acc.save_state()  # checkpoint_0 again, after deleting checkpoint_2 (newer than what it writes)
    assert listing(ckpts) == ["checkpoint_0", "checkpoint_3"]
    with pytest.raises(ValueError, match="checkpoint_3 .* already exists"):
        for _ in range(5):
            acc.save_state()


def test_tied_weights_stay_tied_and_match_native(tmp_path, handles):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.head = torch.nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    def run(project: Path, use_adapter: bool) -> Accelerator:
        acc = _fresh_accelerator(project)
        if use_adapter:
            handles.append(enable_async_checkpointing(acc))
        set_seed(0)
        model = Tied()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        loss = model(torch.randint(0, 50, (4, 3))).logsumexp(-1).mean()
        acc.backward(loss)
        opt.step()
        acc.save_state()
        if use_adapter:
            handles[-1].wait()
        return acc

    run(tmp_path / "a", True)
    run(tmp_path / "n", False)
    ours, native = (tmp_path / p / "checkpoints" / "checkpoint_0" for p in ("a", "n"))
    assert load_file(ours / "model.safetensors").keys() == load_file(native / "model.safetensors").keys() == {"embed.weight"}
    assert_same_state(ours, native)
    acc = _fresh_accelerator(tmp_path / "a")
    handles.append(enable_async_checkpointing(acc))
    model = acc.prepare(Tied())
    acc.load_state(str(ours))
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight.detach(), load_file(native / "model.safetensors")["embed.weight"])


def test_everything_save_state_writes_is_async_and_loads_natively(tmp_path, handles):
    """Custom objects, scheduler, RNG; a snapshot taken at call time (mutations afterwards do not leak in);
    a plain Accelerator (no adapter) loads the result; remove() restores the native methods."""

    class Counter:
        def __init__(self):
            self.n, self.big = 0, torch.zeros(300_000)  # 1.2 MB: staged through a shared buffer

        def state_dict(self):
            return {"n": self.n, "big": self.big}

        def load_state_dict(self, state):
            self.n, self.big = state["n"], state["big"]

    acc = _fresh_accelerator(tmp_path / "p")
    handle = enable_async_checkpointing(acc)
    handles.append(handle)
    # nothing on the instance but the (picklable) handle: no shadowing closures, no hooks
    assert not {"save_state", "load_state", "end_training"} & set(vars(acc)) and not acc._save_model_state_pre_hook
    model, opt, step = _train_objects(acc, width=2048)  # ~200 KB of weights: over the inline threshold with Adam
    counter = Counter()
    acc.register_for_checkpointing(counter)
    step()
    counter.n, counter.big[:] = 7, 7.0
    expected = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    path = acc.save_state()
    counter.n, counter.big[:] = 8, 8.0  # after the call: must not reach the checkpoint
    step()
    handle.remove()
    assert "save_state" not in vars(acc) and "load_state" not in vars(acc) and "end_training" not in vars(acc)
    assert not acc._save_model_state_pre_hook and not acc._load_model_state_pre_hook
    assert is_complete(str(path))
    assert set(listing(path)) == {COMMIT_RECORD, "model.safetensors", "optimizer.bin", "scheduler.bin",
                                  "random_states_0.pkl", "custom_checkpoint_0.pkl"}

    acc2 = _fresh_accelerator(tmp_path / "p")  # no adapter at all
    model2, opt2, _ = _train_objects(acc2, width=2048, seed=1)
    counter2 = Counter()
    acc2.register_for_checkpointing(counter2)
    acc2.load_state(str(path))
    assert counter2.n == 7 and bool((counter2.big == 7.0).all())
    for key, value in acc2.unwrap_model(model2).state_dict().items():
        assert torch.equal(value, expected[key]), key
    acc2.project_configuration.iteration = 1  # natively by hand (accelerate #3306)
    native = acc2.save_state()  # native again: files written synchronously, no commit record
    assert native == tmp_path / "p" / "checkpoints" / "checkpoint_1" and COMMIT_RECORD not in listing(native)
    assert_same_state(path, native)


def test_explicit_output_dir(tmp_path, handles):
    """save_state(dir): published atomically, an older asyncckpt checkpoint there is replaced as a whole;
    a directory holding other things is saved into natively (synchronously), never replaced."""
    acc = _fresh_accelerator(tmp_path / "p", automatic_checkpoint_naming=False)
    handle = enable_async_checkpointing(acc)
    handles.append(handle)
    _, _, step = _train_objects(acc)
    target = tmp_path / "out" / "latest"
    assert acc.save_state(str(target)) == target
    step()
    acc.save_state(str(target))  # replaces the committed one (after waiting for it)
    handle.wait()
    assert is_complete(str(target)) and not any(n.startswith(".") for n in listing(tmp_path / "out"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    acc.save_state(str(mine))
    assert (mine / "notes.txt").read_text() == "keep me" and "optimizer.bin" in listing(mine)


def test_overlapped_optimizer_snapshot_is_taken_before_the_next_step(tmp_path, handles, slow_overlapped_snapshots):
    """overlap_optimizer (the default): optimizer.bin is snapshot on a thread after save_state() returns; the
    next optimizer.step() must wait for it. The thread is slowed down so that the step always arrives first:
    a torn snapshot would hold the next step's Adam state."""
    acc = _fresh_accelerator(tmp_path / "p")
    handle = enable_async_checkpointing(acc, inline_bytes=4096, overlap_optimizer=True)  # optimizer.bin large enough
    handles.append(handle)
    _, opt, step = _train_objects(acc, width=256)
    step()
    expected = {k: v.clone() for k, v in _flat(opt.state_dict()) if torch.is_tensor(v)}
    path = acc.save_state()
    assert handle.checkpointer.snapshot_thread.busy and "optimizer.bin" in handle.last_written  # left to the snapshot thread
    started = time.perf_counter()
    step()  # optimizer.step() waits for the snapshot before changing the state
    assert time.perf_counter() - started > 0.2
    handle.wait()
    saved = dict(_flat(torch.load(path / "optimizer.bin", weights_only=False)))
    assert expected and all(torch.equal(saved[k], v) for k, v in expected.items())
    now = dict(_flat(opt.state_dict()))
    assert any(not torch.equal(v, now[k]) for k, v in expected.items())  # and training moved on
    acc.load_state(str(path))  # loads natively, including the overlapped file
    loaded = dict(_flat(opt.state_dict()))
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())

    acc._optimizers.append(types.SimpleNamespace(optimizer=object()))  # not a torch optimizer: no step hooks
    try:
        with pytest.warns(RuntimeWarning, match="is not a torch.optim.Optimizer"):
            assert not saving.overlaps_optimizer(handle.checkpointer, acc._optimizers)
    finally:
        acc._optimizers.pop()
    assert saving.overlaps_optimizer(handle.checkpointer, acc._optimizers)
    off = enable_async_checkpointing(_fresh_accelerator(tmp_path / "q"), overlap_optimizer=False)
    handles.append(off)
    assert not saving.overlaps_optimizer(off.checkpointer, acc._optimizers)


def test_failed_background_save_raises_at_next_save_state_naming_the_directory(tmp_path, handles):
    """A real I/O error in the writer (RLIMIT_FSIZE, as on a full disk): nothing is published, total_limit
    keeps the old checkpoint, and the next save_state() raises CheckpointWriteError naming the directory."""
    class Blob:
        def __init__(self):
            self.t = torch.zeros(10)

        def state_dict(self):
            return {"t": self.t}

        def load_state_dict(self, state):
            self.t = state["t"]

    acc = _fresh_accelerator(tmp_path / "p", total_limit=1)
    handle = enable_async_checkpointing(acc, max_in_flight=1)  # the next save_state() waits for the failed one
    handles.append(handle)
    limit_file_size(handle.checkpointer, 1 << 20)
    _, _, step = _train_objects(acc)
    blob = Blob()
    acc.register_for_checkpointing(blob)
    acc.save_state()
    handle.wait()
    blob.t = torch.zeros(1 << 20)  # 4 MB file: over the writer's limit
    acc.save_state()  # returns: the failure happens in the background
    blob.t = torch.zeros(10)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint_1 \(step 1\) failed on rank 0: .*File too large.*"
                                                   r"nothing was published under its name"):
        acc.save_state()
    ckpts = tmp_path / "p" / "checkpoints"
    assert listing(ckpts) == ["checkpoint_0"] and is_complete(str(ckpts / "checkpoint_0"))
    acc.save_state()  # the failure was reported once; saving goes on
    handle.wait()
    assert listing(ckpts) == ["checkpoint_2"]

