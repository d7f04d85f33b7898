"""Resuming a framework from a checkpoint, for every adapter: one sequence (``resume``), and the pieces it is
made of.

Every framework resumes through the same steps (saves in flight committed, the checkpoint checked, the files read
once per job), so each adapter passes its framework's own load and nothing else.

More: docs/MODULES.md, core/integration/resume.py.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional, TypeVar

import torch

from asyncckpt.core.api import lifecycle
from asyncckpt.core.errors import CheckpointError
import asyncckpt.core.integration.patching as patching
from asyncckpt.core.loading import cooperative
from asyncckpt.core.loading.hashed_reads import BackgroundCheck, mapped_problem
from asyncckpt.core.storage import commit, file_checksums
from asyncckpt.core import tier
from asyncckpt.core.storage.backend import basename, is_url, normalize
from asyncckpt.core.storage.contents import local_copy
from asyncckpt.core.storage.orphans import wait_for_orphans
from asyncckpt.core.storage.file_checksums import FileChecksum
from asyncckpt.core.verify import integrity

if TYPE_CHECKING:
    from asyncckpt.core.api.checkpointer import Checkpointer

T = TypeVar("T")
logger = logging.getLogger("asyncckpt")

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save files are zip archives
_CPU = ("cpu", torch.device("cpu"))


def wait_for_saves(place: str, orphan_timeout: float = 600.0) -> None:
    """Commit this process's saves still in flight to ``place`` (a checkpoint, or a directory of them)
    or anywhere under it, in every live Checkpointer; raise a failed one. Then wait (bounded) for an
    orphaned writer finishing a checkpoint there: it logs beside its staging directory, in ``place``
    or its parent (Accelerate stages beside ``checkpoints/``)."""
    place = os.path.abspath(os.fspath(place))
    for checkpointer in lifecycle.live():
        for handle in checkpointer.pending():
            if handle.path == place or handle.path.startswith(place + os.sep):
                checkpointer.wait_for(handle.path)
    for folder in (place, os.path.dirname(place)):
        wait_for_orphans(folder, orphan_timeout)


Key = Callable[[str], Optional[float]]  # a framework's sort key for the entries of its checkpoint directory


def prepare(checkpointer: "Checkpointer", place: Optional[str], *, key: Optional[Key] = None,
            mirrored_name: Optional[str] = None) -> None:
    """Step 1 of ``resume``: every save in flight to ``place`` (a checkpoint, or the directory a framework picks
    one from) committed, on every rank (a collective), orphaned writers there included. Then, with the
    ``mirror_to`` option, where the framework is about to pick from ``place`` and finds nothing there in any tier
    (no entry ``key`` knows, or no file ``mirrored_name``: a framework that looks for a fixed name, as
    Lightning's ``last.ckpt``), the newest mirrored checkpoint (or the one of that name) is restored into it. With
    the memory tier on several nodes, where the framework picks from ``place`` (``key``), the nodes first agree on
    the memory checkpoint to resume from and complete their copies of it from each other (``Tier.assemble``)."""
    checkpointer.wait(everywhere=True)
    if place is None or is_url(place):
        return
    wait_for_saves(place, checkpointer.options.timeout)
    if key is not None:  # with the memory tier on several nodes: agree, complete this node's copy
        checkpointer.assemble_from_memory(tier.durable_root_of(place) or place)
    mirror = checkpointer.options.mirror_to
    if not mirror or (mirrored_name is None and key is None):
        return
    if mirrored_name:
        if any(os.path.exists(os.path.join(folder, mirrored_name)) for folder in places(checkpointer, place)):
            return
    elif copies(checkpointer, place, key):
        return
    checkpointer.restore_mirrored(mirror, place, mirrored_name)


def places(checkpointer: "Checkpointer", root: str) -> list[str]:
    """Where the checkpoints of ``root`` (a durable root, or its memory run directory) may be on this node:
    the durable root, and with the memory tier its memory run directory (for an adapter that lists a
    framework's checkpoints itself)."""
    root = tier.durable_root_of(root) or root
    return checkpointer.memory_places(root)


def copies(checkpointer: "Checkpointer", root: str, key: Key) -> list[str]:
    """The checkpoints of ``root`` in every tier of this node, newest first by the framework's ``key``, each copy
    of a checkpoint its own entry, the nearer first: of a name held in memory and on storage, the memory copy
    comes first when it is the same checkpoint (its content's checksums equal) or the newer one. On several nodes,
    of the memory copies only the one they agreed on (``Tier.usable``): every rank tries the same checkpoints."""
    found: dict[str, list[tuple[float, int, str]]] = {}
    for nearness, place in enumerate(places(checkpointer, root)):
        usable = checkpointer.usable_in_memory(place) if nearness else None  # None: any
        for path in candidates(place, key):
            if usable is None or os.path.basename(path) in usable:
                found.setdefault(os.path.basename(path), []).append((key(path), nearness, path))
    for held in found.values():
        held.sort(key=lambda entry: (entry[0], entry[1]), reverse=True)
        if len(held) == 2 and held[0][1] == 0 and commit.same_save(held[0][2], held[1][2]):
            held.reverse()  # the durable copy was written after the memory one: the same checkpoint, further away
    names = sorted(found, key=lambda name: max(entry[0] for entry in found[name]), reverse=True)
    return [path for name in names for _key, _nearness, path in found[name]]


Reads = Literal["file", "directory", "files"]


def resume(checkpointer: "Checkpointer", load: Callable[[Optional[str]], T], *, reads: Reads, path: Optional[str] = None,
           root: Optional[str] = None, key: Optional[Key] = None) -> T:
    """The framework's ``load`` of the checkpoint to resume from, checked as it reads (the module docstring).

    ``path`` alone: the checkpoint the user named. ``root`` alone: the framework picks the newest under it, by its
    own sort ``key``, in any tier (``copies``: with the memory tier, a checkpoint in memory, newer than any
    durable one, or the same one nearer). Both: the framework picked ``path`` from ``root`` itself, and with
    ``resume_from_intact`` older ones may stand in. A damaged copy gives way to the next copy of the same
    checkpoint (its durable one), with a warning naming it. With nothing to resume from, ``load(None)`` (the
    framework's own error, or a fresh start)."""
    options = checkpointer.options
    prepare(checkpointer, path if root is None else root, key=key if path is None else None)
    found = [path] if path is not None else []
    if root is not None and key is not None:
        found += [p for p in copies(checkpointer, root, key) if p != path]
    if not options.resume_from_intact:  # the copies of the chosen checkpoint only
        found = [p for p in found if os.path.basename(p) == os.path.basename(found[0])] if found else []
    if reads == "file" and found:
        return first_intact(found, lambda candidate: load_file(checkpointer, candidate, load))
    if not found or not options.verify:
        return load(found[0] if found else None)
    if reads == "directory":
        return first_intact(found, lambda candidate: checkpointer.load_while_checking(
            candidate, lambda: load(candidate), everywhere=True))
    verified = first_intact(found, lambda candidate: verify(checkpointer, candidate))
    with verified.serving():
        return load(verified.path)


def candidates(root: str, key: Key) -> list[str]:
    """The entries of ``root`` that ``key`` knows (it returns None for the others), newest (largest
    key) first; no ``root``, none. Hidden entries (a save being staged, one being removed) are none."""
    entries = [os.path.join(root, name) for name in os.listdir(root) if not name.startswith(".")] \
        if os.path.isdir(root) else []
    keyed = [(key(path), path) for path in entries]
    return [path for value, path in sorted((kp for kp in keyed if kp[0] is not None), reverse=True)]


def numbered(pattern: "re.Pattern[str]", *, directories: bool = False) -> Callable[[str], Optional[int]]:
    """A framework's sort key for its numbered checkpoints (for ``candidates``): the number ``pattern``'s group 1
    finds in an entry's name (only in a directory's, with ``directories``), else None."""
    def number(path: str) -> Optional[int]:
        found = pattern.search(os.path.basename(path))
        return int(found[1]) if found and (not directories or os.path.isdir(path)) else None

    return number


def first_intact(paths: list[str], attempt: Callable[[str], T]) -> T:
    """``attempt(path)`` for the first of ``paths`` (the framework's pick, then older ones) whose
    attempt raises no ``CheckpointError``; each one skipped is named in a warning. Raises the first
    one's error if none checks out."""
    first_error: Optional[CheckpointError] = None
    for path in paths:
        try:
            result = attempt(path)
        except CheckpointError as e:
            first_error = first_error or e
            logger.warning("asyncckpt: not resuming from %s: %s", path, e)
            continue
        if path != paths[0]:
            logger.warning("asyncckpt: resuming from %s instead (the newest checkpoint that checks out)", path)
        return result
    raise first_error


def load_file(checkpointer: "Checkpointer", path: str, load: Callable[[str], T]) -> T:
    """``load(path)``, the framework's own load of the single file ``path``, on bytes read once per job
    (``readable``), while its checksum is computed beside it; the result only if the bytes are those written,
    else ``CorruptCheckpointError`` naming the file. A file without a checksum (or with ``verify`` off): the
    load alone."""
    expected = file_checksums.read_record(path) if checkpointer.options.verify else None
    with readable(checkpointer, [path]) as local:
        if expected is None:
            return load(local[path])
        result, found = _load_while_checking(local[path], expected, load)
    if found:
        raise integrity.damaged(path, [f"{basename(path)}: {found}"])
    return result


@contextlib.contextmanager
def readable(checkpointer: "Checkpointer", paths: list[str]) -> Iterator[dict[str, str]]:
    """``{path: a local file holding its bytes}`` for the files every rank of the job loads now (a collective):
    a copy in node memory, each byte read from storage once per job (``cooperative.shared_copy``, with the
    ``cooperative_load`` option); else each rank's own: the file itself, or a temporary download of an object
    (``contents.local_copy``: its bytes cross the network once per rank). Files in the memory tier are read
    where they are: they are in this node's memory already."""
    options = checkpointer.options
    in_memory = all(tier.durable_root_of(os.path.dirname(path)) is not None for path in paths)
    with cooperative.shared_copy(paths, checkpointer.process_group, timeout=options.timeout,
                                 readers="off" if in_memory else options.cooperative_load,
                                 memory_root=options.memory_tier.root if options.memory_tier else None) as copies:
        if copies is not None:
            yield copies
            return
    with contextlib.ExitStack() as stack:
        local = {}
        for path in paths:
            folder = stack.enter_context(local_copy(os.path.dirname(path), [basename(path)]))
            local[path] = os.path.join(folder, basename(path))
        yield local


@dataclass
class Verified:
    """A checkpoint directory checked for a resume, holding the objects its check unpickled from its
    ``torch.save`` files until the framework's own ``torch.load`` asks for them (``serving``)."""

    path: str
    report: integrity.Report
    kept: dict[str, Any] = field(default_factory=dict)  # file path -> what torch.load(path, map_location="cpu") gives

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """While the framework loads: its ``torch.load`` of a kept file, onto the CPU, gets the kept object
        (once; any other call reads as usual), and so does its ``safetensors.torch.load_file`` of a kept
        safetensors file (kept where the load read a node-memory copy). What it did not ask for is dropped on
        the way out. With nothing kept (no checksums: written without asyncckpt), both are left alone."""
        if not self.kept:
            yield
            return
        original = torch.load

        def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, os.PathLike)) and not args and map_location in (None, *_CPU) \
                    and not kwargs.get("mmap") and kwargs.keys() <= {"weights_only", "mmap"}:
                kept = self.kept.pop(os.path.abspath(os.fspath(f)), None)
                if kept is not None:
                    return kept
            return original(f, map_location, *args, **kwargs)

        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(patching.patched(torch, "load", load))
                if any(name.endswith(_SAFETENSORS) for name in self.kept):
                    stack.enter_context(self._serving_safetensors())
                yield
        finally:
            self.kept.clear()

    @contextlib.contextmanager
    def _serving_safetensors(self) -> Iterator[None]:
        import safetensors.torch

        original = safetensors.torch.load_file

        def load_file(filename: Any, device: Any = "cpu", **kwargs: Any) -> dict:
            if device in _CPU:  # how its bytes are read (``backend``) changes nothing in what it holds
                kept = self.kept.pop(os.path.abspath(os.fspath(filename)), None)
                if kept is not None:
                    return kept
            return original(filename, device=device, **kwargs)

        with patching.patched(safetensors.torch, "load_file", load_file):
            yield


