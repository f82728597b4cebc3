"""The public API: `generate` and `stream`, their statistics, input forms, stop conditions and errors."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import hf_greedy, perturbed, tiny_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

import specexec
from specexec import GenerationError

V = 32
MAX_POS = 64
PROMPT = [4, 9, 1, 30, 12, 7]
METHODS = ("ar", "sd", "dsl", "specinfer", "specexec")


@functools.cache
def target():
    return tiny_model("llama", seed=21, vocab_size=V, hidden_size=32, max_position_embeddings=MAX_POS)


@functools.cache
def draft():
    return perturbed(target(), 0.03)


@functools.cache
def reference(n: int = 40) -> tuple[int, ...]:
    return tuple(hf_greedy(target(), PROMPT, n))


def tokenizer() -> PreTrainedTokenizerFast:
    """Word-level: token i is the word "w{i}", decoded with spaces between words."""
    backend = Tokenizer(WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


# -- stream and statistics ----------------------------------------------------------------------------------

SAMPLED = dict(temperature=0.9, top_p=0.95, seed=3)


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", METHODS)
def test_stream_chunks_make_up_generate(method: str, sampling: dict) -> None:
    kwargs = dict(method=method, max_new_tokens=30, budget=6, **sampling)
    out = specexec.generate(target(), draft(), PROMPT, **kwargs)
    tokens, chunks = [], []
    for chunk in specexec.stream(target(), draft(), PROMPT, **kwargs):
        tokens += chunk.tokens
        chunks.append(chunk)
        stats = chunk.stats  # read as the chunk arrives
        assert stats.new_tokens == len(tokens)
        assert stats.target_calls == len(chunks)
        assert len(stats.accepted) == len(stats.tree_sizes) == len(stats.tree_depths) == len(chunks)
        assert len(chunk.tokens) == stats.accepted[-1] + 1 or chunk.finish_reason is not None
        assert 1 <= len(chunk.tokens) <= stats.accepted[-1] + 1
        assert stats.accepted[-1] <= stats.tree_depths[-1] <= stats.tree_sizes[-1] <= 6
    assert tokens == out.tokens
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == out.finish_reason == "length"
    stats = out.stats
    assert stats.method == method
    assert stats.prompt_tokens == len(PROMPT)
    assert stats.new_tokens == len(out.tokens) == 30
    assert stats.target_calls == len(chunks)
    assert stats.tokens_per_step == pytest.approx(stats.new_tokens / stats.target_calls)
    assert sum(stats.accepted) + stats.target_calls == stats.new_tokens
    if method == "ar":
        assert stats.draft_calls == 0 and stats.tokens_per_step == 1.0
    else:
        assert stats.draft_calls >= stats.target_calls - 1
        assert stats.tokens_per_step > 1.0
    if not sampling:
        assert out.tokens == list(reference(30))
    times = stats.to_dict()
    for key in ("prefill_seconds", "draft_seconds", "target_seconds", "decode_seconds", "overhead_seconds"):
        assert times[key] >= 0.0, key
    assert times["tokens_per_step"] == stats.tokens_per_step
    assert stats.draft_seconds + stats.target_seconds <= stats.decode_seconds + 1e-6


def test_sampling_is_reproducible_per_seed() -> None:
    runs = [
        specexec.generate(target(), draft(), PROMPT, max_new_tokens=20, temperature=1.0, seed=s).tokens
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize(
    "prompt",
    [
        PROMPT,
        tuple(PROMPT),
        torch.tensor(PROMPT),
        torch.tensor([PROMPT]),
        torch.tensor(PROMPT, dtype=torch.int32),
    ],
    ids=["list", "tuple", "1d", "2d", "int32"],
)
def test_input_forms(prompt) -> None:
    out = specexec.generate(target(), draft(), prompt, method="specexec", max_new_tokens=12, budget=8)
    assert out.tokens == list(reference(12))
    assert out.stats.prompt_tokens == len(PROMPT)


def test_one_token_prompt() -> None:
    expected = hf_greedy(target(), [5], 10)
    for method in METHODS:
        assert specexec.generate(target(), draft(), [5], method=method, max_new_tokens=10).tokens == expected


def test_draft_with_a_larger_vocabulary() -> None:
    """Padded vocabularies differ between model sizes; draft ids past the target's are never proposed."""
    other = tiny_model("llama", seed=22, vocab_size=V + 16, hidden_size=32, num_layers=1)
    for method in ("sd", "specinfer", "specexec"):
        out = specexec.generate(target(), other, PROMPT, method=method, max_new_tokens=20, budget=8)
        assert out.tokens == list(reference(20)), method
        out = specexec.generate(target(), other, PROMPT, method=method, max_new_tokens=20, temperature=1.0)
        assert max(out.tokens) < V


@pytest.mark.parametrize("method", ["sd", "specinfer", "specexec"])
def test_draft_with_a_smaller_vocabulary(method: str) -> None:
    """The engine pads a smaller draft's logits (`TreeDraftRunner._fit_vocab`), so it means to support
    such drafts; but the draft must then also read committed ids it has no embedding for (here prompt id
    30 >= 28). The output must still be the target's, whatever the draft makes of those ids."""
    other = tiny_model("llama", seed=22, vocab_size=V - 4, hidden_size=32, num_layers=1)
    assert max(PROMPT) >= V - 4
    out = specexec.generate(target(), other, PROMPT, method=method, max_new_tokens=20, budget=8)
    assert out.tokens == list(reference(20))


# -- stop conditions ----------------------------------------------------------------------------------------


