"""What both auto policies decide before a step drafts: whether speculation can pay at all on this
machine (`chain_pays`), how much a draft reads after plain steps (`catch_up_window`), and the state they
share (`DraftingPolicy`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from specexec.budget.acceptance import AcceptanceModel
from specexec.budget.costs import PACE_LIMITS, CostModel, TargetPace, chain_seconds
from specexec.budget.gate import SpeculationGate

# Within this share of the calibration the policies keep its prices: on the Zen 4 host a fresh
# calibration's own target settled at a pace of 1.06-1.26 at --ram 0 (MT-Bench), and priced at it ran
# 1% slower than as calibrated (paired, docs/benchmarks-history.md); a calibration 1.6x off, priced at the
# pace, ran 4% faster.
PACE_BAND = 0.3
REPRICE = 0.02  # a move of the pace by this share prices the policy's tables again
CATCH_UP_PASSES = 0.5  # what a draft's catch-up after plain steps may cost, in target passes
CATCH_UP_LIMIT = 1024  # a catch-up of this many tokens within that cost: no tokens are skipped
# What a drafted step costs beyond its forwards, as a share of them: the engine's own work per step and,
# in llama.cpp, a compute graph rebuilt for every new batch shape (measured on 2 cores with the real
# pair: 4-8% of a step's time, docs/benchmarks-history.md). `chain_pays` asks speculation to beat it.
UNMODELED_STEP_COST = 0.10


def chain_pays(acceptance: float, rate: float, seconds: Sequence[float]) -> bool:
    """Whether some chain of k >= 1 draft tokens, each accepted with probability `acceptance` after its
    predecessors, is worth more than a plain step at the achieved `rate`: E(k) - rate T(k) (1 + margin)
    > 1 - rate T(0), with `seconds` the T(k) (`chain_seconds`) and the margin UNMODELED_STEP_COST.

    With the acceptance of the draft's surest tokens, this is the most a step can hope to gain: where
    it fails (a draft pass nearly as slow as a target pass, or verification that grows steeply with the
    tokens verified) speculation cannot pay on this machine, and a step decodes plainly without spending
    a draft pass to find out.
    """
    expected, path = 1.0, 1.0
    plain = 1.0 - rate * seconds[0]
    for k in range(1, len(seconds)):
        path *= acceptance
        expected += path
        if expected - rate * seconds[k] * (1 + UNMODELED_STEP_COST) > plain:
            return True
    return False


def catch_up_window(cost: CostModel) -> int | None:
    """How many committed tokens a draft reads when it probes again after plain steps where drafting has
    been losing: the most whose forward costs at most CATCH_UP_PASSES target passes more than a
    one-token one; None where that holds up to CATCH_UP_LIMIT tokens (a draft that batches cheaply reads
    everything it missed).

    Reading every token it missed cost about 0.1 target pass per token on a CPU (the default pair,
    llama.cpp, 2 threads), paid before a probe knows whether drafting pays again: after a pause of 64
    steps, 7 target passes. The tokens it skips cost the draft context, which matters where drafting
    pays (on HumanEval, skipping after every pause took the default from 1.11x to 1.07x plain decoding
    in cost-model time), so only a losing regime's probes skip. The target checks every token.
    """
    allowed = cost.draft_seconds(1) + CATCH_UP_PASSES * cost.target_seconds(1)
    fits = [n for n in range(1, CATCH_UP_LIMIT + 1) if cost.draft_seconds(n) <= allowed]
    return None if fits[-1] == CATCH_UP_LIMIT else fits[-1]


class DraftingPolicy:
    """What both auto policies decide before a step drafts, from their learnt acceptance (`acceptance`),
    their speculation gate (`gate`) and the times T(k) of chains of k = 0, 1, ... draft tokens
    (`chain_times`, `chain_seconds`); how much a draft reads after plain steps (`catch_up`); and how
    the target's passes run against the calibration (`pace`), which prices every rule's times (`cost`)."""

    calibrated: CostModel  # as measured
    cost: CostModel  # as priced: the target's times at the current pace
    priced: float  # the pace `cost` was priced at
    pace: TargetPace
    acceptance: AcceptanceModel
    gate: SpeculationGate
    chain_times: list[float]
    after_plain: bool  # the last target pass took one token: the next one-token pass repeats its shape

    def _fresh(self, cost: CostModel, chain_length: int) -> None:
        """A new policy's state: nothing learnt, the target priced as calibrated."""
        self.calibrated, self.cost, self.priced, self.pace = cost, cost, 1.0, TargetPace()
        self.chain_times = chain_seconds(cost, chain_length)
        self.acceptance = AcceptanceModel()
        self.gate = SpeculationGate(cost)
        self.after_plain = False  # after the prompt's prefill

    def observe_pass(self, tokens: int, drafting: float, seconds: float) -> None:
        """A verification over `tokens` tokens, after `drafting` seconds of drafting (as the cost model
        prices it), took `seconds` in the target: the pace follows (the pass predicted at the pace: the
        target's time less what a streamed target read ahead meanwhile, the `overlap`, both at the pace).
        The rules are priced at the pace while it is more than PACE_BAND off the calibration, and as
        calibrated within it. Only a measured cost model follows (`CostModel.measured`)."""
        self.after_plain = tokens == 1
        if not self.calibrated.measured:
            return
        pace, measured = self.pace.factor, self.calibrated
        predicted = pace * measured.target_seconds(tokens) - min(drafting, pace * measured.overlap)
        self.pace.observe(predicted, seconds)
        self._follow_pace()

    def _follow_pace(self) -> None:
        """Price the rules at the pace once it is PACE_BAND off the calibration, as calibrated within."""
        wanted = self.pace.factor if abs(math.log(self.pace.factor)) > math.log1p(PACE_BAND) else 1.0
        if abs(math.log(wanted / self.priced)) >= math.log1p(REPRICE):
            self._price(wanted)

    def restore_pace(self, factor: float) -> None:
        """Start from a pace learnt before (`LearntPolicies`), on a measured cost model."""
        low, high = PACE_LIMITS
        if not low <= factor <= high:
            raise ValueError("not a pace")
        if self.calibrated.measured:
            self.pace.factor = factor
            self._follow_pace()

    def _price(self, factor: float) -> None:
        """Price every rule at the target's pace `factor`."""
        scale, self.priced = factor / self.priced, factor
        self.cost = self.calibrated.with_target_pace(factor)
        self.chain_times = chain_seconds(self.cost, len(self.chain_times) - 1)
        self.gate.reprice(self.cost, scale)
        self.__dict__.pop("window", None)  # `window`'s cached value was priced at the old pace

    @functools.cached_property
    def window(self) -> int | None:
        """`catch_up_window` of this policy's costs."""
        return catch_up_window(self.cost)

    @property
    def catch_up(self) -> int | None:
        """How many of the tokens it missed the draft reads now: the latest `window` where drafting has
        been losing, else all (None)."""
        return self.window if self.gate.losing else None

    def worth_drafting(self) -> bool:
        """Whether a step could gain by drafting: `chain_pays` at the surest tokens' learnt acceptance,
        against plain decoding. Not against λ: where drafting had paid more than the next chain promises,
        no step would draft, and a step that does not draft learns nothing, so λ would never come down
        (the default once decoded plainly for 3 of 4 HumanEval prompts at T=0.6 over RPC workers after
        drafting on the first at 1.5x). Sizing values time at λ; the gate ends drafting that loses."""
        return chain_pays(self.acceptance.surest(), self.gate.plain_rate, self.chain_times)

    def drafts_now(self) -> bool:
        """Whether this step drafts (consumes one step of the gate's pause when not: the step is then a
        one-token pass)."""
        drafts = self.gate.allows() and self.worth_drafting()
        self.after_plain = self.after_plain or not drafts
        return drafts

    def may_draft(self, steps: int = 1) -> bool:
        """Whether some step of the next `steps` may draft: the gate's pause ends within them and drafting
        could gain (consumes nothing)."""
        return self.gate.paused < steps and self.worth_drafting()
