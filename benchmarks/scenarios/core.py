"""asyncckpt.core against this machine's limits and the peers: saves, loads, two ranks, planning, the async
stall, memory, and the computation lost while a save is in flight.

Sections, each in a fresh process (one per revision when comparing two):

  saves     (a) ``large``: 16 fp32 tensors; (b) ``adam``: ~8,000 tensors (params + Adam state). Saves:
            ``torch.save`` + fsync, ``safetensors`` + fsync, ``dcp.save`` (no_dist), ``core.save``,
            ``core.async_save``, ``AsyncCkptStorageWriter`` via ``dcp.save``; loads into a preallocated
            state: ``torch.load``, ``safetensors``, ``dcp.load``, ``core.load`` (verify on / off), stock
            ``dcp.load`` of our checkpoint. A first call, back-to-back reps, one rep after idle seconds
            (this VM returns freed memory to its host; touching it again is ~10x slower).
  ranks2    2 gloo ranks, replicated state, ``core.save`` (deduplicated: each writes about half), and the load.
  planning  10,000 small tensors: a first ``async_save`` against later ones, split by the phases the
            handle reports (``handle.timings``).
  stall     the time ``async_save`` blocks against a held memcpy of the same bytes, to durable against a raw
            O_DIRECT write, peak extra memory; ``dcp.async_save`` (THREAD, a reused shared-memory
            ``DefaultStager``, PROCESS) and Lightning's ``AsyncCheckpointIO`` beside it; then a ``torch.mm``
            loop's steps/s alone against while a save is in flight, and while another process writes the
            same bytes (the floor).

Where a rep is paired with the machine's limit of that moment (a raw O_DIRECT write or a held memcpy of the
same bytes made right before it), the pair judges it: this machine's copy and disk speeds move by up to 2x
within a sitting.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import shutil
import time
from collections import defaultdict
from typing import Any, Callable, Optional

from harness import Option, Scenario
from harness.floors import PairedMemcpy, PairedODirect, RawWriter
from harness.machine import MemSampler, drop_caches
from harness.ranks import on_ranks
from harness.report import bars, fmt, side, table
from harness.util import GiB, error_text, free_port, log, median, now, ratio, remove
from harness.workloads import (MMLoop, flat_tensors, n_tensors, reset_state, same_state, state_bytes, workload,
                               zeros_like_state)

STALL_REPS = 7  # reps of our own stalls: one slow rep in 3 (the machine's, not ours) moved the median
WORKLOADS = ("large", "adam")


def reps_of(call: Callable[[], dict], reps: int, settle_s: float = 0.0, first: bool = True,
            prepare: Callable[[], None] = lambda: None) -> dict[str, list]:
    """``first`` call (its keys prefixed ``first_``), ``reps`` back-to-back, one after ``settle_s`` idle seconds
    (prefixed ``settle_``): every figure a list, so that children's results merge by concatenation."""
    out: dict[str, list] = defaultdict(list)

    def one(prefix: str) -> None:
        prepare()
        for key, value in call().items():
            out[prefix + key].append(value)

    if first:
        one("first_")
    for _ in range(reps):
        one("")
    if settle_s > 0:
        prepare()
        time.sleep(settle_s)
        one("settle_")
    return dict(out)


def guarded(results: dict, key: str, call: Callable[[], Any]) -> None:
    """A failing peer is recorded as its error, not a crash."""
    try:
        results[key] = call()
    except Exception as e:  # noqa: BLE001
        results[key] = {"error": error_text(e)}
        log(f"  {key}: ERROR {results[key]['error']}")


