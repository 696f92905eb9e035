"""The native `torch` engine: a compact Llama-family decoder with a paged KV cache.

Modules, in reading order: `config` (which HF configs run), `model` (the decoder), `linear`
(quantized kernels), `weights` (loading HF / compressed-tensors folders, random models),
`blocks` (the KV block pool: free list, block tables, swap to host), `sampling` (logits to
tokens: temperature, top-k, top-p, seeds, logprobs), `compiled` (eager or compiled decode and
prefill forwards, their shapes and warm-up), `inputs` (the decode step's packed inputs kept
between steps, and a step in flight), `generator` (continuous batching: add / step / remove over
those), `engine` (the registry plugin: `load` and `load_generator`).

The engine-neutral types (`SamplingParams`, `TokenEvent`, `OutOfBlocks`, the `BatchGenerator`
protocol) live in `llmopt.engines.generation`; they are importable from here too.

>>> from llmopt.engines.native import load_generator, SamplingParams   # doctest: +SKIP
>>> gen = load_generator("smollm2-135m")                                # doctest: +SKIP
>>> prompt = gen.tokenizer.encode("Paris is")                           # doctest: +SKIP
>>> ids, t = gen.generate(prompt, SamplingParams(max_tokens=8))         # doctest: +SKIP
"""

from llmopt.engines.generation import OutOfBlocks, SamplingParams, TokenEvent
from llmopt.engines.native.engine import NativeCausalLMRunner, NativeEngine, load_generator

__all__ = [
    "NativeEngine",
    "NativeCausalLMRunner",
    "load_generator",
    "Generator",
    "OutOfBlocks",
    "SamplingParams",
    "TokenEvent",
]


def __getattr__(name: str):
    # The generator imports torch; keep `import llmopt.engines` (and `llmopt --help`) torch-free.
    if name == "Generator":
        from llmopt.engines.native.generator import Generator  # heavy: torch

        return Generator
    raise AttributeError(name)
