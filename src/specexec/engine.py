"""The decoding loop shared by every method: a `Generation` prefills, then steps draft -> verify ->
commit; `stream` is a thin loop over it. What differs between methods lives in `specexec.methods`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from specexec.backends import as_model, make_runner
from specexec.backends.base import Model, Runner, prefill
from specexec.budget.acceptance import ConfidenceStop
from specexec.budget.chains import ChainCostStop
from specexec.budget.costs import CostModel
from specexec.budget.trees import AutoBudget
from specexec.calibration import cached_cost_model
from specexec.drafters import Drafter, DraftRequest
from specexec.drafters.base import Draft, tree_forward
from specexec.learnt import LearntPolicies
from specexec.methods import (
    DSL_MAX_LENGTH,
    Budget,
    BudgetError,
    DraftOptions,
    Fixed,
    Method,
    UnknownMethod,
    method,
    not_for,
)
from specexec.models import eos_token_ids
from specexec.prefix_cache import PrefixCache
from specexec.sampling import SamplingParams
from specexec.text import TextStream
from specexec.timing import clock
from specexec.tree import DraftTree

AUTO_MAX_BUDGET = 1024  # the largest tree budget "auto" considers


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
    draft_calls: int = 0  # draft forwards before verification, prefill excluded
    ahead_calls: int = 0  # draft forwards while the target verified (`Settings.draft_ahead`)
    carried: int = 0  # draft nodes that steps started with, grown while the step before was verified
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # inside the draft model's forwards, but those beside verification
    ahead_seconds: float = 0.0  # inside the draft's forwards while the target verified (within its time)
    target_seconds: float = 0.0  # inside the target model's forwards
    decode_seconds: float = 0.0  # everything after prefill: draft + target + overhead
    tree_sizes: list[int] = field(default_factory=list)  # draft tokens verified per step
    tree_depths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per step
    cache_bytes: int = 0  # the runners' KV caches and working buffers (the weights apart)
    # An auto budget's pace of the target against its measured calibration after the last step
    # (`budget.TargetPace`: 1.2 is passes 20% slower than calibrated); None without one.
    target_pace: float | None = None

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


@dataclass(frozen=True)
class Settings:
    """What a generation is asked for (`stream`'s keyword arguments but the models' companions).

    method: a name of `specexec.methods.METHODS`; `budget` an integer, "auto" (specexec and dsl: every
    step sized by the cost model and the acceptances seen so far) or a value `Method.resolve_budget`
    made, None for the method's own default; the generation resolves it once. `expand`,
    `width`, `max_rounds`, `branches`, `ngram` and `lookahead_schedule` shape the drafts of the methods
    that read them (`specexec.methods.DraftOptions`); `confidence_threshold` and `adapt_threshold` are
    dsl's confidence stop. `draft_ahead` (specexec): the draft grows the next tree on while the target
    verifies, on another thread (`Drafter.draft_ahead`). Temperature 0 is greedy. A generation stops at
    an end-of-sequence id (by default every one the target lists), after `max_new_tokens`, or when its
    text contains one of `stop_strings`.
    """

    method: str = "specexec"
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    budget: int | str | Budget | None = None
    expand: int = 32
    width: int = 8
    max_rounds: int = 32
    branches: int = 4
    ngram: int = 0
    lookahead_schedule: str = "constant"
    confidence_threshold: float = 0.4
    adapt_threshold: bool = True
    draft_ahead: bool = False
    eos_token_id: int | Sequence[int] | None = None
    stop_strings: Sequence[str] = ()

    @property
    def draft_options(self) -> DraftOptions:
        return DraftOptions(
            self.expand, self.width, self.max_rounds, self.branches, self.ngram, self.lookahead_schedule,
            self.draft_ahead,
        )  # fmt: skip


SETTINGS = frozenset(f.name for f in fields(Settings))


def sized_by_cost(method_name: str, budget: int | str | None) -> bool:
    """Whether `stream` sizes `method_name`'s drafts from the cost model: budget "auto", given or by
    default."""
    return method(method_name).sized_by_cost(budget)


def generate(
    target,
    draft,
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
    target,
    draft,
    input_ids: Sequence[int] | torch.Tensor,
    *,
    tokenizer=None,
    cost_model: CostModel | None = None,
    learnt: LearntPolicies | None = None,
    prefix_cache: PrefixCache | None = None,
    cancelled: Callable[[], bool] | None = None,
    **settings,
) -> Iterator[Chunk]:
    """Speculative decoding of `target` (a `specexec.backends.base.Model`, or a `transformers` model)
    with `draft`, yielding the tokens committed at each step. `settings` are `Settings`' fields.

    An auto budget sizes its drafts from `cost_model` (by default this pair's calibration, measured on
    first use and cached); with `learnt`, what its policies learn carries over to the next generation
    given the same object (`learnt.LearntPolicies`). `stop_strings` need `tokenizer`. With
    `prefix_cache`, the KV of the longest cached prefix of the prompt is reused and this generation's is
    kept there when it ends. When `cancelled()` turns true between two prefill chunks, the generation
    ends without yielding.
    """
    unknown = sorted(set(settings) - SETTINGS)
    if unknown:
        raise GenerationError(f"unknown generation option {unknown[0]!r}")
    generation = Generation(
        target, draft, input_ids, Settings(**settings), tokenizer, cost_model, learnt, prefix_cache
    )
    try:
        if not generation.prefill(cancelled):
            return
        while True:
            chunk = generation.step()
            yield chunk
            if chunk.finish_reason is not None:
                return
    finally:
        generation.release()


class Generation:
    """One generation: its runners on the target and draft, the committed tokens and the statistics.

    `prefill()` reads the prompt, each `step()` drafts, verifies and commits, `release()` hands the
    runners to the prefix cache (or drops them). It holds nothing of another generation's, so several
    may run on the same models, each with runners of its own.

    The prompt is prefilled `backends.base.PREFILL_CHUNK` tokens at a time. The draft gets a runner and
    a prefill only once the drafter expects to draft: an auto budget may find that drafting cannot pay on
    this machine, and then the draft costs nothing; it catches up when it first drafts (after plain steps
    where drafting has been losing, reading only the latest tokens it missed:
    `budget.policy.catch_up_window`).
    """

    def __init__(
        self,
        target,
        draft,
        input_ids: Sequence[int] | torch.Tensor,
        settings: Settings,
        tokenizer=None,
        cost_model: CostModel | None = None,
        learnt: LearntPolicies | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target, self.draft = target, draft
        self.prompt = _as_token_tensor(input_ids, as_model(target))
        self.method, budget = _checked(settings, target, draft, tokenizer)
        _check_window(self.prompt, settings.max_new_tokens, target)
        self.max_new_tokens = settings.max_new_tokens
        device = self.prompt.device
        self.sampling = SamplingParams(settings.temperature, settings.top_k, settings.top_p)
        self.generator = torch.Generator(device=device).manual_seed(settings.seed)
        eos = _eos_ids(target, settings.eos_token_id, tokenizer)
        self.eos = torch.tensor(eos, dtype=torch.long, device=device)
        self.vocab_size = as_model(target).vocab_size
        self.text = TextStream(tokenizer, settings.stop_strings) if settings.stop_strings else None
        self.draft_ahead = settings.draft_ahead
        self.drafter, self.policy = _drafter(self.method, budget, settings, target, draft, cost_model, learnt)
        self.stats = Stats(method=self.method.name, prompt_tokens=self.prompt.numel())
        self.committed = self.prompt
        # Committed tokens plus scratch slots for the largest tree a step can build, in both caches; the
        # buffers grow to that as the generation needs them.
        self.capacity = self.prompt.numel() + self.max_new_tokens + self.drafter.max_tree_size
        self.pair_draft = draft if self.method.drafts else None
        # The draft is prefilled unless no step can draft: catching up later costs the same draft work
        # inside decoding (and, on llama.cpp, new tree contexts mid-generation).
        self.drafting = self.pair_draft is not None and self.drafter.may_draft(steps=self.max_new_tokens)
        self.head_start: DraftTree | None = None  # the next step's tree, grown while this one verified
        self.prefix_cache = prefix_cache
        self.resumable = False  # whether the runners hold exactly `committed` (up to their lengths)
        self.target_runner, self.draft_runner = self._runners()

    def _runners(self) -> tuple[Runner, Runner | None]:
        """The prefix cache's runners for the longest shared prefix, cut to it, or a new target runner."""
        prompt = self.prompt.tolist()
        reused = self.prefix_cache.take(self.target, self.pair_draft, prompt) if self.prefix_cache else None
        if reused is None:
            return make_runner(self.target, self._needed(), trees=self.drafting), None
        # Everything but the last prompt token can be reused: that one becomes the first tree root.
        self.stats.cached_tokens = min(reused.shared_with(prompt), len(prompt) - 1)
        for runner in (reused.target, reused.draft):
            if runner is not None:
                runner.keep_prefix(self.stats.cached_tokens)
        return reused.target, reused.draft

    def _needed(self) -> int:
        return min(self.capacity, self.prompt.numel() + self.drafter.max_tree_size)

    def prefill(self, cancelled: Callable[[], bool] | None = None) -> bool:
        """Prefill everything but the last prompt token, which becomes the first tree root. False if
        `cancelled()` turned true between two chunks (what was prefilled stays)."""
        start = clock(self.prompt.device)
        if self.drafting and self.draft_runner is None:
            self.draft_runner = make_runner(self.pair_draft, self._needed())
        for runner in [self.target_runner, self.draft_runner] if self.drafting else [self.target_runner]:
            runner.reserve(self._needed(), most=self.capacity)
            if not prefill(runner, self.prompt[runner.length : -1], cancelled):
                self.resumable = True
                return False
        self.stats.prefill_seconds = clock(self.prompt.device) - start
        for runner in self._live_runners():
            runner.forward_seconds = 0.0  # from here on, decoding time only
        self.resumable = True
        self.decode_start = clock(self.prompt.device)
        return True

    def step(self) -> Chunk:
        """Draft a tree, verify it in one target forward, commit the accepted path and the bonus token."""
        self.resumable = False
        self._make_room()
        remaining = self.max_new_tokens - self.stats.new_tokens
        request = DraftRequest(
            self.committed, remaining - 1, self.eos, self.vocab_size, self.sampling, self.generator,
            self.draft_runner, self.head_start,
        )  # fmt: skip
        carried = self.head_start.size - 1 if self.head_start is not None else 0
        self.head_start = None
        proposal = self.drafter.propose(request)
        tree = proposal.tree
        root_slot = self.committed.numel() - 1
        before = self.target_runner.forward_seconds
        logits, ahead = self._verify(proposal, request, root_slot)  # (size, V)
        verify_seconds = self.target_runner.forward_seconds - before
        path, bonus = self.method.rule(tree, logits, proposal, self.sampling, self.generator)
        path_nodes = torch.tensor([0, *path], dtype=torch.long, device=self.prompt.device)
        self._commit(tree if ahead is None else ahead.tree, root_slot, path_nodes, bonus if ahead else None)
        self.drafter.observe(proposal, path, verify_seconds)
        self._count(tree, proposal.draft_calls, len(path))
        self.stats.carried += carried
        self.stats.ahead_calls += ahead.draft_calls if ahead else 0
        new, finish = _cut([*tree.tokens[path_nodes[1:]].tolist(), bonus], self.eos, remaining, self.text)
        self.stats.new_tokens += len(new)
        self.committed = torch.cat(
            [self.committed, torch.tensor(new, dtype=torch.long, device=self.prompt.device)]
        )
        self.stats.decode_seconds = clock(self.prompt.device) - self.decode_start
        self.resumable = True
        return Chunk(new, finish, self.stats)

    def release(self) -> None:
        """Idle the runners (`Runner.idle`), then put them in the prefix cache with the committed tokens, if
        they hold exactly those (after a step or a prefill, not after an error, when a forward may have
        stopped half way)."""
        for runner in self._live_runners():
            runner.idle()  # a runner parked in the cache holds no more than its cache
        if self.prefix_cache is not None and self.resumable:
            self.prefix_cache.put(
                self.committed.tolist(), self.target, self.pair_draft, self.target_runner, self.draft_runner
            )
        self.resumable = False

    def _make_room(self) -> None:
        """A draft runner once the drafter expects to draft, and room in both for this step's tree."""
        if self.pair_draft is not None and self.draft_runner is None and self.drafter.may_draft():
            self.draft_runner = make_runner(
                self.pair_draft, self.committed.numel() + self.drafter.max_tree_size
            )
        for runner in self._live_runners():
            runner.reserve(self.committed.numel() + self.drafter.max_tree_size, most=self.capacity)

    def _verify(
        self, proposal: Draft, request: DraftRequest, root_slot: int
    ) -> tuple[torch.Tensor, Draft | None]:
        """The target's logits (size, V) for the proposal's tree and, when drafting ahead, the tree the
        draft grew on meanwhile (its first nodes the proposal's, numbered alike)."""
        tree = proposal.tree
        nodes = torch.arange(tree.size, device=self.prompt.device)
        draft = self.draft_runner
        if not self.draft_ahead or draft is None or not bool(tree.expanded[0]):
            return tree_forward(self.target_runner, tree, nodes, root_slot), None
        # The target's pass stays on this thread and the draft moves to a thread of its own, which ends
        # with the pass: llama.cpp computes on OpenMP, which stops spinning between graph nodes while it
        # counts more threads than cores, and it counted a lasting helper thread until the process
        # ended (later two-thread draft passes were 50% slower).
        verified = threading.Event()
        most = tree_leaf_limit(self.target, self.pair_draft)[0]
        ahead = _Beside(_draft_ahead_beside, self.drafter, proposal, request, draft, verified, most)
        try:
            logits = tree_forward(self.target_runner, tree, nodes, root_slot)  # (size, V)
        finally:
            verified.set()
            grown, seconds = ahead.result()  # the draft runner is the helper's until its last pass ends
        self.stats.ahead_seconds += seconds
        return logits, grown

    def _commit(self, tree: DraftTree, root_slot: int, path_nodes: torch.Tensor, carry: int | None) -> None:
        """The root and the accepted path stay in the target cache, and in the draft cache as far as the
        draft expanded them; the bonus token becomes the next root. `carry`: the bonus token, when `tree`
        is the one the draft grew on while verifying; if it has the token's node below the path, drafted
        on, that subtree stays in the draft cache too and becomes the next step's head start."""
        self.target_runner.keep(_with_prefix(root_slot, root_slot + path_nodes))
        if self.draft_runner is None:
            return
        draft_root = self.draft_runner.slot(root_slot)
        prefix = min(self.draft_runner.length, draft_root)
        below = path_nodes[:0]  # the carried subtree's root, if any
        if carry is not None:
            children = tree.children(int(path_nodes[-1]))
            below = children[(tree.tokens[children] == carry) & tree.expanded[children]]
        if not below.numel():
            seen = path_nodes[tree.expanded[path_nodes]]
            self.draft_runner.keep(_with_prefix(prefix, draft_root + seen))
            return
        self.head_start, nodes = tree.subtree(int(below[0]))
        path = torch.cat([path_nodes, nodes[:1]])  # the root, the accepted path, the bonus token's node
        self.draft_runner.keep(_with_prefix(prefix, draft_root + path), subtree=draft_root + nodes[1:])

    def _count(self, tree, draft_calls: int, accepted: int) -> None:
        stats = self.stats
        draft = self.draft_runner
        stats.target_seconds = self.target_runner.forward_seconds
        stats.draft_seconds = draft.forward_seconds - stats.ahead_seconds if draft is not None else 0.0
        stats.cache_bytes = self.target_runner.nbytes + (draft.nbytes if draft is not None else 0)
        if self.policy is not None and self.policy.calibrated.measured:
            stats.target_pace = self.policy.pace.factor
        stats.target_calls += 1
        stats.draft_calls += draft_calls
        stats.tree_sizes.append(tree.size - 1)
        stats.tree_depths.append(int(tree.depths[: tree.size].max()))
        stats.accepted.append(accepted)

    def _live_runners(self) -> list[Runner]:
        return [r for r in (self.target_runner, self.draft_runner) if r is not None]


