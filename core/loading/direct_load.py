"""Loading an asyncckpt checkpoint without DCP's load planning, when nothing needs resharding.

More: docs/MODULES.md, core/loading/direct_load.py.
"""
from __future__ import annotations

import gc
import io
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful

from asyncckpt.core.storage.backend import backend_for, join
from asyncckpt.core.loading.metadata_io import DCP_METADATA_FILE, check_relative_path
from asyncckpt.core.loading.reader import RAW_DTYPES, FileSpans, Span, can_read_into, group_by_file, overlapping, read_spans
from asyncckpt.core.formats.names import sidecar_name
from asyncckpt.core.formats.sidecar import Sidecar
from asyncckpt.core.storage.sidecar_io import read_sidecar
from asyncckpt.core.snapshot.structure import flatten_state_dict, set_at

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_ABSENT = object()


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic GC while a load creates its ~10 short-lived objects per key: a collection walks
    the whole heap (a training process's is large), which made parsing a sidecar of thousands of tensors
    several times slower (docs/DESIGN.md, Measured). Nothing created here forms cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class DirectLoad:
    """A planned load: the reads, the blobs of non-tensor values, and where those go."""

    root: str
    files: list[FileSpans]
    objects: list[tuple[str, bytearray]]  # (fqn, buffer the read fills)
    resolved: dict  # the state dict as DCP's loader sees it: Stateful values replaced by their state_dict()
    paths: dict[str, tuple]  # fqn -> path in ``resolved``
    state_dict: dict  # the caller's

    def run(self, threads: int) -> None:
        """Read and verify everything, then put the non-tensor values in place (as dcp.load does)."""
        self.read(threads)
        self.place()

    def read(self, threads: int, files: Optional[list[FileSpans]] = None) -> None:
        """Read and verify ``files`` (default: all of the load's; a cooperative load's share, ``cooperative``)."""
        read_spans(self.root, self.files if files is None else files, threads=threads)

    def place(self) -> None:
        """Put the non-tensor values in place and hand ``Stateful`` values their state (as dcp.load does)."""
        for fqn, blob in self.objects:
            set_at(self.resolved, self.paths[fqn], torch.load(io.BytesIO(blob), weights_only=False))
        for key in sorted(self.state_dict):
            value = self.state_dict[key]
            if isinstance(value, Stateful):
                value.load_state_dict(self.resolved[key])
            else:
                self.state_dict[key] = self.resolved[key]


def _committed_world(root: str, record: dict) -> Optional[int]:
    """The saved world size, if the record lists every rank's sidecar and ``.metadata`` is the one it lists (the
    sidecars then describe exactly what ``.metadata`` does, and it need not be unpickled)."""
    files, world_size = record.get("files"), record.get("world_size")
    if not isinstance(files, dict) or not isinstance(world_size, int) or world_size < 1:
        return None  # e.g. a reduced record of a save through DCP's own API
    if any(sidecar_name(rank) not in files for rank in range(world_size)):
        return None
    try:
        if backend_for(root).stat(join(root, DCP_METADATA_FILE)).size != files.get(DCP_METADATA_FILE):
            return None  # replaced or damaged since the commit: let the checked path deal with it
    except FileNotFoundError:
        return None
    return world_size


def _committed_sidecar(root: str, record: dict, rank: int) -> Optional[Sidecar]:
    """The sidecar of ``rank``, if it is the one of the committed save."""
    try:
        sidecar = read_sidecar(root, rank)
    except FileNotFoundError:
        return None
    return sidecar if sidecar.save_id == record.get("save_id") else None


def _sidecars_for(root: str, record: dict, world_size: int, rank: int,
                  wanted: dict) -> Optional[tuple[list[Sidecar], set]]:
    """The sidecars a load of the keys ``wanted`` reads, and the keys they hold: its own rank's alone where that
    holds every key (a rank that saved its own keys, as a restart of rank-local state: the other ranks' sidecars are
    not parsed), else every rank's, in rank order (replicated state: a key is where the save's dedup put it)."""
    saved: set = set()
    own = _committed_sidecar(root, record, rank) if rank < world_size else None
    if own is not None:
        saved.update(own.tensors.fqn, own.objects.fqn)
        if world_size == 1 or saved.issuperset(wanted):
            return [own], saved
    sidecars = [own if other == rank else _committed_sidecar(root, record, other) for other in range(world_size)]
    if any(sidecar is None for sidecar in sidecars):
        return None
    for sidecar in sidecars:
        if sidecar is not own:
            saved.update(sidecar.tensors.fqn, sidecar.objects.fqn)
    return sidecars, saved


def plan_direct_load(state_dict: dict, root: str, record: dict, *, rank: int, strict: bool,
                     verify: bool) -> Optional[DirectLoad]:
    """The reads of ``rank``'s load that needs no resharding, or None if ``dcp.load`` must do it."""
    world_size = _committed_world(root, record)
    if world_size is None:
        return None
    resolved = {}
    for key in sorted(state_dict):  # dcp.load's order
        value = state_dict[key]
        resolved[key] = value.state_dict() if isinstance(value, Stateful) else value
    flat, paths = flatten_state_dict(resolved)
    chosen = _sidecars_for(root, record, world_size, rank, flat)
    if chosen is None:
        return None
    sidecars, saved = chosen
    if strict and not saved.issuperset(flat):
        return None  # dcp.load names every missing key
    files: list[FileSpans] = []
    taken: Optional[set] = set() if len(sidecars) > 1 else None  # replicated keys every rank wrote: read once
    for sidecar in sidecars:
        for read in (_tensor_reads, _object_reads):
            found = read(sidecar, flat, taken, verify)
            if found is None:
                return None
            for entry in found:
                if entry.spans:
                    check_relative_path(root, entry.relative_path)  # sidecars are input: never read outside root
                    files.append(entry)
    if not _without_repeats(files):
        return None  # state dict tensors sharing memory but saved with different values
    try:  # we write their memory behind autograd's back
        torch.autograd.graph.increment_version([s.target for f in files for s in f.spans if type(s.target) is not bytearray])
    except RuntimeError:
        return None  # inference tensors: dcp.load reports that it cannot write them
    objects = [(span.key, span.target) for f in files for span in f.spans if type(span.target) is bytearray]
    return DirectLoad(root, files, objects, resolved, paths, state_dict)


def _tensor_reads(sidecar: Sidecar, flat: dict, taken: Optional[set], verify: bool) -> Optional[list[FileSpans]]:
    """This rank's tensor items that ``flat`` asks for, per file, in file order; None if one needs dcp.load."""
    t = sidecar.tensors
    shapes = [tuple(shape) for shape in t.shapes]
    at_origin = {index for index, shape in enumerate(shapes) if not any(shape)}
    spans: list[Span] = []
    append, get, dtypes = spans.append, flat.get, RAW_DTYPES
    needed, needed_by = 0, ""
    located: Optional[list] = [] if t.files is not None else None  # items of a share in several files
    for fqn, offsets, sizes, global_size, dtype, file, start, length, data_start, nbytes, digest in zip(
            t.fqn, t.chunk_offsets, t.chunk_sizes, t.global_size, t.dtype, t.item_files(), t.start, t.length,
            t.data_start, t.nbytes, t.xxh3):
        value = get(fqn, _ABSENT)
        if value is _ABSENT:
            continue
        if type(value) not in _PLAIN_TENSORS or sizes != global_size or offsets not in at_origin:
            return None  # not a plain tensor, or the key was saved in chunks: resharding
        if taken is not None:
            if fqn in taken:
                continue
            taken.add(fqn)
        if not can_read_into(value, dtypes.get(dtype), shapes[sizes], nbytes):
            return None
        append(Span(data_start, nbytes, value, digest if verify else None, fqn))
        if located is not None:
            located.append((file, spans[-1], start + length))
        needed, needed_by = start + length, fqn
    return group_by_file(located) if located is not None else [FileSpans(t.file, spans, needed, needed_by)]


def _object_reads(sidecar: Sidecar, flat: dict, taken: Optional[set], verify: bool) -> Optional[list[FileSpans]]:
    """This rank's pickled objects that ``flat`` asks for, each into a buffer of its own, per file."""
    o = sidecar.objects
    located: list = []
    for fqn, file, start, length, digest in zip(o.fqn, o.item_files(), o.start, o.length, o.xxh3):
        value = flat.get(fqn, _ABSENT)
        if value is _ABSENT:
            continue
        if isinstance(value, torch.Tensor):
            return None  # the checkpoint holds an object where the state dict has a tensor
        if taken is not None:
            if fqn in taken:
                continue
            taken.add(fqn)
        located.append((file, Span(start, length, bytearray(length), digest if verify else None, fqn), start + length))
    return group_by_file(located)


def _without_repeats(files: list[FileSpans]) -> bool:
    """Drop reads into memory another read fills with the same bytes (tied weights saved once);
    False if two reads would put different bytes into the same memory (dcp.load's sequential
    copies let the last key win; parallel reads would race)."""
    repeats, clashes = overlapping([(entry.relative_path, span) for entry in files for span in entry.spans])
    if clashes:
        return False
    if repeats:
        for entry in files:
            entry.spans = [span for span in entry.spans if id(span) not in repeats]
    return True
