"""Rich rendering of doctor reports, serving plans and deploy results (--json bypasses this)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from llmopt.cli.render import console, human_bytes

if TYPE_CHECKING:
    from llmopt.deploy import DeployResult
    from llmopt.doctor import DoctorReport
    from llmopt.model.info import ModelInfo
    from llmopt.optimize.space import Plan
    from llmopt.planning.serving import ServingPlan

__all__ = ["render_doctor", "render_serving", "render_plan", "render_deploy"]

_STYLE = {
    "ok": "green",
    "warn": "yellow",
    "fail": "bold red",
    "passed": "green",
    "failed": "bold red",
    "skipped": "dim",
}


def _status(s: str) -> str:
    return f"[{_STYLE.get(s, '')}]{s}[/]"


def render_doctor(report: DoctorReport) -> None:
    t = Table(title=f"llmopt doctor (target {report.target})", show_lines=True)
    for col in ("status", "check", "evidence", "fix"):
        t.add_column(col, overflow="fold")
    for f in report.findings:
        t.add_row(_status(f.status), f.title, escape(f.evidence), escape(f.fix or ""))
    console.print(t)
    for f in report.findings:
        causes = (
            f.details.get("likely_causes") if f.status != "ok" or f.id == "gpu.driver" else None
        )
        if not causes or report.gpus:
            continue
        console.print("[bold]Why no NVIDIA driver answered (most likely first):[/]")
        for i, c in enumerate(causes, 1):
            console.print(f"  {i}. {escape(c['cause'])}\n     evidence: {escape(c['evidence'])}")
            console.print(
                "     confirm: " + "\n              ".join(escape(x) for x in c["confirm"])
            )
            console.print(f"     fix: {escape(c['fix'])}")
    if report.compat:
        ct = Table(title="compute capability -> precisions and engines")
        for col in ("GPU", "cc", "bf16", "fp8", "fp4", "engines"):
            ct.add_column(col)
        for row in report.compat:
            d = row["dtypes"]
            eng = ", ".join(f"{k}: {v}" for k, v in row["engines"].items())
            ct.add_row(
                str(row["gpu"]),
                row["compute_capability"],
                ("yes" if d["bfloat16"] else "no"),
                ("yes" if d["fp8"] else "no"),
                ("yes" if d["fp4"] else "no"),
                eng,
            )
        console.print(ct)
    c = report.counts()
    console.print(
        f"{c['ok']} ok, {c['warn']} warn, {c['fail']} fail -> exit code {report.exit_code}"
    )


def _param_source(info: ModelInfo, source: str, params: float | None) -> str:
    if params:
        return "--params"
    if source == "config":
        return "estimated from config.json"
    return f"counted in the {info.weight_format} weight headers"


def render_serving(plan: ServingPlan, sources: dict[str, str] | None = None) -> None:
    """The serving plan: memory per GPU, layout, engine, launch commands. `sources` adds a
    column saying where each memory figure comes from."""
    m, t = plan.memory, plan.target
    dev = "GPU" if t.kind == "gpu" else "device"  # a CPU target's one device is its RAM
    if not sources:  # `llmopt plan` names the target (and its source) once, above
        console.print(
            f"\n[bold]serving plan[/] on {t.count} x {escape(t.name)} ({human_bytes(m.gpu_memory_bytes)} each; {escape(t.source)})"
        )
    mt = Table(show_header=bool(sources), title=f"memory per {dev} (one replica)")
    mt.add_column("item", style="bold")
    mt.add_column("value")
    if sources:
        mt.add_column("from", style="dim")
    rows = [
        (
            "layout",
            f"tensor parallel {m.tp} x pipeline parallel {m.pp}, {plan.replicas} replica(s)"
            + ("" if plan.fits else "  [bold red]does not fit[/]"),
        ),
        (
            "usable",
            f"{human_bytes(m.usable_bytes)} ({m.utilization:.0%} of {human_bytes(m.gpu_memory_bytes)})",
        ),
        (
            "weights",
            f"{m.precision}: {human_bytes(m.weights_total_bytes)} total, {human_bytes(m.weights_per_gpu_bytes)} per {dev}",
        ),
        (
            "reserve",
            f"{human_bytes(m.reserve_bytes)} = runtime {human_bytes(m.runtime_bytes)} + activations "
            f"{human_bytes(m.activation_bytes)} + logits {human_bytes(m.logits_bytes)}",
        ),
        (
            "KV cache",
            f"{m.kv_dtype}: {m.kv_bytes_per_token:,} B/token ({m.kv_bytes_per_token_per_gpu:,} per {dev}); "
            f"budget {human_bytes(m.kv_budget_bytes)} = {m.kv_tokens:,} tokens",
        ),
        (
            "sequences",
            f"{m.sequences_at(plan.max_model_len):,} at max-model-len {plan.max_model_len:,}; "
            f"{m.sequences_at(plan.workload.input_len + plan.workload.output_len):,} at "
            f"{plan.workload.input_len}+{plan.workload.output_len} tokens",
        ),
    ]
    if plan.estimates:
        e = plan.estimates
        rows.append(
            (
                "decode (batch 1)",
                f"ceiling {e['decode_tokens_per_s_ceiling']} tok/s "
                f"(TPOT >= {e['tpot_floor_ms']} ms), expected ~{e['tpot_expected_ms']} ms",
            )
        )
    for k, v in rows:
        mt.add_row(k, v, *([escape(sources.get(k, ""))] if sources else []))
    console.print(mt)
    console.print(f"[bold]engine[/] {plan.engine}: {escape(plan.engine_reason)}")
    for a in plan.alternatives:
        console.print(f"  alternative {a['engine']}: {escape(a['why'])}")
    for n in plan.notes:
        console.print(f"  note: {escape(n)}")
    for name, cfg in plan.launch.items():
        console.print(f"[bold]{name}[/]: {escape(cfg.command)}")
        for n in cfg.notes:
            console.print(f"  [dim]{escape(n)}[/]")


def render_plan(
    info: ModelInfo, source: str, params: float | None, opt: Plan, serving: ServingPlan
) -> None:
    """`llmopt plan`: one plan, built from one `Target` and one memory math
    (`llmopt.planning.memory.memory_plan`), each figure with where it comes from."""
    t, m = serving.target, serving.memory
    what = {
        "config": "config.json alone (no weights read)",
        "weights": "config.json and the weight headers",
    }
    console.print(
        f"[bold]plan[/] for {escape(info.name)}: {info.num_parameters:,} parameters "
        f"({escape(_param_source(info, source, params))}); sizes from {what[source]}"
    )
    host = f", {t.threads} threads" if t.threads else ""
    feats = f", features {' '.join(t.features)}" if t.features else ""
    console.print(
        f"[bold]target[/] {t.count} x {escape(t.name)}, {human_bytes(t.memory_bytes)} per device"
        f"{host}{feats} [dim]source: {escape(t.source or 'the command line')}[/]"
    )
    kv_src = "layers x KV heads x head_dim x 2 (K, V) x bytes per element, from the config"
    sources = {
        "layout": "smallest tensor x pipeline split whose KV cache holds the workload",
        "usable": "--gpu-memory-utilization (default 0.90 GPU, 0.80 CPU RAM) x the target memory",
        "weights": f"parameters x bytes per {m.precision} weight (quantized: 16-bit embeddings)",
        "reserve": "1 GiB runtime (+ NCCL across GPUs), activations of one scheduler step, "
        "fp32 logits of max-num-seqs",
        "KV cache": kv_src,
        "sequences": "KV tokens / sequence length",
        "decode (batch 1)": (serving.estimates or {}).get("basis", ""),
    }
    render_serving(serving, sources)
    t2 = Table(title="candidates `llmopt optimize` would build and measure on this target")
    for col in ("id", "engine", "recipe", "status"):
        t2.add_column(col)
    for c in opt.candidates:
        t2.add_row(c.id, c.engine, c.recipe, "reference" if c.reference else "planned")
    for s in opt.skipped:
        t2.add_row(s["id"], s["engine"], s["recipe"], f"[dim]skipped: {escape(s['reason'])}[/]")
    console.print(t2)
    for n in opt.notes:
        console.print(f"  note: {escape(n)}")


def render_deploy(res: DeployResult) -> None:
    if hasattr(res.plan, "served_by"):  # an embedder bundle (llmopt.deploy.embedder)
        p = res.plan
        thr = (p.threshold or {}).get("threshold")
        console.print(
            f"embedder {p.model['name']}: served by {p.served_by} on {p.target.name}"
            + (f"; similarity threshold {thr:.4g}" if thr is not None else ""),
            highlight=False,
        )
    else:
        render_serving(res.plan)
    t = Table(title=f"bundle {res.out} validation")
    for col in ("check", "status", "tool", "detail"):
        t.add_column(col, overflow="fold")
    for c in res.checks:
        t.add_row(c.name, _status(c.status), c.tool, escape(c.detail[:400]))
    console.print(t)
    console.print(f"files: {', '.join(res.files)}")
    console.print(f"next: cd {res.out} && docker compose up -d --build   (README.md says more)")
