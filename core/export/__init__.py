"""Exporting a checkpoint's model weights as Hugging Face safetensors (``writing``), in two halves.

Without torch, loaded by the background writer: ``request`` (``ExportRequest``, run behind a commit),
``writing`` (the export itself), ``options`` (``ExportOptions``), ``sources`` (where each tensor's pieces
lie, from the checkpoint's JSON) and ``assembly`` (a tensor from its pieces through a fixed buffer).
With torch, never loaded by the writer: ``torch_sources`` (what only torch reads), ``peft_merge`` and
``__main__``, the child process an export that needs them runs in (tests/project/test_layout.py names both halves).
"""
