"""How much to speculate: lookahead schedules and stopping rules that adapt during generation."""

from __future__ import annotations

from collections import deque


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
            raise ValueError(f"confidence threshold must be in [0, 1], got {threshold}")
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
