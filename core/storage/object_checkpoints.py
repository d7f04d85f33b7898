"""Checkpoints in an object store: written under their own prefix, visible once a commit object exists.

There is no rename in an object store, so a checkpoint ``s3://bucket/ckpts/step_100`` is written
in place, under the prefix ``s3://bucket/ckpts/step_100/`` with the same objects a local
checkpoint directory holds (DCP's ``.metadata`` and ``__{rank}_{n}.distcp``, our sidecars), and
it becomes visible when rank 0's writer creates its commit object ``.asyncckpt-commit.json``
*create-only* (S3 ``If-None-Match: *``): two committers can never both succeed, and a commit
never overwrites another. Everything that finds or lists checkpoints (``latest_checkpoint``,
retention, ``asyncckpt ls``) reads commit objects, from a delimited listing of the root (one
level: the checkpoints' names, never their data objects); a prefix without one is never
returned. Ranks meet through the torch.distributed Store (``barrier.StoreBarrier``), never by
listing the bucket.

While a save runs, each rank's writer keeps an owner marker ``.asyncckpt-owner-{rank}`` (its
owner token, ``leftovers``) under the prefix; the commit deletes them. A single file
(``last.ckpt``) is one object, which an S3 upload makes visible whole or not at all; its checksum
travels as the object's user metadata ``asyncckpt-checksum`` (the local files' extended
attribute), and a hidden marker object ``.{name}.asyncckpt-tmp-{token}`` beside it names its
writer while it uploads. Removal writes ``.asyncckpt-removing`` under the prefix, deletes the
commit object (the checkpoint is gone from every listing), then the rest. ``leftovers_under``
judges what crashed writers left (uncommitted prefixes, markers, incomplete multipart uploads)
by those owner tokens, as for local leftovers.

Overwriting a committed checkpoint at the same URL is not atomic: rank 0's writer deletes the old
commit object when the new save starts, so the old checkpoint disappears then, and with several
ranks another rank may already be replacing its objects (a reader of it then fails on checksums,
never loads wrong data). Save under new names (steps) where that matters.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

import json
import posixpath
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from asyncckpt.core.storage import commit
from asyncckpt.core.storage import leftovers
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import checksum
from asyncckpt.core.errors import CheckpointWriteError
from asyncckpt.core.storage.file_checksums import FileChecksum, parse_record, record_body
from asyncckpt.core.storage.object_store import ObjectStore, ObjectStoreOptions, store_for
from asyncckpt.core.writer.protocol import RequestContext

CHECKSUM_METADATA = "asyncckpt-checksum"  # user metadata of a single-file object: its checksum record
REMOVING_MARKER = ".asyncckpt-removing"  # under a prefix being removed: garbage, whoever wrote it


# ----------------------------------------------------------------------------------- saving
@dataclass
class ObjectDestination:
    """``storage.Destination`` for a URL: the checkpoint's own prefix and its commit object."""

    directory: str  # the checkpoint's URL (its prefix)
    options: Optional[ObjectStoreOptions] = None
    coordinator: bool = False

    @property
    def store(self) -> ObjectStore:
        return store_for(self.directory, self.options)

    def _url(self, name: str) -> str:
        return posixpath.join(self.directory, name)

    def claim(self, rank: int, token: str) -> None:
        if self.coordinator:  # an older checkpoint here stops being one before anything of it changes
            self.store.delete([self._url(names.COMMIT_RECORD)])
        self.store.put(self._url(names.owner_marker_name(rank)), token.encode())

    def tidy(self, context: RequestContext) -> None:
        pass  # leftovers in object stores go with ``asyncckpt clean`` (listing the bucket per save is not free)

    def write_image(self, name: str, image: memoryview, size: int, wait_ready: Optional[Callable[[float], float]]) -> None:
        self.store.upload(self._url(name), image, size, wait_ready=wait_ready)

    def write_small(self, name: str, data: bytes) -> None:
        self.store.put(self._url(name), data)

    def write_atomic(self, name: str, data: bytes) -> None:
        self.store.put(self._url(name), data)  # an object appears whole or not at all

    def publish(self, record: dict) -> Optional[str]:
        """Create the commit object (listing every object of the checkpoint and its size), once;
        then drop the owner markers."""
        entries = self.store.list(self.directory)
        files = {e.name: e.size for e in entries if not e.is_prefix and names.is_published_file(e.name)}
        try:
            self.store.put(self._url(names.COMMIT_RECORD), commit.commit_record_bytes({"files": files, **record}),
                           exclusive=True)
        except FileExistsError:
            raise CheckpointWriteError(f"{self.directory} was committed by another save meanwhile (another job "
                                       "writing the same checkpoint?); this save is not published") from None
        self.store.delete([e.url for e in entries if names.OWNER_MARKER_PATTERN.match(e.name)])
        return None

    def delete(self, replaced: str, token: str) -> None:
        pass  # nothing is replaced: see the module docstring


