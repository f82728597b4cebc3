"""Incremental detokenization with OpenAI stop-sequence semantics."""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Turns the tokens of one generation, step by step, into text deltas.

    The deltas always add up to the final text. A delta never ends inside a multi-byte character (a
    trailing U+FFFD is held back until the next step completes it or the generation ends), and never
    includes text that could still turn out to be the start of a stop sequence. Once a stop sequence
    appears, the text is cut just before it (the sequence itself is never returned) and `stopped` is set.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # everything returned so far
        self.stopped = False

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        """Append a step's tokens; return the new text that is safe to send. `final` flushes everything."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = self._first_stop(full)
        if cut is not None:
            full, final, self.stopped = full[:cut], True, True
        end = len(full)
        if not final:
            end = len(full.rstrip(REPLACEMENT))
            end -= self._stop_prefix_len(full[:end])
        if not full.startswith(self.text):
            # Decoding is not prefix-stable for this tokenizer here (rare: space clean-up rules); wait
            # until it is again, and at the end send what differs from the common prefix.
            if not final:
                return ""
            delta = full[_common_prefix(full, self.text) :]
            self.text = full
            return delta
        if end <= len(self.text):
            return ""
        delta = full[len(self.text) : end]
        self.text = full[:end]
        return delta

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop sequence."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
