"""From a parsed request body to the generation it asks for: prompt tokens, token limits, sampling.

Nothing here knows about HTTP: the route handlers call `check_request` and `prepare` with the body
`schemas.parse_body` returned, the tokenizer and the server's `RequestSettings`, and answer an APIError
(a 4xx with a one-line message) with its status.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

from specexec.server.limits import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS,
    GREEDY_BELOW,
    MAX_TOKENS_WITHOUT_WINDOW,
)
from specexec.server.pair import PairFacts, Params
from specexec.server.queue import random_seed
from specexec.server.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    reject_unsupported,
    stop_sequences,
)


@dataclass(frozen=True)
class RequestSettings:
    """What every request is checked against, fixed for the server's lifetime."""

    model_name: str  # the one model name requests may ask for
    window: int  # prompt plus completion tokens, at most
    vocab_size: int  # token ids in a prompt are below this
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # of a chat request that sets none

    @classmethod
    def for_model(
        cls,
        model: PairFacts,
        model_name: str,
        max_model_len: int | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> RequestSettings:
        """The settings for serving the pair `model` tells of; `max_model_len` None: its context window.

        Raises ValueError for limits that no request could meet."""
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        model_window = model.context_window
        if max_model_len is not None and model_window is not None and max_model_len > model_window:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context window of {model_window}"
            )
        window = max_model_len or model_window or MAX_TOKENS_WITHOUT_WINDOW
        return cls(model_name, window, model.vocab_size, default_max_tokens)


def check_model(name: str, settings: RequestSettings) -> None:
    """404 unless `name` is the model this server serves."""
    if name != settings.model_name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{settings.model_name}'.",
            param="model",
            code="model_not_found",
        )


def check_request(req: CompletionRequest | ChatCompletionRequest, settings: RequestSettings) -> None:
    """The checks that need no tokenizer: the model's name, then parameters this server cannot honour."""
    check_model(req.model, settings)
    reject_unsupported(req)


def prepare(req: CompletionRequest | ChatCompletionRequest, tokenizer, settings: RequestSettings) -> Params:
    """Tokenize and check one request (slow for long prompts: the server runs it off the event loop)."""
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        prompt_ids = chat_prompt(req, tokenizer)
        default_max = settings.default_max_tokens
    else:
        max_tokens = req.max_tokens
        prompt_ids = completion_prompt(req, tokenizer, settings.vocab_size)
        default_max = COMPLETIONS_DEFAULT_MAX_TOKENS
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    max_tokens = completion_budget(len(prompt_ids), max_tokens, default_max, settings.window, prompt_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < GREEDY_BELOW:
        # The limit of sampling as temperature -> 0 is greedy; dividing logits by a denormal
        # temperature would overflow to inf and NaN probabilities instead.
        temperature = 0.0
    seed = req.seed if req.seed is not None else (0 if temperature == 0 else random_seed())
    return Params(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=seed,
        stop=stop_sequences(req.stop),
    )


def completion_budget(
    prompt_tokens: int, max_tokens: int | None, default_max: int, window: int, prompt_param: str
) -> int:
    """The completion tokens a request may generate: `max_tokens`, or without it `default_max`, cut to
    what the window leaves. 400 when the prompt fills the window or `max_tokens` does not fit."""
    if prompt_tokens >= window:
        raise APIError(
            400,
            f"This model's maximum context length is {window} tokens; the prompt has {prompt_tokens} "
            "tokens, which leaves no room to generate.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = window - prompt_tokens
    if max_tokens is None:
        return min(room, default_max)
    if max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for "
            "the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def completion_prompt(req: CompletionRequest, tokenizer, vocab_size: int) -> list[int]:
    """The prompt's token ids: a text encoded with the special tokens, or ids checked against the vocab."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(
                400, "Only one prompt per request is supported.", param="prompt", code="unsupported_value"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = _encode(tokenizer, prompt, add_special_tokens=True)
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400,
                f"Token id {bad[0]} in 'prompt' is out of range [0, {vocab_size}).",
                param="prompt",
                code="invalid_value",
            )
    if not ids:
        raise APIError(400, "The prompt is empty.", param="prompt", code="invalid_value")
    return ids


def chat_prompt(req: ChatCompletionRequest, tokenizer) -> list[int]:
    """The messages rendered by the tokenizer's chat template (with the assistant's turn opened), encoded."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400,
            "This model's tokenizer has no chat template; use /v1/completions.",
            param="messages",
            code="chat_template_missing",
        )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as err:
        raise APIError(
            400, f"The messages do not fit the model's chat template: {err}", param="messages"
        ) from None
    ids = _encode(tokenizer, text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "The messages render to an empty prompt.", param="messages", code="invalid_value")
    return ids


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
