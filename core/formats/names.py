"""Every name asyncckpt gives a file or directory on disk, and how to tell one of ours apart.

More: docs/MODULES.md, core/formats/names.py.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

# ------------------------------------------------------------------------ inside a checkpoint
COMMIT_RECORD = ".asyncckpt-commit.json"
DCP_METADATA_FILE = ".metadata"
ABORT_MARKER = "ABORTED.json"  # in a staging directory: the save failed on some rank
REMOVING_MARKER = ".asyncckpt-removing"  # under an object-store prefix being removed: garbage, whoever wrote it
CHECKSUM_ATTRIBUTE = "user.asyncckpt.checksum"  # a single file's checksum record, attached (an extended attribute)


def data_file_name(rank: int) -> str:
    """A rank's tensor data (``torch.save`` containers back to back, DCP's naming)."""
    return f"__{rank}_0.distcp"


def objects_file_name(rank: int) -> str:
    """A rank's pickled non-tensor values."""
    return f"__{rank}_1.distcp"


def shared_file_name(name: str, save_id: str) -> str:
    """The name a data file written by save ``save_id`` (``__{rank}_{n}.distcp`` there) has in a later checkpoint
    that shares its bytes (a hard link of it: ``storage.sharing``): ``__{rank}_{n}.{save_id}.distcp``. A file that
    already has such a name keeps it."""
    if SHARED_FILE_PATTERN.match(name):
        return name
    stem, extension = os.path.splitext(name)
    return f"{stem}.{save_id}{extension}"


def sidecar_name(rank: int) -> str:
    """A rank's sidecar: where each of its items lies, and its checksum."""
    return f"__{rank}.asyncckpt.json"


def done_marker_name(rank: int) -> str:
    """In a staging directory: this rank's share is durable (file barrier)."""
    return f"__{rank}.done"


def barrier_place_name(save_key: str) -> str:
    """Under an object-store checkpoint's prefix: where the ranks of one save leave their markers
    (``done_marker_name``...; hidden, so never published)."""
    return f".asyncckpt-barrier-{save_key}"


def alive_marker_name(rank: int) -> str:
    """In a staging directory: the owner token of the writer at work on this rank's part of a
    save, rewritten while it works (file barrier: what an orphaned writer judges a rank's writer by)."""
    return f"__{rank}.alive"


def error_marker_name(rank: int) -> str:
    """In a staging directory: this rank's share failed, and why (file barrier)."""
    return f"__{rank}.error.json"


def files_record_name(rank: int) -> str:
    """In a staging directory: the checksums of the files this rank wrote into a directory checkpoint."""
    return f"__{rank}.files.json"


def owner_marker_name(rank: int) -> str:
    """In a staging directory: the owner token of the writer writing this rank's share."""
    return f".asyncckpt-owner-{rank}"


_STEP_IN_NAME = re.compile(r"step[=_-]?(\d+)")
_TRAILING_NUMBER = re.compile(r"(\d+)$")


def step_from_name(name: str) -> Optional[int]:
    """The step a checkpoint's name gives, for one whose commit record has none (a native file):
    step_000120 -> 120, checkpoint-12 -> 12, epoch=1-step=15.ckpt -> 15."""
    match = _STEP_IN_NAME.search(name) or _TRAILING_NUMBER.search(os.path.splitext(name)[0])
    return int(match.group(1)) if match else None


SIDECAR_PATTERN = re.compile(r"^__(\d+)\.asyncckpt\.json$")
DATA_FILE_PATTERN = re.compile(r"^__(\d+)_\d+(?:\.[0-9a-zA-Z_-]+)?\.distcp$")  # a rank's own, or one it shares
SHARED_FILE_PATTERN = re.compile(r"^__(\d+)_\d+\.[0-9a-zA-Z_-]+\.distcp$")  # ``shared_file_name``
OWNER_MARKER_PATTERN = re.compile(r"^\.asyncckpt-owner-(\d+)$")
COORDINATION_FILE_PATTERN = re.compile(r"^(__\d+\.(done|alive|error\.json|files\.json)|ABORTED\.json|\.asyncckpt-owner-\d+)$")


def is_published_file(name: str) -> bool:
    """Whether a file in a staging directory belongs to the checkpoint (listed in the commit
    record) rather than to the coordination of its writers."""
    if COORDINATION_FILE_PATTERN.match(name):
        return False
    return not name.startswith(".") or name == DCP_METADATA_FILE


# ------------------------------------------------------------------------ beside a checkpoint
HIDDEN_KINDS = ("staging", "replaced", "removing", "tmp", "link")
_HIDDEN = re.compile(r"^\.(?P<name>.+)\.asyncckpt-(?P<kind>" + "|".join(HIDDEN_KINDS) + r")-(?P<token>[0-9a-zA-Z_.-]+)$")


@dataclass(frozen=True)
class HiddenName:
    """A parsed hidden name: which entry it belongs to, what it is, and its token."""

    name: str
    kind: str
    token: str


def hidden_name(name: str, kind: str, token: str) -> str:
    if kind not in HIDDEN_KINDS:
        raise ValueError(f"unknown hidden kind {kind!r}")
    return f".{name}.asyncckpt-{kind}-{token}"


def parse_hidden(entry: str) -> Optional[HiddenName]:
    """The parts of one of our hidden names, or None for any other name."""
    match = _HIDDEN.match(entry)
    return HiddenName(match["name"], match["kind"], match["token"]) if match else None


_HIDDEN_IN_TEXT = re.compile(r"\.([^/\s'\"]+?)\.asyncckpt-(?:" + "|".join(HIDDEN_KINDS) + r")-[0-9a-zA-Z_.-]+")


def unhide(text: str) -> str:
    """``text`` with every hidden name replaced by the name it belongs to: messages for people
    name the checkpoint they asked for, not where it was staged."""
    return _HIDDEN_IN_TEXT.sub(r"\1", text)


def is_hidden(path: str) -> bool:
    return parse_hidden(os.path.basename(os.path.normpath(path))) is not None


def hidden_path(path: str, kind: str, token: str, parent: Optional[str] = None) -> str:
    """The hidden sibling of ``path`` (or its hidden name in ``parent``, which must be on the
    same filesystem: entries move between the two by rename)."""
    own_parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.abspath(parent) if parent else own_parent, hidden_name(name, kind, token))


def staging_dir_for(final_path: str, save_id: str, parent: Optional[str] = None) -> str:
    return hidden_path(final_path, "staging", save_id, parent)
