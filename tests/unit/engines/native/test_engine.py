"""The native `torch` engine against transformers on tiny random models of each family (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmopt.core.settings import EngineSettings
from llmopt.engines import get_engine
from llmopt.engines.generation import OutOfBlocks, SamplingParams
from llmopt.engines.native import load_generator
from llmopt.engines.native.config import NativeConfig, UnsupportedModel
from llmopt.engines.native.generator import Generator
from llmopt.engines.native.weights import load_model

ROOT = Path(__file__).resolve().parents[4]
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    # fused qkv_proj / gate_up_proj in the checkpoint, split on load
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"sliding_window": None, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # post-attention / post-feedforward norms only, q/k norms over all heads
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0, "eos_token_id": 2}),
    # interleaved local (window 8) / global layers, pre/post norms, soft-capped scores and logits
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
        },
    ),
    # 5 local : 1 global layers with their own RoPE bases, q/k norms
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "num_hidden_layers": 6,
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
        },
    ),
    # embedding / attention / residual multipliers and logits scaling
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.05,
            "residual_multiplier": 0.22,
            "logits_scaling": 8.0,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


def _hf_model(family: str, out: Path):
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**{**BASE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # random biases/norms, so a mix-up of them cannot go unnoticed
        for n, p in model.named_parameters():
            if n.endswith(("bias", "norm.weight")):
                p.normal_(0.0 if n.endswith("bias") else 1.0, 0.1)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_match_transformers(family, tmp_path):
    hf = _hf_model(family, tmp_path)
    native = load_model(tmp_path, "cpu", torch.float32)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids).logits
    gen = Generator(native, max_batch=2, max_seq_len=96)
    tables = torch.tensor([[1, 2], [3, 4]])
    pos = torch.arange(24).expand(2, 24)
    with torch.inference_mode():
        mine = native(ids, pos, tables, prefill=True, last_only=False)
    torch.testing.assert_close(mine, ref, atol=2e-4, rtol=1e-4)
    # Greedy continuation through the paged decode path equals transformers' generate().
    prompt = ids[:1, :10]
    want = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, 10:]
    got, _ = gen.generate(prompt[0].tolist(), SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == want.tolist()


def test_continuous_batching_equals_one_at_a_time(tiny_llama_dir):
    gen = load_generator(tiny_llama_dir, max_batch=4, max_seq_len=128, block_size=4)
    prompts = [[5, 6, 7], list(range(20, 45)), [9] * 11, [100, 101]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [gen.generate(p, params)[0] for p in prompts]
    assert gen.free_blocks == gen.num_blocks - 1
    out: dict[int, list[int]] = {}
    gen.add(0, prompts[0], params)
    gen.add(1, prompts[1], params)
    for ev in gen.step():  # sequences join while others are mid-generation
        out.setdefault(ev.seq_id, []).append(ev.token_id)
    gen.add(2, prompts[2], params)
    while len(out.get(3, [])) < 12:
        if 3 not in gen.seqs and len(out.get(0, [])) >= 5:
            gen.add(3, prompts[3], params)
        for ev in gen.step():
            out.setdefault(ev.seq_id, []).append(ev.token_id)
            if ev.finish_reason:
                gen.remove(ev.seq_id)
    assert [out[i] for i in range(4)] == alone
    assert gen.free_blocks == gen.num_blocks - 1 and not gen.running


def test_padded_batch_sizes_and_warmup_leave_tokens_unchanged(tiny_llama_dir):
    gen = load_generator(
        tiny_llama_dir,
        max_batch=4,
        max_seq_len=128,
        block_size=4,
        batch_sizes=[3],
        min_bucket_tokens=32,
    )
    assert gen.batch_sizes == [3, 4] and [gen.padded_batch(b) for b in (1, 3, 4)] == [3, 3, 4]
    assert gen.table_width(1) == 8 and gen.table_width(9) == 16  # floor of 32 tokens = 8 blocks
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    alone = [gen.generate(p, params)[0] for p in ([5, 6, 7], list(range(20, 41)))]
    gen.add(0, [5, 6, 7], params)
    gen.add(1, list(range(20, 41)), params)
    out: dict[int, list[int]] = {0: [], 1: []}
    for i in range(10):
        if i == 4:  # a warm-up between steps must not touch the running sequences' cache
            assert gen.warmup(64) >= 0
        for ev in gen.step():
            out[ev.seq_id].append(ev.token_id)
    assert [out[0], out[1]] == alone
    with pytest.raises(ValueError, match="batch sizes"):
        load_generator(tiny_llama_dir, max_batch=4, batch_sizes=[8])


def test_out_of_blocks_and_limits(tiny_llama_dir):
    gen = load_generator(tiny_llama_dir, max_batch=2, max_seq_len=64, block_size=4, num_blocks=6)
    assert gen.free_blocks == 5 and gen.blocks_needed(9) == 3
    gen.add("a", list(range(10, 22)), SamplingParams(max_tokens=20, ignore_eos=True))  # 3 blocks
    with pytest.raises(OutOfBlocks):
        gen.add("b", list(range(10, 22)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="exceeds the context"):
        gen.add("c", [1] * 60, SamplingParams(max_tokens=10))
    gen.add("d", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))  # 1 block, 1 left
    with pytest.raises(OutOfBlocks) as err:
        for _ in range(20):
            gen.step()
    assert set(err.value.seq_ids) <= {"a", "d"} and err.value.seq_ids
    ids = gen.remove("d")  # preempt: the caller re-adds prompt + generated tokens later
    assert ids[:3] == [1, 2, 3] and len(ids) > 3
    gen.step()  # "a" continues with the freed blocks


def test_sampling_seeded_and_stop_tokens(tiny_llama_dir):
    gen = load_generator(tiny_llama_dir, max_batch=2)
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, _ = gen.generate([5, 6, 7], p)
    b, _ = gen.generate([5, 6, 7], p)
    assert a == b
    greedy, _ = gen.generate([5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    topk1, _ = gen.generate(
        [5, 6, 7], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    )
    assert topk1 == greedy
    stop = greedy[3]
    cut, _ = gen.generate([5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))
    assert cut == greedy[: greedy.index(stop) + 1]
    gen.add("lp", [5, 6, 7], SamplingParams(max_tokens=2, logprobs=3))
    ev = gen.step()[0]
    assert len(ev.top_logprobs) == 3 and ev.top_logprobs[0][1] >= ev.logprob - 1e-6


def test_quantized_linears_on_cpu_stay_close(tiny_llama_dir):
    dense = load_model(tiny_llama_dir, "cpu", torch.float32)
    ids = torch.randint(0, 264, (1, 16), generator=torch.Generator().manual_seed(0))
    pos, table = torch.arange(16).unsqueeze(0), torch.tensor([[1]])
    Generator(dense, max_batch=1, max_seq_len=32)
    with torch.inference_mode():
        ref = dense(ids, pos, table, prefill=True, last_only=False)
    for mode, min_sqnr in (("int8", 25.0), ("int4", 12.0)):
        q = load_model(tiny_llama_dir, "cpu", torch.float32, quant=mode, group=32)
        Generator(q, max_batch=1, max_seq_len=32)
        with torch.inference_mode():
            out = q(ids, pos, table, prefill=True, last_only=False)
        sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())
        assert sqnr > min_sqnr, (mode, float(sqnr))
        assert not torch.equal(out, ref)  # really quantized


def test_loads_the_int8_checkpoint_the_hf_engine_writes(tiny_llama_dir, tmp_path):
    from llmopt.core.recipes import get_recipe
    from llmopt.model.info import inspect_model

    out = tmp_path / "w8a16"
    out.mkdir()
    info = inspect_model(tiny_llama_dir)
    facts = get_engine("torch").build(tiny_llama_dir, info, get_recipe("w8a16"), out)
    assert facts["kernel"] == "int8"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    runner = get_engine("torch").load(out, info, get_recipe("w8a16"), EngineSettings())
    layer = runner.gen.model.model.layers[0].self_attn
    assert type(layer.q_proj).__name__ == "Int8Linear"  # stored int8 values used as they are
    hf_runner = get_engine("hf").load(out, info, get_recipe("w8a16"), EngineSettings())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    torch.testing.assert_close(runner.logits(ids), hf_runner.logits(ids), atol=1e-3, rtol=1e-3)
    # prefill + decode through the runner protocol equals full-sequence logits
    last, state = runner.prefill(ids[:, :5])
    step, _ = runner.decode(ids[:, 5:6], state)
    full = runner.logits(ids)
    torch.testing.assert_close(last, full[:, 4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step, full[:, 5], atol=1e-4, rtol=1e-4)


def test_int8_head_is_a_candidate_of_its_own_and_runs_close_to_dense(tiny_llama_dir):
    """`lm_head: int8` (an engine option): the quantized recipes' candidates on CUDA include an
    int8 output projection (opt-in on the CPU; none for dense recipes or where the recipe
    quantizes the head already); loaded, the head is int8 and the tied embedding is not, the
    logits move a little and stay close; an unknown format is refused with the way out."""
    from dataclasses import replace

    from llmopt.core.errors import LlmoptError
    from llmopt.core.recipes import get_recipe
    from llmopt.model.info import inspect_model

    info, torch_engine = inspect_model(tiny_llama_dir), get_engine("torch")
    w8 = get_recipe("w8a16")
    assert torch_engine.settings_space(info, w8, "cuda") == [{}, {"lm_head": "int8"}]
    cpu = torch_engine.settings_space(info, w8, "cpu")
    assert {"lm_head", "opt_in"} <= set(cpu[-1]) and cpu[-1]["lm_head"] == "int8"
    assert torch_engine.settings_space(info, get_recipe("bf16"), "cuda") == [{}]
    assert torch_engine.settings_space(info, replace(w8, name="w8-all", ignore=()), "cuda") == [{}]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    out = {}
    for head in ("dense", "int8"):
        runner = torch_engine.load(
            tiny_llama_dir, info, w8, EngineSettings.from_dict({"lm_head": head})
        )
        net = runner.gen.model
        assert type(net.lm_head).__name__ == ("Int8Linear" if head == "int8" else "Linear")
        assert net.model.embed_tokens.weight.dtype == torch.float32  # the table stays float
        out[head] = runner.logits(ids)
    sqnr = 10 * torch.log10(out["dense"].pow(2).sum() / (out["dense"] - out["int8"]).pow(2).sum())
    assert 25.0 < float(sqnr) < 200.0, float(sqnr)  # changed (really int8), and close
    with pytest.raises(LlmoptError, match="int4"):
        load_generator(tiny_llama_dir, "w8a16", lm_head="int4")


def test_unsupported_models_are_refused_with_the_way_out(tiny_bert_dir):
    with pytest.raises(UnsupportedModel) as err:
        NativeConfig.from_hf({"model_type": "gpt2", "hidden_size": 8})
    assert "hf engine" in str(err.value)
    with pytest.raises(UnsupportedModel, match="RoPE scaling 'yarn'"):
        NativeConfig.from_hf(
            {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}}
        )
    from llmopt.core.recipes import get_recipe
    from llmopt.model.info import inspect_model

    reason = get_engine("torch").incompatible(
        inspect_model(tiny_bert_dir), get_recipe("fp32"), "cpu"
    )
    assert reason and "embedding" in reason


def test_decode_benchmark_script_runs_on_cpu(tmp_path):
    out = tmp_path / "d.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "decode.py"),
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--prompt-len",
        "8",
        "--new-tokens",
        "8",
        "--batches",
        "1",
        "2",
        "--modes",
        "fp32",
        "int8",
        "--hf",
        "--threads",
        "1",
        "--linear",
        "default",
        "GEMV_EVEN=off,FUSE_SILU=off",
        "--lm-head",
        "dense",
        "int8",
        "--json",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert {(r["mode"], r["batch"]) for r in res["native"]} == {
        ("fp32", 1),
        ("fp32", 2),
        ("int8", 1),
    }
    int8 = [r for r in res["native"] if r["mode"] == "int8"]
    labels = [(r["linear"], r["lm_head"]) for r in int8]  # one point per setting, interleaved
    lin = "GEMV_EVEN=off,FUSE_SILU=off"
    assert labels == [(x, h) for x in ("default", lin) for h in ("dense", "int8")]
    # the quantized head reads fewer bytes and moves the logits further from the dense model's
    assert int8[1]["weight_GB"] < int8[0]["weight_GB"]
    assert int8[1]["logits_sqnr_db_vs_dense"] < int8[0]["logits_sqnr_db_vs_dense"]
    bad = subprocess.run(
        cmd[:2] + ["--linear", "GEMV_EVEN=maybe"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode != 0 and "NAME=on|off" in bad.stderr
    assert all(r["tok_s"] > 0 and r["achieved_GBps"] > 0 for r in res["native"])
    # each point's garbage collections during its timed decode (the heap frozen after warm-up)
    assert all(len(r["gc_collections"]) == 3 and r["gc_ms"] >= 0 for r in res["native"])
    assert [h["match_prefix"] for h in res["hf"]] == [8, 8]  # same greedy tokens as HF


def test_decode_benchmark_rounds_interleave_and_report_the_spread(tmp_path):
    """`decode.py --rounds 2`: the points run A B A B, and each gets its median, range and ratio
    to the first point of the same round."""
    out = tmp_path / "d.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--shape", "tiny"]
    cmd += ["--device", "cpu", "--prompt-len", "8", "--new-tokens", "8", "--modes", "int8"]
    cmd += ["--quant-batches", "1", "--threads", "1", "--linear", "default", "GEMV_EVEN=off"]
    cmd += ["--rounds", "2", "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    order = [(r["round"], r["linear"]) for r in res["native"]]
    assert order == [(0, "default"), (0, "GEMV_EVEN=off"), (1, "default"), (1, "GEMV_EVEN=off")]
    first, second = res["rounds"]
    assert first["rounds"] == second["rounds"] == 2
    assert first["ratio_to_first"] == [1.0, 1.0]
    rows = res["native"]
    assert second["ratio_to_first"] == [
        rows[1]["tok_s"] / rows[0]["tok_s"],
        rows[3]["tok_s"] / rows[2]["tok_s"],
    ]
    assert second["tok_s_min"] <= second["tok_s_median"] <= second["tok_s_max"]


def test_loads_compressed_tensors_int4_from_llmopt_quantize(tiny_llama_dir, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from llmopt.core.recipes import get_recipe
    from llmopt.model.info import inspect_model
    from llmopt.quant import build_checkpoint

    info, rec = inspect_model(tiny_llama_dir), get_recipe("w4a16-rtn-g64")
    out = tmp_path / "w4"
    build_checkpoint(tiny_llama_dir, rec, tmp_path / "ckpt")  # as the build stage does first
    get_engine("torch").build(tmp_path / "ckpt", info, rec, out)
    runner = get_engine("torch").load(out, info, rec, EngineSettings())
    assert type(runner.gen.model.model.layers[0].self_attn.q_proj).__name__ == "Int4Linear"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():  # transformers + compressed-tensors decompress the same folder
        ref = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    mine = runner.logits(ids)
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - mine).pow(2).sum())
    assert sqnr > 35, float(sqnr)  # same int4 values; only bf16 activations in the kernel differ


@pytest.mark.parametrize("recipe", ["w4a16-gptq-g32", "fp8-dynamic"])
def test_loads_a_bfloat16_folder_from_quantize_dtype_auto(tiny_llama_dir, tmp_path, recipe):
    # `llmopt quantize --dtype auto` on a GPU writes a bf16 checkpoint in bf16: scales and the
    # unquantized tensors too. The engine must read those scales in its own compute dtype.
    pytest.importorskip("compressed_tensors")
    from llmopt.engines.native.weights import load_model
    from llmopt.quant import CalibrationConfig, quantize

    cal = CalibrationConfig(num_samples=2, seq_len=32)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    pos, table = torch.arange(8).unsqueeze(0), torch.tensor([[1]])

    def logits(folder):
        model = load_model(folder, "cpu", torch.float32)
        Generator(model, max_batch=1, max_seq_len=32)  # allocates the KV cache
        with torch.inference_mode():
            return model(ids, pos, table, prefill=True, last_only=False).float()

    ref = logits(tiny_llama_dir)
    sqnr = {}
    for dtype in ("float32", "bfloat16"):
        quantize(tiny_llama_dir, recipe, tmp_path / dtype, calibration=cal, dtype=dtype)
        out = logits(tmp_path / dtype)
        assert torch.isfinite(out).all()
        sqnr[dtype] = float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))
    # Calibrating in bf16 rounds differently (int4 codes near a boundary flip), but it must be
    # as faithful to the original model as calibrating in float32.
    assert sqnr["bfloat16"] > sqnr["float32"] - 3, sqnr


GEMV_CHECK = """
import torch
from llmopt.engines.native import attention as A
from llmopt.engines.native import linear as L
from llmopt.engines.native import triton_kernels as T
# the dot kernel's configs: unsplit, split 2 and 8 in whole tiles or not, one split left empty
first = {}
for i, c in enumerate(T.wo8_dot.configs):
    first.setdefault((c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]), i)