def verify(checkpointer: "Checkpointer", path: str, *, everywhere: bool = False) -> Verified:
    """``checkpointer.require_intact(path)``, unpickling each ``torch.save`` file of it as it is hashed
    and keeping what it holds for the framework's load (``Verified.serving``). A collective: the files every
    rank loads are read once per job (``readable``); then their kept objects map the node's copy (tensors
    backed by its pages, not copied), safetensors files included."""
    kept: dict[str, Any] = {}
    with readable(checkpointer, _checksummed_files(path)) as local:
        def check_and_keep(file: str, expected: FileChecksum, progress: Optional[Callable[[int], None]]
                           ) -> Optional[str]:
            copy = local.get(os.path.abspath(file), file)
            mapped = copy != file  # a node-memory copy: keep what loads from it by mapping it
            with open(copy, "rb", buffering=0) as f:
                torch_file = f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
            if not torch_file:  # safetensors (mapped by its loader), JSON
                if not (mapped and file.endswith(_SAFETENSORS)):
                    return mapped_problem(copy, expected)
                return _keep(kept, file, *_load_while_checking(copy, expected, _safetensors_load))
            saved_on: set[str] = set()

            def onto_cpu(storage: Any, location: str) -> Any:
                saved_on.add(location)
                return storage

            try:
                loaded, found = _load_while_checking(copy, expected, lambda f: torch.load(
                    f, map_location=onto_cpu, weights_only=True, mmap=mapped))
            except Exception:  # noqa: BLE001 - intact, but not for weights_only (an RNG state's numpy arrays, a
                return None    # pickled class): the framework loads it itself, with the globals it allows
            return _keep(kept, file, loaded if saved_on <= {"cpu"} else None, found)  # then map_location=None: same

        report = checkpointer.require_intact(path, everywhere=everywhere, check_file=check_and_keep)
    return Verified(normalize(path), report, kept)