def _checked(settings: Settings, target, draft, tokenizer) -> tuple[Method, Budget]:
    """The method of `settings` and its budget resolved, once every setting is one it can run on these
    models."""
    try:
        chosen = method(settings.method)
        budget = chosen.resolve_budget(settings.budget)
    except (UnknownMethod, BudgetError) as err:
        raise GenerationError(str(err)) from None
    ngram = settings.ngram
    if chosen.drafts and draft is None:
        raise GenerationError(f"method {chosen.name!r} needs a draft model")
    if settings.max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {settings.max_new_tokens}")
    if not isinstance(ngram, int) or ngram < 0:
        raise GenerationError(f"ngram must be an integer >= 0, got {ngram!r}")
    if settings.lookahead_schedule not in ("constant", "heuristic"):
        raise GenerationError(
            f"lookahead_schedule must be 'constant' or 'heuristic', got {settings.lookahead_schedule!r}"
        )
    leaf_limit, limiter = tree_leaf_limit(target, draft)
    if isinstance(budget, Fixed) and chosen.tree and budget.size + 2 * ngram > leaf_limit:
        raise GenerationError(
            f"budget {budget.size} could make trees of more than the {leaf_limit} leaves {limiter} "
            f"verifies in one pass; use a budget of at most {leaf_limit - 2 * ngram}"
        )
    if ngram and "ngram" not in chosen.options:
        raise GenerationError(not_for(chosen.name, "ngram grafting", "ngram"))
    if settings.draft_ahead and "draft_ahead" not in chosen.options:
        raise GenerationError(not_for(chosen.name, "draft_ahead", "draft_ahead"))
    if settings.stop_strings and tokenizer is None:
        raise GenerationError("stop_strings need a tokenizer")
    try:
        SamplingParams(settings.temperature, settings.top_k, settings.top_p)
        ConfidenceStop(settings.confidence_threshold, settings.adapt_threshold)
    except ValueError as e:
        raise GenerationError(str(e)) from None
    return chosen, budget


