"""Verification: does a candidate compute what the reference computes?

`lm` (causal LMs) and `embedding` (+ `retrieval`) score the metrics; `gates` holds the thresholds;
`stats` the paired bootstrap; `integrity` the fail-fast checks; `attribution` the per-layer SQNR;
`endpoint` the OpenAI-compatible client; `tasks` multiple-choice JSONL; `lm_eval` the optional
lm-evaluation-harness bridge; `api.verify_models` wires them for `llmopt verify`.
"""