_SAFETENSORS = ".safetensors"


def _safetensors_load(path: str) -> dict:
    import safetensors.torch

    return safetensors.torch.load_file(path, device="cpu")


def _keep(kept: dict[str, Any], file: str, loaded: Any, found: Optional[str]) -> Optional[str]:
    """Keep ``loaded`` for the framework's load of ``file`` if its bytes are intact; returns the damage found."""
    if found is None and loaded is not None:
        kept[os.path.abspath(file)] = loaded
    return found


def _checksummed_files(path: str) -> list[str]:
    """The files of the directory checkpoint ``path`` that a check hashes one by one (those its commit record has
    a checksum of), as absolute paths: what every rank of a job loads from it, or reads to check it."""
    record = commit.read_commit_record(path) if not is_url(path) else None
    return [os.path.abspath(os.path.join(path, name)) for name in sorted((record or {}).get("checksums", {}))]


def _load_while_checking(path: str, expected: FileChecksum, load: Callable[[str], T]) -> tuple[Optional[T], Optional[str]]:
    """``load(path)`` while a ``BackgroundCheck`` hashes the file: (its result, what is wrong with the file).
    If ``load`` raises: (None, the damage) when the bytes are damaged, else its error, raised."""
    check = BackgroundCheck(path, expected)
    try:
        result = load(path)
    except Exception:
        found = check.problem()
        if found is None:
            raise
        return None, found
    return result, check.problem()
