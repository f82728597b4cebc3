"""Acceptance rules: which tokens of a verified draft tree are emitted.

Both rules return the accepted path (tree nodes, root excluded) and one more token sampled from the
target where the path ends, so every step emits at least one token.
"""

from __future__ import annotations

import torch

from specexec.sampling import SamplingParams, argmax, probs_from_logits, sample
from specexec.tree import DraftTree


def cache_walk(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """SpecExec's rule: lossless for any tree, however it was drafted.

    Sample the target at the root; while the sample is a child of the current node, move there and sample
    again. Each emitted token is an exact target sample given the tokens before it; the tree only decides
    how far one target pass reaches. `logits` (size, V) are the target's, row i at tree node i.
    """
    path: list[int] = []
    node = 0
    while True:
        token = _draw(logits[node], params, generator)
        children = tree.children(node)
        match = children[tree.tokens[children] == token]
        if not match.numel():
            return path, token
        node = int(match[0])  # siblings hold distinct tokens
        path.append(node)


def rejection_walk(
    tree: DraftTree,
    logits: torch.Tensor,
    draft_probs: dict[int, torch.Tensor],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Multi-draft speculative sampling (SpecInfer, Sequoia); with one child per node it is exactly the
    Leviathan/Chen chain rule.

    At each node the children, drawn from q without replacement and tried in draw order, are accepted with
    probability min(1, p(x)/q(x)); after a rejection p becomes the residual norm(max(p - q, 0)) and x is
    removed from q. If no child is accepted, the extra token is sampled from what is left of p.
    """
    if params.greedy:
        return cache_walk(tree, logits, params, generator)  # p is one-hot: accept the child equal to it
    path: list[int] = []
    node = 0
    while True:
        p = probs_from_logits(logits[node], params)  # (V,)
        children = tree.children(node)
        accepted = None
        if children.numel():
            q = draft_probs[node].clone()  # (V,)
            for child in children.tolist():
                x = int(tree.tokens[child])
                u = torch.rand((), generator=generator, dtype=torch.float64)
                if u * q[x] < p[x]:  # u < p/q without dividing
                    accepted = child
                    break
                p = _normalized((p - q).clamp_(min=0.0), fallback=p)
                q[x] = 0.0
                q = _normalized(q, fallback=q)
        if accepted is None:
            return path, int(sample(p, generator))
        node = accepted
        path.append(node)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(argmax(logits))
    return int(sample(probs_from_logits(logits, params), generator))


def _normalized(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    # A zero residual only arises when p == q, where the rule accepts with certainty; keep rounding safe.
    return x / total if total > 0 else fallback
