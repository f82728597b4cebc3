"""How much to speculate: lookahead schedules and stopping rules that adapt during generation, and the
interfaces the drafters use them through. What they learn is kept across generations by
`specexec.learnt.LearntPolicies`."""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from specexec.tree import DraftTree

# What the drafters ask of the policies below: nothing else of them, so a policy's internals (its cost
# model, acceptance rates, gate) can change without touching a drafter.


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


class HeuristicLookahead:
    """Hugging Face's "heuristic" schedule: +2 after a fully accepted draft, -1 otherwise, never below 1."""

    def __init__(self, start: int) -> None:
        self.length = max(1, start)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.length = self.length + 2 if accepted == drafted else max(1, self.length - 1)


class ConfidenceStop:
    """Stop drafting once the draft's probability for its own token falls below a threshold.

    The token that crosses the threshold stays in the draft (as in HF and llama.cpp). With `adapt`, after
    every verification the threshold moves to the value that best separates accepted from rejected draft
    tokens over the last `window` verified ones, costing a stop that was too early (a lost accepted token)
    three times a draft token wasted, as HF does. Only verified tokens are labelled: the ones after the
    first rejection were never checked. The new value applies from the next draft on.
    """

    def __init__(self, threshold: float = 0.4, adapt: bool = True, window: int = 200, min_samples: int = 6):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold
        self.adapt = adapt
        self.min_samples = min_samples
        self.history: deque[tuple[float, bool]] = deque(maxlen=window)

    def should_stop(self, confidence: float) -> bool:
        return confidence < self.threshold

    def observe(self, confidences: list[float], accepted: int) -> None:
        self.history.extend((c, True) for c in confidences[:accepted])
        if accepted < len(confidences):
            self.history.append((confidences[accepted], False))
        if self.adapt:
            self.threshold = best_threshold(list(self.history), self.min_samples, self.threshold)


def best_threshold(samples: list[tuple[float, bool]], min_samples: int, current: float) -> float:
    """The threshold t minimising FPR + 3 * FNR for the rule "continue while confidence >= t".

    Candidates are the observed confidences (a threshold just at a sample keeps it); `current` is kept
    until there are enough samples of both classes.
    """
    positives = sum(label for _, label in samples)
    negatives = len(samples) - positives
    if len(samples) < min_samples or not positives or not negatives:
        return current
    best, best_cost = current, float("inf")
    true_pos = false_pos = 0
    ranked = sorted(samples, key=lambda s: -s[0])
    for i, (confidence, label) in enumerate(ranked):
        true_pos += label
        false_pos += not label
        if i + 1 < len(ranked) and ranked[i + 1][0] == confidence:
            continue  # a threshold keeps all samples of equal confidence together
        cost = false_pos / negatives + 3 * (1 - true_pos / positives)
        if cost < best_cost:
            best, best_cost = confidence, cost
    return best


