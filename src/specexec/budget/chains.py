"""A draft chain's length: Hugging Face's heuristic schedule (`HeuristicLookahead`) and the stop where
drafting on is not expected to pay (`ChainCostStop`)."""

from __future__ import annotations

import torch

from specexec.budget.costs import CostModel
from specexec.budget.policy import DraftingPolicy


class HeuristicLookahead:
    """Hugging Face's "heuristic" schedule: +2 after a fully accepted draft, -1 otherwise, never below 1."""

    def __init__(self, start: int) -> None:
        self.length = max(1, start)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.length = self.length + 2 if accepted == drafted else max(1, self.length - 1)


class ChainCostStop(DraftingPolicy):
    """Stop a draft chain where drafting on is not expected to pay at the generation's achieved rate.

    Draft token i is accepted, given its predecessors were, with the `AcceptanceModel` rate of c_i, the
    draft's own probability for it, learnt from this generation's verifications. A chain of k tokens is
    then expected to emit E(k) = 1 + sum over j <= k of the products in T(k) = k single-token draft
    passes (less the `overlap`) + a target pass over k + 1 tokens (the cost model). As for `AutoBudget`,
    a chain maximises E(k) - λ T(k), λ the achieved rate floored at plain decoding's; after each token it
    goes on if some longer chain, up to `max_length`, is worth more, its further tokens assumed as likely
    as the last one (so a cost curve that jumps once and is flat after does not stop it short).
    """

    def __init__(self, cost: CostModel, max_length: int = 20) -> None:
        self.max_length = max_length
        # T(k) for k = 0 .. max_length (`chain_times`), looked up for every length after every draft token.
        self._fresh(cost, max_length)
        self.start()

    def start(self) -> None:
        """A new chain."""
        self.length = 0
        self.path = 1.0  # probability that every draft token so far is accepted
        self.expected = 1.0  # E(length)

    def should_stop(self, confidence: float) -> bool:
        """Called after each draft token with the draft's probability for it."""
        accept = float(self.acceptance(torch.tensor([confidence]))[0])
        self.path *= accept
        self.expected += self.path
        self.length += 1
        rate = self.gate.floor_rate
        value = self.expected - rate * self.chain_times[self.length]
        path, expected = self.path, self.expected
        for k in range(self.length + 1, self.max_length + 1):
            path *= accept
            expected += path
            if expected - rate * self.chain_times[k] > value:
                return False
        return True

    def observe(
        self, confidences: list[float], accepted: int, first_pass_tokens: int, target_seconds: float
    ) -> None:
        """The chain's draft probabilities, how many of its tokens were accepted, how many tokens its
        first draft pass took in (the gate charges that pass for all of them: after plain steps the
        draft catches up on theirs, which T(k) leaves out) and the verification's measured target time."""
        verified = confidences[: accepted + 1]  # tokens after the first rejection were never checked
        labels = torch.arange(len(verified)) < accepted
        self.acceptance.observe(torch.tensor(verified), labels)
        k, drafting = len(confidences), 0.0
        if confidences:
            drafting = k * self.cost.draft_seconds(1)
            drafting += self.cost.draft_seconds(first_pass_tokens) - self.cost.draft_seconds(1)
            seconds = float(self.cost.exposed(torch.tensor(drafting))) + self.cost.target_seconds(k + 1)
            self.gate.record(accepted + 1, seconds)
        self.observe_pass(k + 1, drafting, target_seconds)
        self.start()
