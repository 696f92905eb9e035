"""`report.html`: the run as ONE self-contained HTML5 file (inline CSS and SVG, no JS, no URLs).

Same content as `report.md`, laid out for a browser: a summary card, charts, coloured tables and a
collapsible section per candidate. Every string from the run directory is escaped.
"""

from __future__ import annotations

from html import escape

from llmopt.report.checklist import checklist
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
from llmopt.report.plots import COLORS, memory_bars_svg, quality_speed_svg, speed_bars_svg
from llmopt.report.plots_search import latency_cdf_svg, throughput_concurrency_svg
from llmopt.report.view import CandidateView, RunView, fmt_bytes, fmt_num, fmt_pct, fmt_value, fmt_x

__all__ = ["render_html"]

_CSS = """
:root { --fg:#1f2328; --muted:#59636e; --line:#d1d9e0; --bg:#f6f8fa; --card:#fff;
  --ok:#1a7f37; --okbg:#dafbe1; --bad:#cf222e; --badbg:#ffebe9; --warn:#9a6700; --warnbg:#fff8c5; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg); line-height:1.45;
  font:14px/1.45 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif; }
main { max-width:1180px; margin:0 auto; padding:24px 20px 48px; }
h1 { font-size:24px; margin:0 0 4px; } h2 { font-size:18px; margin:28px 0 10px; }
h3 { font-size:15px; margin:16px 0 6px; }
.meta, .muted { color:var(--muted); }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:16px 18px; }
.summary { border-left:6px solid var(--muted); margin-top:16px; }
.summary.chosen { border-left-color:var(--ok); } .summary.none { border-left-color:var(--warn); }
.summary .headline { font-size:18px; font-weight:600; }
.stats { display:flex; flex-wrap:wrap; gap:28px; margin-top:12px; }
.stat b { display:block; font-size:22px; } .stat span { color:var(--muted); font-size:12px; }
.notice { background:var(--warnbg); border:1px solid #d4a72c; border-radius:6px; padding:8px 12px;
  margin-top:12px; }
.charts { display:grid; grid-template-columns:repeat(auto-fit,minmax(460px,1fr)); gap:16px;
  align-items:start; }
figure { margin:0; } figcaption { font-weight:600; margin-bottom:6px; }
.scroll { overflow-x:auto; }
table { border-collapse:collapse; width:100%; background:var(--card); font-size:13px; }
th, td { border:1px solid var(--line); padding:5px 8px; text-align:left; vertical-align:top; }
th { background:#eef1f4; font-weight:600; }
table.cands td:last-child { min-width:240px; }
td.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
tr.chosen td { background:var(--okbg); } tr.failed td { background:#fbefff; }
tr.dropped td { color:#6e4b4b; } tr.cut td { color:#6e5a4b; background:#fff8f0; }
td.pass { color:var(--ok); font-weight:600; } td.fail { color:var(--bad); font-weight:600; }
table.kv { width:auto; min-width:50%; } table.kv th { text-align:left; }
.pill { display:inline-block; border-radius:10px; padding:0 8px; font-size:12px; font-weight:600;
  color:#fff; }
ul.checklist { list-style:none; padding:0; } ul.checklist > li { margin:8px 0; }
ul.checklist ul { margin:4px 0 0; color:var(--muted); }
.badge { display:inline-block; min-width:44px; text-align:center; border-radius:4px;
  font-size:11px; font-weight:700; padding:1px 6px; margin-right:6px; }
.badge.ok { background:var(--okbg); color:var(--ok); } .badge.fail { background:var(--badbg);
  color:var(--bad); } .badge.warn { background:var(--warnbg); color:var(--warn); }
.badge.info { background:#eef1f4; color:var(--muted); }
details { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:8px 14px; margin:8px 0; }
summary { cursor:pointer; font-weight:600; }
pre { background:#f6f8fa; border:1px solid var(--line); border-radius:6px; padding:10px;
  overflow-x:auto; font-size:12px; }
.error { background:var(--badbg); border:1px solid #ff8182; border-radius:6px; padding:8px 12px; }
footer { margin-top:32px; color:var(--muted); font-size:12px; }
"""


def render_html(view: RunView) -> str:
    """The whole report as one self-contained HTML file. Deterministic for a given run directory.

    Args:
        view: the loaded run (`load_run(run_dir)`).

    Example:
        >>> from llmopt.report.view import load_run
        >>> page = render_html(load_run("runs/smollm2"))  # doctest: +SKIP
    """
    title = f"llmopt report: {view.model_name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body><main>",
        f"<header><h1>{escape(title)}</h1><div class='meta'>{escape(_meta(view))}</div></header>",
        _summary(view),
        _charts(view),
        "<h2>Candidates</h2>",
        _candidates(view),
        _engines(view),
        _search(view),
        "<h2>Checklist</h2>",
        _checklist(view),
        _roofline(view),
        "<h2>Model</h2>",
        _kv(model_rows(view)) if view.model else "<p>model.json missing.</p>",
        _plan(view),
        "<h2>Candidate details</h2>",
        *(_detail(view, cv) for cv in view.candidates),
        "" if view.candidates else "<p>None yet.</p>",
        _environment(view),
        "<h2>Reproduce</h2>",
        f"<pre><code>{escape(str(view.run.get('command') or '(command not recorded)'))}</code></pre>",
        f"<footer>llmopt {escape(str(view.run.get('llmopt_version', '?')))}, "
        f"schema {escape(str(view.run.get('schema_version', '?')))}.</footer>",
        "</main></body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"