dots = [first[c] for c in ((64, 512, 1), (64, 512, 2), (32, 256, 8), (32, 1024, 2))]
for kernel, cfgs in (("gemv", (0, 2, 6)), ("dot", dots)):
    for cfg in cfgs:
        A.INTERPRET_CONFIG = cfg
        shapes = ((96, 256, 1), (200, 512, 3), (64, 384, 4), (48, 1024, 16), (40, 520, 2), (24, 90, 1),
                  (128, 2048, 1))  # (the last unmasked: the GEMV's largest tiles divide it)
        for n, k, m in shapes:  # (k % 4 != 0: int8 not read as words)
            w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
            counters = L.tile_counters(n, m, "cpu")
            for q, s in (L.quantize_int8(w), L.quantize_fp8(w)):
                for _ in range(2):  # the counters are left zero for the next launch
                    y = L.wo_mm(x, q, s.contiguous(), kernel, counters)
                    assert not counters.any(), counters
                ref = x @ (q.float() * s[:, None]).t()
                err = float((y - ref).norm() / ref.norm())
                assert err < 1e-5, (kernel, cfg, n, k, m, q.dtype, err)
                if kernel == "gemv" and m == 1:  # the down projection reading silu(gate) * up
                    gu = torch.randn(1, 2 * k) * 3
                    y = L.wo_mm(gu, q, s.contiguous(), kernel, gated=True)
                    g, u = gu.chunk(2, dim=-1)
                    ref = (torch.nn.functional.silu(g) * u) @ (q.float() * s[:, None]).t()
                    err = float((y - ref).norm() / ref.norm())
                    assert err < 1e-5, ("gated", cfg, n, k, q.dtype, err)