@dataclass
class ObjectFileRequest:
    """Upload a staged single file as one object, with its checksum in the object's metadata."""

    path: str
    size: int
    options: Optional[ObjectStoreOptions] = None

    def run(self, context: RequestContext) -> None:
        store = store_for(self.path, self.options)
        image = context.image[:self.size]
        digest = FileChecksum(self.size, checksum(image))  # before the upload: S3 takes metadata up front
        parent, name = posixpath.split(self.path)
        marker = posixpath.join(parent, names.hidden_name(name, "tmp", context.token()))
        store.put(marker, b"")
        try:
            store.upload(self.path, context.image, self.size, metadata={CHECKSUM_METADATA: record_body(digest)})
        finally:
            store.delete([marker])


def read_file_checksum(url: str) -> Optional[FileChecksum]:
    """The checksum a single-file object carries, or None (written without asyncckpt)."""
    body = store_for(url, None).user_metadata(url).get(CHECKSUM_METADATA)
    return parse_record(body.encode()) if body else None


# ----------------------------------------------------------------------------------- finding
def committed_under(root: str, options: Optional[ObjectStoreOptions] = None) -> Iterator[tuple[str, Optional[dict]]]:
    """``(url, commit record or None)`` of every checkpoint name directly under ``root`` (one
    delimited listing, then the candidates' commit objects, fetched side by side)."""
    store = store_for(root, options)
    try:
        entries = store.list(root.rstrip("/"))
    except FileNotFoundError:
        return iter(())
    candidates = [e.url for e in entries if e.is_prefix and not e.name.startswith(".")]
    bodies = store.get_many([posixpath.join(url, names.COMMIT_RECORD) for url in candidates])
    return iter([(url, _parse_commit(body)) for url, body in zip(candidates, bodies)])


def _parse_commit(body: Optional[bytes]) -> Optional[dict]:
    if body is None:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("format") != commit.COMMIT_FORMAT:
        return None
    return record


# ----------------------------------------------------------------------------------- removing
def remove(url: str, options: Optional[ObjectStoreOptions] = None) -> None:
    """Remove a checkpoint (prefix) or a single-file object: for a prefix, first mark it as being
    removed and delete its commit object (gone from every listing at once), then everything else."""
    store = store_for(url, options)
    commit_url = posixpath.join(url, names.COMMIT_RECORD)
    if store.exists(commit_url) or not _is_object(store, url):
        store.put(posixpath.join(url, REMOVING_MARKER), b"")
        store.delete([commit_url])
        store.delete_prefix(url)
    else:
        store.delete([url])


def _is_object(store: ObjectStore, url: str) -> bool:
    try:
        store.info(url)
        return True
    except FileNotFoundError:
        return False


@dataclass
class ObjectRemoveRequest:
    """``file_requests.RemoveRequest`` for URLs (same queue order and ``after`` rule)."""

    paths: list
    options: Optional[ObjectStoreOptions] = None

    def run(self, context: RequestContext) -> None:
        for path in self.paths:
            remove(path, self.options)


