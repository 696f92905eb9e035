"""How much verification and benchmark work one candidate stage does: `StageProfile`, its named
presets, and `StageSettings` (a run's settings at one fidelity, as the worker receives them).

    PROFILES[name]   full fidelity (rung 2) of `--profile full | quick`
    SCREEN[name]     the search's cheap first rung (rung 1) of the same profile
    PAIR[name]       one round of the side-by-side benchmark of the finalists (rung 3)

The sizes are part of a run's identity: run.json keeps them (`settings`, and the screen's under
`settings["fidelities"]["screen"]`), a resume with other sizes is refused, and every worker process
reads its stage's sizes back from there. They cross the process boundary as the same JSON keys the
dictionaries had, so run directories written before these types existed still read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["StageProfile", "StageSettings", "PROFILES", "SCREEN", "PAIR", "RUNGS", "base_fidelity"]

# The rung number a fidelity is recorded with (reverify repeats full fidelity: no rung).
RUNGS = {"screen": 1, "full": 2, "pair": 3}


def base_fidelity(fidelity: str) -> str:
    """The sizes a fidelity uses: a side-by-side round ("pair1", "tune2", ...) uses "pair"'s.

    >>> base_fidelity("pair2"), base_fidelity("tune1"), base_fidelity("screen")
    ('pair', 'pair', 'screen')
    """
    return "pair" if fidelity.startswith(("pair", "tune")) else fidelity


@dataclass(frozen=True)
class StageProfile:
    """Sizes of one fidelity's verification and benchmark work.

    `generation_prompts` is None where the verifier's own default applies (full fidelity); the
    screen sets 0, leaving greedy-match generation to full fidelity.
    """

    eval_windows: int  # LM: held-out windows scored for perplexity and KL
    window: int  # LM: tokens per window (capped at the model's context)
    sentences: int  # embeddings: sentences compared with the reference
    bench_sentences: int  # embeddings: sentences per benchmark repeat
    bench_repeats: int  # timed repeats (each after a warm-up)
    prompt_tokens: int  # LM benchmark prompt length
    new_tokens: int  # LM benchmark decode steps
    generation_prompts: int | None = None
    bench_batch_sizes: tuple[int, ...] = (1,)  # decode batch sizes (throughput vs concurrency)

    VERIFY_FIELDS = ("eval_windows", "window", "sentences", "generation_prompts")
    BENCH_FIELDS = (
        "bench_sentences",
        "bench_repeats",
        "prompt_tokens",
        "new_tokens",
        "bench_batch_sizes",
    )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form kept in run.json and search.json (an unset generation_prompts is left
        out, a tuple is written as a list)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StageProfile:
        """Read the JSON form back; unknown keys (the run's other settings) are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "bench_batch_sizes" in kw:
            kw["bench_batch_sizes"] = tuple(kw["bench_batch_sizes"])
        return cls(**kw)

    def fidelity_record(self, level: str, which: tuple[str, ...]) -> dict[str, Any]:
        """The `fidelity` field of a verify or bench result: the level, its rung, and the sizes
        that stage used (`which`: VERIFY_FIELDS or BENCH_FIELDS)."""
        d = self.to_dict()
        rung = RUNGS.get(base_fidelity(level))
        return {"level": level, "rung": rung, **{k: d[k] for k in which if k in d}}


PROFILES: dict[str, StageProfile] = {
    # The default. 3 repeats (each after a warm-up) keep a 15-minute search within budget.
    "full": StageProfile(
        eval_windows=16,
        window=512,
        sentences=2000,
        bench_sentences=512,
        bench_repeats=3,
        prompt_tokens=100,
        new_tokens=64,
        bench_batch_sizes=(1, 4),
    ),
    # Tests and smoke runs; still >= 1000 sentences for embeddings, so the cosine statistics
    # mean something.
    "quick": StageProfile(
        eval_windows=4,
        window=256,
        sentences=1000,
        bench_sentences=128,
        bench_repeats=3,
        prompt_tokens=64,
        new_tokens=32,
        bench_batch_sizes=(1,),
    ),
}

# Rung 1 of each profile: a quarter of the evaluation tokens or sentences, short benchmarks, no
# generation.
SCREEN: dict[str, StageProfile] = {
    "full": StageProfile(
        eval_windows=4,
        window=256,
        sentences=500,
        bench_sentences=128,
        bench_repeats=2,
        prompt_tokens=64,
        new_tokens=24,
        bench_batch_sizes=(1,),
        generation_prompts=0,
    ),
    "quick": StageProfile(
        eval_windows=2,
        window=128,
        sentences=250,
        bench_sentences=64,
        bench_repeats=2,
        prompt_tokens=32,
        new_tokens=12,
        bench_batch_sizes=(1,),
        generation_prompts=0,
    ),
}


# One side-by-side round: the finalists and the reference benchmarked one after the other, each
# once, at the full profile's batch sizes and prompt (so the objective reads the same metric) but
# with fewer decode steps; the rounds, mirrored, are the repeats (llmopt.optimize.loop).
PAIR: dict[str, StageProfile] = {
    "full": replace(PROFILES["full"], bench_repeats=1, new_tokens=32, bench_sentences=256),
    "quick": replace(PROFILES["quick"], bench_repeats=1, new_tokens=16, bench_sentences=64),
}


@dataclass(frozen=True)
class StageSettings:
    """What one worker stage needs from run.json's `settings`: the sizes of its fidelity, the
    quality budget, the gate preset and the threads."""

    sizes: StageProfile
    max_quality_drop: float
    gates: str = "default"  # runs written before `--gates` existed used the default preset
    threads: int | None = None
    fidelity: str = "full"

    @classmethod
    def for_run(
        cls, profile: str, max_quality_drop: float, gates: str, threads: int | None
    ) -> StageSettings:
        """Full-fidelity settings of a new run with `--profile profile`."""
        return cls(PROFILES[profile], max_quality_drop, gates, threads)

    def run_json(self, profile: str) -> dict[str, Any]:
        """run.json's `settings`: the full sizes flat, the run's knobs, and the screen's sizes
        under `fidelities` (part of the run's identity: a resume must not mix them)."""
        return {
            **self.sizes.to_dict(),
            "profile": profile,
            "max_quality_drop": self.max_quality_drop,
            "gates": self.gates,
            "threads": self.threads,
            "fidelities": {
                "screen": SCREEN[profile].to_dict(),
                "pair": PAIR[profile].to_dict(),
            },
        }

    @classmethod
    def from_run_json(cls, settings: dict[str, Any], fidelity: str = "full") -> StageSettings:
        """The settings a stage at `fidelity` runs with: run.json's, with that fidelity's sizes
        over the full ones ("reverify" has none of its own: full sizes)."""
        over = (settings.get("fidelities") or {}).get(base_fidelity(fidelity), {})
        sizes = StageProfile.from_dict({**settings, **over})
        return cls(
            sizes,
            float(settings["max_quality_drop"]),
            settings.get("gates", "default"),
            settings.get("threads"),
            fidelity,
        )
