"""The object-store backend: S3 (and, through the same fsspec calls, GCS or Azure Blob) behind a few operations.

Everything goes through fsspec (``s3fs`` for ``s3://``): credentials, endpoint and client settings
come from fsspec's usual ``storage_options`` and the environment (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, fsspec's ``FSSPEC_S3_*``), or from ``ObjectStoreOptions`` given to a
``Checkpointer`` (which hands them to its background writer with every request).

More: docs/MODULES.md, core/storage/object_store.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from asyncckpt.core.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.core.storage.fsio import fsync_file
from asyncckpt.core.storage.listing import IncompleteUpload, Listed

DEFAULT_PART_BYTES = 32 << 20
DEFAULT_CONCURRENCY = 8
MIN_PART_BYTES = 5 << 20  # S3's minimum for every part but the last
MAX_COPY_BYTES = 5 << 30  # S3's maximum for a part copied by the server
_MAX_PARTS = 10_000


def compose_parts(size: int, copied: list[tuple[int, int]], part_bytes: int) -> list[tuple[int, int, bool]]:
    """The parts of a multipart upload of ``size`` bytes whose ranges ``copied`` (ascending, disjoint) the server
    copies: ``(start, end, copy)`` covering ``[0, size)`` in order. S3 wants every part but the last of at least
    ``MIN_PART_BYTES``: a copied range shorter than that is uploaded instead, and an uploaded run shorter than that
    takes the head of the copied range after it; uploaded runs go in parts of about ``part_bytes``, copied ones in
    parts of at most ``MAX_COPY_BYTES``."""
    segments: list[list] = []  # [start, end, copy], covering [0, size)
    cursor = 0
    for start, end in copied:
        if end - start < MIN_PART_BYTES or start < cursor:
            continue
        if start > cursor:
            segments.append([cursor, start, False])
        segments.append([start, end, True])
        cursor = end
    if cursor < size:
        segments.append([cursor, size, False])
    merged: list[list] = []
    for index, segment in enumerate(segments):
        if merged and not merged[-1][2] and not segment[2]:
            merged[-1][1] = segment[1]
            continue
        if merged and not merged[-1][2] and merged[-1][1] - merged[-1][0] < MIN_PART_BYTES:  # too short: take more
            grown = merged[-1][0] + MIN_PART_BYTES
            if segment[1] - grown < MIN_PART_BYTES:
                merged[-1][1] = segment[1]  # what would be left of this copied range is too short: uploaded too
                continue
            merged[-1][1], segment[0] = grown, grown
        merged.append(segment)
    parts: list[tuple[int, int, bool]] = []
    for start, end, copy in merged:  # each piece at least part_bytes (uploaded), under the maximum (copied)
        count = -(-(end - start) // (MAX_COPY_BYTES - MIN_PART_BYTES)) if copy else max(1, (end - start) // part_bytes)
        bounds = [start + i * ((end - start) // count) for i in range(count)] + [end]
        parts += [(bounds[i], bounds[i + 1], copy) for i in range(count)]
    return parts


class ObjectStoreError(CheckpointError):
    """An object-store operation failed; the message names the URL, the bucket and the endpoint."""


@dataclass
class ObjectStoreOptions:
    """How to reach an object store and how to use it. Each field, its default and meaning: docs/options.md.

    Args:
        storage_options: passed to ``fsspec.core.url_to_fs`` (None: fsspec's defaults and the environment).
        part_bytes: multipart part size for uploads (>= 5 MiB), and the size of ranged reads of large items.
        concurrency: parts (uploads) or ranges (loads) in flight at once, per process.
    """

    storage_options: Optional[dict] = None
    part_bytes: int = DEFAULT_PART_BYTES
    concurrency: int = DEFAULT_CONCURRENCY

    def __post_init__(self) -> None:
        if self.part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be at least {MIN_PART_BYTES} (S3's minimum part size)")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")

    def cache_key(self) -> str:
        return json.dumps([self.storage_options or {}, self.part_bytes, self.concurrency], sort_keys=True, default=repr)


_configured: dict[str, ObjectStoreOptions] = {}
_in_use: ContextVar[Optional[ObjectStoreOptions]] = ContextVar("asyncckpt_object_store", default=None)
_stores: dict[tuple[str, str], "ObjectStore"] = {}
_lock = threading.Lock()


def configure(options: Optional[ObjectStoreOptions], prefix: str = "") -> None:
    """Use ``options`` in this process for URLs starting with ``prefix`` (all URLs by default): for
    code that reads checkpoints without a ``Checkpointer`` at hand (``latest_checkpoint``, the CLI).
    The longest matching prefix wins; None forgets the entry."""
    with _lock:
        if options is None:
            _configured.pop(prefix, None)
        else:
            _configured[prefix] = options


@contextlib.contextmanager
def using(options: Optional[ObjectStoreOptions]):
    """Within the block (this thread or task), URLs are reached with ``options`` (a Checkpointer's,
    for its loads and checks); None changes nothing."""
    token = _in_use.set(options) if options is not None else None
    try:
        yield
    finally:
        if token is not None:
            _in_use.reset(token)


def options_for(url: str) -> ObjectStoreOptions:
    """The options in ``using``, else those ``configure``d for the longest matching prefix, else the defaults."""
    current = _in_use.get()
    if current is not None:
        return current
    with _lock:
        matches = [prefix for prefix in _configured if url.startswith(prefix)]
        return _configured[max(matches, key=len)] if matches else ObjectStoreOptions()


def store_for(url: str, options: Optional[ObjectStoreOptions] = None) -> "ObjectStore":
    """The store serving ``url`` with ``options`` (default: ``options_for(url)``), one per process
    and set of options."""
    options = options or options_for(url)
    key = (_scheme(url), options.cache_key())
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = ObjectStore(url, options)
        return store


def _scheme(url: str) -> str:
    from fsspec.core import split_protocol

    return split_protocol(url)[0]


def forget_listings(url: str, options: Optional[ObjectStoreOptions] = None) -> None:
    """This process's fsspec caches of ``url`` and its parents are out of date (the background
    writer, another process, changed it). fsspec keeps one filesystem instance per set of options,
    so this also refreshes what the framework sees through fsspec (Lightning's ``ModelCheckpoint``
    lists its directory to find ``last.ckpt``)."""
    store = store_for(url, options)
    store.fs.invalidate_cache(store.path(url))


@dataclass
class _Window:
    """A bounded number of coroutines in flight; the first failure stops the others."""

    limit: int
    tasks: set = field(default_factory=set)

    async def add(self, coroutine: Awaitable) -> None:
        while len(self.tasks) >= self.limit:
            done, self.tasks = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
            self._check(done)
        self.tasks.add(asyncio.ensure_future(coroutine))

    async def drain(self) -> None:
        while self.tasks:
            done, self.tasks = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
            self._check(done)

    def _check(self, done: set) -> None:
        for task in done:
            if task.exception() is not None:
                for other in self.tasks:
                    other.cancel()
                raise task.exception()


class ObjectStore:
    """One fsspec filesystem and the options it is used with (see the module docstring)."""

    def __init__(self, url: str, options: ObjectStoreOptions) -> None:
        import fsspec

        self.options = options
        self.protocol = _scheme(url)
        try:
            self.fs, _ = fsspec.core.url_to_fs(url, **(options.storage_options or {}))
        except ImportError as e:
            raise ObjectStoreError(f"{url}: the fsspec filesystem for '{self.protocol}://' is not installed ({e}); "
                                   "for s3:// pip install s3fs (asyncckpt's s3 extra)") from e
        self.is_s3 = self.protocol in ("s3", "s3a")
        if not getattr(self.fs, "async_impl", False):
            raise ObjectStoreError(f"{url}: fsspec's '{self.protocol}' filesystem is not asynchronous; asyncckpt "
                                   "needs an async one (s3fs, gcsfs, adlfs)")

    # ------------------------------------------------------------------ naming
    def path(self, url: str) -> str:
        """The filesystem's own path of ``url`` (``bucket/key``)."""
        import fsspec.core

        return fsspec.core.strip_protocol(url).rstrip("/")

    def url(self, path: str) -> str:
        return f"{self.protocol}://{path}"

    def bucket_and_key(self, url: str) -> tuple[str, str]:
        bucket, _, key = self.path(url).partition("/")
        return bucket, key

    def endpoint(self) -> str:
        """The endpoint as configured (storage_options, then the environment): for messages."""
        found = (getattr(self.fs, "client_kwargs", None) or {}).get("endpoint_url")
        found = found or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return found or f"the default endpoint of {self.protocol}://"

    _READS = ("read", "look up", "list", "list uploads in")

    def _error(self, what: str, url: str, error: BaseException) -> BaseException:
        """``error`` as raised to our callers: absent objects (on reads) and existing ones (on
        create-only puts) as they are; everything else an ``ObjectStoreError`` naming the place."""
        if isinstance(error, (FileExistsError, CheckpointError)) or (isinstance(error, FileNotFoundError) and what in self._READS):
            return error
        bucket, _ = self.bucket_and_key(url)
        kind = type(error).__name__
        text = str(error) or kind
        if isinstance(error, FileNotFoundError):
            text = f"the bucket does not exist ({text})"
        elif kind in ("NoCredentialsError", "PartialCredentialsError"):
            text = (f"no credentials ({text}): give them in storage_options (key/secret) or the environment "
                    "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
        elif isinstance(error, PermissionError):
            text = f"access denied ({text}): check the credentials and the bucket's permissions"
        elif kind in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                      "ServerDisconnectedError", "ReadTimeoutError", "ConnectionRefusedError") or isinstance(error, ConnectionError):
            text = f"cannot reach the endpoint ({kind}: {text})"
        return ObjectStoreError(f"{what} {url} failed: {text} (bucket '{bucket}', endpoint {self.endpoint()})")

    def _run(self, what: str, url: str, coroutine: Callable[[], Awaitable]) -> Any:
        from fsspec.asyn import sync

        try:
            return sync(self.fs.loop, coroutine)
        except BaseException as e:
            raise self._error(what, url, e) from e

    # ------------------------------------------------------------------ writing
    def upload(self, url: str, image: memoryview, size: int, *, metadata: Optional[dict[str, str]] = None,
               wait_ready: Optional[Callable[[float], float]] = None) -> None:
        """Write ``image[:size]`` as the object ``url`` (see the module docstring). With ``wait_ready``
        the image is still being copied: each part goes as soon as the copy has passed its end."""
        wait = wait_ready or (lambda _done: float("inf"))
        part = max(self.options.part_bytes, -(-size // _MAX_PARTS))
        if not self.is_s3 or size <= part:  # one request: a plain PUT (or the filesystem's own upload)
            ready = 0.0
            while ready < size:
                ready = wait(ready)
            self.put(url, bytes(image[:size]), metadata=metadata)
            return
        self._run("upload to", url, lambda: self._multipart(url, image, size, part, metadata or {}, wait))

    async def _multipart(self, url: str, image: memoryview, size: int, part: int, metadata: dict,
                         wait: Callable[[float], float]) -> None:
        bucket, key = self.bucket_and_key(url)
        upload = await self.fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key, Metadata=metadata)
        upload_id = upload["UploadId"]
        etags: dict[int, str] = {}
        loop = asyncio.get_running_loop()

        async def send(number: int, start: int) -> None:
            body = bytes(image[start:min(start + part, size)])
            reply = await self.fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                           PartNumber=number, Body=body)
            etags[number] = reply["ETag"]

        try:
            window = _Window(self.options.concurrency)
            ready = 0.0
            for number, start in enumerate(range(0, size, part), 1):
                end = min(start + part, size)
                while ready < end:  # the copy has not got this far yet (streamed saves)
                    ready = await loop.run_in_executor(None, wait, ready)
                await window.add(send(number, start))
            await window.drain()
            await self.fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                                   MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]})
        except BaseException:
            try:
                await self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - the endpoint may be what failed: clean takes it later
                pass
            raise
        finally:
            self.fs.invalidate_cache(self.path(url))

    def compose(self, url: str, image: memoryview, size: int, copied: list[tuple[int, int]], source: str) -> int:
        """Write ``image[:size]`` as the object ``url``, the ranges ``copied`` (ascending, disjoint) not from
        ``image`` but copied by the server from the same ranges of the object ``source`` (S3 UploadPartCopy: none of
        their bytes pass through this client), the rest uploaded. Returns the bytes uploaded (``compose_parts``)."""
        parts = compose_parts(size, copied, self.options.part_bytes)
        bucket, key = self.bucket_and_key(url)
        source_bucket, source_key = self.bucket_and_key(source)

        async def run() -> None:
            upload_id = (await self.fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
            etags: dict[int, str] = {}

            async def send(number: int, start: int, end: int, copy: bool) -> None:
                if copy:
                    reply = await self.fs._call_s3("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload_id,
                                                   PartNumber=number, CopySourceRange=f"bytes={start}-{end - 1}",
                                                   CopySource={"Bucket": source_bucket, "Key": source_key})
                    etags[number] = reply["CopyPartResult"]["ETag"]
                else:
                    reply = await self.fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                                   PartNumber=number, Body=bytes(image[start:end]))
                    etags[number] = reply["ETag"]

            try:
                window = _Window(self.options.concurrency)
                for number, (start, end, copy) in enumerate(parts, 1):
                    await window.add(send(number, start, end, copy))
                await window.drain()
                await self.fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                                       MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]})
            except BaseException:
                with contextlib.suppress(Exception):  # the endpoint may be what failed: clean takes it later
                    await self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
                raise
            finally:
                self.fs.invalidate_cache(self.path(url))

        self._run("upload to", url, run)
        return sum(end - start for start, end, copy in parts if not copy)

    def copy(self, source: str, url: str) -> bool:
        """The object ``source`` copied as ``url`` by the server (S3 CopyObject, up to 5 GiB); False where it is not
        there or too large."""
        bucket, key = self.bucket_and_key(url)
        source_bucket, source_key = self.bucket_and_key(source)
        try:
            self._run("copy to", url, lambda: self.fs._call_s3("copy_object", Bucket=bucket, Key=key,
                                                                CopySource={"Bucket": source_bucket, "Key": source_key}))
        except ObjectStoreError:
            return False
        finally:
            self.fs.invalidate_cache(self.path(url))
        return True

    def put(self, url: str, data: bytes, *, exclusive: bool = False, metadata: Optional[dict[str, str]] = None) -> None:
        """Write a small object in one request; ``exclusive``: only if it does not exist yet
        (FileExistsError otherwise)."""
        extra: dict[str, Any] = {"mode": "create"} if exclusive else {}
        if metadata and self.is_s3:
            extra["Metadata"] = metadata
        self._run("write", url, lambda: self.fs._pipe_file(self.path(url), data, **extra))

    # ------------------------------------------------------------------ reading
    def get(self, url: str) -> bytes:
        return self._run("read", url, lambda: self.fs._cat_file(self.path(url)))

    def read_ranges(self, ranges: list[tuple[str, int, Optional[int]]],
                    consume: Callable[[int, Optional[bytes]], None]) -> None:
        """Fetch every ``(url, start, end)`` (``end`` None: the whole object), ``concurrency`` at a
        time, and hand each to ``consume(index, data)`` as it arrives (on the event loop's thread),
        ``data`` None where the object is absent."""
        async def fetch(index: int) -> None:
            url, start, end = ranges[index]
            try:
                if end is None:
                    data = await self.fs._cat_file(self.path(url))
                else:
                    data = await self.fs._cat_file(self.path(url), start=start, end=end)
            except FileNotFoundError:
                consume(index, None)
                return
            if end is not None and len(data) != end - start:
                raise CorruptCheckpointError(f"{url}: object is truncated (wanted bytes {start}..{end}, got {len(data)})")
            consume(index, data)

        if ranges:
            self._run("read", ranges[0][0], lambda: self._each(fetch, len(ranges)))

    async def _each(self, fetch: Callable[[int], Awaitable], count: int) -> None:
        """``fetch(0) .. fetch(count - 1)``, ``concurrency`` in flight; the first failure stops the rest."""
        window = _Window(self.options.concurrency)
        for index in range(count):
            await window.add(fetch(index))
        await window.drain()

    def download(self, url: str, local_path: str) -> None:
        """Copy the object ``url`` into the local file ``local_path``, durably (fsynced)."""
        self._run("read", url, lambda: self.fs._get_file(self.path(url), local_path))
        fsync_file(local_path)

    def stat(self, url: str) -> Listed:
        """What ``url`` is: an object (its size and time) or a prefix; FileNotFoundError if neither."""
        path = self.path(url)
        self.fs.invalidate_cache(path)  # another process (a writer) may have changed it
        found = self._run("look up", url, lambda: self.fs._info(path))
        return self._listed(found)

    def user_metadata(self, url: str) -> dict[str, str]:
        if not self.is_s3:
            return {}
        bucket, key = self.bucket_and_key(url)
        reply = self._run("look up", url, lambda: self.fs._call_s3("head_object", Bucket=bucket, Key=key))
        return reply.get("Metadata", {})

    def list(self, url: str) -> list[Listed]:
        """Objects and sub-prefixes directly under ``url`` (one delimited listing); FileNotFoundError
        when there is nothing under it."""
        path = self.path(url)
        self.fs.invalidate_cache(path)
        return [self._listed(item) for item in self._run("list", url, lambda: self.fs._ls(path, detail=True))]

    def _listed(self, item: dict) -> Listed:
        """What fsspec's ``info`` or ``ls`` says of one name, as ``Listed``."""
        path = item["name"].rstrip("/")
        modified = item.get("LastModified") or item.get("mtime")
        return Listed(path.rsplit("/", 1)[-1], self.url(path), item.get("type") == "directory", int(item.get("size") or 0),
                      modified.timestamp() if hasattr(modified, "timestamp") else 0.0)

    # ------------------------------------------------------------------ deleting
    def delete(self, urls: list[str]) -> None:
        """Delete these objects (absent ones are fine)."""
        if urls:
            paths = [self.path(u) for u in urls]
            self._run("delete", urls[0], lambda: self.fs._rm(paths))
            for path in paths:
                self.fs.invalidate_cache(path)

    def delete_prefix(self, url: str) -> None:
        """Delete every object under ``url``/ (nothing there is fine)."""
        path = self.path(url)

        async def remove() -> None:
            try:
                await self.fs._rm(path, recursive=True)
            except FileNotFoundError:
                pass

        self._run("delete", url, remove)
        self.fs.invalidate_cache(path)

    def incomplete_uploads(self, url: str, *, and_itself: bool = False) -> list[IncompleteUpload]:
        """Multipart uploads begun and neither completed nor aborted, for keys under ``url``/ (and,
        ``and_itself``, for ``url`` itself: one request either way)."""
        if not self.is_s3:
            return []
        bucket, key = self.bucket_and_key(url)
        prefix = key if and_itself else f"{key}/" if key else ""
        reply = self._run("list uploads in", url,
                          lambda: self.fs._call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix))
        found = [IncompleteUpload(self.url(f"{bucket}/{u['Key']}"), u["UploadId"], u["Initiated"].timestamp())
                 for u in reply.get("Uploads", [])]
        return [u for u in found if not and_itself or u.url == url or u.url.startswith(url + "/")]

    def abort_upload(self, upload: IncompleteUpload) -> None:
        bucket, key = self.bucket_and_key(upload.url)
        self._run("abort the upload of", upload.url,
                  lambda: self.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id))
