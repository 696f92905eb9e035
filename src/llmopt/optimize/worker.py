"""One stage of one candidate, in its own process:
`python -m llmopt.optimize.worker RUN CANDIDATE STAGE [FIDELITY]`.

FIDELITY is "full" (default: the run's profile), "screen" (the search's cheap first rung: the
sizes in `settings["fidelities"]["screen"]`) or "reverify" (full sizes, separate files). The sizes
used are recorded in the result's `fidelity` field.

Why a process per stage: peak memory is then the candidate's own (not the sum of everything loaded
before it), a crash or an out-of-memory kill in one candidate cannot take the run down, and the
run directory stays the only channel between stages, which is what makes resuming exact.
The stage's JSON is written atomically at the very end; on failure `error.json` is written instead.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from llmopt.assets.text import (
    evaluation_sentences,
    evaluation_text,
    simlex999,
    token_windows,
    wordsim353,
)
from llmopt.bench.embedding import bench_embedding
from llmopt.bench.lm import bench_causal_lm
from llmopt.bench.lm_run import lm_roofline
from llmopt.bench.roofline import measure_ceilings
from llmopt.bench.timing import environment, machine_probe
from llmopt.core.atomic import TMP_PREFIX, atomic_dir, read_json, write_json
from llmopt.core.recipes import get_recipe
from llmopt.core.schema import BenchResult, Candidate
from llmopt.engines import get_engine, load_runner
from llmopt.hardware.runtime import peak_rss_bytes, rss_bytes
from llmopt.model.info import ModelInfo
from llmopt.optimize.profiles import StageProfile, StageSettings
from llmopt.optimize.served import bench_served, verify_served
from llmopt.rundir.paths import CandidateDir, RunDir
from llmopt.verify.embedding import (
    RetrievalSpec,
    reference_outputs,
    reference_side,
    verify_embedding,
)
from llmopt.verify.gates import Gates
from llmopt.verify.integrity import check_weights, raise_on_problems
from llmopt.verify.lm import ReferenceOutputs, verify_causal_lm

log = logging.getLogger("llmopt.optimize.worker")

# Seconds between releasing a benchmark's runner and the probe after it: longer than OpenMP's
# default spin-wait (200 ms), so the probe sees the machine, not the runner's idle threads.
PROBE_SETTLE_S = 0.3

__all__ = ["run_stage", "main"]


def _context(run: RunDir, cid: str):

    meta = read_json(run.run_json)
    info = ModelInfo.from_dict(read_json(run.model_json))
    cand = Candidate.from_dict(read_json(run.candidate(cid).stage_file("candidate")))
    return meta, info, cand, get_engine(cand.engine), get_recipe(cand.recipe)


def stage_settings(meta: dict[str, Any], fidelity: str) -> StageSettings:
    """The run's settings with the sizes of `fidelity` applied (full: the profile as is)."""
    return StageSettings.from_run_json(meta["settings"], fidelity)


def _reference_id(run: RunDir) -> str:
    plan = read_json(run.plan_json)
    return next(c["id"] for c in plan["candidates"] if c.get("reference"))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _log_progress(phase: str, done: int, total: int) -> None:
    """A long step's progress, as a line of the candidate's log (the parent's progress view
    shows a running stage's last log line)."""
    log.info("%s %d/%d", phase, done, total)


def build(run: RunDir, cid: str) -> dict[str, Any]:
    """The candidate's artifact. A calibrated recipe is quantized here first (`llmopt.quant`);
    the engine then takes in that checkpoint (engines only load checkpoints, never quantize)."""
    meta, info, cand, engine, recipe = _context(run, cid)
    cdir = run.candidate(cid)
    source = Path(meta["model_path"])
    t0 = time.perf_counter()
    with atomic_dir(cdir.artifact) as tmp:
        if recipe.calibrated:
            import tempfile

            from llmopt.quant import build_checkpoint  # heavy: torch

            # Beside the artifact (same filesystem): the engine hard-links the files it keeps.
            # Named like atomic_dir's temporaries, so a killed build's leftover is cleared by
            # the next build of this artifact.
            prefix = f"{TMP_PREFIX}{cdir.artifact.name}.quant-"
            with tempfile.TemporaryDirectory(dir=cdir.root, prefix=prefix) as q:
                facts = build_checkpoint(
                    source, recipe, Path(q) / "checkpoint", progress=_log_progress
                )
                facts.update(engine.build(Path(q) / "checkpoint", info, recipe, tmp))
        else:
            facts = engine.build(source, info, recipe, tmp)
    facts.update(seconds=time.perf_counter() - t0, artifact_bytes=_dir_bytes(cdir.artifact))
    return facts


def verify(run: RunDir, cid: str, fidelity: str = "full") -> dict[str, Any]:
    out = _verify(run, cid, fidelity)
    sizes = stage_settings(read_json(run.run_json), fidelity).sizes
    out["fidelity"] = sizes.fidelity_record(fidelity, StageProfile.VERIFY_FIELDS)
    return out


