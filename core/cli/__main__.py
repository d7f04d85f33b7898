"""``python -m asyncckpt.core.cli``: the same as the ``asyncckpt`` command."""
from asyncckpt.core.cli.main import main

raise SystemExit(main())
