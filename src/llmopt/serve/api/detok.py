"""Token ids to streamed text: incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE (a multi-byte character spans tokens)
and for SentencePiece (a token's leading space depends on its left neighbour). So, as vLLM and
TGI do, each step decodes a short window twice, with and without the new tokens, and emits the
difference once it no longer ends in an incomplete character (U+FFFD).

Stop strings: text that could still grow into a stop string is held back, so a client never sees
a piece of the stop string; when one appears, the text is cut before it.

>>> s = StopChecker(["\\n\\n"])
>>> s.push("Hello\\n"), s.push("\\nWorld")
(('Hello', False), ('', True))
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer", "StopChecker"]

_CONTEXT = 5  # prompt tokens kept as left context (leading-space rules of SentencePiece)


class IncrementalDetokenizer:
    """Feed generated token ids, get the new text. One per sequence; not thread-safe."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # ids before this are already emitted as text

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as is)."""
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""


class StopChecker:
    """Cuts the output at the first stop string and holds back text that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # all text so far (up to the stop, once found)
        self.sent = 0  # characters of `text` already emitted

    def push(self, delta: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit now, stopped)."""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out, False
        # Emitted text never ends in a prefix of a stop string, so a stop starts at >= sent.
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.text = self.text[self.sent : cut], self.text[:cut]
            self.sent = cut
            return out, True
        hold = self._held(self.text)
        end = len(self.text) - hold
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, False

    def flush(self) -> str:
        """The held-back tail at the end of generation (no stop string appeared)."""
        out, self.sent = self.text[self.sent :], len(self.text)
        return out

    def _held(self, text: str) -> int:
        # Longest suffix of `text` that is a proper prefix of some stop string.
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
