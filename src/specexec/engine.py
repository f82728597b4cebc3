"""The decoding loop shared by every method: draft -> verify -> commit, with statistics and streaming."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from transformers import PreTrainedModel

from specexec.budget import (
    AutoBudget,
    ChainCostStop,
    ConfidenceStop,
    CostModel,
    HeuristicLookahead,
    LearntPolicies,
)
from specexec.calibration import cached_cost_model
from specexec.drafters import (
    BestFirstDrafter,
    ChainDrafter,
    Drafter,
    DraftRequest,
    NoDrafter,
    SampledTreeDrafter,
)
from specexec.drafters.base import tree_forward
from specexec.models import eos_token_ids
from specexec.prefix_cache import PrefixCache
from specexec.runner import clock, make_runner, prefill
from specexec.sampling import SamplingParams
from specexec.text import TextStream
from specexec.verify import cache_walk, rejection_walk

HEURISTIC_MAX_LENGTH = 64  # a ceiling for the heuristic schedule, which has none of its own
METHODS = ("ar", "sd", "dsl", "specinfer", "specexec")
# Methods whose drafts are sampled from a known q: verified by rejection sampling, which accepts more
# than the cache walk at temperature > 0 (both are exact; greedy, they are the same rule).
REJECTION_METHODS = ("sd", "dsl", "specinfer")
AUTO_METHODS = ("specexec", "dsl")  # the methods whose budget may be "auto" (sized by the cost model)
# Draft tokens verified per target pass when `budget` is not given. "auto" sizes every step by the costs
# measured on this machine, the one default that suits both a CPU and an offloaded GPU.
DEFAULT_BUDGETS = {"ar": 0, "sd": 4, "dsl": "auto", "specinfer": 32, "specexec": "auto"}
DSL_MAX_LENGTH = 20  # the longest dsl chain under budget "auto"
AUTO_MAX_BUDGET = 1024  # the largest tree budget "auto" considers


def sized_by_cost(method: str, budget: int | str | None) -> bool:
    """Whether `stream` sizes `method`'s drafts from the cost model: budget "auto", given or by default."""
    return method in AUTO_METHODS and (DEFAULT_BUDGETS[method] if budget is None else budget) == "auto"


class GenerationError(ValueError):
    """Invalid arguments to `generate`/`stream` (bad method, empty prompt, context too long, ...)."""