class CostModel:
    """Measured forward times: the target against tokens verified, the draft against nodes expanded.

    Linear interpolation between measured sizes, and linear extrapolation past the last two (in
    proportion to size where the last two fall: a batch can cost less than a smaller one in llama.cpp,
    but no size past the last one timed is assumed to).

    `overlap`: seconds of drafting before a target pass that the pass takes back. A target streamed from
    disk reads its first units ahead while the draft works, up to its read-ahead window; the target
    times were taken pass after pass, without that head start.

    `measured`: timed on this machine (`calibration.calibrate`). The policies then price the target at
    the pace its passes actually run (`TargetPace`): a measurement is a snapshot of a machine that
    drifts. A model written by hand is priced as written.
    """

    def __init__(
        self,
        target: dict[int, float],
        draft: dict[int, float],
        label: str = "",
        overlap: float = 0.0,
        measured: bool = False,
    ) -> None:
        if len(target) < 2 or len(draft) < 2:
            raise ValueError("a cost model needs at least two measured sizes per model")
        if overlap < 0:
            raise ValueError("a cost model's overlap is a time: at least 0")
        self.target = dict(sorted(target.items()))
        self.draft = dict(sorted(draft.items()))
        self.label = label
        self.overlap = overlap
        self.measured = measured

    def target_seconds(self, tokens: int) -> float:
        return _interpolate(self.target, tokens)

    def draft_seconds(self, nodes: int) -> float:
        return _interpolate(self.draft, nodes)

    def exposed(self, drafting: torch.Tensor) -> torch.Tensor:
        """What `drafting` seconds before a target pass add to a step: all but the `overlap` the pass
        takes back, elementwise."""
        return (drafting - self.overlap).clamp(min=0.0)

    def with_target_pace(self, factor: float) -> CostModel:
        """This model with the target's times and its overlap `factor` times the measured ones (the
        overlap is the target reading ahead: on a slower disk the same window takes as much longer)."""
        target = {n: seconds * factor for n, seconds in self.target.items()}
        return CostModel(target, self.draft, self.label, self.overlap * factor, self.measured)

    def to_json(self) -> dict:
        return {
            "label": self.label, "target": self.target, "draft": self.draft, "overlap": self.overlap,
            "measured": self.measured,
        }  # fmt: skip

    def fingerprint(self) -> tuple:
        """Equal for cost models of the same measurements (a calibration read from disk twice)."""
        return self.label, tuple(self.target.items()), tuple(self.draft.items()), self.overlap

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        as_points = lambda d: {int(k): float(v) for k, v in d.items()}  # noqa: E731
        target, draft = as_points(data["target"]), as_points(data["draft"])
        # Files without "measured" are calibrations written before it was recorded.
        measured = bool(data.get("measured", True))
        return cls(target, draft, data.get("label", ""), float(data.get("overlap", 0.0)), measured)


