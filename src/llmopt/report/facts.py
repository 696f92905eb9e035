"""What the report says, as plain text: summary line and table rows.

Both renderers lay these out (Markdown escapes them for Markdown, HTML for HTML), so the two
reports cannot disagree.
"""

from __future__ import annotations

from llmopt.report.view import (
    QUALITY_ORDER,
    SPEED_ORDER,
    CandidateView,
    Ratio,
    RunView,
    fmt_bytes,
    fmt_num,
    fmt_pct,
    fmt_value,
    fmt_x,
    order_names,
)

__all__ = [
    "ENGINE_HEADERS",
    "engine_rows",
    "BENCH_HEADERS",
    "ROOFLINE_HEADERS",
    "VERIFY_HEADERS",
    "bench_facts",
    "bench_rows",
    "candidate_cells",
    "candidate_headers",
    "env_rows",
    "model_rows",
    "plan_rows",
    "roofline_rows",
    "summary_line",
    "verify_rows",
]

VERIFY_HEADERS = ["metric", "reference", "candidate", "delta", "threshold", "gate", "n", "unit"]
BENCH_HEADERS = ["metric", "median", "p50", "p90", "p99", "min", "max", "n", "unit"]
ROOFLINE_HEADERS = [
    "phase",
    "achieved GB/s",
    "share of copy bandwidth",
    "achieved GFLOP/s",
    "share of matmul peak",
    "verdict",
    "what it implies",
]


def summary_line(view: RunView) -> str:
    """One sentence: the chosen candidate with its speedup and quality drop, or why none was.

    Args:
        view: the loaded run.
    """
    budget = f"budget {fmt_pct(view.max_quality_drop)}"
    if view.selection is None:
        return f"No selection yet (selection.json missing); {len(view.candidates)} candidates."
    chosen = view.chosen
    if view.selection.chosen and chosen is None:
        return (
            f"Chosen: {view.selection.chosen}, but candidates/{view.selection.chosen}/ is missing."
        )
    if chosen is None:
        return f"No candidate was chosen: none passed the quality gates within the {budget}."
    drop = fmt_pct(chosen.verify.quality_drop) if chosen.verify else "n/a"
    speed = fmt_num(view.speed(chosen))
    sel = view.selection
    value = sel.objective_values.get(chosen.id) if sel.objective_values else None
    obj = ""
    if value is not None and sel.objective != "throughput":
        shown = fmt_bytes(value) if sel.objective_unit == "bytes" else fmt_num(value)
        obj = f"best {sel.objective} ({shown} {sel.objective_unit}); ".replace(" bytes)", ")")
    # The ratio the selection decided on (side by side with the reference where it was: one
    # time window, not two numbers taken minutes apart), the same number the candidates table
    # shows in the chosen row.
    r = view.objective_ratio(chosen)
    if r is None or r.basis == "reference":
        lead = f"{view.primary_metric} {speed}, "
    elif r.within_noise:
        which = "confirmed" if r.unconfirmed else "measurable"
        lead = (
            f"no {which} {r.metric} difference from the reference ({_how(r)}); "
            f"{_why_within_noise(view, chosen, r)}; {view.primary_metric} {speed}, "
        )
    elif r.basis == "side by side":
        lead = (
            f"{fmt_x(r.value)} the reference's {r.metric} measured side by side "
            f"({r.rounds} round{'s' if r.rounds != 1 else ''}, {r.lo:.2f}-{r.hi:.2f}x); "
            f"{view.primary_metric} {speed}, "
        )
    else:
        lead = f"{fmt_x(r.value)} the reference's {r.metric} ({_how(r)}; {speed}), "
    return (
        f"Chosen: {chosen.id} ({chosen.recipe} on {chosen.engine}): {obj}{lead}"
        f"quality drop {drop} ({budget})."
    )


def _how(r: Ratio) -> str:
    """How a ratio was measured, with what puts it within noise."""
    if r.basis == "side by side":
        n = f"{r.rounds} round{'s' if r.rounds != 1 else ''}"
        return f"{fmt_x(r.value)} side by side, {n} spanning {r.lo:.2f}-{r.hi:.2f}x"
    if r.unconfirmed:
        return (
            f"{fmt_x(r.value)} in separate runs, not confirmed side by side: the machine's load "
            "changed during every round"
        )
    if r.within_noise and r.noise is not None:
        return f"{fmt_x(r.value)} in separate runs, within their run-to-run spread of {fmt_pct(r.noise)}"
    return f"{r.basis}"


