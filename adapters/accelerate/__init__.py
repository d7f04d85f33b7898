"""asyncckpt adapter for accelerate (see docs/)."""