def _verify(run: RunDir, cid: str, fidelity: str) -> dict[str, Any]:

    meta, info, cand, engine, recipe = _context(run, cid)
    if engine.served:  # its own server process (vLLM): verified over HTTP
        return verify_served(run, cid, fidelity, _context)
    s = stage_settings(meta, fidelity)
    # Fail fast on a broken artifact (NaN/Inf weights, zero or missing quantization scales).
    raise_on_problems(check_weights(run.candidate(cid).artifact), cid)
    gates = Gates.preset(s.gates, max_quality_drop=s.max_quality_drop)
    runner = load_runner(engine.name, run.candidate(cid).artifact, info, recipe, cand.settings)
    if info.task == "embedding":
        return _verify_embedding(run, cid, cand, runner, s, gates, fidelity).to_dict()

    z = s.sizes
    window = min(z.window, info.max_context or z.window)  # never past the model's context
    windows = token_windows(runner.tokenizer, evaluation_text(), window, z.eval_windows)
    # Two greedy-match prompts unless the sizes say otherwise (the screen skips generation).
    prompts, new = (2 if z.generation_prompts is None else z.generation_prompts), 32
    # The reference's outputs on these windows are computed once per fidelity and kept beside it:
    # later candidates compare against the file instead of loading and running the reference.
    ref_id = _reference_id(run)
    cache = run.candidate(ref_id).root / f"reference-outputs.{fidelity}.npz"
    reference = None
    if not cand.reference:
        reference = ReferenceOutputs.load(cache, windows, prompts, new)
        if reference is None:
            _, _, rc, re, rr = _context(run, ref_id)
            ref_runner = load_runner(re.name, run.candidate(rc.id).artifact, info, rr, rc.settings)
            reference = ReferenceOutputs.from_runner(ref_runner, windows, prompts, new)
            reference.save(cache)
            del ref_runner
    return verify_causal_lm(
        cid,
        runner,
        windows,
        reference,
        s.max_quality_drop,
        gates=gates,
        generation_prompts=prompts,
        generation_tokens=new,
        keep_reference=cache if cand.reference else None,
    ).to_dict()


def _verify_embedding(
    run: RunDir, cid: str, cand: Candidate, runner, s: StageSettings, gates, fidelity: str
):
    import numpy as np

    sentences = evaluation_sentences(s.sizes.sentences)
    # The user's threshold, pairs, queries and corpus (`optimize --threshold ...`), if any, with
    # the model's own instruction prompts.
    info = ModelInfo.from_dict(read_json(run.model_json))
    options = read_json(run.run_json)["settings"].get("retrieval") or {}
    spec = RetrievalSpec.from_options(**options).with_prompts(info)
    # Reference outputs are computed once per fidelity and shared by every candidate.
    ref_file = run.reference / (
        "embeddings.npy" if fidelity == "full" else f"embeddings.{fidelity}.npy"
    )
    side_file = ref_file.with_name(ref_file.stem + ".retrieval.npz")
    ref_side = None
    if cand.reference:
        emb = reference_outputs(runner, sentences)
        run.reference.mkdir(parents=True, exist_ok=True)
        tmp = ref_file.with_name(f".tmp-{ref_file.name}")
        np.save(tmp, emb, allow_pickle=False)
        tmp.replace(ref_file)
        tmp = side_file.with_name(f".tmp-{side_file.name}")
        with open(tmp, "wb") as f:
            np.savez(f, **reference_side(runner, spec))
        tmp.replace(side_file)
        ref_emb, ref_spearman, scores = None, None, None
    else:
        ref_emb = np.load(ref_file, allow_pickle=False)
        with np.load(side_file, allow_pickle=False) as z:
            ref_side = {k: z[k] for k in z.files}
        ref_verify = run.candidate(_reference_id(run)).read("verify", fidelity)
        scores = {m["name"]: m["candidate"] for m in ref_verify["metrics"]}
        ref_spearman = scores["wordsim353_spearman"]
    return verify_embedding(
        cid,
        runner,
        sentences,
        ref_emb,
        wordsim353(),
        ref_spearman,
        1.0 - s.max_quality_drop,
        gates=gates,
        simlex_pairs=simlex999(),
        reference_scores=scores,
        retrieval=spec,
        reference_retrieval=ref_side,
    )