# ------------------------------------------------------------------------------------------ saves and loads
def saves(kind: str, size_mib: int, reps: int, settle_s: float, peers: bool, root: str) -> dict:
    from asyncckpt import core

    if peers:
        from harness import peers as P
    state = workload(kind, size_mib << 20)
    nbytes, flat = state_bytes(state), flat_tensors(state)
    out: dict = {"bytes": nbytes, "tensors": n_tensors(state), "save": {}, "load": {}}
    last: dict[str, str] = {}
    counter = iter(range(1 << 30))

    def save_peer(name: str, call: Callable[[str], None], paired: Optional[PairedODirect] = None, first: bool = True):
        def one() -> dict:
            raw = paired() if paired is not None else None
            path = os.path.join(root, f"{name}_{next(counter)}")
            t0 = now()
            call(path)
            t1 = now()
            os.sync()
            r = {"s": t1 - t0, "durable_s": now() - t0}
            if raw is not None:
                r["x_paired_odirect"] = raw / (t1 - t0)
            remove(last.get(name, ""))
            last[name] = path
            return r

        log(f"  save {name}")
        guarded(out["save"], name, lambda: reps_of(one, reps, settle_s, first, prepare=os.sync))

    if peers:
        save_peer("torch_save", lambda path: P.torch_save_fsync(state, path))
        save_peer("safetensors", lambda path: P.safetensors_save_fsync(flat, path))
        save_peer("dcp_save", lambda path: P.dcp_save(state, path))
    paired = PairedODirect(nbytes, root)
    save_peer("ours_core_save", lambda path: core.save(state, path), paired)
    paired.close()
    memcpy = PairedMemcpy(nbytes)

    def ours_async() -> dict:
        path = os.path.join(root, "async")
        floor = memcpy()
        t0 = now()
        handle = core.async_save(state, path)
        stall = now() - t0
        handle.result()
        seconds = now() - t0
        shutil.rmtree(path, ignore_errors=True)
        return {"stall_s": stall, "s": seconds, "x_paired_memcpy": stall / floor}

    log("  save ours_core_async_save")
    guarded(out["save"], "ours_core_async_save", lambda: reps_of(ours_async, max(reps, STALL_REPS), settle_s, False,
                                                                 prepare=os.sync))
    memcpy = None  # frees its two copies before the loads (ours_async reads the name, hence not del)
    if peers:
        writer = core.AsyncCkptStorageWriter(os.path.join(root, "writer"))
        save_peer("ours_writer_dcp_save", lambda path: P.dcp_save(state, path, storage_writer=writer))
    target = zeros_like_state(state)

    def load_peer(name: str, load: Callable[[dict, str], None], source: str) -> None:
        if source not in last:
            out["load"][name] = {"error": f"no checkpoint from {source}"}
            return

        def one() -> dict:
            reset_state(target, state)
            t0 = now()
            load(target, last[source])
            return {"s": now() - t0}

        def body() -> dict:
            r = reps_of(one, reps)
            if not same_state(target, state):
                raise AssertionError(f"{name}: loaded values differ from the saved state")
            if drop_caches() is None:  # root only
                r["cold_s"] = [one()["s"]]
            return r

        log(f"  load {name}")
        guarded(out["load"], name, body)

    loads = [("ours_core_load_verify", lambda t, path: core.load(t, path, verify=True), "ours_core_save"),
             ("ours_core_load_noverify", lambda t, path: core.load(t, path, verify=False), "ours_core_save")]
    if peers:
        loads = [("torch_load", P.torch_load_into, "torch_save"),
                 ("safetensors_load_file", lambda t, path: P.safetensors_load_into(t, path, state), "safetensors"),
                 ("dcp_load", P.dcp_load, "dcp_save"), *loads,
                 ("dcp_load_FileSystemReader_of_ours", P.dcp_load, "ours_core_save")]
    for name, load, source in loads:
        load_peer(name, load, source)
    core.default_checkpointer().close()
    return out


# ------------------------------------------------------------------------------------------ two ranks
def _rank2(rank: int, world: int, kind: str, size_mib: int, reps: int, settle_s: float, root: str) -> dict:
    import torch.distributed as dist

    from asyncckpt import core

    state = workload(kind, size_mib << 20)
    directory = os.path.join(root, f"r2_{kind}")
    os.makedirs(directory, exist_ok=True)
    paired: list[PairedODirect] = []
    counter = iter(range(1 << 30))

    def one() -> dict:
        dist.barrier()
        raw = None
        if paired:  # both ranks write their share raw at once: the disk of the moment for this rep
            raw = paired[0]()
            dist.barrier()
        path = os.path.join(directory, f"ck_{next(counter)}")
        t0 = now()
        core.save(state, path)
        seconds = now() - t0
        mine = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith(f"__{rank}_"))
        return {"s": seconds, "raw_s": raw, "bytes": mine, "path": path}

    first = one()
    paired.append(PairedODirect(first["bytes"], directory, threads=1))
    out = {"first": first, "reps": [one() for _ in range(reps)]}
    paired.pop().close()
    dist.barrier()
    time.sleep(settle_s)
    out["settle"] = one()
    target = zeros_like_state(state)
    loads = []
    for _ in range(reps + 1):
        reset_state(target, state)
        dist.barrier()
        t0 = now()
        core.load(target, out["settle"]["path"])
        loads.append(now() - t0)
    out.update(load_s=loads[1:], load_verified=same_state(target, state))
    core.default_checkpointer().close()
    return out


