"""What the auto policies learn, kept across generations and processes (`LearntPolicies`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import budget_pair, tiny_qwen

import specexec
from specexec.budget.acceptance import AcceptanceModel
from specexec.budget.costs import CostModel
from specexec.budget.trees import AutoBudget


@pytest.fixture(scope="module")
def models():
    """A tiny target, a draft close to it, and a prompt."""
    return budget_pair()


def test_learnt_policies_carry_what_one_generation_learnt_into_the_next(models) -> None:
    """With a draft that is rarely right, a fresh generation finds that out again every time, drafting
    from its first steps; one that shares `LearntPolicies` with the generation before it drafts far
    less. Outputs are exact either way."""
    target, _, prompt = models
    wrong = tiny_qwen(5)  # unrelated weights
    cost = CostModel({1: 0.1, 4: 0.11, 16: 0.2}, {1: 0.02, 16: 0.05})
    for method in ("specexec", "dsl"):
        learnt = specexec.LearntPolicies()

        def run(shared, method=method):
            return specexec.generate(
                target, wrong, prompt, method=method, budget="auto", cost_model=cost, max_new_tokens=48,
                learnt=shared,
            )  # fmt: skip

        first, again, fresh = run(learnt), run(learnt), run(None)
        assert again.tokens == fresh.tokens == first.tokens
        assert fresh.stats.draft_calls == first.stats.draft_calls > 0
        assert again.stats.draft_calls < fresh.stats.draft_calls / 2, method


def test_saved_policies_keep_the_target_pace(tmp_path: Path) -> None:
    """A new process starts at the pace the last one learnt, with λ in the units it was saved in."""
    path = tmp_path / "pair.json"
    cost = CostModel({1: 0.4, 16: 0.5, 64: 0.8}, {1: 0.02, 16: 0.1}, measured=True)
    first = specexec.LearntPolicies(path)
    policy = first.get(("pair",), ("setting",), lambda: AutoBudget(cost, max_budget=64))
    for _ in range(60):
        policy.observe_pass(1, 0.0, 1.5 * cost.target_seconds(1))
    first.save()
    again = specexec.LearntPolicies(path).get(
        ("pair",), ("setting",), lambda: AutoBudget(cost, max_budget=64)
    )
    assert again.pace.factor == policy.pace.factor == pytest.approx(1.5, rel=0.01)
    assert again.cost.target_seconds(16) == pytest.approx(0.75, rel=0.03)
    assert again.gate.rate == pytest.approx(policy.gate.rate)
    assert again.target_table.tolist() == pytest.approx((again.measured_table * policy.pace.factor).tolist())


def test_saved_policies_start_a_new_process_where_the_last_one_stopped(models, tmp_path: Path) -> None:
    """`save` then a new `LearntPolicies` on the same file (what one `specexec generate` after another
    does): the second starts from what the first learnt; a damaged or foreign file starts fresh."""
    target, _, prompt = models
    wrong = tiny_qwen(5)
    cost = CostModel({1: 0.1, 4: 0.11, 16: 0.2}, {1: 0.02, 16: 0.05})
    path = tmp_path / "learnt" / "pair.json"

    def run(learnt):
        return specexec.generate(
            target, wrong, prompt, method="specexec", budget="auto", cost_model=cost, max_new_tokens=48,
            learnt=learnt,
        )  # fmt: skip

    first = specexec.LearntPolicies(path)
    fresh = run(first)
    first.save()
    again = run(specexec.LearntPolicies(path))
    assert again.tokens == fresh.tokens
    assert again.stats.draft_calls < fresh.stats.draft_calls / 2
    path.write_text("{not json")
    assert run(specexec.LearntPolicies(path)).stats.draft_calls == fresh.stats.draft_calls
    path.write_text('{"format": 0, "policies": {}}')
    assert run(specexec.LearntPolicies(path)).stats.draft_calls == fresh.stats.draft_calls
    first.save()
    damaged = json.loads(path.read_text())
    for state in damaged["policies"].values():
        state["acceptance"]["tried"] = state["acceptance"]["tried"][:3]
    path.write_text(json.dumps(damaged))
    assert run(specexec.LearntPolicies(path)).stats.draft_calls == fresh.stats.draft_calls
    other = CostModel({1: 0.1, 4: 0.12, 16: 0.2}, {1: 0.02, 16: 0.05})  # another calibration: not its state
    first.save()
    out = specexec.generate(
        target, wrong, prompt, method="specexec", budget="auto", cost_model=other, max_new_tokens=48,
        learnt=specexec.LearntPolicies(path),
    )  # fmt: skip
    assert out.stats.draft_calls > again.stats.draft_calls


def test_learnt_rates_follow_the_last_observations() -> None:
    from specexec.budget.acceptance import ACCEPTANCE_MEMORY
    from specexec.budget.gate import RATE_MEMORY, SpeculationGate

    model = AcceptanceModel()
    for _ in range(4):
        model.observe(torch.full((ACCEPTANCE_MEMORY,), 0.95), torch.ones(ACCEPTANCE_MEMORY, dtype=torch.bool))
    model.observe(torch.full((ACCEPTANCE_MEMORY,), 0.95), torch.zeros(ACCEPTANCE_MEMORY, dtype=torch.bool))
    assert float(model(torch.tensor([0.95]))[0]) == pytest.approx(0.5, abs=0.01)  # all-time: 0.8
    gate = SpeculationGate(CostModel({1: 0.1, 64: 0.2}, {1: 0.05, 64: 0.1}))
    for _ in range(RATE_MEMORY):
        gate.record(1, 0.5)  # 2 tok/s
    for _ in range(RATE_MEMORY // 2):
        gate.record(10, 0.5)  # 20 tok/s, five memories' worth of tokens
    assert gate.rate > 15  # all-time: 8
