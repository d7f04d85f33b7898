"""The core's import structure: no import cycle among its modules (imports inside functions count:
they only hide a cycle), no package importing one above it in the layering
errors < formats < storage < writer, tier < client < snapshot < loading < export < verify < api < cli / integration
(the memory tier's package but its training-process half, ``tier.job``, which is the api's level), and the
background writer process loading only its own packages: ``writer``, ``tier`` (but ``tier.job``), ``storage``,
``formats``, ``errors``, and the half of ``export`` that reads without torch (stated here, checked statically and by
running every kind of request through a real writer); and every torch.distributed collective the library runs
in one module, ``snapshot.collectives``, which picks the transport that carries it.
"""
from __future__ import annotations

import ast
import os

import pytest

CORE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "core")
LEVEL = {"errors": 0, "formats": 1, "storage": 2, "writer": 3, "tier": 3, "client": 4, "snapshot": 5, "loading": 6,
         "export": 7, "verify": 8, "api": 9, "cli": 10, "integration": 10}
#: The memory tier's training-process half: the tier of one ``Checkpointer``, at the api's level (it needs torch.distributed,
#: the snapshot's buffers and the options), never loaded by the writer process.
TIER_JOB = "asyncckpt.core.tier.job"
#: What the writer process may load: these packages, and ``export`` but for its modules that read with
#: torch (run by ``asyncckpt export`` and by the child process an export that needs torch runs in).
WRITER_PROCESS = ("errors", "formats", "storage", "writer", "tier")
EXPORT_WITH_TORCH = ("asyncckpt.core.export.torch_sources", "asyncckpt.core.export.peft_merge",
                     "asyncckpt.core.export.__main__")


def _modules() -> dict[str, str]:
    found = {}
    for directory, _subdirectories, files in os.walk(CORE):
        for name in files:
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(directory, name), os.path.dirname(CORE))[:-3].replace(os.sep, ".")
                found["asyncckpt." + relative.removesuffix(".__init__")] = os.path.join(directory, name)
    return found


def _imports() -> dict[str, set[str]]:
    """module -> the core modules it imports anywhere in its source (functions included)."""
    modules = _modules()
    edges: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                candidates = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            edges[module] |= {c for c in candidates if c in modules and c != module and c != "asyncckpt.core"}
    return edges


