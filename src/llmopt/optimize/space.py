"""The search space and the plan: every compatible (recipe, engine, engine settings), filtered
before any work; `make_plan` turns it into the run's candidate list (reference first) and the list
of what is skipped, each with its reason.

Recipes come from the registry (`llmopt.core.recipes.RECIPES`) and engines from theirs
(`llmopt.engines.ENGINES`), so a newly registered recipe or engine is searched without touching
this module. A combination is ruled out, with its reason, by (in this order) the task rules below,
the engine's task list, `Engine.missing()` (not installed) and `Engine.incompatible()` (cannot run
this recipe on this model and device). Nothing ruled out is ever built.

Two rules keep the grid small without hiding anything (each skip is listed with its reason):
an alias (a preset whose configuration equals an earlier one, e.g. `w4a16` = `w4a16-gptq-g128`)
is measured once, under the first name; and on CPU one group size per quantization algorithm is
searched (128, or the largest registered size that divides the model's widths; a size that does
not divide them is never built; `--candidates` still selects the others explicitly).

Engine settings (`llmopt.core.settings.EngineSettings`): an engine offers variations worth
measuring with `Engine.settings_space(info, recipe, device)` (the first entry is its default; the
base class offers none, one candidate per recipe, which keeps the CPU candidate count small). A
variation with an `opt_in` reason is listed as skipped unless named in `--candidates`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from llmopt.core.recipes import RECIPES, Recipe
from llmopt.core.schema import SCHEMA_VERSION, Candidate
from llmopt.engines import ENGINES
from llmopt.hardware.target import Target
from llmopt.planning.memory import memory_table

if TYPE_CHECKING:
    from llmopt.engines.base import Engine
    from llmopt.model.info import ModelInfo

__all__ = ["REFERENCE", "Plan", "make_plan", "candidate_space", "task_rule", "settings_suffix"]

REFERENCE = ("hf", "fp32")  # (engine, recipe) every other candidate is compared against
# A settings variation holding this key is searched only when named in --candidates; the value
# says why (listed as the skip reason otherwise).
OPT_IN = "opt_in"


def task_rule(task: str, recipe: Recipe) -> str | None:
    """Why `recipe` makes no sense for a model of `task` (None when it may).

    >>> from llmopt.core.recipes import Recipe
    >>> task_rule("embedding", Recipe("kv-fp8")) is not None
    True
    """
    kv = getattr(recipe, "kv_cache_dtype", None) or getattr(recipe, "kv_dtype", None)
    if task != "causal-lm" and (kv or recipe.name.startswith("kv-")):
        return "KV-cache recipes apply to decoder LMs only (an encoder keeps no KV cache)"
    return None


def format_rule(engine: Engine, recipe: Recipe) -> str | None:
    """Why `engine` cannot run `recipe`'s weight format: GGUF types are llama.cpp's own.

    >>> from llmopt.engines import get_engine
    >>> from llmopt.core.recipes import get_recipe
    >>> format_rule(get_engine("hf"), get_recipe("gguf-q8_0"))
    "GGUF Q8_0 is llama.cpp's own format: the llamacpp engine runs it"
    """
    if recipe.gguf_type and not engine.gguf:
        return f"GGUF {recipe.gguf_type} is llama.cpp's own format: the llamacpp engine runs it"
    return None


CPU_GROUP_SIZE = 128  # on CPU, the group size searched per algorithm (kernel speed barely varies)


def _config(recipe: Recipe) -> Recipe:
    """The recipe without its names: equal configs are the same numbers under another name."""
    return replace(recipe, name="_", description="")


def _widths(info: ModelInfo) -> list[int]:
    return [w for w in (info.hidden_size, info.intermediate_size) if isinstance(w, int) and w > 0]


def _cpu_group_size(recipe: Recipe, info: ModelInfo) -> int | None:
    """The one group size searched on CPU for `recipe`'s family (same config, any group size):
    the largest registered one that divides the model's widths (CPU_GROUP_SIZE if it does)."""

    def family(r: Recipe) -> str:  # the config without names and group size
        skip = ("name", "description", "group_size", "extra")
        return repr(sorted((k, repr(v)) for k, v in asdict(r).items() if k not in skip))

    fam = family(recipe)
    sizes = {
        r.group_size
        for r in RECIPES.values()
        if getattr(r, "group_size", None) and family(r) == fam
    }
    fits = [g for g in sizes if all(w % g == 0 for w in _widths(info))]
    if CPU_GROUP_SIZE in fits:
        return CPU_GROUP_SIZE
    return max(fits, default=None)


def grid_rule(
    recipe: Recipe, seen: dict[Recipe, str], info: ModelInfo, device: str, only: list[str] | None
) -> str | None:
    """Why `recipe` is not searched as its own point of the grid: an alias, a group size that
    does not divide the model's widths, or (on CPU) not the one group size searched per family."""
    cfg = _config(recipe)
    if cfg in seen:
        return f"alias of {seen[cfg]} (same configuration), measured once under that name"
    gs = getattr(recipe, "group_size", None)
    if gs and (bad := [w for w in _widths(info) if w % gs]):
        return f"group size {gs} does not divide the model's width {bad[0]}"
    named = bool(only) and any(i.endswith(f"-{recipe.name}") for i in only)
    if device == "cpu" and not getattr(recipe, "weight_symmetric", True) and not named:
        # Each 4-bit algorithm's calibration costs minutes on a CPU; three more of them made the
        # default SmolLM2 search (the quick start, 4 min before) run past 12 min.
        return (
            "asymmetric 4-bit: on cpu the symmetric twin is searched (the format every engine "
            "loads by default); name it in --candidates to try it"
        )
    pick = _cpu_group_size(recipe, info) if gs else None
    if device == "cpu" and gs and gs != pick and not named:
        return (
            f"group size {gs}: on cpu one group size per algorithm is searched "
            f"(g{pick}, the largest that divides the model); name it in --candidates to try it"
        )
    return None


