"""Layer 6, the worker: the bootstep, lease renewal, the maintainer thread, the sweep that
re-publishes orphans, back-pressure while the store is down, and startup self-checks."""