# RMSNorm inside the GEMV (the norm's weight folded into w's columns) and the residual add in
# its epilogue, masked and unmasked, both formats; `norm_linear` / `linear_add` only where on
for cfg in (0, 6):
    A.INTERPRET_CONFIG = cfg
    for n, k in ((96, 256), (128, 2048), (40, 520)):
        w, x, r = torch.randn(n, k) * 0.02, torch.randn(1, k) * 3, torch.randn(1, n)
        eps = 1e-5
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        # int8, FP8 and dense weights with unit scales (`DenseLinear`; fp32 here, bf16 on a GPU)
        for q, s in (L.quantize_int8(w), L.quantize_fp8(w), (w, torch.ones(n))):
            wd = q.float() * s[:, None]
            y = L.wo_mm(x, q, s.contiguous(), "gemv", norm_eps=eps)
            err = float((y - xn @ wd.t()).norm() / (xn @ wd.t()).norm())
            assert err < 1e-5, ("norm", cfg, n, k, q.dtype, err)
            y = L.wo_mm(x, q, s.contiguous(), "gemv", residual=r)
            ref = r + x @ wd.t()
            assert float((y - ref).norm() / ref.norm()) < 1e-5, ("residual", cfg, n, k, q.dtype)
# the GEMV's unmasked variant is for shapes its largest tiles divide
tiles = {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for c in T.wo8_gemv.configs}
assert (L.GEMV_TILE_N, L.GEMV_TILE_K) == (max(t[0] for t in tiles), max(t[1] for t in tiles))
print("ok")
"""


def test_triton_int8_fp8_kernels_match_reference_in_triton_interpreter():
    pytest.importorskip("triton")  # not a dependency on CPU hosts; CUDA hosts have it
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", GEMV_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_silu_down_matches_the_two_ops_on_gpu():
    """The FP8 down projection computing silu(gate) * up as it reads it (opt-in) gives the
    separate ops' result (bf16, both roundings kept) at one row, and declines where it does not
    apply (fusion off, two rows, int8 weights: the GEMV's gated input is checked for int8 too)."""
    from llmopt.engines.native import linear as L

    torch.manual_seed(0)
    w = torch.randn(512, 1024, device="cuda") * 0.02
    gu = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16) * 3
    g, u = gu.chunk(2, dim=-1)
    int8 = L.Int8Linear(*L.quantize_int8(w), None, torch.bfloat16)
    assert L.silu_down(int8, gu) is None
    got = L.wo_mm(gu[0], int8.weight, int8.scale_f, kernel="gemv", gated=True)
    torch.testing.assert_close(
        got[None], int8(torch.nn.functional.silu(g) * u), rtol=2e-2, atol=2e-2
    )
    if not L.fp8_supported():
        return
    down = L.Fp8Linear(*L.quantize_fp8(w), None, torch.bfloat16)
    assert down.triton_kernel
    want = down(torch.nn.functional.silu(g) * u)
    assert not L.FUSE_SILU and L.silu_down(down, gu) is None  # opt-in
    L.FUSE_SILU = True
    try:
        got = L.silu_down(down, gu)
        assert got is not None and got.shape == want.shape == (1, 1, 512)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        assert L.silu_down(down, gu.expand(2, 1, 2048)) is None
    finally:
        L.FUSE_SILU = False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16", "int8-cuda", "fp8-cuda"])
