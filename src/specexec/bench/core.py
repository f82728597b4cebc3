"""Run every configuration on the same prompts, interleaved, and keep one raw record per (prompt, config).

Timing protocol (same clock, `specexec.timing.clock`, for every method):

- Warm-up: each configuration generates `warmup_tokens` tokens on the first prompt first; not recorded.
- Interleaving: prompt i runs the configurations in the list rotated left by i, so no configuration always
  runs first (or right after a given other one).
- Seeds: prompt i uses seed `seed + i` in every configuration.
- `wall_seconds`: the whole call, from request to last token (prefill included).
- Quantization levels (`quant`): each level is its own loaded pair; ar runs once per level, and identity
  is judged against the ar of the same level (a quantized model is exact relative to itself).
- llamacpp: plain decoding of the target's GGUF by llama.cpp (`specexec.bench.llamacpp`); prefill is its
  eval of the prompt minus the last token, decode is everything after, as for the engine.
- specexec's own methods (ar, sd, specinfer, specexec): prefill and decode times come from the engine's
  `Stats` (prefill = target and draft forwards over the prompt; decode = everything after).
- Hugging Face methods (hf-assisted, hf-lookup): target and draft forwards are counted and timed by
  forward hooks. `generate` folds the prompt into its first target forward (prompt + first candidates),
  so the target's prefill cannot be timed inside it: it is estimated as a separate forward of the target
  over the same prompt, timed just before the call, capped at the first target forward's own time. The
  assistant's first forward is the draft's prefill alone (prompt only), so hf-assisted's draft prefill is
  that forward's measured time. prefill_seconds = target estimate + draft prefill; decode_seconds =
  wall_seconds - prefill_seconds; target/draft seconds are the hooked times minus their prefill parts.
  Every target forward counts as a verification call (the first one also processes the prompt).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specexec.backends import as_model
from specexec.backends.options import QUANT_MODES
from specexec.bench.errors import BenchError
from specexec.bench.hf import run_hf
from specexec.bench.llamacpp import PLAIN, SPECULATIVE
from specexec.bench.methods import (
    AUTO_METHODS,
    BENCH_METHODS,
    BUDGET_METHODS,
    DRAFT_METHODS,
    ENGINE_DRAFT_METHODS,
    EXTERNAL_METHODS,
    HF_METHODS,
)
from specexec.engine import generate
from specexec.learnt import LearntPolicies
from specexec.models import eos_token_ids
from specexec.prompts import Prompt
from specexec.sampling import SamplingParams
from specexec.storage import read_bytes
from specexec.timing import clock

DEFAULT_BUDGETS = (16, 64, 256, 1024, "auto")
DEFAULT_DSL_BUDGETS = ("auto",)
DEFAULT_SD_BUDGETS = (2, 4, 8)
DEFAULT_LLAMACPP_SPEC_BUDGETS = (3, 8)
DEFAULT_EXPAND = 32
DEFAULT_WIDTH = 8
DEFAULT_BRANCHES = 4


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: a method and, for the methods that take them, its budget and tree shape."""

    method: str
    budget: int | str | None = None  # "auto": sized from the calibrated cost model (specexec, dsl)
    expand: int | None = None  # specexec only
    width: int | None = None  # specexec only
    branches: int | None = None  # specinfer only
    quant: str = "none"  # which loaded pair runs it
    ngram: int | None = None  # specexec only: prompt-lookup tokens grafted per chain (0 = off)
    draft_vocab: int = 0  # methods with a draft: the token ids it scores (`--draft-vocab`; 0 = all)
    draft_ahead: bool | None = None  # specexec only: `Settings.draft_ahead` (default False)

    def __post_init__(self) -> None:
        if self.method not in BENCH_METHODS:
            raise BenchError(f"unknown method {self.method!r}; choose from {', '.join(BENCH_METHODS)}")
        if self.quant not in QUANT_MODES:
            raise BenchError(f"unknown quantization {self.quant!r}; choose from {', '.join(QUANT_MODES)}")
        if self.method in EXTERNAL_METHODS and self.quant != "none":
            raise BenchError(f"method {self.method!r} runs its own GGUF weights; it takes no quantization")
        if self.draft_vocab and self.method not in ENGINE_DRAFT_METHODS:
            raise BenchError(f"method {self.method!r} takes no --draft-vocab")
        if self.draft_vocab < 0:
            raise BenchError(f"draft_vocab must be >= 0, got {self.draft_vocab}")
        if self.draft_ahead is not None and self.method != "specexec":
            raise BenchError(f"method {self.method!r} takes no draft_ahead")
        if self.method == "specexec" and self.draft_ahead is None:
            object.__setattr__(self, "draft_ahead", False)
        if self.budget == "auto" and self.method not in AUTO_METHODS:
            raise BenchError(f"budget 'auto' is for specexec and dsl only, not {self.method!r}")
        if (
            self.method in BUDGET_METHODS
            and self.budget != "auto"
            and (self.budget is None or self.budget < 1)
        ):
            raise BenchError(f"method {self.method!r} needs a budget >= 1, got {self.budget}")
        if self.method not in BUDGET_METHODS and self.budget not in (None, "auto"):
            raise BenchError(f"method {self.method!r} takes no budget")
        # Tree shape: the defaults where it applies, nothing where it does not.
        shape = {
            "expand": DEFAULT_EXPAND if self.method == "specexec" else None,
            "width": DEFAULT_WIDTH if self.method == "specexec" else None,
            "branches": DEFAULT_BRANCHES if self.method == "specinfer" else None,
            "ngram": 0 if self.method == "specexec" else None,
        }
        for name, default in shape.items():
            value = getattr(self, name)
            if default is None and value is not None:
                raise BenchError(f"method {self.method!r} takes no {name}")
            if default is not None and value is None:
                object.__setattr__(self, name, default)
            elif value is not None and value < (0 if name == "ngram" else 1):
                raise BenchError(f"{name} must be >= {0 if name == 'ngram' else 1}, got {value}")

    @property
    def label(self) -> str:
        label = self.method if self.budget is None else f"{self.method}@{self.budget}"
        label += f"+ngram{self.ngram}" if self.ngram else ""
        label += "+ahead" if self.draft_ahead else ""
        label += f"/dv{self.draft_vocab}" if self.draft_vocab else ""
        return label + (f"/{self.quant}" if self.quant != "none" else "")

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "method": self.method,
            "budget": self.budget,
            "expand": self.expand,
            "width": self.width,
            "branches": self.branches,
            "quant": self.quant,
            "ngram": self.ngram,
            "draft_vocab": self.draft_vocab,
            "draft_ahead": self.draft_ahead,
        }


