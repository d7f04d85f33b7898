#!/usr/bin/env python
"""One-run benchmark of asyncckpt.core against this machine's limits and the peers.

    .venv/bin/python benchmarks/core_bench.py --out docs/benchmarks.json --md docs/benchmarks.md

Sections (all in one run, results in one JSON + one markdown report):

  limits    memcpy into a held buffer; O_DIRECT write + fsync; buffered write + fsync;
            cold (after drop_caches) and cached sequential reads.
  workloads (a) "large": 16 big fp32 tensors; (b) "adam": 1 GiB in ~8,000 tensors (5 large +
            2000 small params, Adam exp_avg / exp_avg_sq / 0-dim step per param). Saves:
            torch.save(+fsync), safetensors save_file(+fsync), dcp.save(no_dist), ours
            (core.save, AsyncCkptStorageWriter via dcp.save); loads: torch.load / safetensors
            (+copy into the preallocated state), dcp.load, ours (verify on/off).
  ranks2    2 gloo ranks (spawned), replicated state, core.save (dedup: each writes ~half).
  planning  10,000 small tensors: first vs warm Checkpointer.async_save, and the isolated
            planning steps (flatten, structure_hash, agree_on_structure, _plan).
  stall     time blocked in async_save vs a held memcpy of the same bytes, total to durable,
            vs dcp.async_save (THREAD, PROCESS, DefaultStager) and Lightning AsyncCheckpointIO;
            peak extra memory (system used, process-tree RSS) per path.
  slowdown  a torch.mm 512x512 loop's steps/s alone vs while a save is in flight.

Every figure is a median of --reps back-to-back reps; saves also get one rep after --settle-s
idle seconds (this VM returns freed memory to its host; touching it again is ~10x slower, see
/work/shared/research/machine.md). A failing peer is recorded as an error string, not a crash.

This file holds sections 2-6 and the command line. What they share lives beside it, one job per module:
harness.py (timing, samplers, workload states, section 1's limits and the paired floors, also used by
floors.py, load_bench.py and profile_core.py), peers.py (the calls of the checkpointers measured against
ours) and report.py (the goals and the markdown, which --from-json re-renders on its own).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Optional

import psutil
import torch

from harness import (
    GiB, MiB, REPO, CpuMonitor, MemSampler, MMLoop, PairedMemcpy, PairedODirect, bench_limits, drop_caches,
    err_str, fill_zero, flat_tensors, free_port, gbps, git_meta, guarded, guarded_into, iter_tensors,
    limit_values, log, make_adam, make_large, med, n_tensors, non_tensors_equal, now, remove, remove_glob, rnd,
    run_peer, same_state, state_bytes, sync_quiet, tree_bytes, wait_quiet, zeros_like_state,
)
from raw_writer import RawWriter
from report import collect_errors, goals, render_md

STALL_REPS = 7  # reps of our own async stalls: one slow rep in 3 (the machine's, not ours) moved the median


# ---------------------------------------------------------------------------------------- 2. workloads
def bench_workload(args, name: str, sd: dict) -> dict:
    import peers  # here, not at the top: re-rendering a report (--from-json) needs neither the peers nor core
    from asyncckpt import core

    nbytes = state_bytes(sd)
    res: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors(sd), "save": {}, "load": {}}
    log(f"workload {name}: {nbytes / GiB:.3f} GiB in {res['tensors']} tensors")
    wdir = os.path.join(args.dir, f"w_{name}")
    os.makedirs(wdir, exist_ok=True)
    flat = flat_tensors(sd)
    last: dict[str, str] = {}

    def saver(peer: str, call: Callable[[str], None], paired: Optional[Callable[[], float]] = None):
        def prepare():
            remove_glob(wdir, peer + "_")
            sync_quiet()

        def fn(tag):
            raw_s = paired() if paired is not None else None
            path = os.path.join(wdir, f"{peer}_{tag}")
            t0 = now()
            call(path)
            t1 = now()
            os.sync()
            t2 = now()
            last[peer] = path
            out = {"s": t1 - t0, "durable_s": t2 - t0, "gbps": gbps(nbytes, t1 - t0),
                   "durable_gbps": gbps(nbytes, t2 - t0), "disk_bytes": tree_bytes(path)}
            if raw_s is not None:  # this rep against a raw write of the same bytes made just before it
                out.update(paired_odirect_s=raw_s, x_paired_odirect=raw_s / (t1 - t0))
            return out
        return fn, prepare

    def run_save(peer, call, first=True, paired=None):
        fn, prepare = saver(peer, call, paired)
        log(f"  save {peer}")
        r = guarded(res["save"], peer, run_peer, fn, reps=args.reps, settle_s=args.settle_s, first=first, prepare=prepare)
        if "median" in r:
            m = r["median"]
            log(f"    median {m['s']:.3f} s ({m['gbps']:.2f} GB/s), first {r.get('first', {}).get('s', float('nan')):.3f} s,"
                f" after idle {r.get('settle', {}).get('s', float('nan')):.3f} s")

    def ours_save(path):
        core.save(sd, path)

    writer_box: dict[str, Any] = {}

    def ours_writer(path):
        if "w" not in writer_box:
            writer_box["w"] = core.AsyncCkptStorageWriter(path)
        peers.dcp_save(sd, path, storage_writer=writer_box["w"])

    run_save("torch_save", lambda path: peers.torch_save_fsync(sd, path))
    run_save("safetensors", lambda path: peers.safetensors_save_fsync(flat, path))
    run_save("dcp_save", lambda path: peers.dcp_save(sd, path))
    with contextlib.suppress(Exception):
        core.default_checkpointer().close()  # the next core.save is a genuine first call
    paired_odirect = PairedODirect(nbytes, wdir)
    run_save("ours_core_save", ours_save, paired=paired_odirect)
    paired_odirect.close()

    def ours_async(tag):
        path = os.path.join(wdir, f"ours_core_async_save_{tag}")
        memcpy_s = paired_memcpy()
        t0 = now()
        handle = core.async_save(sd, path)
        t1 = now()
        handle.result()
        t2 = now()
        last["ours_core_async_save"] = path
        return {"stall_s": t1 - t0, "s": t2 - t0, "gbps": gbps(nbytes, t2 - t0),
                "paired_memcpy_s": memcpy_s, "x_paired_memcpy": (t1 - t0) / memcpy_s}

    paired_memcpy = PairedMemcpy(nbytes)
    log("  save ours_core_async_save (warm; stall = until async_save returned)")
    r = guarded(res["save"], "ours_core_async_save", run_peer, ours_async, reps=max(args.reps, STALL_REPS), settle_s=args.settle_s,
                first=False, prepare=lambda: (remove_glob(wdir, "ours_core_async_save_"), sync_quiet()))
    if "median" in r:
        log(f"    stall median {r['median']['stall_s']:.3f} s, total {r['median']['s']:.3f} s, "
            f"{r['median']['x_paired_memcpy']:.2f}x a held memcpy made right before each rep")
    paired_memcpy = None  # frees its two copies before the next save (ours_async reads the name, hence not del)
    remove_glob(wdir, "ours_core_async_save_")
    run_save("ours_writer_dcp_save", ours_writer)
    writer_box.clear()
    gc.collect()

    # ---- loads, into a preallocated (held) state dict, page cache warm; one cold rep.
    target = zeros_like_state(sd)

    def loader(load: Callable[[dict, str], None], path: str):
        def fn(tag):
            if tag == "cold":
                why = drop_caches()
                if why is not None:
                    return {"skipped": why}
            fill_zero(target)
            t0 = now()
            load(target, path)
            dt = now() - t0
            return {"s": dt, "gbps": gbps(nbytes, dt)}
        return fn

    def run_load(peer, load, source_peer):
        if source_peer not in last:
            res["load"][peer] = {"error": f"no checkpoint from {source_peer}"}
            return
        log(f"  load {peer}")

        def body():
            fn = loader(load, last[source_peer])
            out = run_peer(fn, reps=args.reps, settle_s=0, first=True, settle=False)
            out["verified"] = same_state(target, sd) and non_tensors_equal(target, sd)
            out["cold"] = fn("cold")
            if not out["verified"]:
                raise AssertionError(f"{peer}: loaded values differ from the saved state")
            return out

        r = guarded(res["load"], peer, body)
        if "median" in r:
            log(f"    median {r['median']['s']:.3f} s ({r['median']['gbps']:.2f} GB/s), cold {r['cold'].get('s', float('nan')):.3f} s")

    def restore_groups():
        if "optim" in target:
            target["optim"]["param_groups"] = zeros_like_state(sd["optim"]["param_groups"])

    for peer, load, src in [
        ("torch_load", peers.torch_load_into, "torch_save"),
        ("safetensors_load_file", lambda t, path: peers.safetensors_load_into(t, path, sd), "safetensors"),
        ("dcp_load", peers.dcp_load, "dcp_save"),
        ("ours_core_load_verify", lambda t, path: core.load(t, path, verify=True), "ours_core_save"),
        ("ours_core_load_noverify", lambda t, path: core.load(t, path, verify=False), "ours_core_save"),
        ("dcp_load_FileSystemReader_of_ours", peers.dcp_load, "ours_core_save"),
    ]:
        restore_groups()
        run_load(peer, load, src)
    target = None  # frees it before the cleanup (the loaders read the name, hence not del)
    with contextlib.suppress(Exception):
        core.default_checkpointer().close()
    remove(wdir)
    sync_quiet()
    gc.collect()
    return res


# ---------------------------------------------------------------------------------------- 3. two ranks
def _rank_entry(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # as torchrun does with 2 ranks on 2 cores
    import torch.distributed as dist
    from asyncckpt import core

    out: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        for name in cfg["workloads"]:
            try:
                sd = make_large(cfg["bytes"]) if name == "large" else make_adam(cfg["bytes"], cfg["n_small"])
                nbytes = state_bytes(sd)
                wdir = os.path.join(cfg["dir"], f"r2_{name}")
                if rank == 0:
                    os.makedirs(wdir, exist_ok=True)
                dist.barrier()
                ck = core.default_checkpointer()
                reps: list[dict] = []
                w: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors(sd)}
                pair: dict[str, PairedODirect] = {}

                def one(tag):
                    dist.barrier()
                    if rank == 0:
                        remove_glob(wdir, "ck_")
                        os.sync()
                    dist.barrier()
                    raw_s = None
                    if pair:  # both ranks write their share raw at once: the disk of the moment for this rep
                        raw_s = pair["write"]()
                        dist.barrier()
                    path = os.path.join(wdir, f"ck_{tag}")
                    t0 = now()
                    core.save(sd, path)
                    dt = now() - t0
                    sizes = {}
                    for r in range(world):
                        for suffix in ("0", "1"):
                            fp = os.path.join(path, f"__{r}_{suffix}.distcp")
                            if os.path.exists(fp):
                                sizes[f"__{r}_{suffix}.distcp"] = os.path.getsize(fp)
                    return {"s": dt, "files": sizes, "path": path, "raw_s": raw_s}

                w["first"] = one("first")
                share = sum(size for file, size in w["first"]["files"].items() if file.startswith(f"__{rank}_"))
                pair["write"] = PairedODirect(share, wdir, threads=1)
                for i in range(cfg["reps"]):
                    reps.append(one(f"r{i}"))
                pair.pop("write").close()
                w["reps"] = reps
                dist.barrier()
                time.sleep(cfg["settle_s"])
                w["settle"] = one("settle")
                # load (each rank reads the whole replicated state: both ranks' files)
                target = zeros_like_state(sd)
                loads = []
                for i in range(cfg["reps"] + 1):
                    fill_zero(target)
                    dist.barrier()
                    t0 = now()
                    core.load(target, w["settle"]["path"])
                    loads.append(now() - t0)
                w["load_first_s"] = loads[0]
                w["load_reps_s"] = loads[1:]
                w["load_verified"] = same_state(target, sd)
                del target
                ck.close()
                dist.barrier()
                if rank == 0:
                    remove(wdir)
                out[name] = w
                sd = None  # frees this workload's state before the next is built (one() reads the name, hence not del)
                gc.collect()
            except Exception as e:
                out[name] = {"error": err_str(e), "traceback": traceback.format_exc()[-2000:]}
        queue.put((rank, out))
    except BaseException as e:
        queue.put((rank, {"error": err_str(e), "traceback": traceback.format_exc()[-2000:]}))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def bench_two_ranks(args, nbytes: int) -> dict:
    import multiprocessing as mp

    log("two ranks (gloo, spawned processes)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    cfg = {"bytes": nbytes, "n_small": args.n_small, "dir": args.dir, "reps": args.reps,
           "settle_s": args.settle_s, "workloads": ["large"] if args.quick else ["large", "adam"]}
    procs = [ctx.Process(target=_rank_entry, args=(r, 2, port, cfg, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + args.rank_timeout
    while len(got) < 2 and time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            rank, out = queue.get(timeout=5)
            got[rank] = out
        if len(got) < 2 and not any(p.is_alive() for p in procs) and queue.empty():
            break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(got) < 2:
        return {"error": f"ranks did not finish (got {sorted(got)}; exit codes {[p.exitcode for p in procs]})",
                "partial": got}
    res: dict[str, Any] = {"world_size": 2, "per_rank_threads": 1, "raw": got}
    for name in cfg["workloads"]:
        r0, r1 = got[0].get(name, {}), got[1].get(name, {})
        if "error" in r0 or "error" in r1 or not r0:
            res[name] = {"error": r0.get("error") or r1.get("error") or "missing"}
            continue
        nb = r0["bytes"]
        reps = [max(a["s"], b["s"]) for a, b in zip(r0["reps"], r1["reps"])]
        first = max(r0["first"]["s"], r1["first"]["s"])
        settle = max(r0["settle"]["s"], r1["settle"]["s"])
        files = r0["settle"]["files"]
        loads = [max(a, b) for a, b in zip(r0["load_reps_s"], r1["load_reps_s"])]
        raw = [max(a["raw_s"], b["raw_s"]) for a, b in zip(r0["reps"], r1["reps"])]
        x_paired = [w / s for w, s in zip(raw, reps)]
        res[name] = {
            "paired_odirect_reps_s": raw, "x_paired_odirect_reps": x_paired, "save_x_paired_odirect": med(x_paired),
            "bytes": nb, "tensors": r0["tensors"],
            "save_first_s": first, "save_reps_s": reps, "save_median_s": med(reps), "save_settle_s": settle,
            "save_gbps": gbps(nb, med(reps)), "save_settle_gbps": gbps(nb, settle),
            "bytes_per_rank": {f"rank{r}": files.get(f"__{r}_0.distcp", 0) + files.get(f"__{r}_1.distcp", 0)
                               for r in range(2)},
            "files": files,
            "load_first_s": max(r0["load_first_s"], r1["load_first_s"]),
            "load_reps_s": loads, "load_median_s": med(loads), "load_gbps_per_rank": gbps(nb, med(loads)),
            "load_verified": bool(r0["load_verified"] and r1["load_verified"]),
        }
        log(f"  {name}: save median {med(reps):.3f} s ({gbps(nb, med(reps)):.2f} GB/s), after idle {settle:.3f} s, "
            f"bytes per rank {res[name]['bytes_per_rank']}")
    return res


# ---------------------------------------------------------------------------------------- 4. planning
def _planning_entry(cfg: dict, queue) -> None:
    try:
        queue.put(_planning_body(cfg))
    except BaseException as e:
        queue.put({"error": err_str(e), "traceback": traceback.format_exc()[-2000:]})


def _planning_body(cfg: dict) -> dict:
    """Time each ``async_save`` and split it with the phases its handle reports (``handle.timings``):
    ``plan_s`` (a cold plan), ``buffer_s`` (taking or allocating the staging buffer) and ``copy_s``
    (the copy and the hand-off to the writer). What is left of the call is the per-save
    bookkeeping every save repeats (flatten, structure description + digest, agreement, plan-cache
    lookup, source lookup, request): "warm planning". "Cold planning" = that + ``plan_s`` on the
    first save of a structure.
    """
    from asyncckpt.core import Checkpointer

    def clear_templates():
        with contextlib.suppress(Exception):
            from asyncckpt.core.snapshot.container import container_template
            container_template.cache_clear()

    n, reps = cfg["n"], cfg["reps"]
    gen = torch.Generator().manual_seed(7)
    lo, hi = math.log(256), math.log(4096)  # 1-16 KiB fp32, random shapes
    sizes = [int(math.exp(lo + (hi - lo) * u)) for u in torch.rand(n, generator=gen).tolist()]
    sd = {"model": {f"layers.{i // 10}.p{i % 10}": torch.randn(s, generator=gen) for i, s in enumerate(sizes)}}
    out: dict[str, Any] = {"tensors": n, "bytes": state_bytes(sd), "unique_shapes": len(set(sizes))}
    d = cfg["dir"]
    os.makedirs(d, exist_ok=True)
    counter = [0]

    def timed_async(ck) -> dict:
        counter[0] += 1
        t0 = now()
        h = ck.async_save(sd, os.path.join(d, f"ck{counter[0]}"))
        ret = now() - t0
        h.result()
        total = now() - t0
        shutil.rmtree(os.path.join(d, f"ck{counter[0]}"), ignore_errors=True)
        r = {"return_s": ret, "total_s": total, "plan_s": h.timings.get("plan_s", 0.0),
             "slot_s": h.timings.get("buffer_s", 0.0), "copy_s": h.timings["copy_s"]}
        r["bookkeeping_s"] = ret - r["plan_s"] - r["slot_s"] - r["copy_s"]  # the hand-off is part of copy
        return r

    # 1. a fresh Checkpointer: writer start + plan + buffer + templates, all cold
    ck = Checkpointer()
    out["first"] = timed_async(ck)
    out["warm"] = [timed_async(ck) for _ in range(reps)]
    ck.close()
    # 2. a new structure for a Checkpointer whose writer already runs: cold plan, cold templates
    ck = Checkpointer()
    ck.save({"tiny": torch.zeros(4)}, os.path.join(d, "tiny"))
    clear_templates()
    out["cold_plan"] = timed_async(ck)
    out["warm2"] = [timed_async(ck) for _ in range(reps)]
    ck.close()
    # 3. the same, templates already rendered (a structure seen before by this process)
    ck = Checkpointer()
    ck.save({"tiny": torch.zeros(4)}, os.path.join(d, "tiny"))
    out["cold_plan_warm_templates"] = timed_async(ck)
    ck.close()

    warm = out["warm"] + out["warm2"]
    out["warm_median"] = {k: med([w[k] for w in warm]) for k in warm[0]}
    out["warm_planning_s"] = out["warm_median"]["bookkeeping_s"]
    out["cold_planning_s"] = out["cold_plan"]["bookkeeping_s"] + out["cold_plan"]["plan_s"]
    out["warm_cold_planning_ratio"] = out["warm_planning_s"] / out["cold_planning_s"]
    out["e2e_warm_over_first_return"] = out["warm_median"]["return_s"] / out["first"]["return_s"]
    out["e2e_warm_over_cold_plan_return"] = out["warm_median"]["return_s"] / out["cold_plan"]["return_s"]
    shutil.rmtree(d, ignore_errors=True)
    return out


def bench_planning(args) -> dict:
    import multiprocessing as mp

    log(f"planning: {args.plan_tensors} small tensors (fresh process: cold caches)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    cfg = {"n": args.plan_tensors, "reps": max(args.reps, 3), "dir": os.path.join(args.dir, "planning")}
    p = ctx.Process(target=_planning_entry, args=(cfg, queue))
    p.start()
    try:
        out = queue.get(timeout=args.rank_timeout)
    except Exception as e:
        out = {"error": f"planning process gave no result: {err_str(e)}"}
    p.join(timeout=30)
    if p.is_alive():
        p.kill()
    if "error" not in out:
        log(f"  cold planning {out['cold_planning_s']:.3f} s, warm {out['warm_planning_s']:.4f} s "
            f"(ratio {out['warm_cold_planning_ratio']:.2%}); async_save return first {out['first']['return_s']:.3f} s, "
            f"warm {out['warm_median']['return_s']:.4f} s")
    return out


# ---------------------------------------------------------------------------------------- 5/6. stall, memory, slowdown
def bench_stall(args, sd: dict, limits: dict) -> dict:
    import torch.distributed as dist

    import peers  # here, not at the top: see bench_workload
    from asyncckpt.core import Checkpointer

    nbytes = state_bytes(sd)
    res: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors(sd), "peers": {}, "slowdown": {}}
    log(f"stall: {nbytes / GiB:.3f} GiB in {res['tensors']} tensors")
    sdir = os.path.join(args.dir, "stall")
    os.makedirs(sdir, exist_ok=True)

    # floors: one held memcpy of the same bytes (from the limits) and a per-tensor copy into held clones
    res["memcpy_same_bytes_s"] = nbytes / (limits["memcpy_gbps"] * 1e9) if limits.get("memcpy_gbps") else None
    held = {k: torch.zeros_like(t) for k, t in iter_tensors(sd)}
    srcs = flat_tensors(sd)

    def per_tensor_copy():
        t0 = now()
        for k, t in srcs.items():
            held[k].copy_(t)
        return now() - t0

    per_tensor_copy()
    res["per_tensor_held_copy_s"] = med([per_tensor_copy() for _ in range(args.reps)])
    held = None  # frees the clones before the saves (per_tensor_copy reads the name, hence not del)
    gc.collect()
    log(f"  held memcpy of {nbytes / GiB:.3f} GiB: {res['memcpy_same_bytes_s']:.3f} s (1 GiB copy), "
        f"per-tensor copy into held tensors {res['per_tensor_held_copy_s']:.3f} s")

    # a 1-rank gloo group: DCP's PROCESS mode needs one (THREAD peers use no_dist=True, the faster DCP path)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)

    def prepare_for(prefix):
        def prepare():
            remove_glob(sdir, prefix + "_")
            sync_quiet()
        return prepare

    def async_peer(name: str, start: Callable[[str], Any], *, staged: Optional[Callable[[Any], None]] = None,
                   finish: Callable[[Any], None], first=True, settle=True, reps=None, sampler=True,
                   paired: Optional[Callable[[], float]] = None, paired_write: Optional[PairedODirect] = None):
        """start(path) -> token (returns after the blocking part); staged(token) waits for the snapshot;
        finish(token) waits for the write; then os.sync() for durable. ``paired``: the stall's floor
        of the moment, taken right before each rep; ``paired_write``: the disk's (before that)."""
        mem: dict[str, Any] = {}

        def fn(tag):
            path = os.path.join(sdir, f"{name}_{tag}")
            raw_s = paired_write() if paired_write is not None else None
            memcpy_s = paired() if paired is not None else None
            s = MemSampler() if sampler else contextlib.nullcontext()
            with s:
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
            r = {"stall_s": t1 - t0, "staged_s": t2 - t0, "total_s": t3 - t0, "durable_s": t4 - t0,
                 "durable_gbps": gbps(nbytes, t4 - t0)}
            if memcpy_s is not None:  # this rep's stall against a held memcpy made just before it
                r.update(paired_memcpy_s=memcpy_s, x_paired_memcpy=(t1 - t0) / memcpy_s)
            if raw_s is not None:  # this rep's save-to-durable against a raw write of the same bytes just before it
                r.update(paired_odirect_s=raw_s, durable_x_paired_odirect=(t4 - t0) / raw_s)
            if sampler:
                r["mem"] = s.result()
                mem[tag] = r["mem"]
            return r

        log(f"  {name}")
        out = guarded(res["peers"], name, run_peer, fn, reps=args.reps if reps is None else reps,
                      settle_s=args.settle_s, first=first, settle=settle, prepare=prepare_for(name))
        if "median" in out:
            out["peak_extra_used_gib"] = max(m["extra_used_gib"] for m in mem.values()) if mem else None
            out["peak_extra_tree_rss_gib"] = max(m["extra_tree_rss_gib"] for m in mem.values()) if mem else None
            m = out["median"]
            log(f"    stall {m['stall_s']:.3f} s, staged {m['staged_s']:.3f} s, total {m['total_s']:.3f} s, "
                f"durable {m['durable_s']:.3f} s; first stall {out.get('first', {}).get('stall_s', float('nan')):.3f} s; "
                f"after idle stall {out.get('settle', {}).get('stall_s', float('nan')):.3f} s; "
                f"peak extra used {out['peak_extra_used_gib']:.2f} GiB")
        remove_glob(sdir, name + "_")
        return out

    # ---- ours
    ck = Checkpointer()
    paired_memcpy, paired_write = PairedMemcpy(nbytes), PairedODirect(nbytes, sdir)
    gc.collect()
    async_peer("ours_async_save", lambda p: ck.async_save(sd, p), staged=lambda h: h.wait_staged(),
               finish=lambda h: h.result(), paired=paired_memcpy, paired_write=paired_write,
               reps=max(args.reps, STALL_REPS))
    del paired_memcpy
    paired_write.close()
    async_peer("ours_async_save_overlap", lambda p: ck.async_save(sd, p, overlap_staging=True),
               staged=lambda h: h.wait_staged(), finish=lambda h: h.result(), first=True)
    # compute slowdown while our write is in flight
    loop = MMLoop()
    slow = res["slowdown"]

    def slowdown(name: str, start: Callable[[str], Any], done: Callable[[Any], bool], finish: Callable[[Any], None],
                 reps: int):
        def body():
            alone_before = loop.rate_alone(args.mm_seconds)
            steps = secs = stall = 0.0
            per = []
            for i in range(reps):
                prepare_for("slow_" + name)()
                path = os.path.join(sdir, f"slow_{name}_{i}")
                t0 = now()
                token = start(path)
                t1 = now()
                n, dt = loop.run_until(lambda: done(token))
                finish(token)
                steps += n
                secs += dt
                stall += t1 - t0
                per.append({"stall_s": t1 - t0, "in_flight_s": dt, "steps": n})
            alone_after = loop.rate_alone(args.mm_seconds)
            alone = (alone_before + alone_after) / 2
            rate = steps / secs if secs else None
            lost = (stall + secs - steps / alone) / reps  # seconds of compute lost per save (stall included)
            remove_glob(sdir, "slow_" + name + "_")
            return {"alone_steps_per_s": alone, "alone_before": alone_before, "alone_after": alone_after,
                    "in_flight_steps_per_s": rate, "slowdown_x": alone / rate if rate else None,
                    "in_flight_s_per_save": secs / reps, "stall_s_per_save": stall / reps,
                    "compute_lost_s_per_save": lost, "reps": per}

        log(f"  slowdown while {name} in flight")
        r = guarded(slow, name, body)
        if "slowdown_x" in r:
            log(f"    alone {r['alone_steps_per_s']:.0f} steps/s, in flight {r['in_flight_steps_per_s']:.0f} steps/s "
                f"({r['slowdown_x']:.2f}x) for {r['in_flight_s_per_save']:.2f} s; lost {r['compute_lost_s_per_save']:.2f} s/save")

    slowdown("ours_async_save", lambda p: ck.async_save(sd, p), lambda h: h.done(), lambda h: h.result(), args.reps)
    slowdown("ours_async_save_overlap", lambda p: ck.async_save(sd, p, overlap_staging=True), lambda h: h.done(),
             lambda h: h.result(), args.reps)
    # the floor: the same bytes written durably by another process from memory it holds, nothing else
    raw = RawWriter(nbytes, sdir)
    slowdown("raw_write_floor", lambda p: raw.start(), lambda _: raw.done(), lambda _: raw.wait(), args.reps)
    raw.close()
    with contextlib.suppress(Exception):
        ck.close()
    ck = None  # frees our Checkpointer before the peers run (the lambdas above read the name, hence not del)
    gc.collect()

    # ---- dcp.async_save THREAD, default stager (deep copy in the caller), no_dist
    async_peer("dcp_async_thread_default", lambda p: peers.dcp_async_save_thread(sd, p),
               finish=lambda f: f.result(timeout=args.peer_timeout))
    slowdown("dcp_async_thread_default", lambda p: peers.dcp_async_save_thread(sd, p),
             lambda f: f.done(), lambda f: f.result(timeout=args.peer_timeout), 1)

    # ---- dcp.async_save THREAD with a reused DefaultStager(shared memory, async staging), no_dist
    def stager_peer():
        stager = peers.shm_async_stager()
        try:
            async_peer("dcp_async_thread_DefaultStager_shm_async",
                       lambda p: peers.dcp_async_save_staged(sd, p, stager),
                       staged=lambda r: r.staging_completion.result(timeout=args.peer_timeout),
                       finish=lambda r: r.upload_completion.result(timeout=args.peer_timeout), settle=False)
        finally:
            stager.close()

    guarded_into(res["peers"], "dcp_async_thread_DefaultStager_shm_async", stager_peer)
    gc.collect()

    # ---- Lightning AsyncCheckpointIO(TorchCheckpointIO()): clone in the caller, torch.save in a thread, no fsync
    def lightning_peer():
        io_ = peers.lightning_async_io()
        async_peer("lightning_AsyncCheckpointIO", lambda p: io_.save_checkpoint(sd, p), finish=lambda _t: io_.teardown())
        start, io2 = peers.lightning_async_io_signalling(sd)
        slowdown("lightning_AsyncCheckpointIO", start, lambda e: e.is_set(), lambda _e: io2.teardown(), 1)

    guarded_into(res["peers"], "lightning_AsyncCheckpointIO", lightning_peer)
    gc.collect()

    # ---- dcp.async_save PROCESS (default stager), needs the process group; slow: fewer reps, no idle rep
    if not args.skip_process:
        async_peer("dcp_async_process_default",
                   lambda p: peers.dcp_async_save_process(sd, p),
                   finish=lambda f: f.result(timeout=args.peer_timeout), settle=False, reps=min(args.reps, 2))
    gc.collect()
    remove(sdir)
    return res


