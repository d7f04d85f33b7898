"""What adapters may use of the core, beyond the public API (``asyncckpt.core.__all__``).

An adapter translates a framework's save and load calls into a ``Checkpointer``'s; to do that it
replaces framework functions (``patching``, reversible and contract-checked against the releases
``versions`` names), drains and waits for saves in flight (``lifecycle``), asks torch.distributed
what the core asks (``dist_env``), captures the framework's own ``dcp.save`` calls
(``capturing_dcp_saves``), hands native files' bytes over (``tensor_bytes``), checksums small
records (``checksum``), waits for the writer of a previous run still finishing a checkpoint
(``wait_for_orphans``), and resumes through one helper (``resume``: candidates, newest intact, a
check that reads each file once), and reads an ``export=`` option (``export_options``). Everything else under ``asyncckpt.core`` is private: its sub-packages
(``api``, ``snapshot``, ``client``, ``writer``, ``export``, ``storage``, ``formats``, ``loading``, ``verify``, ``cli``) may
change in any release; a test keeps adapters to this module and the public API.
"""
from asyncckpt.core.api import lifecycle
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.formats.checksum import checksum
from asyncckpt.core.integration import patching, resume, versions
from asyncckpt.core.integration.dcp_capture import capturing_dcp_saves
from asyncckpt.core.snapshot import dist_env
from asyncckpt.core.snapshot.file_snapshots import tensor_bytes
from asyncckpt.core.storage.orphans import wait_for_orphans
from asyncckpt.core.export.options import as_options as export_options

__all__ = [
    "SaveHandle", "capturing_dcp_saves", "checksum", "dist_env", "lifecycle", "patching", "resume", "tensor_bytes",
    "versions", "wait_for_orphans", "export_options",
]
