"""How much to speculate: lookahead schedules and stopping rules that adapt during generation."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections import deque
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specexec.quant import quant_label
from specexec.runner import ModelRunner, clock


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

    Linear interpolation between measured sizes, and linear extrapolation past the last two.
    """

    def __init__(self, target: dict[int, float], draft: dict[int, float], label: str = "") -> None:
        if len(target) < 2 or len(draft) < 2:
            raise ValueError("a cost model needs at least two measured sizes per model")
        self.target = dict(sorted(target.items()))
        self.draft = dict(sorted(draft.items()))
        self.label = label

    def target_seconds(self, tokens: int) -> float:
        return _interpolate(self.target, tokens)

    def draft_seconds(self, nodes: int) -> float:
        return _interpolate(self.draft, nodes)

    def to_json(self) -> dict:
        return {"label": self.label, "target": self.target, "draft": self.draft}

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        as_points = lambda d: {int(k): float(v) for k, v in d.items()}  # noqa: E731
        return cls(as_points(data["target"]), as_points(data["draft"]), data.get("label", ""))


def _interpolate(points: dict[int, float], x: int) -> float:
    xs = list(points)
    i = next((i for i, v in enumerate(xs) if v >= x), len(xs) - 1)
    i = min(max(i, 1), len(xs) - 1)
    (x0, y0), (x1, y1) = (xs[i - 1], points[xs[i - 1]]), (xs[i], points[xs[i]])
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class AutoBudget:
    """Chooses the SpecExec tree size per step from a cost model and an acceptance estimate.

    A node whose draft path probability is d is accepted with probability about min(1, scale * d); `scale`
    is learnt from this generation's verifications (accepted tokens over predicted). The tree of size b
    (the b best nodes) is worth E(b) / T(b) tokens per second, with E(b) = 1 + the sum of those
    probabilities and T(b) = draft time spent + target time for b + 1 tokens. Growth continues while one
    more draft round is expected to raise that rate; the verified tree is the b that maximises it.
    """

    def __init__(self, cost: CostModel, max_budget: int = 1024, prior_weight: float = 4.0) -> None:
        self.cost = cost
        self.max_budget = max_budget
        # A prior of `prior_weight` predicted tokens, all accepted: start by trusting the draft.
        self.predicted = prior_weight
        self.observed = prior_weight
        # Target time for 1 .. max_budget + 1 tokens, looked up every draft round.
        self.target_table = torch.tensor([cost.target_seconds(n) for n in range(1, max_budget + 2)])

    @property
    def scale(self) -> float:
        return self.observed / self.predicted

    def node_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return (self.scale * scores.exp()).clamp(max=1.0)

    def best_size(self, ranked_scores: torch.Tensor, draft_seconds: float) -> tuple[int, float]:
        """(b, rate) maximising E(b) / T(b) over b = 0..len(ranked_scores), best-first scores."""
        gains = torch.cat([torch.ones(1), 1 + self.node_probs(ranked_scores).cumsum(0)])  # (n+1,)
        rates = gains / (draft_seconds + self.target_table[: len(gains)])
        best = int(rates.argmax())
        return best, float(rates[best])

    def frontier_size(
        self, ranked: torch.Tensor, frontier: torch.Tensor, draft_seconds: float, child_prob: float
    ) -> int:
        """How many of the `frontier` nodes (scores, best first; each child about `child_prob` likely) the
        next draft pass should expand to raise the rate of the best tree from the `ranked` node scores
        most; 0 when no count raises it. The draft's cost per pass decides between narrow and wide."""
        size, rate = self.best_size(ranked, draft_seconds)
        gain = 1 + float(self.node_probs(ranked[:size]).sum())
        counts = torch.arange(1, len(frontier) + 1)  # (F,)
        extra = self.node_probs(frontier).cumsum(0) * child_prob  # (F,)
        grown = (size + counts).clamp(max=self.max_budget)
        pass_seconds = torch.tensor([self.cost.draft_seconds(int(n)) for n in counts])
        rates = (gain + extra) / (draft_seconds + pass_seconds + self.target_table[grown])  # (F,)
        best = int(rates.argmax())
        return best + 1 if float(rates[best]) > rate else 0

    def observe(self, verified_scores: torch.Tensor, accepted: int) -> None:
        self.predicted += float(verified_scores.exp().sum())
        self.observed += accepted


