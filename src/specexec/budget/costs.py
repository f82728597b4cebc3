"""Measured forward times (`CostModel`), how the target's passes run against them (`TargetPace`), and
the times of draft chains."""

from __future__ import annotations

import torch

# How the target's pace follows its measured passes (`TargetPace`): the share of the way (in log) one pass
# moves it, and the most it moves the calibration either way. A streamed pass varies by about 20%.
PACE_WEIGHT = 0.1
PACE_LIMITS = (0.25, 4.0)


class CostModel:
    """Measured forward times: the target against tokens verified, the draft against nodes expanded.

    Linear interpolation between measured sizes, and linear extrapolation past the last two (in
    proportion to size where the last two fall: a batch can cost less than a smaller one in llama.cpp,
    but no size past the last one timed is assumed to).

    `overlap`: seconds of drafting before a target pass that the pass takes back. A target streamed from
    disk reads its first units ahead while the draft works, up to its read-ahead window; the target
    times were taken pass after pass, without that head start.

    `reshape`: seconds a one-token target pass costs more right after a pass of another shape (a tree's)
    than right after another one-token pass, as `target` times it. llama.cpp reuses the compute graph of
    a batch shaped as the one before; over RPC workers a reused graph is not sent again (71 KiB a pass
    instead of 497 for the 1.5B target over two workers).

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
        reshape: float = 0.0,
    ) -> None:
        if len(target) < 2 or len(draft) < 2:
            raise ValueError("a cost model needs at least two measured sizes per model")
        if overlap < 0 or reshape < 0:
            raise ValueError("a cost model's overlap and reshape are times: at least 0")
        self.target = dict(sorted(target.items()))
        self.draft = dict(sorted(draft.items()))
        self.label = label
        self.overlap = overlap
        self.measured = measured
        self.reshape = reshape

    def target_seconds(self, tokens: int) -> float:
        return _interpolate(self.target, tokens)

    def draft_seconds(self, nodes: int) -> float:
        return _interpolate(self.draft, nodes)

    def exposed(self, drafting: torch.Tensor) -> torch.Tensor:
        """What `drafting` seconds before a target pass add to a step: all but the `overlap` the pass
        takes back, elementwise."""
        return (drafting - self.overlap).clamp(min=0.0)

    def with_target_pace(self, factor: float) -> CostModel:
        """This model with the target's times, its overlap and its reshape `factor` times the measured
        ones (the overlap is the target reading ahead: on a slower disk the same window takes as much
        longer)."""
        target = {n: seconds * factor for n, seconds in self.target.items()}
        overlap, reshape = self.overlap * factor, self.reshape * factor
        return CostModel(target, self.draft, self.label, overlap, self.measured, reshape)

    def to_json(self) -> dict:
        return {
            "label": self.label, "target": self.target, "draft": self.draft, "overlap": self.overlap,
            "measured": self.measured, "reshape": self.reshape,
        }  # fmt: skip

    def fingerprint(self) -> tuple:
        """Equal for cost models of the same measurements (a calibration read from disk twice)."""
        return self.label, tuple(self.target.items()), tuple(self.draft.items()), self.overlap, self.reshape

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        as_points = lambda d: {int(k): float(v) for k, v in d.items()}  # noqa: E731
        target, draft = as_points(data["target"]), as_points(data["draft"])
        # Files without "measured" are calibrations written before it was recorded.
        measured = bool(data.get("measured", True))
        overlap, reshape = float(data.get("overlap", 0.0)), float(data.get("reshape", 0.0))
        return cls(target, draft, data.get("label", ""), overlap, measured, reshape)


def _interpolate(points: dict[int, float], x: int) -> float:
    xs = list(points)
    i = next((i for i, v in enumerate(xs) if v >= x), len(xs) - 1)
    i = min(max(i, 1), len(xs) - 1)
    (x0, y0), (x1, y1) = (xs[i - 1], points[xs[i - 1]]), (xs[i], points[xs[i]])
    if x > x1 and y1 <= y0:  # past a dip at the last size: grow in proportion, never shrink
        return y1 * x / x1
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class TargetPace:
    """How the target's passes run against the calibration, followed online: a factor on its times.

    A calibration is a snapshot of the machine. A target streamed from disk costs what the disk reads at
    the time: one calibration at --ram 0 caught the disk at two thirds of its usual speed, and the runs
    after it verified trees priced for that disk (docs/benchmarks-history.md); other programs' load moves a
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
