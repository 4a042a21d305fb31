"""Benchmarks and generators run from the repository root (``python -m benchmarks.corpus_gen``); not installed."""
