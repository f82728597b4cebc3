"""The calibration: forward costs measured on this machine, cached per pair, timed against drift."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
from tiny_models import budget_pair

from specexec.budget.chains import ChainCostStop
from specexec.budget.costs import CostModel
from specexec.budget.trees import AutoBudget
from specexec.calibration import cached_cost_model


@pytest.fixture(scope="module")
def models():
    """A tiny target, a draft close to it, and a prompt."""
    return budget_pair()


def test_calibration_is_measured_once_and_cached(models, tmp_path, monkeypatch) -> None:
    from specexec import calibration

    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    target, draft, _ = models
    first = cached_cost_model(target, draft)
    # Every size from 1 up to where a forward stops paying (REPAY_LIMIT; a tiny model's costs are mostly
    # per-call overhead, so how far that is depends on the machine).
    for curve, sizes in ((first.target, calibration.TARGET_SIZES), (first.draft, calibration.DRAFT_SIZES)):
        assert list(curve) == list(sizes[: len(curve)]) and len(curve) >= 2
    assert all(v > 0 for v in [*first.target.values(), *first.draft.values()])
    assert list((tmp_path / "calibration").glob("*.json"))
    monkeypatch.setattr("specexec.calibration.calibrate", lambda *a, **k: pytest.fail("calibrated twice"))
    assert cached_cost_model(target, draft).target == first.target


def calibrate_on_a_fake_clock(
    models,
    monkeypatch,
    seconds: Callable[[int, int], float],
    head_start: Callable[[float, int], float] = None,
    repeats: int = 3,
    draft_seconds: Callable[[int, int], float] | None = None,
    target_seen: list[int] | None = None,
) -> tuple[CostModel, list[int]]:
    """`calibration.calibrate` (`repeats` rounds) over runners whose k-th forward of n tokens takes
    `seconds(n, k)` on a fake clock (the draft's `draft_seconds(n, k)` where given), less
    `head_start(pause, n)` for the target's forwards after a pause (as a streamed target reads ahead);
    also returns the sizes forwarded, in order (the target's alone into `target_seen`)."""
    from specexec import calibration

    now = [0.0]
    seen: list[int] = []

    class FakeRunner:
        def __init__(self, model, capacity) -> None:
            self.device = torch.device("cpu")
            self.is_target = model is models[0]
            self.last_end = 0.0

        def extend(self, tokens, logits_to_keep=1) -> None:
            seen.append(tokens.numel())
            if self.is_target and target_seen is not None:
                target_seen.append(tokens.numel())
            cost = seconds if self.is_target or draft_seconds is None else draft_seconds
            took = cost(tokens.numel(), len(seen))
            if head_start and self.is_target:
                took -= head_start(now[0] - self.last_end, tokens.numel())
            now[0] += took
            self.last_end = now[0]

        def keep(self, slots) -> None:
            pass

    def sleep(pause: float) -> None:
        now[0] += pause

    monkeypatch.setattr(calibration, "make_runner", FakeRunner)
    monkeypatch.setattr(calibration, "clock", lambda device: now[0])
    monkeypatch.setattr(calibration, "sleep", sleep)
    target, draft, _ = models
    return calibration.calibrate(target, draft, repeats=repeats, progress=False), seen


def test_calibration_drift_moves_the_curve_without_bending_it(models, monkeypatch) -> None:
    """The machine slows down steadily while calibrating: every forward costs its size times a factor that
    grows with each forward. Sizes measured one after another would come out in the wrong proportions
    (the last sizes timed at the slowest); timing each against the one-token forward just before it keeps
    them (taking turns alone left a 12% bend)."""
    cost, _ = calibrate_on_a_fake_clock(models, monkeypatch, lambda n, k: n * (1 + 0.05 * k))
    for curve in (cost.target, cost.draft):
        per_token = [seconds / n for n, seconds in curve.items()]
        assert max(per_token) < 1.05 * min(per_token), curve


def test_calibration_does_not_time_sizes_that_cannot_pay(models, monkeypatch) -> None:
    """A CPU where cost grows with every token: sizes past REPAY_LIMIT one-token target passes are never
    run (they would be the slowest to time), and the curve extrapolates past the last one timed."""
    cost, seen = calibrate_on_a_fake_clock(models, monkeypatch, lambda n, k: 0.05 * n)
    assert max(cost.target) == 31 and max(cost.draft) == 31  # 31 costs 31 > 20 passes; 32 never ran
    assert max(n for n in seen if n != 256) == 31  # 256: the context
    assert cost.target_seconds(64) == pytest.approx(3.2)


def test_a_slow_target_is_timed_every_round_at_the_sizes_trees_use(models, monkeypatch) -> None:
    """Slow models (a one-token forward of SLOW_FORWARD or more, as a streamed target's): sizes up to
    SLOW_REPEATED are timed in every round, larger ones once, however many rounds."""
    from specexec import calibration

    for repeats in (3, 5):
        cost, seen = calibrate_on_a_fake_clock(
            models, monkeypatch, lambda n, k: 0.5 + 0.001 * n, repeats=repeats
        )
        assert max(cost.target) == 1024  # flat: every size pays
        warm_up = len(calibration.TARGET_SIZES) + len(calibration.DRAFT_SIZES) + 2
        timed = collections.Counter(seen[warm_up:])
        for n in (3, 64):
            assert timed[n] == 2 * repeats, timed  # every round, target and draft
        assert timed[128] == 2 and timed[256] == 1, timed  # once per model (the draft stops at 128)


def test_a_very_slow_target_is_timed_once_per_sparse_size(models, monkeypatch) -> None:
    """A target whose one-token pass takes VERY_SLOW_FORWARD or more (a large model streamed from disk)
    is timed once per size of SPARSE_SIZES, in the warm-up round: a quarter of the passes a slow one
    takes, and the same curve from them. The draft beside it is timed as before."""
    from specexec import calibration

    def calibrated(one: float) -> tuple[CostModel, list[int]]:
        target: list[int] = []
        cost, _ = calibrate_on_a_fake_clock(
            models, monkeypatch, lambda n, k: one + 0.01 * n, draft_seconds=lambda n, k: 0.01 * n,
            target_seen=target,
        )  # fmt: skip
        return cost, target[1:]  # less the context's prefill

    very_slow, very_slow_passes = calibrated(9.0)
    assert sorted(very_slow.target) == list(calibration.SPARSE_SIZES)
    for n in (1, 3, 16, 17, 100, 1024):
        assert very_slow.target_seconds(n) == pytest.approx(9.0 + 0.01 * n, rel=1e-6), n
    assert len(very_slow_passes) == 1 + 3 * (len(calibration.SPARSE_SIZES) - 1) + 3 * 3
    slow, slow_passes = calibrated(0.5)
    assert sorted(slow.target) == sorted(calibration.TARGET_SIZES)  # every size, in rounds
    assert len(very_slow_passes) < len(slow_passes) / 4, (len(very_slow_passes), len(slow_passes))
    assert sorted(very_slow.draft) == sorted(slow.draft) == sorted(calibration.DRAFT_SIZES)


def test_calibration_times_what_a_pause_before_a_target_pass_saves(models, monkeypatch) -> None:
    """A streamed target reads ahead while the draft works, up to its window: here a pass of up to 16
    tokens after a pause is shorter by the pause, up to 0.2 s; a larger one is compute-bound and gains
    nothing. The calibration finds those 0.2 s (its pause is as long as a pass, 0.5 s), and a curve that
    charges a step drafting at least that long what it takes: the drafting plus the pass after it.
    Nothing for a target in RAM."""
    streamed, _ = calibrate_on_a_fake_clock(
        models,
        monkeypatch,
        lambda n, k: 0.5 + 0.01 * n,
        head_start=lambda pause, n: min(pause, 0.2) if n <= 16 else 0.0,
    )
    assert streamed.overlap == pytest.approx(0.2)
    assert streamed.target_seconds(1) == pytest.approx(0.51)  # pass after pass, as plain decoding runs
    for n, drafting in ((8, 0.3), (16, 0.2), (32, 0.3), (64, 0.4)):
        step = float(streamed.exposed(torch.tensor(drafting))) + streamed.target_seconds(n)
        head_start = min(drafting, 0.2) if n <= 16 else 0.0
        assert step == pytest.approx(drafting + 0.5 + 0.01 * n - head_start), n
    in_ram, _ = calibrate_on_a_fake_clock(models, monkeypatch, lambda n, k: 0.5 + 0.01 * n)
    assert in_ram.overlap == 0.0
    assert CostModel.from_json(streamed.to_json()).fingerprint() == streamed.fingerprint()


def test_calibration_times_what_a_one_token_pass_costs_more_after_another_shape(models, monkeypatch) -> None:
    """llama.cpp reuses a repeated shape's graph: here a one-token target pass costs 0.05 s more right
    after a pass of another shape. The one-token cost is the repeated pass's, and the reshape the
    difference; a target without it (the negative control) has none."""

    def with_reshape(extra: float):
        last = [0]

        def seconds(n: int, k: int) -> float:
            took = 0.1 + 0.01 * n + (extra if n == 1 and last[0] != 1 else 0.0)
            last[0] = n
            return took

        return seconds

    draft = lambda n, k: 0.01 * n  # noqa: E731
    cost, _ = calibrate_on_a_fake_clock(models, monkeypatch, with_reshape(0.05), draft_seconds=draft)
    assert cost.reshape == pytest.approx(0.05)
    assert cost.target_seconds(1) == pytest.approx(0.11)
    control, _ = calibrate_on_a_fake_clock(models, monkeypatch, with_reshape(0.0), draft_seconds=draft)
    assert control.reshape == 0.0


def test_calibration_keeps_a_batch_that_costs_less_than_a_smaller_one(models, monkeypatch) -> None:
    """llama.cpp's repacked kernels run rows in groups: 4 tokens can cost less than 3 (IQ4_NL on AVX-512:
    1.56x against 2.1x of one). The machine meanwhile switches between two speeds, 1.8x apart, every 20
    forwards. The calibration must keep both the dip and the proportions, and the policies must then
    verify 4 tokens rather than 3."""
    shape = {1: 1.0, 2: 1.55, 3: 2.1, 4: 1.56, 6: 2.7, 8: 3.0, 16: 4.1}

    def seconds(n: int, k: int) -> float:
        speed = 1.8 if (k // 20) % 2 else 1.0
        return 0.1 * speed * (shape[n] if n in shape else n / 4)

    cost, _ = calibrate_on_a_fake_clock(models, monkeypatch, seconds)
    for curve in (cost.target, cost.draft):
        ratios = {n: curve[n] / curve[1] for n in shape if n in curve}
        assert ratios == pytest.approx({n: shape[n] for n in ratios}, rel=0.02), ratios
    assert cost.target_seconds(4) < cost.target_seconds(3)
    assert cost.target_seconds(64) > cost.target_seconds(32) > cost.target_seconds(16)
    # A chain of sure draft tokens does not stop at 2 (3 tokens verified) when 3 verify for less (the
    # draft at a tenth of the target's cost: at the same cost no chain pays).
    stop = ChainCostStop(CostModel(cost.target, {n: seconds / 10 for n, seconds in cost.draft.items()}))
    stop.start()
    assert [stop.should_stop(0.95) for _ in range(2)] == [False, False]  # a chain of 3 at least
    # A tree of 2 sure nodes and a third as likely is verified whole (4 tokens), not cut at 3.
    policy = AutoBudget(cost)
    assert policy.best_size(torch.tensor([0.9, 0.8, 0.7]), draft_seconds=0.0)[0] == 3


def test_calibration_sees_passes_step_up_past_a_multiple_of_16(models, monkeypatch) -> None:
    """llama.cpp's CPU passes cost least at a multiple of 16 tokens and step up one token past it (the
    1.5B target streamed from disk: 16 tokens 0.49 s, 17 0.54 s). Here each started block of 16 tokens
    costs 0.1 s over 0.5 s. The curve must show the steps, and the auto budget must then verify trees
    whose pass (the nodes and the root) fills its last block: 15, 31 or 63 nodes, not one more."""
    cost, _ = calibrate_on_a_fake_clock(models, monkeypatch, lambda n, k: 0.5 + 0.1 * -(-n // 16))
    for tokens, seconds in ((16, 0.6), (17, 0.7), (24, 0.7), (32, 0.7), (33, 0.8), (64, 0.9), (65, 1.0)):
        assert cost.target_seconds(tokens) == pytest.approx(seconds), tokens
    policy = AutoBudget(cost)
    ranked = [decay ** torch.arange(1.0, 64.0) for decay in (0.5, 0.85, 0.95)]  # 63 nodes, best first
    assert [policy.best_size(probs, draft_seconds=0.0)[0] for probs in ranked] == [15, 31, 63]
