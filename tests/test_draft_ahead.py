"""Drafting ahead (`Settings.draft_ahead`): the draft grows the next tree while the target verifies, on
another thread, and the next step starts from the subtree below the token the verification ended on.

The cache walk is exact whatever the tree, so outputs must not change; the tests check that, that trees
really are carried over (a feature that never carried would pass the exactness tests alone), and the
errors. Streamed llama.cpp targets, the case it is for, are covered in test_stream.py.
"""

from __future__ import annotations

import functools

import pytest
from tiny_models import PERTURB_NOISE, hf_greedy, perturbed, tiny_model

import specexec
from specexec.budget.costs import CostModel
from specexec.drafters import BestFirstDrafter
from specexec.engine import GenerationError

PROMPT = [3, 17, 42, 5, 9, 11, 60, 2]
NEW = 48
# A target pass that costs the same for any tree and a cheap draft: the auto budget builds trees.
FLAT = CostModel({1: 1.0, 1024: 1.2}, {1: 0.05, 128: 0.06})


@functools.cache
def pair(arch: str, kind: str):
    target = tiny_model(arch, seed=0)
    return target, target if kind == "self" else perturbed(target, PERTURB_NOISE[arch])


@functools.cache
def reference(arch: str) -> tuple[int, ...]:
    return tuple(hf_greedy(pair(arch, "self")[0], PROMPT, NEW))


@pytest.mark.parametrize("budget", [8, "auto"])
@pytest.mark.parametrize("kind", ["self", "perturbed"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_greedy_output_is_the_targets_and_trees_are_carried(arch: str, kind: str, budget) -> None:
    target, draft = pair(arch, kind)
    cost = {"cost_model": FLAT} if budget == "auto" else {}
    out = specexec.generate(
        target, draft, PROMPT, method="specexec", budget=budget, max_new_tokens=NEW, draft_ahead=True, **cost
    )
    assert out.tokens == list(reference(arch))
    stats = out.stats
    assert stats.ahead_calls > 0
    assert max(stats.tree_sizes) <= (budget if budget != "auto" else 1024)
    if kind == "self":  # the target's own choices: the verified path ends where the draft grew on
        assert stats.carried > 0


def test_by_default_it_drafts_nothing_ahead_and_carries_nothing() -> None:
    target, draft = pair("llama", "self")
    out = specexec.generate(target, draft, PROMPT, method="specexec", budget=8, max_new_tokens=NEW)
    assert out.tokens == list(reference("llama"))
    assert out.stats.ahead_calls == 0 and out.stats.carried == 0 and out.stats.ahead_seconds == 0.0


def test_carrying_saves_draft_passes() -> None:
    """With the target as its own draft, a carried tree spares the step the passes that grew it."""
    target, draft = pair("llama", "self")
    calls = {}
    for ahead in (False, True):
        out = specexec.generate(
            target, draft, PROMPT, method="specexec", budget=8, max_new_tokens=NEW, draft_ahead=ahead
        )
        calls[ahead] = out.stats.draft_calls
    assert calls[True] < calls[False]


def test_only_specexec_drafts_ahead() -> None:
    target, draft = pair("llama", "perturbed")
    with pytest.raises(GenerationError, match="draft_ahead is for method 'specexec', not 'sd'"):
        specexec.generate(target, draft, PROMPT, method="sd", max_new_tokens=4, draft_ahead=True)


def test_an_error_while_drafting_ahead_surfaces_after_the_pass(monkeypatch) -> None:
    def broken(self, *args, **kwargs):
        raise RuntimeError("drafting ahead failed")

    monkeypatch.setattr(BestFirstDrafter, "draft_ahead", broken)
    target, draft = pair("llama", "perturbed")
    with pytest.raises(RuntimeError, match="drafting ahead failed"):
        specexec.generate(
            target, draft, PROMPT, method="specexec", budget=8, max_new_tokens=8, draft_ahead=True
        )
    # The generation that failed let go of its verifying thread; the next one runs as usual.
    out = specexec.generate(target, draft, PROMPT, method="specexec", budget=8, max_new_tokens=NEW)
    assert out.tokens == list(reference("llama"))


def test_sampled_output_does_not_depend_on_drafting_ahead() -> None:
    """The cache walk draws one target sample per emitted token, whatever the tree: with the same seed,
    drafting ahead (other trees) must emit the same tokens. With the distribution test of specexec
    (test_distribution.py), this makes drafting ahead exact when sampling too."""
    target, draft = pair("qwen2", "perturbed")
    runs = {
        ahead: specexec.generate(
            target, draft, PROMPT, method="specexec", budget=4, max_new_tokens=NEW, temperature=0.8, seed=5,
            draft_ahead=ahead,
        )
        for ahead in (False, True)
    }  # fmt: skip
    assert runs[True].tokens == runs[False].tokens
    assert runs[True].stats.carried > 0  # test design: other trees


def test_the_cli_flag_and_the_stats_line() -> None:
    from specexec.cli import _drafted_ahead, build_parser

    assert build_parser().parse_args(["generate", "--draft-ahead", "x"]).draft_ahead is True
    assert build_parser().parse_args(["generate", "x"]).draft_ahead is False
    target, draft = pair("llama", "self")
    on = specexec.generate(
        target, draft, PROMPT, method="specexec", budget=8, max_new_tokens=NEW, draft_ahead=True
    )
    off = specexec.generate(target, draft, PROMPT, method="specexec", budget=8, max_new_tokens=NEW)
    line = _drafted_ahead(on.stats)
    assert f"({on.stats.ahead_calls} passes, {on.stats.carried} nodes carried into steps)" in line, line
    assert _drafted_ahead(off.stats) == ""


def test_the_bench_compares_drafting_ahead_off_and_on() -> None:
    from specexec.bench import make_configs
    from specexec.bench.core import BenchConfig
    from specexec.bench.errors import BenchError

    configs = make_configs(["specexec"], budgets=[8], draft_aheads=(False, True))
    assert [c.label for c in configs] == ["ar", "specexec@8", "specexec@8+ahead"]
    assert [c.draft_ahead for c in configs] == [None, False, True]
    with pytest.raises(BenchError, match="takes no draft_ahead"):
        BenchConfig("sd", 4, draft_ahead=True)
