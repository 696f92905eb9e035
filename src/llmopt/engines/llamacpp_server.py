"""Start llama-cpp-python's OpenAI-compatible server, optionally without ggml's extra buffers.

    python -m llmopt.engines.llamacpp_server [--no-extra-bufts] --model X.gguf --host 127.0.0.1 --port N

Why this exists: llama-cpp-python 0.3.36 built from source on a CPU with AMX (Sapphire Rapids
and later) puts quantized weights in ggml's AMX "extra" buffer, and its AMX matmul kernel crashes
with SIGSEGV on the first completion in our containers (gdb: `ggml_backend_amx_mul_mat`). llama.cpp
has a model parameter to turn the extra buffer types off (`use_extra_bufts`, the CLI's
`--no-repack`), but llama-cpp-python does not expose it; this launcher sets it on the default
model parameters and then runs the unmodified `llama_cpp.server` main. Everything else (HTTP,
scheduling, sampling) is the third-party server as shipped.
"""

from __future__ import annotations

import runpy
import sys

__all__ = ["main", "disable_extra_buffers"]


def disable_extra_buffers() -> None:
    """Make every `llama_cpp.Llama` built from now on skip ggml's extra (AMX/repack) buffers.

    Example:
        >>> disable_extra_buffers()  # doctest: +SKIP
    """
    import llama_cpp.llama_cpp as capi

    original = capi.llama_model_default_params
    if getattr(original, "_llmopt_patched", False):
        return

    def params():
        p = original()
        p.use_extra_bufts = False
        return p

    params._llmopt_patched = True  # type: ignore[attr-defined]
    capi.llama_model_default_params = params


def main(argv: list[str] | None = None) -> None:
    """Entry point: strip `--no-extra-bufts`, apply it, run `python -m llama_cpp.server`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--no-extra-bufts" in args:
        args.remove("--no-extra-bufts")
        disable_extra_buffers()
    sys.argv = ["llama_cpp.server", *args]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
