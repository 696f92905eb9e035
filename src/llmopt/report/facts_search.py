"""What the report says about the search, the roofline and the environment, as plain text rows.

Shared by `markdown.py` and `html.py` (like `facts.py`), so the two reports cannot disagree.
"""

from __future__ import annotations

from llmopt.report.view import RunView, fmt_num, fmt_pct, fmt_value

__all__ = [
    "DOCTOR_HEADERS",
    "SEARCH_HEADERS",
    "ROOFLINE_SUMMARY_HEADERS",
    "doctor_rows",
    "reverify_lines",
    "roofline_summary_rows",
    "search_facts",
    "search_rows",
]

SEARCH_HEADERS = [
    "candidate",
    "screen quality drop",
    "screen objective (x ref)",
    "full objective",
    "ran on",
    "task seconds",
    "outcome",
]
ROOFLINE_SUMMARY_HEADERS = ["candidate", "phase", "verdict", "share of ceiling", "what it implies"]
DOCTOR_HEADERS = ["check", "status", "evidence", "fix"]


def search_facts(view: RunView) -> list[list[str]]:
    """(fact, value) rows: objective, strategy, budget, executor, fidelities, events."""
    s = view.search or {}
    if not s:
        return []
    b = s.get("budget") or {}
    ex = s.get("executor") or {}
    budget = f"{fmt_num(b.get('seconds'))} s" if b.get("seconds") else "none"
    rows = [
        ["objective", str(s.get("objective"))],
        ["strategy", f"{s.get('search')} (fidelity 1: screen, fidelity 2: full)"],
        ["time budget", f"{budget}; this call took {fmt_num(b.get('elapsed_s'))} s"],
        ["executor", fmt_value("", ex)],
    ]
    for name, sizes in (s.get("fidelities") or {}).items():
        rows.append([f"fidelity {name}", fmt_value("", sizes)])
    rows += [["event", e] for e in s.get("events") or []]
    # Rung 4: the chosen one's runtime settings, and what compiling its decode costs and saves.
    tuned = (view.selection.tuned if view.selection else None) or {}
    if tuned.get("note"):
        rows.append(["settings (rung 4)", str(tuned["note"])])
    if tuned.get("payback"):
        rows.append(["compiled decode", str(tuned["payback"])])
    if s.get("stopped_early"):
        rows.append(["early stop", "yes: the objective could not improve further"])
    return rows


def search_rows(view: RunView) -> list[list[str]]:
    """One row per candidate: what the screen measured, the full objective, where it ran."""
    sel = view.selection
    values = sel.objective_values if sel else {}
    rows = []
    for cv in view.candidates:
        sv = cv.screen_verify
        score = view.screen_score(cv)
        where = []
        for rung, t in cv.tasks.items():
            if t.get("host"):
                node = f", node {str(t['node_id'])[:8]}" if t.get("node_id") else ""
                where.append(f"{rung}: {t['host']} pid {t.get('pid')}{node}")
        secs = sum(float(t.get("seconds") or 0) for t in cv.tasks.values())
        full = values.get(cv.id)
        unit = sel.objective_unit if sel else ""
        rows.append(
            [
                cv.id + (" (reference)" if cv.reference else ""),
                fmt_pct(sv.quality_drop) if sv else "n/a",
                "1.00x"
                if cv.reference and cv.screen_bench
                else (f"{score:.2f}x" if score is not None else "n/a"),
                f"{fmt_num(full)} {unit}".strip() if full is not None else "n/a",
                "; ".join(where) or "n/a",
                fmt_num(secs) if secs else "n/a",
                view.status(cv).text,
            ]
        )
    return rows


def roofline_summary_rows(view: RunView) -> list[list[str]]:
    """Per benchmarked phase of the chosen candidate and the reference: the roofline verdict."""
    rows = []
    shown = {c.id: c for c in (view.chosen, view.reference) if c is not None}
    for cv in shown.values():
        phases = ((cv.bench.roofline if cv.bench else None) or {}).get("phases", [])
        for p in phases:
            verdict = str(p.get("verdict", "?"))
            share = p.get("bandwidth_share") if "memory" in verdict else p.get("flops_share")
            rows.append(
                [
                    cv.id,
                    str(p.get("phase", p.get("metric", "?"))),
                    verdict,
                    fmt_pct(share),
                    str(p.get("implication", "")),
                ]
            )
    return rows


def doctor_rows(view: RunView) -> list[list[str]]:
    """doctor.json findings (the environment the run saw)."""
    d = view.doctor or {}
    rows = [
        [
            str(f.get("title") or f.get("id") or f.get("check", "")),
            str(f.get("status", "")),
            str(f.get("evidence", "")),
            str(f.get("fix") or ""),
        ]
        for f in d.get("findings", [])
    ]
    if d.get("error"):
        rows.append(["doctor", "error", str(d["error"]), ""])
    return rows


def reverify_lines(view: RunView) -> list[str]:
    """The last `--reverify` verdict, with what changed since the run."""
    r = view.reverify
    if not r:
        return []
    out = [f"{r.get('checked', '?')}: {r.get('verdict', '?')}"]
    for k, (a, b) in (r.get("versions_changed") or {}).items():
        out.append(f"{k}: {a} -> {b}")
    return out