def _check_window(prompt: torch.Tensor, max_new_tokens: int, target) -> None:
    window = as_model(target).context_window
    if window is not None and prompt.numel() + max_new_tokens > window:
        raise GenerationError(
            f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context window of {window} tokens"
        )


def _drafter(
    chosen: Method, budget: Budget, settings: Settings, target, draft, cost: CostModel | None, learnt
) -> tuple[Drafter, AutoBudget | ChainCostStop | None]:
    """The method's drafter and, under an auto budget, its cost policy (kept in `learnt` if given)."""
    confidence = ConfidenceStop(settings.confidence_threshold, settings.adapt_threshold)
    if isinstance(budget, Fixed):
        return chosen.make_drafter(budget.size, settings.draft_options, confidence, None), None
    cost = cost or cached_cost_model(target, draft)
    max_budget = min(AUTO_MAX_BUDGET, tree_leaf_limit(target, draft)[0] - 2 * settings.ngram)
    make = (
        (lambda: ChainCostStop(cost, DSL_MAX_LENGTH))
        if chosen.chain
        else (lambda: AutoBudget(cost, max_budget=max_budget))
    )
    if learnt is not None:
        sampling = (settings.temperature, settings.top_k, settings.top_p)
        policy = learnt.get(
            (id(target), id(draft)), (chosen.name, max_budget, *sampling, cost.fingerprint()), make
        )
    else:
        policy = make()
    if chosen.chain:
        policy.start()  # a chain cut short by the last generation's end is not this one's
    size = DSL_MAX_LENGTH if chosen.chain else max_budget
    return chosen.make_drafter(size, settings.draft_options, confidence, policy), policy


