"""The engine-neutral generation protocol: what `llmopt serve` drives, whichever engine batches.

A batching engine (`Engine.batching`) turns a `GeneratorSpec` into a `BatchGenerator`
(`Engine.load_generator`): an object that admits sequences (`add`), runs them one step at a time
(`step`, which returns `TokenEvent`s) and forgets them (`remove`), over a pool of KV-cache blocks
whose free count it reports and whose exhaustion it signals with `OutOfBlocks`. The serve
scheduler decides who runs; the generator only says what fits.

This module imports no torch: the API process of `llmopt serve --engine-process` builds
`SamplingParams` and `GeneratorSpec`s (pickled to the engine process) without loading a model.

>>> spec = GeneratorSpec(model="smollm2-135m", max_batch=4)
>>> spec.recipe, spec.engine
('fp32', 'torch')
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "OutOfBlocks",
    "SamplingParams",
    "TokenEvent",
    "PromptLogprob",
    "PrefixCacheStats",
    "GeneratorSpec",
    "BatchGenerator",
    "TEMPERATURE_FLOOR",
    "SEED_MIN",
    "SEED_MAX",
    "check_seed",
    "eos_token_ids",
    "finish_reason",
]

# A temperature below this samples as greedy (vLLM's `_SAMPLING_EPS`): dividing fp32 logits by
# a smaller one overflows to inf, and the softmax of inf is NaN.
TEMPERATURE_FLOOR = 1e-5

# The seeds a torch.Generator takes (`manual_seed`); a request's choices draw from seed, seed+1...
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def check_seed(seed: int | None) -> None:
    """ValueError unless `seed` is None or a seed a random generator takes (SEED_MIN..SEED_MAX).

    >>> check_seed(2**64)
    Traceback (most recent call last):
    ...
    ValueError: seed 18446744073709551616 is out of range (-9223372036854775808..18446744073709551615)
    """
    if seed is not None and not SEED_MIN <= int(seed) <= SEED_MAX:
        raise ValueError(f"seed {seed} is out of range ({SEED_MIN}..{SEED_MAX})")


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks. `seq_ids`: the running sequences that needed one."""

    def __init__(self, message: str, seq_ids: list[Hashable] | None = None):
        super().__init__(message)
        self.seq_ids = seq_ids or []


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # number of top alternatives to return per token (the chosen one always)
    # Log-probabilities of the prompt's own tokens, computed in prefill and sent once with the
    # first TokenEvent: None = off; 0 = each prompt token's only; N = also its top-N.
    prompt_logprobs: int | None = None


def eos_token_ids(declared: int | Iterable[int] | None, tokenizer: Any = None) -> set[int]:
    """The token ids that end a sequence unless `SamplingParams.ignore_eos`: what the model
    declares (one id, a list of them, or None) and its tokenizer's EOS token, if it has one.

    >>> sorted(eos_token_ids([2, 7])), sorted(eos_token_ids(2)), eos_token_ids(None)
    ([2, 7], [2], set())
    """
    ids = [] if declared is None else [declared] if isinstance(declared, int) else declared
    out = {int(t) for t in ids}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        out.add(int(tokenizer.eos_token_id))
    return out


def finish_reason(
    token: int,
    params: SamplingParams,
    *,
    generated: int,
    total: int,
    max_seq_len: int,
    eos_ids: set[int],
) -> str | None:
    """Why a sequence ends with the `token` just appended, or None if it goes on: "stop" for a
    stop token or (unless `ignore_eos`) an EOS id, else "length" once it has `generated`
    `params.max_tokens` tokens or holds (`total`, prompt included) `max_seq_len`. Stop strings
    are text, not ids: the serve API ends a sequence on those (`serve.api.detok`).

    >>> p = SamplingParams(max_tokens=3, stop_token_ids=(5,))
    >>> finish_reason(5, p, generated=1, total=4, max_seq_len=16, eos_ids={2})
    'stop'
    >>> finish_reason(2, p, generated=1, total=4, max_seq_len=16, eos_ids={2})
    'stop'
    >>> p = SamplingParams(max_tokens=3, ignore_eos=True)
    >>> finish_reason(2, p, generated=1, total=4, max_seq_len=16, eos_ids={2}) is None
    True
    >>> finish_reason(2, p, generated=3, total=6, max_seq_len=16, eos_ids={2})
    'length'
    """
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if generated >= params.max_tokens or total >= max_seq_len:
        return "length"
    return None


# One prompt token's (logprob given the tokens before it, top-N [(token id, logprob)]).
PromptLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class TokenEvent:
    seq_id: Hashable
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error" | None
    # First event only, when SamplingParams.prompt_logprobs is set: one entry per prompt token,
    # None for the first (nothing precedes it), else (logprob, top-N [(token id, logprob)]).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # Set (with finish_reason "error") when this sequence alone failed in this step (NaN or inf
    # logits in its row): the generator has stopped it; the others in the batch go on.
    error: str | None = None


