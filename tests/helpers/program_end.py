"""The last lines of the test programs that train on several processes with torch.distributed (gloo).

torch asks a program to destroy its process group before it exits. Without that, gloo's worker threads may still
hold the last collective's tensors while the interpreter shuts down, and freeing them then aborts the process
("terminate called without an active exception", SIGABRT): 7 of 40 runs of a two-rank program whose last act is an
``all_reduce`` under load, 0 of 40 with these lines (2026-11-28, torch 2.13; it made a Lightning program of
test_memory_tier_nodes.py exit with -6 once, with or without asyncckpt alike). Lightning destroys its group at exit
for NCCL only, the Transformers Trainer never; Accelerate's ``end_training`` does.
"""

DESTROY_PROCESS_GROUP = """
import torch.distributed
if torch.distributed.is_available() and torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
"""
