"""Stand-alone tools that read what runs wrote (metrics.jsonl, traces); nothing here trains."""
