"""`report.md`: the run as Markdown, readable in a terminal, a pull request or a wiki.

The text both renderers share (summary line, candidate table cells, checklist) comes from
`llmopt.report.facts` and `llmopt.report.checklist`; this module only lays it out.
"""

from __future__ import annotations

from typing import Any

from llmopt.report.checklist import CHECK_MARK, checklist
from llmopt.report.facts import (
    BENCH_HEADERS,
    ENGINE_HEADERS,
    ROOFLINE_HEADERS,
    VERIFY_HEADERS,
    bench_facts,
    bench_rows,
    candidate_cells,
    candidate_headers,
    engine_rows,
    env_rows,
    model_rows,
    plan_rows,
    roofline_rows,
    summary_line,
    verify_rows,
)
from llmopt.report.facts_search import (
    DOCTOR_HEADERS,
    ROOFLINE_SUMMARY_HEADERS,
    SEARCH_HEADERS,
    doctor_rows,
    reverify_lines,
    roofline_summary_rows,
    search_facts,
    search_rows,
)
from llmopt.report.view import CandidateView, RunView, fmt_num, fmt_pct, fmt_value

__all__ = ["render_markdown"]


def render_markdown(view: RunView) -> str:
    """The whole report as Markdown. Deterministic: the same run directory gives the same text.

    Args:
        view: the loaded run (`load_run(run_dir)`).

    Example:
        >>> from llmopt.report.view import load_run
        >>> text = render_markdown(load_run("runs/smollm2"))  # doctest: +SKIP
    """
    out: list[str] = []
    out += _header(view)
    out += ["## Candidates", ""]
    if view.candidates:
        out += _table(candidate_headers(view), [candidate_cells(view, c) for c in view.candidates])
    else:
        out += ["No candidates yet (plan.json and candidates/ are empty or missing).", ""]
    if len({cv.engine for cv in view.candidates}) > 1:
        out += ["## Engines", "", "Each engine's fastest candidate within the quality gates.", ""]
        out += _table(ENGINE_HEADERS, engine_rows(view))
    out += _search(view)
    out += ["## Checklist", ""]
    for check in checklist(view):
        out.append(f"- {CHECK_MARK[check.status]} **{_md(check.title)}** ({check.status})")
        out += [f"    - {_md(e)}" for e in check.evidence]
    out += [""]
    if roof := roofline_summary_rows(view):
        out += ["## Roofline verdict per phase", ""]
        out += _table(ROOFLINE_SUMMARY_HEADERS, roof)
    out += ["## Model", ""]
    out += (
        _table(["fact", "value"], model_rows(view)) if view.model else ["model.json missing.", ""]
    )
    out += _plan(view)
    out += ["## Candidate details", ""]
    for cv in view.candidates:
        out += _detail(view, cv)
    out += [] if view.candidates else ["None yet.", ""]
    out += _environment(view)
    out += ["## Reproduce", "", *_code(str(view.run.get("command") or "(command not recorded)"))]
    return "\n".join(out).rstrip() + "\n"


def _search(view: RunView) -> list[str]:
    if not view.search and not view.reverify:
        return []
    out = ["## Search", ""]
    if view.search:
        out += _table(["fact", "value"], search_facts(view))
        out += _table(SEARCH_HEADERS, search_rows(view))
    if lines := reverify_lines(view):
        out += [f"**Reverify:** {_md(lines[0])}", ""] + [f"- {_md(x)}" for x in lines[1:]] + [""]
    return out


def _md(s: Any) -> str:
    """Escape a user/model string for Markdown text and table cells (one line, no raw HTML)."""
    s = " ".join(str(s).split())
    # `<` alone is enough to stop raw HTML (tags, comments) and keeps `>`, `&` readable as text.
    return s.replace("<", "&lt;").replace("|", "\\|")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md(h) for h in headers) + " |"]
    lines.append("|" + "|".join(" --- " for _ in headers) + "|")
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _code(text: str, lang: str = "bash") -> list[str]:
    fence = "```"
    while fence in text:  # a longer fence than any run of backticks inside
        fence += "`"
    return [fence + lang, text.rstrip("\n"), fence, ""]