# ----------------------------------------------------------------------------------- leftovers
@dataclass
class ObjectLeftover:
    """What a crashed or killed writer left under a root; ``alive`` as in ``leftovers.Leftover``."""

    url: str
    kind: str  # "uncommitted" (a prefix), "upload" (an incomplete multipart upload), "tmp" (a single file's marker)
    belongs_to: str
    alive: Optional[bool]
    modified: float
    size: int = 0


def leftovers_under(root: str, options: Optional[ObjectStoreOptions] = None) -> list[ObjectLeftover]:
    """Uncommitted prefixes, single-file markers and incomplete uploads directly under ``root``."""
    store = store_for(root, options)
    try:
        entries = store.list(root)
    except FileNotFoundError:
        return []
    found: list[ObjectLeftover] = []
    writing: dict[str, Optional[bool]] = {}  # single-file name -> whether a writer of it lives
    for entry in entries:
        hidden = names.parse_hidden(entry.name)
        if hidden is not None and hidden.kind == "tmp":
            alive = leftovers.owner_alive(hidden.token)
            writing[hidden.name] = True if alive or writing.get(hidden.name) else alive
            found.append(ObjectLeftover(entry.url, "tmp", hidden.name, alive, entry.modified))
    prefixes = [e for e in entries if e.is_prefix and not e.name.startswith(".")]
    records = store.get_many([posixpath.join(e.url, names.COMMIT_RECORD) for e in prefixes])
    uploads = store.incomplete_uploads(root)
    for entry, record in zip(prefixes, records):
        if _parse_commit(record) is None:
            found.append(_uncommitted(store, entry.url, entry.name, uploads))
    dead_prefixes = {leftover.url for leftover in found if leftover.kind == "uncommitted"}
    for upload in uploads:
        if any(upload.url.startswith(prefix + "/") for prefix in dead_prefixes):
            continue  # goes with its prefix
        name = upload.url[len(root.rstrip("/")) + 1:].split("/", 1)[0]
        alive = writing.get(name) if "/" not in upload.url[len(root.rstrip("/")) + 1:] else None
        found.append(ObjectLeftover(upload.url, "upload", name, alive, upload.initiated))
    return found


def _uncommitted(store: ObjectStore, url: str, name: str, uploads: list) -> ObjectLeftover:
    """An uncommitted prefix, judged by its owner markers (``leftovers.owner_alive``)."""
    entries = store.list(url)
    size = sum(e.size for e in entries)
    modified = max((e.modified for e in entries), default=0.0)
    modified = max([modified] + [u.initiated for u in uploads if u.url.startswith(url + "/")])
    if any(e.name == REMOVING_MARKER for e in entries):
        return ObjectLeftover(url, "uncommitted", name, False, modified, size)
    markers = [e.url for e in entries if names.OWNER_MARKER_PATTERN.match(e.name)]
    verdicts = [leftovers.owner_alive(body.decode(errors="replace")) if body is not None else None
                for body in store.get_many(markers)]
    if any(v is True for v in verdicts):
        alive: Optional[bool] = True
    elif verdicts and all(v is False for v in verdicts):
        alive = False
    else:
        alive = None
    return ObjectLeftover(url, "uncommitted", name, alive, modified, size)


def removable(leftover: ObjectLeftover, unknown_older_than: Optional[float]) -> bool:
    """As ``leftovers.removable``: the owner is gone, or unknown and older than ``unknown_older_than``."""
    if leftover.alive is False:
        return True
    return leftover.alive is None and unknown_older_than is not None and time.time() - leftover.modified >= unknown_older_than


def delete_leftover(leftover: ObjectLeftover, options: Optional[ObjectStoreOptions] = None) -> None:
    store = store_for(leftover.url, options)
    if leftover.kind == "uncommitted":
        for upload in store.incomplete_uploads(leftover.url):
            store.abort_upload(upload)
        store.delete_prefix(leftover.url)
    elif leftover.kind == "upload":
        for upload in store.incomplete_uploads(posixpath.dirname(leftover.url)):
            if upload.url == leftover.url:
                store.abort_upload(upload)
    else:
        store.delete([leftover.url])
