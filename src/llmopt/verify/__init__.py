"""Verification: does a candidate compute what the reference computes (see `lm.py`, `embedding.py`)."""
