"""SpecInfer-style sampled trees: several distinct sampled first tokens, each grown into a sampled chain."""

from __future__ import annotations

import torch

from specexec.drafters.base import Draft, DrafterBase, DraftRequest, TreeDraftRunner, expandable
from specexec.sampling import probs_from_logits, sample, sample_without_replacement
from specexec.tree import DraftTree


class SampledTreeDrafter(DrafterBase):
    def __init__(self, budget: int, branches: int = 4) -> None:
        self.branches = max(1, min(branches, budget))
        self.depth = max(1, budget // self.branches)
        self.max_tree_size = self.branches * self.depth + 1

    def propose(self, request: DraftRequest) -> Draft:
        tree = DraftTree(int(request.committed[-1]), self.max_tree_size, request.committed.device)
        draft = Draft(tree)
        steps = TreeDraftRunner(request, tree)
        if request.max_depth < 1:
            return draft
        logits = steps.expand_root()  # (1, V)
        q = probs_from_logits(logits, request.sampling)[0]  # (V,)
        if request.sampling.greedy:
            # q is one-hot; distinct branches come from the draft's own ranking instead.
            first = torch.topk(logits[0], self.branches).indices
        else:
            first = sample_without_replacement(q, self.branches, request.generator)
        draft.draft_probs[0] = q
        leaves = tree.add(torch.zeros_like(first), first)
        for _ in range(min(self.depth, request.max_depth) - 1):
            leaves = leaves[expandable(tree, request)[leaves]]
            if not leaves.numel():
                break
            q = probs_from_logits(steps.expand(leaves), request.sampling)  # (L, V)
            for leaf, q_leaf in zip(leaves.tolist(), q, strict=True):
                draft.draft_probs[leaf] = q_leaf
            leaves = tree.add(leaves, sample(q, request.generator))
        draft.draft_calls = steps.calls
        return draft
