"""How likely a draft token is to be accepted: learnt rates per draft probability (`AcceptanceModel`) and
the adaptive confidence threshold of dynamic lookahead (`ConfidenceStop`)."""

from __future__ import annotations

from collections import deque

import torch

# What an acceptance model remembers when it lives across generations (`LearntPolicies`): per bin, the
# last this many verified tokens.
ACCEPTANCE_MEMORY = 256


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
