"""The KV caches of recent generations, kept so that a prompt that starts with the same tokens (the next
turn of a chat, a shared system prompt) skips their prefill.

`stream(..., prefix_cache=cache)` takes the entry whose tokens share the longest prefix with its prompt,
truncates its runners to that prefix (a truncation costs nothing: slots above the length are scratch),
prefills only the rest, and puts its runners back, with the tokens they hold, when the generation ends
(finished, stopped by its caller, or cancelled during prefill). Entries are evicted least recently used
first, to stay within a byte budget; an entry in use is out of the cache, so one generation never
shares its buffers with another.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class CachedPrefix:
    """Runners of a finished generation of a model pair: `tokens`, the first `runner.read` of which
    each one holds, less any a draft skipped (`SlotRunner.skip`; the draft's runner is None if it was
    never needed)."""

    tokens: list[int]
    target_model: object
    draft_model: object | None
    target: object  # a runner (ModelRunner or LlamaCppRunner)
    draft: object | None

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (self.draft.nbytes if self.draft is not None else 0)

    def shared_with(self, prompt: Sequence[int]) -> int:
        """How many leading tokens this entry's target cache shares with `prompt`."""
        n = min(len(prompt), self.target.length)
        for i in range(n):
            if self.tokens[i] != prompt[i]:
                return i
        return n


class PrefixCache:
    """At most `max_bytes` of KV caches, by token prefix, least recently used evicted first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: list[CachedPrefix] = []  # least recently used first
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, target, draft, prompt: Sequence[int]) -> CachedPrefix | None:
        """Remove and return the entry of this model pair sharing the most leading tokens with `prompt`
        (None if none shares any)."""
        with self._lock:
            best, shared = None, 0
            for entry in self._entries:
                if entry.target_model is not target or entry.draft_model is not draft:
                    continue
                n = entry.shared_with(prompt)
                if n and n >= shared:  # ties go to the most recent
                    best, shared = entry, n
            if best is not None:
                self._entries.remove(best)
            return best

    def put(self, tokens: Sequence[int], target, draft, target_runner, draft_runner) -> None:
        """Keep the runners of models `target` and `draft` (None for plain decoding), each holding the
        first `read` of `tokens`, as the most recent entry."""
        entry = CachedPrefix(list(tokens), target, draft, target_runner, draft_runner)
        with self._lock:
            if entry.nbytes > self.max_bytes:
                return
            self._entries.append(entry)
            total = sum(e.nbytes for e in self._entries)
            while total > self.max_bytes:
                total -= self._entries.pop(0).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
