"""Real text for calibration and quality checks, from gensim's test data (installed offline).

- `wikipedia_articles()`: ~100 real English Wikipedia articles as plain prose (~2.7 MB).
- `wikipedia_split()`: a fixed split by article into calibration (~70%) and evaluation (~30%)
  parts, so that quantizers never calibrate on the text that perplexity is measured on.
- `evaluation_sentences()`: sentences of the evaluation part, for embedding checks.
- `wordsim353()`, `simlex999()`: word pairs with human similarity scores.

gensim is used as a data package only: its Python modules need compiled dependencies we do not
install, so nothing here imports it; we locate its folder with `importlib.util.find_spec`.
"""

from __future__ import annotations

import bz2
import hashlib
import html
import importlib.util
import logging
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmopt.assets.models import llmopt_home
from llmopt.core.atomic import read_json, write_json
from llmopt.core.errors import AssetMissingError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Article",
    "TextSplit",
    "gensim_data_dir",
    "wikipedia_articles",
    "wikipedia_split",
    "calibration_text",
    "evaluation_text",
    "sentences",
    "evaluation_sentences",
    "calibration_sentences",
    "wordsim353",
    "simlex999",
    "token_windows",
    "special_prefix",
    "window_convention",
    "strip_wiki_markup",
]

log = logging.getLogger(__name__)

GENSIM_PIN = "gensim==4.4.0"
WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# Bump when the markup stripper changes so cached JSON from an older version is re-parsed.
_STRIPPER_VERSION = 2
_MIN_ARTICLE_CHARS = 1000  # stubs and disambiguation pages are lists, not prose
_EVAL_PERCENT = 30


@dataclass(frozen=True)
class Article:
    title: str
    text: str


@dataclass(frozen=True)
class TextSplit:
    calibration: list[Article]
    evaluation: list[Article]


def gensim_data_dir() -> Path:
    """gensim's `test/test_data` folder (located, never imported).

    >>> (gensim_data_dir() / "wordsim353.tsv").is_file()  # doctest: +SKIP
    True
    """
    spec = importlib.util.find_spec("gensim")
    folder = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" if spec else None
    if folder is None or not folder.is_dir():
        raise AssetMissingError(
            f"the text data needs {GENSIM_PIN} (its test_data folder)",
            hint=f"run `llmopt assets install` (or: pip install --no-deps {GENSIM_PIN})",
        )
    return folder


def _data_file(name: str) -> Path:
    path = gensim_data_dir() / name
    if not path.is_file():
        raise AssetMissingError(
            f"{path} is missing from the gensim package",
            hint=f"reinstall it: pip install --no-deps --force-reinstall {GENSIM_PIN}",
        )
    return path


# --- wiki markup -> prose ------------------------------------------------------------------
# Hand-written rather than gensim.corpora.wikicorpus.filter_wiki: importing that module imports
# gensim, which needs its compiled extensions and numpy/scipy pins we do not install. This
# stripper covers what the 107 articles of the dump use; it aims at readable prose, not at a
# faithful MediaWiki renderer.

_BLOCK_TAGS = re.compile(
    r"<(ref|math|gallery|timeline|score|syntaxhighlight|source|imagemap|hiero|chem)\b[^>]*?"
    r"(/>|>.*?</\1\s*>)",
    re.DOTALL | re.IGNORECASE,
)
_COMMENT = re.compile(r"<!--.*?(-->|$)", re.DOTALL)
_BRACES = re.compile(r"\{\{|\}\}|^[ \t:]*\{\||^[ \t]*\|\}", re.MULTILINE)
_LINK_BRACKETS = re.compile(r"\[\[|\]\]")
_DROP_NAMESPACES = {"file", "image", "media", "category"}
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(-[a-z]+)?$")
_EXT_LINK = re.compile(r"\[(?:https?:)?//[^\s\]]+\s*([^\]]*)\]")
# A bare URL, without the sentence's own punctuation after it.
_URL = re.compile(r"https?://[^\s<>\]|]*[^\s<>\]|.,;:!?)'\"]")
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$")
_TAIL_SECTIONS = {
    "see also",
    "references",
    "notes",
    "footnotes",
    "external links",
    "further reading",
    "bibliography",
    "sources",
    "citations",
}


def _strip_nested(text: str) -> str:
    # Templates {{...}} nest, and tables {|...|} hold templates; a stack finds their extents.
    out, stack, last = [], [], 0
    for m in _BRACES.finditer(text):
        tok = m.group().strip(" \t:")
        if tok in ("{{", "{|"):
            if not stack:
                out.append(text[last : m.start()])
            stack.append(tok)
        elif stack and ((tok == "}}" and stack[-1] == "{{") or (tok == "|}" and stack[-1] == "{|")):
            stack.pop()
            if not stack:
                last = m.end()
    if not stack:
        out.append(text[last:])
    return "".join(out)