def ranks2(kind: str, size_mib: int, reps: int, settle_s: float, root: str) -> dict:
    """Per rep the slower rank's seconds, and ``x_paired`` = both ranks' raw write of their shares / the save."""
    r0, r1 = on_ranks(_rank2, 2, kind, size_mib, reps, settle_s, root, timeout=1800)
    shutil.rmtree(os.path.join(root, f"r2_{kind}"), ignore_errors=True)
    reps_s = [max(a["s"], b["s"]) for a, b in zip(r0["reps"], r1["reps"])]
    raw_s = [max(a["raw_s"], b["raw_s"]) for a, b in zip(r0["reps"], r1["reps"])]
    return {"first_s": [max(r0["first"]["s"], r1["first"]["s"])], "s": reps_s,
            "x_paired_odirect": [w / s for w, s in zip(raw_s, reps_s)],
            "settle_s": [max(r0["settle"]["s"], r1["settle"]["s"])], "bytes_per_rank": {"0": r0["first"]["bytes"], "1": r1["first"]["bytes"]},
            "load_s": [max(a, b) for a, b in zip(r0["load_s"], r1["load_s"])],
            "load_verified": [r0["load_verified"] and r1["load_verified"]]}


# ------------------------------------------------------------------------------------------ planning
def planning(n: int, reps: int, root: str) -> dict:
    """Each ``async_save`` split by the phases its handle reports: ``plan_s`` (a cold plan), ``buffer_s``
    (the snapshot buffer), ``copy_s`` (the copy and the hand-off); the rest of the call is the bookkeeping every
    save repeats (flatten, structure description, agreement, plan-cache lookup): "warm planning". "Cold
    planning" = that + ``plan_s`` on the first save of a structure."""
    import torch

    from asyncckpt.core import Checkpointer

    generator = torch.Generator().manual_seed(7)
    lo, hi = math.log(256), math.log(4096)  # 1-16 KiB fp32, random shapes
    sizes = [int(math.exp(lo + (hi - lo) * u)) for u in torch.rand(n, generator=generator).tolist()]
    state = {"model": {f"layers.{i // 10}.p{i % 10}": torch.randn(s, generator=generator) for i, s in enumerate(sizes)}}
    counter = iter(range(1 << 30))

    def timed(checkpointer) -> dict:
        path = os.path.join(root, f"ck{next(counter)}")
        t0 = now()
        handle = checkpointer.async_save(state, path)
        returned = now() - t0
        handle.result()
        total = now() - t0
        shutil.rmtree(path, ignore_errors=True)
        t = handle.timings
        parts = {"plan_s": t.get("plan_s", 0.0), "buffer_s": t.get("buffer_s", 0.0), "copy_s": t.get("copy_s", 0.0)}
        return {"return_s": returned, "total_s": total, **parts, "bookkeeping_s": returned - sum(parts.values())}

    out: dict = {"tensors": n, "bytes": state_bytes(state)}
    with Checkpointer() as checkpointer:  # a fresh Checkpointer: the writer's start, plan, buffer, all cold
        out["first"] = timed(checkpointer)
        warm = [timed(checkpointer) for _ in range(reps)]
    state = {"renamed": state["model"]}  # a structure this process has not seen: its plan and templates are cold
    with Checkpointer() as checkpointer:  # ... for a Checkpointer whose writer already runs
        checkpointer.save({"tiny": torch.zeros(4)}, os.path.join(root, "tiny"))
        out["cold_plan"] = timed(checkpointer)
        warm += [timed(checkpointer) for _ in range(reps)]
    out["warm"] = {key: median(w[key] for w in warm) for key in warm[0]}
    out["warm_planning_s"] = out["warm"]["bookkeeping_s"]
    out["cold_planning_s"] = out["cold_plan"]["bookkeeping_s"] + out["cold_plan"]["plan_s"]
    return out


