"""The decoding methods, one entry each: how a method drafts, how its drafts are verified, its default
budget and the options it reads. The engine, the benchmark, the server and the command line all read
this registry; adding a method is one entry in METHODS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specexec.budget.acceptance import ConfidenceStop
from specexec.budget.chains import ChainCostStop, HeuristicLookahead
from specexec.drafters import BestFirstDrafter, ChainDrafter, Draft, Drafter, NoDrafter, SampledTreeDrafter
from specexec.sampling import SamplingParams
from specexec.tree import DraftTree
from specexec.verify import cache_walk, rejection_walk

HEURISTIC_MAX_LENGTH = 64  # a ceiling for the heuristic schedule, which has none of its own
DSL_MAX_LENGTH = 20  # the longest dsl chain under budget "auto"


@dataclass(frozen=True)
class DraftOptions:
    """The options that shape a method's drafts (each method reads its own, `Method.options`)."""

    expand: int = 32
    width: int = 8
    max_rounds: int = 32
    branches: int = 4
    ngram: int = 0
    lookahead_schedule: str = "constant"
    # Grow the next tree while the target verifies (`Drafter.draft_ahead`): for the cache walk only,
    # which is exact whatever the tree.
    draft_ahead: bool = False


# The acceptance rule of a step: (tree, target logits, the draft, sampling, generator) -> (path, bonus).
Rule = Callable[
    [DraftTree, torch.Tensor, Draft, SamplingParams, torch.Generator | None], tuple[list[int], int]
]


def walk_cache(tree, logits, draft, sampling, generator) -> tuple[list[int], int]:
    """SpecExec's cache walk: exact for any tree, however it was drafted (`verify.cache_walk`)."""
    return cache_walk(tree, logits, sampling, generator)


def walk_rejection(tree, logits, draft, sampling, generator) -> tuple[list[int], int]:
    """Multi-draft rejection sampling against the distributions the draft sampled from
    (`verify.rejection_walk`): accepts more than the cache walk at temperature > 0."""
    return rejection_walk(tree, logits, draft.draft_probs, sampling, generator)


@dataclass(frozen=True)
class Fixed:
    """A budget of `size` draft tokens: a chain's length, a tree's nodes (0: no draft)."""

    size: int

    @property
    def option(self) -> int:
        """As the `budget` option writes it."""
        return self.size


@dataclass(frozen=True)
class Auto:
    """A budget sized every step from the cost model: a tree's `AutoBudget`, a chain's `ChainCostStop`."""

    @property
    def option(self) -> str:
        """As the `budget` option writes it."""
        return "auto"


Budget = Fixed | Auto


class BudgetError(ValueError):
    """A budget the method cannot take."""


@dataclass(frozen=True)
class Method:
    """One decoding method.

    `make_drafter(size, options, confidence, policy)` builds its drafter for one generation: `size` its
    budget in draft tokens (under an auto budget, the most the policy may ask for), `confidence` a dsl
    chain's confidence stop, and `policy` the auto budget's cost policy (`AutoBudget` for a tree,
    `ChainCostStop` for a chain), None under a fixed budget.
    """

    name: str
    summary: str
    make_drafter: Callable[..., Drafter]
    rule: Rule
    default_budget: int | str
    options: tuple[str, ...] = ()  # the DraftOptions fields it reads
    auto: bool = False  # whether its budget may be "auto" (sized by the cost model)
    tree: bool = False  # whether a budget is a tree's size (bounded by the leaves a backend verifies)
    chain: bool = False  # whether "auto" sizes a chain (`ChainCostStop`) rather than a tree (`AutoBudget`)

    @property
    def drafts(self) -> bool:
        """Whether it needs a draft model."""
        return self.default_budget != 0

    def resolve_budget(self, budget: int | str | Budget | None) -> Budget:
        """The one budget value of a generation: `budget` as given ("auto", an integer, or already
        resolved), or the method's default where None. Raises `BudgetError` for one it cannot take."""
        if isinstance(budget, Fixed | Auto):
            budget = budget.option  # checked as the option would be
        value = self.default_budget if budget is None else budget
        if value == "auto":
            if not self.auto:
                raise BudgetError(not_for(self.name, "budget 'auto'", "auto"))
            return Auto()
        if not isinstance(value, int) or isinstance(value, bool) or (self.drafts and value < 1):
            raise BudgetError(f"budget must be an integer >= 1 or 'auto', got {value!r}")
        return Fixed(value)

    def sized_by_cost(self, budget: int | str | Budget | None) -> bool:
        """Whether a generation with `budget` (None: the method's default) is sized by the cost model; a
        budget it cannot take is not (`resolve_budget` says why when the generation starts)."""
        try:
            return isinstance(self.resolve_budget(budget), Auto)
        except BudgetError:
            return False