def settings_suffix(variation: dict[str, Any]) -> str:
    """The candidate-id suffix of a settings variation: {"compile": True, "batch": 8} -> "-compile-batch8".

    >>> settings_suffix({"compile": False, "block_size": 16})
    '-nocompile-block_size16'
    """
    parts = []
    for k, v in variation.items():
        parts.append(k if v is True else f"no{k}" if v is False else f"{k}{v}")
    return "".join(f"-{p}" for p in parts)


def _variations(engine: Engine, info: ModelInfo, recipe: Recipe, device: str) -> list[dict]:
    return list(engine.settings_space(info, recipe, device)) or [{}]


def candidate_space(
    info: ModelInfo,
    target: Target,
    only: list[str] | None = None,
    settings: dict[str, Any] | None = None,
) -> tuple[list[Candidate], list[dict[str, str]]]:
    """Every candidate for `info` on `target`, and every combination ruled out with its reason.

    Args:
        info: from `inspect_model`.
        target: from `llmopt.hardware.target.detect_target`.
        only: restrict to these candidate ids (the reference is always kept).
        settings: settings given to every candidate (threads, device).

    Returns:
        (candidates, reference first then registry order; skipped entries
        {"id", "engine", "recipe", "reason"}).

    Example:
        >>> cands, skipped = candidate_space(info, target)       # doctest: +SKIP
        >>> cands[0].id, skipped[0]["reason"]                      # doctest: +SKIP
        ('hf-fp32', 'float16 matmuls are emulated on most CPUs ...')
    """

    base = {"threads": target.threads, "device": target.device, **(settings or {})}
    cands: list[Candidate] = []
    skipped: list[dict[str, str]] = []
    seen: dict[Recipe, str] = {}
    for recipe in RECIPES.values():
        grid = grid_rule(recipe, seen, info, target.device, only)
        seen.setdefault(_config(recipe), recipe.name)
        for engine in ENGINES.values():
            cid = f"{engine.name}-{recipe.name}"
            is_ref = (engine.name, recipe.name) == REFERENCE
            reason = (
                task_rule(info.task, recipe)
                or (None if is_ref else grid)
                or (
                    f"engine does not run {info.task} models"
                    if info.task not in engine.tasks
                    else None
                )
                or format_rule(engine, recipe)
                or engine.missing()
                or engine.incompatible(info, recipe, target.device)
            )
            if reason:
                skipped.append(
                    {"id": cid, "engine": engine.name, "recipe": recipe.name, "reason": reason}
                )
                continue
            for i, var in enumerate(_variations(engine, info, recipe, target.device)):
                var = dict(var)
                opt_in = var.pop(OPT_IN, None)
                vid = cid + ("" if i == 0 else settings_suffix(var))
                ref = is_ref and i == 0
                if opt_in and vid not in (only or ()):
                    skipped.append(
                        {
                            "id": vid,
                            "engine": engine.name,
                            "recipe": recipe.name,
                            "reason": f"{opt_in}; name it in --candidates to search it",
                        }
                    )
                    continue
                if only and vid not in only and cid not in only and not ref:
                    skipped.append(
                        {
                            "id": vid,
                            "engine": engine.name,
                            "recipe": recipe.name,
                            "reason": "not selected (--candidates)",
                        }
                    )
                    continue
                desc = f"{recipe.description or recipe.name} on {engine.name}" + (
                    f" ({settings_suffix(var)[1:]})" if i else ""
                )
                cands.append(Candidate(vid, engine.name, recipe.name, {**base, **var}, ref, desc))
    cands.sort(key=lambda c: not c.reference)
    return cands, skipped


@dataclass
class Plan:
    """plan.json: the target, its memory math, the candidates (reference first) and what was
    ruled out with the reason."""

    target: Target
    memory: dict[str, Any]
    candidates: list[Candidate]
    skipped: list[dict[str, str]]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "target": self.target.to_dict(),
            "memory": self.memory,
            "candidates": [c.to_dict() for c in self.candidates],
            "skipped": self.skipped,
            "notes": self.notes,
        }


def make_plan(
    info: ModelInfo,
    target: Target,
    only: list[str] | None = None,
    settings: dict[str, Any] | None = None,
) -> Plan:
    """List the candidates to build for `info` on `target`, and those skipped with the reason.

    Args:
        info: from `inspect_model`.
        target: from `detect_target`.
        only: restrict to these candidate ids (the reference is always kept).
        settings: engine settings given to every candidate (e.g. {"threads": 2}).
    """
    cands, skipped = candidate_space(info, target, only, settings)
    unknown = sorted(set(only or []) - {c.id for c in cands} - {s["id"] for s in skipped})
    if unknown:
        raise ValueError(
            f"unknown candidate id(s) {unknown}; known: "
            f"{sorted([c.id for c in cands] + [s['id'] for s in skipped])}"
        )
    assert cands and cands[0].reference, "the hf fp32 reference must be runnable"
    return Plan(target, memory_table(info, target), cands, skipped)
