"""Measuring a model pair's forward costs on this machine, and where they and what the auto budgets learn
are kept on disk (one file per pair, keyed by everything that changes the costs)."""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from time import sleep

import torch
from tqdm.auto import tqdm

from specexec.backends import as_model, make_runner
from specexec.budget.costs import CostModel
from specexec.learnt import LearntPolicies
from specexec.paths import cache_root
from specexec.timing import clock

# Small sizes are dense: low-bit kernels (torch's `--quant`) make the cost jump after a few rows. Around
# each multiple of 16 the sizes come in threes: llama.cpp's CPU passes cost least at a multiple of 16
# tokens and step up one token past it (the 1.5B target streamed from disk, 2 cores: 16 tokens 0.49 s,
# 17 0.54 s, 32 0.58 s, 33 0.66 s; the 0.5B draft in RAM: 15 tokens 0.146 s, 16 0.128 s, 17 0.150 s).
# Timed at the multiples alone, the curve priced a 33-token pass as a 32-token one.
_AROUND_16 = tuple(n for block in (16, 32, 48, 64, 128) for n in (block - 1, block, block + 1))
TARGET_SIZES = (1, 2, 3, 4, 6, 8, *_AROUND_16, 256, 512, 1024)
DRAFT_SIZES = tuple(n for n in TARGET_SIZES if n <= 128)
# A forward that costs more than this many one-token target passes cannot be repaid (no step is expected
# to emit more tokens; published SpecExec trees reach about 20): larger sizes are not timed, and the
# cost model extrapolates past the last one timed.
REPAY_LIMIT = 20
# A model whose one-token forward takes this long (seconds: a target streamed from disk) is timed in one
# round above SLOW_REPEATED tokens: its forwards are long against the machine's drift, and three rounds of
# every size would take minutes. Sizes up to SLOW_REPEATED still take every round: their differences
# decide tree sizes, and one streamed pass varies by 20% (one round timed the 1.5B target at --ram 0 at
# 0.47 s for 1 token, 0.59 s for 2 and 0.38 s for 3, and the auto budget verified trees of 1-3 nodes).
SLOW_FORWARD = 0.25
SLOW_REPEATED = 64
# A model whose one-token forward takes this long (seconds: a large target streamed from disk, say a 70B
# one reading 28 GB a pass at 3 GB/s: 9 s) is timed once per size, on SPARSE_SIZES, each size in the
# warm-up round itself, and its overlap from OVERLAP_SAMPLES pairs: 52 passes and 14 pauses as long as
# one, where the rounds above take 222 passes and about 70 pauses (45 minutes at 9 s a pass, before a
# first token; tests/test_calibration.py counts them). Its passes are long against the jitter of one pass,
# and it verifies large trees, for which the sizes between these matter less.
VERY_SLOW_FORWARD = 2.0
SPARSE_SIZES = (1, 2, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 512, 1024)
# The overlap is a difference of two streamed passes that vary by 20% each: four calibrations of the
# 1.5B target at --ram 0 on one machine (Zen 4) found 0.082, 0.090, 0.112 and 0.118 s from 3 pairs each,
# and every size's cost includes it. Pairs are cheap beside the sizes: this many per round of sizes.
OVERLAP_SAMPLES = 3
# Part of the calibration cache key: a new way of timing invalidates curves measured the old way.
CALIBRATION_FORMAT = "paired-ratios-slow-repeated-blocks-of-16-paused-overlap-3x-reshape"