def first_fresh(tokens: list[int], start: int) -> int:
    """Position of the first token at or after `start` that did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("method", METHODS)
def test_eos_argument(method: str) -> None:
    ref = list(reference())
    pos = first_fresh(ref, 6)
    for eos in (ref[pos], [ref[pos], V - 1 if ref[pos] != V - 1 else 0]):
        out = specexec.generate(
            target(), target(), PROMPT, method=method, max_new_tokens=40, eos_token_id=eos
        )
        assert out.tokens == ref[: pos + 1]
        assert out.finish_reason == "stop"


def test_eos_from_generation_config() -> None:
    ref = list(reference())
    pos = first_fresh(ref, 6)
    model = tiny_model("llama", seed=21, vocab_size=V, hidden_size=32, max_position_embeddings=MAX_POS)
    model.generation_config.eos_token_id = [ref[pos]]
    out = specexec.generate(model, model, PROMPT, max_new_tokens=40)
    assert out.tokens == ref[: pos + 1] and out.finish_reason == "stop"


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    ref = list(reference())
    pos = first_fresh(ref, 6)
    out = specexec.generate(target(), target(), PROMPT, max_new_tokens=pos + 1, eos_token_id=ref[pos])
    assert out.tokens == ref[: pos + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("words", [1, 2])
def test_stop_strings(method: str, words: int) -> None:
    tok = tokenizer()
    ref = list(reference())
    pos = first_fresh(ref, 8)
    stop = tok.decode(ref[pos - words + 1 : pos + 1])
    assert stop not in tok.decode(ref[:pos]), "test design: the stop string appears first at pos"
    out = specexec.generate(
        target(), target(), PROMPT, method=method, max_new_tokens=40, stop_strings=[stop], tokenizer=tok
    )
    assert out.tokens == ref[: pos + 1]
    assert out.finish_reason == "stop"
    assert tok.decode(out.tokens).endswith(stop)
    assert sum(out.stats.accepted) + out.stats.target_calls >= len(out.tokens)  # the last step may be cut
    chunks = list(
        specexec.stream(
            target(), target(), PROMPT, method=method, max_new_tokens=40, stop_strings=[stop], tokenizer=tok
        )
    )
    assert [t for c in chunks for t in c.tokens] == out.tokens
    assert chunks[-1].finish_reason == "stop"


def test_stop_string_not_reached() -> None:
    out = specexec.generate(
        target(), draft(), PROMPT, max_new_tokens=10, stop_strings=["w99"], tokenizer=tokenizer()
    )
    assert out.tokens == list(reference(10)) and out.finish_reason == "length"


# -- context window -----------------------------------------------------------------------------------------


def test_prompt_plus_new_tokens_up_to_the_context_window() -> None:
    prompt = (PROMPT * 6)[:30]
    expected = hf_greedy(target(), prompt, MAX_POS - 30)
    for method in METHODS:
        out = specexec.generate(
            target(), draft(), prompt, method=method, max_new_tokens=MAX_POS - 30, budget=64
        )
        assert out.tokens == expected, method


def test_prompt_plus_new_tokens_beyond_the_context_window() -> None:
    prompt = (PROMPT * 6)[:30]
    with pytest.raises(GenerationError, match=r"(?i)context window of 64"):
        specexec.generate(target(), draft(), prompt, max_new_tokens=MAX_POS - 29)


# -- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        (PROMPT, {"method": "beam"}, "unknown method"),
        (PROMPT, {"method": "SpecExec"}, "unknown method"),
        (PROMPT, {"draft": None, "method": "sd"}, "draft"),
        (PROMPT, {"draft": None, "method": "specexec"}, "draft"),
        ([], {}, "non-empty"),
        (torch.tensor([], dtype=torch.long), {}, "non-empty"),
        (torch.tensor([PROMPT, PROMPT]), {}, "1-D"),
        ([1, 2, V], {}, "input_ids"),
        ([1, -1, 2], {}, "input_ids"),
        (PROMPT, {"max_new_tokens": 0}, "max_new_tokens"),
        (PROMPT, {"max_new_tokens": -3}, "max_new_tokens"),
        (PROMPT, {"budget": 0}, "budget"),
        (PROMPT, {"temperature": -1.0}, "temperature"),
        (PROMPT, {"temperature": float("nan")}, "temperature"),
        (PROMPT, {"top_p": 0.0}, "top_p"),
        (PROMPT, {"top_p": 1.5}, "top_p"),
        (PROMPT, {"top_k": -2}, "top_k"),
        (PROMPT, {"stop_strings": ["w1"]}, "tokenizer"),
        (PROMPT, {"method": "sd", "lookahead_schedule": "fast"}, "lookahead_schedule"),
        (PROMPT, {"method": "dsl", "confidence_threshold": 1.5}, "confidence_threshold"),
    ],
)
def test_errors(prompt, kwargs: dict, match: str) -> None:
    kwargs = dict(kwargs)
    drafter = kwargs.pop("draft", draft())
    with pytest.raises(GenerationError, match=match):
        specexec.generate(target(), drafter, prompt, **kwargs)
    with pytest.raises(GenerationError, match=match):  # `stream` raises on the first `next`
        next(specexec.stream(target(), drafter, prompt, **kwargs))


def test_generation_error_is_a_value_error() -> None:
    assert issubclass(GenerationError, ValueError)


def test_ar_needs_no_draft_and_ignores_budget() -> None:
    out = specexec.generate(target(), None, PROMPT, method="ar", max_new_tokens=5, budget=0)
    assert out.tokens == list(reference(5))
