"""KV reuse across generations (`stream(prefix_cache=...)`), KV buffers that grow with the generation,
and a prefill that can be cancelled between chunks."""

from __future__ import annotations

import functools

import pytest
from tiny_models import perturbed, tiny_model

import specexec
from specexec.backends import base as runner_base
from specexec.prefix_cache import PrefixCache

PROMPT = [5, 17, 3, 29, 11, 8, 2, 40, 13, 6]
FOLLOW_UP = [7, 31, 4, 19]


@functools.cache
def pair(arch: str):
    target = tiny_model(arch, seed=31, max_position_embeddings=256)
    return target, perturbed(target, 0.03)


def embedded_tokens(model) -> list[int]:
    """Token counts of every forward of `model` from now on (both runners embed their input first)."""
    counts: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: counts.append(args[0].numel()))
    return counts


@pytest.mark.parametrize("method", ["ar", "sd", "specexec"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # the native forward, and Hugging Face's (sliding)
def test_a_follow_up_reuses_the_first_turn_and_equals_a_fresh_generation(arch: str, method: str) -> None:
    target, draft = pair(arch)
    cache = PrefixCache(1 << 30)
    kwargs = dict(method=method, budget=8 if method != "ar" else None, max_new_tokens=12)
    first = specexec.generate(target, draft, PROMPT, prefix_cache=cache, **kwargs)
    assert first.stats.cached_tokens == 0 and len(cache) == 1
    turn = PROMPT + first.tokens + FOLLOW_UP
    reused = specexec.generate(target, draft, turn, prefix_cache=cache, **kwargs)
    fresh = specexec.generate(target, draft, turn, **kwargs)
    assert reused.tokens == fresh.tokens
    # The target cache held the prompt and all but the last generated token.
    assert reused.stats.cached_tokens == len(PROMPT) + len(first.tokens) - 1
    assert len(cache) == 1  # the entry was taken, extended and put back

    # A prompt that shares only its first tokens reuses those, and still decodes exactly.
    other = PROMPT[:4] + [1, 2, 3]
    out = specexec.generate(target, draft, other, prefix_cache=cache, **kwargs)
    assert out.stats.cached_tokens == 4
    assert out.tokens == specexec.generate(target, draft, other, **kwargs).tokens


def test_reuse_skips_the_prefill_of_the_cached_tokens() -> None:
    target, draft = pair("llama")
    cache = PrefixCache(1 << 30)
    first = specexec.generate(target, draft, PROMPT, method="ar", max_new_tokens=5, prefix_cache=cache)
    counts = embedded_tokens(target)
    turn = PROMPT + first.tokens + FOLLOW_UP
    specexec.generate(target, draft, turn, method="ar", max_new_tokens=1, prefix_cache=cache)
    # Prefill forwards only what the cache lacked (the last generated token and the follow-up but its
    # last token, the first root); then one decoding step.
    assert counts == [len(FOLLOW_UP), 1]


def test_least_recently_used_entries_are_evicted_by_bytes() -> None:
    target, draft = pair("llama")
    probe = PrefixCache(1 << 30)
    specexec.generate(target, draft, PROMPT, max_new_tokens=4, prefix_cache=probe)
    one = probe.nbytes
    cache = PrefixCache(int(one * 1.5))
    specexec.generate(target, draft, PROMPT, max_new_tokens=4, prefix_cache=cache)
    specexec.generate(target, draft, [9, 9, 9, 9, 9, 9, 9, 9, 9, 9], max_new_tokens=4, prefix_cache=cache)
    assert len(cache) == 1 and cache.nbytes <= cache.max_bytes
    again = specexec.generate(target, draft, PROMPT, max_new_tokens=4, prefix_cache=cache)
    assert again.stats.cached_tokens == 0  # the first entry was evicted
    assert len(PrefixCache(0)) == 0
    specexec.generate(target, draft, PROMPT, max_new_tokens=4, prefix_cache=(empty := PrefixCache(0)))
    assert len(empty) == 0  # nothing fits in no bytes
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)


def test_kv_buffers_grow_with_the_generation_not_the_context_window() -> None:
    window = 1 << 17
    target = tiny_model("llama", seed=31, max_position_embeddings=window)
    draft = perturbed(target, 0.03)
    cache = PrefixCache(1 << 30)
    chunks = specexec.stream(target, draft, PROMPT, max_new_tokens=window - 64, budget=8, prefix_cache=cache)
    new_tokens = sum(len(next(chunks).tokens) for _ in range(3))
    chunks.close()  # the runners go to the cache, where their buffers can be measured
    config = target.config
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32 K, V
    held = cache.nbytes
    print(
        f"KV held after {new_tokens} new tokens: {held} bytes; sized for the window: {2 * window * per_slot}"
    )
    # Target and draft, each at most twice what the prompt, the tokens and the largest tree need; sized
    # for the window they would hold 100 MB.
    assert held <= 2 * 2 * 200 * per_slot


def test_a_prefill_is_cancelled_between_chunks_and_its_work_kept(monkeypatch) -> None:
    monkeypatch.setattr(runner_base, "PREFILL_CHUNK", 4)
    target, draft = pair("llama")
    cache = PrefixCache(1 << 30)
    asked = []
    counts = embedded_tokens(target)
    prompt = PROMPT * 3  # 29 tokens to prefill: 8 chunks of at most 4

    def cancelled() -> bool:
        asked.append(True)
        return len(asked) == 2

    kwargs = dict(method="sd", budget=4, max_new_tokens=6)
    chunks = list(specexec.stream(target, draft, prompt, prefix_cache=cache, cancelled=cancelled, **kwargs))
    assert chunks == [] and counts == [4, 4]  # stopped after the second chunk, nothing decoded
    out = specexec.generate(target, draft, prompt, prefix_cache=cache, **kwargs)
    assert out.stats.cached_tokens == 8
    assert out.tokens == specexec.generate(target, draft, prompt, **kwargs).tokens