def bench(run: RunDir, cid: str, fidelity: str = "full") -> dict[str, Any]:

    meta, info, cand, engine, recipe = _context(run, cid)
    if engine.served:  # its own server process (vLLM): benchmarked with the load generator
        return bench_served(run, cid, fidelity, _context)
    z = stage_settings(meta, fidelity).sizes
    before = rss_bytes()
    t0 = time.perf_counter()
    runner = load_runner(engine.name, run.candidate(cid).artifact, info, recipe, cand.settings)
    load_s = time.perf_counter() - t0
    roofline: dict[str, Any] = {}
    probe_before = machine_probe()
    if info.task == "embedding":
        sentences = evaluation_sentences(z.sentences)[: z.bench_sentences]
        metrics, warm = bench_embedding(runner, sentences, repeats=z.bench_repeats)
        primary, settings = (
            "sentences_per_s_b32",
            {"sentences": len(sentences), "batch_sizes": [1, 32]},
        )
    else:
        import torch

        ids = runner.tokenizer(evaluation_text()[:20000], add_special_tokens=False)["input_ids"]
        ctx = info.max_context or 2048
        new = min(z.new_tokens, ctx // 2)
        prompt = torch.tensor([ids[: min(z.prompt_tokens, ctx - new)]], dtype=torch.long)
        batches = z.bench_batch_sizes
        metrics, warm = bench_causal_lm(runner, prompt, new, z.bench_repeats, batch_sizes=batches)
        primary = "decode_tokens_per_s"
        settings = {
            "batch": 1,
            "batch_sizes": list(batches),
            "prompt_tokens": prompt.shape[1],
            "new_tokens": new,
        }
    peak = peak_rss_bytes()  # before the ceilings below: their buffers are not the model's
    # The runner's own threads (ONNX Runtime's and OpenMP's pools) spin for a while after the
    # last inference; released, and given a moment, they no longer look like a neighbour.
    del runner
    gc.collect()
    time.sleep(PROBE_SETTLE_S)
    probe = {"before": probe_before, "after": machine_probe()}
    # The screen only ranks candidates and a side-by-side round only compares them: the
    # ceilings are measured with the full benchmark.
    if info.task == "causal-lm" and fidelity in ("full", "reverify"):
        # The machine's ceilings, measured in this process right after the phases, so each
        # phase's achieved bandwidth and FLOP/s read as a share of what the machine does now.
        ceilings = measure_ceilings(cand.settings.device)
        roofline = lm_roofline(metrics, info, recipe, prompt.shape[1], new, ceilings)
    settings.update(repeats=z.bench_repeats, threads=cand.settings.threads)
    return BenchResult(
        candidate_id=cid,
        task=info.task,
        metrics=metrics,
        primary=primary,
        peak_rss_bytes=peak,
        model_rss_bytes=max(0, peak - before),
        artifact_bytes=_dir_bytes(run.candidate(cid).artifact),
        load_seconds=load_s,
        warmup_seconds=warm,
        settings=settings,
        env={**environment(), "probe": probe},
        roofline=roofline,
        fidelity=z.fidelity_record(fidelity, StageProfile.BENCH_FIELDS),
    ).to_dict()


STAGE_FUNCS = {"build": build, "verify": verify, "bench": bench}


def run_stage(run: RunDir, cid: str, stage: str, fidelity: str = "full") -> None:
    """Run `stage` at `fidelity` for candidate `cid` in this process and write its JSON (or error.json)."""
    cdir: CandidateDir = run.candidate(cid)
    err = cdir.stage_file("error")
    err.unlink(missing_ok=True)
    try:
        args = (run, cid) if stage == "build" else (run, cid, fidelity)
        result = STAGE_FUNCS[stage](*args)
    except Exception as e:
        log.exception("%s of %s failed", stage, cid)
        write_json(
            err,
            {
                "stage": stage,
                "fidelity": fidelity,
                "error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
                "traceback": traceback.format_exc(),
            },
        )
        raise SystemExit(1) from None
    write_json(cdir.stage_file(stage, fidelity), result)


def _die_with_parent() -> None:
    """End this stage when the run that started it ends, however it ends.

    A SIGTERM becomes SystemExit, so `with` blocks unwind (temporary folders removed, a vLLM
    server stopped) and no result or error file is written: a resumed run does the stage again.
    On Linux the kernel also sends SIGTERM when the parent dies (PR_SET_PDEATHSIG), so killing
    `llmopt optimize` (a job scheduler's timeout, `kill PID`) does not leave a stage running on.
    """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if sys.platform.startswith("linux"):
        import ctypes  # lazy: Linux only

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        parent = os.environ.get(PARENT_ENV)
        if parent and os.getppid() != int(parent):  # it died before prctl took effect
            sys.exit(128 + signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "LLMOPT_STAGE_PARENT"  # the pid that started the stage (`executor._spawn`)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    assert len(argv) in (3, 4), (
        "usage: python -m llmopt.optimize.worker RUN_DIR CANDIDATE_ID STAGE [FIDELITY]"
    )
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Per-tensor loading bars from transformers would flood log.txt; the parent shows progress.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    run_stage(RunDir(argv[0]), argv[1], argv[2], argv[3] if len(argv) == 4 else "full")


if __name__ == "__main__":
    main()