# ------------------------------------------------------------------------------------------ the stall
def stall(size_mib: int, reps: int, settle_s: float, mm_seconds: float, peers: bool, process_peer: bool,
          peer_timeout: float, root: str) -> dict:
    import torch.distributed as dist

    from asyncckpt.core import Checkpointer

    state = workload("adam", size_mib << 20)
    nbytes = state_bytes(state)
    out: dict = {"bytes": nbytes, "tensors": n_tensors(state), "peers": {}, "slowdown": {}}
    if peers:
        from harness import peers as P

        if not dist.is_initialized():  # DCP's PROCESS mode needs a group; THREAD peers use no_dist=True
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
    counter = iter(range(1 << 30))

    def async_peer(name: str, start: Callable[[str], Any], finish: Callable[[Any], None], *,
                   staged: Optional[Callable[[Any], None]] = None, paired: bool = False, first: bool = True,
                   settle: bool = True, n: Optional[int] = None) -> None:
        """start(path) returns after the blocking part; staged(token) waits for the snapshot; finish(token)
        for the write; then os.sync() for durable. ``paired``: each rep against a held memcpy and a raw
        O_DIRECT write of the same bytes made right before it."""
        floors = (PairedMemcpy(nbytes), PairedODirect(nbytes, root)) if paired else None

        def one() -> dict:
            raw = floors[1]() if floors else None
            memcpy = floors[0]() if floors else None
            path = os.path.join(root, f"{name}_{next(counter)}")
            with MemSampler() as sampler:
                t0 = now()
                token = start(path)
                t1 = now()
                if staged is not None:
                    staged(token)
                t2 = now()
                finish(token)
                t3 = now()
                os.sync()
                t4 = now()
            remove(path)
            r = {"stall_s": t1 - t0, "staged_s": t2 - t0, "total_s": t3 - t0, "durable_s": t4 - t0,
                 "extra_used_gib": sampler.result()["extra_used_gib"]}
            if floors:
                r.update(x_paired_memcpy=(t1 - t0) / memcpy, durable_x_paired_odirect=(t4 - t0) / raw)
            return r

        log(f"  {name}")
        guarded(out["peers"], name, lambda: reps_of(one, reps if n is None else n, settle_s if settle else 0.0, first))
        if floors:
            floors[1].close()

    loop = MMLoop()

    def slowdown(name: str, start: Callable[[str], Any], done: Callable[[Any], bool], finish: Callable[[Any], None],
                 n: int) -> None:
        """``torch.mm`` steps lost per save: the loop runs from the save call's return until it is done."""
        def body() -> dict:
            alone = [loop.rate_alone(mm_seconds)]
            steps = seconds = stalled = 0.0
            for _ in range(n):
                path = os.path.join(root, f"slow_{name}_{next(counter)}")
                t0 = now()
                token = start(path)
                t1 = now()
                k, dt = loop.run_until(lambda: done(token))
                finish(token)
                remove(path)
                steps, seconds, stalled = steps + k, seconds + dt, stalled + t1 - t0
            alone.append(loop.rate_alone(mm_seconds))
            rate = sum(alone) / 2
            return {"alone_steps_per_s": rate, "in_flight_steps_per_s": steps / seconds if seconds else None,
                    "slowdown_x": rate / (steps / seconds) if steps else None, "in_flight_s_per_save": seconds / n,
                    "stall_s_per_save": stalled / n, "compute_lost_s_per_save": (stalled + seconds - steps / rate) / n}

        log(f"  slowdown while {name} is in flight")
        guarded(out["slowdown"], name, body)

    checkpointer = Checkpointer()
    # a revision before the snapshot's names (``--before``) spells them overlap_staging and wait_staged
    overlap = {("overlap_snapshot" if "overlap_snapshot" in inspect.signature(checkpointer.async_save).parameters
                else "overlap_staging"): True}

    def taken(handle) -> None:
        (handle.wait_snapshot if hasattr(handle, "wait_snapshot") else handle.wait_staged)()

    async_peer("ours_async_save", lambda p: checkpointer.async_save(state, p), lambda h: h.result(),
               staged=taken, paired=True, n=max(reps, STALL_REPS))
    async_peer("ours_async_save_overlap", lambda p: checkpointer.async_save(state, p, **overlap),
               lambda h: h.result(), staged=taken)
    slowdown("ours_async_save", lambda p: checkpointer.async_save(state, p), lambda h: h.done(), lambda h: h.result(), reps)
    slowdown("ours_async_save_overlap", lambda p: checkpointer.async_save(state, p, **overlap),
             lambda h: h.done(), lambda h: h.result(), reps)
    checkpointer.close()
    if peers:
        raw = RawWriter(nbytes, root)
        slowdown("raw_write_floor", lambda p: raw.start(), lambda _: raw.done(), lambda _: raw.wait(), reps)
        raw.close()
        async_peer("dcp_async_thread_default", lambda p: P.dcp_async_save_thread(state, p),
                   lambda f: f.result(timeout=peer_timeout))
        slowdown("dcp_async_thread_default", lambda p: P.dcp_async_save_thread(state, p), lambda f: f.done(),
                 lambda f: f.result(timeout=peer_timeout), 1)
        with contextlib.closing(P.shm_async_stager()) as stager:
            async_peer("dcp_async_thread_DefaultStager_shm_async", lambda p: P.dcp_async_save_staged(state, p, stager),
                       lambda r: r.upload_completion.result(timeout=peer_timeout),
                       staged=lambda r: r.staging_completion.result(timeout=peer_timeout), settle=False)
        io = P.lightning_async_io()
        async_peer("lightning_AsyncCheckpointIO", lambda p: io.save_checkpoint(state, p), lambda _: io.teardown())
        start, io2 = P.lightning_async_io_signalling(state)
        slowdown("lightning_AsyncCheckpointIO", start, lambda e: e.is_set(), lambda _: io2.teardown(), 1)
        if process_peer:  # slow: fewer reps, no idle rep
            async_peer("dcp_async_process_default", lambda p: P.dcp_async_save_process(state, p),
                       lambda f: f.result(timeout=peer_timeout), settle=False, n=min(reps, 2))
        dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------------ the sitting
