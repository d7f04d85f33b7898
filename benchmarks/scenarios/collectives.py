"""What asyncckpt's own process group costs where the training's carries no CPU tensors, at 2, 4 and 8 ranks.

Under NCCL (here a default group made with ``init_process_group("cuda:gloo")``, which refuses CPU tensors as NCCL
does) the library makes a gloo group of its own over the same ranks (``snapshot.collectives``) at the first
collective that needs it, and one of half the ranks (one rank per node, two ranks per node here) for what crosses
nodes in a cooperative load. Per rep, every rank starts together (a Store barrier): the group made (``new_group``:
every rank connects to every other one, through the rendezvous Store), its first collective (a 24-byte
all_gather), a later one, the one-per-node group made; then both given up (``release``, as a Checkpointer's
teardown). The slowest rank's time, since the group serves only once every rank has it; rep 0 is dropped (the
first group of a process).
"""
from __future__ import annotations

from harness import Option, Scenario
from harness.ranks import on_ranks
from harness.report import bars, fmt, table
from harness.util import median, now

KEYS = ("create_s", "first_s", "steady_s", "nodes_create_s")


def _together(store, world: int, key: str) -> None:
    """Every rank here, released at once (the last to arrive opens the gate)."""
    if store.add(f"bench/{key}", 1) == world:
        store.set(f"bench/{key}/go", "1")
    store.wait([f"bench/{key}/go"])


def _rank(rank: int, world: int, reps: int) -> dict:
    import torch.distributed as dist

    from asyncckpt.core.snapshot import collectives

    store = dist.distributed_c10d._get_default_store()
    rows: dict[str, list[float]] = {key: [] for key in KEYS}
    for rep in range(reps + 1):
        _together(store, world, f"{rep}")
        t0 = now()
        ranks = collectives.over(None)
        ranks.carrier()
        created = now() - t0
        t0 = now()
        ranks.gather_ints([rank, rep, 0])
        first = now() - t0
        t0 = now()
        ranks.gather_ints([rank, rep, 1])
        steady = now() - t0
        _together(store, world, f"{rep}/nodes")
        t0 = now()
        ranks.among(range(0, world, 2))
        nodes = now() - t0
        collectives.release()
        if rep:
            for key, value in zip(KEYS, (created, first, steady, nodes)):
                rows[key].append(value)
    return rows


def groups(world: int, reps: int) -> dict:
    ranks = on_ranks(_rank, world, reps, backend="cuda:gloo")
    return {key: [max(values) for values in zip(*(rank[key] for rank in ranks))] for key in KEYS}


def measure(sitting) -> dict:
    worlds = [int(w) for w in str(sitting.o.worlds).split(",")]
    out: dict[str, dict] = {}
    for _, world in sitting.abba(worlds, 2):
        with sitting.phase(f"{world} ranks"):
            found = sitting.child("groups", world=world, reps=sitting.o.reps)
        entry = out.setdefault(str(world), {key: [] for key in KEYS})
        for key in KEYS:
            entry[key] += found[key]
    return out


def render(result: dict) -> str:
    figures = result["figures"]
    worlds = sorted(figures, key=int)
    created = {w: median(figures[w]["create_s"]) for w in worlds}
    first, last = worlds[0], worlds[-1]
    growth = created[last] / created[first] if created[first] else None
    return "\n".join([
        f"Medians over {len(figures[first]['create_s'])} reps per world size (two children each, ABBA), in ms; each rep "
        "the slowest rank. The machine has 2 cores: at 8 ranks, 8 processes share them.", "",
        *table(["ranks", "our group made", "its first all_gather", "a later all_gather",
                "one rank per node (half the ranks): made"],
               [[w, fmt(1000 * created[w], ".1f"), fmt(1000 * median(figures[w]["first_s"]), ".2f"),
                 fmt(1000 * median(figures[w]["steady_s"]), ".2f"), fmt(1000 * median(figures[w]["nodes_create_s"]), ".1f")]
                for w in worlds]),
        "", f"From {first} to {last} ranks the group costs {fmt(growth, '.1f')}x as much: each rank connects to every "
            "other one (w - 1 connections each, w(w - 1)/2 in all, every address through the rendezvous Store)."])


def plot(result: dict, figure) -> None:
    figures = result["figures"]
    worlds = sorted(figures, key=int)
    bars(figure.subplots(), [f"{w} ranks" for w in worlds], [1000 * median(figures[w]["create_s"]) for w in worlds],
         "ms to make the group (median)")


SCENARIO = Scenario(
    title="The library's own process group",
    question=__doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"worlds": Option("2,4,8", "2", "the world sizes, comma-separated")},
    reps=(10, 1),
)