def test_gemv_pdl_matches_the_plain_launch_on_gpu(fmt, monkeypatch):
    """The one-row GEMV launched as a programmatic dependent (`GEMV_PDL`: its first weight tile
    loaded before it waits for its input) gives the plain launch's output in every variant,
    with and without masks, eagerly and inside a compiled step's CUDA graph, where its input
    is written by the kernel just before it (an Inductor kernel, then the other GEMV). `-cuda`:
    the CUDA C++ GEMV (`GEMV_CUDA`), else Triton's."""
    from llmopt.engines.native import linear as L

    fmt, _, cuda = fmt.partition("-")
    monkeypatch.setattr(L, "GEMV_CUDA", bool(cuda))
    if cuda:
        from llmopt.engines.native import cuda_gemv

        if cuda_gemv.missing_tools():
            pytest.skip(f"the CUDA GEMV cannot be built here ({cuda_gemv.missing_tools()})")
        assert L.prepare_cuda_gemv("cuda") == ""  # built and checked: a failure is a failure
    if fmt == "fp8" and not L.fp8_supported():
        pytest.skip("FP8 needs compute capability 8.9+")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(0)

    def weights(n, k):
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        if fmt == "bf16":
            return w.bfloat16(), torch.ones(n, device="cuda")
        q, s = (L.quantize_int8 if fmt == "int8" else L.quantize_fp8)(w)
        return q, s.float().contiguous()

    def row(k):
        return torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)

    def both(fn, *args, **kw):
        monkeypatch.setattr(L, "GEMV_PDL", False)
        want = fn(*args, **kw)
        monkeypatch.setattr(L, "GEMV_PDL", True)
        got = fn(*args, **kw)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        return want

    for n, k in ((1024, 2048), (1000, 2000)):  # unmasked (`GEMV_TILE_*` divide it), masked
        w, s = weights(n, k)
        x, x2, r = row(k), row(2 * k), row(n)
        both(L.wo_mm, x, w, s, "gemv")
        both(L.wo_mm, x2, w, s, "gemv", gated=True)
        both(L.wo_mm, x, w, s, "gemv", norm_eps=1e-5)
        both(L.wo_mm, x, w, s, "gemv", residual=r)

    (w1, s1), (w2, s2) = weights(1024, 2048), weights(2048, 1024)

    def step(x):
        h = L.wo_mm(x * 2, w1, s1, "gemv", norm_eps=1e-5)
        return L.wo_mm(h, w2, s2, "gemv", residual=x)

    x = row(2048)
    want = both(step, x)
    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, CUDA-graph capture, replay
        got = both(lambda: compiled(x).clone())
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()