def _sd(budget: int, options: DraftOptions, confidence: ConfidenceStop, policy: None) -> Drafter:
    if options.lookahead_schedule == "heuristic":
        return ChainDrafter(
            budget, schedule=HeuristicLookahead(budget), max_length=max(budget, HEURISTIC_MAX_LENGTH)
        )
    return ChainDrafter(budget)


def _dsl(
    budget: int, options: DraftOptions, confidence: ConfidenceStop, policy: ChainCostStop | None
) -> Drafter:
    return ChainDrafter(budget, stop=confidence, cost_stop=policy)


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method(
            "ar",
            "the target alone",
            lambda budget, options, confidence, policy: NoDrafter(),
            walk_cache,
            0,
        ),
        Method(
            "sd",
            "a chain of `budget` draft tokens and the rejection rule; `lookahead_schedule` 'heuristic' "
            "adapts the length (+2 after a fully accepted draft, -1 otherwise)",
            _sd,
            walk_rejection,
            4,
            options=("lookahead_schedule",),
        ),
        Method(
            "dsl",
            "a chain that stops once the draft's probability for its own token drops below "
            "`confidence_threshold` (adapted from observed acceptances if `adapt_threshold`), at most "
            "`budget` tokens; under 'auto', also where drafting on is not expected to pay",
            _dsl,
            walk_rejection,
            "auto",
            auto=True,
            chain=True,
        ),
        Method(
            "specinfer",
            "`branches` sampled chains, `budget` draft tokens in all, multi-draft rejection",
            lambda budget, options, confidence, policy: SampledTreeDrafter(budget, options.branches),
            walk_rejection,
            32,
            options=("branches",),
            tree=True,
        ),
        Method(
            "specexec",
            "a best-first tree of `budget` tokens (`expand` nodes per draft pass, `width` children per "
            "node, at most `max_rounds` draft passes), verified by the cache walk; with `ngram` > 0, "
            "prompt-lookup chains of up to `ngram` tokens are grafted into the tree",
            lambda budget, options, confidence, policy: BestFirstDrafter(
                policy or budget,
                options.expand,
                options.width,
                options.max_rounds,
                options.ngram,
                options.draft_ahead,
            ),
            walk_cache,
            "auto",
            options=("expand", "width", "max_rounds", "ngram", "draft_ahead"),
            auto=True,
            tree=True,
        ),
    )
}


def not_for(name: str, what: str, taking: str) -> str:
    """The message refusing `what` (e.g. "budget 'auto'") to method `name`, naming the methods that take
    it: those with `auto`, or whose options include `taking`."""
    able = [repr(m.name) for m in METHODS.values() if (m.auto if taking == "auto" else taking in m.options)]
    return f"{what} is for method{'s' if len(able) > 1 else ''} {' and '.join(able)}, not {name!r}"


class UnknownMethod(ValueError):
    """A method name the registry does not have."""


def method(name: str) -> Method:
    """The method called `name`."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise UnknownMethod(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None
