"""The native `torch` engine: a compact Llama-family decoder with a paged KV cache.

Modules, in reading order: `config` (which HF configs run), `model` (the decoder), `linear`
(quantized kernels), `weights` (loading HF / compressed-tensors folders, random models),
`generator` (continuous batching: add / step / remove), `engine` (the registry plugin).

>>> from llmopt.engines.native import load_generator, SamplingParams   # doctest: +SKIP
>>> gen = load_generator("smollm2-135m")                                # doctest: +SKIP
>>> ids, t = gen.generate(gen.tokenizer.encode("Paris is"), SamplingParams(max_tokens=8))  # doctest: +SKIP
"""

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
    if name in ("Generator", "OutOfBlocks", "SamplingParams", "TokenEvent"):
        from llmopt.engines.native import generator

        return getattr(generator, name)
    raise AttributeError(name)
