"""Benchmark harness: 1-producer/N-consumer scenarios on fresh cache roots, with reports."""