@dataclass
class PrefixCacheStats:
    """A generator's prefix-cache lookups, cumulative, in prompt tokens (vLLM's
    `prefix_cache_queries` / `prefix_cache_hits`): `queries` counts the prompt tokens of every
    sequence admitted with a lookup, `hits` those of them found in cached KV blocks (not
    prefilled). A recomputed (preempted) sequence looks up its prompt + generated tokens again.

    >>> PrefixCacheStats(queries=200, hits=150).hit_rate
    0.75
    """

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class GeneratorSpec:
    """What to load as a batch generator, and its shape. Plain values only: it is pickled to
    the engine process (`llmopt serve --engine-process`).

    Args:
        model: HF folder, built artifact or built-in name.
        recipe: the numeric recipe's name (fp32, bf16, w8a16...).
        engine: the registered engine whose `load_generator` builds it.
        device: "cpu", "cuda", "cuda:1"...
        max_batch: sequences in a batch at most.
        block_size, num_blocks: the KV-cache pool (num_blocks None: enough for max_batch
            sequences of max_seq_len tokens).
        max_seq_len: prompt + generated tokens of one sequence at most (None: the engine's).
        batch_sizes: decode batch shapes (None: the engine's).
        compile_prefill: compile the prefill forward too.
        prefix_caching: reuse the KV blocks of prompt prefixes computed before (an engine
            without a prefix cache ignores it).
        settings: the run's candidate's engine settings (`EngineSettings.to_dict()`: threads
            and the engine's own options), for an engine whose generator runs with them (the
            openvino engine: its KV-cache precision, inference precision, threads); None: the
            engine's defaults.
    """

    model: str
    recipe: str = "fp32"
    engine: str = "torch"
    device: str = "cpu"
    max_batch: int = 8
    block_size: int = 16
    num_blocks: int | None = None
    max_seq_len: int | None = None
    batch_sizes: tuple[int, ...] | None = None
    compile_prefill: bool = False
    prefix_caching: bool = False
    settings: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", str(self.model))
        if self.settings is not None:
            object.__setattr__(self, "settings", dict(self.settings))
        if self.batch_sizes is not None:
            object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))


@runtime_checkable
class BatchGenerator(Protocol):
    """Continuous batching over a paged KV cache, as the serve scheduler, engine loop, engine
    process, swap verdict and warm-up use it. Sequence ids are any hashable the caller picks.

    A generator may also keep `time` (cumulative step timings, exported as metrics) and
    `prefix_cache` (its `PrefixCacheStats`, None or absent without a prefix cache); the
    scheduler reads them with `getattr`, so they are not required here. With a prefix cache,
    `free_blocks` counts the cached blocks no sequence holds (they are evicted when needed) and
    sequences may share blocks, so `blocks_of` of two sequences may overlap.
    """

    tokenizer: Any
    device: Any  # where its KV cache lives (str() gives "cpu", "cuda:0"...)
    max_batch: int
    block_size: int
    num_blocks: int
    max_seq_len: int
    batch_sizes: list[int]

    # -- capacity ------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """KV blocks not allocated to any sequence (cached ones no sequence holds included)."""
        ...

    def blocks_needed(self, n_tokens: int) -> int:
        """KV blocks `n_tokens` tokens occupy."""
        ...

    def blocks_of(self, seq_id: Hashable) -> list[int]:
        """The KV blocks `seq_id` holds now (a copy)."""
        ...

    def prefill_pending(self, seq_id: Hashable) -> int:
        """Prompt tokens of `seq_id` still to prefill (0 once it decodes)."""
        ...

    # -- lifecycle -----------------------------------------------------------------------------
    def add(self, seq_id: Hashable, prompt_ids: list[int], params: SamplingParams) -> None:
        """Admit a sequence (ValueError: refused; OutOfBlocks: no room now). All or nothing:
        when it raises, the generator holds nothing for `seq_id` (no blocks, no state)."""
        ...

    def step(self, prefill_budget: int | None = None) -> list[TokenEvent]:
        """Prefill what was admitted (at most `prefill_budget` tokens), decode the rest."""
        ...

    def remove(self, seq_id: Hashable) -> list[int]:
        """Forget a sequence, free its blocks; returns its prompt + generated ids."""
        ...

    # -- preemption by swap --------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token holds across all layers."""
        ...

    def layer_parameters(self) -> int:
        """Parameters of the decoder layers (recomputing a token costs about twice as many
        FLOPs)."""
        ...

    def swap_out(self, seq_id: Hashable) -> Any:
        """Move a decoding sequence's KV cache to host memory; returns it (with `nbytes` and
        `num_blocks`) for `swap_in`."""
        ...

    def swap_in(self, seq_id: Hashable, swapped: Any) -> None:
        """Bring a swapped-out sequence back; it continues as if it had never left. All or
        nothing, as `add`: when it raises, the generator holds nothing for `seq_id`, and
        `swapped` can be brought back later."""
        ...

    # -- warm-up -------------------------------------------------------------------------------
    def warmup_widths(self, max_tokens: int | None = None) -> list[int]:
        """The decode length buckets of contexts up to `max_tokens`."""
        ...

    def warmup(self, max_tokens: int | None = None) -> float:
        """Compile every decode shape up to `max_tokens` of context; returns the seconds."""
        ...

    def warmup_prefill(self) -> float:
        """Compile the prefill, if it is compiled; returns the seconds (0: nothing to do)."""
        ...

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], dict]:
        """Run one sequence to the end; returns (generated ids, timings)."""
        ...
