"""Prompt-lookup candidates: continuations copied from earlier in the sequence, at no draft cost.

Code and chat answers repeat what came before (identifiers, signatures, quoted text). If the last n tokens
occurred earlier, the tokens that followed them then are a cheap guess for what follows now. SpecExec
grafts such a chain into its tree; the target verifies it with the rest, and the cache walk stays exact
because the tree is still a function of the committed tokens alone.
"""

from __future__ import annotations

import torch

from specexec.tree import DraftTree

MAX_NGRAM = 3  # longest suffix matched; shorter ones are tried when it does not occur


def ngram_continuation(tokens: torch.Tensor, length: int, max_ngram: int = MAX_NGRAM) -> torch.Tensor:
    """The (up to) `length` tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for the largest n <= max_ngram that occurs; empty when none does."""
    for n in range(min(max_ngram, tokens.numel() - 1), 0, -1):
        windows = tokens[:-1].unfold(0, n, 1)  # (len - n, n): every n-gram but the final one
        hits = (windows == tokens[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start : start + length]
    return tokens[:0]


def graft_chain(
    tree: DraftTree, node: int, chain: torch.Tensor, max_depth: int, eos_token_ids: torch.Tensor
) -> list[int]:
    """Add `chain` below `node`, reusing children that already hold the next token; returns new nodes.

    New nodes get their parent's score (they cost no draft probability mass), unexpanded, so the draft
    cache never claims their KV. Stops at `max_depth` and after an end-of-sequence token.
    """
    added = []
    for token in chain.tolist():
        ended = node > 0 and bool(torch.isin(tree.tokens[node], eos_token_ids))
        if ended or int(tree.depths[node]) >= max_depth:
            break
        children = tree.children(node)
        same = children[tree.tokens[children] == token]
        if same.numel():
            node = int(same[0])
            continue
        if tree.size == tree.capacity:
            break
        parent = torch.tensor([node], device=tree.tokens.device)
        node = int(tree.add(parent, torch.tensor([token], device=parent.device), tree.scores[parent])[0])
        added.append(node)
    return added
