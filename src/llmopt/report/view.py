"""A run directory read into one object the renderers share: `load_run(run_dir) -> RunView`.

The view only reads. A run in progress or a failed candidate leaves files missing; the view records
what is absent (or unreadable) instead of raising, so a report can always be rendered.
Derived facts (speedup, memory vs reference, status) live here so Markdown and HTML agree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.core.atomic import TMP_PREFIX, read_json
from llmopt.core.schema import BenchResult, Candidate, Selection, VerifyResult

__all__ = [
    "QUALITY_ORDER",
    "SPEED_ORDER",
    "CandidateView",
    "Ratio",
    "RunView",
    "Status",
    "fmt_bytes",
    "fmt_num",
    "fmt_pct",
    "fmt_value",
    "fmt_x",
    "load_run",
    "order_names",
]

# Known metric names render first, in this order; any other name follows in the order found.
QUALITY_ORDER = (
    "perplexity",
    "top1_agreement",
    "kl_divergence_mean",
    "cosine_mean",
    "cosine_p1",
    "cosine_min",
    "wordsim353_spearman",
)
SPEED_ORDER = (
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "sentences_per_s_b32",
    "sentences_per_s_b1",
)
# The quality metric shown in the candidates table, by task.
MAIN_QUALITY = {"causal-lm": "perplexity", "embedding": "cosine_mean"}
_CANDIDATE_FILES = ("candidate.json", "build.json", "verify.json", "bench.json")


def order_names(names: list[str], known: tuple[str, ...]) -> list[str]:
    """`names` with those in `known` first (in `known`'s order), then the rest as found.

    Args:
        names: metric names as they appear in a result.
        known: preferred order.

    >>> order_names(["b", "perplexity", "a"], QUALITY_ORDER)
    ['perplexity', 'b', 'a']
    """
    first = [k for k in known if k in names]
    return first + [n for n in dict.fromkeys(names) if n not in known]


@dataclass
class Status:
    """Where a candidate ended: label is chosen/kept/dropped/failed at <stage>/incomplete."""

    kind: str  # "chosen" | "kept" | "dropped" | "cut" | "failed" | "incomplete": drives colours
    label: str
    reason: str = ""

    @property
    def text(self) -> str:
        if not self.reason or self.reason.startswith(f"{self.label}:"):  # selection's own wording
            return self.reason or self.label
        return f"{self.label}: {self.reason}"


@dataclass(frozen=True)
class Ratio:
    """A candidate's objective relative to the reference's (higher is better), and how it was
    measured: the number the selection decided on, so every table and the headline quote it.

    Attributes:
        value: the ratio (2.0: twice as good as the reference on `metric`).
        basis: "reference" (the reference itself), "side by side" (the finalists' mirrored
            rounds, one time window), "separate runs" (two full-fidelity benchmarks taken
            minutes apart) or "screen" (the search's cheap first rung).
        metric: what was compared: the objective, or for a run that recorded no objective
            values, the primary speed metric.
        lo, hi: the spread of the side-by-side rounds.
        rounds: side-by-side rounds behind `value`.
        noise: separate runs: the larger run-to-run spread of the two benchmarks (a fraction).
        unconfirmed: the side-by-side rounds were measured but none was comparable (the
            machine's load changed during every one), so `value` rests on separate runs.
    """

    value: float
    basis: str
    metric: str = ""
    lo: float | None = None
    hi: float | None = None
    rounds: int = 0
    noise: float | None = None
    unconfirmed: bool = False

    @property
    def within_noise(self) -> bool:
        """Whether the measurement cannot tell this candidate from the reference: the rounds'
        spread includes 1.0, or separate runs differ by less than their own spread, or the
        side-by-side comparison was not confirmed."""
        if self.basis == "side by side":
            return self.lo is not None and self.hi is not None and self.lo <= 1.0 <= self.hi
        if self.basis == "separate runs":
            return self.unconfirmed or (
                self.noise is not None and abs(self.value - 1.0) <= self.noise
            )
        return False

    @property
    def cell(self) -> str:
        """The table cell: "1.50x side by side (1.45-1.55x)", "1.81x separate runs", ...

        >>> Ratio(1.5, "side by side", lo=1.45, hi=1.55, rounds=2).cell
        '1.50x side by side (1.45-1.55x)'
        >>> Ratio(1.2, "separate runs", unconfirmed=True).cell
        '1.20x separate runs, not confirmed side by side'
        """
        if self.basis == "reference":
            return "1.00x (reference)"
        x = fmt_x(self.value)
        if self.basis == "side by side":
            return f"{x} side by side ({self.lo:.2f}-{self.hi:.2f}x)"
        if self.unconfirmed:
            return f"{x} separate runs, not confirmed side by side"
        return f"{x} {self.basis}"


@dataclass
class CandidateView:
    """Everything the run directory holds about one candidate; any part may be None."""

    id: str
    candidate: Candidate | None = None
    build: dict[str, Any] | None = None
    verify: VerifyResult | None = None
    bench: BenchResult | None = None
    error: dict[str, Any] | None = None
    # The search's cheap first rung (fidelity 1), and where each of its tasks ran.
    screen_verify: VerifyResult | None = None
    screen_bench: BenchResult | None = None
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # rung -> task record

    @property
    def reference(self) -> bool:
        return bool(self.candidate and self.candidate.reference)

    @property
    def engine(self) -> str:
        return self.candidate.engine if self.candidate else "?"

    @property
    def recipe(self) -> str:
        return self.candidate.recipe if self.candidate else "?"

    @property
    def missing(self) -> list[str]:
        """Stage files not present, e.g. ["verify.json", "bench.json"]."""
        have = {
            "candidate.json": self.candidate,
            "build.json": self.build,
            "verify.json": self.verify,
            "bench.json": self.bench,
        }
        return [name for name in _CANDIDATE_FILES if have[name] is None]


@dataclass
class RunView:
    """The parsed run directory. Build it with `load_run`; renderers only read it."""

    run_dir: Path
    run: dict[str, Any]
    model: dict[str, Any]
    doctor: dict[str, Any] | None
    plan: dict[str, Any] | None
    selection: Selection | None
    candidates: list[CandidateView]
    missing: list[str] = field(default_factory=list)  # top-level files absent
    problems: list[str] = field(default_factory=list)  # files present but unreadable
    search: dict[str, Any] | None = None  # search.json: objective, budget, cuts, executor
    reverify: dict[str, Any] | None = None  # reverify.json: does the choice still hold?
    deploy: dict[str, Any] | None = None  # best/deploy.json: the bundle written (or why not)
    launch: dict[str, Any] | None = None  # best/launch.json: how the chosen one is run

    # ---- run facts ----
    @property
    def model_name(self) -> str:
        return str(self.run.get("model") or self.model.get("name") or self.run_dir.name)

    @property
    def task(self) -> str:
        return str(self.model.get("task") or "")

    @property
    def created(self) -> str:
        return str(self.run.get("created") or "unknown date")

    @property
    def max_quality_drop(self) -> float | None:
        if self.selection is not None:
            return self.selection.max_quality_drop
        v = self.run.get("max_quality_drop")
        return float(v) if isinstance(v, int | float) else None

    @property
    def reference(self) -> CandidateView | None:
        return next((c for c in self.candidates if c.reference), None)

    @property
    def chosen(self) -> CandidateView | None:
        cid = self.selection.chosen if self.selection else None
        return self.get(cid) if cid else None

    def get(self, cid: str) -> CandidateView | None:
        return next((c for c in self.candidates if c.id == cid), None)

    @property
    def primary_metric(self) -> str | None:
        """The speed metric ranked on: the reference's primary, else the first bench's."""
        benches = [c.bench for c in self.candidates if c.bench is not None]
        ref = self.reference
        if ref is not None and ref.bench is not None:
            return ref.bench.primary
        return benches[0].primary if benches else None

    @property
    def quality_metric(self) -> str | None:
        """The quality metric shown in tables and on the scatter's secondary axis."""
        names = [m.name for c in self.candidates if c.verify for m in c.verify.metrics]
        main = MAIN_QUALITY.get(self.task)
        if main in names:
            return main
        ordered = order_names(names, QUALITY_ORDER)
        return ordered[0] if ordered else None

    def quality_names(self) -> list[str]:
        names = [m.name for c in self.candidates if c.verify for m in c.verify.metrics]
        return order_names(names, QUALITY_ORDER)

    # ---- per-candidate derived facts ----
    def speed(self, cv: CandidateView, name: str | None = None) -> float | None:
        """Median of speed metric `name` (default: the primary) or None if not measured."""
        name = name or self.primary_metric
        if cv.bench is None or name not in cv.bench.metrics:
            return None
        return cv.bench.metrics[name].median

    def speedup(self, cv: CandidateView, name: str | None = None) -> float | None:
        """How many times faster than the reference on `name` (default: the primary metric)."""
        name = name or self.primary_metric
        ref = self.reference
        v, r = self.speed(cv, name), self.speed(ref, name) if ref else None
        if v is None or r is None or not _finite(v, r) or v <= 0 or r <= 0:
            return None
        # Rates (per second) are better higher; times (seconds, ms) are better lower.
        return r / v if _is_time(name or "", cv.bench.metrics[name].unit) else v / r

    def objective_ratio(self, cv: CandidateView) -> Ratio | None:
        """`cv`'s objective relative to the reference's, as the selection measured it: side by
        side where the rounds were comparable, else the full-fidelity values (separate runs),
        else the screen's score; None when nothing was measured."""
        sel, ref = self.selection, self.reference
        if cv.reference:
            return Ratio(1.0, "reference", self.objective)
        pr = (sel.side_by_side or {}).get(cv.id) if sel else None
        if pr and pr.get("trusted") and pr.get("ratio"):
            n = len(pr.get("ratios") or [])
            return Ratio(pr["ratio"], "side by side", self.objective, pr["lo"], pr["hi"], n)
        unconfirmed = bool(pr and pr.get("rounds") and not pr.get("trusted"))
        noise = self._noise(cv, ref) if ref is not None else None
        values = sel.objective_values if sel else {}
        if ref is not None and cv.id in values and ref.id in values:
            a, b = values[cv.id], values[ref.id]
            if a > 0 and b > 0:
                x = a / b if sel.higher_is_better else b / a
                return Ratio(
                    x, "separate runs", self.objective, noise=noise, unconfirmed=unconfirmed
                )
        if (x := self.speedup(cv)) is not None:
            metric = self.primary_metric or ""
            return Ratio(x, "separate runs", metric, noise=noise, unconfirmed=unconfirmed)
        if (x := self.screen_score(cv)) is not None:
            return Ratio(x, "screen", self.objective)
        return None

    def _noise(self, cv: CandidateView, ref: CandidateView) -> float | None:
        """The larger run-to-run spread of the primary metric of `cv`'s and `ref`'s benchmarks
        (the selection's own noise measure); memory is measured once (0)."""
        if self.objective == "memory":
            return 0.0
        spreads = [
            s.spread
            for c in (cv, ref)
            if c.bench is not None and (s := c.bench.metrics.get(c.bench.primary)) is not None
        ]
        return max(spreads) if len(spreads) == 2 else None

    def memory_ratio(self, cv: CandidateView, attr: str = "peak_rss_bytes") -> float | None:
        """`attr` of the candidate's bench (peak_rss_bytes, artifact_bytes...) over the reference's."""
        ref = self.reference
        if cv.bench is None or ref is None or ref.bench is None:
            return None
        a, b = getattr(cv.bench, attr), getattr(ref.bench, attr)
        return a / b if a and b else None

    @property
    def objective(self) -> str:
        if self.selection is not None:
            return self.selection.objective
        return str((self.search or {}).get("objective") or self.run.get("objective") or "?")

    def screen_score(self, cv: CandidateView) -> float | None:
        """The candidate's objective at the screen, relative to the reference's (higher better)."""
        return ((self.search or {}).get("screen_scores") or {}).get(cv.id)

    def on_pareto(self, cv: CandidateView) -> bool:
        return cv.id in self.pareto_ids()

    def pareto_ids(self) -> list[str]:
        """The selection's Pareto front, or one computed from (speed up, quality drop down)."""
        if self.selection is not None and self.selection.pareto:
            return list(self.selection.pareto)
        pts = [
            (c.id, self.speed(c), c.verify.quality_drop)
            for c in self.candidates
            if c.verify is not None and self.speed(c) is not None
        ]
        return [
            i
            for i, s, q in pts
            if not any(s2 >= s and q2 <= q and (s2 > s or q2 < q) for j, s2, q2 in pts if j != i)
        ]

    def status(self, cv: CandidateView) -> Status:
        """Chosen, kept, dropped (with the selection's reason), failed at a stage, or incomplete."""
        sel = self.selection
        reason = sel.reasons.get(cv.id, "") if sel else ""
        if cv.error is not None:
            stage = cv.error.get("stage", "?")
            if cv.error.get("fidelity") not in (None, "full"):
                stage += f" ({cv.error['fidelity']})"
            return Status("failed", f"failed at {stage}", _one_line(cv.error.get("error", "")))
        if sel is not None and cv.id in sel.cut and (cv.verify is None or cv.bench is None):
            return Status("cut", "cut", sel.cut[cv.id])
        if sel is not None and sel.chosen == cv.id:
            return Status("chosen", "chosen", reason)
        if sel is not None and cv.id in sel.ranking:
            return Status("kept", "kept", reason)
        if sel is not None and reason:
            return Status("dropped", "dropped", reason)
        missing = [m for m in cv.missing if m != "build.json"]
        if missing:
            return Status("incomplete", "incomplete", "no " + ", ".join(missing))
        if cv.verify is not None and not cv.verify.passed:
            failed = [m.name for m in cv.verify.metrics if m.passed is False]
            return Status("dropped", "dropped", "failed quality gate: " + ", ".join(failed))
        return Status("incomplete", "incomplete", "selection.json missing")


def load_run(run_dir: str | Path) -> RunView:
    """Read a run directory into a `RunView`, never raising for missing or unreadable files.

    Args:
        run_dir: the folder `llmopt optimize` wrote (run.json, model.json, plan.json, candidates/).

    Example:
        >>> view = load_run("runs/smollm2")  # doctest: +SKIP
        >>> [view.status(c).text for c in view.candidates]  # doctest: +SKIP
    """
    run_dir = Path(run_dir)
    missing: list[str] = []
    problems: list[str] = []

    def load(rel: str, parse: Any = None, note_missing: bool = True) -> Any:
        path = run_dir / rel
        if not path.is_file():
            if note_missing:
                missing.append(rel)
            return None
        try:
            data = read_json(path)
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, found {type(data).__name__}")
            return parse(data) if parse else data
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            # A half-migrated or hand-edited file: report it, render the rest.
            problems.append(f"{rel}: {type(e).__name__}: {_one_line(str(e))}")
            return None

    run = load("run.json") or {}
    model = load("model.json") or {}
    doctor = load("doctor.json", note_missing=False)
    search = load("search.json", note_missing=False)
    reverify = load("reverify.json", note_missing=False)
    deploy = load("best/deploy.json", note_missing=False)
    launch = load("best/launch.json", note_missing=False)
    plan = load("plan.json")
    selection = load("selection.json", Selection.from_dict)

    planned: dict[str, Candidate] = {}
    for d in (plan or {}).get("candidates", []) or []:
        try:
            c = Candidate.from_dict(d)
            planned[c.id] = c
        except (TypeError, AttributeError) as e:
            problems.append(f"plan.json candidate: {type(e).__name__}: {_one_line(str(e))}")
    cand_root = run_dir / "candidates"
    on_disk = sorted(
        p.name
        for p in (cand_root.iterdir() if cand_root.is_dir() else [])
        # `candidates/<id>+<setting>/` are the chosen one's settings variations
        # (llmopt.optimize.tune), reported with it, not as candidates.
        if p.is_dir() and not p.name.startswith(TMP_PREFIX) and "+" not in p.name
    )
    views = []
    for cid in list(planned) + [i for i in on_disk if i not in planned]:
        pre = f"candidates/{cid}/"
        views.append(
            CandidateView(
                id=cid,
                candidate=load(pre + "candidate.json", Candidate.from_dict, False)
                or planned.get(cid),
                build=load(pre + "build.json", None, False),
                verify=load(pre + "verify.json", VerifyResult.from_dict, False),
                bench=load(pre + "bench.json", BenchResult.from_dict, False),
                error=load(pre + "error.json", None, False),
                screen_verify=load(pre + "verify.screen.json", VerifyResult.from_dict, False),
                screen_bench=load(pre + "bench.screen.json", BenchResult.from_dict, False),
                tasks={
                    rung: t
                    for rung in ("build", "screen", "full", "reverify")
                    if (t := load(pre + f"task.{rung}.json", None, False)) is not None
                },
            )
        )
    # Reference first, then plan order (the sort is stable).
    views.sort(key=lambda c: not c.reference)
    return RunView(
        run_dir,
        run,
        model,
        doctor,
        plan,
        selection,
        views,
        missing,
        problems,
        search,
        reverify,
        deploy,
        launch,
    )


def _finite(*xs: float) -> bool:
    return all(isinstance(x, int | float) and math.isfinite(x) for x in xs)


def _is_time(name: str, unit: str) -> bool:
    if "per_s" in name or "/s" in unit:
        return False
    return unit in ("s", "ms", "us") or name.endswith(("_ms", "_s", "_seconds", "latency"))


def _one_line(s: Any) -> str:
    return " ".join(str(s).split()) if not isinstance(s, dict | list) else json.dumps(s)


# ---- formatting shared by the Markdown and HTML renderers ----
def fmt_num(x: Any, sign: bool = False) -> str:
    """A number at 4 significant digits, thousands separated when large; "n/a" for None.

    >>> fmt_num(12.34567), fmt_num(123456.7), fmt_num(-0.0333, sign=True)
    ('12.35', '123,457', '-0.0333')
    """
    if x is None:
        return "n/a"
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    if not math.isfinite(x):
        return str(x)  # "nan", "inf": shown as they are, the integrity check flags them
    s = "+" if sign else ""
    if isinstance(x, int) or abs(x) >= 10000:
        return f"{x:{s},.0f}"
    return f"{x:{s}.4g}"


def fmt_pct(frac: float | None, sign: bool = False) -> str:
    """A fraction as a percentage: 0.0042 -> "0.42%"."""
    if frac is None or not isinstance(frac, int | float):
        return "n/a"
    return f"{frac * 100:{'+' if sign else ''}.2f}%"


def fmt_x(ratio: float | None) -> str:
    """A ratio as "1.85x"."""
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def fmt_bytes(n: Any) -> str:
    """Bytes in binary units: 1536 -> "1.5 KiB"."""
    if not isinstance(n, int | float) or isinstance(n, bool):
        return "n/a"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def fmt_value(key: str, v: Any) -> str:
    """A fact from a JSON dict, formatted by its key: *_bytes as sizes, lists joined."""
    if (key.endswith("bytes") or key.startswith("bytes")) and isinstance(v, int | float):
        return fmt_bytes(v)
    if key.endswith("seconds") and isinstance(v, int | float):
        return f"{fmt_num(v)} s"
    if isinstance(v, float | int) and not isinstance(v, bool):
        return fmt_num(v)
    if isinstance(v, list):
        return ", ".join(fmt_value("", i) for i in v) if v else "none"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {fmt_value(k, i)}" for k, i in v.items()) if v else "none"
    return "n/a" if v is None else str(v)