def _gemv_variants(g, n: int, k: int):
    """A row x (K), a residual r (N) and the one-row GEMV's variants as (args, kwargs) for
    `wo_mm(*args, q, s, "gemv", **kwargs)`: plain, SiLU x up of a 2K row, norm, residual."""
    x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
    x2 = torch.randn(1, 2 * k, device="cuda", generator=g, dtype=torch.bfloat16)
    r = torch.randn(1, n, device="cuda", generator=g, dtype=torch.bfloat16)
    variants = [
        ((x,), {}),
        ((x2,), {"gated": True}),
        ((x,), {"norm_eps": 1e-5}),
        ((x,), {"residual": r}),
    ]
    return x, r, variants


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_prefetch_matches_on_gpu(monkeypatch):
    """`GEMV_PREFETCH`: the int8 GEMV through the autotuner that also tries each weight tile
    loaded one step ahead gives the plain GEMV's outputs (to bf16 rounding: the two may pick
    configs that sum in another order) in every variant, with and without masks, with K one
    tile or less, through the plain and the dependent launch."""
    from llmopt.engines.native import linear as L

    monkeypatch.setattr(L, "GEMV_CUDA", False)  # (a switch of the Triton GEMV)

    g = torch.Generator(device="cuda").manual_seed(1)
    for n, k in ((1024, 2048), (1000, 2000), (96, 256)):  # unmasked, masked, one tile of K
        w = torch.randn(n, k, device="cuda", generator=g) * 0.05
        q, s = L.quantize_int8(w)
        s = s.float().contiguous()
        _x, _r, variants = _gemv_variants(g, n, k)
        for pdl in (False, True):
            monkeypatch.setattr(L, "GEMV_PDL", pdl)
            for args, kw in variants:
                monkeypatch.setattr(L, "GEMV_PREFETCH", False)
                want = L.wo_mm(*args, q, s, "gemv", **kw)
                monkeypatch.setattr(L, "GEMV_PREFETCH", True)
                got = L.wo_mm(*args, q, s, "gemv", **kw)
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int8_gemv_through_half_precision_matches_on_gpu(monkeypatch):
    """`GEMV_INT8_F16`: the int8 GEMV's bytes made floats through f16 pairs (inline PTX) give
    the same weights, so the same outputs as the plain GEMV, in every variant, with and
    without masks, and the dequantized reference."""
    from llmopt.engines.native import linear as L

    monkeypatch.setattr(L, "GEMV_CUDA", False)  # (a switch of the Triton GEMV)

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((1024, 2048), (1000, 2000)):
        w = torch.randn(n, k, device="cuda", generator=g) * 0.05
        w[0, :8] = torch.linspace(-1, 1, 8)  # a row whose codes reach -127 and 127
        q, s = L.quantize_int8(w)
        s = s.float().contiguous()
        x, r, variants = _gemv_variants(g, n, k)
        for args, kw in variants:
            monkeypatch.setattr(L, "GEMV_INT8_F16", False)
            want = L.wo_mm(*args, q, s, "gemv", **kw)
            monkeypatch.setattr(L, "GEMV_INT8_F16", True)
            got = L.wo_mm(*args, q, s, "gemv", **kw)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        ref = x.float() @ (q.float() * s[:, None]).t()
        torch.testing.assert_close(got.float() - r.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantized_decode_on_gpu_matches_dense(tiny_llama_dir):
    dense = load_generator(tiny_llama_dir, "bf16", device="cuda", compile=False)
    want, _ = dense.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    for rec, head in (("w8a16", None), ("fp8-dynamic", None), ("fp8-dynamic", "int8")):
        gen = load_generator(tiny_llama_dir, rec, device="cuda", compile=True, lm_head=head)
        got, _ = gen.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(got) == 8 and got[:2] == want[:2], (rec, head)


def test_calibrated_candidates_are_calibrated_on_the_gpu_when_there_is_one(
    tiny_llama_dir, tmp_path
):
    from llmopt.core.recipes import get_recipe
    from llmopt.model.info import inspect_model
    from llmopt.quant import build_checkpoint

    recipe = get_recipe("w4a16-gptq-g32")
    facts = build_checkpoint(tiny_llama_dir, recipe, tmp_path / "q")
    assert facts["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert facts["recipe"]["dtype"] == "float32"  # the recipe's, wherever it was built
    # The engine only takes the calibrated checkpoint in; it refuses to build one itself.
    info = inspect_model(tiny_llama_dir)
    built = get_engine("torch").build(tmp_path / "q", info, recipe, tmp_path / "artifact")
    assert built["kernel"] == "int4" and (tmp_path / "artifact" / "config.json").exists()
    with pytest.raises(ValueError, match="calibrated checkpoints"):
        get_engine("torch").build(tiny_llama_dir, info, recipe, tmp_path / "raw")


def test_prompt_logprobs_equal_log_softmax_of_transformers_logits(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    gen = load_generator(tiny_llama_dir, max_batch=4, max_seq_len=128, block_size=4)
    gen.max_prefill_tokens = 16  # the 3 prompts take 2 forwards, two of them right-padded together
    gen.prompt_logprob_chunk = 3 * gen.model.cfg.vocab_size  # the LM head 3 rows at a time
    prompts = [[257, 72, 101, 108, 108, 111], [5, 9, 200, 31], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    asks = [None, 3, 0]  # off; top-3 (right-padded beside the first); the chosen token only
    for i, (p, k) in enumerate(zip(prompts, asks, strict=True)):
        gen.add(i, p, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k))
    first = {ev.seq_id: ev for ev in gen.step()}
    assert sorted(first) == [0, 1, 2]
    later = [ev for _ in range(2) for ev in gen.step()]
    assert len(later) == 6 and all(ev.prompt_logprobs is None for ev in later)  # sent once
    assert first[0].prompt_logprobs is None
    for i in (1, 2):
        p, k, got = prompts[i], asks[i], first[i].prompt_logprobs
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
        assert len(got) == len(p) and got[0] is None
        for t in range(1, len(p)):
            lp, tops = got[t]
            assert lp == pytest.approx(float(ref[t - 1, p[t]]), abs=1e-4)
            assert len(tops) == k
            if k:
                vals, ids = torch.topk(ref[t - 1], k)
                assert [x for x, _ in tops] == ids.tolist()
                assert [v for _, v in tops] == pytest.approx(vals.tolist(), abs=1e-4)
    # Generated tokens are unchanged by asking for prompt log-probabilities.
    plain = load_generator(tiny_llama_dir, max_batch=1, max_seq_len=128, block_size=4)
    want, _ = plain.generate(prompts[1], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [first[1].token_id] + [ev.token_id for ev in later if ev.seq_id == 1] == want


def _count_prefill_tokens(gen: Generator) -> list[int]:
    """Record the tokens (padding included) of every model forward outside the decode step."""
    counted: list[int] = []
    decode, in_decode = gen.steps.decode, [False]

    def wrapped(packed, *rest):
        in_decode[0] = True
        try:
            return decode(packed, *rest)
        finally:
            in_decode[0] = False

    gen.steps.decode = wrapped
    gen.model.register_forward_pre_hook(
        lambda _m, args, _kw: None if in_decode[0] else counted.append(args[0].numel()),
        with_kwargs=True,
    )
    return counted


def _run_alone(gen: Generator, prompt: list[int], params: SamplingParams):
    gen.add("ref", prompt, params)
    evs = gen.step()
    while evs[-1].finish_reason is None:
        evs.extend(gen.step())
    gen.remove("ref")
    return [e.token_id for e in evs], evs[0].prompt_logprobs


@pytest.mark.parametrize("budget", [5, 7, 12])
def test_chunked_prefill_equals_unchunked(tiny_llama_dir, budget):
    # Block size 4: chunks of 5 or 7 tokens (less the running decodes) end mid-block; the
    # 25- and 18-token prompts take several chunks while other sequences decode.
    gen = load_generator(tiny_llama_dir, max_batch=4, max_seq_len=128, block_size=4)
    prompts = [[5, 6, 7], list(range(20, 45)), [9] * 11, list(range(60, 78))]
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, prompt_logprobs=k) for k in (2, 0, None, 3)
    ]
    ref = [_run_alone(gen, p, sp) for p, sp in zip(prompts, params, strict=True)]
    counted = _count_prefill_tokens(gen)
    out: dict[int, list[int]] = {}
    plp: dict[int, list] = {}
    partial, step = set(), 0
    while len(out) < 4 or any(len(v) < 10 for v in out.values()):
        if step in (0, 2, 3):  # 0 and 1 together; 2 and 3 join while others decode
            for i in {0: (0, 1), 2: (2,), 3: (3,)}[step]:
                gen.add(i, prompts[i], params[i])
        decodes = sum(gen.prefill_pending(k) == 0 for k in gen.running)
        counted.clear()
        for ev in gen.step(prefill_budget=budget - decodes):
            out.setdefault(ev.seq_id, []).append(ev.token_id)
            if ev.prompt_logprobs is not None:
                plp.setdefault(ev.seq_id, []).append(ev.prompt_logprobs)
            if ev.finish_reason:
                gen.remove(ev.seq_id)
        assert sum(counted) <= budget - decodes  # padding included
        partial |= {k for k in gen.running if 0 < gen.prefill_pending(k) < len(prompts[k])}
        step += 1
        assert step < 100
    assert {1, 3} <= partial  # the long prompts were prefilled over several steps
    assert [out[i] for i in range(4)] == [r[0] for r in ref]
    assert sorted(plp) == [0, 1, 3] and all(len(v) == 1 for v in plp.values())  # sent once
    for i in (0, 1, 3):
        (got,), want = plp[i], ref[i][1]
        assert len(got) == len(want) == len(prompts[i]) and got[0] is None and want[0] is None
        for a, b in zip(got[1:], want[1:], strict=True):
            assert a[0] == pytest.approx(b[0], abs=1e-5)
            assert [t for t, _ in a[1]] == [t for t, _ in b[1]]
            assert [v for _, v in a[1]] == pytest.approx([v for _, v in b[1]], abs=1e-5)
    assert gen.free_blocks == gen.num_blocks - 1 and not gen.running


def test_chunked_prefill_batches_chunks_within_the_budget(tiny_llama_dir):
    gen = load_generator(tiny_llama_dir, max_batch=4, max_seq_len=128, block_size=4)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [
        list(range(30, 39)),
        list(range(40, 47)),
        list(range(50, 60)),
        [1, 2, 3, 4, 5],
        [7, 8, 9],
    ]
    want = [_run_alone(gen, p, params)[0] for p in prompts]
    counted = _count_prefill_tokens(gen)
    out: dict[int, list[int]] = {}

    def step(budget: int) -> list[int]:
        counted.clear()
        evs = gen.step(prefill_budget=budget)
        for ev in evs:
            out.setdefault(ev.seq_id, []).append(ev.token_id)
            if ev.finish_reason:
                gen.remove(ev.seq_id)
        return [ev.seq_id for ev in evs]

    for i in range(3):
        gen.add(i, prompts[i], params)
    assert step(0) == [] and gen.prefill_pending(0) == 9  # no budget: nothing is prefilled
    assert step(6) == [] and counted == [6]  # 6 of the first prompt's 9
    # 3 (paged, after the 6) + 7 + 3 (first chunks): 7 and 3 padded together would be 14 > 13.
    assert step(13) == [0, 1] and counted == [3, 7, 3]
    assert [gen.prefill_pending(k) for k in range(3)] == [0, 0, 7]
    assert step(20) == [2, 0, 1] and counted == [7]  # the rest of prompt 2; two decodes
    while gen.running:
        step(8)
    # 5 + 3 real tokens and 2 of padding fit a budget of 10: one right-padded forward.
    gen.add(3, prompts[3], params)
    gen.add(4, prompts[4], params)
    assert step(10) == [3, 4] and counted == [10]
    while gen.running:
        step(10)
    assert [out[i] for i in range(5)] == want


@pytest.mark.parametrize("sliced", [False, True])
def test_paged_path_runs_right_padded_chunks_at_any_start(tiny_llama_dir, monkeypatch, sliced):
    # Two sequences whose first 5 and 3 tokens are in the cache continue with chunks of 4 and 6
    # tokens (one forward, right-padded, ending mid-block): the logits at every real position
    # equal those of one causal prefill over the whole prompt. Sliced: the queries run 2 at a
    # time (scores of 2 sequences x 4 heads x 2 queries x 12 keys), as a long chunk's would.
    from llmopt.engines.native.model import Attention

    if sliced:
        monkeypatch.setattr(Attention, "max_score_elems", 2 * 4 * 2 * 12)
    native = load_model(tiny_llama_dir, "cpu", torch.float32)
    Generator(native, max_batch=2, max_seq_len=32, block_size=4)  # sets up the cache
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(3))
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.inference_mode():
        full = native(ids, torch.arange(9).expand(2, 9), tables, prefill=True, last_only=False)
        native.setup_cache(8, 4, torch.float32, "cpu")  # a fresh (zeroed) cache
        for row, n in ((0, 5), (1, 3)):
            native(
                ids[row : row + 1, :n], torch.arange(n)[None], tables[row : row + 1], prefill=True
            )
        chunk = torch.stack([torch.cat([ids[0, 5:9], ids[0, :2] * 0]), ids[1, 3:9]])
        pos = torch.tensor([[5], [3]]) + torch.arange(6)
        got = native(chunk, pos, tables, prefill=False, last_only=False)
    torch.testing.assert_close(got[0, :4], full[0, 5:9], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], full[1, 3:9], atol=1e-4, rtol=1e-4)


