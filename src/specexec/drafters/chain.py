"""A chain of sampled draft tokens: classic speculative sampling (`sd`) and dynamic lookahead (`dsl`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specexec.budget.interfaces import ChainBudget, ChainStop, LookaheadSchedule
from specexec.drafters.base import Draft, DrafterBase, DraftRequest, TreeDraftRunner, expandable, plain_step
from specexec.sampling import argmax, probs_from_logits, sample
from specexec.tree import DraftTree


class ChainDrafter(DrafterBase):
    """Up to `length` draft tokens, one draft forward each.

    `schedule` adapts the length between steps; `stop` ends a draft early when the draft is unsure;
    `cost_stop` ends it where one more token is expected to cost more time than it returns.
    """

    def __init__(
        self,
        length: int,
        schedule: LookaheadSchedule | None = None,
        stop: ChainStop | None = None,
        max_length: int | None = None,
        cost_stop: ChainBudget | None = None,
    ) -> None:
        self.length = length
        self.schedule = schedule
        self.stop = stop
        self.cost_stop = cost_stop
        # A heuristic schedule has no ceiling of its own; the cache needs one.
        self.max_length = max_length or length
        self.max_tree_size = self.max_length + 1

    def propose(self, request: DraftRequest) -> Draft:
        if not self.drafts_now():
            return plain_step(request)
        tree = DraftTree(int(request.committed[-1]), self.max_tree_size, request.committed.device)
        draft = Draft(tree)
        steps = TreeDraftRunner(request, tree, self.cost_stop.catch_up if self.cost_stop else None)
        length = min(self.schedule.length if self.schedule else self.length, self.max_length)
        node = torch.zeros(1, dtype=torch.long, device=tree.tokens.device)
        for i in range(min(length, request.max_depth)):
            if not expandable(tree, request)[node]:
                break  # the last draft token ended the sequence
            logits = steps.expand_root() if i == 0 else steps.expand(node)  # (1, V)
            if request.sampling.greedy:
                # The cache walk verifies a greedy chain, so no q is kept; the draft's own softmax says
                # how sure it is.
                token, q = argmax(logits), None  # (1,)
            else:
                q = probs_from_logits(logits, request.sampling)[0]  # (V,)
                draft.draft_probs[int(node)] = q
                token = sample(q, request.generator)[None]  # (1,)
            node = tree.add(node, token)
            if self.stop is not None or self.cost_stop is not None:
                sure = torch.softmax(logits[0], -1) if q is None else q  # (V,)
                draft.confidences.append(float(sure[token]))
                if self.ends_chain(draft.confidences[-1]):
                    break
        draft.draft_calls = steps.calls
        draft.first_pass_tokens = steps.first_pass_tokens
        return draft

    def may_draft(self, steps: int = 1) -> bool:
        return self.cost_stop is None or self.cost_stop.may_draft(steps)

    def drafts_now(self) -> bool:
        """Whether this step drafts at all (the cost stop may pause drafting, or find it cannot pay)."""
        return self.cost_stop is None or self.cost_stop.drafts_now()

    def ends_chain(self, confidence: float) -> bool:
        """Whether the token just drafted, the draft's probability for it being `confidence`, is the
        chain's last. Both rules see every token (the cost stop keeps the chain's running estimate)."""
        by_confidence = self.stop is not None and self.stop.should_stop(confidence)
        by_cost = self.cost_stop is not None and self.cost_stop.should_stop(confidence)
        return by_confidence or by_cost

    def observe(self, draft: Draft, path: Sequence[int], target_seconds: float) -> None:
        """The stopping rules learn the chain's token probabilities and how many were accepted; the cost
        stop also how many tokens its first draft pass took in, and how long the target took."""
        accepted = len(path)
        if self.schedule is not None:
            self.schedule.observe(draft.tree.size - 1, accepted)
            self.schedule.length = min(self.schedule.length, self.max_length)
        if self.stop is not None:
            self.stop.observe(draft.confidences, accepted)
        if self.cost_stop is not None:
            self.cost_stop.observe(draft.confidences, accepted, draft.first_pass_tokens, target_seconds)