def merge(results: list[dict]) -> dict:
    """Children's results for one revision, merged: lists concatenated, the rest from the first."""
    if len(results) == 1:
        return results[0]
    merged = dict(results[0])
    for key, value in results[0].items():
        if isinstance(value, dict):
            merged[key] = merge([r.get(key, {}) for r in results])
        elif isinstance(value, list):
            merged[key] = [x for r in results for x in r.get(key, [])]
    return merged


def measure(sitting) -> dict:
    o = sitting.o
    comparing = len(sitting.revisions) > 1
    rounds, reps = (2, max(1, math.ceil(o.reps / 2))) if comparing else (1, o.reps)
    runs = sitting.runs(["asyncckpt"], {"asyncckpt"})
    figures: dict = {"saves": {}, "ranks2": {}, "planning": {}, "stall": {}}

    def section(name: str, key: Optional[str], function: str, **kwargs) -> None:
        found = defaultdict(list)
        with sitting.phase(name):
            for _, run in sitting.abba(runs, rounds):
                peers = {"peers": run.revision is sitting.after} if "peers" in kwargs else {}
                found[run.label].append(sitting.child(function, revision=run.revision,
                                                      **{**kwargs, "reps": reps, **peers,
                                                         "root": sitting.directory(name)}))
        target = figures[function] if key is None else figures[function].setdefault(key, {})
        target.update({label: merge(results) for label, results in found.items()})

    sections = o.sections.split(",")
    for kind in WORKLOADS:
        if "saves" in sections:
            section(f"saves {kind}", kind, "saves", kind=kind, size_mib=o.size_mib, settle_s=o.settle_s, peers=True)
        if "ranks2" in sections and (kind == "large" or not sitting.quick):
            section(f"two ranks {kind}", kind, "ranks2", kind=kind, size_mib=o.size_mib, settle_s=o.settle_s)
    if "planning" in sections:
        section("planning", None, "planning", n=o.plan_tensors)
    if "stall" in sections:
        section("stall", None, "stall", size_mib=o.size_mib, settle_s=o.settle_s, mm_seconds=o.mm_seconds, peers=True,
                process_peer=o.process_peer, peer_timeout=o.peer_timeout)
    return figures


# ------------------------------------------------------------------------------------------ the page
SAVES = {"torch_save": "`torch.save` + fsync", "safetensors": "`safetensors.torch.save_file` + fsync",
         "dcp_save": "`dcp.save` (no_dist, FileSystemWriter)", "ours_core_save": "**`core.save`**",
         "ours_core_async_save": "`core.async_save` (warm; `s` = until `result()`)",
         "ours_writer_dcp_save": "`AsyncCkptStorageWriter` via `dcp.save`"}
LOADS = {"torch_load": "`torch.load(weights_only=True)` + copy", "safetensors_load_file": "`safetensors load_file` + copy",
         "dcp_load": "`dcp.load` (no_dist) of the dcp.save checkpoint", "ours_core_load_verify": "**`core.load`, verify on**",
         "ours_core_load_noverify": "`core.load`, verify off",
         "dcp_load_FileSystemReader_of_ours": "stock `dcp.load` (FileSystemReader) of our checkpoint"}
ASYNC = {"ours_async_save": "**`Checkpointer.async_save`**", "ours_async_save_overlap": "`async_save(overlap_snapshot=True)`",
         "dcp_async_thread_default": "`dcp.async_save` THREAD, default stager",
         "dcp_async_thread_DefaultStager_shm_async": "`dcp.async_save` THREAD, reused shared-memory `DefaultStager`",
         "dcp_async_process_default": "`dcp.async_save` PROCESS, default stager",
         "lightning_AsyncCheckpointIO": "Lightning `AsyncCheckpointIO(TorchCheckpointIO())` (no fsync)",
         "raw_write_floor": "floor: a raw O_DIRECT write + fsync of the same bytes by another process"}


def limit(result: dict, kind: str) -> Optional[float]:
    """The machine's rate (GB/s) for the ratios: the better of the sitting's start and end medians."""
    values = [result["limits"].get(when, {}).get(kind, {}).get("median") for when in ("start", "end")]
    return max((v for v in values if v), default=None)


def m(values: Optional[list]) -> Optional[float]:
    return median(values or [])