def calibrate(
    target,
    draft,
    context: int = 256,
    repeats: int = 3,
    label: str = "",
    progress: bool = True,
) -> CostModel:
    """Time a forward of n new tokens after a `context`-token prefix, per size and model.

    Each sample of size n is taken right after a one-token forward of the same model and kept as the
    ratio of the two: this machine's speed drifts (other tenants, clocks), often by tens of percent
    within a minute, and a drift must move the whole curve, not the ratios the policies weigh sizes by.
    A model whose one-token forward takes SLOW_FORWARD or more is sampled in one round only above
    SLOW_REPEATED tokens. A size's
    cost is then the median of its `repeats` ratios (2 from 256 tokens up, where a run is long
    and steady) times the model's one-token cost, the median of all its one-token samples.

    The curve is not forced to be monotone: llama.cpp's repacked kernels work on groups of rows, so a
    batch can cost less than a smaller one (IQ4_NL on AVX-512: 4 tokens 1.56x of one, 3 tokens 2.1x),
    and the policies, which maximise value over sizes, then verify 4 tokens rather than 3.

    A warm-up round goes through each model's sizes in ascending order and stops a model's sizes at the
    first one costing more than REPAY_LIMIT one-token target passes: on a CPU the sizes that cannot pay
    are also the slow ones to time. Then the sizes take turns (one sample of every size, then the next
    round). A very slow model (VERY_SLOW_FORWARD) takes its one sample of each of SPARSE_SIZES in the
    warm-up round, and no rounds.

    The target's `overlap` is timed last: a one-token pass after a pause as long as itself, against one
    right after another, paired, the median of OVERLAP_SAMPLES x `repeats` differences (at least 0). A
    target streamed from disk reads ahead during the pause (as during drafting), up to its read-ahead
    window; a pause as long as a pass leaves the reader time to fill it. A target in RAM gains nothing
    from a pause. The target's larger sizes are timed after such a pause too, as a generation runs them
    (after the draft's work), and the curve adds the overlap back: the policies charge drafting beyond
    the overlap on top of it. What a pause saves shrinks as a pass turns compute-bound (the 1.5B target
    at --ram 0: 0.08-0.12 s for 1-16 tokens, 0.05 s for 17, nothing from 32), so a curve timed pass
    after pass, less one overlap for every size, priced the large passes too low.

    The target's `reshape` is timed as its overlap is, in pairs: a one-token pass right after a two-token
    one against one right after another one-token pass (llama.cpp reuses a repeated shape's graph).
    """
    timer = _Timer({"target": target, "draft": draft}, context)
    with torch.inference_mode():
        timer.fill_context()
        warm_up = _warm_up(timer, progress)
        slow = {name for name, seconds in warm_up.first.items() if seconds >= SLOW_FORWARD}
        steady = {name: warm_up.sizes[name] for name in timer.names if name not in warm_up.very_slow}
        rounds = _rounds(steady, repeats, slow)
        with tqdm(
            total=sum(map(len, rounds)), desc="calibrating forward costs", disable=not progress, leave=False
        ) as bar:
            for round_ in rounds:
                for name, n in round_:
                    warm_up.add(name, n, *timer.sample(name, n))
                    bar.update()
        pairs = OVERLAP_SAMPLES * (1 if "target" in warm_up.very_slow else repeats)
        overlap = max(0.0, statistics.median(timer.overlap() for _ in range(pairs)))
        reshape = 0.0  # a very slow target's pass dwarfs a graph built again
        if "target" not in warm_up.very_slow:
            reshape = max(0.0, statistics.median(timer.reshape() for _ in range(pairs)))
    # The target's sizes above one token were timed after a pause: add back what the pause took off.
    added = {"target": overlap, "draft": 0.0}
    target_curve, draft_curve = (
        {
            n: statistics.median(warm_up.ones[name]) * statistics.median(r) + (added[name] if n > 1 else 0.0)
            for n, r in warm_up.ratios[name].items()
        }
        for name in timer.names
    )
    return CostModel(target_curve, draft_curve, label, overlap, measured=True, reshape=reshape)


