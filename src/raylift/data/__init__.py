"""Data: Ray Data datasets built from a task, and the per-worker batch sources."""
