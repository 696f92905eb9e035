#!/usr/bin/env bash
# Builds, on this machine (PyPI reachable), what `benchmarks/h200_runs.sh` expects carried to the
# GPU machine (which reaches nothing), into the git-ignored folders it reads:
#
#   bash scripts/setup.sh --dev && bash benchmarks/h200_prepare.sh
#
#   .whl/                      wheels the device image lacks (the serving, quantize and
#                              real-weight steps; `setup` installs them there)
#   .devdata/smollm2-tok/      SmolLM2's tokenizer (random-weight folders of the 8B shape use it)
#   .devdata/llmopt_home/data  the built-in Wikipedia text, parsed (verification, calibration)
#   .devdata/site/gensim/      the one gensim data file that text is parsed from (its presence
#                              is checked), not the package
#   .devdata/smol/part-a?      the built-in SmolLM2 GGUF (98 MB) in two halves: one call carries
#                              at most 64 MiB with the repository, so `smol-part` takes one a call
#
# A call then carries [".whl", ".devdata/smollm2-tok", ".devdata/llmopt_home", ".devdata/site"]
# plus one `.devdata/smol/part-aa` (then `part-ab`) where it runs `smol-part`. The issue-24 kernel steps need none
# of it. Each folder is rebuilt whole (written beside, then renamed), so a killed run leaves the
# old one or none.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'bash scripts/setup.sh --dev' first (or set PYTHON)"; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p .devdata

swap() {  # swap NEW FINAL: FINAL replaced by NEW in one rename
  rm -rf "$2.old"
  [ -e "$2" ] && mv "$2" "$2.old"
  mv "$1" "$2" && rm -rf "$2.old"
}

echo "--- wheels for the device image (Python 3.12, x86-64)"
dl() { "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version 3.12 --platform manylinux2014_x86_64 -d "$tmp/whl" "$@"; }
# pydantic with its dependencies (pydantic-core at the version it pins); the rest without theirs:
# the image has torch, transformers and their dependencies already.
dl pydantic==2.14.4
dl --no-deps gguf compressed-tensors==0.20.1 annotated-doc fastapi starlette uvicorn hypercorn \
  h2 hpack hyperframe priority wsproto loguru opentelemetry-api importlib-metadata
swap "$tmp/whl" .whl
printf '  %s\n' .whl/*.whl

echo "--- SmolLM2: tokenizer and GGUF pieces"
gguf=$("$PY" -c "from llmopt.assets.models import builtin_gguf; print(builtin_gguf('smollm2-135m') or '')")
[ -f "$gguf" ] || { echo "the SmolLM2 GGUF is not installed: run '.venv/bin/llmopt assets install'"; exit 2; }
"$PY" - "$gguf" "$tmp/tok" <<'PY'
import sys
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

gguf, out = Path(sys.argv[1]), sys.argv[2]
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
# as llmopt.assets prepares it: the GGUF carries no tokenizer length limit, the model's context is it
cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
tok.model_max_length = cfg.max_position_embeddings
tok.save_pretrained(out)
PY
swap "$tmp/tok" .devdata/smollm2-tok
mkdir -p "$tmp/smol"
split -n 2 "$gguf" "$tmp/smol/part-"  # part-aa, part-ab
swap "$tmp/smol" .devdata/smol
du -b .devdata/smol/part-* | sed 's/^/  /'

echo "--- the Wikipedia text: its source file and the parsed cache"
dump=$("$PY" -c "from llmopt.assets.text import WIKI_DUMP, gensim_data_dir as d; print(d() / WIKI_DUMP)")
mkdir -p "$tmp/site/gensim/test/test_data"
: > "$tmp/site/gensim/__init__.py"  # found by find_spec, never imported
cp "$dump" "$tmp/site/gensim/test/test_data/"
swap "$tmp/site" .devdata/site
LLMOPT_HOME="$tmp/home" "$PY" -c "from llmopt.assets.text import wikipedia_articles as w; print(' ', len(w()), 'articles')"
swap "$tmp/home" .devdata/llmopt_home
du -sh .whl .devdata/* | sed 's/^/  /'
