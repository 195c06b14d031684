"""Command-line entry points (rlf-train, rlf-convert, rlf-bench, rlf-cache)."""
