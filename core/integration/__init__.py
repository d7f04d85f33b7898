"""The adapter kit: what adapters use of the core beyond the public API (``asyncckpt.core.__all__``).

More: docs/MODULES.md, core/integration/__init__.py.
"""
from asyncckpt.core.api import lifecycle
from asyncckpt.core.api.options import resolve as resolve_options, taking_options
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.formats.checksum import checksum
from asyncckpt.core.integration import capture, patching, resume, saving, versions
from asyncckpt.core.integration.dcp_capture import capturing_dcp_saves
from asyncckpt.core.integration.metrics import Records, SaveMetrics
from asyncckpt.core.snapshot import collectives, dist_env
from asyncckpt.core.snapshot.file_snapshots import tensor_bytes
from asyncckpt.core.storage.backend import is_url, normalize as normalize_path
from asyncckpt.core.storage.orphans import wait_for_orphans

__all__ = [
    "Records", "SaveHandle", "SaveMetrics", "capture", "capturing_dcp_saves", "checksum", "collectives", "dist_env",
    "is_url",
    "lifecycle", "normalize_path", "patching", "resolve_options", "resume", "saving", "taking_options", "tensor_bytes",
    "versions", "wait_for_orphans",
]