def _meta(view: RunView) -> str:
    obj = view.objective
    return (
        f"{view.created} · target {view.run.get('target', '?')} · objective {obj} · "
        f"max quality drop {fmt_pct(view.max_quality_drop)}"
    )


def _table(
    headers: list[str], rows: list[list[str]], row_classes: list[str] | None = None, cls: str = ""
) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes else ""
        body.append(f"<tr{cls}>" + "".join(_td(c) for c in row) + "</tr>")
    return f"<div class='scroll'><table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"


def _td(cell: str) -> str:
    cls = {"pass": "pass", "FAIL": "fail"}.get(cell)
    if cls is None and cell[:1] in "+-0123456789" and cell not in ("", "-"):
        cls = "num"
    return f'<td class="{cls}">{escape(cell)}</td>' if cls else f"<td>{escape(cell)}</td>"


def _kv(rows: list[list[str]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return f"<div class='scroll'><table class='kv'><tbody>{body}</tbody></table></div>"


def _summary(view: RunView) -> str:
    chosen = view.chosen
    out = [f"<section class='card summary {'chosen' if chosen else 'none'}'>"]
    out.append(f"<div class='headline'>{escape(summary_line(view))}</div>")
    if chosen is not None:
        # The selection's own ratio (the headline's), said how it was measured.
        r = view.objective_ratio(chosen)
        how = "" if r is None else (" within noise" if r.within_noise else f" {r.basis}")
        stats: list[tuple[str, str]] = [
            (fmt_x(r.value if r else None), f"{view.objective} vs reference{how}"),
            (fmt_num(view.speed(chosen)), f"{view.primary_metric} (median)"),
            (fmt_pct(chosen.verify.quality_drop if chosen.verify else None), "quality drop"),
        ]
        if chosen.bench is not None:
            ratio = fmt_x(view.memory_ratio(chosen))
            stats.append((fmt_bytes(chosen.bench.peak_rss_bytes), f"peak RSS ({ratio} reference)"))
        out.append("<div class='stats'>")
        out += [
            f"<div class='stat'><b>{escape(v)}</b><span>{escape(k)}</span></div>" for v, k in stats
        ]
        out.append("</div>")
    out.append("</section>")
    if view.missing:
        missing = ", ".join(view.missing)
        out.append(
            f"<div class='notice'>Missing: {escape(missing)} (run in progress or a stage failed).</div>"
        )
    out += [f"<div class='notice'>Unreadable: {escape(p)}</div>" for p in view.problems]
    return "\n".join(out)


def _charts(view: RunView) -> str:
    charts = [
        (
            "Quality drop vs speed (diamond: reference, ring: chosen, dashed: Pareto front)",
            quality_speed_svg(view),
        ),
        ("Speed per candidate", speed_bars_svg(view)),
        ("Latency CDF over the timed repeats (thick: chosen)", latency_cdf_svg(view)),
        ("Throughput vs concurrency (batch size)", throughput_concurrency_svg(view)),
        ("Memory per candidate", memory_bars_svg(view)),
    ]
    figs = [
        f"<figure class='card'><figcaption>{escape(t)}</figcaption>{svg}</figure>"
        for t, svg in charts
        if svg
    ]
    if not figs:
        return "<h2>Charts</h2><p class='muted'>No bench results yet.</p>"
    return "<h2>Charts</h2><div class='charts'>" + "".join(figs) + "</div>"


def _candidates(view: RunView) -> str:
    if not view.candidates:
        return "<p>No candidates yet (plan.json and candidates/ are empty or missing).</p>"
    rows = [candidate_cells(view, cv) for cv in view.candidates]
    kinds = [view.status(cv).kind for cv in view.candidates]
    return _table(candidate_headers(view), rows, kinds, "cands")


def _engines(view: RunView) -> str:
    if len({cv.engine for cv in view.candidates}) < 2:
        return ""
    note = "<p class='muted'>Each engine's fastest candidate within the quality gates.</p>"
    return "<h2>Engines</h2>" + note + _table(ENGINE_HEADERS, engine_rows(view))


def _checklist(view: RunView) -> str:
    items = []
    for c in checklist(view):
        ev = "".join(f"<li>{escape(e)}</li>" for e in c.evidence)
        items.append(
            f"<li><span class='badge {c.status}'>{c.status.upper()}</span>"
            f"<b>{escape(c.title)}</b><ul>{ev}</ul></li>"
        )
    return f"<ul class='checklist'>{''.join(items)}</ul>"


def _plan(view: RunView) -> str:
    out = ["<h2>Target and plan</h2>"]
    if view.plan is None:
        return out[0] + "<p>plan.json missing.</p>"
    out.append(_kv(plan_rows(view)))
    notes = list(view.plan.get("memory", {}).get("notes", [])) + list(view.plan.get("notes", []))
    if notes:
        out.append("<ul>" + "".join(f"<li>{escape(str(n))}</li>" for n in notes) + "</ul>")
    skipped = view.plan.get("skipped") or []
    if skipped:
        keys = ["id", "engine", "recipe", "reason"]
        out += [
            "<h3>Skipped candidates</h3>",
            _table(keys, [[str(s.get(k, "")) for k in keys] for s in skipped]),
        ]
    if view.doctor:
        out += ["<h3>Environment (llmopt doctor)</h3>", _table(DOCTOR_HEADERS, doctor_rows(view))]
    return "\n".join(out)


def _search(view: RunView) -> str:
    if not view.search and not view.reverify:
        return ""
    out = ["<h2>Search</h2>"]
    if view.search:
        out += [_kv(search_facts(view)), _table(SEARCH_HEADERS, search_rows(view))]
    if lines := reverify_lines(view):
        ok = (view.reverify or {}).get("holds")
        out.append(f"<div class='notice'><b>Reverify:</b> {escape(lines[0])}</div>")
        out.append(_notes(lines[1:]))
        out.append("" if ok else "<p class='muted'>see reverify.json</p>")
    return "\n".join(out)


def _roofline(view: RunView) -> str:
    rows = roofline_summary_rows(view)
    if not rows:
        return ""
    return (
        "<h2>Roofline verdict per phase</h2><p class='muted'>chosen candidate and reference; "
        "ceilings measured in the same process</p>" + _table(ROOFLINE_SUMMARY_HEADERS, rows)
    )


def _detail(view: RunView, cv: CandidateView) -> str:
    st = view.status(cv)
    color = (
        COLORS["reference"]
        if cv.reference and st.kind == "kept"
        else COLORS.get(st.kind, "#59636e")
    )
    ref = " (reference)" if cv.reference else ""
    out = [
        f"<details{' open' if st.kind in ('chosen', 'failed') else ''}><summary>{escape(cv.id)}{ref} "
        f"<span class='pill' style='background:{color}'>{escape(st.label)}</span></summary>"
    ]
    facts: list[list[str]] = [["engine", cv.engine], ["recipe", cv.recipe], ["status", st.text]]
    c = cv.candidate
    if c and c.description:
        facts.append(["description", c.description])
    if c and c.settings:
        facts.append(["settings", fmt_value("", c.settings.to_dict())])
    facts += [[f"build.{k}", fmt_value(k, v)] for k, v in (cv.build or {}).items()]
    if cv.missing:
        facts.append(["missing", ", ".join(cv.missing)])
    out.append(_kv(facts))
    if cv.verify is not None:
        v = cv.verify
        verdict = "passed" if v.passed else "FAILED"
        out.append(
            f"<h3>Verify: {verdict}, quality drop {fmt_pct(v.quality_drop)}, {fmt_num(v.seconds)} s</h3>"
        )
        out.append(_table(VERIFY_HEADERS, verify_rows(cv)))
        out.append(_notes([f"{m.name}: {m.note}" for m in v.metrics if m.note] + list(v.notes)))
    if cv.bench is not None:
        out += ["<h3>Bench</h3>", _table(BENCH_HEADERS, bench_rows(cv)), _kv(bench_facts(cv))]
        if roof := roofline_rows(cv):
            out += [
                "<h3>Roofline</h3><p class='muted'>ceilings measured in the same process</p>",
                _table(ROOFLINE_HEADERS, roof),
            ]
        out.append(_notes(cv.bench.notes))
    if cv.error:
        e = cv.error
        out.append(
            f"<div class='error'><b>Error at {escape(str(e.get('stage', '?')))}:</b> "
            f"{escape(str(e.get('error', '')))}</div>"
        )
        if e.get("traceback"):
            out.append(f"<pre>{escape(str(e['traceback']))}</pre>")
    out.append("</details>")
    return "\n".join(o for o in out if o)


def _notes(notes: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{escape(str(n))}</li>" for n in notes) + "</ul>" if notes else ""


def _environment(view: RunView) -> str:
    cid, rows, differ = env_rows(view)
    out = "<h2>Benchmark environment</h2>"
    if cid is None:
        return out + "<p>No bench.json with an environment yet.</p>"
    out += f"<p class='muted'>As recorded by the benchmark of {escape(cid)}.</p>" + _kv(rows)
    if differ:
        out += f"<p>Differs between candidates: {escape(', '.join(differ))}</p>"
    return out