# ---------------------------------------------------------------------------------------- main
def run_on_snapshot(rev: str, argv: list) -> int:
    """Re-run this script with asyncckpt.core taken from ``git archive rev`` (a consistent snapshot)."""
    import tempfile

    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="asyncckpt-bench-")
    try:
        pkg = os.path.join(tmp, "asyncckpt")
        os.makedirs(pkg)
        open(os.path.join(pkg, "__init__.py"), "w").close()
        archive = subprocess.run(["git", "archive", sha, "core"], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", pkg], input=archive, check=True)
        env = dict(os.environ, ASYNCCKPT_BENCH_SNAPSHOT=sha,
                   PYTHONPATH=os.pathsep.join([tmp] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        log(f"benchmarking asyncckpt.core at {sha[:10]} (snapshot in {tmp})")
        return subprocess.call([sys.executable, os.path.abspath(__file__)] + list(argv), env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--md", default=None, help="markdown report")
    ap.add_argument("--dir", default="/work/bench-tmp", help="scratch directory on the disk under test (emptied afterwards)")
    ap.add_argument("--settle-s", type=float, default=None, help="idle seconds before the after-idle rep (default 20; 2 with --quick)")
    ap.add_argument("--reps", type=int, default=None, help="back-to-back reps per figure (default 3; 2 with --quick)")
    ap.add_argument("--size-mib", type=int, default=None, help="state size (default 1024; 128 with --quick)")
    ap.add_argument("--n-small", type=int, default=None, help="small params in workload b (default 2000; 250 with --quick)")
    ap.add_argument("--plan-tensors", type=int, default=None, help="tensors for the planning test (default 10000; 2000 with --quick)")
    ap.add_argument("--mm-seconds", type=float, default=None, help="seconds of the alone mm loop (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small smoke version (128 MiB), < 2 minutes")
    ap.add_argument("--sections", default="limits,workloads,ranks2,planning,stall",
                    help="comma list of: limits,workloads,ranks2,planning,stall")
    ap.add_argument("--skip-process", action="store_true", help="skip dcp.async_save PROCESS mode (slow; skipped with --quick)")
    ap.add_argument("--peer-timeout", type=float, default=300.0)
    ap.add_argument("--rank-timeout", type=float, default=900.0)
    ap.add_argument("--core-rev", default=None,
                    help="benchmark asyncckpt.core as committed at this git revision (e.g. HEAD: a `git archive` "
                         "snapshot put first on PYTHONPATH) instead of the working tree, which others may be editing")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before starting, wait up to this many seconds until the machine is idle (other jobs distort timings)")
    ap.add_argument("--from-json", default=None, help="only re-render --md from an existing results JSON")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            R = json.load(f)
        R["goals"] = goals(R)
        with open(args.md, "w") as f:
            f.write(render_md(R, R["meta"]["command"]))
        return 0
    if args.core_rev and not os.environ.get("ASYNCCKPT_BENCH_SNAPSHOT"):
        return run_on_snapshot(args.core_rev, sys.argv[1:] if argv is None else argv)
    q = args.quick
    args.settle_s = args.settle_s if args.settle_s is not None else (1.0 if q else 20.0)
    if q:
        args.skip_process = True
    args.size_mib = args.size_mib or (128 if q else 1024)
    args.reps = args.reps or (2 if q else 3)
    args.n_small = args.n_small or (250 if q else 2000)
    args.plan_tensors = args.plan_tensors or (2000 if q else 10000)
    args.mm_seconds = args.mm_seconds or (1.0 if q else 3.0)
    sections = set(args.sections.split(","))
    nbytes = args.size_mib * MiB
    os.makedirs(args.dir, exist_ok=True)
    t_start = now()
    command = " ".join([".venv/bin/python", "benchmarks/core_bench.py"] + (argv if argv is not None else sys.argv[1:]))
    R: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": command,
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{psutil.virtual_memory().total / GiB:.1f} GiB RAM, kernel {platform.release()}",
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "quick": q, "settle_s": args.settle_s, "reps": args.reps,
            "size_mib": args.size_mib, "dir": args.dir, "loadavg_start": os.getloadavg(),
            **git_meta(),
        },
    }
    import asyncckpt.core as _core_mod
    R["meta"]["core_source"] = os.path.dirname(_core_mod.__file__)
    R["meta"]["core_snapshot_commit"] = os.environ.get("ASYNCCKPT_BENCH_SNAPSHOT")
    if args.wait_quiet > 0:
        log(f"waiting up to {args.wait_quiet:.0f} s for the machine to be idle")
        R["meta"]["wait_quiet"] = wait_quiet(args.wait_quiet)
        log(f"  {R['meta']['wait_quiet']}")
    cpu = CpuMonitor().start()
    R["interference"] = {}

    def section(name, fn, *a):
        t0 = now()
        try:
            return fn(*a)
        finally:
            R["interference"][name] = {"wall_s": now() - t0, **cpu.window(t0, now())}
            i = R["interference"][name]
            log(f"  [{name}: {i['wall_s']:.0f} s, other processes used {i.get('foreign_cpu_cores_mean', 0):.2f} cores on average]")
    with contextlib.suppress(Exception):
        import lightning, safetensors
        R["meta"]["lightning"] = lightning.__version__
        R["meta"]["safetensors"] = safetensors.__version__

    def save_partial():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(rnd(R, 5), f, indent=1, default=str)

    try:
        if "limits" in sections:
            section("limits", guarded, R, "limits", bench_limits, args, nbytes, "start")
        R["limit_values"] = limit_values(R.get("limits", {}), None)
        save_partial()
        if "workloads" in sections:
            R["workloads"] = {}
            sd = make_large(nbytes)
            section("workload_large", guarded, R["workloads"], "large", bench_workload, args, "large", sd)
            del sd
            gc.collect()
            save_partial()
            sd = make_adam(nbytes, args.n_small)
            section("workload_adam", guarded, R["workloads"], "adam", bench_workload, args, "adam", sd)
            del sd
            gc.collect()
            save_partial()
        if "ranks2" in sections:
            section("ranks2", guarded, R, "ranks2", bench_two_ranks, args, nbytes)
            save_partial()
        if "planning" in sections:
            section("planning", guarded, R, "planning", bench_planning, args)
            save_partial()
        if "stall" in sections:
            sd = make_adam(nbytes, args.n_small)
            section("stall", guarded, R, "stall", bench_stall, args, sd, R["limit_values"])
            del sd
            gc.collect()
            save_partial()
        if "limits" in sections:
            section("limits_end", guarded, R, "limits_end", bench_limits, args, nbytes, "end")
            R["limit_values"] = limit_values(R.get("limits", {}), R.get("limits_end"))
    finally:
        cpu.stop()
        R["meta"]["wall_s"] = now() - t_start
        R["meta"]["loadavg_end"] = os.getloadavg()
        R["goals"] = goals(R)
        R["errors_summary"] = collect_errors({k: v for k, v in R.items() if k != "meta"})
        save_partial()
        if args.md:
            os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
            with open(args.md, "w") as f:
                f.write(render_md(R, command))
        with contextlib.suppress(Exception):
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        for name in os.listdir(args.dir) if os.path.isdir(args.dir) else []:
            remove(os.path.join(args.dir, name))
        log(f"done in {(now() - t_start) / 60:.1f} min")
        for g in R["goals"]:
            log(f"goal: {g['goal']}: {g['measured']} -> {g['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
