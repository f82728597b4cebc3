"""The real pair with int4 weights (float32 activations), and llama.cpp on the target GGUF. A module of its
own so that the float32 pair of test_integration.py is freed first (both at once need ~18 GB)."""

from __future__ import annotations

import pytest
import torch

import specexec
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from specexec.prompts import load_prompts

pytestmark = pytest.mark.slow

NEW_TOKENS = 12  # PyTorch's low-bit kernels are ~40x slower with float32 activations than bfloat16


@pytest.fixture(scope="module")
def int4_pair():
    """The pair with int4 weights, float32 activations: exact relative to the quantized target."""
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = load_prompts("humaneval", tokenizer, n=1)
    target = load_model(DEFAULT_TARGET, torch.float32, quant="int4")
    draft = load_model(DEFAULT_DRAFT, torch.float32, quant="int4")
    prompt = prompts[0]
    eos = eos_token_ids(target, tokenizer)
    with torch.inference_mode():
        reference = target.generate(
            torch.tensor([prompt.input_ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
            pad_token_id=eos[0],
        )[0, len(prompt.input_ids) :].tolist()  # fmt: skip
    return target, draft, prompt, reference


@pytest.mark.parametrize(("method", "budget", "ngram"), [("sd", 3, 0), ("specexec", 8, 10)])
def test_real_pair_int4_greedy_equals_its_own_target(int4_pair, method: str, budget: int, ngram: int) -> None:
    target, draft, prompt, reference = int4_pair
    out = specexec.generate(
        target, draft, prompt.input_ids, method=method, budget=budget, ngram=ngram, max_new_tokens=NEW_TOKENS
    )
    assert out.tokens == reference
    assert out.stats.tokens_per_step > 1.5


def test_llamacpp_decodes_the_target_gguf() -> None:
    """The llamacpp bench method on the real target GGUF (skipped without the optional extra)."""
    pytest.importorskip("llama_cpp")
    from specexec.bench.llamacpp import LlamaCpp
    from specexec.models import gguf_file

    tokenizer = load_tokenizer(DEFAULT_TARGET)
    ids = tokenizer("def fibonacci(n):")["input_ids"]
    runner = LlamaCpp(gguf_file(DEFAULT_TARGET), context=128)
    out = runner.run(ids, 16, 0, [151643, 151645], temperature=0.0, top_p=1.0, top_k=0)
    assert out["new_tokens"] == 16 and out["target_calls"] == 16
    assert "return" in tokenizer.decode(out["tokens"])
    again = runner.run(ids, 16, 0, [151643, 151645], temperature=0.0, top_p=1.0, top_k=0)
    assert again["tokens"] == out["tokens"]
