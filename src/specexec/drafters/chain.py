"""A chain of k sampled draft tokens, for classic speculative sampling (`sd`)."""

from __future__ import annotations

import torch

from specexec.drafters.base import Draft, DraftRequest, TreeDraftRunner, expandable
from specexec.runner import ModelRunner
from specexec.sampling import probs_from_logits, sample
from specexec.tree import DraftTree


class ChainDrafter:
    def __init__(self, runner: ModelRunner, length: int) -> None:
        self.runner = runner
        self.length = length
        self.max_tree_size = length + 1

    def propose(self, request: DraftRequest) -> Draft:
        tree = DraftTree(int(request.committed[-1]), self.max_tree_size, request.committed.device)
        draft = Draft(tree)
        steps = TreeDraftRunner(self.runner, request, tree)
        node = torch.zeros(1, dtype=torch.long, device=tree.tokens.device)
        for i in range(min(self.length, request.max_depth)):
            if not expandable(tree, request)[node]:
                break  # the last draft token ended the sequence
            logits = steps.expand_root() if i == 0 else steps.expand(node)  # (1, V)
            q = probs_from_logits(logits, request.sampling)  # (1, V)
            draft.draft_probs[int(node)] = q[0]
            node = tree.add(node, sample(q, request.generator))
        draft.draft_calls = steps.calls
        return draft
