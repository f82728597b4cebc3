"""What the drafters ask of the budget policies: nothing else of them, so a policy's internals (its cost
model, acceptance rates, gate) can change without touching a drafter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specexec.tree import DraftTree


class LookaheadSchedule(Protocol):
    """What `ChainDrafter` asks of a schedule that adapts the draft length between steps
    (`HeuristicLookahead`); the drafter caps `length` at its own ceiling after each step."""

    length: int

    def observe(self, drafted: int, accepted: int) -> None: ...


class ChainStop(Protocol):
    """What `ChainDrafter` asks of a rule that ends a draft chain early (`ConfidenceStop`)."""

    def should_stop(self, confidence: float) -> bool: ...
    def observe(self, confidences: list[float], accepted: int) -> None: ...


class DraftingSwitch(Protocol):
    """Whether a step drafts, and how much the draft reads after plain steps (`DraftingPolicy`)."""

    @property
    def catch_up(self) -> int | None: ...
    def drafts_now(self) -> bool: ...
    def may_draft(self, steps: int = 1) -> bool: ...


class ChainBudget(DraftingSwitch, ChainStop, Protocol):
    """What `ChainDrafter` asks of a cost stop (`ChainCostStop`): a chain stop that also switches drafting
    off, and learns how many tokens each chain's first draft pass took in."""

    def observe(
        self, confidences: list[float], accepted: int, first_pass_tokens: int, target_seconds: float
    ) -> None: ...


class TreeBudget(DraftingSwitch, Protocol):
    """What `BestFirstDrafter` asks of an auto budget (`AutoBudget`): how large a tree may grow, how many
    nodes each draft pass expands, which tree is verified, and what each verification taught."""

    @property
    def max_budget(self) -> int: ...
    def draft_pass_seconds(self, nodes: int) -> float: ...
    def child_acceptance(self, best_child_probs: torch.Tensor) -> float: ...
    def node_probs(self, tree: DraftTree) -> torch.Tensor: ...
    def frontier_size(
        self, ranked: torch.Tensor, frontier: torch.Tensor, draft_seconds: float, child_accept: float
    ) -> int: ...
    def best_size(self, ranked_probs: torch.Tensor, draft_seconds: float) -> tuple[int, float]: ...
    def step_seconds(self, size: int, draft_seconds: float) -> float: ...
    def observe(self, tree: DraftTree, path: Sequence[int], drafted: int) -> None: ...
    def record(self, tokens: int, seconds: float) -> None: ...
    def observe_pass(self, tokens: int, drafting: float, seconds: float) -> None: ...
