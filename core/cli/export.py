"""``asyncckpt export CHECKPOINT OUT``: a checkpoint's model weights as Hugging Face safetensors.

The same export the ``export=`` option runs in the background writer after each commit
(``core/export/``), offline and in this process (which reads with torch: ``torch_sources.read``), for
any checkpoint asyncckpt reads: ours (sharded in any world size, or a framework's directory), and what
the frameworks write without asyncckpt (a stock DCP directory, an FSDP ``pytorch_model_fsdp_0/``,
safetensors or ``torch.save`` files), local or at an ``s3://`` URL. ``OUT`` is a local directory, committed like a checkpoint, or an ``s3://`` URL (see
``export_checkpoint`` for what goes through a temporary directory).
"""
from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from asyncckpt.core.errors import CheckpointError
from asyncckpt.core.formats.hf_safetensors import parse_size
from asyncckpt.core.export import torch_sources
from asyncckpt.core.export.options import ExportOptions
from asyncckpt.core.export.writing import export_checkpoint, total_bytes

EXIT_OK, EXIT_PROBLEM = 0, 1


def add_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser("export", help="write a checkpoint's model as Hugging Face safetensors (shards + "
                                                "index, config.json copied), committed")
    export.add_argument("checkpoint", metavar="CHECKPOINT")
    export.add_argument("out", metavar="OUT", help="a directory (created; replaced if it holds an export) or s3:// URL")
    export.add_argument("--max-shard-size", default="5GB", help="tensor bytes per file at most (default 5GB)")
    export.add_argument("--dtype", default=None, help="write floating tensors as this dtype (bf16, fp16, fp32)")
    export.add_argument("--keys", default=None, metavar="PREFIX",
                        help="export the tensors whose key starts with PREFIX, without it (default: the model: "
                             "'model.' where the keys have it, else every tensor)")
    export.add_argument("--add-prefix", default="", metavar="PREFIX", help="put PREFIX before every exported name")
    export.add_argument("--buffer", default="64MiB", help="the fixed buffer the export reads through (its memory)")
    export.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    try:
        options = ExportOptions(max_shard_size=args.max_shard_size, dtype=args.dtype, keys=args.keys,
                                add_prefix=args.add_prefix, buffer_bytes=parse_size(args.buffer))
        read = torch_sources.read
        with tqdm(total=total_bytes(args.checkpoint, options, read), unit="B", unit_scale=True, unit_divisor=1024,
                  desc="export", file=sys.stderr, disable=args.no_progress, dynamic_ncols=True) as bar:
            target = export_checkpoint(args.checkpoint, args.out, options, read=read, progress=bar.update)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"asyncckpt export: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    print(f"{target}: exported from {args.checkpoint}")
    return EXIT_OK