def _link_text(inner: str) -> str:
    target, _, label = inner.partition("|")
    prefix, colon, rest = target.strip().lstrip(":").partition(":")
    if colon:
        p = prefix.strip().lower()
        if p in _DROP_NAMESPACES or (not label and _LANG_PREFIX.match(p)):
            return ""
        if not label:
            return rest
    # [[a|b|c]] only occurs for files (dropped above); the last part is the shown text.
    return label.rsplit("|", 1)[-1] if label else target


def _strip_links(text: str) -> str:
    # [[target|label]] -> label; files and categories (whose captions hold links) vanish.
    out, stack = [], []
    for m in _LINK_BRACKETS.finditer(text):
        if m.group() == "[[":
            stack.append((m.start(), len(out)))
            continue
        if not stack:
            continue
        start, _ = stack.pop()
        if stack:  # a link inside a caption: resolved when the outer one closes
            continue
        out.append((start, m.end(), _link_text(_strip_links(text[start + 2 : m.start()]))))
    pieces, last = [], 0
    for start, end, repl in out:
        pieces.append(text[last:start])
        pieces.append(repl)
        last = end
    pieces.append(text[last:])
    return "".join(pieces)


def strip_wiki_markup(wikitext: str) -> str:
    """Plain prose of one article's wikitext (paragraphs separated by blank lines)."""
    text = _COMMENT.sub("", wikitext)
    text = _BLOCK_TAGS.sub("", text)
    text = _strip_nested(text)
    text = _strip_links(text)
    text = _EXT_LINK.sub(r"\1", text)
    text = _URL.sub("", text)
    text = _TAG.sub("", text)
    text = re.sub(r"'{2,}", "", text)  # ''italic'', '''bold'''
    text = html.unescape(text).replace("\xa0", " ")
    paragraphs, current = [], []
    for raw in text.splitlines():
        line = raw.strip()
        heading = _HEADING.match(line)
        if heading:
            if heading.group(1).strip().lower() in _TAIL_SECTIONS:
                break  # what follows is citations and link lists, not prose
            line = ""
        if line.startswith(("|", "!", "__")):  # table debris, magic words like __TOC__
            line = ""
        line = re.sub(r"^[*#:;]+\s*", "", line)  # list and indent markers
        line = re.sub(r"\(\s*[,;]?\s*\)", "", line)  # "( )" left where a template was removed
        line = re.sub(r"\s+([,.;:])", r"\1", re.sub(r"\s{2,}", " ", line)).strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def _parse_dump(path: Path) -> list[Article]:
    articles = []
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if not elem.tag.endswith("}page"):
                continue
            ns = elem.tag[: -len("page")]
            title = elem.findtext(f"{ns}title") or ""
            is_article = elem.findtext(f"{ns}ns") == "0" and elem.find(f"{ns}redirect") is None
            raw = elem.findtext(f"{ns}revision/{ns}text") or ""
            elem.clear()  # keep memory flat while streaming
            if not is_article or raw.lstrip().upper().startswith("#REDIRECT"):
                continue
            text = strip_wiki_markup(raw)
            if len(text) >= _MIN_ARTICLE_CHARS:
                articles.append(Article(title, text))
    return articles


