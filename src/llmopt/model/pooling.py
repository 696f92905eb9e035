"""How an embedder turns token states into one vector, read from its sentence-transformers files.

sentence-transformers describes the head of an embedding model in small JSON files next to the
weights: `modules.json` lists the modules (Transformer, Pooling, Normalize), the Pooling module's
`config.json` says which pooling (`pooling_mode_mean_tokens`, `pooling_mode_cls_token`,
`pooling_mode_lasttoken`), `sentence_bert_config.json` the truncation length, and
`config_sentence_transformers.json` the instruction prompts (Qwen3-Embedding's "query" prompt,
E5-style "query: " / "passage: " prefixes). A folder without them gets the architecture's usual
pooling: mean for encoders (BERT-style), last token for decoders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.core.errors import UnsupportedModelError

__all__ = ["EmbeddingHead", "read_embedding_head", "POOLING_MODES"]

# sentence-transformers' pooling_mode_* keys, by the name llmopt.engines.pooling.pool uses.
POOLING_MODES = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "last"}
# Prompt names of config_sentence_transformers.json that mean "the text is a query".
_QUERY_NAMES = ("query", "search_query", "retrieval.query", "retrieval_query")
_DOCUMENT_NAMES = ("document", "passage", "search_document", "retrieval.passage", "corpus")


@dataclass(frozen=True)
class EmbeddingHead:
    """The pooling, normalization, truncation and prompts of one embedder.

    >>> EmbeddingHead("cls", True).query("what is it?")
    'what is it?'
    >>> EmbeddingHead("last", True, query_prompt="Instruct: find\\nQuery:").query("x")
    'Instruct: find\\nQuery:x'
    """

    pooling: str  # "mean" | "cls" | "last"
    normalize: bool
    max_seq_length: int | None = None
    query_prompt: str | None = None  # prepended to queries (sentence-transformers: prompt + text)
    document_prompt: str | None = None  # prepended to corpus texts

    def query(self, text: str) -> str:
        """`text` as the model expects a query (its instruction prompt prepended, if any)."""
        return (self.query_prompt or "") + text

    def document(self, text: str) -> str:
        """`text` as the model expects a corpus document."""
        return (self.document_prompt or "") + text


def read_embedding_head(folder: Path, encoder: bool) -> EmbeddingHead:
    """The embedding head of `folder` from its sentence-transformers files, else the defaults.

    Args:
        folder: a model folder.
        encoder: whether the architecture is a bidirectional encoder (mean pooling by default);
            decoders default to last-token pooling.

    Raises:
        UnsupportedModelError: a pooling llmopt does not implement (max, weighted mean, or
            several at once), or an unreadable sentence-transformers file.

    >>> read_embedding_head(Path("no-such-folder"), encoder=True)
    EmbeddingHead(pooling='mean', normalize=False, max_seq_length=None, query_prompt=None, document_prompt=None)
    """
    folder = Path(folder)
    pooling = "mean" if encoder else "last"
    normalize = False
    for m in _read(folder / "modules.json", []):
        kind = str(m.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            cfg_path = folder / str(m.get("path", "")) / "config.json"
            if cfg_path.is_file():
                pooling = _pooling_mode(_read(cfg_path, {}), cfg_path)
    st = _read(folder / "sentence_bert_config.json", {})
    max_len = st.get("max_seq_length")
    prompts = _read(folder / "config_sentence_transformers.json", {}).get("prompts") or {}
    return EmbeddingHead(
        pooling=pooling,
        normalize=normalize,
        max_seq_length=int(max_len) if max_len else None,
        query_prompt=_first(prompts, _QUERY_NAMES),
        document_prompt=_first(prompts, _DOCUMENT_NAMES),
    )


def _pooling_mode(cfg: dict[str, Any], path: Path) -> str:
    on = [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_")]
    on = [k for k in on if cfg[f"pooling_mode_{k}"]]
    if "pooling_mode" in cfg and not on:  # newer sentence-transformers: one string field
        on = [
            {"mean": "mean_tokens", "cls": "cls_token"}.get(
                cfg["pooling_mode"], cfg["pooling_mode"]
            )
        ]
    picked = [POOLING_MODES.get(k) for k in on]
    if len(picked) != 1 or picked[0] is None:
        raise UnsupportedModelError(
            f"pooling {on or 'none'} in {path} is not supported",
            hint="llmopt supports exactly one of mean (pooling_mode_mean_tokens), CLS "
            "(pooling_mode_cls_token) or last-token (pooling_mode_lasttoken) pooling",
        )
    return picked[0]


def _first(prompts: dict[str, Any], names: tuple[str, ...]) -> str | None:
    for name in names:
        if prompts.get(name):
            return str(prompts[name])
    return None


def _read(path: Path, default: Any) -> Any:
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(
            f"{path} is not readable JSON ({e})",
            hint=f"restore {path.name} from the model's original files",
        ) from e