def test_step_without_budget_finishes_a_chunked_prompt(tiny_llama_dir):
    gen = load_generator(tiny_llama_dir, max_batch=2, max_seq_len=64, block_size=4)
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    want, want_plp = _run_alone(gen, list(range(30, 45)), params)
    gen.add(0, list(range(30, 45)), params)
    gen.add(1, [5, 6, 7], params)
    assert gen.step(prefill_budget=6) == [] and gen.prefill_pending(0) == 9
    evs = gen.step()  # no budget: the rest of 0 (paged) and all of 1 (SDPA) at once
    assert sorted(ev.seq_id for ev in evs) == [0, 1] and not gen.prefill_pending(1)
    got = [ev for ev in evs if ev.seq_id == 0]
    while not gen.finished(0):
        got += [ev for ev in gen.step() if ev.seq_id == 0]
    assert [ev.token_id for ev in got] == want
    assert [x[0] for x in got[0].prompt_logprobs[1:]] == pytest.approx(
        [x[0] for x in want_plp[1:]], abs=1e-5
    )


def test_compiled_prefill_matches_eager_and_step_time_is_attributed(tiny_llama_dir):
    """`compile_prefill=True` (Inductor, dynamic shapes; a C++ compile on the CPU) gives the
    same tokens as the eager prefill for batches and prompt lengths it was not warmed up with,
    and `gen.time` splits the steps into prefill and decode."""
    prompts = [list(range(20, 45)), [9] * 11, [5, 6, 7], [100, 101]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    eager = load_generator(tiny_llama_dir, max_batch=4, max_seq_len=128, block_size=4)
    want = [eager.generate(p, params)[0] for p in prompts]
    gen = load_generator(
        tiny_llama_dir, max_batch=4, max_seq_len=128, block_size=4, compile_prefill=True
    )
    assert gen.warmup_prefill() > 0 and gen.time.prefill_forwards == 0  # warm-up not counted
    for i, p in enumerate(prompts):
        gen.add(i, p, params)
    out: dict[int, list[int]] = {}
    while gen.running and not all(gen.finished(k) for k in gen.running):
        for ev in gen.step():
            out.setdefault(ev.seq_id, []).append(ev.token_id)
    assert [out[i] for i in range(4)] == want
    t = gen.time
    assert t.prefill_tokens == sum(map(len, prompts)) and t.prefill_forwards == 1
    assert t.decode_steps == 5  # the first token comes from the prefill
    assert 0 < t.prefill_s + t.decode_s <= t.step_s
    assert load_generator(tiny_llama_dir, max_batch=1).warmup_prefill() == 0.0  # nothing compiled


def test_batched_sampling_is_row_independent_and_filters():
    """sample_rows: each row's pick does not depend on the other rows (a seeded row equals its
    draw alone), top_k=1 and a tiny top_p reduce to the argmax, and logprobs are log-softmax."""
    from llmopt.engines.native.sampling import sample_rows

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    P = SamplingParams
    params = [
        P(),
        P(temperature=0.8, seed=1),
        P(temperature=1.0, top_k=1, seed=2),
        P(temperature=1.0, top_p=1e-6, seed=3),
        P(temperature=1.3, top_k=5, top_p=0.9, seed=4, logprobs=3),
        P(logprobs=2),
    ]

    def rngs():
        return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

    together = sample_rows(logits, params, rngs())
    alone = [
        sample_rows(logits[i : i + 1], [p], [g])[0]
        for i, (p, g) in enumerate(zip(params, rngs(), strict=True))
    ]
    assert together == alone
    best = logits.argmax(-1).tolist()
    assert together[0][0] == best[0] and together[2][0] == best[2] and together[3][0] == best[3]
    assert together[4][0] in torch.topk(logits[4], 5).indices.tolist()
    logp = torch.log_softmax(logits, -1)
    tok, lp, top = together[5]
    assert tok == best[5] and lp == pytest.approx(float(logp[5, tok]))
    assert [t for t, _ in top] == torch.topk(logp[5], 2).indices.tolist()
    assert len(together[4][2]) == 3 and together[1][2] == []
    # Seeded draws repeat; the temperature-0.8 row is not always the argmax over many seeds.
    picks = {
        sample_rows(logits[1:2], [P(temperature=5.0)], [torch.Generator().manual_seed(s)])[0][0]
        for s in range(20)
    }
    assert len(picks) > 1


def test_nucleus_from_top_k_matches_the_full_sort():
    """Top-p keeps the same tokens whether a row's nucleus is found among its top NUCLEUS_K
    logits (peaked rows) or by sorting the whole row (flat rows, the fallback)."""
    from llmopt.engines.native.sampling import NUCLEUS_K, nucleus

    torch.manual_seed(1)
    V = 4 * NUCLEUS_K
    peaked, flat = torch.randn(3, V) * 8, torch.randn(3, V) * 0.1
    x = torch.cat([peaked, flat])
    q = torch.tensor([0.9, 0.5, 1.0, 0.9, 0.99, 1.0])[:, None]

    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # the plain definition
    p = torch.softmax(sorted_x, -1)
    drop = (p.cumsum(-1) - p > q) & (q < 1.0)
    want = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))

    got = nucleus(x, q)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], x[~torch.isinf(got)])
    kept = (~torch.isinf(got)).sum(-1).tolist()
    assert kept[2] == kept[5] == V and kept[0] < NUCLEUS_K and kept[3] > NUCLEUS_K  # both paths ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_split_matches_one_argmax(dtype):
    """The two-level greedy (chunks reduced apart, then combined) picks the same token as one
    argmax (the first maximum on ties, across chunks and inside one) and the same
    log-probability, for a vocabulary that is not a whole number of chunks, a chunk of -inf only
    (masked tokens) and a row whose maximum is in the padded last chunk."""
    from llmopt.engines.native.sampling import greedy_split

    torch.manual_seed(2)
    v = 1000  # 8 chunks of 125 at chunks=8; 7 of 143 plus a padded one at chunks=7
    x = (torch.randn(5, v) * 4).to(dtype)
    x[1, 300] = x[1, 700] = x[1].max() + 1  # tie across chunks: the first wins
    x[2, 10] = x[2, 11] = x[2].max() + 1  # tie inside a chunk
    x[3, :250] = float("-inf")  # whole chunks masked
    x[4, v - 1] = x[4].max() + 1  # maximum in the last (padded) chunk
    want = torch.argmax(x, -1)
    want_lp = x.float().gather(1, want[:, None]) - torch.logsumexp(x.float(), -1, keepdim=True)
    for chunks in (8, 7, 1):
        best, lp = greedy_split(x, chunks)
        assert torch.equal(best, want), chunks
        assert lp.dtype == dtype
        torch.testing.assert_close(lp.float(), want_lp.flatten().to(dtype).float())
    assert want[1] == 300 and want[2] == 10 and want[4] == v - 1


