"""What a run reports: metrics (console, JSONL, TensorBoard), Prometheus, and the per-step report."""