def peer(by_label: dict, figure: Callable[[dict], Any]) -> Any:
    """A peer's figure: measured in the after revision's children only (the peers do not change with asyncckpt)."""
    return next((value for found in by_label.values() if (value := figure(found)) is not None), None)


def goals(result: dict) -> list[list]:
    f, rows = result["figures"], []
    odirect, cached, memcpy = (limit(result, k) for k in ("odirect_write", "cached_read", "memcpy"))

    def add(label: str, goal: str, measured: str, ok: Optional[bool]) -> None:
        rows.append(([label] if label else []) + [goal, measured, "n/a" if ok is None else ("yes" if ok else "**no**")])

    for label in result.get("labels", ["asyncckpt"]):
        name = side(label, result).lstrip(", ")
        for kind in WORKLOADS:
            save = f["saves"].get(kind, {}).get(label, {})
            s = save.get("save", {}).get("ours_core_save", {})
            x = m(s.get("x_paired_odirect"))
            best = ratio(ratio(save.get("bytes"), m(s.get("s"))), odirect and odirect * 1e9)
            add(name, f"({kind}) save >= 0.8x a raw O_DIRECT write of the same bytes (1 rank)",
                f"{fmt(x, '.2f')}x (paired, median); {fmt(best, '.2f')}x the sitting's best rate", None if x is None else x >= 0.8)
            r2 = f["ranks2"].get(kind, {}).get(label, {})
            x = m(r2.get("x_paired_odirect"))
            add(name, f"({kind}) save >= 0.8x a raw O_DIRECT write of the same bytes (2 ranks)", f"{fmt(x, '.2f')}x (paired)",
                None if x is None else x >= 0.8)
            ours_l = m(save.get("load", {}).get("ours_core_load_verify", {}).get("s"))
            dcp_l = m(peer(f["saves"].get(kind, {}), lambda w: w["load"].get("dcp_load", {}).get("s")))
            rl = ratio(ratio(save.get("bytes"), ours_l), cached and cached * 1e9)
            add(name, f"({kind}) load >= 0.8x the cached read, and faster than dcp.load",
                f"{fmt(rl, '.2f')}x the cached read; dcp.load / ours = {fmt(ratio(dcp_l, ours_l), '.2f')}",
                None if rl is None else rl >= 0.8 and (dcp_l is None or dcp_l > ours_l))
            a = save.get("save", {}).get("ours_core_async_save", {})
            x = m(a.get("x_paired_memcpy"))
            add(name, f"({kind}) async stall <= 1.2x a held memcpy of the same bytes", f"{fmt(x, '.2f')}x (paired)",
                None if x is None else x <= 1.2)
        p = f["planning"].get(label)
        if p:
            x = p["warm_planning_s"] / p["cold_planning_s"]
            add(name, "warm planning <= 5% of cold", f"{100 * x:.1f}%", x <= 0.05)
        st = f["stall"].get(label)
        if st and "stall_s" in st["peers"].get("ours_async_save", {}):
            ours = st["peers"]["ours_async_save"]
            x = m(ours.get("durable_x_paired_odirect"))
            add(name, "(adam) async save to durable <= 1.25x a raw O_DIRECT write of the same bytes", f"{fmt(x, '.2f')}x (paired)",
                None if x is None else x <= 1.25)
            ov = m(st["peers"].get("ours_async_save_overlap", {}).get("stall_s"))
            floor = st["bytes"] / (memcpy * 1e9) if memcpy else None
            add(name, "(adam) overlapped stall <= 0.1x a held memcpy", f"{fmt(ratio(ov, floor), '.3f')}x",
                None if ov is None or floor is None else ov / floor <= 0.1)
            slow = st["slowdown"].get("ours_async_save", {}).get("slowdown_x")
            floor_x = peer(f["stall"], lambda st: st["slowdown"].get("raw_write_floor", {}).get("slowdown_x"))
            add(name, "(adam) compute slowdown while a save is in flight <= 1.2x",
                f"{fmt(slow, '.2f')}x (the raw-write floor: {fmt(floor_x, '.2f')}x)", None if slow is None else slow <= 1.2)
            peak = max(ours.get("first_extra_used_gib", []) + ours.get("extra_used_gib", []), default=None)
            x = ratio(peak, st["bytes"] / GiB)
            add(name, "(adam) peak extra memory <= 1.1x the state per save in flight", f"{fmt(x, '.2f')}x",
                None if x is None else x <= 1.1)
    return rows


