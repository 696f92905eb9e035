"""The report's checklist: each item a status (ok/warn/fail/info) with evidence from the run.

Items: quantization applied and verified, integrity (finite numbers, failed candidates), memory
plan vs measured peak RSS, selection within the quality budget, benchmark noise, doctor findings.
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
    checks = [_quantization(view), _integrity(view), _memory(view), _selection(view)]
    checks.append(_noise(view))
    if view.doctor:
        checks.append(_doctor(view))
    return checks


def _is_quantized(cv: CandidateView) -> bool:
    facts = {**(cv.candidate.settings if cv.candidate else {}), **(cv.build or {})}
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
        if cv.verify is None:
            evidence.append(f"{cv.id} ({cv.recipe} on {cv.engine}): {built}, not verified")
            continue
        verified += 1
        passed += cv.verify.passed
        failed = [
            f"{m.name} {fmt_num(m.candidate)} vs threshold {fmt_num(m.threshold)}"
            for m in cv.verify.metrics
            if m.passed is False
        ]
        gate = "gates passed" if cv.verify.passed else "gate failed: " + "; ".join(failed)
        drop = fmt_pct(cv.verify.quality_drop)
        evidence.append(
            f"{cv.id} ({cv.recipe} on {cv.engine}): {built}, verified, {gate}, quality drop {drop}"
        )
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
    status = "fail" if bad else "warn" if failed or incomplete or view.problems else "ok"
    return Check(status, "Integrity", evidence)


def _memory(view: RunView) -> Check:
    if view.plan is None:
        return Check("warn", "Memory plan", ["plan.json missing"])
    total = (view.plan.get("target") or {}).get("memory_bytes")
    weights = (view.plan.get("memory") or {}).get("weights_bytes") or {}
    evidence = [f"target memory {fmt_bytes(total)}"] if total else ["target memory unknown"]
    evidence += [f"planned weights {d}: {fmt_bytes(b)}" for d, b in weights.items()]
    over = []
    for cv in view.candidates:
        if cv.bench is not None:
            share = f" ({cv.bench.peak_rss_bytes / total:.1%} of target)" if total else ""
            evidence.append(
                f"measured peak RSS {cv.id}: {fmt_bytes(cv.bench.peak_rss_bytes)}{share}"
            )
            if total and cv.bench.peak_rss_bytes > total:
                over.append(cv.id)
    if over:
        evidence.append("over target memory: " + ", ".join(over))
    return Check("fail" if over else "ok" if total else "warn", "Memory plan", evidence)


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
        f"{f.get('check')}: {f.get('status')}: {f.get('evidence', '')}"
        for f in findings
        if f.get("status") != "ok"
    ] or [f"all {len(findings)} checks ok"]
    return Check(status, "Environment (doctor)", ev)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
