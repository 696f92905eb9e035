"""Server settings: one typed, validated object (`ServeSettings`), filled by the CLI.

>>> ServeSettings(max_num_seqs=4).max_num_seqs
4
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ServeSettings"]


@dataclass(frozen=True)
class ServeSettings:
    """How the server schedules, bounds and protects itself.

    Args:
        host: address to bind; loopback unless the user asks for more.
        port: TCP port (0 picks a free one).
        served_name: the model id clients send (default: the model's name).
        api_key: when set, `/v1/*` requires `Authorization: Bearer <api_key>` (else 401).
        max_num_seqs: sequences decoded together (the engine's batch).
        max_num_batched_tokens: tokens computed per engine step (prefill + one per decode).
            With chunked prefill, a prompt longer than what a step has left is prefilled in
            chunks over several steps; without it, one such prompt is still prefilled, alone.
        enable_chunked_prefill: split prompt prefills into chunks that fit each step's token
            budget (after one token per running decode), as vLLM does, so a burst of long
            prompts never stalls the running streams for a whole prefill. None: the engine's
            default: off for the native engine (`NATIVE_CHUNKED_PREFILL`), vLLM's own for
            `--engine vllm`.
        enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before (vLLM's
            automatic prefix caching: full blocks found by the hash of their tokens and every
            token before them). None: the engine's default: on for the native engine (as vLLM
            V1); the hf and openvino engines have no prefix cache.
        swap_space_gib: host memory for the KV caches of sequences preempted by swapping (vLLM's
            `--swap-space`); used only where swapping beats recomputing for this model and
            device (`serve/swap.py`); 0: preemption by recompute only.
        engine_process: run the engine (generator, scheduler, step loop) in its own process,
            as vLLM's engine core, so the API process's Python (detokenizing, streaming) never
            holds the GIL the engine needs (`serve/engine/process.py`). Off: an engine thread.
            None: on for CUDA, off on the CPU (`NATIVE_GPU_DEFAULTS`).
        compile_prefill: torch.compile the native engine's prefill forward as well as its
            decode step (dynamic shapes, compiled during warm-up; `Generator`). None: on for
            CUDA, off on the CPU (a C++ compile of every shape there, for little gain).
        block_size: KV-cache page size in tokens.
        num_blocks: KV-cache pages, one of them scratch (None: enough for max_num_seqs
            sequences of max_seq_len tokens).
        max_seq_len: longest prompt + output accepted (None: the model's context, up to 4096).
        max_queue: requests accepted beyond the running ones; past that, 429 with Retry-After.
        request_timeout_s: wall-clock bound per request (queueing included); 504 when hit.
        max_body_bytes: largest request body accepted (413 beyond).
        drain_timeout_s: on SIGTERM, how long in-flight requests may take to finish.
        embed_batch_window_ms: embeddings: how long the batcher waits for more requests.
        embed_max_batch: embeddings: most texts per forward pass (a larger request is split
            into forwards of this size, interleaved with other requests').
        embed_max_inputs: embeddings: most inputs in one request (400 beyond; OpenAI's 2048).
        embed_max_tokens: embeddings: most tokens in one request, all inputs together (400
            beyond; OpenAI's 300,000).
        decode_batch_sizes: batch sizes the decode step runs at (a batch is padded up to the next
            one); on CUDA each is a compiled graph. None: 1, 4, 16, ... up to max_num_seqs on
            CUDA (fewer compiles), 1, 2, 4, ... on the CPU.
        warmup_tokens: before accepting requests, run (on CUDA: compile) the decode step of
            every batch size for every length bucket up to this many tokens of context; longer
            contexts compile on first use. 0: none. Ignored on the CPU (nothing is compiled).
        recipe: numeric recipe of the engine (fp32, bf16, ...).
        device: "cpu" or "cuda".
        threads: torch CPU threads (None: torch's default).
        http2: serve under hypercorn, which speaks HTTP/2 (cleartext h2c, by prior knowledge or
            Upgrade, or over TLS by ALPN) as well as HTTP/1.1 on the same port; False: uvicorn,
            HTTP/1.1 only (`serve/hypercorn_server.py`).
        ssl_certfile, ssl_keyfile: PEM certificate (chain) and private key: serve over TLS (both
            or neither). With `http2`, clients negotiate h2 or http/1.1 by ALPN.
        sources, source_notes: where each of the five scheduler/cache settings above came from
            and why; `llmopt.serve.defaults.resolve_settings` fills them (`llmopt serve` plans
            every one the user did not pass).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None
    api_key: str | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool | None = None
    engine_process: bool | None = None
    compile_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    swap_space_gib: float = 4.0
    block_size: int = 16
    num_blocks: int | None = None
    max_seq_len: int | None = None
    max_queue: int = 64
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    drain_timeout_s: float = 30.0
    embed_batch_window_ms: float = 5.0
    embed_max_batch: int = 64
    embed_max_inputs: int = 2048
    embed_max_tokens: int = 300_000
    decode_batch_sizes: tuple[int, ...] | None = None
    warmup_tokens: int = 1024
    recipe: str = "fp32"
    device: str = "cpu"
    threads: int | None = None
    http2: bool = False
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Where each scheduler/cache setting came from ("flag", "run plan", "plan", "default") and
    # why (`llmopt.serve.defaults`); a setting missing here was set in code.
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    source_notes: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not a TCP port (0-65535)")
        if self.max_num_seqs < 1:
            raise ValueError("max-num-seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max-num-batched-tokens must be >= 1")
        if self.block_size < 1:
            raise ValueError("block-size must be >= 1 token")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num-blocks must be >= 2 (one is scratch), or unset to plan it")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError("max-seq-len must be >= 2 tokens (a prompt and one generated)")
        if self.max_queue < 0:
            raise ValueError("max-queue must be >= 0")
        if self.request_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("request-timeout must be > 0 s and drain-timeout >= 0 s")
        if self.max_body_bytes < 1024:
            raise ValueError("max-body-bytes must be at least 1024")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty; pass a real key or leave it out")
        if self.embed_max_batch < 1 or self.embed_max_inputs < 1 or self.embed_max_tokens < 1:
            raise ValueError("embed-max-batch, embed-max-inputs and embed-max-tokens must be >= 1")
        if self.warmup_tokens < 0:
            raise ValueError("warmup-tokens must be >= 0 (0: no warm-up)")
        if self.decode_batch_sizes is not None and not all(
            1 <= b <= self.max_num_seqs for b in self.decode_batch_sizes
        ):
            raise ValueError(
                f"decode-batch-sizes {list(self.decode_batch_sizes)} must lie in 1..max-num-seqs "
                f"({self.max_num_seqs}{self._from('max_num_seqs')}); pass --max-num-seqs to "
                "batch more sequences"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: use cpu or cuda")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError(
                "TLS needs both --ssl-certfile (the PEM certificate) and --ssl-keyfile (its "
                "private key); pass both, or neither for plain HTTP"
            )
        for flag, path in (
            ("--ssl-certfile", self.ssl_certfile),
            ("--ssl-keyfile", self.ssl_keyfile),
        ):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file; give the path of a PEM file")

    @property
    def scheme(self) -> str:
        """ "https" when the server speaks TLS, else "http"."""
        return "https" if self.ssl_certfile else "http"

    def _from(self, name: str) -> str:
        src = self.sources.get(name)
        return f", from the {src}" if src in ("plan", "run plan") else ""

    def source(self, name: str) -> str:
        """Where setting `name` came from: "flag", "run plan", "plan" or "default"."""
        return self.sources.get(name, "default")

    def batch_sizes(self) -> list[int]:
        """The decode batch sizes the engine is built with (see `decode_batch_sizes`)."""
        if self.decode_batch_sizes:
            return sorted(set(self.decode_batch_sizes) | {self.max_num_seqs})
        step = 4 if self.device == "cuda" else 2
        sizes, b = [], 1
        while b < self.max_num_seqs:
            sizes.append(b)
            b *= step
        return sizes + [self.max_num_seqs]

    @property
    def capacity(self) -> int:
        """Requests in flight at most (running + queued); one more gets 429."""
        return self.max_num_seqs + self.max_queue

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None  # never echo the secret
        return d