def _why_within_noise(view: RunView, cv: CandidateView, r: Ratio) -> str:
    """Why the chosen candidate won when its speed cannot be told from the reference's: the
    separate runs' numbers it was ranked on (not confirmed side by side), and what else it
    offers (less memory, a smaller artifact), or only a higher median (said as such)."""
    better = []
    rss, art = view.memory_ratio(cv), view.memory_ratio(cv, "artifact_bytes")
    if rss is not None and rss < 0.95:
        better.append(f"its smaller peak memory ({fmt_x(rss)} the reference's)")
    if art is not None and art < 0.95:
        better.append(f"its smaller artifact ({fmt_x(art)} the reference's)")
    if r.unconfirmed:
        also = f", and it has {' and '.join(better)}" if better else ""
        return f"chosen on the separate runs' numbers{also}"
    return "chosen for " + (" and ".join(better) or "its higher median, a difference within noise")


def candidate_headers(view: RunView) -> list[str]:
    """Column names of the candidates table (`candidate_cells` fills them).

    Args:
        view: the loaded run.
    """
    q, p = view.quality_metric or "quality", view.primary_metric or "speed"
    return [
        "candidate",
        "engine",
        "recipe",
        f"{q} (delta)",
        "quality drop",
        "gate",
        f"{p} median (p90)",
        f"{view.objective} vs reference",
        "peak RSS (vs ref)",
        "artifact",
        "status",
    ]


def candidate_cells(view: RunView, cv: CandidateView) -> list[str]:
    """The candidates-table row of `cv` as plain strings.

    Args:
        view: the loaded run.
        cv: one candidate of `view`.
    """
    quality = drop = gate = "n/a"
    if cv.verify is not None:
        metric = next((m for m in cv.verify.metrics if m.name == view.quality_metric), None)
        if metric is not None:
            quality = f"{fmt_num(metric.candidate)} ({fmt_num(metric.delta, sign=True)})"
        drop = fmt_pct(cv.verify.quality_drop)
        gate = "pass" if cv.verify.passed else "FAIL"
    speed = speedup = rss = artifact = "n/a"
    if cv.bench is not None:
        st = cv.bench.metrics.get(view.primary_metric or "")
        if st is not None:
            speed = f"{fmt_num(st.median)} ({fmt_num(st.p90)})"
        rss = f"{fmt_bytes(cv.bench.peak_rss_bytes)} ({fmt_x(view.memory_ratio(cv))})"
        artifact = fmt_bytes(cv.bench.artifact_bytes)
    elif cv.build and "artifact_bytes" in cv.build:
        artifact = fmt_bytes(cv.build["artifact_bytes"])
    # The ratio the selection used, labelled with how it was measured (side by side, separate
    # runs, screen): the chosen row's number is the headline's.
    if (r := view.objective_ratio(cv)) is not None:
        speedup = r.cell
    cid = cv.id + (" (reference)" if cv.reference else "")
    return [
        cid,
        cv.engine,
        cv.recipe,
        quality,
        drop,
        gate,
        speed,
        speedup,
        rss,
        artifact,
        view.status(cv).text,
    ]


ENGINE_HEADERS = [
    "engine",
    "its best candidate",
    "quality drop",
    "gate",
    "speed median",
    "objective vs reference",
    "peak RSS",
    "artifact",
    "verdict",
]


def engine_rows(view: RunView) -> list[list[str]]:
    """One row per engine: its fastest candidate that passed the gates (else its best
    measured one), and why the engine was chosen, kept or dropped. Columns as `ENGINE_HEADERS`.

    Args:
        view: the loaded run.
    """
    rows = []
    for engine in dict.fromkeys(cv.engine for cv in view.candidates):
        own = [cv for cv in view.candidates if cv.engine == engine]
        passed = [cv for cv in own if cv.verify is not None and cv.verify.passed]
        measured = [cv for cv in (passed or own) if view.speed(cv) is not None]
        best = max(measured, key=lambda cv: view.speed(cv) or 0.0) if measured else None
        if best is None:
            status = {view.status(cv).text for cv in own}
            rows.append(
                [
                    engine,
                    "none measured",
                    "n/a",
                    "n/a",
                    "n/a",
                    "n/a",
                    "n/a",
                    "n/a",
                    "; ".join(sorted(status)),
                ]
            )
            continue
        cells = dict(zip(candidate_headers(view), candidate_cells(view, best), strict=True))
        st = view.status(best)
        if not passed:
            verdict = "dropped: no candidate of this engine passed the quality gates"
        else:  # the selection's own words: the ratio it states is on the objective it used
            verdict = st.text
        rows.append(
            [
                engine,
                best.id,
                cells["quality drop"],
                cells["gate"],
                cells[next(h for h in cells if h.endswith("median (p90)"))],
                cells[f"{view.objective} vs reference"],
                cells["peak RSS (vs ref)"],
                cells["artifact"],
                verdict,
            ]
        )
    return rows


def verify_rows(cv: CandidateView) -> list[list[str]]:
    """One row per verify metric (known names first), columns as `VERIFY_HEADERS`.

    Args:
        cv: one candidate; no rows without verify.json.
    """
    by_name = {m.name: m for m in (cv.verify.metrics if cv.verify else [])}
    rows = []
    for name in order_names(list(by_name), QUALITY_ORDER):
        m = by_name[name]
        gate = {True: "pass", False: "FAIL", None: "report only"}[m.passed]
        rows.append(
            [
                name,
                fmt_num(m.reference),
                fmt_num(m.candidate),
                fmt_num(m.delta, sign=True),
                fmt_num(m.threshold),
                gate,
                fmt_num(m.n),
                m.unit,
            ]
        )
    return rows


