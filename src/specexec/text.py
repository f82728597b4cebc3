"""Incremental detokenization with OpenAI stop-sequence semantics, linear in the output's length."""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Turns the tokens of one generation, as they come, into text deltas.

    Each token is decoded in a short window (the tokens since the last one whose text was final, and
    one before them, so that decoders which treat a sequence's first token specially see the same
    context): the delta is what that window's text adds to the text of its first part. The deltas are
    the text, so what is sent is never rewritten, and the same tokens give the same text however they
    are split into steps. Clean-up of spaces is not applied (it would rewrite text already sent).

    A delta never ends inside a multi-byte character (held back until the next token completes it, or
    flushed as U+FFFD at the end) and never includes text that could still turn out to be the start of
    a stop sequence. Once a stop sequence appears, the text is cut just before it (the sequence itself
    is never returned), `stopped` is set, and `token_count` is the number of tokens up to the one that
    completed it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.token_count = 0  # tokens consumed: all of them, or those up to the stop sequence
        self.stopped = False
        self._window = 0  # first token of the decoding window
        self._read = 0  # tokens whose text is final
        self._pending = ""  # decoded text not returned yet (a possible start of a stop sequence)
        self._sent: list[str] = []

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._sent)

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        """Append a step's tokens; return the new text that is safe to send. `final` flushes everything."""
        for token in tokens:
            if self.stopped:
                break
            self.tokens.append(int(token))
            self.token_count += 1
            self._append(self._next_text())
        if final and not self.stopped:
            self._append(self._decode(self._window, len(self.tokens))[len(self._settled()) :])
            self._read = self._window = len(self.tokens)
        end = len(self._pending)
        if not (final or self.stopped):
            end -= self._stop_prefix_len(self._pending)
        delta, self._pending = self._pending[:end], self._pending[end:]
        if delta:
            self._sent.append(delta)
        return delta

    def _next_text(self) -> str:
        """The text the last token completes ("" while it ends inside a character or shows nothing)."""
        settled = self._settled()
        window = self._decode(self._window, len(self.tokens))
        if len(window) <= len(settled) or window.endswith(REPLACEMENT):
            return ""
        self._window, self._read = self._read, len(self.tokens)
        return window[len(settled) :]

    def _settled(self) -> str:
        return self._decode(self._window, self._read)

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self.tokenizer.decode(
            self.tokens[start:end], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _append(self, text: str) -> None:
        """Add decoded text; cut at the first stop sequence it completes."""
        if not text:
            return
        before = len(self._pending)
        self._pending += text
        hits = [i for i in (self._pending.find(s, max(0, before - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            self._pending = self._pending[: min(hits)]
            self.stopped = True

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop sequence."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