def parse_methods(text: str) -> list[str]:
    """A comma-separated method list, in the given order, duplicates dropped."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise BenchError(f"empty method list {text!r}; choose from {', '.join(BENCH_METHODS)}")
    unknown = [name for name in names if name not in BENCH_METHODS]
    if unknown:
        raise BenchError(f"unknown method {unknown[0]!r}; choose from {', '.join(BENCH_METHODS)}")
    return list(dict.fromkeys(names))


def parse_budgets(text: str, option: str = "--budgets") -> list[int | str]:
    """A comma-separated list of positive integers (and "auto"), duplicates dropped, sorted."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise BenchError(f"{option}: empty budget list")
    budgets = []
    for part in parts:
        if part == "auto":
            continue
        try:
            value = int(part)
        except ValueError:
            raise BenchError(
                f"{option}: {part!r} is not an integer or 'auto' (expected e.g. 16,64,auto)"
            ) from None
        if value < 1:
            raise BenchError(f"{option}: budgets must be >= 1, got {value}")
        budgets.append(value)
    return sorted(set(budgets)) + (["auto"] if "auto" in parts else [])


def make_configs(
    methods: Sequence[str],
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    *,
    sd_budgets: Sequence[int] = DEFAULT_SD_BUDGETS,
    specinfer_budgets: Sequence[int] | None = None,
    expand: int = DEFAULT_EXPAND,
    width: int = DEFAULT_WIDTH,
    branches: int = DEFAULT_BRANCHES,
    quants: Sequence[str] = ("none",),
    ngrams: Sequence[int] = (0,),
    dsl_budgets: Sequence[int | str] = DEFAULT_DSL_BUDGETS,
    llamacpp_spec_budgets: Sequence[int] = DEFAULT_LLAMACPP_SPEC_BUDGETS,
    draft_vocabs: Sequence[int] = (0,),
    draft_aheads: Sequence[bool] = (False,),
) -> list[BenchConfig]:
    """Expand quantization levels x methods x budgets into configurations; `ar` (the reference) is always
    included, first in each level. The engine's drafted methods run once per `draft_vocabs` entry (the
    draft's `--draft-vocab`; 0 = its whole vocabulary), at the first level only when there are several.

    sd runs once per `sd_budgets` entry (its draft length), dsl once per `dsl_budgets` entry ("auto" or
    the longest confidence-stopped chain), specinfer once per `specinfer_budgets` entry (default:
    `budgets` without "auto"), specexec once per `budgets` x `ngrams` x `draft_aheads` entry
    (`Settings.draft_ahead`); ar and the HF methods run
    once per level; llamacpp runs once and llamacpp-spec once per `llamacpp_spec_budgets` entry (their
    own weights).
    """
    if not quants or not ngrams or not draft_vocabs:
        raise BenchError("at least one quantization level, ngram setting and draft vocabulary are needed")
    if len(set(quants)) > 1 and len(set(draft_vocabs)) > 1:
        raise BenchError("compare draft vocabularies at one quantization level at a time")
    configs = []
    for quant in dict.fromkeys(quants):
        budget_lists = (budgets, sd_budgets, dsl_budgets, specinfer_budgets, llamacpp_spec_budgets)
        level = _level_configs(methods, *budget_lists, expand, width, branches, quant, ngrams, draft_aheads)
        for config in level:
            if config.method not in ENGINE_DRAFT_METHODS:
                configs.append(config)
                continue
            configs += [dataclasses.replace(config, draft_vocab=n) for n in dict.fromkeys(draft_vocabs)]
    return list(dict.fromkeys(configs))  # llamacpp, the same at every level, once


