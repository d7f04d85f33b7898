"""Pickling DCP's ``.metadata`` on every save without re-pickling every tensor entry.

For 8,000 tensors ``pickle.dumps(Metadata)`` costs the writer 0.1-0.3 s of CPU per save (tens of
thousands of Python-level reduce and ``__getstate__`` calls), yet everything but a handful of
entries (the non-tensor items, and which checkpoint this is) is identical from one save of a
structure to the next. So the tensor entries are pickled once per structure into a protocol-2
stream that has integer markers where the per-save parts go, and each save splices small pickles
of those parts into the holes. The result is an ordinary pickle, equal after loading to
``pickle.dumps`` of the same ``Metadata``, which torch's stock ``FileSystemReader`` (plain
``pickle.load``) and our restricted unpickler read.

Why splicing is sound:
- protocol 2 numbers memo entries explicitly (``BINPUT n``), so the template's references to its
  own memo stay valid whatever is inserted between them;
- the spliced parts are pickled with ``Pickler.fast`` (no memo at all), so they neither refer to
  nor add to the template's memo;
- each hole is either a position where the stream expects exactly one value, or a span inside a
  dict's ``MARK ... SETITEMS`` batch, where any number of key/value pairs may stand. Each dict
  gets two marker pairs, so it always has >= 2 entries and is written in that batched form (a
  one-entry dict is written with ``SETITEM`` instead); if the pickler closes a batch of 1,000
  between the two marker pairs, the cut removes that ``SETITEMS MARK`` and merges the batches.
"""
from __future__ import annotations

import io
import pickle
import secrets
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

_PROTOCOL = 2
_BININT = b"J"  # opcode of a 4-byte signed int: markers are chosen in [2**30, 2**31)


def _fragment(obj: Any) -> bytes:
    """The opcodes that push ``obj``, with no memo use (no PROTO header, no STOP)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=_PROTOCOL)
    pickler.fast = True
    pickler.dump(obj)
    return buffer.getvalue()[2:-1]


def _pairs(entries: dict) -> bytes:
    return b"".join(_fragment(key) + _fragment(value) for key, value in entries.items())


class MetadataPickleTemplate:
    """``.metadata`` bytes for one structure's tensor entries, with holes for the rest."""

    def __init__(self, tensor_entries: dict, tensor_storage: dict) -> None:
        for _attempt in range(8):
            markers = [secrets.randbelow(1 << 30) + (1 << 30) for _ in range(11)]
            if len(set(markers)) != len(markers):
                continue
            m = iter(markers)
            template = Metadata(
                state_dict_metadata={**tensor_entries, next(m): next(m), next(m): next(m)},
                planner_data=next(m),
                storage_data={**tensor_storage, next(m): next(m), next(m): next(m)},
                storage_meta=next(m),
                version=next(m),
            )
            stream = pickle.dumps(template, protocol=_PROTOCOL)
            spans = self._holes(stream, markers)
            if spans is not None:
                break
        else:  # pragma: no cover - needs eight marker collisions with the data in a row
            raise RuntimeError("could not place unique markers in the .metadata template")
        cuts = [0] + [edge for span in spans for edge in span] + [len(stream)]
        self._parts = [stream[cuts[i]:cuts[i + 1]] for i in range(0, len(cuts), 2)]

    @staticmethod
    def _holes(stream: bytes, markers: list[int]) -> list[tuple[int, int]] | None:
        """(start, end) of the five holes, or None if a marker is not unique in the stream."""
        where = []
        for marker in markers:
            pattern = _BININT + marker.to_bytes(4, "little")
            position = stream.find(pattern)
            if position < 0 or stream.find(pattern, position + 1) >= 0:
                return None
            where.append(position)
        op = len(_BININT) + 4
        return [
            (where[0], where[3] + op),  # state_dict_metadata: the two marker pairs
            (where[4], where[4] + op),  # planner_data
            (where[5], where[8] + op),  # storage_data: the two marker pairs
            (where[9], where[9] + op),  # storage_meta
            (where[10], where[10] + op),  # version
        ]

    def render(self, *, object_entries: dict, planner_data: Any, object_storage: dict, storage_meta: Any,
               version: Any) -> bytes:
        """The whole ``.metadata`` pickle: the tensor entries plus this save's parts."""
        first, after_entries, after_planner, after_storage, after_meta, last = self._parts
        return b"".join((
            first, _pairs(object_entries), after_entries, _fragment(planner_data), after_planner,
            _pairs(object_storage), after_storage, _fragment(storage_meta), after_meta, _fragment(version), last,
        ))
