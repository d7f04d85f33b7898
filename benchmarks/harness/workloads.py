"""The state dicts the scenarios save, and what they compare a loaded state with.

Two workloads recur through the pages: (a) ``make_large``, a few large fp32 tensors (the bytes alone),
and (b) ``make_adam``, a model's parameters with Adam's state, ~8,000 tensors of 1 KiB to 64 MiB (where
the per-tensor work shows). The same seed gives the same values in every process, so a child can
rebuild what another saved.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional

import torch

from .util import now


def make_large(total_bytes: int, n: int = 16, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    each = total_bytes // n // 4
    return {f"layer{i}.weight": torch.empty(each).uniform_(-1, 1, generator=generator) for i in range(n)}


def make_adam(total_bytes: int, n_small: Optional[int] = None, seed: int = 1) -> dict:
    """Params (4 large + 1 remainder + ``n_small`` log-uniform 1-128 KiB) and Adam-like state per param:
    fp32 bytes of params + exp_avg + exp_avg_sq + steps = ``total_bytes``. ``n_small`` defaults to 2000
    per GiB (~8,000 tensors in 1 GiB; fewer in the small states of a smoke run)."""
    if n_small is None:
        n_small = max(10, 2000 * total_bytes // (1 << 30))
    generator = torch.Generator().manual_seed(seed)
    n_params = 5 + n_small
    param_bytes = (total_bytes - 4 * n_params) // 3
    large_each = total_bytes // 16
    lo, hi = math.log(256), math.log(32768)  # elements: 1 KiB .. 128 KiB of fp32
    small = [int(math.exp(lo + (hi - lo) * u)) for u in torch.rand(n_small, generator=generator).tolist()]
    remainder = param_bytes // 4 - 4 * (large_each // 4) - sum(small)
    if remainder <= 0:
        raise ValueError("state too small for 4 large tensors and the small ones: fewer small ones (n_small)")
    sizes = [large_each // 4] * 4 + [remainder] + small
    model, state = {}, {}
    for i, numel in enumerate(sizes):
        model[f"block{i}.weight"] = torch.empty(numel).uniform_(-1, 1, generator=generator)
        state[i] = {"step": torch.tensor(float(100 + i)),
                    "exp_avg": torch.empty(numel).uniform_(-1e-3, 1e-3, generator=generator),
                    "exp_avg_sq": torch.empty(numel).uniform_(0, 1e-6, generator=generator)}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(len(sizes)))}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def on_device(obj: Any, device: str) -> Any:
    """``obj`` with every tensor in it moved to ``device`` (the rest kept as it is)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: on_device(v, device) for k, v in obj.items()}
    return obj


def workload(name: str, total_bytes: int, n_small: Optional[int] = None) -> dict:
    """``large`` or ``adam`` of ``total_bytes``."""
    return make_large(total_bytes) if name == "large" else make_adam(total_bytes, n_small)


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def n_tensors(state: Any) -> int:
    return sum(1 for _ in iter_tensors(state))


def flat_tensors(state: Any) -> dict:
    return dict(iter_tensors(state))


def zeros_like_state(state: Any) -> Any:
    """The same structure with zero tensors (pre-faulted) and float leaves changed: a load must restore all."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(zeros_like_state(v) for v in state)
    return -1.0 if isinstance(state, float) else state


def same_state(a: Any, b: Any) -> bool:
    """Same tensors, and (for ``make_adam`` states) the same optimizer param_groups."""
    ta, tb = flat_tensors(a), flat_tensors(b)
    if ta.keys() != tb.keys() or not all(torch.equal(ta[k], tb[k]) for k in ta):
        return False
    groups = [s.get("optim", {}).get("param_groups") if isinstance(s, dict) else None for s in (a, b)]
    return groups[0] == groups[1]


def reset_state(target: Any, saved: Any) -> None:
    """Zero every tensor of ``target`` and scramble its param_groups, so that a load must restore all of it."""
    for _, t in iter_tensors(target):
        t.zero_()
    if isinstance(target, dict) and "optim" in target:
        target["optim"]["param_groups"] = zeros_like_state(saved["optim"]["param_groups"])


def copy_into_state(target: Any, flat: dict) -> None:
    for key, t in iter_tensors(target):
        t.copy_(flat[key])


class MMLoop:
    """``torch.mm`` 512x512 steps: the computation a background save must not slow down."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.a = torch.randn(512, 512, generator=generator)
        self.b = torch.randn(512, 512, generator=generator)
        self.c = torch.empty(512, 512)

    def step(self) -> None:
        torch.mm(self.a, self.b, out=self.c)

    def rate_alone(self, seconds: float) -> float:
        for _ in range(20):
            self.step()
        t0, n = now(), 0
        while now() - t0 < seconds:
            self.step()
            n += 1
        return n / (now() - t0)

    def run_until(self, done: Callable[[], bool]) -> tuple[int, float]:
        t0, n = now(), 0
        while not done():
            self.step()
            n += 1
        return n, now() - t0


class GpuMMLoop(MMLoop):
    """A GPU trainer's step: ``MATMULS`` bf16 4096x4096 products (each through ``tanh``), then a synchronize, as a
    step's loss read back makes one; the CPU waits for the GPU in between (its cores free for background work)."""

    MATMULS = 20

    def __init__(self) -> None:
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step(self) -> None:
        a = self.a
        for _ in range(self.MATMULS):
            a = (a @ a).tanh_()
        self.a = a
        torch.cuda.synchronize()