def _level_configs(
    methods,
    budgets,
    sd_budgets,
    dsl_budgets,
    specinfer_budgets,
    llamacpp_spec_budgets,
    expand,
    width,
    branches,
    quant,
    ngrams,
    draft_aheads,
) -> list[BenchConfig]:
    methods = list(dict.fromkeys(["ar", *methods]))
    per_method = {
        "sd": sd_budgets,
        "dsl": dsl_budgets,
        "specinfer": [b for b in budgets if b != "auto"] if specinfer_budgets is None else specinfer_budgets,
        "specexec": budgets,
        SPECULATIVE: llamacpp_spec_budgets,
    }
    configs = []
    for method in methods:
        if method not in BENCH_METHODS:
            raise BenchError(f"unknown method {method!r}; choose from {', '.join(BENCH_METHODS)}")
        if method not in BUDGET_METHODS:
            configs.append(BenchConfig(method, quant="none" if method in EXTERNAL_METHODS else quant))
            continue
        if not per_method[method]:
            raise BenchError(f"method {method!r} needs at least one budget")
        for budget in per_method[method]:
            if method == "specexec":
                for n, ahead in itertools.product(dict.fromkeys(ngrams), dict.fromkeys(draft_aheads)):
                    configs.append(
                        BenchConfig(method, budget, expand, width, quant=quant, ngram=n, draft_ahead=ahead)
                    )
            elif method == "specinfer":
                configs.append(BenchConfig(method, budget, branches=branches, quant=quant))
            elif method in EXTERNAL_METHODS:
                configs.append(BenchConfig(method, budget))
            else:
                configs.append(BenchConfig(method, budget, quant=quant))
    return configs


