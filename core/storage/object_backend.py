"""An object store's storage primitives (``backend.Backend``): checkpoints written under their own
prefix, visible once a commit object exists.

More: docs/MODULES.md, core/storage/object_backend.py.
"""
from __future__ import annotations

import contextlib
import posixpath
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import FileChecksum, parse_record, record_body
from asyncckpt.core.storage.listing import IncompleteUpload, Listed
from asyncckpt.core.storage.object_store import ObjectStore, ObjectStoreOptions, store_for

CHECKSUM_METADATA = "asyncckpt-checksum"  # user metadata of a single-file object: its checksum record


@dataclass
class ObjectBackend:
    """``backend.Backend`` for URLs, over the fsspec client of ``object_store`` (one per process and
    set of options). Holds only its options: requests that carry it pickle cheaply."""

    options: Optional[ObjectStoreOptions] = None
    remote = True
    marker_poll_s = 0.1  # each look is a LIST or GET request, billed

    def store(self, url: str) -> ObjectStore:
        return store_for(url, self.options)

    # ---------------------------------------------------------------- what is there
    def stat(self, path: str) -> Listed:
        return self.store(path).stat(path)

    def names(self, path: str) -> list[str]:
        """Objects and sub-prefixes one level down, by a delimited listing: nothing deeper is listed."""
        return [entry.name for entry in self.store(path).list(path)]

    def listing(self, path: str) -> list[Listed]:
        return self.store(path).list(path)

    # ---------------------------------------------------------------- reading
    def read_ranges(self, ranges: list[tuple[str, int, Optional[int]]],
                    consume: Callable[[int, Optional[bytes]], None]) -> None:
        if ranges:
            self.store(ranges[0][0]).read_ranges(ranges, consume)

    def read_pieces(self, path: str, piece_bytes: int) -> Iterator[memoryview]:
        data = memoryview(self.store(path).get(path))  # one GET: the object is read whole anyway
        for start in range(0, len(data), piece_bytes):
            yield data[start:start + piece_bytes]

    def download(self, path: str, local_path: str) -> None:
        self.store(path).download(path, local_path)

    def read_checksum_record(self, path: str) -> Optional[FileChecksum]:
        body = self.store(path).user_metadata(path).get(CHECKSUM_METADATA)
        return parse_record(body.encode()) if body else None

    # ---------------------------------------------------------------- writing
    def write(self, path: str, data: Union[bytes, memoryview], size: Optional[int] = None, *, atomic: bool = False,
              wait_ready: Optional[Callable[[float], float]] = None, direct_io: bool = True, io_threads: int = 2) -> None:
        """An object appears whole or not at all, ``atomic`` or not; a snapshot buffer's image goes
        as a multipart upload (``object_store``)."""
        if isinstance(data, memoryview):
            self.store(path).upload(path, data, len(data) if size is None else size, wait_ready=wait_ready)
        else:
            self.store(path).put(path, data)

    def compose(self, path: str, image: memoryview, size: int, copied: list[tuple[int, int]], source: str) -> int:
        """``write`` of a snapshot buffer's image whose ranges ``copied`` the store copies from the same ranges of the
        object ``source`` rather than receive them (``ObjectStore.compose``; a store without server-side copies:
        all of it uploaded). Returns the bytes uploaded."""
        store = self.store(path)
        if not store.is_s3:
            self.write(path, image, size)
            return size
        return store.compose(path, image, size, copied, source)

    def write_marker(self, path: str, data: bytes, *, exclusive: bool = False, append: bool = False) -> None:
        """``append``: an object is written whole; each such marker has one writer here (a rank's)."""
        with contextlib.suppress(FileExistsError):
            self.store(path).put(path, data, exclusive=exclusive)

    def write_file(self, path: str, image: memoryview, size: int, token: str, *,
                   checksum: Optional[Callable[[], Optional[FileChecksum]]], direct_io: bool = True,
                   io_threads: int = 2, wait_ready: Optional[Callable[[float], float]] = None) -> None:
        """One object, with its checksum record in the object's metadata (S3 takes metadata up front:
        hashed before the upload), and a hidden marker beside it naming its writer while it uploads."""
        ready = 0.0 if wait_ready is not None else float("inf")
        while ready < float("inf"):  # an object's metadata goes first: it is sent once all of it is ready
            ready = wait_ready(ready)
        store = self.store(path)
        found = checksum() if checksum is not None else None
        parent, name = posixpath.split(path)
        marker = posixpath.join(parent, names.hidden_name(name, "tmp", token))
        store.put(marker, b"")
        try:
            store.upload(path, image, size, metadata={CHECKSUM_METADATA: record_body(found)} if found else None)
        finally:
            store.delete([marker])

    def share_file(self, source: str, path: str) -> bool:
        store = self.store(path)
        return store.is_s3 and store.copy(source, path)

    def publish(self, staging_dir: str, final_path: str, record: bytes) -> Optional[str]:
        """The commit object, created once (the checkpoint was written under its final name)."""
        self.store(final_path).put(posixpath.join(final_path, names.COMMIT_RECORD), record, exclusive=True)
        return None  # nothing is replaced: see the module docstring

    # ---------------------------------------------------------------- removing
    def delete(self, paths: list[str], *, durable: bool = True) -> None:
        if paths:
            self.store(paths[0]).delete(paths)

    def remove_tree(self, path: str, token: str, *, later: Callable[[Callable[[], None]], None],
                    hidden_parent: Optional[str] = None) -> None:
        """First marked as being removed and its commit object deleted (gone from every listing at
        once), then everything else, at once: its objects keep the checkpoint's name, which the next
        save (queued behind) may take."""
        store = self.store(path)
        store.put(posixpath.join(path, names.REMOVING_MARKER), b"")
        store.delete([posixpath.join(path, names.COMMIT_RECORD)])
        store.delete_prefix(path)

    def uploads(self, path: str) -> list[IncompleteUpload]:
        return self.store(path).incomplete_uploads(path)

    def abort_uploads(self, path: str) -> None:
        store = self.store(path)
        for upload in store.incomplete_uploads(path, and_itself=True):
            store.abort_upload(upload)
