"""An object store as a ``backend.Backend``: checkpoints written under their own prefix, visible once a
commit object exists.

There is no rename in an object store, so a checkpoint ``s3://bucket/ckpts/step_100`` is written
in place, under the prefix ``s3://bucket/ckpts/step_100/`` with the same objects a local
checkpoint directory holds (DCP's ``.metadata`` and ``__{rank}_{n}.distcp``, our sidecars), and
it becomes visible when rank 0's writer creates its commit object ``.asyncckpt-commit.json``
*create-only* (S3 ``If-None-Match: *``): two committers can never both succeed, and a commit
never overwrites another. Everything that finds or lists checkpoints (``latest_checkpoint``,
retention, ``asyncckpt ls``) reads commit objects, from a delimited listing of the root (one
level: the checkpoints' names, never their data objects); a prefix without one is never
returned. Ranks meet through the torch.distributed Store (``barrier.StoreBarrier``) while their
training processes live; each also leaves a marker object under a hidden prefix of the save's own
(``barrier_place``), where writers whose training processes died meet instead (``barrier.MarkerBarrier``).

While a save runs, each rank's writer keeps an owner marker ``.asyncckpt-owner-{rank}`` (its
owner token, ``leftovers``) under the prefix; the commit deletes them. A single file
(``last.ckpt``) is one object, which an S3 upload makes visible whole or not at all; its checksum
travels as the object's user metadata ``asyncckpt-checksum`` (the local files' extended
attribute), and a hidden marker object ``.{name}.asyncckpt-tmp-{token}`` beside it names its
writer while it uploads. Removal writes ``.asyncckpt-removing`` under the prefix, deletes the
commit object (the checkpoint is gone from every listing), then the rest. ``find_leftovers``
judges what crashed writers left (uncommitted prefixes, markers, incomplete multipart uploads)
by those owner tokens, as for local leftovers. Loads read ranges (``read_ranges``), ``concurrency``
of them in flight.

Overwriting a committed checkpoint at the same URL is not atomic: rank 0's writer deletes the old
commit object when the new save starts, so the old checkpoint disappears then, and with several
ranks another rank may already be replacing its objects (a reader of it then fails on checksums,
never loads wrong data). Save under new names (steps) where that matters.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from asyncckpt.core.errors import CheckpointWriteError
from asyncckpt.core.formats import commit_record
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import FileChecksum, parse_record, record_body
from asyncckpt.core.storage import leftovers
from asyncckpt.core.storage.leftovers import Leftover
from asyncckpt.core.storage.listing import Listed
from asyncckpt.core.storage.object_store import ObjectStore, ObjectStoreOptions, forget_listings, store_for

CHECKSUM_METADATA = "asyncckpt-checksum"  # user metadata of a single-file object: its checksum record
REMOVING_MARKER = ".asyncckpt-removing"  # under a prefix being removed: garbage, whoever wrote it


# ----------------------------------------------------------------------------------- saving
@dataclass
class ObjectDestination:
    """``backend.Destination`` for a URL: the checkpoint's own prefix and its commit object."""

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

    def tidy_parent(self) -> Optional[str]:
        return None  # leftovers in object stores go with ``asyncckpt clean`` (listing the bucket per save is not free)

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
        files = {e.name: e.size for e in entries if not e.is_dir and names.is_published_file(e.name)}
        try:
            self.store.put(self._url(names.COMMIT_RECORD), commit_record.encode({"files": files, **record}), exclusive=True)
        except FileExistsError:
            raise CheckpointWriteError(f"{self.directory} was committed by another save meanwhile (another job "
                                       "writing the same checkpoint?); this save is not published") from None
        self.store.delete([e.path for e in entries if names.OWNER_MARKER_PATTERN.match(e.name)])
        return None

    def delete(self, replaced: str, token: str) -> None:
        pass  # nothing is replaced: see the module docstring


