"""Per-item checksums: xxh3-64 (~10x faster than CRC32 here, so verification is cheap).

The xxhash package's Python functions hold the GIL while they hash. A load hashes every item
right after reading it, on two threads, and the writer hashes a rank's image beside its writes:
with the GIL held, the hashing of one thread stalls the other's Python work, and the 2 cores never
hash in parallel. So items of ``LARGE_BYTES`` or more are hashed through the C API that the
package's extension module exports (libxxhash's own symbols), called with ctypes, which releases
the GIL for the duration of a foreign call; the runtime-dispatched variants use AVX2/AVX-512 where
the CPU has them. Small items keep the Python functions (~0.1 us a call against ~1.5 us through
ctypes). The values are the same either way; if the extension ever stops exporting the symbols,
everything falls back to the Python functions.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Optional

import numpy as np
import xxhash
import xxhash._xxhash

LARGE_BYTES = 128 << 10  # from here on, the ctypes call's overhead is under 5% of the hashing


def _c_api() -> Optional[ctypes.CDLL]:
    """xxhash's C functions (GIL released while they run), or None if the extension lacks them."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        one_shot, update = lib.XXH3_64bits_dispatch, lib.XXH3_64bits_update_dispatch
        create, reset, digest, free = lib.XXH3_createState, lib.XXH3_64bits_reset, lib.XXH3_64bits_digest, lib.XXH3_freeState
    except (OSError, AttributeError):
        return None
    one_shot.restype, one_shot.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    update.restype, update.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    create.restype, create.argtypes = ctypes.c_void_p, []
    reset.restype, reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
    digest.restype, digest.argtypes = ctypes.c_uint64, [ctypes.c_void_p]
    free.restype, free.argtypes = ctypes.c_int, [ctypes.c_void_p]
    return lib


_C = _c_api()


def _address(data) -> tuple[int, int, np.ndarray]:
    """Start address and length of a contiguous bytes-like object, and the array that keeps it alive."""
    array = np.frombuffer(data, dtype=np.uint8)
    return array.ctypes.data, array.nbytes, array


def checksum(data) -> str:
    """Hex xxh3-64 of a contiguous bytes-like object (no copy), without the GIL for large ones."""
    if _C is None or (data.nbytes if hasattr(data, "nbytes") else len(data)) < LARGE_BYTES:
        return xxhash.xxh3_64_hexdigest(data)
    address, nbytes, _keep = _address(data)
    return f"{_C.XXH3_64bits_dispatch(address, nbytes):016x}"


class _GilFreeStream:
    """An incremental xxh3-64 on libxxhash's state (GIL released during each ``update``)."""

    def __init__(self) -> None:
        state = _C.XXH3_createState()
        if not state:
            raise MemoryError("XXH3_createState failed")
        self._state = state
        weakref.finalize(self, _C.XXH3_freeState, state)
        _C.XXH3_64bits_reset(state)

    def update(self, data) -> None:
        address, nbytes, _keep = _address(data)
        _C.XXH3_64bits_update_dispatch(self._state, address, nbytes)

    def hexdigest(self) -> str:
        return f"{_C.XXH3_64bits_digest(self._state):016x}"


def checksum_stream():
    """An incremental xxh3-64 (``update(piece)`` …, then ``hexdigest()``): the same value as
    ``checksum`` of all the pieces joined, for items hashed piece by piece as they are read."""
    return xxhash.xxh3_64() if _C is None else _GilFreeStream()
