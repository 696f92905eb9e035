"""Print a Markdown table of every candidate in one or more run directories (for docs/benchmarks.md).

    python benchmarks/summarize_runs.py runs/smollm2-135m runs/minilm-l6

Numbers are read from the run directories as written by `llmopt optimize`; nothing is re-measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(p: Path) -> dict | None:
    return json.loads(p.read_text()) if p.exists() else None


def summarize(run: Path) -> str:
    meta = json.loads((run / "run.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    sel = _load(run / "selection.json") or {}
    rows = [
        f"### {meta['model']} ({meta['settings']['profile']} profile, target {meta['target']})",
        "",
    ]
    env = None
    header = None
    for c in plan["candidates"]:
        d = run / "candidates" / c["id"]
        v, b = _load(d / "verify.json"), _load(d / "bench.json")
        if v is None or b is None:
            rows.append(f"| {c['id']} | incomplete | | | | |")
            continue
        env = env or b["env"]
        q = {m["name"]: m for m in v["metrics"]}
        if header is None:
            names = [
                n
                for n in (
                    "perplexity",
                    "top1_agreement",
                    "kl_divergence_mean",
                    "cosine_mean",
                    "cosine_min",
                    "wordsim353_spearman",
                )
                if n in q
            ]
            speeds = list(b["metrics"])
            header = names, speeds
            rows.append(
                "| candidate | "
                + " | ".join(names + [f"{s} (median [min-max])" for s in speeds])
                + " | peak RSS MiB | artifact MiB | gate | selection |"
            )
            rows.append("|" + " --- |" * (len(names) + len(speeds) + 5))
        names, speeds = header
        cells = [f"{q[n]['candidate']:.4f}" for n in names]
        cells += [
            f"{b['metrics'][s]['median']:.1f} [{b['metrics'][s]['min']:.1f}-{b['metrics'][s]['max']:.1f}]"
            for s in speeds
        ]
        verdict = sel.get("reasons", {}).get(c["id"], "")
        rows.append(
            f"| {c['id']} | " + " | ".join(cells) + f" | {b['peak_rss_bytes'] / 2**20:.0f} | "
            f"{b['artifact_bytes'] / 2**20:.0f} | {'pass' if v['passed'] else 'FAIL'} | {verdict} |"
        )
    if env:
        rows += [
            "",
            f"Machine: {env.get('cpu')}, {env.get('cpu_count')} CPUs, torch {env.get('torch')} "
            f"({env.get('torch_threads')} threads), transformers {env.get('transformers')}. "
            f"Run created {meta['created']}. Command: `{meta['command']}`.",
        ]
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(summarize(Path(p)) for p in sys.argv[1:]))