def bench_rows(cv: CandidateView) -> list[list[str]]:
    """One row per bench metric (known names first, primary marked), columns as `BENCH_HEADERS`.

    Args:
        cv: one candidate; no rows without bench.json.
    """
    if cv.bench is None:
        return []
    rows = []
    for name in order_names(list(cv.bench.metrics), SPEED_ORDER):
        s = cv.bench.metrics[name]
        nums = [fmt_num(x) for x in (s.median, s.p50, s.p90, s.p99, s.min, s.max, s.n)]
        rows.append([name + (" (primary)" if name == cv.bench.primary else ""), *nums, s.unit])
    return rows


def roofline_rows(cv: CandidateView) -> list[list[str]]:
    """One row per benchmarked phase with its roofline verdict (bench.json `roofline.phases`).

    Args:
        cv: one candidate; no rows without a roofline (embedding runs, older runs).
    """
    phases = (getattr(cv.bench, "roofline", None) or {}).get("phases", []) if cv.bench else []
    return [
        [
            str(p.get("phase", p.get("metric", "?"))),
            fmt_num(p["achieved_bytes_per_s"] / 1e9),
            fmt_pct(p["bandwidth_share"]),
            fmt_num(p["achieved_flops_per_s"] / 1e9),
            fmt_pct(p["flops_share"]),
            str(p["verdict"]),
            str(p.get("implication", "")),
        ]
        for p in phases
    ]


def bench_facts(cv: CandidateView) -> list[list[str]]:
    """(fact, value) rows of a bench result besides its metrics: memory, load time, settings.

    Args:
        cv: one candidate; no rows without bench.json.
    """
    b = cv.bench
    if b is None:
        return []
    keys = ("peak_rss_bytes", "model_rss_bytes", "artifact_bytes", "load_seconds", "warmup_seconds")
    rows = [[k, fmt_value(k, getattr(b, k))] for k in keys]
    return rows + [["settings", fmt_value("", b.settings)]]


def env_rows(view: RunView) -> tuple[str | None, list[list[str]], list[str]]:
    """The bench environment: (candidate it came from, (key, value) rows, keys that differ).

    Args:
        view: the loaded run.
    """
    envs = [(cv.id, cv.bench.env) for cv in view.candidates if cv.bench and cv.bench.env]
    if not envs:
        return None, [], []
    cid, env = envs[0]
    differ = sorted({k for _, e in envs[1:] for k in set(e) | set(env) if e.get(k) != env.get(k)})
    return cid, [[k, fmt_value(k, v)] for k, v in env.items()], differ


def model_rows(view: RunView) -> list[list[str]]:
    """(fact, value) rows of model.json, sizes and counts made readable.

    Args:
        view: the loaded run.
    """
    rows = []
    for k, v in view.model.items():
        if k == "num_parameters" and isinstance(v, int):
            rows.append([k, f"{v / 1e6:,.1f} M ({v:,})"])
        elif k == "weight_files" and isinstance(v, list):
            rows.append(
                [
                    k,
                    f"{len(v)} file(s): {', '.join(map(str, v[:4]))}"
                    + (" ..." if len(v) > 4 else ""),
                ]
            )
        elif k == "kv_bytes_per_token" and isinstance(v, dict):
            rows.append([k, ", ".join(f"{d}: {fmt_bytes(b)}" for d, b in v.items())])
        else:
            rows.append([k, fmt_value(k, v)])
    return rows


def plan_rows(view: RunView) -> list[list[str]]:
    """(fact, value) rows of the plan: target, workload and the memory math.

    Args:
        view: the loaded run.
    """
    plan = view.plan or {}
    rows = [[f"target.{k}", fmt_value(k, v)] for k, v in (plan.get("target") or {}).items()]
    rows += [[f"workload.{k}", fmt_value(k, v)] for k, v in (plan.get("workload") or {}).items()]
    mem = plan.get("memory") or {}
    total = (plan.get("target") or {}).get("memory_bytes")
    for dtype, b in (mem.get("weights_bytes") or {}).items():
        share = (
            f" ({b / total:.1%} of target memory)" if total and isinstance(b, int | float) else ""
        )
        rows.append([f"weights in {dtype}", fmt_bytes(b) + share])
    for dtype, b in (mem.get("kv_bytes_per_token") or {}).items():
        rows.append([f"KV cache per token in {dtype}", fmt_bytes(b)])
    for k, v in mem.items():
        if k not in ("weights_bytes", "kv_bytes_per_token", "notes"):
            rows.append([f"memory.{k}", fmt_value(k, v)])
    return rows
