"""Whether drafting has been paying: the speculation gate and the achieved rate λ."""

from __future__ import annotations

from specexec.budget.costs import CostModel

# What λ remembers when it lives across generations (`LearntPolicies`): the last this many tokens of
# drafted steps.
RATE_MEMORY = 512
# The longest pause of `SpeculationGate`, in steps, where drafting has been paying and where it has not.
PAYING_MAX_PAUSE = 64
LOSING_MAX_PAUSE = 256


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
    8% of plain speed; docs/benchmarks-history.md). Undrafted steps are plain target steps, so exactness is
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
        default once ran at 0.84x plain llama.cpp on MT-Bench, docs/benchmarks-history.md)."""
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