def _package(module: str) -> str:
    """``storage`` for ``asyncckpt.core.storage.local``, ``errors`` for ``asyncckpt.core.errors``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def _in_writer_process(module: str) -> bool:
    """Whether the writer process may load ``module`` (the ``asyncckpt`` and ``asyncckpt.core`` packages
    themselves run as it starts: their public names load on first use)."""
    if module in ("asyncckpt", "asyncckpt.core"):
        return True
    if _package(module) == "export":
        return module not in EXPORT_WITH_TORCH
    return _package(module) in WRITER_PROCESS and module != TIER_JOB


def test_the_check_sees_the_whole_core():
    edges = _imports()
    assert "asyncckpt.core.storage.backend" in edges and "asyncckpt.core.storage.local" in edges["asyncckpt.core.storage.backend"]


def test_no_import_cycle_among_core_modules():
    edges = _imports()
    visiting, done, cycles = [], set(), []

    def visit(module: str) -> None:
        visiting.append(module)
        for target in sorted(edges[module]):
            if target in visiting:
                cycles.append(visiting[visiting.index(target):] + [target])
            elif target not in done:
                visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(edges):
        if module not in done:
            visit(module)
    assert cycles == [], " ; ".join(" -> ".join(cycle) for cycle in cycles)


def _level(module: str) -> int:
    return LEVEL["api"] if module == TIER_JOB else LEVEL[_package(module)]


@pytest.mark.parametrize("package", sorted(LEVEL))
def test_no_package_imports_one_above_it(package):
    upward = sorted((module, target) for module, targets in _imports().items() for target in targets
                    if _package(module) == package and _package(target) in LEVEL
                    and _level(target) > _level(module))
    assert upward == []


def test_adapters_use_only_the_public_api_and_the_integration_interface():
    """An adapter imports ``asyncckpt.core`` (its ``__all__``) and ``asyncckpt.core.integration`` (its
    modules and ``__all__``), nothing else of the core: the rest is private and may change."""
    import asyncckpt.core as core
    import asyncckpt.core.integration as integration

    adapters = os.path.join(os.path.dirname(CORE), "adapters")
    allowed = {"asyncckpt.core": set(core.__all__), "asyncckpt.core.integration": set(integration.__all__)}
    offending = []
    for directory, _subdirectories, files in os.walk(adapters):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asyncckpt.core"):
                    if node.module in allowed:
                        offending += [f"{path}: {node.module}.{a.name}" for a in node.names if a.name not in allowed[node.module]]
                    elif not node.module.startswith("asyncckpt.core.integration."):
                        offending.append(f"{path}: {node.module}")
                elif isinstance(node, ast.Import):
                    offending += [f"{path}: {a.name}" for a in node.names if a.name.startswith("asyncckpt.core.")
                                  and not a.name.startswith("asyncckpt.core.integration")]
    assert offending == [], offending


def _private_names_of_the_core() -> set[str]:
    """The ``_x`` attributes core classes have: their methods, and what they assign to ``self._x``."""
    names = set()
    for path in _modules().values():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names |= {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self":
                names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_adapters_and_the_kit_reach_no_private_attribute_of_a_core_object():
    """An adapter (``adapters/``) and the adapter kit (``core/integration/``) use a core object through its public
    names: ``checkpointer._ledger`` (or any ``_x`` a core class has) from there is a reach into internals that may
    change. Their own objects' (``self._x``) are theirs."""
    private = _private_names_of_the_core()
    assert "_ledger" in private and "_parts" in private  # the check sees the Checkpointer's components
    root = os.path.dirname(CORE)
    paths = [os.path.join(d, name) for top in ("adapters", os.path.join("core", "integration"))
             for d, _s, files in os.walk(os.path.join(root, top)) for name in files if name.endswith(".py")]
    offending = []
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private and ast.unparse(node.value) not in ("self", "cls"):
                offending.append(f"{os.path.relpath(path, root)}:{node.lineno} {ast.unparse(node)}")
    assert offending == [], offending


#: What runs a collective (or makes or destroys a group, itself one) in torch.distributed, and DCP's wrapper of them.
COLLECTIVES = {"all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
               "all_to_all_single", "barrier", "monitored_barrier", "batch_isend_irecv", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "recv", "recv_object_list",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
               "send_object_list", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
               "destroy_process_group", "_DistWrapper"}
THE_COLLECTIVES_MODULE = os.path.join(CORE, "snapshot", "collectives.py")


