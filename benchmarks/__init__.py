"""Benchmarks: rate-limited multi-rank runs on one machine (see README.md)."""