def tree_leaf_limit(*models) -> tuple[int, str]:
    """The most leaves a verified tree may have (the least any of `models` can verify in one forward),
    and the runtime that sets it."""
    limits = [(m.max_tree_leaves, m.runtime) for m in map(as_model, filter(None, models))]
    return min(((n, runtime) for n, runtime in limits if n is not None), default=(1 << 30, ""))


@torch.inference_mode()
def _draft_ahead_beside(
    drafter: Drafter,
    proposal: Draft,
    request: DraftRequest,
    runner: Runner,
    verified: threading.Event,
    most: int,
) -> tuple[Draft | None, float]:
    """`Drafter.draft_ahead` until `verified` is set, on one draft thread (inference mode is per thread);
    also the seconds it spent in draft forwards."""
    before = runner.forward_seconds
    runner.share_cpu(True)
    try:
        grown = drafter.draft_ahead(proposal, request, lambda: not verified.is_set(), most)
        return grown, runner.forward_seconds - before
    finally:
        runner.share_cpu(False)


class _Beside(threading.Thread):
    """`function(*args)` on a thread of its own; `result()` joins it and returns or raises its outcome."""

    def __init__(self, function: Callable, *args) -> None:
        super().__init__(name="specexec-draft-ahead", daemon=True)
        self.function, self.args = function, args
        self.outcome = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.outcome = self.function(*self.args)
        except BaseException as error:  # handed to the thread that waits for it
            self.error = error

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.outcome


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


def _as_token_tensor(input_ids: Sequence[int] | torch.Tensor, model: Model) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long).to(model.device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise GenerationError("input_ids must be a non-empty 1-D sequence of token ids")
    vocab = model.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise GenerationError(f"input_ids must be in [0, {vocab}), got ids up to {int(ids.max())}")
    return ids


def _eos_ids(model, eos_token_id: int | Sequence[int] | None, tokenizer) -> list[int]:
    if eos_token_id is None:
        return eos_token_ids(model, tokenizer)
    return sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))


def probe(model) -> None:
    """One one-token forward on a fresh runner of `model`, to check the model still answers."""
    model = as_model(model)
    make_runner(model, 1, trees=False).extend(torch.zeros(1, dtype=torch.long, device=model.device))
