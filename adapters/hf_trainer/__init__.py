"""asyncckpt adapter for hf_trainer (see docs/)."""
