"""The report's checklist: each item a status (ok/warn/fail/info) with evidence from the run.

Items: quantization applied and verified; fused/compiled kernels active; memory plan fits with
headroom; scheduler settings match the workload; caches enabled; integrity checks passed; selection
within the quality budget; benchmark noise; doctor findings.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from llmopt.report.view import CandidateView, RunView, fmt_bytes, fmt_num, fmt_pct

__all__ = ["CHECK_MARK", "Check", "checklist"]

CHECK_MARK = {"ok": "✅", "warn": "⚠️", "fail": "❌", "info": "➖"}
# Recipe names that mean integer/low-bit numbers (w8a16, int8-sq, fp8-dynamic, gguf-q4_k_m...).
_QUANT_RE = re.compile(r"(^|[^a-z])(w\d|a\d|int\d|q\d|fp8|fp4|nf4|awq|gptq|gguf)", re.I)
_SPREAD_WARN = 0.10  # run-to-run (max - min) / median above which a speed number is noisy
_HEADROOM = 0.80  # peak RSS above this share of the target's memory leaves too little headroom
# build.json keys that say which fused or compiled kernels an engine put in (any engine's wording)
_KERNEL_KEY = re.compile(r"fus|compil|kernel|graph|optimi|cuda_graph|sdpa|attn_impl", re.I)


@dataclass
class Check:
    """One checklist item: status ok/warn/fail/info, a title, and evidence lines."""

    status: str
    title: str
    evidence: list[str] = field(default_factory=list)


def checklist(view: RunView) -> list[Check]:
    """The report's checklist, each item with its evidence from the run directory.

    Args:
        view: the loaded run.
    """
    checks = [
        _quantization(view),
        _kernels(view),
        _memory(view),
        _scheduler(view),
        _caches(view),
        _integrity(view),
        _selection(view),
        _noise(view),
    ]
    if view.doctor:
        checks.append(_doctor(view))
    return checks


def _is_quantized(cv: CandidateView) -> bool:
    facts = {**(cv.candidate.settings.to_dict() if cv.candidate else {}), **(cv.build or {})}
    if facts.get("weight_bits") or facts.get("quantized"):
        return True
    return not cv.reference and bool(_QUANT_RE.search(cv.recipe))


def _quantization(view: RunView) -> Check:
    quant = [cv for cv in view.candidates if _is_quantized(cv)]
    if not quant:
        return Check("info", "Quantization applied and verified", ["no quantized candidate"])
    evidence, passed, verified = [], 0, 0
    for cv in quant:
        built = "built" if cv.build is not None else "not built"
        if cv.error is not None:
            built = f"failed at {cv.error.get('stage', '?')}"
        v = cv.verify or cv.screen_verify
        if v is None:
            evidence.append(f"{cv.id} ({cv.recipe} on {cv.engine}): {built}, not verified")
            continue
        level = "verified" if cv.verify is not None else "verified at the screen only"
        verified += cv.verify is not None
        passed += bool(cv.verify is not None and v.passed)
        failed = [
            f"{m.name} {fmt_num(m.candidate)} vs threshold {fmt_num(m.threshold)}"
            for m in v.metrics
            if m.passed is False
        ]
        gate = "gates passed" if v.passed else "gate failed: " + "; ".join(failed)
        drop = fmt_pct(v.quality_drop)
        evidence.append(
            f"{cv.id} ({cv.recipe} on {cv.engine}): {built}, {level}, {gate}, quality drop {drop}"
        )
    if not verified:  # every quantized candidate was cut by the search (or failed)
        screened = any(cv.screen_verify is not None for cv in quant)
        how = "screen only" if screened else "none verified: cut by the search or failed"
        return Check("info", f"Quantization applied and verified ({how})", evidence)
    status = "ok" if passed else "warn"
    return Check(
        status, f"Quantization applied and verified ({passed}/{verified} passed)", evidence
    )


def _integrity(view: RunView) -> Check:
    bad, n = [], 0
    for cv in view.candidates:
        if cv.verify is not None:
            for m in cv.verify.metrics:
                for label, x in (("reference", m.reference), ("candidate", m.candidate)):
                    n += 1
                    if x is not None and not _finite(x):
                        bad.append(f"{cv.id}: {m.name} {label} = {x}")
            if not _finite(cv.verify.quality_drop):
                bad.append(f"{cv.id}: quality_drop = {cv.verify.quality_drop}")
        if cv.bench is not None:
            for name, s in cv.bench.metrics.items():
                n += 1
                if not all(_finite(x) for x in (s.median, s.p90, s.min, s.max)):
                    bad.append(f"{cv.id}: {name} = {s.median}")
    failed = [cv for cv in view.candidates if cv.error is not None]
    evidence = [f"{len(bad)} non-finite of {n} numbers" if bad else f"all {n} numbers finite"]
    evidence = evidence if n else ["no verify or bench numbers yet"]
    evidence += bad
    evidence += [
        f"failed: {cv.id} at {cv.error.get('stage', '?')}: {view.status(cv).reason}"
        for cv in failed
    ] or ["no failed candidates"]
    incomplete = [cv.id for cv in view.candidates if view.status(cv).kind == "incomplete"]
    if incomplete:
        evidence.append("incomplete: " + ", ".join(incomplete))
    evidence += [f"unreadable: {p}" for p in view.problems]
    for cv in view.candidates:  # the verifier's own integrity notes (NaN weights, scales...)
        notes = [n for n in (cv.verify.notes if cv.verify else []) if "integrity" in n.lower()]
        evidence += [f"{cv.id}: {n}" for n in notes]
    status = "fail" if bad else "warn" if failed or incomplete or view.problems else "ok"
    return Check(status, "Integrity checks passed", evidence)


def _memory(view: RunView) -> Check:
    if view.plan is None:
        return Check("warn", "Memory plan", ["plan.json missing"])
    total = (view.plan.get("target") or {}).get("memory_bytes")
    weights = (view.plan.get("memory") or {}).get("weights_bytes") or {}
    evidence = [f"target memory {fmt_bytes(total)}"] if total else ["target memory unknown"]
    evidence += [f"planned weights {d}: {fmt_bytes(b)}" for d, b in weights.items()]
    fits = (view.plan.get("memory") or {}).get("max_sequences_at_context")
    if fits:
        ctx = (view.plan.get("memory") or {}).get("context")
        evidence.append(f"full-context ({ctx}-token) sequences that fit beside the weights: {fits}")
    over, tight = [], []
    for cv in view.candidates:
        if cv.bench is not None:
            share = f" ({cv.bench.peak_rss_bytes / total:.1%} of target)" if total else ""
            evidence.append(
                f"measured peak RSS {cv.id}: {fmt_bytes(cv.bench.peak_rss_bytes)}{share}"
            )
            if total and cv.bench.peak_rss_bytes > total:
                over.append(cv.id)
            elif total and cv.bench.peak_rss_bytes > _HEADROOM * total:
                tight.append(cv.id)
    if over:
        evidence.append("over target memory: " + ", ".join(over))
    if tight:
        evidence.append(f"less than {1 - _HEADROOM:.0%} headroom: " + ", ".join(tight))
    chosen = view.chosen
    if chosen is not None and chosen.bench is not None and total:
        left = 1 - chosen.bench.peak_rss_bytes / total
        evidence.insert(0, f"chosen {chosen.id} leaves {left:.1%} of target memory free")
    status = "fail" if over else "warn" if tight or not total else "ok"
    return Check(status, "Memory plan fits with headroom", evidence)


def _kernels(view: RunView) -> Check:
    title = "Fused/compiled kernels active"
    ev, active = [], []
    for cv in view.candidates:
        facts = {k: v for k, v in (cv.build or {}).items() if _KERNEL_KEY.search(k)}
        facts.update(
            {
                k: v
                for k, v in (cv.candidate.settings.to_dict() if cv.candidate else {}).items()
                if _KERNEL_KEY.search(k)
            }
        )
        if facts:
            ev.append(f"{cv.id}: " + ", ".join(f"{k}={_short(v)}" for k, v in facts.items()))
            if any(v not in (None, False, 0, "", [], {}, "none", "eager") for v in facts.values()):
                active.append(cv.id)
    chosen = view.chosen
    if chosen is not None:
        on = chosen.id in active
        ev.insert(
            0,
            f"chosen {chosen.id}: "
            + (
                "fused/compiled kernels reported by its engine"
                if on
                else "eager kernels (its engine reports no fusion or compilation)"
            ),
        )
    if not ev:
        ev = ["no engine reported fusion or compilation (eager PyTorch kernels)"]
    status = "ok" if chosen is not None and chosen.id in active else "info"
    return Check(status, title, ev)


def _scheduler(view: RunView) -> Check:
    title = "Scheduler settings match the workload"
    s = view.run.get("settings") or {}
    ev = []
    if view.task == "causal-lm":
        ev.append(
            f"workload measured: {s.get('prompt_tokens', '?')}-token prompts, "
            f"{s.get('new_tokens', '?')} new tokens, batch sizes {s.get('bench_batch_sizes', [1])}"
        )
    else:
        ev.append(f"workload measured: {s.get('bench_sentences', '?')} sentences at batch 1 and 32")
    chosen = view.chosen
    status = "info"
    if chosen is not None and chosen.bench is not None:
        per_b = {
            int(m.group(1)): st.median
            for n, st in chosen.bench.metrics.items()
            if (m := re.fullmatch(r"(?:decode_tokens|sentences)_per_s_b(\d+)", n))
        }
        if "decode_tokens_per_s" in chosen.bench.metrics:
            per_b.setdefault(1, chosen.bench.metrics["decode_tokens_per_s"].median)
        if len(per_b) >= 2:
            best = max(per_b, key=per_b.get)
            ev.append(
                f"chosen {chosen.id}: "
                + ", ".join(f"batch {b}: {fmt_num(v)}/s" for b, v in sorted(per_b.items()))
                + f"; best at batch {best}"
            )
            status = "ok"
        threads = chosen.candidate.settings.threads if chosen.candidate else None
        env_threads = chosen.bench.env.get("torch_threads")
        if threads:
            ev.append(f"threads: {threads} requested, {env_threads} used by torch in the bench")
            if env_threads and env_threads != threads:
                status = "warn"
    serve = (view.launch or {}).get("serve") or {}
    if serve.get("scheduler"):
        ev.append(f"launch: {serve['scheduler']}")
    thr = (view.launch or {}).get("similarity_threshold") or {}
    if thr.get("threshold") is not None:
        agree = [
            f"{thr[k]:.2%}{label}"
            for k, label in (("agreement", ""), ("agreement_as_is", " as is"))
            if thr.get(k) is not None
        ]
        ev.append(
            f"similarity threshold for the application: {thr['threshold']:.4g} in place of "
            f"{thr['reference_threshold']:.4g} (decision agreement with the reference "
            f"{', '.join(agree) or 'unknown'}; best/launch.json)"
        )
    dep = view.deploy or {}
    if dep.get("written"):
        ev.append(
            f"deploy bundle best/deploy written with its serving plan ({len(dep.get('files', []))} files; "
            f"validators {'passed' if dep.get('ok') else 'reported problems'})"
        )
    elif dep:
        ev.append(f"no deploy bundle: {dep.get('reason', '?')}")
    return Check(status, title, ev)


def _caches(view: RunView) -> Check:
    title = "Caches enabled"
    ev, status = [], "info"
    chosen = view.chosen or view.reference
    b = chosen.bench if chosen is not None else None
    if view.task == "causal-lm" and b is not None:
        dec, pre = b.metrics.get("decode_ms_per_token"), b.metrics.get("prefill_tokens_per_s")
        p = b.settings.get("prompt_tokens")
        if dec and pre and p and pre.median:
            recompute = 1000.0 * p / pre.median  # what a step without a KV cache would cost
            ok = dec.median < recompute
            status = "ok" if ok else "warn"
            ev.append(
                f"KV cache: {chosen.id} decodes in {fmt_num(dec.median)} ms/token; "
                f"recomputing the {p}-token prompt takes {fmt_num(recompute)} ms "
                f"({'cache in use' if ok else 'no faster than recomputing: cache not effective'})"
            )
        kv = (view.model or {}).get("kv_bytes_per_token") or {}
        if kv:
            ev.append(
                "KV cache per token: " + ", ".join(f"{d} {fmt_bytes(v)}" for d, v in kv.items())
            )
    elif view.task == "embedding":
        ev.append("encoder model: no KV cache; each request is one forward pass")
    ref_files = sorted(p.name for p in (view.run_dir / "reference").glob("*") if p.is_file())
    if ref_files:
        ev.append(
            "reference outputs computed once and shared by every candidate: " + ", ".join(ref_files)
        )
    ev.append("candidate artifacts built once and reused by the screen, full fidelity and reverify")
    return Check(status, title, ev)


def _short(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _selection(view: RunView) -> Check:
    title = "Selection within budget"
    sel, budget = view.selection, view.max_quality_drop
    if sel is None:
        return Check("warn", title, ["selection.json missing"])
    chosen = view.chosen
    if chosen is None:
        ev = [f"nothing chosen at budget {fmt_pct(budget)}"]
        return Check("warn", title, ev + [f"{k}: {v}" for k, v in sel.reasons.items()])
    if chosen.verify is None:
        return Check("fail", title, [f"chosen {chosen.id} has no verify.json"])
    drop = chosen.verify.quality_drop
    ok = chosen.verify.passed and budget is not None and drop <= budget
    cmp = "<=" if budget is not None and drop <= budget else ">"
    ev = [
        f"chosen {chosen.id}: quality drop {fmt_pct(drop)} {cmp} budget {fmt_pct(budget)}",
        f"gates {'all passed' if chosen.verify.passed else 'FAILED'}",
        f"ranking: {', '.join(sel.ranking) or 'empty'}",
    ]
    return Check("ok" if ok else "fail", title, ev)


def _noise(view: RunView) -> Check:
    name, ev, noisy = view.primary_metric, [], []
    for cv in view.candidates:
        st = cv.bench.metrics.get(name or "") if cv.bench else None
        if st is not None:
            ev.append(f"{cv.id}: {name} spread {st.spread:.1%} over n={st.n}")
            noisy += [cv.id] if st.spread > _SPREAD_WARN else []
    if not ev:
        return Check("info", "Benchmark noise", ["no bench results"])
    ev.insert(0, f"(max - min) / median; above {_SPREAD_WARN:.0%} is flagged")
    return Check("warn" if noisy else "ok", "Benchmark noise", ev)


def _doctor(view: RunView) -> Check:
    findings = (view.doctor or {}).get("findings", [])
    worst = {s.get("status") for s in findings}
    status = "fail" if "fail" in worst else "warn" if "warn" in worst else "ok"
    ev = [
        f"{f.get('title') or f.get('id') or f.get('check')}: {f.get('status')}: "
        f"{f.get('evidence', '')}"
        for f in findings
        if f.get("status") != "ok"
    ] or [f"all {len(findings)} checks ok"]
    return Check(status, "Environment (doctor)", ev)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