def _interpolate(points: dict[int, float], x: int) -> float:
    xs = list(points)
    i = next((i for i, v in enumerate(xs) if v >= x), len(xs) - 1)
    i = min(max(i, 1), len(xs) - 1)
    (x0, y0), (x1, y1) = (xs[i - 1], points[xs[i - 1]]), (xs[i], points[xs[i]])
    if x > x1 and y1 <= y0:  # past a dip at the last size: grow in proportion, never shrink
        return y1 * x / x1
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class AcceptanceModel:
    """P(a draft token is accepted | its parent was), as a function of the draft's own probability q for
    it (given its parent), learnt online per generation.

    Per bin of q: (accepted + w * q) / (tried + w), the bin's verified tokens plus a prior of `w`
    (`prior_weight`) tokens as likely as the draft says for this one. Conditional rates rather than one
    global scale, because a draft is typically under-confident on easy text and over-confident on hard
    text, and because the path probability of a deep node is the product of these rates, not a scaled
    product of draft probabilities. Bins are 0.1 wide above 0.1 and shrink threefold per bin below it:
    a sampled tree holds many siblings of q 0.001-0.03, and rating them alike (once all at 0.05, the
    middle of one bin below 0.1) made a first generation at T=0.6 draft three times as long a step.
    """

    # Upper edges of every bin but the last (which ends at 1).
    EDGES = torch.tensor([0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    BINS = len(EDGES) + 1

    def __init__(self, prior_weight: float = 2.0) -> None:
        self.prior_weight = prior_weight
        self.accepted = torch.zeros(self.BINS)
        self.tried = torch.zeros(self.BINS)

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        q = q.float().cpu().clamp(0.0, 1.0)
        bins = self._bin(q)
        return (self.accepted[bins] + self.prior_weight * q) / (self.tried[bins] + self.prior_weight)

    def surest(self) -> float:
        """The rate of the top bin's tokens, at its middle (q 0.95): a draft that is never wrong is no
        prior to judge drafting by."""
        return float(self((self.EDGES[-1:] + 1.0) / 2)[0])

    def observe(self, q: torch.Tensor, accepted: torch.Tensor) -> None:
        """Verified draft tokens: their draft probabilities q and whether each was accepted. A bin keeps
        its last ACCEPTANCE_MEMORY tokens' worth (older ones fade), so rates learnt over many generations
        still follow the text."""
        bins = self._bin(q.float().cpu())
        self.tried.index_add_(0, bins, torch.ones(len(bins), dtype=self.tried.dtype))
        self.accepted.index_add_(0, bins, accepted.cpu().to(self.accepted.dtype))
        fade = (ACCEPTANCE_MEMORY / self.tried.clamp(min=1.0)).clamp(max=1.0)
        self.tried *= fade
        self.accepted *= fade

    def _bin(self, q: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(q, self.EDGES, right=True)

    def state(self) -> dict:
        return {"accepted": self.accepted.tolist(), "tried": self.tried.tolist()}

    def restore(self, state: dict) -> None:
        accepted = torch.tensor(state["accepted"], dtype=self.accepted.dtype)
        tried = torch.tensor(state["tried"], dtype=self.tried.dtype)
        valid = accepted.shape == (self.BINS,) and tried.shape == (self.BINS,)
        if not valid or bool((accepted < 0).any() or (accepted > tried).any()):
            raise ValueError("not an acceptance state of this model")
        self.accepted, self.tried = accepted, tried


class SpeculationGate:
    """Turns drafting off for a while when drafted steps have been slower than plain decoding would be,
    and keeps the generation's achieved rate λ for the sizing rules.

    Each drafted step is recorded with its tokens and its cost-model time; once `window` steps are in,
    if their tokens per second fall below one token per single-token target pass, the next `pause`
    steps decode without a draft. How the pause then moves depends on λ, which remembers far more
    drafted steps than a window: where drafting has been paying (λ at least plain decoding's rate), a
    losing window is likely bad luck, so the pause doubles (up to 64) and a winning window resets it;
    where drafting has been losing, it grows fourfold (up to 256) and a winning window only halves it.
    A probe after a pause is dear in a losing regime: every drafted step there loses about half a
    target pass, and the draft first catches up on every token it skipped (on MT-Bench at T=0.6 with
    the default pair, doubling up to 64 and resetting on a lucky window drafted 17% of steps and cost
    8% of plain speed; docs/benchmarks.md). Undrafted steps are plain target steps, so exactness is
    untouched.
    """

    def __init__(self, cost: CostModel, window: int = 6, pause: int = 4, prior_steps: int = 2) -> None:
        self.plain_rate = 1.0 / cost.target_seconds(1)
        self.window = window
        self.first_pause = self.pause = pause
        self.paused = 0
        self.history: list[tuple[int, float]] = []
        # λ starts as `prior_steps` steps of plain decoding, then follows every drafted step.
        self.tokens = float(prior_steps)
        self.seconds = prior_steps / self.plain_rate

    @property
    def rate(self) -> float:
        """λ: tokens per cost-model second over this generation's drafted steps (plus the prior)."""
        return self.tokens / self.seconds

    @property
    def floor_rate(self) -> float:
        """The rate every sizing rule values time at: λ, but never below plain decoding's, which a
        generation achieves whatever drafting did so far. Valued below it, time spent drafting would look
        cheaper the more drafting had lost, and a losing generation would draft more (part of why the
        default once ran at 0.84x plain llama.cpp on MT-Bench, docs/benchmarks.md)."""
        return max(self.rate, self.plain_rate)

    @property
    def losing(self) -> bool:
        """Whether drafting has been losing: λ below plain decoding's rate."""
        return self.rate < self.plain_rate

    def allows(self) -> bool:
        """Whether this step drafts (consumes one paused step when not)."""
        if self.paused:
            self.paused -= 1
            return False
        return True

    def record(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if self.tokens > RATE_MEMORY:  # λ follows the last RATE_MEMORY tokens' worth of drafted steps
            fade = RATE_MEMORY / self.tokens
            self.tokens, self.seconds = RATE_MEMORY, self.seconds * fade
        self.history.append((tokens, seconds))
        if len(self.history) < self.window:
            return
        rate = sum(t for t, _ in self.history) / sum(s for _, s in self.history)
        self.history.clear()
        losing = self.losing
        if rate < self.plain_rate:
            grow, longest = (4, LOSING_MAX_PAUSE) if losing else (2, PAYING_MAX_PAUSE)
            self.paused, self.pause = self.pause, min(grow * self.pause, longest)
        else:
            self.pause = max(self.first_pause, self.pause // 2) if losing else self.first_pause

    def reprice(self, cost: CostModel, scale: float) -> None:
        """The target's times are now `cost`'s, `scale` times what they were: plain decoding's rate and
        the seconds recorded so far follow, so λ stays in the units every rule now prices time in."""
        self.plain_rate = 1.0 / cost.target_seconds(1)
        self.seconds *= scale
        self.history = [(tokens, seconds * scale) for tokens, seconds in self.history]

    def state(self) -> dict:
        """λ and the pause (a window in progress is not kept)."""
        return {"tokens": self.tokens, "seconds": self.seconds, "pause": self.pause, "paused": self.paused}

    def restore(self, state: dict) -> None:
        tokens, seconds = float(state["tokens"]), float(state["seconds"])
        pause, paused = int(state["pause"]), int(state["paused"])
        if not (tokens > 0 and seconds > 0 and pause >= 1 and paused >= 0):
            raise ValueError("not a gate state")
        self.tokens, self.seconds, self.pause, self.paused = tokens, seconds, pause, paused


class TargetPace:
    """How the target's passes run against the calibration, followed online: a factor on its times.

    A calibration is a snapshot of the machine. A target streamed from disk costs what the disk reads at
    the time: one calibration at --ram 0 caught the disk at two thirds of its usual speed, and the runs
    after it verified trees priced for that disk (docs/benchmarks.md); other programs' load moves a
    target in RAM too. Each verification's measured time moves the factor PACE_WEIGHT of the way (in log)
    toward the one that would have predicted it, within PACE_LIMITS; the policies price at it once it
    is PACE_BAND off the calibration (`DraftingPolicy.observe_pass`).
    """

    def __init__(self) -> None:
        self.factor = 1.0

    def observe(self, predicted: float, measured: float) -> None:
        """A pass predicted, at the current factor, to take `predicted` seconds took `measured`."""
        if predicted <= 0 or measured <= 0:
            return
        low, high = PACE_LIMITS
        self.factor = min(high, max(low, self.factor * (measured / predicted) ** PACE_WEIGHT))


def chain_seconds(cost: CostModel, max_length: int) -> list[float]:
    """T(k) for k = 0 .. max_length: k one-node draft passes (less what the target pass takes back) and a
    target pass over k + 1 tokens."""
    drafting = cost.exposed(cost.draft_seconds(1) * torch.arange(max_length + 1.0))
    return [float(d) + cost.target_seconds(k + 1) for k, d in enumerate(drafting)]


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

    def _fresh(self, cost: CostModel, chain_length: int) -> None:
        """A new policy's state: nothing learnt, the target priced as calibrated."""
        self.calibrated, self.cost, self.priced, self.pace = cost, cost, 1.0, TargetPace()
        self.chain_times = chain_seconds(cost, chain_length)
        self.acceptance = AcceptanceModel()
        self.gate = SpeculationGate(cost)

    def observe_pass(self, tokens: int, drafting: float, seconds: float) -> None:
        """A verification over `tokens` tokens, after `drafting` seconds of drafting (as the cost model
        prices it), took `seconds` in the target: the pace follows (the pass predicted at the pace: the
        target's time less what a streamed target read ahead meanwhile, the `overlap`, both at the pace).
        The rules are priced at the pace while it is more than PACE_BAND off the calibration, and as
        calibrated within it. Only a measured cost model follows (`CostModel.measured`)."""
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
        """Whether a step could gain by drafting (`chain_pays` at the surest tokens' learnt acceptance)."""
        return chain_pays(self.acceptance.surest(), self.gate.floor_rate, self.chain_times)

    def drafts_now(self) -> bool:
        """Whether this step drafts (consumes one step of the gate's pause when not)."""
        return self.gate.allows() and self.worth_drafting()

    def may_draft(self, steps: int = 1) -> bool:
        """Whether some step of the next `steps` may draft: the gate's pause ends within them and drafting
        could gain (consumes nothing)."""
        return self.gate.paused < steps and self.worth_drafting()


class AutoBudget(DraftingPolicy):
    """Chooses the SpecExec tree per step from a cost model and learnt acceptance rates.

    A node is accepted with probability P = the product, along its path, of the `AcceptanceModel` rate of
    each token's conditional draft probability. The tree of size b (the b most likely nodes) is expected
    to emit E(b) = 1 + the sum of their P in T(b) = draft time spent (less the cost model's `overlap`)
    + target time for b + 1 tokens.
    What a generation maximises is its total tokens over its total time, not each step's own E / T: a node
    is worth adding whenever it pays better than the rate the generation achieves, even if it lowers an
    already fast step's ratio. So each step maximises the value E(b) - λ T(b), λ being the achieved rate
    floored at plain decoding's (`SpeculationGate.floor_rate`; Dinkelbach's method for ratio objectives).
    A draft pass continues while expanding some number of the best unexpanded nodes (chosen too) raises
    the best value; the verified tree is the b that maximises it.
    """

    def __init__(self, cost: CostModel, max_budget: int = 1024) -> None:
        self.max_budget = max_budget
        self._fresh(cost, CHAIN_CHECK)
        # Target time for 1 .. max_budget + 1 tokens and draft time for 1 .. max_budget nodes, looked up
        # every draft round (the target's as measured, then as priced: interpolation scales with it).
        self.measured_table = torch.tensor([cost.target_seconds(n) for n in range(1, max_budget + 2)])
        self.target_table = self.measured_table
        self.draft_table = torch.tensor([cost.draft_seconds(n) for n in range(1, max_budget + 1)])

    def _price(self, factor: float) -> None:
        super()._price(factor)
        self.target_table = self.measured_table * factor

    def draft_pass_seconds(self, nodes: int) -> float:
        """The cost model's time for a draft pass over `nodes` nodes."""
        return self.cost.draft_seconds(nodes)

    def child_acceptance(self, best_child_probs: torch.Tensor) -> float:
        """How likely a best child is to be accepted after its parent: the mean learnt rate of the draft
        probabilities of a round's best children, (F,)."""
        return float(self.acceptance(best_child_probs).mean())

    def node_probs(self, tree: DraftTree) -> torch.Tensor:
        """P for every node of `tree` (the root: 1), (size,)."""
        size = tree.size
        rates = self.acceptance(_conditional_probs(tree)).clamp(min=1e-6)  # (size,)
        rates[0] = 1.0
        log_p = tree.ancestors[:size, :size].float().cpu() @ rates.log()  # sum over each path
        return log_p.exp()

    def best_size(self, ranked_probs: torch.Tensor, draft_seconds: float) -> tuple[int, float]:
        """(b, value) maximising E(b) - λ T(b) over b = 0..len(ranked_probs), nodes best first."""
        gains = torch.cat([torch.ones(1), 1 + ranked_probs.cumsum(0)])  # (n+1,)
        seconds = self.cost.exposed(torch.tensor(draft_seconds)) + self.target_table[: len(gains)]  # (n+1,)
        values = gains - self.gate.floor_rate * seconds
        best = int(values.argmax())
        return best, float(values[best])

    def step_seconds(self, size: int, draft_seconds: float) -> float:
        """T(b) of a step that spent `draft_seconds` drafting and verifies `size` draft nodes."""
        return float(self.cost.exposed(torch.tensor(draft_seconds)) + self.target_table[size])

    def frontier_size(
        self, ranked: torch.Tensor, frontier: torch.Tensor, draft_seconds: float, child_accept: float
    ) -> int:
        """How many of the `frontier` nodes (their P, best first; each one's best child accepted with
        probability about `child_accept` after it) the next draft pass should expand to raise the value
        of the best tree from the `ranked` node P most; 0 when no count raises it. The draft's cost per
        pass decides between narrow and wide passes.

        Each count is judged by the best tree it makes possible, which may leave out nodes the best tree
        now has: where a larger batch costs less (llama.cpp's grouped kernels: 4 tokens below 3), the best
        tree is padded with unlikely siblings that a deeper node should replace, not join.
        """
        _, value = self.best_size(ranked, draft_seconds)
        count = len(frontier)
        children = frontier * child_accept  # (F,) each expanded node's best child, best first
        # Row c - 1: the current nodes and the children of the first c frontier nodes (-1: not drafted).
        grown = torch.where(
            torch.arange(count) < torch.arange(1, count + 1)[:, None], children, -1.0
        )  # (F, F)
        nodes = torch.cat([ranked.expand(count, -1), grown], dim=1)  # (F, n + F)
        nodes = nodes.sort(dim=1, descending=True).values[:, : self.max_budget]
        gains = torch.cat([torch.ones(count, 1), 1 + nodes.clamp(min=0).cumsum(1)], dim=1)  # (F, b + 1)
        sizes = gains.shape[1]
        drafting = self.cost.exposed(draft_seconds + self.draft_table[:count, None])  # (F, 1)
        seconds = drafting + self.target_table[None, :sizes]
        values = gains - self.gate.floor_rate * seconds  # (F, b + 1)
        drafted = torch.arange(sizes) <= len(ranked) + torch.arange(1, count + 1)[:, None]
        best = values.masked_fill(~drafted, float("-inf")).amax(dim=1)  # (F,)
        c = int(best.argmax())
        return c + 1 if float(best[c]) > value else 0

    def observe(self, tree: DraftTree, path: Sequence[int], drafted: int) -> None:
        """Label the verified draft nodes (among the first `drafted`): every child of the root and of an
        accepted node was tried by the verification, and the one on the path was accepted."""
        on_path = torch.zeros(tree.size, dtype=torch.bool)
        on_path[[0, *path]] = True
        nodes = torch.arange(1, drafted)
        tried = nodes[on_path[tree.parents[1:drafted].cpu()]]
        self.acceptance.observe(_conditional_probs(tree)[tried], on_path[tried])

    def record(self, tokens: int, seconds: float) -> None:
        """A drafted step's emitted tokens and its estimated time T(b), for the gate and λ."""
        self.gate.record(tokens, seconds)


def _conditional_probs(tree: DraftTree) -> torch.Tensor:
    """Each node's draft probability given its parent, (size,) (the root's is meaningless)."""
    size = tree.size
    parents = tree.parents[:size].clamp(min=0)
    return (tree.scores[:size] - tree.scores[parents]).exp().cpu()


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


# What the auto policies remember when they live across generations (`LearntPolicies`): per acceptance
# bin, the last this many verified tokens; for λ, the last this many tokens of drafted steps.
ACCEPTANCE_MEMORY = 256
RATE_MEMORY = 512
# The longest pause of `SpeculationGate`, in steps, where drafting has been paying and where it has not.
PAYING_MAX_PAUSE = 64
LOSING_MAX_PAUSE = 256
# How the target's pace follows its measured passes (`TargetPace`): the share of the way (in log) one pass
# moves it, and the most it moves the calibration either way. A streamed pass varies by about 20%.
PACE_WEIGHT = 0.1
PACE_LIMITS = (0.25, 4.0)
# Within this share of the calibration the policies keep its prices: on the Zen 4 host a fresh
# calibration's own target settled at a pace of 1.06-1.26 at --ram 0 (MT-Bench), and priced at it ran
# 1% slower than as calibrated (paired, docs/benchmarks.md); a calibration 1.6x off, priced at the
# pace, ran 4% faster.
PACE_BAND = 0.3
REPRICE = 0.02  # a move of the pace by this share prices the policy's tables again
CATCH_UP_PASSES = 0.5  # what a draft's catch-up after plain steps may cost, in target passes
CATCH_UP_LIMIT = 1024  # a catch-up of this many tokens within that cost: no tokens are skipped
CHAIN_CHECK = 32  # the longest chain `AutoBudget.worth_drafting` considers
# What a drafted step costs beyond its forwards, as a share of them: the engine's own work per step and,
# in llama.cpp, a compute graph rebuilt for every new batch shape (measured on 2 cores with the real
# pair: 4-8% of a step's time, docs/benchmarks.md). `chain_pays` asks speculation to beat it.
UNMODELED_STEP_COST = 0.10