@dataclass
class BenchResult:
    records: list[dict]  # one per (prompt, configuration), warm-up excluded
    rows: list[dict]  # one per configuration, from `summarize(records)`
    configs: list[BenchConfig] = field(default_factory=list)


def run_benchmark(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase | None,
    prompts: Sequence[Prompt],
    configs: Sequence[BenchConfig],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    warmup_tokens: int = 16,
    repeats: int = 1,
    eos_token_id: Sequence[int] | None = None,
    progress: bool = True,
    records_path: str | os.PathLike | None = None,
    quantized: Mapping[str, tuple[PreTrainedModel, PreTrainedModel | None]] | None = None,
    drafts: Mapping[int, PreTrainedModel] | None = None,
    llamacpp=None,
    llamacpp_spec=None,
    network: Callable[[], tuple[int, int]] | None = None,
) -> BenchResult:
    """Run every configuration on every prompt (interleaved, after a warm-up) and summarize.

    `target`/`draft` run the configurations of their own quantization level; `quantized` maps the other
    levels to their pairs. A configuration whose `draft_vocab` N is in `drafts` runs `drafts[N]` instead of
    its pair's draft (the pairs' drafts serve the one other value). `llamacpp` is a
    `specexec.bench.llamacpp.LlamaCpp` and `llamacpp_spec` a `specexec.bench.llamacpp.LlamaCppSpeculative`,
    for the llamacpp and llamacpp-spec methods. `network()`, where the target's layers are on other
    machines, gives the bytes sent to and received from them so far (each record gets its run's).
    `eos_token_id` defaults to `eos_token_ids(target, tokenizer)`; the same ids go to every method.
    `warmup_tokens` = 0 skips the warm-up. `repeats` > 1 runs every (prompt, configuration) pair that many
    times with the same seed, so the same tokens, timed again: repeat r goes through the prompts again
    with each prompt's configuration order reversed on odd r, so a drift in machine speed during the run
    weighs on every configuration alike. With `records_path`, each record is also appended to that JSONL
    file as soon as it is measured, so an interrupted run keeps what it measured.
    """
    from specexec.bench.report import summarize

    configs = list(configs)
    prompts = list(prompts)
    pairs = {as_model(target).quantization: (target, draft), **(quantized or {})}
    drafts = dict(drafts or {})
    external = {PLAIN: llamacpp, SPECULATIVE: llamacpp_spec}
    _check(
        pairs, drafts, external, prompts, configs, max_new_tokens, temperature, top_p, top_k, warmup_tokens,
        repeats,
    )  # fmt: skip
    eos = list(eos_token_ids(target, tokenizer) if eos_token_id is None else eos_token_id)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    run = _ConfigRunner(pairs, drafts, external, eos, sampling, network=network)
    from tqdm.auto import tqdm

    if warmup_tokens > 0:
        for config in tqdm(configs, desc="warm-up", unit="config", file=sys.stderr, disable=not progress):
            run(config, prompts[0], min(warmup_tokens, max_new_tokens), seed)
    records = _timed_runs(run, prompts, configs, max_new_tokens, seed, repeats, progress, records_path)
    records.sort(key=lambda r: (r["prompt_index"], r["repeat"], configs.index(_config_of(r))))
    return BenchResult(records, summarize(records), configs)


