"""Rich rendering of results for people (the `--json` paths bypass this module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmopt.report.facts import summary_line
from llmopt.report.view import load_run

if TYPE_CHECKING:
    from llmopt.model.info import ModelInfo
    from llmopt.optimize.job import OptimizeResult

console = Console(stderr=False)
# Errors go to stderr, so `--json > facts.json` never holds an error message instead of JSON.
err_console = Console(stderr=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def render_inspect(info: ModelInfo) -> None:
    t = Table(title=f"{info.name}  ({info.path})", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    rows = [
        ("task", info.task),
        ("architecture", info.architecture),
        ("model type", info.model_type),
        ("parameters", f"{info.num_parameters:,} ({info.num_parameters / 1e6:.1f} M)"),
        ("layers", info.num_layers),
        ("hidden size", info.hidden_size),
        ("attention heads", info.num_heads),
        ("KV heads", info.num_kv_heads),
        ("head dim", info.head_dim),
        ("intermediate size", info.intermediate_size),
        ("vocab", info.vocab_size),
        ("max context", info.max_context),
        ("dtype (config / stored)", f"{info.dtype} / {info.weights_dtype}"),
        (
            "on disk",
            f"{human_bytes(info.bytes_on_disk)} in {len(info.weight_files)} {info.weight_format} file(s)",
        ),
        ("tied embeddings", info.tied_embeddings),
    ]
    if info.task == "embedding":
        rows.append(("pooling", f"{info.pooling}{', normalized' if info.normalize else ''}"))
    else:
        rows.append(("attention", info.attention_pattern))
    for dt, b in info.kv_bytes_per_token.items():
        note = ""
        if info.sliding_layers and info.sliding_window:
            note = (
                f" (every layer at full length; sliding ones stop at {info.sliding_window} tokens)"
            )
        rows.append((f"KV cache / token ({dt})", human_bytes(b) + note))
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)


def render_selection(res: OptimizeResult) -> None:
    """The final table: each candidate, the ratio to the reference the selection used
    (labelled side by side / separate runs / screen, as in the report) and its verdict; then
    the report's headline, so the terminal and the report say the same thing."""
    sel = res.selection
    view = load_run(res.run_dir)
    t = Table(title=f"selection ({sel.objective}, max quality drop {sel.max_quality_drop:.2%})")
    t.add_column("candidate", overflow="fold")
    t.add_column(f"{sel.objective} vs reference", overflow="fold")
    t.add_column("verdict", overflow="fold")
    for cid, why in sel.reasons.items():
        style = (
            "green"
            if cid == sel.chosen
            else ("red" if why.startswith(("failed", "dropped")) else "")
        )
        cv = view.get(cid)
        r = view.objective_ratio(cv) if cv is not None else None
        t.add_row(
            f"[{style}]{escape(cid)}[/]" if style else escape(cid),
            r.cell if r else "n/a",
            escape(why),
        )
    console.print(t)
    if res.resumed:
        console.print(
            f"resumed: {len(res.skipped)} finished stage(s) reused, {len(res.ran)} run now"
        )
    srch = res.search or {}
    if srch:
        b = srch.get("budget") or {}
        limit = f" of {b['seconds']:.0f} s budget" if b.get("seconds") else ""
        ex = srch.get("executor") or {}
        console.print(
            f"search: {srch.get('search')} for {srch.get('objective')}, "
            f"{len(srch.get('cut') or {})} cut, {b.get('elapsed_s', 0):.0f} s{limit}, "
            f"on {ex.get('executor', 'local')} (x{ex.get('parallel', 1)})"
        )
        for e in srch.get("events") or []:
            console.print(f"  {e}")
    console.print(
        f"chosen: [bold]{sel.chosen or 'none'}[/]"
        + (f"  (artifact in {res.run_dir / 'best'})" if sel.chosen else "")
    )
    console.print(escape(summary_line(view)), highlight=False)
    console.print(f"report: [bold]{res.report_html}[/]\n        {res.report_md}")


def render_reverify(res: dict) -> None:
    style = "green" if res["holds"] else "red"
    console.print(f"[{style}]{res['verdict']}[/]", highlight=False)
    for k, (a, b) in (res.get("versions_changed") or {}).items():
        console.print(f"  {k}: {a} -> {b}")
    console.print(
        f"recorded in reverify.json; chosen {res['chosen']}, reference {res['reference']}"
    )
