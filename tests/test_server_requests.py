"""Request normalisation (server/requests.py) without HTTP or a model: body -> `Params` or an APIError."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jinja2
import pytest

from specexec.server.limits import COMPLETIONS_DEFAULT_MAX_TOKENS, GREEDY_BELOW, MAX_TOKENS_WITHOUT_WINDOW
from specexec.server.requests import RequestSettings, check_request, prepare
from specexec.server.schemas import APIError, ChatCompletionRequest, CompletionRequest, parse_body

MODEL = "tiny"
BOS = 1  # what the fake tokenizer prepends when asked for special tokens
VOCAB = 300
SETTINGS = RequestSettings(model_name=MODEL, window=64, vocab_size=VOCAB, default_max_tokens=40)


class FakeTokenizer:
    """One token per character (its code point), BOS first with special tokens; a tagged chat template."""

    chat_template = "tags"

    def __call__(self, text: str, add_special_tokens: bool) -> dict:
        return {"input_ids": ([BOS] if add_special_tokens else []) + [ord(ch) for ch in text]}

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize
        turns = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return turns + "<assistant>"


class BrokenTemplate(FakeTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        raise jinja2.TemplateError("roles must alternate")


def completion(settings: RequestSettings = SETTINGS, tokenizer=None, **body):
    req = parse_body(CompletionRequest, json.dumps({"model": MODEL, "prompt": "hi", **body}).encode())
    check_request(req, settings)
    return prepare(req, tokenizer or FakeTokenizer(), settings)


def chat(settings: RequestSettings = SETTINGS, tokenizer=None, **body):
    messages = [{"role": "user", "content": "hi"}]
    req = parse_body(
        ChatCompletionRequest, json.dumps({"model": MODEL, "messages": messages, **body}).encode()
    )
    check_request(req, settings)
    return prepare(req, tokenizer or FakeTokenizer(), settings)


def refused(call, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args, **kwargs)
    assert 400 <= info.value.status < 500 and "\n" not in info.value.message
    return info.value


# ---- prompts -----------------------------------------------------------------------------------------


def test_a_text_prompt_is_encoded_with_special_tokens_and_chat_without():
    assert completion(prompt="ab").prompt_ids == [BOS, ord("a"), ord("b")]
    assert completion(prompt=["ab"]).prompt_ids == [BOS, ord("a"), ord("b")]
    assert chat().prompt_ids == [ord(ch) for ch in "<user>hi<assistant>"]


def test_chat_content_parts_are_joined():
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    assert chat(messages=messages).prompt_ids == [ord(ch) for ch in "<system>be brief<user>hi<assistant>"]


def test_token_id_prompts_are_taken_as_they_are_and_checked_against_the_vocabulary():
    assert completion(prompt=[5, 0, VOCAB - 1]).prompt_ids == [5, 0, VOCAB - 1]
    assert completion(prompt=[[7, 8]]).prompt_ids == [7, 8]
    err = refused(completion, prompt=[5, VOCAB, 6])
    assert err.param == "prompt" and f"Token id {VOCAB} " in err.message


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
def test_one_prompt_per_request(prompt):
    assert refused(completion, prompt=prompt).code == "unsupported_value"


@pytest.mark.parametrize("prompt", [[], [[]]])
def test_an_empty_prompt_is_refused(prompt):
    assert refused(completion, prompt=prompt).message == "The prompt is empty."


def test_chat_needs_a_template_that_renders_the_messages():
    no_template = FakeTokenizer()
    no_template.chat_template = None
    assert refused(chat, tokenizer=no_template).code == "chat_template_missing"
    err = refused(chat, tokenizer=BrokenTemplate())
    assert err.param == "messages" and "roles must alternate" in err.message


# ---- token limits ------------------------------------------------------------------------------------


def test_max_tokens_defaults_differ_between_completions_and_chat():
    assert completion().max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert chat().max_tokens == SETTINGS.default_max_tokens != COMPLETIONS_DEFAULT_MAX_TOKENS


def test_the_default_max_tokens_is_cut_to_the_room_the_window_leaves():
    assert completion(prompt=[2] * 40).max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS  # room for 24
    short = RequestSettings(MODEL, window=30, vocab_size=VOCAB, default_max_tokens=40)
    assert chat(settings=short).max_tokens == 30 - len("<user>hi<assistant>")
    assert completion(settings=short, prompt=[2] * 25).max_tokens == 5


def test_chat_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=3).max_tokens == 3
    assert chat(max_tokens=3, max_completion_tokens=5).max_tokens == 5


def test_max_tokens_may_fill_the_window_but_not_pass_it():
    assert completion(prompt=[2] * 60, max_tokens=4).max_tokens == 4
    err = refused(completion, prompt=[2] * 60, max_tokens=5)
    assert err.status == 400 and err.param == "max_tokens" and err.code == "context_length_exceeded"
    assert "requested 65 tokens (60 in the prompt, 5 for the completion)" in err.message


@pytest.mark.parametrize(("call", "param"), [(completion, "prompt"), (chat, "messages")])
def test_a_prompt_that_fills_the_window_is_refused(call, param):
    tiny = RequestSettings(MODEL, window=len("<user>hi<assistant>"), vocab_size=VOCAB)
    body = {"prompt": [2] * tiny.window} if call is completion else {}
    err = refused(call, settings=tiny, **body)
    assert err.param == param and err.code == "context_length_exceeded"
    assert f"the prompt has {tiny.window} tokens" in err.message
    assert call(settings=RequestSettings(MODEL, tiny.window + 1, VOCAB), **body).max_tokens == 1


# ---- sampling ------------------------------------------------------------------------------------------


def test_sampling_defaults():
    params = completion(seed=9)
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.stop) == (1.0, 1.0, 0, 9, [])


def test_sampling_parameters_pass_through():
    params = completion(temperature=0.7, top_p=0.9, top_k=40, seed=-3, stop=["\n", "END"])
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 40, -3)
    assert params.stop == ["\n", "END"]
    assert completion(stop="END").stop == ["END"]


def test_temperatures_below_the_threshold_decode_greedily_with_seed_zero():
    assert GREEDY_BELOW > 0
    params = completion(temperature=GREEDY_BELOW / 2)
    assert params.temperature == 0.0 and params.seed == 0
    assert completion(temperature=0.0, seed=5).seed == 5  # an explicit seed is kept
    at = completion(temperature=GREEDY_BELOW, seed=1)
    assert at.temperature == GREEDY_BELOW


def test_sampling_without_a_seed_draws_one():
    seeds = {completion(temperature=1.0).seed for _ in range(4)}
    assert len(seeds) > 1


@pytest.mark.parametrize(
    "body",
    [
        {"temperature": -0.1},
        {"temperature": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"max_tokens": 0},
        {"temperature": "hot"},
    ],
)
def test_out_of_range_sampling_parameters_are_a_400(body):
    err = refused(completion, **body)
    assert err.status == 400 and err.param == next(iter(body))


@pytest.mark.parametrize("stop", [["a"] * 5, [""], ["x" * 257]])
def test_bad_stop_sequences_are_a_400(stop):
    assert refused(completion, stop=stop).param == "stop"


# ---- what the server does not serve -------------------------------------------------------------------


def test_another_model_is_a_404():
    err = refused(completion, model="gpt-4")
    assert err.status == 404 and err.code == "model_not_found" and f"serves '{MODEL}'" in err.message


@pytest.mark.parametrize(
    ("call", "body", "param"),
    [
        (completion, {"n": 2}, "n"),
        (completion, {"echo": True}, "echo"),
        (completion, {"logit_bias": {"5": 1.0}}, "logit_bias"),
        (chat, {"tools": [{"type": "function"}]}, "tools"),
        (chat, {"logprobs": True}, "logprobs"),
    ],
)
def test_unsupported_options_are_refused_before_tokenizing(call, body, param):
    class Untouchable(FakeTokenizer):
        def __call__(self, text: str, add_special_tokens: bool) -> dict:
            raise AssertionError("tokenized a request that check_request refuses")

    assert refused(call, tokenizer=Untouchable(), **body).param == param


def test_unknown_request_fields_are_a_400():
    err = refused(completion, best_effort=True)
    assert err.code == "unknown_parameter" and err.param == "best_effort"


# ---- settings -----------------------------------------------------------------------------------------


def test_settings_take_the_models_window_unless_a_shorter_one_is_set():
    config = SimpleNamespace(context_window=512, vocab_size=VOCAB)
    assert RequestSettings.for_model(config, MODEL) == RequestSettings(MODEL, 512, VOCAB)
    assert RequestSettings.for_model(config, MODEL, max_model_len=100, default_max_tokens=7) == (
        RequestSettings(MODEL, 100, VOCAB, 7)
    )
    no_window = SimpleNamespace(context_window=None, vocab_size=VOCAB)
    assert RequestSettings.for_model(no_window, MODEL).window == MAX_TOKENS_WITHOUT_WINDOW
    assert RequestSettings.for_model(no_window, MODEL, max_model_len=99999).window == 99999


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 513}, "exceeds the model's context window of 512"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"default_max_tokens": 0}, "default_max_tokens must be >= 1"),
    ],
)
def test_settings_refuse_limits_no_request_could_meet(kwargs, message):
    config = SimpleNamespace(context_window=512, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=message):
        RequestSettings.for_model(config, MODEL, **kwargs)


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        SETTINGS.window = 1  # type: ignore[misc]