@dataclass
class Stats:
    """What one generation did and where its time went. Seconds exclude nothing but the clock itself."""

    method: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose target KV came from the prefix cache
    new_tokens: int = 0
    target_calls: int = 0  # verification forwards, prefill excluded
    draft_calls: int = 0  # draft forwards, prefill excluded
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # inside the draft model's forwards
    target_seconds: float = 0.0  # inside the target model's forwards
    decode_seconds: float = 0.0  # everything after prefill: draft + target + overhead
    tree_sizes: list[int] = field(default_factory=list)  # draft tokens verified per step
    tree_depths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per step

    @property
    def tokens_per_step(self) -> float:
        """Emitted tokens per target verification call, the bonus token included."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def overhead_seconds(self) -> float:
        return max(0.0, self.decode_seconds - self.draft_seconds - self.target_seconds)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "tokens_per_step": self.tokens_per_step,
            "overhead_seconds": self.overhead_seconds,
            "decode_tokens_per_second": self.decode_tokens_per_second,
        }


@dataclass
class Chunk:
    """The tokens one step committed; `finish_reason` ("stop" or "length") is set on the last chunk."""

    tokens: list[int]
    finish_reason: str | None
    stats: Stats


@dataclass
class GenerationOutput:
    tokens: list[int]
    finish_reason: str
    stats: Stats


def generate(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    input_ids: Sequence[int] | torch.Tensor,
    **kwargs,
) -> GenerationOutput:
    """Generate new tokens after `input_ids`; same arguments as `stream`."""
    tokens: list[int] = []
    chunk = None
    for chunk in stream(target, draft, input_ids, **kwargs):
        tokens.extend(chunk.tokens)
    assert chunk is not None
    return GenerationOutput(tokens, chunk.finish_reason or "length", chunk.stats)


@torch.inference_mode()
def stream(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    input_ids: Sequence[int] | torch.Tensor,
    *,
    method: str = "specexec",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    budget: int | str | None = None,
    expand: int = 32,
    width: int = 8,
    max_rounds: int = 32,
    branches: int = 4,
    ngram: int = 0,
    lookahead_schedule: str = "constant",
    confidence_threshold: float = 0.4,
    adapt_threshold: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    cost_model: CostModel | None = None,
    learnt: LearntPolicies | None = None,
    prefix_cache: PrefixCache | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[Chunk]:
    """Speculative decoding, yielding the tokens committed at each step.

    method:
      "ar"        the target alone;
      "sd"        a chain of `budget` draft tokens and the rejection rule; `lookahead_schedule`
                  "heuristic" adapts the length (+2 after a fully accepted draft, -1 otherwise);
      "dsl"       a chain that stops once the draft's probability for its own token drops below
                  `confidence_threshold` (adapted from observed acceptances if `adapt_threshold`),
                  at most `budget` tokens (an integer budget: the confidence rule alone);
      "specinfer" `branches` sampled chains, `budget` draft tokens in all, multi-draft rejection;
      "specexec"  a best-first tree of `budget` tokens (`expand` nodes per draft pass, `width` children
                  per node, at most `max_rounds` draft passes), verified by the cache walk; with
                  `ngram` > 0, prompt-lookup chains of up to `ngram` tokens are grafted into the tree.
    `budget` defaults to DEFAULT_BUDGETS[method] ("auto" for specexec and dsl). For "specexec",
    budget="auto" sizes every step's tree by expected speed, from `cost_model` (by default this pair's
    calibration, measured on first use and cached) and the acceptances seen so far; for "dsl" it also
    ends each chain where drafting on is not expected to pay at the rate the generation achieves (at most
    DSL_MAX_LENGTH tokens). With `learnt`, what these policies learn carries over to the next generation
    given the same object (`budget.LearntPolicies`); without it, every generation learns afresh.
    Temperature 0 is greedy. Stops at an end-of-sequence id (by default every one the target's
    configuration lists), after `max_new_tokens`, or when the text contains one of `stop_strings`
    (which needs `tokenizer`).
    With `prefix_cache`, the KV of the longest cached prefix of the prompt is reused and this
    generation's is kept there when it ends. The prompt is prefilled `runner.PREFILL_CHUNK` tokens at a
    time; when `cancelled()` turns true between two chunks, the generation ends without yielding. The
    draft is prefilled only if the drafter expects to draft (an auto budget may find that drafting
    cannot pay on this machine); otherwise it catches up when it first drafts. After plain steps where
    drafting has been losing, an auto budget's draft reads only the latest tokens it missed, as many as
    cost at most half a target pass (`budget.catch_up_window`).
    """
    prompt = _as_token_tensor(input_ids, target)
    if method not in METHODS:
        raise GenerationError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method != "ar" and draft is None:
        raise GenerationError(f"method {method!r} needs a draft model")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not isinstance(ngram, int) or ngram < 0:
        raise GenerationError(f"ngram must be an integer >= 0, got {ngram!r}")
    budget = DEFAULT_BUDGETS[method] if budget is None else budget
    leaf_limit = tree_leaf_limit(target, draft)
    cost_stop = None
    if budget == "auto":
        if method not in AUTO_METHODS:
            raise GenerationError(f"budget 'auto' is for methods 'specexec' and 'dsl', not {method!r}")
        cost = cost_model or cached_cost_model(target, draft)
        max_budget = min(AUTO_MAX_BUDGET, leaf_limit - 2 * ngram)
        make = (
            (lambda: ChainCostStop(cost, DSL_MAX_LENGTH))
            if method == "dsl"
            else (lambda: AutoBudget(cost, max_budget=max_budget))
        )
        if learnt is not None:
            setting = (method, max_budget, temperature, top_k, top_p, cost.fingerprint())
            policy = learnt.get((id(target), id(draft)), setting, make)
        else:
            policy = make()
        if method == "dsl":
            budget, cost_stop = DSL_MAX_LENGTH, policy
            cost_stop.start()  # a chain cut short by the last generation's end is not this one's
        else:
            budget = policy
    elif not isinstance(budget, int) or (method != "ar" and budget < 1):
        raise GenerationError(f"budget must be an integer >= 1 or 'auto', got {budget!r}")
    if lookahead_schedule not in ("constant", "heuristic"):
        raise GenerationError(
            f"lookahead_schedule must be 'constant' or 'heuristic', got {lookahead_schedule!r}"
        )
    if isinstance(budget, int) and method in ("specinfer", "specexec") and budget + 2 * ngram > leaf_limit:
        raise GenerationError(
            f"budget {budget} could make trees of more than the {leaf_limit} leaves llama.cpp verifies in "
            f"one pass; use a budget of at most {leaf_limit - 2 * ngram}"
        )
    if ngram and method != "specexec":
        raise GenerationError(f"ngram grafting is for method 'specexec', not {method!r}")
    if stop_strings and tokenizer is None:
        raise GenerationError("stop_strings need a tokenizer")
    try:
        sampling = SamplingParams(temperature, top_k, top_p)
        confidence_stop = ConfidenceStop(confidence_threshold, adapt_threshold)
    except ValueError as e:
        raise GenerationError(str(e)) from None
    window = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if window is not None and prompt.numel() + max_new_tokens > window:
        raise GenerationError(
            f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context window of {window} tokens"
        )
    eos = torch.tensor(_eos_ids(target, eos_token_id, tokenizer), dtype=torch.long, device=prompt.device)
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    vocab_size = target.config.get_text_config().vocab_size

    drafter = _make_drafter(
        method, budget, expand, width, max_rounds, branches, ngram, lookahead_schedule,
        confidence_stop, cost_stop,
    )  # fmt: skip
    # Committed tokens plus scratch slots for the largest tree a step can build, in both caches; the
    # buffers grow to that as the generation needs them.
    capacity = prompt.numel() + max_new_tokens + drafter.max_tree_size
    needed = min(capacity, prompt.numel() + drafter.max_tree_size)
    stats = Stats(method=method, prompt_tokens=prompt.numel())
    prompt_list = prompt.tolist()
    pair_draft = draft if method != "ar" else None
    # The draft is prefilled unless no step of this generation can draft: catching up later costs the same
    # draft work inside decoding (and, on llama.cpp, new tree contexts mid-generation).
    drafting = pair_draft is not None and drafter.may_draft(steps=max_new_tokens)
    reused = prefix_cache.take(target, pair_draft, prompt_list) if prefix_cache else None
    if reused is not None:
        target_runner, draft_runner = reused.target, reused.draft
        # Everything but the last prompt token can be reused: that one becomes the first tree root.
        stats.cached_tokens = min(reused.shared_with(prompt_list), prompt.numel() - 1)
        for runner in (target_runner, draft_runner):
            if runner is not None:
                runner.keep_prefix(stats.cached_tokens)
    else:
        target_runner, draft_runner = make_runner(target, needed, trees=drafting), None
    text = TextStream(tokenizer, stop_strings) if stop_strings else None

    committed = prompt
    resumable = False  # whether the runners hold exactly `committed` (up to their lengths)
    try:
        # Prefill: everything but the last prompt token, which becomes the first tree root. The draft
        # model gets a runner (and a prefill) only once the drafter expects to draft: an auto budget
        # may find that drafting cannot pay on this machine, and then the draft costs nothing.
        start = clock(prompt.device)
        if drafting and draft_runner is None:
            draft_runner = make_runner(pair_draft, needed)
        for runner in [target_runner, draft_runner] if drafting else [target_runner]:
            runner.reserve(needed, most=capacity)
            if not prefill(runner, prompt[runner.length : -1], cancelled):
                resumable = True
                return
        stats.prefill_seconds = clock(prompt.device) - start
        for runner in (target_runner, draft_runner):
            if runner is not None:
                runner.forward_seconds = 0.0  # from here on, decoding time only

        decode_start = clock(prompt.device)
        while True:
            if pair_draft is not None and draft_runner is None and drafter.may_draft():
                draft_runner = make_runner(pair_draft, committed.numel() + drafter.max_tree_size)
            for runner in (target_runner, draft_runner):
                if runner is not None:
                    runner.reserve(committed.numel() + drafter.max_tree_size, most=capacity)
            remaining = max_new_tokens - stats.new_tokens
            request = DraftRequest(
                committed, remaining - 1, eos, vocab_size, sampling, generator, draft_runner
            )
            proposal = drafter.propose(request)
            tree = proposal.tree
            root_slot = committed.numel() - 1
            logits = tree_forward(
                target_runner, tree, torch.arange(tree.size, device=prompt.device), root_slot
            )
            if method in REJECTION_METHODS:
                path, bonus = rejection_walk(tree, logits, proposal.draft_probs, sampling, generator)
            else:
                path, bonus = cache_walk(tree, logits, sampling, generator)

            # Commit: the root and the accepted path stay in the target cache, and in the draft cache as
            # far as the draft expanded them; the bonus token becomes the next root.
            path_nodes = torch.tensor([0, *path], dtype=torch.long, device=prompt.device)
            target_runner.keep(_with_prefix(root_slot, root_slot + path_nodes))
            if draft_runner is not None:
                seen = path_nodes[tree.expanded[path_nodes]]
                draft_root = draft_runner.slot(root_slot)
                draft_runner.keep(_with_prefix(min(draft_runner.length, draft_root), draft_root + seen))
            stats.target_seconds = target_runner.forward_seconds
            stats.draft_seconds = draft_runner.forward_seconds if draft_runner is not None else 0.0
            stats.target_calls += 1
            stats.draft_calls += proposal.draft_calls
            stats.tree_sizes.append(tree.size - 1)
            stats.tree_depths.append(int(tree.depths[: tree.size].max()))
            stats.accepted.append(len(path))
            drafter.observe(proposal, path)

            new, finish = _cut([*tree.tokens[path_nodes[1:]].tolist(), bonus], eos, remaining, text)
            stats.new_tokens += len(new)
            committed = torch.cat([committed, torch.tensor(new, dtype=torch.long, device=prompt.device)])
            stats.decode_seconds = clock(prompt.device) - decode_start
            resumable = True
            yield Chunk(new, finish, stats)
            resumable = False
            if finish is not None:
                resumable = True
                return
    finally:
        # Only at a yield or a clean stop do the runners hold `committed`; after an error, drop them.
        if prefix_cache is not None and resumable:
            prefix_cache.put(committed.tolist(), target, pair_draft, target_runner, draft_runner)


def _make_drafter(
    method: str,
    budget: int | AutoBudget,
    expand: int,
    width: int,
    max_rounds: int,
    branches: int,
    ngram: int,
    lookahead_schedule: str,
    confidence_stop: ConfidenceStop,
    cost_stop: ChainCostStop | None,
) -> Drafter:
    if method == "ar":
        return NoDrafter()
    if method == "sd":
        schedule = HeuristicLookahead(budget) if lookahead_schedule == "heuristic" else None
        ceiling = max(budget, HEURISTIC_MAX_LENGTH) if schedule else budget
        return ChainDrafter(budget, schedule=schedule, max_length=ceiling)
    if method == "dsl":
        return ChainDrafter(budget, stop=confidence_stop, cost_stop=cost_stop)
    if method == "specinfer":
        return SampledTreeDrafter(budget, branches)
    return BestFirstDrafter(budget, expand, width, max_rounds, ngram)


def tree_leaf_limit(*models) -> int:
    """The most leaves a verified tree may have: llama.cpp gives every leaf a sequence id of its own."""
    from specexec.llamacpp import MAX_SEQUENCES

    on_llamacpp = any(getattr(m, "backend", "torch") == "llamacpp" for m in models if m is not None)
    return MAX_SEQUENCES - 1 if on_llamacpp else 1 << 30


def _with_prefix(prefix_len: int, tail: torch.Tensor) -> torch.Tensor:
    """Slots [0, prefix_len) followed by `tail`."""
    return torch.cat([torch.arange(prefix_len, device=tail.device), tail])


def _cut(
    new: list[int], eos: torch.Tensor, remaining: int, text: TextStream | None
) -> tuple[list[int], str | None]:
    """Trim a step's tokens at the first end-of-sequence id (kept), stop string (`text` follows the
    generation's text; the token completing the string is kept) or length limit."""
    finish = None
    eos_ids = set(eos.tolist())
    for i, token in enumerate(new):
        if token in eos_ids:
            new, finish = new[: i + 1], "stop"
            break
    if len(new) >= remaining:
        new, finish = new[:remaining], finish or "length"
    if text is not None:
        before = text.token_count
        text.add(new)
        if text.stopped:
            return new[: text.token_count - before], "stop"
    return new, finish


def _as_token_tensor(input_ids: Sequence[int] | torch.Tensor, model: PreTrainedModel) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long).to(model.device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise GenerationError("input_ids must be a non-empty 1-D sequence of token ids")
    vocab = model.config.get_text_config().vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise GenerationError(f"input_ids must be in [0, {vocab}), got ids up to {int(ids.max())}")
    return ids


def _eos_ids(model: PreTrainedModel, eos_token_id: int | Sequence[int] | None, tokenizer) -> list[int]:
    if eos_token_id is None:
        return eos_token_ids(model, tokenizer)
    return sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