def _collective_calls(path: str) -> list[str]:
    """``path:line name`` of each use of a torch.distributed collective in ``path``: through a name bound to
    torch.distributed (``import torch.distributed as dist``: ``dist.barrier``), torch itself
    (``torch.distributed.barrier``), or imported from it (``from torch.distributed import barrier``)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    aliases, imported = {"torch.distributed"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            if node.module.startswith("torch.distributed"):
                imported |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and ast.unparse(node.value) in aliases:
            found.append(f"{path}:{node.lineno} {node.attr}")
        elif isinstance(node, ast.Name) and node.id in imported:
            found.append(f"{path}:{node.lineno} {node.id}")
    return found


def test_every_collective_runs_in_the_collectives_module():
    """Whatever the training's backend (NCCL carries no CPU tensors), the library's collectives run on the
    transport ``snapshot.collectives`` picks: no torch.distributed collective anywhere else in the core or the
    adapters (a framework's own, such as Lightning's ``strategy.broadcast``, is the framework's)."""
    package = os.path.dirname(CORE)
    paths = [os.path.join(d, name) for top in ("core", "adapters") for d, _s, files in os.walk(os.path.join(package, top))
             for name in files if name.endswith(".py")]
    assert len(_collective_calls(THE_COLLECTIVES_MODULE)) >= 8  # the check sees them where they are
    assert [call for path in paths if path != THE_COLLECTIVES_MODULE for call in _collective_calls(path)] == []


def test_the_export_halves_are_what_the_layout_says():
    edges = _imports()
    assert set(EXPORT_WITH_TORCH) <= set(edges)
    assert "asyncckpt.core.export.request" in edges and _in_writer_process("asyncckpt.core.export.request")


@pytest.mark.parametrize("package", ["writer", "tier", "export"])
def test_what_the_writer_process_runs_imports_only_what_it_may_load(package):
    """The writer package, and the memory tier's half that the writer runs, import only writer/tier/storage/formats/
    errors modules; export's half without torch (its request, options, sources, assembly, writing) only those and
    itself."""
    offending = sorted((module, target) for module, targets in _imports().items() for target in targets
                       if _package(module) == package and _in_writer_process(module) and not _in_writer_process(target))
    assert offending == []


def _imported_by_writers(stderr: str) -> set[str]:
    """The modules ``PYTHONPROFILEIMPORTTIME`` (``python -X importtime``) reported on ``stderr``: every
    module a process imported, in the order it did, one line each (``import time: self | cumulative | name``)."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and "imported package" not in line}


def test_the_writer_process_loads_only_its_packages_and_never_torch(tmp_path, s3_root, monkeypatch, capfd):
    """A real writer (started by a Checkpointer, as ever) runs every kind of request: native files, a
    directory transaction mirrored to an object store, a removal, sharded saves (whose DCP metadata rank
    0's writer pickles itself, see dcp_pickle), retention, an export. CPython's own import report
    (``PYTHONPROFILEIMPORTTIME``, which the writer inherits with the environment, written to its stderr,
    the test's) then lists every module it loaded: of asyncckpt only the writer's packages, and never
    torch (~190 MiB of its own memory and ~1 s of CPU to import)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from asyncckpt import core

    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # read by every Python process started from now on
    capfd.readouterr()
    manager = core.CheckpointManager(tmp_path / "managed", keep_last=1, checkpointer=core.Checkpointer())
    ck = manager.checkpointer
    ck.save_file({"w": torch.ones(3), "step": 2}, tmp_path / "a.pt")
    ck.save_file({"w": torch.ones(3)}, tmp_path / "a.safetensors", format="safetensors")
    tx = ck.begin_directory(tmp_path / "checkpoint-1", step=1)
    tx.save_file({"w": torch.ones(3)}, "model.safetensors", format="safetensors")
    tx.write_bytes("trainer_state.json", b"{}")
    ck.mirror(tmp_path / "checkpoint-1", f"{s3_root}/mirrored/checkpoint-1", after=tx.commit()).result()
    ck.remove([tmp_path / "a.pt"]).result()
    ck.wait()
    assert core.is_complete(str(tmp_path / "checkpoint-1")) and not os.path.exists(tmp_path / "a.pt")
    assert core.is_complete(f"{s3_root}/mirrored/checkpoint-1")
    for step in (1, 2):  # sharded saves, then retention deleting step 1
        manager.save(step, {"w": torch.full((4,), float(step)), "step": step})
    assert manager.steps() == [2]
    ck.export(core.latest_checkpoint(str(tmp_path / "managed")), core.ExportOptions(directory=str(tmp_path / "export"))).result()
    assert os.listdir(tmp_path / "export")
    loaded = {"w": torch.zeros(4), "step": 0}
    dcp.load(loaded, checkpoint_id=core.latest_checkpoint(str(tmp_path / "managed")))  # torch's own reader unpickles the writer's .metadata
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.full((4,), 2.0))
    manager.close()  # the writer exits: everything it loaded is reported

    loaded_modules = _imported_by_writers(capfd.readouterr().err)
    ours = {module for module in loaded_modules if module.split(".")[0] == "asyncckpt"}
    assert {"asyncckpt.core.writer.directory_requests", "asyncckpt.core.writer.mirror",
            "asyncckpt.core.writer.file_requests", "asyncckpt.core.writer.shard_requests",
            "asyncckpt.core.writer.retention", "asyncckpt.core.export.request"} <= ours  # the report is the writer's
    assert sorted(module for module in ours if not _in_writer_process(module)) == []
    assert not {module for module in loaded_modules if module.split(".")[0] == "torch"}
