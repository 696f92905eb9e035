"""Benchmarks: how fast and how big a candidate is (see `lm.py`, `embedding.py`)."""
