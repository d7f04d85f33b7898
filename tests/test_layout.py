"""The core's import structure: no import cycle among its modules (imports inside functions count:
they only hide a cycle), and no package importing one above it in the layering
errors < formats < storage < writer < snapshot < loading < verify < api < cli / integration.
"""
from __future__ import annotations

import ast
import os

import pytest

CORE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core")
LEVEL = {"errors": 0, "formats": 1, "storage": 2, "writer": 3, "snapshot": 4, "loading": 5, "verify": 6,
         "api": 7, "cli": 8, "integration": 8}


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


@pytest.mark.parametrize("package", sorted(LEVEL))
def test_no_package_imports_one_above_it(package):
    upward = sorted((module, target) for module, targets in _imports().items() for target in targets
                    if _package(module) == package and _package(target) in LEVEL
                    and LEVEL[_package(target)] > LEVEL[package])
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
