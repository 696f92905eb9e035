"""The text assets: markup stripping, the calibration/evaluation split, sentences, word pairs."""

from __future__ import annotations

import importlib.util
import json

import pytest

from llmopt.assets import text
from llmopt.assets.models import llmopt_home
from llmopt.assets.text import Article, sentences, strip_wiki_markup
from llmopt.core.errors import AssetMissingError

needs_gensim = pytest.mark.skipif(
    importlib.util.find_spec("gensim") is None, reason="gensim data not installed"
)

WIKITEXT = """{{Infobox person
| name = Ada {{nowrap|Lovelace}}
| image = x.jpg
}}
'''Ada Lovelace''' (10 December 1815 – 27 November 1852) was an English [[mathematician]]
and [[Writer|writer]].<ref name="a">{{cite web|url=http://example.com|title=T}}</ref>
She is known for her work on the [[Analytical Engine]].<ref>Plain ref.</ref><!-- hidden -->
[[File:Ada.jpg|thumb|A portrait with a [[link]] inside.]]

== Life ==
{| class="wikitable"
|-
| cell {{tmpl}} || cell
|}
She met [[Charles Babbage]] in 1833, see [http://example.com/x the site] or http://bare.org.
&nbsp;Her notes <sup>were</sup> published in 1843.

== References ==
* {{cite book|title=Should vanish}}
* A reference line that should vanish too.
[[Category:Mathematicians]]
[[de:Ada Lovelace]]
"""


def test_strip_wiki_markup() -> None:
    out = strip_wiki_markup(WIKITEXT)
    for junk in ("{{", "}}", "[[", "]]", "<ref", "<!--", "{|", "|}", "'''", "==", "http", "<sup>"):
        assert junk not in out, junk
    assert "Ada Lovelace (10 December 1815 – 27 November 1852) was an English mathematician" in out
    assert "and writer." in out
    assert "She met Charles Babbage in 1833, see the site or." in out
    assert "Her notes were published in 1843." in out
    for gone in ("Infobox", "portrait", "cell", "Plain ref", "hidden", "vanish", "Mathematicians"):
        assert gone not in out, gone
    assert "de:" not in out


def test_unbalanced_template_does_not_crash() -> None:
    assert strip_wiki_markup("Before text. {{open template") == "Before text."


def test_sentence_splitter() -> None:
    art = Article(
        "t",
        "Dr. Smith met J. R. R. Tolkien in the U.S. during the war. It rained, e.g. all day long. "
        "Short one. What happened next was not recorded anywhere!\n\nA new paragraph starts here now.",
    )
    assert sentences([art]) == [
        "Dr. Smith met J. R. R. Tolkien in the U.S. during the war.",
        "It rained, e.g. all day long.",
        "What happened next was not recorded anywhere!",
        "A new paragraph starts here now.",
    ]
    assert sentences([art], min_words=1, max_words=2) == ["Short one."]


@needs_gensim
def test_articles_are_clean_prose_and_cached() -> None:
    arts = text.wikipedia_articles()
    assert 90 <= len(arts) <= 110
    total = sum(len(a.text) for a in arts)
    assert 2_000_000 < total < 3_500_000
    assert "Anarchism" in {a.title for a in arts}
    assert len({a.title for a in arts}) == len(arts)
    joined = "\n".join(a.text for a in arts)
    for junk in ("{{", "[[", "<ref", "]]", "}}", "#REDIRECT", "&nbsp;"):
        assert junk not in joined, junk
    cache = llmopt_home() / "data" / f"enwiki-articles-v{text._STRIPPER_VERSION}.json"
    assert len(json.loads(cache.read_text())["articles"]) == len(arts)
    assert text.wikipedia_articles() == arts  # from the cache


@needs_gensim
def test_damaged_cache_is_reparsed() -> None:
    arts = text.wikipedia_articles()
    cache = llmopt_home() / "data" / f"enwiki-articles-v{text._STRIPPER_VERSION}.json"
    cache.write_text("{broken")
    assert text.wikipedia_articles() == arts


@needs_gensim
def test_split_is_disjoint_and_deterministic() -> None:
    split = text.wikipedia_split()
    cal = {a.title for a in split.calibration}
    ev = {a.title for a in split.evaluation}
    assert cal and ev and not cal & ev
    assert len(cal) + len(ev) == len(text.wikipedia_articles())
    assert 0.2 < len(ev) / (len(cal) + len(ev)) < 0.45
    again = text.wikipedia_split()
    assert [a.title for a in again.evaluation] == [a.title for a in split.evaluation]
    assert text.evaluation_text() == "\n\n".join(a.text for a in split.evaluation)
    assert len(text.evaluation_text()) > 500_000 and len(text.calibration_text()) > 1_000_000


@needs_gensim
def test_evaluation_sentences() -> None:
    sents = text.evaluation_sentences(2000)
    assert len(sents) == 2000 == len(set(sents))
    assert sents == text.evaluation_sentences(2000)
    assert all(5 <= len(s.split()) <= 60 for s in sents)
    cal = "\n".join(a.text for a in text.wikipedia_split().calibration)
    assert sum(s in cal for s in sents[::50]) <= 2  # from the evaluation articles
    with pytest.raises(ValueError, match="at most"):
        text.evaluation_sentences(10**6)


@needs_gensim
def test_word_pairs() -> None:
    ws = text.wordsim353()
    assert len(ws) == 353
    assert ws[0] == ("love", "sex", 6.77)
    assert all(0 <= s <= 10 for _, _, s in ws)
    sl = text.simlex999()
    assert len(sl) == 999 and sl[0] == ("old", "new", 1.58)


def test_missing_gensim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(text.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AssetMissingError) as e:
        text.wordsim353()
    assert "gensim==4.4.0" in e.value.hint
