"""What the trainer shows: metrics (Prometheus, JSONL) and experiment tracking."""