@dataclass
class _ConfigRunner:
    """Runs one configuration on one prompt: on its level's pair (with the draft of its vocabulary, where
    one was loaded for it), or on the llama.cpp runner its method names."""

    pairs: Mapping[str, tuple[PreTrainedModel, PreTrainedModel | None]]
    drafts: Mapping[int, PreTrainedModel]
    external: Mapping[str, Any]  # the llama.cpp peers' runners, by method
    eos: list[int]
    sampling: dict
    # As in a server: the auto budgets of each configuration keep learning from one prompt to the next.
    learnt: LearntPolicies = field(default_factory=LearntPolicies)
    network: Callable[[], tuple[int, int]] | None = None  # bytes sent to and received from RPC workers

    def __call__(self, config: BenchConfig, prompt: Prompt, tokens: int, seed: int) -> dict:
        """The run's record, with the bytes it read from storage (a target streamed with --ram) and, over
        RPC, the bytes it sent to the workers and received from them."""
        before = read_bytes()
        exchanged = self.network() if self.network else None
        record = self._run(config, prompt, tokens, seed)
        record["storage_read_bytes"] = read_bytes() - before
        if exchanged is not None:
            sent, received = self.network()
            record["network_sent_bytes"] = sent - exchanged[0]
            record["network_received_bytes"] = received - exchanged[1]
        return record

    def _run(self, config: BenchConfig, prompt: Prompt, tokens: int, seed: int) -> dict:
        if config.method == PLAIN:
            return self.external[PLAIN].run(prompt.input_ids, tokens, seed, self.eos, **self.sampling)
        if config.method == SPECULATIVE:
            return self.external[SPECULATIVE].run(
                prompt.input_ids, tokens, seed, self.eos, draft_length=config.budget, **self.sampling
            )
        target, draft = self.pairs[config.quant]
        draft = self.drafts.get(config.draft_vocab, draft)
        if config.method in HF_METHODS:
            return run_hf(
                target, draft, config.method, prompt.input_ids, tokens, seed, self.eos, **self.sampling
            )
        return _run_engine(
            target, draft, config, prompt.input_ids, tokens, seed, self.eos, self.learnt, **self.sampling
        )


def _timed_runs(
    run: _ConfigRunner,
    prompts: list[Prompt],
    configs: list[BenchConfig],
    max_new_tokens: int,
    seed: int,
    repeats: int,
    progress: bool,
    records_path: str | os.PathLike | None,
) -> list[dict]:
    """One record per (repeat, prompt, configuration), in the interleaved order `run_benchmark` describes;
    each also appended to `records_path` as soon as it is measured."""
    from tqdm.auto import tqdm

    records = []
    total = repeats * len(prompts) * len(configs)
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not progress)
    with ExitStack() as stack:
        stack.enter_context(bar)
        sink = stack.enter_context(open(records_path, "w", encoding="utf-8")) if records_path else None
        for repeat, (index, prompt) in product(range(repeats), enumerate(prompts)):
            shift = index % len(configs)
            ordered = configs[shift:] + configs[:shift]
            for order, config in enumerate(ordered[::-1] if repeat % 2 else ordered):
                bar.set_postfix_str(f"{prompt.id} {config.label}", refresh=False)
                measured = run(config, prompt, max_new_tokens, seed + index)
                records.append(
                    {
                        **config.as_dict(),
                        **run.sampling,
                        "max_new_tokens": max_new_tokens,
                        "prompt_index": index,
                        "prompt_id": prompt.id,
                        "seed": seed + index,
                        "repeat": repeat,
                        "order": order,
                        **measured,
                    }
                )
                if sink is not None:
                    sink.write(json.dumps(records[-1]) + "\n")
                    sink.flush()
                bar.update()
    return records


def _config_of(record: dict) -> BenchConfig:
    keys = ("method", "budget", "expand", "width", "branches", "quant", "ngram", "draft_vocab")
    return BenchConfig(**{k: record[k] for k in keys}, draft_ahead=record.get("draft_ahead"))