class _Timer:
    """Times forwards of n new tokens after a `context`-token prefix, on a runner per model."""

    def __init__(self, models: dict, context: int) -> None:
        self.names = list(models)
        self.context = context
        self.runners = {name: make_runner(m, context + max(TARGET_SIZES)) for name, m in models.items()}
        self.generator = torch.Generator().manual_seed(0)
        self.vocab = min(as_model(m).vocab_size for m in models.values())

    def fill_context(self) -> None:
        for runner in self.runners.values():
            runner.extend(self._tokens(self.context, runner.device))

    def _tokens(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.randint(0, self.vocab, (n,), generator=self.generator).to(device)

    def forward(self, name: str, n: int) -> float:
        runner = self.runners[name]
        runner.keep(torch.arange(self.context, device=runner.device))
        tokens = self._tokens(n, runner.device)
        start = clock(runner.device)
        runner.extend(tokens, logits_to_keep=n)
        return clock(runner.device) - start

    def sample(self, name: str, n: int) -> tuple[float, float]:
        """(one-token seconds, n-token seconds / one-token seconds). One token is timed in steady state,
        right after another one-token forward: plain decoding and chain drafting repeat that shape, which
        llama.cpp runs faster (it reuses its compute graph: 71 against 91 ms for the 1.5B target on 2
        cores), and a streamed target's pass right after a long one starts with units read ahead. Other
        sizes are timed after a one-token forward, as trees vary, the target's after a pause as long as
        that forward (the draft's turn)."""
        self.forward(name, 1)
        one = self.forward(name, 1)
        if n == 1:
            return one, 1.0
        if name == "target":
            sleep(one)
        return one, self.forward(name, n) / one

    def reshape(self) -> float:
        """How much longer a one-token target pass takes right after a two-token one than right after a
        one-token one (a graph built, and over RPC sent, again)."""
        self.forward("target", 1)
        repeated = self.forward("target", 1)
        self.forward("target", 2)
        return self.forward("target", 1) - repeated

    def overlap(self) -> float:
        """How much sooner a one-token target pass ends after a pause as long as a pass."""
        self.forward("target", 1)
        back_to_back = self.forward("target", 1)
        sleep(back_to_back)
        return back_to_back - self.forward("target", 1)


@dataclass
class _Samples:
    """What the warm-up round found: each model's sizes worth timing, its first one-token forward's
    seconds, the models timed in this round alone, and the samples taken so far."""

    sizes: dict[str, list[int]] = field(default_factory=lambda: {"target": [], "draft": []})
    first: dict[str, float] = field(default_factory=dict)
    very_slow: set[str] = field(default_factory=set)
    ones: dict[str, list[float]] = field(default_factory=lambda: {"target": [], "draft": []})
    ratios: dict[str, dict[int, list[float]]] = field(default_factory=lambda: {"target": {}, "draft": {}})

    def add(self, name: str, n: int, one: float, ratio: float) -> None:
        self.ones[name].append(one)
        self.ratios[name].setdefault(n, []).append(ratio)


def _warm_up(timer: _Timer, progress: bool) -> _Samples:
    """Each model's sizes in ascending order, up to the first costing more than REPAY_LIMIT one-token
    target passes; a very slow model's sample of each of SPARSE_SIZES."""
    found = _Samples()
    with tqdm(desc="calibrating forward costs (warm-up)", disable=not progress, leave=False) as bar:
        one_step = None
        for name, candidates in (("target", TARGET_SIZES), ("draft", DRAFT_SIZES)):
            for n in candidates:
                if name in found.very_slow:
                    if n not in SPARSE_SIZES:
                        continue
                    one, ratio = timer.sample(name, n)
                    found.ones[name].append(one)
                    found.ratios[name][n] = [ratio]
                    seconds = one * ratio
                else:
                    seconds = timer.forward(name, n)
                bar.update()
                one_step = one_step or seconds
                found.first.setdefault(name, seconds)
                if n == 1 and seconds >= VERY_SLOW_FORWARD:
                    found.very_slow.add(name)
                    found.ratios[name][1] = [1.0]
                found.sizes[name].append(n)
                if len(found.sizes[name]) >= 2 and seconds > REPAY_LIMIT * one_step:
                    break
    return found


def _rounds(sizes: dict[str, list[int]], repeats: int, slow: set[str]) -> list[list[tuple[str, int]]]:
    """The (model, size) samples of each round: every size once per round, `repeats` rounds (2 from 256
    tokens up, where a run is long and steady: those take the middle rounds); a `slow` model's sizes above
    SLOW_REPEATED take only the first of their rounds."""
    rounds: list[list[tuple[str, int]]] = [[] for _ in range(repeats)]
    for name in sizes:
        for n in sizes[name]:
            runs = repeats if n < 256 else min(repeats, 2)
            first = (repeats - runs) // 2
            if name in slow and n > SLOW_REPEATED:
                runs = 1
            for r in range(first, first + runs):
                rounds[r].append((name, n))
    return rounds


def cached_cost_model(target, draft, recalibrate: bool = False) -> CostModel:
    """The calibration of this pair on this machine, measured on first use and cached on disk.

    The cache key covers both models (name, size, quantization, the w4a8 kernel build, scored
    vocabulary and which forward runs them), their dtypes and devices, the thread count and the
    target's offloading (real or simulated), so a change in any of them calibrates again.
    """
    path = _calibration_path(target, draft)
    if path.exists() and not recalibrate:
        return CostModel.from_json(json.loads(path.read_text()))
    cost = calibrate(target, draft, label=as_model(target).cost_label)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cost.to_json(), indent=1))
    return cost


def is_calibrated(target, draft) -> bool:
    """Whether `cached_cost_model` has this pair's calibration on disk (else it measures first)."""
    return _calibration_path(target, draft).exists()


def persisted_policies(target, draft) -> LearntPolicies:
    """The `LearntPolicies` of this pair on this machine, kept on disk beside its calibration."""
    calibration = _calibration_path(target, draft)
    return LearntPolicies(calibration.parent.parent / "learnt" / calibration.name)


def _calibration_path(target, draft) -> Path:
    """Where the pair's calibration is kept: keyed by what each model's forward costs depend on
    (`Model.cost_key`), the thread count and the calibration's format."""
    key = "|".join(
        [
            as_model(target).cost_key(),
            as_model(draft).cost_key(),
            str(torch.get_num_threads()),
            CALIBRATION_FORMAT,
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"{digest}.json"