def _header(view: RunView) -> list[str]:
    meta = [
        view.created,
        f"target {view.run.get('target', '?')}",
        f"objective {view.objective}",
        f"max quality drop {fmt_pct(view.max_quality_drop)}",
        f"llmopt {view.run.get('llmopt_version', '?')}",
    ]
    out = [f"# llmopt report: {_md(view.model_name)}", "", _md(" · ".join(meta)), ""]
    out += [f"**Summary.** {_md(summary_line(view))}", ""]
    if view.missing:
        out += [
            f"> Missing: {_md(', '.join(view.missing))} (run in progress or a stage failed).",
            "",
        ]
    for p in view.problems:
        out += [f"> Unreadable: {_md(p)}", ""]
    return out


def _plan(view: RunView) -> list[str]:
    out = ["## Target and plan", ""]
    if view.plan is None:
        return [*out, "plan.json missing.", ""]
    out += _table(["fact", "value"], plan_rows(view))
    notes = list(view.plan.get("memory", {}).get("notes", [])) + list(view.plan.get("notes", []))
    out += [f"- {_md(n)}" for n in notes] + ([""] if notes else [])
    skipped = view.plan.get("skipped") or []
    if skipped:
        out += ["Skipped candidates:", ""]
        rows = [[str(s.get(k, "")) for k in ("id", "engine", "recipe", "reason")] for s in skipped]
        out += _table(["id", "engine", "recipe", "reason"], rows)
    if view.doctor:
        out += ["### Environment (llmopt doctor)", ""]
        out += _table(DOCTOR_HEADERS, doctor_rows(view))
    return out


def _detail(view: RunView, cv: CandidateView) -> list[str]:
    c = cv.candidate
    ref = " (reference)" if cv.reference else ""
    out = [f"### {_md(cv.id)}{ref}", ""]
    out += [f"- engine: {_md(cv.engine)}, recipe: {_md(cv.recipe)}"]
    out += [f"- status: **{_md(view.status(cv).text)}**"]
    if c and c.description:
        out += [f"- description: {_md(c.description)}"]
    if c and c.settings:
        out += [f"- settings: {_md(fmt_value('', c.settings.to_dict()))}"]
    if cv.build:
        out += [
            f"- build: {_md(', '.join(f'{k}: {fmt_value(k, v)}' for k, v in cv.build.items()))}"
        ]
    if cv.missing:
        out += [f"- missing: {_md(', '.join(cv.missing))}"]
    out += [""]
    if cv.verify:
        v = cv.verify
        verdict = "passed" if v.passed else "FAILED"
        out += [
            f"Verify: {verdict}, quality drop {fmt_pct(v.quality_drop)}, {fmt_num(v.seconds)} s",
            "",
        ]
        out += _table(VERIFY_HEADERS, verify_rows(cv))
        notes = [f"{m.name}: {m.note}" for m in v.metrics if m.note] + list(v.notes)
        out += [f"- {_md(n)}" for n in notes] + ([""] if notes else [])
    if cv.bench:
        out += ["Bench:", "", *_table(BENCH_HEADERS, bench_rows(cv))]
        out += [f"- {k}: {_md(v)}" for k, v in bench_facts(cv)]
        if roof := roofline_rows(cv):
            out += [
                "",
                "Roofline (ceilings measured in the same process):",
                "",
                *_table(ROOFLINE_HEADERS, roof),
            ]
        out += [f"- {_md(n)}" for n in cv.bench.notes] + [""]
    if cv.error:
        e = cv.error
        out += [f"**Error at {_md(e.get('stage', '?'))}:** {_md(e.get('error', ''))}", ""]
        if e.get("traceback"):
            out += _code(str(e["traceback"]), "text")
    return out


def _environment(view: RunView) -> list[str]:
    out = ["## Benchmark environment", ""]
    cid, rows, differ = env_rows(view)
    if cid is None:
        return [*out, "No bench.json with an environment yet.", ""]
    out += [f"As recorded by the benchmark of {_md(cid)}:", "", *_table(["key", "value"], rows)]
    if differ:
        out += [f"Differs between candidates: {_md(', '.join(differ))}", ""]
    return out