def _check(
    pairs, drafts, external, prompts, configs, max_new_tokens, temperature, top_p, top_k, warmup_tokens,
    repeats,
) -> None:  # fmt: skip
    if not prompts:
        raise BenchError("no prompts to run")
    if not configs:
        raise BenchError("no configurations to run")
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        duplicate = next(label for label in labels if labels.count(label) > 1)
        raise BenchError(f"more than one configuration is labelled {duplicate!r}; labels must be distinct")
    if max_new_tokens < 1:
        raise BenchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if warmup_tokens < 0:
        raise BenchError(f"warmup_tokens must be >= 0, got {warmup_tokens}")
    if repeats < 1:
        raise BenchError(f"repeats must be >= 1, got {repeats}")
    try:
        SamplingParams(temperature, top_k, top_p)
    except ValueError as e:
        raise BenchError(str(e)) from None
    levels = {c.quant for c in configs if c.method not in EXTERNAL_METHODS}
    missing = next(iter(sorted(levels - set(pairs))), None)
    if missing:
        raise BenchError(f"no {missing} model pair was loaded; loaded: {', '.join(pairs)}")
    for method, runner in external.items():
        if runner is None and any(c.method == method for c in configs):
            raise BenchError(f"method {method!r} needs its llama.cpp runner (specexec.bench.llamacpp)")
    hf = sorted({c.method for c in configs if c.method in HF_METHODS})
    not_hf = [
        m for pair in pairs.values() for m in pair if m is not None and not isinstance(m, PreTrainedModel)
    ]
    if hf and not_hf:
        raise BenchError(f"{hf[0]} runs Hugging Face models; load the pair with --backend torch")
    for quant, (_, draft) in pairs.items():
        on_pair = [c for c in configs if c.quant == quant and c.draft_vocab not in drafts]
        needs_draft = sorted({c.method for c in on_pair if c.method in DRAFT_METHODS})
        if draft is None and needs_draft:
            raise BenchError(f"method(s) {', '.join(needs_draft)} need a draft model")
    on_pairs = sorted({c.draft_vocab for c in configs if c.method in DRAFT_METHODS} - set(drafts))
    if len(on_pairs) > 1:
        raise BenchError(f"no draft with --draft-vocab {on_pairs[-1]} was loaded")
    main_level = as_model(next(iter(pairs.values()))[0]).quantization
    if any(c.draft_vocab in drafts and c.quant != main_level for c in configs):
        raise BenchError(f"drafts of other vocabularies run at the {main_level} level only")
    target = next(iter(pairs.values()))[0]
    empty = [p.id for p in prompts if not p.input_ids]
    if empty:
        raise BenchError(f"prompt {empty[0]} has no tokens")
    window = as_model(target).context_window
    longest = max(prompts, key=lambda p: len(p.input_ids))
    if window is not None and len(longest.input_ids) + max_new_tokens > window:
        raise BenchError(
            f"prompt {longest.id} ({len(longest.input_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
            f"exceeds the target's context window of {window} tokens"
        )


def _run_engine(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    config: BenchConfig,
    input_ids: list[int],
    max_new_tokens: int,
    seed: int,
    eos: list[int],
    learnt: LearntPolicies,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
) -> dict:
    shape = {}
    if config.method == "specexec":
        shape = {
            "expand": config.expand, "width": config.width, "ngram": config.ngram,
            "draft_ahead": config.draft_ahead,
        }  # fmt: skip
    elif config.method == "specinfer":
        shape = {"branches": config.branches}
    start = clock(target.device)
    out = generate(
        target,
        None if config.method == "ar" else draft,
        input_ids,
        method=config.method,
        budget=config.budget,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        eos_token_id=eos,
        learnt=learnt,
        **shape,
    )
    wall = clock(target.device) - start
    stats = out.stats
    return {
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "tokens": out.tokens,
        "finish_reason": out.finish_reason,
        "target_calls": stats.target_calls,
        "draft_calls": stats.draft_calls,
        "prefill_seconds": stats.prefill_seconds,
        "decode_seconds": stats.decode_seconds,
        "wall_seconds": wall,
        "draft_seconds": stats.draft_seconds,
        "target_seconds": stats.target_seconds,
        "ahead_calls": stats.ahead_calls,
        "ahead_seconds": stats.ahead_seconds,
        "carried": stats.carried,
        "tree_sizes": list(stats.tree_sizes),
        "tree_depths": list(stats.tree_depths),
        "accepted": list(stats.accepted),
        "target_pace": stats.target_pace,
        "prefill_timing": "engine",
        "hf_settings": None,
    }