def wikipedia_articles() -> list[Article]:
    """Articles of gensim's shortened English Wikipedia dump as plain prose, in dump order.

    Parsed once (a few seconds) and cached as JSON under `<llmopt_home>/data/`.

    Raises:
        AssetMissingError: gensim's data files are not installed.

    >>> arts = wikipedia_articles()  # doctest: +SKIP
    >>> arts[0].title  # doctest: +SKIP
    'Anarchism'
    """
    source = _data_file(WIKI_DUMP)
    cache = llmopt_home() / "data" / f"enwiki-articles-v{_STRIPPER_VERSION}.json"
    stat = source.stat()
    key = {"source": WIKI_DUMP, "size": stat.st_size, "stripper_version": _STRIPPER_VERSION}
    try:
        cached = read_json(cache)
        if cached.get("key") == key:
            return [Article(a["title"], a["text"]) for a in cached["articles"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or damaged cache: parse again below
    log.info("parsing %s (once)", source)
    articles = _parse_dump(source)
    write_json(cache, {"key": key, "articles": [a.__dict__ for a in articles]})
    return articles


def _in_evaluation(title: str) -> bool:
    # A stable hash (not Python's salted hash()) so the split is the same in every process.
    return int(hashlib.sha256(title.encode()).hexdigest()[:8], 16) % 100 < _EVAL_PERCENT


def wikipedia_split() -> TextSplit:
    """Split the articles ~70/30 into calibration and evaluation parts, by a hash of the title.

    Deterministic, and no article is in both parts.

    >>> s = wikipedia_split()  # doctest: +SKIP
    >>> {a.title for a in s.calibration} & {a.title for a in s.evaluation}  # doctest: +SKIP
    set()
    """
    arts = wikipedia_articles()
    return TextSplit(
        calibration=[a for a in arts if not _in_evaluation(a.title)],
        evaluation=[a for a in arts if _in_evaluation(a.title)],
    )


def calibration_text() -> str:
    """The calibration articles joined by blank lines (for quantizer calibration)."""
    return "\n\n".join(a.text for a in wikipedia_split().calibration)


def evaluation_text() -> str:
    """The evaluation articles joined by blank lines (for perplexity).

    >>> len(evaluation_text()) > 500_000  # doctest: +SKIP
    True
    """
    return "\n\n".join(a.text for a in wikipedia_split().evaluation)


_ABBREVIATIONS = {
    "mr",
    "mrs",
    "ms",
    "dr",
    "prof",
    "st",
    "jr",
    "sr",
    "vs",
    "etc",
    "e.g",
    "i.e",
    "cf",
    "no",
    "vol",
    "pp",
    "p",
    "c",
    "ca",
    "fig",
    "approx",
    "inc",
    "ltd",
    "co",
    "gen",
    "col",
    "lt",
    "capt",
    "sgt",
    "gov",
    "rev",
    "jan",
    "feb",
    "mar",
    "apr",
    "jun",
    "jul",
    "aug",
    "sep",
    "sept",
    "oct",
    "nov",
    "dec",
    "mt",
    "ft",
    "al",
    "ed",
    "eds",
    "est",
    "u.s",
    "u.k",
}
_BOUNDARY = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_LAST_WORD = re.compile(r"(\S+)$")


def _split_paragraph(par: str) -> list[str]:
    out, start = [], 0
    for m in _BOUNDARY.finditer(par):
        word = _LAST_WORD.search(par[start : m.start() + 1])
        token = word.group(1) if word else ""
        core = token.rstrip(".").lstrip("\"'(").lower()
        # Not a boundary after "Dr.", "e.g.", an initial ("J. R. R. Tolkien") or "U.S.".
        if token.endswith(".") and (
            core in _ABBREVIATIONS or re.fullmatch(r"[a-z](\.[a-z])*", core)
        ):
            continue
        out.append(par[start : m.end()].strip())
        start = m.end()
    out.append(par[start:].strip())
    return [s for s in out if s]


def sentences(articles: list[Article], min_words: int = 5, max_words: int = 60) -> list[str]:
    """Split articles into sentences, keeping those of `min_words`..`max_words` words.

    Order follows the articles and the text; duplicates are kept (see `evaluation_sentences`).

    >>> sentences([Article("t", "Dr. Smith went home early today. It rained all day long there.")])
    ['Dr. Smith went home early today.', 'It rained all day long there.']
    """
    out = []
    for article in articles:
        for par in article.text.split("\n\n"):
            for s in _split_paragraph(par):
                if min_words <= len(s.split()) <= max_words:
                    out.append(s)
    return out


def evaluation_sentences(n: int = 2000) -> list[str]:
    """`n` distinct sentences of the evaluation articles, spread evenly over all of them.

    Raises:
        ValueError: the evaluation part has fewer than `n` distinct sentences.

    >>> len(evaluation_sentences(100))  # doctest: +SKIP
    100
    """
    distinct = list(dict.fromkeys(sentences(wikipedia_split().evaluation)))
    if len(distinct) < n:
        raise ValueError(
            f"the evaluation articles hold only {len(distinct)} distinct sentences, "
            f"fewer than the {n} asked for; ask for at most {len(distinct)}"
        )
    # Evenly spaced picks cover every article instead of only the first few.
    return [distinct[i * len(distinct) // n] for i in range(n)]


def calibration_sentences(n: int = 300) -> list[str]:
    """`n` distinct sentences of the calibration articles (never scored by verification),
    spread evenly over all of them: what static activation scales are calibrated on.

    >>> len(calibration_sentences(50))  # doctest: +SKIP
    50
    """
    distinct = list(dict.fromkeys(sentences(wikipedia_split().calibration)))
    if len(distinct) < n:
        raise ValueError(
            f"the calibration articles hold only {len(distinct)} distinct sentences, "
            f"fewer than the {n} asked for; ask for at most {len(distinct)}"
        )
    return [distinct[i * len(distinct) // n] for i in range(n)]


def _word_pairs(name: str) -> list[tuple[str, str, float]]:
    pairs = []
    for line in _data_file(name).read_text(encoding="utf-8").splitlines():
        parts = line.strip().split("\t")
        if not line.strip() or line.startswith("#") or len(parts) < 3:
            continue
        try:
            pairs.append((parts[0], parts[1], float(parts[2])))
        except ValueError:  # a header row without '#'
            continue
    return pairs


def wordsim353() -> list[tuple[str, str, float]]:
    """WordSim-353 pairs (word1, word2, human score 0-10).

    >>> wordsim353()[0]  # doctest: +SKIP
    ('love', 'sex', 6.77)
    """
    return _word_pairs("wordsim353.tsv")


def simlex999() -> list[tuple[str, str, float]]:
    """SimLex-999 pairs (word1, word2, human similarity 0-10).

    >>> simlex999()[0]  # doctest: +SKIP
    ('old', 'new', 1.58)
    """
    return _word_pairs("simlex999.txt")


def special_prefix(tokenizer) -> list[int]:
    """The token ids the tokenizer puts before a text of its own accord (its BOS, usually).

    Found by encoding a probe with and without special tokens, so it follows whatever the
    tokenizer's post-processor does (`add_bos_token`, a template processor), not a guess from
    `bos_token` alone: GPT-2 style tokenizers define a BOS but never add it; Llama 3, Gemma and
    Mistral tokenizers add it.

    >>> class Tok:
    ...     def __call__(self, text, add_special_tokens=True):
    ...         ids = [ord(c) for c in text]
    ...         return {"input_ids": ([1] if add_special_tokens else []) + ids}
    >>> special_prefix(Tok())
    [1]
    """
    probe = "The quick brown fox."
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return full[:k]
    return []


def window_convention(tokenizer) -> str:
    """How `token_windows` feeds text to this tokenizer's model, in words (for results).

    >>> class Tok:
    ...     bos_token = "<s>"
    ...     def __call__(self, text, add_special_tokens=True):
    ...         return {"input_ids": [ord(c) for c in text]}
    >>> window_convention(Tok())
    'no prefix token in each window (the tokenizer adds none)'
    """
    prefix = special_prefix(tokenizer)
    if not prefix:
        return "no prefix token in each window (the tokenizer adds none)"
    return (
        f"each window starts with the tokenizer's own prefix {prefix} (its BOS), "
        "as the model reads its input"
    )


def token_windows(tokenizer, text: str, window: int = 512, count: int = 16) -> torch.Tensor:
    """Cut `text` into `count` windows of `window` tokens, in order: the unit quantization
    calibrates and evaluates on, and verification scores perplexity over.

    Each window is fed as the model reads input: where the tokenizer puts a prefix before a
    text (a BOS token: Llama 3, Gemma, Mistral...), every window starts with it and holds
    `window - len(prefix)` tokens of text, as lm-evaluation-harness starts its rolling
    log-likelihood windows with the prefix token. A model that always saw BOS at position 0 in
    training scores badly without it (the text is then out of distribution); tokenizers that
    add nothing (GPT-2 style, SmolLM2) get plain consecutive text. `window_convention` says
    which, for the results.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: held-out prose (`evaluation_text()`).
        window: tokens per window, prefix included (the context each token is predicted from
            is at most this).
        count: number of windows; fewer are returned if the text runs out (never padded).

    Returns:
        (N, window) int64 tensor.
    """
    import torch  # heavy: only the callers that tokenize pay for it

    prefix = special_prefix(tokenizer)
    body = window - len(prefix)
    if body < 2:
        raise ValueError(f"a window of {window} tokens leaves no room after the prefix {prefix}")
    # verbose=False: the whole text is longer than the model's context on purpose (it is cut
    # into windows below); transformers would warn about that length.
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    n = min(count, len(ids) // body)
    if n == 0:
        raise ValueError(
            f"evaluation text has {len(ids)} tokens, fewer than one window of {window}"
        )
    rows = torch.tensor(ids[: n * body], dtype=torch.long).view(n, body)
    if prefix:
        rows = torch.cat([torch.tensor([prefix] * n, dtype=torch.long), rows], dim=1)
    return rows
