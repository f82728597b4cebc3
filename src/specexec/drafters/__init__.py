"""How candidates are proposed. Each method is a drafter plus an acceptance rule (see `verify`)."""

from __future__ import annotations

from specexec.drafters.base import Draft, Drafter, DrafterBase, DraftRequest, plain_step
from specexec.drafters.best_first import BestFirstDrafter
from specexec.drafters.chain import ChainDrafter
from specexec.drafters.sampled_tree import SampledTreeDrafter


class NoDrafter(DrafterBase):
    """Plain autoregressive decoding: the tree is the root alone, so each step emits one target sample."""

    max_tree_size = 1

    def may_draft(self, steps: int = 1) -> bool:
        return False

    def propose(self, request: DraftRequest) -> Draft:
        return plain_step(request)


__all__ = [
    "BestFirstDrafter",
    "ChainDrafter",
    "Draft",
    "DraftRequest",
    "Drafter",
    "DrafterBase",
    "NoDrafter",
    "SampledTreeDrafter",
]
