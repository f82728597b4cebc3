"""The Hugging Face methods of the benchmark: `generate` with assisted generation (hf-assisted) or prompt
lookup (hf-lookup), its forwards counted and timed by hooks (the protocol: `specexec.bench.core`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from transformers import GenerationConfig, PreTrainedModel

from specexec.timing import clock

PROMPT_LOOKUP_TOKENS = 10  # hf-lookup: prompt_lookup_num_tokens


class _ForwardMeter:
    """Counts and times a model's forwards (hooks on the top module), and records their input lengths."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.calls = 0
        self.seconds = 0.0
        self.first_seconds = 0.0  # the first forward alone
        self.input_lengths: list[int] = []
        self._start = 0.0
        self._handles = []

    def __enter__(self) -> _ForwardMeter:
        self._handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.input_lengths.append(int(ids.shape[-1]) if ids is not None else 0)
        self._start = clock(self.model.device)

    def _after(self, module, args, output) -> None:
        elapsed = clock(self.model.device) - self._start
        if self.calls == 0:
            self.first_seconds = elapsed
        self.seconds += elapsed
        self.calls += 1


@contextmanager
def _plain_generation_configs(*models: PreTrainedModel | None) -> Iterator[None]:
    """Give each model a GenerationConfig holding only its special-token ids, for the duration.

    `generate` fills every option the caller leaves unset from `model.generation_config`, so a checkpoint's
    sampling defaults (repetition_penalty, top_k, ...) would leak into the Hugging Face runs; and
    assisted generation reads its knobs from the assistant's config, which must stay at the library
    defaults (num_assistant_tokens=20, "constant" schedule, assistant_confidence_threshold=0.4).
    """
    saved = []
    for model in models:
        if model is None:
            continue
        old = model.generation_config
        ids = {k: getattr(old, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        saved.append((model, old))
        model.generation_config = GenerationConfig(**ids)
    try:
        yield
    finally:
        for model, old in saved:
            model.generation_config = old


def hf_assisted_settings() -> dict:
    """The dynamic-speculation settings hf-assisted runs with (library defaults), for the report."""
    defaults = GenerationConfig._get_default_generation_params()
    return {
        "num_assistant_tokens": defaults["num_assistant_tokens"],
        "num_assistant_tokens_schedule": defaults["num_assistant_tokens_schedule"],
        "assistant_confidence_threshold": defaults["assistant_confidence_threshold"],
        # The ROC adaptation of the threshold runs only when scikit-learn is importable.
        "threshold_adaptation": importlib.util.find_spec("sklearn") is not None,
    }


@torch.inference_mode()
def run_hf(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    method: str,
    input_ids: list[int],
    max_new_tokens: int,
    seed: int,
    eos: list[int],
    *,
    temperature: float,
    top_p: float,
    top_k: int,
) -> dict:
    """Generate with Hugging Face's assisted generation ("hf-assisted", `draft` as the assistant) or prompt
    lookup ("hf-lookup"); the record's timings follow `specexec.bench.core`'s protocol."""
    assisted = method == "hf-assisted"
    ids = torch.tensor([input_ids], dtype=torch.long, device=target.device)
    options: dict = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        options.update(temperature=temperature, top_p=top_p, top_k=top_k)
    if eos:
        options["eos_token_id"] = eos
        options["pad_token_id"] = target.generation_config.pad_token_id
        if options["pad_token_id"] is None:
            options["pad_token_id"] = eos[0]
    if not assisted:
        options["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    generation_config = GenerationConfig(**options)

    with _plain_generation_configs(target, draft if assisted else None):
        # Prefill estimate: the same prompt forwarded alone, by the target (and the draft).
        target_estimate = _prompt_forward_seconds(target, ids)
        torch.manual_seed(seed)
        with ExitStack() as meters:
            target_meter = meters.enter_context(_ForwardMeter(target))
            draft_meter = meters.enter_context(_ForwardMeter(draft)) if assisted else None
            start = clock(target.device)
            out = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=generation_config,
                assistant_model=draft if assisted else None,
            )
            wall = clock(target.device) - start

    tokens = out[0, ids.shape[1] :].tolist()
    # Capped at the first target forward, which includes the prompt: decode time and the forward-time
    # split then stay consistent (target + draft <= decode) whatever the noise of the estimate.
    target_prefill = min(target_estimate, target_meter.first_seconds)
    draft_prefill = draft_meter.first_seconds if draft_meter else 0.0
    prefill = target_prefill + draft_prefill
    # Draft tokens verified by each target forward: the first forward also carries the prompt.
    lengths = target_meter.input_lengths
    tree_sizes = [max(0, n - 1) for n in lengths]
    if tree_sizes:
        tree_sizes[0] = max(0, lengths[0] - len(input_ids))
    return {
        "prompt_tokens": len(input_ids),
        "new_tokens": len(tokens),
        "tokens": tokens,
        "finish_reason": "stop" if tokens and tokens[-1] in eos else "length",
        "target_calls": target_meter.calls,
        "draft_calls": draft_meter.calls if draft_meter else 0,
        "prefill_seconds": prefill,
        "decode_seconds": max(0.0, wall - prefill),
        "wall_seconds": wall,
        "draft_seconds": draft_meter.seconds - draft_prefill if draft_meter else 0.0,
        "target_seconds": target_meter.seconds - target_prefill,
        "tree_sizes": tree_sizes,
        "tree_depths": list(tree_sizes),  # HF drafts are chains
        "accepted": None,
        "target_pace": None,
        "prefill_timing": "separate-forward",
        "hf_settings": hf_assisted_settings()
        if assisted
        else {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS, "max_matching_ngram_size": 2},
    }


def _prompt_forward_seconds(model: PreTrainedModel, ids: torch.Tensor) -> float:
    start = clock(model.device)
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return clock(model.device) - start
