"""Per-item ``torch.save`` containers, produced without calling ``torch.save`` per tensor.

Torch's DCP reader ``torch.load``s every tensor item from its own small zip container. That
container is fully determined by the tensor's dtype and shape: apart from the storage bytes it
is identical from one save to the next. So we render it once per (dtype, shape) with
``torch.serialization.skip_data`` (which leaves the data bytes out) and with CRC32 computation
off (torch's reader does not check record CRCs; our own checksums live in the sidecar), keep
the bytes before and after the data record, and at save time only the tensor bytes are copied.
"""
from __future__ import annotations

import functools
import io
import struct
import threading
import zipfile
from dataclasses import dataclass

import torch
from torch.utils.serialization import config as _serialization_config

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
LOCAL_HEADER_SIGNATURE = 0x04034B50
_template_lock = threading.Lock()


@dataclass(frozen=True)
class ContainerTemplate:
    """The bytes of a torch.save container around its single data record."""

    prefix: bytes
    suffix: bytes
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)

    @property
    def data_offset(self) -> int:
        return len(self.prefix)


def _data_record_offset(container: bytes) -> tuple[int, int]:
    """Offset and size of the single tensor data record inside a torch.save zip."""
    with zipfile.ZipFile(io.BytesIO(container)) as archive:
        (info,) = [i for i in archive.infolist() if i.filename.split("/", 1)[-1] == "data/0"]
    header = LOCAL_HEADER.unpack_from(container, info.header_offset)
    if header[0] != LOCAL_HEADER_SIGNATURE:
        raise AssertionError("unexpected zip layout in torch.save output")
    name_len, extra_len = header[9], header[10]
    return info.header_offset + LOCAL_HEADER.size + name_len + extra_len, info.file_size


@functools.lru_cache(maxsize=1 << 16)
def container_template(dtype: torch.dtype, shape: tuple[int, ...]) -> ContainerTemplate:
    """The torch.save container for a contiguous CPU tensor of ``dtype`` and ``shape``."""
    placeholder = torch.empty(shape, dtype=dtype)
    buffer = io.BytesIO()
    with _template_lock:
        previous = _serialization_config.save.compute_crc32
        _serialization_config.save.compute_crc32 = False
        try:
            with torch.serialization.skip_data():
                torch.save(placeholder, buffer)
        finally:
            _serialization_config.save.compute_crc32 = previous
    rendered = buffer.getvalue()
    offset, size = _data_record_offset(rendered)
    nbytes = placeholder.numel() * placeholder.element_size()
    if size != nbytes:
        raise AssertionError(f"torch.save data record is {size} bytes, expected {nbytes}")
    return ContainerTemplate(rendered[:offset], rendered[offset + size :], nbytes)
