"""Layer 5, the task API: ``ResumableTask``, its claim, checkpoints, durable steps, the
idempotency ledger and continuity contexts."""