# Small sizes are dense: low-bit kernels (`specexec.quant`) make the cost jump after a few rows.
class ChainCostStop:
    """Stop a draft chain where one more token is expected to lower the step's tokens per second.

    Draft token i is accepted, given its predecessors were, with probability about min(1, scale * c_i),
    c_i being the draft's own probability for it; `scale` is learnt from this generation's verifications
    as in `AutoBudget`. A chain of k tokens is then worth E(k) = 1 + sum over j <= k of the products, in
    T(k) = k single-token draft passes + a target pass over k + 1 tokens (the cost model). The next
    token is expected to be as likely as the last one.
    """

    def __init__(self, cost: CostModel, prior_weight: float = 4.0) -> None:
        self.cost = cost
        self.predicted = prior_weight
        self.observed = prior_weight
        self.start()

    def start(self) -> None:
        """A new chain."""
        self.length = 0
        self.path = 1.0  # probability that every draft token so far is accepted
        self.expected = 1.0  # E(length)
        self.predictions: list[float] = []

    def should_stop(self, confidence: float) -> bool:
        """Called after each draft token with the draft's probability for it."""
        accept = min(1.0, self.observed / self.predicted * confidence)
        self.path *= accept
        self.expected += self.path
        self.predictions.append(self.path)
        self.length += 1
        k = self.length
        rate = self.expected / self._seconds(k)
        return (self.expected + self.path * accept) / self._seconds(k + 1) <= rate

    def observe(self, accepted: int) -> None:
        self.predicted += sum(self.predictions)
        self.observed += accepted
        self.start()

    def _seconds(self, k: int) -> float:
        return k * self.cost.draft_seconds(1) + self.cost.target_seconds(k + 1)


TARGET_SIZES = (1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512, 1024)
DRAFT_SIZES = (1, 2, 3, 4, 6, 8, 16, 32, 64, 128)


def calibrate(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    context: int = 256,
    repeats: int = 3,
    label: str = "",
    progress: bool = True,
) -> CostModel:
    """Time a forward of n new tokens after a `context`-token prefix, per size (median of `repeats`)."""
    jobs = [(target, n) for n in TARGET_SIZES] + [(draft, n) for n in DRAFT_SIZES]
    bar = tqdm(total=len(jobs) * repeats, desc="calibrating forward costs", disable=not progress, leave=False)
    runners = {id(m): ModelRunner(m, context + max(TARGET_SIZES)) for m in (target, draft)}
    generator = torch.Generator().manual_seed(0)
    vocab = min(m.config.get_text_config().vocab_size for m in (target, draft))
    times: dict[int, dict[int, float]] = {id(target): {}, id(draft): {}}
    with torch.inference_mode():
        for model, n in jobs:
            runner = runners[id(model)]
            if runner.length < context:
                runner.extend(torch.randint(0, vocab, (context,), generator=generator).to(model.device))
            samples = []
            for _ in range(repeats + 1):  # the first run of each size warms up
                runner.keep(torch.arange(context, device=model.device))
                tokens = torch.randint(0, vocab, (n,), generator=generator).to(model.device)
                start = clock(model.device)
                runner.extend(tokens, logits_to_keep=n)
                samples.append(clock(model.device) - start)
                bar.update(1 if len(samples) > 1 else 0)
            times[id(model)][n] = statistics.median(samples[1:])
    bar.close()
    return CostModel(times[id(target)], times[id(draft)], label)


def cached_cost_model(
    target: PreTrainedModel, draft: PreTrainedModel, recalibrate: bool = False
) -> CostModel:
    """The calibration of this pair on this machine, measured on first use and cached on disk.

    The cache key covers both models (name and size), their dtypes and devices, the thread count and
    the target's offloading (real or simulated), so a change in any of them calibrates again.
    """
    from specexec.offload import offload_label

    label = offload_label(target)
    path = _calibration_path(target, draft, label)
    if path.exists() and not recalibrate:
        return CostModel.from_json(json.loads(path.read_text()))
    cost = calibrate(target, draft, label=label)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cost.to_json(), indent=1))
    return cost


def _calibration_path(target: PreTrainedModel, draft: PreTrainedModel, label: str) -> Path:
    def describe(model: PreTrainedModel) -> str:
        size = sum(p.numel() for p in model.parameters())
        return f"{model.config.name_or_path}:{size}:{model.dtype}:{model.device}:{quant_label(model)}"

    key = "|".join([describe(target), describe(draft), str(torch.get_num_threads()), label])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get("SPECEXEC_CACHE", Path.home() / ".cache" / "specexec"))
    return root / "calibration" / f"{digest}.json"
