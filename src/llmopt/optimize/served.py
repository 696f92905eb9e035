"""The verify and bench stages of a *served* candidate (`Engine.served`: vLLM), over HTTP.

Such an engine has no in-process runner: the stage starts its server (`engine.server(...)`, a
context manager that stops it on every way out), then

- verify: the artifact's integrity checks first, as for every engine; then the endpoint path of
  `llmopt verify --endpoint` (`llmopt.verify.endpoint`): perplexity and top-1 agreement from the
  server's prompt log-probabilities on the same token windows as every other candidate, greedy
  generations against the in-process reference, under the same gates. KL divergence cannot be
  measured from top-k log-probabilities; the result's notes say so.
- bench: the load generator of `llmopt bench serve` (`llmopt.bench.loadgen`) with the run's
  prompt (the same evaluation text, `prompt_tokens` long) and `new_tokens` per request, spelled
  in the in-process metric names so the objectives rank it beside the others: at concurrency 1,
  `prefill_tokens_per_s` (prompt tokens / time to first token), `decode_ms_per_token` (time per
  output token) and `decode_tokens_per_s`; at each larger batch size B, B requests at
  concurrency B and `decode_tokens_per_s_bB`, the sum of their decode rates. Client-side timing
  over loopback HTTP includes the server's HTTP and detokenization work, which in-process
  numbers do not: the result's notes say so.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from llmopt.assets.text import evaluation_text, token_windows
from llmopt.bench.loadgen import LoadSpec, Workload, run_load
from llmopt.bench.timing import environment, machine_probe
from llmopt.core.atomic import read_json
from llmopt.core.schema import BenchResult, summarize
from llmopt.engines import load_runner
from llmopt.optimize.profiles import StageProfile, StageSettings
from llmopt.rundir.paths import RunDir
from llmopt.verify.endpoint import OpenAIEndpoint, verify_causal_lm_endpoint
from llmopt.verify.gates import Gates
from llmopt.verify.integrity import check_weights, raise_on_problems

__all__ = ["verify_served", "bench_served", "decode_rates"]


def _reference_runner(run: RunDir, info, ctx):
    plan = read_json(run.plan_json)
    ref = next(c for c in plan["candidates"] if c.get("reference"))
    _, _, rc, re, rr = ctx(run, ref["id"])
    return load_runner(re.name, run.candidate(rc.id).artifact, info, rr, rc.settings)


def verify_served(run: RunDir, cid: str, fidelity: str, ctx) -> dict[str, Any]:
    """The verify stage of a served candidate (`ctx` is the worker's `_context`)."""
    meta, info, cand, engine, recipe = ctx(run, cid)
    s = StageSettings.from_run_json(meta["settings"], fidelity)
    cdir = run.candidate(cid)
    raise_on_problems(check_weights(cdir.artifact), cid)
    gates = Gates.preset(s.gates, max_quality_drop=s.max_quality_drop)
    reference = _reference_runner(run, info, ctx)
    z = s.sizes
    window = min(z.window, info.max_context or z.window)
    windows = token_windows(reference.tokenizer, evaluation_text(), window, z.eval_windows)
    prompts = 2 if z.generation_prompts is None else z.generation_prompts
    log = cdir.root / f"server.verify.{fidelity}.log"
    with engine.server(cdir.artifact, info, recipe, cand.settings, log=log) as srv:
        endpoint = OpenAIEndpoint(srv.base_url, srv.model, tokenizer=reference.tokenizer)
        result = verify_causal_lm_endpoint(
            cid, endpoint, windows, reference, gates, generation_prompts=prompts
        )
    result.notes.append(
        f"verified through {engine.name}'s own server ({srv.config.engine}) on loopback: "
        "prompt log-probabilities and greedy generations over HTTP"
    )
    return result.to_dict()


def decode_rates(records: list[dict[str, Any]]) -> list[float]:
    """Each successful request's decode rate, tokens/s: (output tokens - 1) / (latency - TTFT).

    >>> decode_rates([{"success": True, "output_tokens": 11, "latency": 1.5, "ttft": 0.5},
    ...               {"success": False, "output_tokens": 0, "latency": 0, "ttft": 0}])
    [10.0]
    """
    return [
        (r["output_tokens"] - 1) / (r["latency"] - r["ttft"])
        for r in records
        if r["success"] and r["output_tokens"] > 1 and r["latency"] > r["ttft"]
    ]


def bench_served(run: RunDir, cid: str, fidelity: str, ctx) -> dict[str, Any]:
    """The bench stage of a served candidate (`ctx` is the worker's `_context`)."""
    meta, info, cand, engine, recipe = ctx(run, cid)
    z = StageSettings.from_run_json(meta["settings"], fidelity).sizes
    cdir = run.candidate(cid)
    from transformers import AutoTokenizer  # heavy: the prompt in the run's tokenizer

    tok = AutoTokenizer.from_pretrained(cdir.artifact)
    ids = tok(evaluation_text()[:20000], add_special_tokens=False)["input_ids"]
    ctx_len = info.max_context or 2048
    new = min(z.new_tokens, ctx_len // 2)
    prompt = tok.decode(ids[: min(z.prompt_tokens, ctx_len - new)])
    batches = sorted({1, *z.bench_batch_sizes})
    metrics: dict[str, Any] = {}
    errors: list[str] = []
    log = cdir.root / f"server.bench.{fidelity}.log"
    t0 = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as tmp,
        engine.server(cdir.artifact, info, recipe, cand.settings, log=log) as srv,
    ):
        load_s = time.perf_counter() - t0
        # As the in-process bench: the machine probed before and after the timed block, so that
        # side-by-side rounds compare numbers only from a machine that stayed alike.
        probe_before = machine_probe()
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text(json.dumps({"prompt": prompt, "max_tokens": new}) + "\n")
        work = Workload(output_len=new, prompts_file=prompts, ignore_eos=True)
        w0 = time.perf_counter()
        run_load(srv.base_url, LoadSpec("concurrency", 1, num_requests=1), work, srv.model)
        warm = time.perf_counter() - w0
        prompt_lens: list[int] = []
        for b in batches:
            spec = LoadSpec("concurrency", b, num_requests=b * z.bench_repeats, max_seconds=3600)
            out = run_load(srv.base_url, spec, work, srv.model, warmups=0)
            errors += out["errors"]
            recs = [r for r in out["requests"] if r["success"]]
            if not recs:
                continue
            rates = decode_rates(recs)
            if b == 1:
                prompt_lens = [r["prompt_len"] for r in recs]
                metrics["prefill_tokens_per_s"] = summarize(
                    [r["prompt_len"] / r["ttft"] for r in recs if r["ttft"] > 0], "tokens/s"
                )
                metrics["ttft_ms"] = summarize([1000 * r["ttft"] for r in recs], "ms")
                if rates:
                    metrics["decode_tokens_per_s"] = summarize(rates, "tokens/s")
                    metrics["decode_ms_per_token"] = summarize([1000 / x for x in rates], "ms")
            elif rates:
                # b requests decode together: their rates add up (one value per wave of b).
                waves = [sum(rates[i : i + b]) for i in range(0, len(rates) - b + 1, b)]
                metrics[f"decode_tokens_per_s_b{b}"] = summarize(waves or [sum(rates)], "tokens/s")
        probe = {"before": probe_before, "after": machine_probe()}
        peak = srv.peak_rss_bytes()
        server_cmd = srv.config.command
    if "decode_tokens_per_s" not in metrics:
        raise RuntimeError(
            f"no request to {engine.name}'s server completed: {errors[:1] or 'no answer'} "
            f"(server log: {log})"
        )
    notes = [
        f"measured through {engine.name}'s own server with llmopt's load generator (client-side "
        "timing over loopback HTTP: includes the server's HTTP, tokenization and "
        "detokenization, which in-process numbers do not)",
        "memory: the sum of the server processes' peak resident memory (VmHWM)",
    ]
    return BenchResult(
        candidate_id=cid,
        task=info.task,
        metrics=metrics,
        primary="decode_tokens_per_s",
        peak_rss_bytes=peak,
        model_rss_bytes=peak,
        artifact_bytes=sum(f.stat().st_size for f in cdir.artifact.rglob("*") if f.is_file()),
        load_seconds=load_s,
        warmup_seconds=warm,
        settings={
            "batch": 1,
            "batch_sizes": batches,
            "prompt_tokens": round(sum(prompt_lens) / len(prompt_lens)) if prompt_lens else None,
            "new_tokens": new,
            "repeats": z.bench_repeats,
            "threads": cand.settings.threads,
            "server": server_cmd,
        },
        env={**environment(), "probe": probe},
        notes=notes + [f"request errors: {e}" for e in sorted(set(errors))[:3]],
        fidelity=z.fidelity_record(fidelity, StageProfile.BENCH_FIELDS),
    ).to_dict()
