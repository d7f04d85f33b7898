"""Checking a checkpoint in an object store against its checksums (``integrity`` for URLs).

A single-file object is read and hashed against the checksum in its metadata. A checkpoint prefix
is copied (the objects its commit record lists, and the sidecars) into a temporary directory and
that copy is checked by ``integrity``, exactly as a local checkpoint is: every byte has to be read
anyway, and a copy under the same names is the same checkpoint. The copy needs local space the
size of the checkpoint (``TMPDIR``); problems are reported with the URL, not the copy's path.
"""
from __future__ import annotations

import os
import posixpath
import tempfile
from typing import Callable

from asyncckpt.core.storage import file_checksums
from asyncckpt.core.verify import integrity
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import checksum
from asyncckpt.core.storage.commit import read_commit_record
from asyncckpt.core.storage.object_store import store_for


def check(url: str, *, on_problem: Callable[[str], None] = lambda message: None) -> integrity.Report:
    """What is wrong with the checkpoint at ``url``; FileNotFoundError if there is none."""
    store = store_for(url)
    try:
        store.info(url)  # an object: a single file (a prefix is not one)
    except FileNotFoundError:
        pass
    else:
        return _check_file(url, on_problem)
    record = read_commit_record(url)
    if record is None:
        if not store.exists(url):
            raise FileNotFoundError(f"{url}: nothing there")
        return integrity.Report(url, "sharded", "INCOMPLETE")
    wanted = sorted(set(record.get("files", {})) | {names.COMMIT_RECORD} | {
        names.sidecar_name(rank) for rank in range(record.get("world_size") or 0)})
    with tempfile.TemporaryDirectory(prefix="asyncckpt-verify-") as parent:
        copy = os.path.join(parent, posixpath.basename(url))
        os.makedirs(copy)
        for name, body in zip(wanted, store.get_many([posixpath.join(url, name) for name in wanted])):
            if body is not None:
                with open(os.path.join(copy, name), "wb") as f:
                    f.write(body)
        report = integrity.check(copy, on_problem=lambda message: on_problem(message.replace(copy, url)))
    report.path = url
    report.problems = [message.replace(copy, url) for message in report.problems]
    return report


def _check_file(url: str, on_problem: Callable[[str], None]) -> integrity.Report:
    report = integrity.Report(url, "file", "COMPLETE")
    expected = file_checksums.read_record(url)
    if expected is None:
        report.unverified.append(posixpath.basename(url))
        return report
    data = store_for(url).get(url)
    found = checksum(data) if len(data) == expected.size else None
    if found != expected.xxh3:
        problem = (f"{posixpath.basename(url)}: {len(data)} B, {expected.size} B when written" if found is None else
                   f"{posixpath.basename(url)}: checksum mismatch: expected xxh3 {expected.xxh3}, found {found}")
        report.problems.append(problem)
        on_problem(problem)
    report.checked_files, report.checked_bytes = 1, expected.size
    return report