def render(result: dict) -> str:
    f, o = result["figures"], result["options"]
    comparing = len(result["revisions"]) > 1
    lines = [f"{o['size_mib']} MiB states; medians of the back-to-back reps (min–max); `first` is a fresh process's first "
             f"call; `after idle` one rep after {o['settle_s']:g} s idle. `x` ratios use the sitting's limits (the better "
             "of start and end); `paired` ratios, each rep against the limit measured right before it, decide the goals.",
             "", "## Goals", "", *table((["asyncckpt"] if comparing else []) + ["goal", "measured", "met"], goals(result))]
    for kind in WORKLOADS:
        for label, w in f["saves"].get(kind, {}).items():
            lines += [f"## Saves and loads, {kind}{side(label, result)}", "",
                      f"{w['bytes'] / GiB:.3f} GiB in {w['tensors']} tensors, one process.", "",
                      *table(["save", "first s", "s (min–max)", "GB/s", "x O_DIRECT", "paired", "durable s", "after idle s"],
                             [_save_row(SAVES[k], v, w["bytes"], result) for k, v in w["save"].items()]),
                      *table(["load", "first s", "s (min–max)", "GB/s", "x cached read", "cold s"],
                             [_load_row(LOADS[k], v, w["bytes"], result) for k, v in w["load"].items()])]
    rows = [[kind + side(label, result), fmt(m(r["first_s"])), _range(r["s"]), fmt(m(r["x_paired_odirect"]), ".2f"),
             fmt(m(r["settle_s"])), " / ".join(f"{b / 1e6:.0f} MB" for b in r["bytes_per_rank"].values()), fmt(m(r["load_s"])),
             all(r["load_verified"])] for kind, by in f["ranks2"].items() for label, r in by.items()]
    if rows:
        lines += ["## Two ranks", "", "gloo, 1 intra-op thread each, replicated state: the planner deduplicates it, each rank "
                  "writes about half. The slower rank's time from a barrier to `core.save` returning; `paired` = both ranks "
                  "writing their share raw at once right before each rep / the save.", "",
                  *table(["workload", "first s", "s (min–max)", "paired", "after idle s", "bytes per rank", "load s",
                          "load verified"], rows)]
    for label, p in f["planning"].items():
        phases = ("return_s", "plan_s", "bookkeeping_s", "buffer_s", "copy_s", "total_s")
        saves = (("first, fresh Checkpointer", p["first"]), ("first of a structure, writer running", p["cold_plan"]),
                 ("later (median)", p["warm"]))
        lines += [f"## Planning{side(label, result)}", "",
                  f"{p['tensors']} fp32 tensors of 1–16 KiB ({p['bytes'] / 1e6:.0f} MB), a fresh process; each `async_save` "
                  "split by the phases its handle reports; bookkeeping = the rest of the call, what every save repeats.", "",
                  *table(["save", "returned after s", "plan s", "bookkeeping s", "buffer s", "copy + hand-off s",
                          "committed s"], [[what, *(fmt(r[k], ".4f") for k in phases)] for what, r in saves]),
                  f"Warm planning {p['warm_planning_s']:.4f} s / cold {p['cold_planning_s']:.4f} s = "
                  f"**{100 * p['warm_planning_s'] / p['cold_planning_s']:.1f}%** (goal <= 5%).", ""]
    for label, st in f["stall"].items():
        memcpy, per_tensor = limit(result, "memcpy"), limit(result, "per_tensor_copy")
        floor = st["bytes"] / (memcpy * 1e9) if memcpy else None
        lines += [f"## Async save: stall, durable, memory (adam){side(label, result)}", "",
                  f"{st['bytes'] / GiB:.3f} GiB in {st['tensors']} tensors. Floors (the sitting's limits): a held memcpy of "
                  f"the same bytes {fmt(floor)} s; copying its tensors one by one into held clones "
                  f"{fmt(st['bytes'] / (per_tensor * 1e9) if per_tensor else None)} s. `staged` = the "
                  "snapshot complete; `total` = the write finished; `durable` = after a following `os.sync()`; memory = "
                  "the peak of system used memory over a rep less its value before the call.", "",
                  *table(["path", "first stall s", "stall s (min–max)", "x memcpy", "paired memcpy", "staged s", "total s",
                          "durable s", "paired O_DIRECT", "after idle stall s", "peak extra GiB"],
                         [_async_row(ASYNC[k], v, floor) for k, v in st["peers"].items()]),
                  "Computation lost while a save is in flight: a `torch.mm` 512x512 loop (torch's threads) runs from the "
                  "call's return until the save is done; `lost` = the loop's progress lost per save, the stall included.", "",
                  *table(["path", "alone steps/s", "in flight steps/s", "slowdown", "in flight s/save", "stall s/save",
                          "lost s/save"], [_slowdown_row(ASYNC[k], v) for k, v in st["slowdown"].items()])]
    return "\n".join(lines)