def test_failed_prefill_compile_falls_back_to_eager(tiny_llama_dir, monkeypatch):
    """A compile that fails at warm-up leaves the prefill eager, says why, and still serves."""

    def broken(model, **kw):
        def fwd(*a, **k):
            raise RuntimeError("Dynamo cannot trace this layer")

        return fwd

    monkeypatch.setattr(torch, "compile", broken)
    gen = load_generator(
        tiny_llama_dir, max_batch=2, max_seq_len=64, block_size=4, compile_prefill=True
    )
    assert gen.warmup_prefill() == 0.0
    assert "cannot trace" in gen.prefill_compile_error and gen.steps.prefill_forward is gen.model
    ids, _ = gen.generate([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(ids) == 3


def test_choices_sharing_a_prompt_score_it_once(tiny_llama_dir, monkeypatch):
    """n > 1: identical prompts prefilled in one forward compute their prompt log-probabilities
    once; every choice gets the same values as a lone request would."""
    gen = load_generator(tiny_llama_dir, max_batch=4, max_seq_len=64, block_size=4)
    prompt, params = list(range(30, 42)), SamplingParams(max_tokens=2, prompt_logprobs=2)
    alone = {}
    gen.add("solo", prompt, params)
    for ev in gen.step():
        alone = ev.prompt_logprobs
    gen.remove("solo")
    calls = []
    real = gen._prompt_logprobs
    monkeypatch.setattr(gen, "_prompt_logprobs", lambda *a: calls.append(1) or real(*a))
    for k in ("a", "b", "c"):
        gen.add(k, prompt, params)
    gen.add("other", list(range(50, 62)), params)
    got = {ev.seq_id: ev.prompt_logprobs for ev in gen.step()}
    assert len(calls) == 2  # one for the three identical prompts, one for the other
    assert got["a"] == got["b"] == got["c"] == alone and got["other"] != alone


def test_gemma3_local_window_and_rope_base_are_exercised(tmp_path):
    # The family check above passes only if the window and the local RoPE base are honoured:
    # without them, the same 24-token prompt gives clearly different logits.
    hf = _hf_model("gemma3", tmp_path)
    native = load_model(tmp_path, "cpu", torch.float32)
    assert native.cfg.local_layers == (0, 1, 2, 3, 4) and native.cfg.local_window == 8
    assert native.cfg.local_rope_theta == 10000.0 and native.cfg.rope_theta == 1e6
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    pos, tables = torch.arange(24).expand(1, 24), torch.tensor([[1, 2]])
    Generator(native, max_batch=1, max_seq_len=96)  # allocates the KV cache
    with torch.inference_mode():
        ref = hf(ids).logits
        good = native(ids, pos, tables, prefill=True, last_only=False)
        for layer in native.model.layers:
            layer.self_attn.window = None
        no_window = native(ids, pos, tables, prefill=True, last_only=False)
    torch.testing.assert_close(good, ref, atol=2e-4, rtol=1e-4)
    assert (no_window - ref).abs().max() > 0.05


def test_float8_kv_cache_is_written_rounded_and_read_upcast(tiny_llama_dir):
    """A float8 (e4m3) KV cache: keys/values are stored rounded to float8 and upcast as read, so
    the greedy continuation stays close to the bf16 cache's (the prompt's first token, computed
    from fresh keys, is identical)."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    prompt, params = list(range(30, 52)), SamplingParams(max_tokens=16, ignore_eos=True)
    outs = {}
    for name, kv in (("bf16", None), ("fp8", fp8)):
        native = load_model(tiny_llama_dir, "cpu", torch.bfloat16)
        gen = Generator(native, max_batch=1, max_seq_len=96, block_size=4, kv_dtype=kv)
        assert gen.model.model.layers[0].self_attn.k_cache.dtype == (kv or torch.bfloat16)
        outs[name], _ = gen.generate(prompt, params)
    assert outs["fp8"][0] == outs["bf16"][0]
    agree = sum(a == b for a, b in zip(outs["fp8"], outs["bf16"], strict=True))
    assert agree >= 12, (outs, agree)
