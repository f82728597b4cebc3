"""A draft that only proposes the most common tokens: a smaller LM head, so a cheaper draft pass.

The LM head of a small draft is a large share of its weights (Qwen2.5 0.5B: 136M of 494M parameters,
151,936 rows), and every draft pass reads all of it. A draft that scores only the first `size` token ids
reads `size` rows instead. Byte-level BPE vocabularies list their tokens in merge order, which follows
frequency, so the first ids are the common ones (the first 32,000 Qwen2.5 ids cover about 94% of the
tokens of Python's standard library source). Every end-of-sequence id, and the ids the caller names (the
tokenizer's special tokens), are always kept.

The other ids get logit -inf: the draft gives them probability 0. That costs acceptance where the target
wants a rare token, never correctness, since every method verifies with the target's full distribution
(the rejection rules take the draft's probabilities as they are, zeros included).

Each backend applies the restriction its own way (`specexec.backends.torch.draft_vocab`: a smaller
`nn.Linear`; `specexec.backends.llamacpp.draft_gguf`: a GGUF copy whose output layer holds only the kept
rows); what ids are kept, and how their logits are spread back over the whole vocabulary, is decided here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class DraftVocabError(ValueError):
    """A vocabulary restriction that cannot be applied as asked."""


def full_vocab_logits(logits: torch.Tensor, kept: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits (..., V') of the ids `kept` as rows over the whole vocabulary (..., `vocab`), -inf elsewhere."""
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))  # (..., V)
    return full.index_copy_(-1, kept, logits)


def kept_token_ids(size: int, vocab: int, always: Iterable[int] = (), multiple: int = 64) -> list[int]:
    """The ids a head restricted to `size` of `vocab` ids scores, ascending: ids < `size`, the ids in
    `always`, and the next ids up to a whole `multiple` of rows."""
    check_draft_vocab(size, vocab)
    kept = {*range(size), *(i for i in always if 0 <= i < vocab)}
    padding = [i for i in range(size, vocab) if i not in kept][: -len(kept) % multiple]
    return sorted(kept.union(padding))


def check_draft_vocab(size: int, vocab: int) -> None:
    """Refuse a restriction that keeps nothing or everything of a `vocab`-token head."""
    if not 0 < size < vocab:
        raise DraftVocabError(f"--draft-vocab must be between 1 and {vocab - 1} (the vocabulary), got {size}")