def _save_row(name: str, v: dict, nbytes: int, result: dict) -> list:
    if "error" in v:
        return [name, v["error"], *[""] * 6]
    rate = ratio(nbytes / 1e9, m(v.get("s")))
    return [name, fmt(m(v.get("first_s"))), _range(v.get("s")), fmt(rate, ".2f"),
            fmt(ratio(rate, limit(result, "odirect_write")), ".2f"), fmt(m(v.get("x_paired_odirect")), ".2f"),
            fmt(m(v.get("durable_s"))), fmt(m(v.get("settle_s")))]


def _load_row(name: str, v: dict, nbytes: int, result: dict) -> list:
    if "error" in v:
        return [name, v["error"], *[""] * 4]
    rate = ratio(nbytes / 1e9, m(v.get("s")))
    return [name, fmt(m(v.get("first_s"))), _range(v.get("s")), fmt(rate, ".2f"),
            fmt(ratio(rate, limit(result, "cached_read")), ".2f"), fmt(m(v.get("cold_s")))]


def _async_row(name: str, v: dict, floor: Optional[float]) -> list:
    if "error" in v:
        return [name, v["error"], *[""] * 9]
    peak = max(v.get("first_extra_used_gib", []) + v.get("extra_used_gib", []), default=None)
    return [name, fmt(m(v.get("first_stall_s"))), _range(v.get("stall_s")), fmt(ratio(m(v.get("stall_s")), floor), ".2f"),
            fmt(m(v.get("x_paired_memcpy")), ".2f"), fmt(m(v.get("staged_s"))), fmt(m(v.get("total_s"))),
            fmt(m(v.get("durable_s"))), fmt(m(v.get("durable_x_paired_odirect")), ".2f"), fmt(m(v.get("settle_stall_s"))),
            fmt(peak, ".2f")]


def _slowdown_row(name: str, v: dict) -> list:
    if "error" in v:
        return [name, v["error"], *[""] * 5]
    return [name, fmt(v.get("alone_steps_per_s"), ".0f"), fmt(v.get("in_flight_steps_per_s"), ".0f"),
            f"{fmt(v.get('slowdown_x'), '.2f')}x", fmt(v.get("in_flight_s_per_save"), ".2f"), fmt(v.get("stall_s_per_save")),
            fmt(v.get("compute_lost_s_per_save"), ".2f")]


def _range(values: Optional[list]) -> str:
    if not values:
        return "–"
    return fmt(median(values)) + (f" ({fmt(min(values))}–{fmt(max(values))})" if len(values) > 1 else "")


def plot(result: dict, figure) -> None:
    left, right = figure.subplots(1, 2)
    stall_by = result["figures"]["stall"]
    labels, values = [], []
    for label, st in stall_by.items():
        for k, v in st["peers"].items():
            if "stall_s" in v:
                labels.append(f"{k}@{label.partition('@')[2]}" if "@" in label else k)
                values.append(m(v["stall_s"]))
    memcpy = limit(result, "memcpy")
    floor = next(iter(stall_by.values()))["bytes"] / (memcpy * 1e9) if memcpy and stall_by else None
    bars(left, [s.replace("_", " ")[:26] for s in labels], values, "stall s (adam)", floor, "held memcpy")
    saves = result["figures"]["saves"].get("adam", {})
    labels = [f"{k}@{lb.partition('@')[2]}" if "@" in lb else k for lb, w in saves.items() for k in w["save"]
              if "s" in w["save"][k]]
    values = [m(w["save"][k]["s"]) for w in saves.values() for k in w["save"] if "s" in w["save"][k]]
    raw = saves and odirect_s(result, next(iter(saves.values()))["bytes"])
    bars(right, [s.replace("_", " ")[:26] for s in labels], values, "save s (adam)", raw or None, "O_DIRECT write")


def odirect_s(result: dict, nbytes: int) -> Optional[float]:
    rate = limit(result, "odirect_write")
    return nbytes / (rate * 1e9) if rate else None


SCENARIO = Scenario(
    title="asyncckpt core: saves, loads, the async stall, against the machine and the peers",
    question=__doc__.split("\n\n", 1)[0].replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"size_mib": Option(1024, 32), "settle_s": Option(20.0, 0.5), "plan_tensors": Option(10000, 300),
             "mm_seconds": Option(3.0, 0.3), "process_peer": Option(True, False, "dcp.async_save PROCESS (slow)"),
             "peer_timeout": Option(300.0), "sections": Option("saves,ranks2,planning,stall")},
    reps=(3, 1),
    limits=("memcpy", "odirect_write", "buffered_write", "cold_read", "cached_read", "per_tensor_copy"),
    limits_mib="size_mib",
    revisioned=True,
)