# ----------------------------------------------------------------------------------- the backend
@dataclass
class ObjectBackend:
    """``backend.Backend`` for URLs, over the fsspec client of ``object_store`` (one per process and
    set of options). Holds only its options: requests that carry it pickle cheaply."""

    options: Optional[ObjectStoreOptions] = None
    remote = True

    def store(self, url: str) -> ObjectStore:
        return store_for(url, self.options)

    # ---------------------------------------------------------------- names
    def normalize(self, path: str) -> str:
        return os.fspath(path).rstrip("/")

    def join(self, base: str, *parts: str) -> str:
        return posixpath.join(base, *parts)

    def basename(self, path: str) -> str:
        return posixpath.basename(path.rstrip("/"))

    # ---------------------------------------------------------------- reading
    def read_bytes(self, path: str) -> bytes:
        return self.store(path).get(path)

    def size_of(self, path: str) -> int:
        return self.store(path).size(path)

    def exists(self, path: str) -> bool:
        return self.store(path).exists(path)

    def is_file(self, path: str) -> bool:
        try:
            self.store(path).info(path)  # a prefix is not an object
            return True
        except FileNotFoundError:
            return False

    def list_names(self, path: str) -> list[str]:
        """Objects and sub-prefixes one level down, by a delimited listing: nothing deeper is listed."""
        return [entry.name for entry in self.store(path).list(path)]

    def listing(self, path: str) -> list[Listed]:
        return self.store(path).list(path)

    marker_poll_s = 0.1  # each look is a LIST or GET request, billed

    def barrier_place(self, staging_dir: str, key: str) -> str:
        return posixpath.join(staging_dir, names.barrier_place_name(key))  # hidden prefix: never published

    def write_marker(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        with contextlib.suppress(FileExistsError):
            self.store(path).put(path, data, exclusive=exclusive)

    def delete_markers(self, paths: list[str]) -> None:
        if paths:
            self.store(paths[0]).delete(paths)

    def read_pieces(self, path: str, piece_bytes: int) -> Iterator[memoryview]:
        data = memoryview(self.read_bytes(path))  # one GET: the object is read whole anyway
        for start in range(0, len(data), piece_bytes):
            yield data[start:start + piece_bytes]

    def read_ranges(self, ranges: list[tuple[str, int, int]], consume: Callable[[int, bytes], None]) -> None:
        if ranges:
            self.store(ranges[0][0]).read_ranges(ranges, consume)

    def range_bytes(self, path: str) -> int:
        return self.store(path).options.part_bytes

    def commit_bodies_under(self, root: str) -> list[tuple[str, Optional[bytes]]]:
        """One delimited listing, then the candidates' commit objects, fetched side by side."""
        store = self.store(root)
        try:
            entries = store.list(root.rstrip("/"))
        except FileNotFoundError:
            return []
        candidates = [e.path for e in entries if e.is_dir and not e.name.startswith(".")]
        return list(zip(candidates, store.get_many([posixpath.join(url, names.COMMIT_RECORD) for url in candidates])))

    def used_bytes(self, path: str) -> int:
        """An object's size, or the objects directly under a prefix (one listing)."""
        store = self.store(path)
        try:
            return store.size(path)
        except FileNotFoundError:
            pass
        try:
            return sum(e.size for e in store.list(path))
        except FileNotFoundError:
            return 0

    @contextlib.contextmanager
    def local_copy(self, path: str, names: list[str]) -> Iterator[str]:
        """The objects ``names`` under ``path`` fetched into a temporary directory of the same name
        (local space the size of what is fetched, under ``TMPDIR``)."""
        with tempfile.TemporaryDirectory(prefix="asyncckpt-copy-") as parent:
            copy = os.path.join(parent, posixpath.basename(path))
            os.makedirs(copy)
            for name, body in zip(names, self.store(path).get_many([posixpath.join(path, name) for name in names])):
                if body is not None:
                    with open(os.path.join(copy, name), "wb") as f:
                        f.write(body)
            yield copy

    # ---------------------------------------------------------------- writing
    def destination(self, final_path: str, staging_dir: str, *, coordinator: bool, direct_io: bool = True,
                    io_threads: int = 2) -> ObjectDestination:
        return ObjectDestination(final_path, self.options, coordinator=coordinator)

    def tidy_parent(self, path: str) -> Optional[str]:
        return None  # see ``ObjectDestination.tidy_parent``

    def staging_dir_for(self, final_path: str, save_id: str) -> str:
        return final_path  # written in place: nothing to rename

    def write_file(self, path: str, image: memoryview, size: int, token: str, *,
                   checksum: Optional[Callable[[], Optional[FileChecksum]]], direct_io: bool = True,
                   io_threads: int = 2) -> None:
        """One object, with its checksum record in the object's metadata (S3 takes metadata up front:
        hashed before the upload), and a hidden marker beside it naming its writer while it uploads."""
        store = self.store(path)
        found = checksum() if checksum is not None else None
        parent, name = posixpath.split(path)
        marker = posixpath.join(parent, names.hidden_name(name, "tmp", token))
        store.put(marker, b"")
        try:
            store.upload(path, image, size, metadata={CHECKSUM_METADATA: record_body(found)} if found else None)
        finally:
            store.delete([marker])

    def read_checksum_record(self, path: str) -> Optional[FileChecksum]:
        body = self.store(path).user_metadata(path).get(CHECKSUM_METADATA)
        return parse_record(body.encode()) if body else None

    def download(self, path: str, local_path: str) -> None:
        self.store(path).download(path, local_path)

    # ---------------------------------------------------------------- removing
    def uncommit(self, path: str) -> None:
        self.store(path).delete([posixpath.join(path, names.COMMIT_RECORD)])

    def remove(self, paths: list[str], token: str, after_reply: Callable[[Callable[[], None]], None],
               hidden_parent: Optional[str] = None) -> None:
        """A prefix: first marked as being removed and its commit object deleted (gone from every
        listing at once), then everything else; a single-file object: deleted."""
        for url in paths:
            store = self.store(url)
            commit_url = posixpath.join(url, names.COMMIT_RECORD)
            if store.exists(commit_url) or not self.is_file(url):
                store.put(posixpath.join(url, REMOVING_MARKER), b"")
                store.delete([commit_url])
                store.delete_prefix(url)
            else:
                store.delete([url])

    def find_leftovers(self, root: str) -> list[Leftover]:
        """Uncommitted prefixes, single-file markers and incomplete uploads directly under ``root``."""
        store = self.store(root)
        try:
            entries = store.list(root)
        except FileNotFoundError:
            return []
        found: list[Leftover] = []
        writing: dict[str, Optional[bool]] = {}  # single-file name -> whether a writer of it lives
        for entry in entries:
            hidden = names.parse_hidden(entry.name)
            if hidden is not None and hidden.kind == "tmp":
                alive = leftovers.owner_alive(hidden.token)
                writing[hidden.name] = True if alive or writing.get(hidden.name) else alive
                found.append(Leftover(entry.path, "tmp", hidden.name, alive, entry.modified, 0))
        prefixes = [e for e in entries if e.is_dir and not e.name.startswith(".")]
        records = store.get_many([posixpath.join(e.path, names.COMMIT_RECORD) for e in prefixes])
        uploads = store.incomplete_uploads(root)
        for entry, record in zip(prefixes, records):
            if commit_record.parse(record) is None:
                found.append(_uncommitted(store, entry.path, entry.name, uploads))
        dead_prefixes = {leftover.path for leftover in found if leftover.kind == "uncommitted"}
        for upload in uploads:
            if any(upload.url.startswith(prefix + "/") for prefix in dead_prefixes):
                continue  # goes with its prefix
            name = upload.url[len(root.rstrip("/")) + 1:].split("/", 1)[0]
            alive = writing.get(name) if "/" not in upload.url[len(root.rstrip("/")) + 1:] else None
            found.append(Leftover(upload.url, "upload", name, alive, upload.initiated, 0))
        return found

    def delete_leftover(self, leftover: Leftover) -> None:
        store = self.store(leftover.path)
        if leftover.kind == "uncommitted":
            for upload in store.incomplete_uploads(leftover.path):
                store.abort_upload(upload)
            store.delete_prefix(leftover.path)
        elif leftover.kind == "upload":
            for upload in store.incomplete_uploads(posixpath.dirname(leftover.path)):
                if upload.url == leftover.path:
                    store.abort_upload(upload)
        else:
            store.delete([leftover.path])

    def forget_cached(self, path: str) -> None:
        forget_listings(path, self.options)


def _uncommitted(store: ObjectStore, url: str, name: str, uploads: list) -> Leftover:
    """An uncommitted prefix, judged by its owner markers (``leftovers.owner_alive``)."""
    entries = store.list(url)
    size = sum(e.size for e in entries)
    modified = max((e.modified for e in entries), default=0.0)
    modified = max([modified] + [u.initiated for u in uploads if u.url.startswith(url + "/")])
    if any(e.name == REMOVING_MARKER for e in entries):
        return Leftover(url, "uncommitted", name, False, modified, size)
    markers = [e.path for e in entries if names.OWNER_MARKER_PATTERN.match(e.name)]
    verdicts = [leftovers.owner_alive(body.decode(errors="replace")) if body is not None else None
                for body in store.get_many(markers)]
    if any(v is True for v in verdicts):
        alive: Optional[bool] = True
    elif verdicts and all(v is False for v in verdicts):
        alive = False
    else:
        alive = None
    return Leftover(url, "uncommitted", name, alive, modified, size)
