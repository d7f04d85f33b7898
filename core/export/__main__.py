"""``python -m asyncckpt.core.export CHECKPOINT TARGET EXPORT_OF OPTIONS_JSON``: the local part of an
export (``writing.export_local``), read with torch.

The background writer never imports torch (what that would cost it, for the rest of its life:
docs/DESIGN.md, "The writer never loads torch"). An export of a checkpoint only torch reads (a ``torch.save`` file such as Lightning's
``.ckpt``, a stock DCP directory) or of a PEFT adapter merged into its base model runs here instead, in
a process that exits when it is done; the writer waits for it. On failure, the last line on stderr says
what failed (``TypeName: message``) and the exit status is 1.
"""
from __future__ import annotations

import json
import sys

from asyncckpt.core.export import torch_sources
from asyncckpt.core.export.options import as_options
from asyncckpt.core.export.writing import export_local
from asyncckpt.core.storage import owners


def main(argv: list[str]) -> int:
    checkpoint, target, export_of, options = argv[0], argv[1], argv[2], as_options(json.loads(argv[3]))
    try:
        export_local(checkpoint, target, options, read=torch_sources.read, token=owners.owner_token(),
                     progress=None, export_of=export_of)
    except Exception as e:  # noqa: BLE001 - reported to the writer, which raises it
        print(f"{type(e).__name__}: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
