"""asyncckpt adapter for lightning (see docs/)."""
